"""Debian roots with netpager's packages, for tests/deb: the packages
built from the release build (`scripts/deb.sh`, once per session), a
Debian 12 root made by mmdebstrap with their dependencies (cached in
/var/cache/netpager-test/, keyed by that list), unpacked into a temporary
directory (`Root`: commands by chroot without network; `LiveRoot`: with
/proc, /sys and /dev, in a network namespace of its own with loopback up,
so daemons and devices run in it)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from netpager_testkit import Teardown
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.paths import repo_root, target_dir

PACKAGES = ["netpager-donor", "netpager-client", "netpager-prefetchd"]
COMMANDS = {"netpager-donor": ["netpager-token", "netpager-drain"], "netpager-client": ["pagerctl"],
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


@pytest.fixture(scope="session")
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
        td.add(f"directory {self.dir}", self._remove)
        check(["tar", "-x", "-f", str(tar), "-C", str(self.dir)])

    def _remove(self) -> None:
        shutil.rmtree(self.dir)

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




def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` (from /proc/self/mountinfo), deepest first."""
    prefix = str(path)
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        m = line.split(" ")[4].encode().decode("unicode_escape")
        if m == prefix or m.startswith(prefix + "/"):
            out.append(m)
    return sorted(out, key=len, reverse=True)


class LiveRoot(Root):
    """A root where the packages' daemons and devices run: /proc, /sys and
    /dev (read-only: nothing in the root can remove the machine's device
    nodes) mounted in it, and commands run by chroot inside a network
    namespace of its own with only loopback, so its donors listen on
    127.0.0.x without meeting anything else on the machine. Mounts happen
    in the machine's mount namespace (nsenter enters the network namespace
    only), so a FUSE mount made by one command is there for the next.

    Undone on every exit path by `td`, in this order: devices attached
    from the root detached (pagerctl detach, then swapoff, losetup -d and
    unmounting whatever is left under the root), every process in the
    namespace killed, the namespace deleted, the root's mounts unmounted,
    and the directory removed only once nothing is mounted under it."""

    def __init__(self, td: Teardown, tar: Path):
        super().__init__(td, tar)
        self.netns = f"npday-{uuid.uuid4().hex[:8]}"
        check(["ip", "netns", "add", self.netns])
        td.add(f"network namespace {self.netns}", self._remove_netns)
        check(["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"])
        td.add(f"mounts in {self.dir}", self._unmount)
        check(["mount", "-t", "proc", "proc", str(self.dir / "proc")])
        check(["mount", "--rbind", "/sys", str(self.dir / "sys")])
        check(["mount", "--make-rslave", str(self.dir / "sys")])
        check(["mount", "--bind", "/dev", str(self.dir / "dev")])
        check(["mount", "-o", "remount,bind,ro", str(self.dir / "dev")])
        td.add(f"devices attached in {self.dir}", self._detach_all)

    def run(self, cmd: str, env: dict | None = None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
        full = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "HOME": "/root",
                "DEBIAN_FRONTEND": "noninteractive", **(env or {})}
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", "chroot", str(self.dir),
                               "sh", "-c", cmd], env=full, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def check(self, cmd: str, env: dict | None = None) -> str:
        p = self.run(cmd, env)
        assert p.returncode == 0, f"in the root: {cmd}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p.stdout + p.stderr

    def _remove(self) -> None:
        # Never through a mount: /sys and /dev are the machine's.
        left = mounts_under(self.dir)
        if left:
            raise RuntimeError(f"not removing {self.dir}: still mounted under it: {left}")
        shutil.rmtree(self.dir)

    def _detach_all(self) -> None:
        for top in ("var/lib/netpager", "tmp", "root"):
            for record in sorted((self.dir / top).glob("**/attach.json")):
                state = "/" + str(record.parent.relative_to(self.dir))
                self.run(f"pagerctl detach --state-dir {state}")
        # Whatever a failed detach (or a hand-made swap) left.
        for dev in Path("/sys/block").glob("loop*"):
            try:
                backing = (dev / "loop" / "backing_file").read_text().strip()
            except OSError:
                continue
            if backing.startswith(str(self.dir) + "/"):
                subprocess.run(["swapoff", f"/dev/{dev.name}"], capture_output=True)
                check(["losetup", "-d", f"/dev/{dev.name}"])
        system = tuple(str(self.dir / d) for d in ("proc", "sys", "dev"))
        for m in mounts_under(self.dir):
            if not any(m == x or m.startswith(x + "/") for x in system):
                subprocess.run(["umount", "-l", m], capture_output=True)

    def _remove_netns(self) -> None:
        pids = run(["ip", "netns", "pids", self.netns]).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        check(["ip", "netns", "delete", self.netns])

    def _unmount(self) -> None:
        for m in mounts_under(self.dir):
            check(["umount", "-l", m])
        left = mounts_under(self.dir)
        assert left == [], f"still mounted under {self.dir}: {left}"
