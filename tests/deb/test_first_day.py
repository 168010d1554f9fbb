"""An admin's first day (issue 37): the packages installed into a clean
Debian 12 root, then the README's and the man pages' instructions followed
as they are written, extracted from the documents themselves (the README's
code blocks, the installed man pages' EXAMPLES), each checked.

The root runs in a network namespace of its own with only loopback
(debroot.LiveRoot), so the documents' donors on 127.0.0.x meet nothing else
on the machine. Where one document's daemons would stand in the next one's
way, the test stops them by their pid files between documents. Blocks that
cannot run on one machine (addresses of a real lab, a foreground nbdkit)
are parsed, not run: every command in them must parse, as every option an
installed man page names must exist in its command's --help.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from debroot import LiveRoot, base_root
from netpager_testkit import Teardown, wait_for
from netpager_testkit.paths import repo_root

WORK = "/root/first-day"
# roff escapes pandoc writes in code blocks.
ROFF = {"aq": "'", "dq": '"', "ga": "`", "ti": "~", "ha": "^", "at": "@", "rs": "\\", "lq": '"',
        "rq": '"', "lB": "[", "rB": "]", "dollar": "$", "em": "--", "en": "-", "hy": "-"}


def md_blocks(text: str, heading: str) -> list[str]:
    """The fenced code blocks under the Markdown heading `heading`, up to
    the next heading of its level or above (a `#` line inside a code block
    is a shell comment, not a heading)."""
    level = len(heading.split(" ")[0])
    blocks, inside, fence = [], False, None
    for line in text.splitlines():
        if fence is not None:
            if line.startswith("```"):
                if inside:
                    blocks.append("\n".join(fence) + "\n")
                fence = None
            else:
                fence.append(line)
        elif line.startswith("```"):
            fence = []
        elif line.startswith("#"):
            if line == heading:
                inside = True
            elif inside and len(line) - len(line.lstrip("#")) <= level:
                break
    return blocks


def unroff(line: str) -> str:
    line = re.sub(r"\\f\[[A-Z]*\]|\\f[A-Z]", "", line)
    line = re.sub(r"\\\[([A-Za-z]+)\]", lambda m: ROFF.get(m.group(1), m.group(0)), line)
    line = line.replace("\\-", "-").replace("\\&", "").replace("\\e", "\\").replace("\\\\", "\\")
    return line


def man_examples(roff: str) -> list[str]:
    """The code blocks (.nf ... .fi) of an installed page's EXAMPLES, as its
    reader sees them."""
    m = re.search(r'^\.SH "?EXAMPLES"?\n(.*?)(?=^\.SH )', roff, re.S | re.M)
    assert m, "no EXAMPLES section"
    blocks = re.findall(r"^\.nf\n(.*?)^\.fi$", m.group(1), re.S | re.M)
    return ["\n".join(unroff(l) for l in b.splitlines() if unroff(l).strip() != "") + "\n" for b in blocks]


def commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and
    loop keywords dropped, the command substitution's inside taken."""
    out, cur = [], ""
    for line in block.splitlines():
        line = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        cmd = cur.strip()
        cur = ""
        for part in re.split(r"\s*(?:&&|;|\|)\s*", cmd):
            part = re.sub(r"^(?:for \w+ in .*|while .*|done|do|\w+=\$\()\s*", "", part.strip()).rstrip(")&").strip()
            if part and not part.startswith(("#", "...")):
                out.append(part)
    return out


def runnable(block: str) -> bool:
    """Whether a block can run on one machine: loopback addresses only, and
    no daemon kept in the foreground."""
    addrs = re.findall(r"\b(\d+\.\d+\.\d+\.\d+)\b", block)
    return (all(a.startswith("127.") for a in addrs) and not re.search(r"\bnbdkit\b[^\n]* -f\b", block)
            and not re.search(r"\bd\d:\d", block) and "..." not in block)


class Day:
    """The installed root and what the test learned of its commands' help."""

    def __init__(self, root: LiveRoot):
        self.root = root
        self.helps: dict[str, str] = {}

    def sh(self, script: str, env: dict | None = None) -> str:
        """Runs a block as written (set -e: every command must work)."""
        return self.root.check(f"cd {WORK} && set -e\n{script}", env)

    def help_of(self, program: str) -> str:
        """The --help of `program` and, for a command with subcommands,
        of each (nested, hidden ones too), in the root."""
        if program in self.helps:
            return self.helps[program]
        p = self.root.run(f"{program} --help")
        text = p.stdout + p.stderr
        if program == "nbdkit":
            text += self.root.run("nbdkit pager-server --help").stdout
        subs = re.findall(r"^  ([a-z][a-z-]+)  ", text.split("Commands:")[1], re.M) if "Commands:" in text else []
        if program == "pagerctl":
            subs += ["hold", "hold-nbd"]
        for sub in subs:
            if sub != "help":
                text += self.help_of(f"{program} {sub}")
        self.helps[program] = text
        return text

    def parses(self, cmd: str) -> None:
        """A command of our programs parses: its options and values are
        accepted (clap's, up to --help), nbdkit's options and pager-server's
        parameters exist."""
        words = cmd.split()
        prog = words[0]
        if prog in ("pagerctl", "prefetchd", "pager-hints", "prefetch-job"):
            p = self.root.run(f"i=2; {cmd} --help")
            assert p.returncode == 0 and "Usage:" in p.stdout, f"does not parse: {cmd}\n{p.stderr}"
        elif prog in ("netpager-token", "netpager-drain"):
            for w in words[1:]:
                if w.startswith("--"):
                    assert w.split("=")[0] in self.help_of(prog), f"{cmd}: {w} is not in {prog} --help"
        elif prog == "nbdkit":
            helps = self.help_of("nbdkit")
            plugin = words.index("pager-server") if "pager-server" in words else len(words)
            for w in words[1:plugin]:
                if w.startswith("-") and not w.startswith("-i") and len(w) > 2:
                    assert w.split("=")[0] in helps, f"{cmd}: nbdkit has no {w}"
            for w in words[plugin + 1:]:
                if "=" in w:
                    assert f"\n{w.split('=')[0]}=" in helps, f"{cmd}: pager-server has no {w.split('=')[0]}="

    def follow(self, name: str, blocks: list[str], env: dict | None = None) -> list[str]:
        """Parses every command of `blocks`, runs the runnable ones; their
        output."""
        out = []
        for b in blocks:
            for c in commands(b):
                if c.split()[0] in ("pagerctl", "nbdkit", "netpager-token", "netpager-drain", "prefetchd",
                                    "pager-hints", "prefetch-job"):
                    self.parses(c)
            if runnable(b):
                out.append(self.sh(b, env))
        assert out, f"{name}: no block could run"
        return out

    def listening(self, port: int) -> bool:
        """Whether anything in the root's network namespace listens on `port`."""
        rows = [l.split() for l in self.root.check("cat /proc/net/tcp").splitlines()[1:]]
        return any(r[1].endswith(f":{port:04X}") and r[3] == "0A" for r in rows)

    def stop_donors(self) -> None:
        """Stops the donors a document left, by their pid files."""
        self.root.check("for p in /run/netpager-donor*.pid /tmp/np-donor*.pid /tmp/donor*.pid; do "
                        "if [ -e \"$p\" ]; then kill \"$(cat \"$p\")\" || true; rm -f \"$p\"; fi; done")
        wait_for(lambda: not self.listening(10809), 30, "the donors to stop listening")

    def man_options_exist(self, page: str, programs: list[str]) -> None:
        """Every option the installed page names is in --help of one of the
        programs it documents."""
        text = self.root.check(f"MANWIDTH=1000 man {page}")
        assert not re.search("[\u2010-\u2015\u2018-\u201f\u2212]", text), f"{page}: typographic characters"
        helps = "".join(self.help_of(p) for p in programs)
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", text))
        missing = sorted(o for o in named if not re.search(rf"(?<![\w-]){o}(?![\w-])", helps))
        assert missing == [], f"man {page} names options no --help has: {missing}"


def test_first_day_from_the_documents(debs):
    readme = (repo_root() / "README.md").read_text()
    td = Teardown("first day")
    try:
        root = LiveRoot(td, base_root(debs))
        day = Day(root)
        # fio is not in the root: pagerctl(1)'s one fio option is checked here.
        fio = subprocess.run(["fio", "--cmdhelp=ioengine"], capture_output=True, text=True)
        assert fio.returncode == 0, fio.stderr
        day.helps["fio"] = "--ioengine"
        work = root.dir / WORK.lstrip("/")
        (work / "dist").mkdir(parents=True)
        for deb in debs.values():
            shutil.copy(deb, work / "dist")

        # README, "Installing from packages": apt, then the lab key.
        install, keys = md_blocks(readme, "### Installing from packages")
        day.sh("\n".join(l for l in install.splitlines() if not l.startswith("make ")))
        assert "install ok installed" in root.check("dpkg-query -W -f '${Status}\\n' netpager-donor")
        day.sh(keys)
        psk = root.dir / "etc/netpager/netpager.psk"
        assert oct(psk.stat().st_mode & 0o777) == "0o600"
        lines = psk.read_text().splitlines()
        assert [l.split(":")[0] for l in lines] == ["netpager", "busy1", "busy2", "busy3"], lines
        assert len({l.split(":")[1] for l in lines}) == 1, "one key on every line"

        # Every installed man page: no option its commands lack.
        for page, programs in {
            "pagerctl": ["pagerctl", "nbdkit", "losetup", "swapon", "mkswap", "setsid", "nbdinfo", "fio"],
            "pager-server": ["nbdkit", "pagerctl", "nbdinfo", "netpager-token", "netpager-drain"],
            "pager-client-plugin": ["nbdkit", "pagerctl"],
            "8 prefetchd": ["prefetchd", "pager-hints", "prefetch-job", "nbdkit"],
            "netpager-token": ["netpager-token"], "netpager-drain": ["netpager-drain"],
            "pager-hints": ["pager-hints"], "prefetch-job": ["prefetch-job"],
        }.items():
            day.man_options_exist(page, programs)

        # README, "Server (donor)": a donor, then a donor's export as swap by hand.
        server = md_blocks(readme, "### Server (donor)")
        assert len(server) == 2, server
        day.sh(server[0])
        assert "donor1" in root.check("pagerctl donor-status 127.0.0.2:10810")
        day.sh(server[1])
        assert "/tmp/netpager-mnt" not in root.check("cat /proc/self/mounts")
        # Its pages went back to the donor: nothing is left unclaimed.
        assert "UNCLAIMED" not in root.check("pagerctl donor-status 127.0.0.2:10810")

        # README, "Client": the whole block, as written.
        (client,) = md_blocks(readme, "### Client")[:1]
        out = day.sh(client)
        assert re.search(r"^/dev/loop\d+$", out, re.M), out
        assert "holds nothing of ours and left the set" in out and "released" in out, out
        assert root.run("pagerctl status --state-dir /var/lib/netpager/swap0").returncode == 3
        for i in (3, 4, 5):
            exports = root.check(f"pagerctl donor-status 127.0.0.{i}:10810")
            assert "UNCLAIMED" not in exports, exports
        day.stop_donors()

        # The installed man pages' EXAMPLES: parsed, and run where they can.
        for page in ("man1/pagerctl.1.gz", "man1/pager-server.1.gz"):
            roff = root.check(f"zcat /usr/share/man/{page}")
            blocks = man_examples(roff)
            src = (repo_root() / ("pagerctl/pagerctl.1.md" if "pagerctl" in page else
                                  "pager-server/pager-server.1.md")).read_text()
            for b in blocks:
                # What the reader copies is what the page's source says.
                assert all(l.strip() in src for l in b.splitlines()), f"{page}: changed in rendering:\n{b}"
            day.follow(page, blocks)
            day.stop_donors()

        # The packaged units, run as systemd would, with the packaged
        # configuration; edited only where the admin must (the donors'
        # addresses, this client's line in the lab key).
        root.check("pagerctl psk add /etc/netpager/netpager.psk \"$(hostname)\"")
        hosts = root.dir / "etc/hosts"
        known = hosts.read_text() if hosts.exists() else "127.0.0.1 localhost\n"
        hosts.write_text(known + "127.0.0.2 donor1\n127.0.0.3 donor2\n127.0.0.4 donor3\n")
        unit = (root.dir / "usr/lib/systemd/system/netpager-client.service").read_text()
        attach = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
        client_unit = (f"PAGERCTL_WAIT_DONORS=$(sed -n 's/^Environment=PAGERCTL_WAIT_DONORS=//p' "
                       f"/usr/lib/systemd/system/netpager-client.service); . /etc/netpager/client.conf; {attach}")
        # At boot, before any donor: attach waits, then fails naming each.
        p = root.run(client_unit.replace("--wait-donors ${PAGERCTL_WAIT_DONORS}", "--wait-donors 2"))
        assert p.returncode == 1, p.stdout + p.stderr
        assert "donor donor1:10809: nothing listens at donor1:10809" in p.stderr, p.stderr
        assert "swap is not turned on" in p.stderr, p.stderr
        assert not (root.dir / "var/lib/netpager/client/attach.json").exists()
        # The donors come up while attach waits.
        waiting = subprocess.Popen(["nsenter", f"--net=/run/netns/{root.netns}", "chroot", str(root.dir),
                                    "sh", "-c", client_unit], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
        td.add("the client unit's attach", lambda: waiting.poll() is None and waiting.kill())
        donor_unit = (root.dir / "usr/lib/systemd/system/netpager-donor.service").read_text()
        start = re.search(r"^ExecStart=(.*?[^\\])$", donor_unit, re.M | re.S).group(1).replace("\\\n", " ")
        root.check("mkdir -p /run/credentials/netpager-donor.service && "
                   "cp /etc/netpager/netpager.psk /run/credentials/netpager-donor.service/")
        for i in (2, 3, 4):
            # Three donor machines, each with its own address.
            conf = f"/tmp/donor{i}.conf"
            root.check(f"sed 's/0\\.0\\.0\\.0/127.0.0.{i}/g' /etc/netpager/donor.conf > {conf}")
            line = (start.replace("%d", "/run/credentials/netpager-donor.service")
                    .replace("--foreground", f"--pidfile /run/netpager-donor{i}.pid"))
            root.check(f". {conf}; {line}")
        out, err = waiting.communicate(timeout=600)
        assert waiting.returncode == 0, err
        assert "waiting for donors (--wait-donors)" in err, err
        device = out.strip().splitlines()[-1]
        assert device in root.check("cat /proc/swaps"), "the unit's device is not swap"
        assert root.run("pagerctl status --state-dir /var/lib/netpager/client").returncode == 0

        # Removing the donor package: drained first; refused while the
        # client's pages stay on it, with how to force.
        p = root.run("apt-get remove -y netpager-donor", env={"NETPAGER_DRAIN_TIMEOUT": "3"})
        assert p.returncode != 0, p.stdout
        text = p.stdout + p.stderr
        assert "netpager-donor: not removed" in text and "NETPAGER_FORCE_REMOVE=1" in text, text
        assert "draining" not in root.check("pagerctl donor-status 127.0.0.2:10810 --psk /etc/netpager/netpager.psk"
                                            " | sed -n 's/^state *//p'")
        stop = re.search(r"^ExecStop=(.*)$", unit, re.M).group(1)
        root.check(stop)
        p = root.run("apt-get remove -y netpager-donor", env={"NETPAGER_DRAIN_TIMEOUT": "3"})
        assert p.returncode != 0 and "pagerctl release" in p.stdout + p.stderr, p.stdout + p.stderr
        root.check("pagerctl release --state-dir /var/lib/netpager/client")
        out = root.check("apt-get remove -y netpager-donor", env={"NETPAGER_DRAIN_TIMEOUT": "60"})
        assert out.count("holds nothing") == 3, out
    finally:
        errors = td.close()
    assert not errors, errors
