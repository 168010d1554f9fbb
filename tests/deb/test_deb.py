"""The Debian packages (issue 28), installed into a fresh Debian 12 root.

`scripts/deb.sh` builds netpager-donor, netpager-client and
netpager-prefetchd from the release build (lintian must pass). A Debian 12
root made by mmdebstrap with the packages' dependencies (cached in
/var/cache/netpager-test/, keyed by that list) is unpacked into a temporary
directory; inside it, with no network (`unshare --net`), apt installs the
packages, the commands run, an upgrade leaves an attached device alone,
and remove then purge leave the root exactly as it was.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from netpager_testkit import Teardown
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.paths import repo_root, target_dir

PACKAGES = ["netpager-donor", "netpager-client", "netpager-prefetchd"]
COMMANDS = {"netpager-donor": ["netpager-token"], "netpager-client": ["pagerctl"],
            "netpager-prefetchd": ["prefetchd", "prefetch-job", "pager-hints"]}
CACHE = Path("/var/cache/netpager-test")
# What the test itself uses inside the root, beyond the packages' dependencies.
TOOLS = ["man-db"]
# Paths the package manager itself changes (its database, logs, caches):
# not the packages' doing.
OWN_STATE = ("var/lib/dpkg/", "var/lib/apt/", "var/cache/apt/", "var/log/", "var/cache/debconf/",
             "var/cache/man/", "var/cache/ldconfig/", "etc/ld.so.cache", "tmp/debs")
TIMEOUT = 900


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, **kw)


def check(argv: list[str], **kw) -> str:
    p = run(argv, **kw)
    assert p.returncode == 0, f"{argv}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def debs():
    if os.geteuid() != 0:
        skip_or_fail("needs root (chroot)")
    for tool in ("mmdebstrap", "lintian", "pandoc", "help2man", "unshare"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} is not installed (scripts/deps.sh installs it)")
    if run(["cargo", "deb", "--version"]).returncode != 0:
        skip_or_fail("cargo-deb is not installed (scripts/deps.sh installs it)")
    if not (target_dir() / "pagerctl").exists():
        pytest.fail(f"not built in {target_dir()} (run `make build`)")
    out = Path(tempfile.mkdtemp(prefix="netpager-debs-"))
    try:
        check(["bash", str(repo_root() / "scripts" / "deb.sh"), str(out)])
        found = {p: sorted(out.glob(f"{p}_*.deb")) for p in PACKAGES}
        assert all(len(v) == 1 for v in found.values()), found
        yield {p: v[0] for p, v in found.items()}
    finally:
        shutil.rmtree(out)


def dependencies(debs: dict[str, Path]) -> list[str]:
    """The packages' Depends and Recommends, by name, without netpager's own."""
    names = set(TOOLS)
    for deb in debs.values():
        for field in ("Depends", "Recommends"):
            text = check(["dpkg-deb", "-f", str(deb), field])
            for alt in re.split(r"[,|]", text):
                name = alt.strip().split(" ")[0].split(":")[0]
                if name and name not in PACKAGES:
                    names.add(name)
    return sorted(names)


def base_root(debs: dict[str, Path]) -> Path:
    """The cached Debian 12 root for these dependencies, made when missing
    (older roots, for other dependency lists, are removed)."""
    deps = dependencies(debs)
    key = hashlib.sha256(",".join(deps).encode()).hexdigest()[:16]
    tar = CACHE / f"bookworm-{key}.tar"
    if not tar.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        for old in CACHE.glob("bookworm-*.tar"):
            old.unlink()
        part = tar.with_suffix(".part")
        try:
            check(["mmdebstrap", "--quiet", "--format=tar", "--variant=apt", f"--include={','.join(deps)}", "bookworm", str(part)])
            part.rename(tar)
        finally:
            part.unlink(missing_ok=True)
    return tar


class Root:
    """A Debian root unpacked in a temporary directory; commands run in it
    by chroot, without network."""

    def __init__(self, td: Teardown, tar: Path):
        self.dir = Path(tempfile.mkdtemp(prefix="netpager-root-"))
        td.add(f"directory {self.dir}", lambda: shutil.rmtree(self.dir))
        check(["tar", "-x", "-f", str(tar), "-C", str(self.dir)])

    def run(self, cmd: str) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
        return run(["unshare", "--net", "chroot", str(self.dir), "sh", "-c", cmd], env=env)

    def check(self, cmd: str) -> str:
        p = self.run(cmd)
        assert p.returncode == 0, f"in the root: {cmd}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p.stdout + p.stderr

    def tree(self) -> dict[str, tuple]:
        """Every path in the root but the package manager's own state, with
        its type, mode and owner."""
        out = {}
        for dirpath, dirnames, filenames in os.walk(self.dir):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                rel = str(path.relative_to(self.dir))
                if rel.startswith(OWN_STATE):
                    continue
                st = path.lstat()
                out[rel] = (st.st_mode, st.st_uid, st.st_gid)
        return out


def test_install_use_upgrade_remove_purge_in_a_fresh_debian_root(debs):
    td = Teardown("debian root")
    try:
        root = Root(td, base_root(debs))
        before = root.tree()
        (root.dir / "tmp" / "debs").mkdir()
        for deb in debs.values():
            shutil.copy(deb, root.dir / "tmp" / "debs")
        names = " ".join(f"/tmp/debs/{d.name}" for d in debs.values())
        root.check(f"apt-get install -y {names}")

        # The plugin by name, as `nbdkit memory` works.
        help_text = root.check("nbdkit pager-server --help")
        assert "budget=" in help_text, help_text
        assert root.check("nbdkit --dump-config | sed -n 's/^plugindir=//p'").strip() + \
            "/nbdkit-pager-server-plugin.so" in root.check("dpkg -L netpager-donor")

        # Every command says its package's version and commit.
        for pkg, commands in COMMANDS.items():
            version = root.check(f"dpkg-query -W -f '${{Version}}' {pkg}").strip()
            for c in commands:
                out = root.check(f"{c} --version").strip()
                assert re.fullmatch(rf"{re.escape(c)} {re.escape(version)} \(commit [0-9a-f]{{40}}\)", out), out

        for page, section in [("pagerctl", 1), ("pager-server", 1), ("pager-client-plugin", 1), ("prefetchd", 8),
                              ("netpager-token", 1), ("pager-hints", 1), ("prefetch-job", 1)]:
            assert root.check(f"man -w {page}").strip() == f"/usr/share/man/man{section}/{page}.{section}.gz"

        # Units installed, none enabled; configurations are conffiles.
        for pkg in PACKAGES:
            assert (root.dir / "usr/lib/systemd/system" / f"{pkg}.service").exists()
            conf = "/etc/netpager/" + pkg.removeprefix("netpager-") + ".conf"
            assert conf in root.check(f"dpkg-query -W -f '${{Conffiles}}' {pkg}")
        assert not list((root.dir / "etc/systemd/system").glob("**/netpager-*")), "a unit was enabled"

        # An upgrade (here: the same package again) with a device attached
        # leaves it attached and says when the new version takes effect
        # (a record without a device: not restartable; real devices, a
        # restartable one moved onto the new pagerctl, in
        # tests/client/test_client_upgrade.py).
        attached = root.dir / "var/lib/netpager/swap"
        attached.mkdir(parents=True)
        (attached / "attach.json").write_text("{}\n")
        (root.dir / "var/lib/netpager/client").mkdir()  # the packaged unit's StateDirectory
        out = root.check(f"dpkg -i /tmp/debs/{debs['netpager-client'].name}")
        assert "/var/lib/netpager/swap: attached, not restartable, left as it is" in out, out
        assert "takes effect at its next attach" in out, out
        assert (attached / "attach.json").exists()

        # Remove keeps the configuration, purge takes it and the package's
        # state, and nothing else.
        (root.dir / "etc/netpager/donor.conf").write_text("# edited\n")
        root.check("apt-get remove -y " + " ".join(PACKAGES))
        assert (root.dir / "etc/netpager/donor.conf").read_text() == "# edited\n"
        root.check("apt-get purge -y " + " ".join(PACKAGES))
        assert (attached / "attach.json").exists(), "purge removed state the package did not create"
        assert not (root.dir / "var/lib/netpager/client").exists()
        shutil.rmtree(root.dir / "var/lib/netpager")
        shutil.rmtree(root.dir / "tmp" / "debs")
        after = root.tree()
        left = sorted(set(after) - set(before))
        gone = sorted(set(before) - set(after))
        changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
        assert (left, gone, changed) == ([], [], []), (left, gone, changed)
        assert root.check("dpkg-query -W -f '${Package}\\n' 'netpager-*' 2>/dev/null || true").strip() == ""
    finally:
        errors = td.close()
    assert not errors, errors
