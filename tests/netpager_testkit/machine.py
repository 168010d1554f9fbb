"""What test runs on one machine share, and how they keep apart.

Several `make test` runs (worktrees, CI jobs) may share a machine at once.
Three things are machine-wide, and without care one run would decide
another's result:

- Loopback addresses and their ports. A port picked free on a shared
  address can be taken by another run before it is bound, or while a donor
  restarts on it. Each test process holds a block 127.N.0.0/16 of its own
  (`loopback(host)`), so its ports are only ever its own.
- Swap. The kernel sends every process's pages to the swap area of highest
  priority, whichever test made it: a job would swap onto another run's
  device, and lose pages when that test kills its client. A test holds
  `SWAP` while it has a swap area on (`PagerClient` with `--swap`,
  `attach.Swap`). A run killed with SIGKILL leaves its area on; once its
  FUSE server is gone as well, the next run to take `SWAP` switches it off.
- FUSE over io_uring's switch (`/sys/module/fuse/parameters/enable_uring`),
  read when a FUSE file system is mounted: `pagerctl attach` turns it on,
  `pagerctl detach` turns it back, some tests turn it off. Attach, detach
  and those tests hold `URING_SWITCH`.

Each is an flock on a file in /run/lock (the Rust harness, test-support's
`machine.rs`, takes the same files), released by the kernel when the
process exits, however it exits. Holders write who they are into the file,
so a run that waits too long says whom it waited for.

What the kernel does not release with the process (a memory cgroup) is
named with its owner (`owner_tag()`: pid and start time), so that the next
run can tell a leftover of a process killed with SIGKILL, whose teardown
never ran, from another live run's, and sweep it (`owner_gone`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

LOCK_DIR = Path("/run/lock") if os.access("/run/lock", os.W_OK) else Path(tempfile.gettempdir())


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (/proc/PID/stat's
    22nd field), None when it is gone: with the pid, it names one process
    even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def owner_tag() -> str:
    """`PID-STARTTIME` of this process, for names of what outlives it."""
    return f"{os.getpid()}-{_start_time(os.getpid())}"


def owner_gone(tag: str) -> bool:
    """Whether the process an `owner_tag` names has exited."""
    pid, _, start = tag.partition("-")
    return not pid.isdigit() or _start_time(int(pid)) != start


def lock_path(name: str) -> Path:
    return LOCK_DIR / f"netpager-test-{name}.lock"


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _mark(fd: int, what: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {what}\n".encode(), 0)


class MachineLock:
    """An exclusive flock shared by every test run on the machine, re-entrant
    within this process (a test that holds it may attach, which takes it too)."""

    def __init__(self, name: str, what: str):
        self.name = name
        self.what = what
        self.path = lock_path(name)
        self._fd: int | None = None
        self._depth = 0
        self._mutex = threading.Lock()

    def acquire(self, timeout: float = 1800.0) -> None:
        with self._mutex:
            if self._depth == 0:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            os.close(fd)
                            raise TimeoutError(
                                f"waited {timeout:.0f}s for {self.path} ({self.what}), held by "
                                f"{_holder(self.path)}") from None
                        time.sleep(0.2)
                _mark(fd, self.what)
                self._fd = fd
            self._depth += 1

    def release(self) -> None:
        with self._mutex:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0 and self._fd is not None:
                os.close(self._fd)  # drops the flock
                self._fd = None

    @contextmanager
    def held(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def hold(self, teardown) -> None:
        """Acquires it until `teardown` closes (or an earlier `release`)."""
        self.acquire()
        teardown.add(f"release {self.path}", self.release)


class SwapLock(MachineLock):
    """`SWAP`: whoever takes it first in a process also switches off the swap
    areas a killed run left on a dead FUSE file (`sweep_dead_swap`): under the
    lock no live run has one on, and such an area, at the top priority tests
    use, would take the next job's pages and fail every write."""

    def acquire(self, timeout: float = 1800.0) -> None:
        super().acquire(timeout)
        if self._depth == 1:
            for what in sweep_dead_swap():
                print(f"netpager tests: swept {what}", file=sys.stderr, flush=True)


def _fuse_mounts() -> list[str]:
    """Mount points of FUSE file systems, longest first (/proc/self/mountinfo
    escapes a space as \\040)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        if post.split()[0].startswith("fuse"):
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), pre.split()[4]))
    return sorted(points, key=len, reverse=True)


def _server_gone(mountpoint: str) -> bool:
    """A FUSE mount whose server has exited answers ENOTCONN to everything."""
    try:
        os.stat(mountpoint)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def sweep_dead_swap() -> list[str]:
    """Switches off each swap area on a loop device whose file lies on a FUSE
    mount whose server is gone (a run killed with SIGKILL: its teardown never
    ran), detaches the loop device and unmounts the dead mount; returns what
    it swept. Nothing with a live server is touched."""
    swept = []
    for line in Path("/proc/swaps").read_text().splitlines()[1:]:
        device = line.split()[0]
        loop = re.fullmatch(r"/dev/(loop\d+)", device)
        if not loop:
            continue
        try:
            backing = Path(f"/sys/block/{loop[1]}/loop/backing_file").read_text().strip()
        except OSError:
            continue
        backing = backing.removesuffix(" (deleted)")
        mount = next((m for m in _fuse_mounts() if backing.startswith(m.rstrip("/") + "/")), None)
        if mount is None or not _server_gone(mount):
            continue
        for argv in (["swapoff", device], ["losetup", "-d", device], ["umount", "-l", mount]):
            subprocess.run(argv, capture_output=True, timeout=600)
        swept.append(f"swap area {device} on {backing}, whose FUSE server is gone")
    return swept


SWAP = SwapLock("swap", "a swap area on")
URING_SWITCH = MachineLock("uring-switch", "FUSE over io_uring's switch")

_block: tuple[int, int] | None = None
_block_mutex = threading.Lock()


def loopback_block() -> int:
    """N of the block 127.N.0.0/16 this process holds (taken on first use)."""
    global _block
    with _block_mutex:
        if _block is None:
            for n in range(1, 255):
                fd = os.open(lock_path(f"net-{n}"), os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                _mark(fd, f"127.{n}.0.0/16")
                _block = (n, fd)  # held until the process exits
                break
            else:
                raise RuntimeError(f"every loopback block 127.1-254.0.0/16 is held "
                                   f"({LOCK_DIR}/netpager-test-net-*.lock)")
        return _block[0]


def loopback(host: int, net: int = 0) -> str:
    """127.N.net.host in this process's own block."""
    if not (1 <= host <= 254 and 0 <= net <= 255):
        raise ValueError(f"loopback host {host}, net {net}: host 1-254, net 0-255")
    return f"127.{loopback_block()}.{net}.{host}"
