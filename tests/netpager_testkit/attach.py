"""Attaching an NBD export as swap without the kernel nbd module.

    NBD export --nbdfuse--> MOUNTDIR/nbd --losetup--> /dev/loopN --mkswap/swapon--> swap

Each step registers its undo the moment it succeeds, so the reverse path
(swapoff, losetup -d, fusermount3 -u, nbdfuse gone, rmdir) runs on every
exit: swap is switched off while the donor still answers, which is why
donors are started (and so undone) before anything is attached to them.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .cleanup import Teardown
from .machine import SWAP
from .procs import OwnedProcess, tail, wait_for


def run(argv: list[str], timeout: float = 120.0) -> str:
    """Runs a command, raising with its output when it fails."""
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip()}")
    return p.stdout


def mounted(path) -> bool:
    target = str(Path(path))
    with open("/proc/mounts") as f:
        return any(line.split()[1] == target for line in f)


def swaps() -> dict[str, int]:
    """Active swap areas: device -> used bytes (from /proc/swaps)."""
    out = {}
    with open("/proc/swaps") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            out[fields[0]] = int(fields[3]) * 1024
    return out


def swap_priorities() -> dict[str, int]:
    """Active swap areas: device -> priority (from /proc/swaps)."""
    out = {}
    with open("/proc/swaps") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            out[fields[0]] = int(fields[4])
    return out


class FuseFile:
    """An NBD export as a regular file `MOUNTDIR/nbd`, served by nbdfuse."""

    def __init__(self, teardown: Teardown, workdir, uri: str, connections: int | None = None,
                 timeout: float = 30.0):
        self.uri = uri
        workdir = Path(workdir)
        tag = uuid.uuid4().hex[:8]
        self.mountdir = workdir / f"netpager-fuse-{tag}"
        self.path = self.mountdir / "nbd"
        self.pidfile = workdir / f"nbdfuse-{tag}.pid"
        self.mountdir.mkdir(parents=True)
        teardown.add(f"mountpoint {self.mountdir}", self._rmdir)
        argv = ["nbdfuse", "-P", self.pidfile]
        if connections:
            argv += ["-C", str(connections)]
        argv += [self.path, uri]
        self.proc = OwnedProcess(argv, workdir / f"nbdfuse-{tag}.log", teardown, f"nbdfuse {tag}")
        teardown.add(f"fuse mount {self.mountdir}", self.unmount)

        def ready():
            if not self.proc.alive():
                raise RuntimeError(f"nbdfuse for {uri} exited with {self.proc.popen.returncode}: "
                                   f"{tail(self.proc.log_path)}")
            return self.pidfile.exists() and mounted(self.mountdir) and self.path.exists()

        wait_for(ready, timeout, f"nbdfuse mount of {uri} at {self.path}")

    def size(self) -> int:
        return self.path.stat().st_size

    def unmount(self, timeout: float = 30.0) -> None:
        """fusermount3 -u (retried while the file is still busy), then waits for nbdfuse."""
        deadline = time.monotonic() + timeout
        while mounted(self.mountdir):
            p = subprocess.run(["fusermount3", "-u", str(self.mountdir)],
                               capture_output=True, text=True)
            if p.returncode == 0:
                break
            if time.monotonic() > deadline:
                subprocess.run(["umount", "-l", str(self.mountdir)], capture_output=True)
                raise RuntimeError(f"fusermount3 -u {self.mountdir}: {p.stderr.strip()} "
                                   "(detached lazily instead)")
            time.sleep(0.1)
        if self.proc.wait(timeout) is None:
            raise RuntimeError(f"nbdfuse pid {self.proc.pid} still running {timeout:.0f}s "
                               f"after unmounting {self.mountdir}")

    def _rmdir(self) -> None:
        if self.mountdir.exists() and not mounted(self.mountdir):
            self.mountdir.rmdir()


class Mount:
    """mount DEVICE on a directory, unmounted on teardown. With `lazy`, an
    unmount that fails (a dead device) detaches the file system lazily."""

    def __init__(self, teardown: Teardown, device: str, where, lazy: bool = False):
        self.where = Path(where)
        self.lazy = lazy
        self.where.mkdir(exist_ok=True)
        run(["mount", device, self.where])
        teardown.add(f"mount {self.where}", self.umount)

    def umount(self) -> None:
        if not mounted(self.where):
            return
        try:
            run(["umount", self.where])
        except RuntimeError:
            if not self.lazy:
                raise
            run(["umount", "-l", self.where])


def file_checksums(root, pattern: str) -> dict[str, str]:
    """sha256 of each file in `root` matching `pattern`, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(root).glob(pattern))}


class LoopDevice:
    """`losetup --find --show FILE`, detached on teardown."""

    def __init__(self, teardown: Teardown, backing_file, direct_io: bool = False):
        self.backing_file = str(Path(backing_file))
        argv = ["losetup", "--find", "--show"] + (["--direct-io=on"] if direct_io else [])
        self.device = run(argv + [self.backing_file]).strip()
        teardown.add(f"loop device {self.device} on {self.backing_file}", self.detach)

    @property
    def _sysfs_backing(self) -> Path:
        return Path("/sys/block") / Path(self.device).name / "loop" / "backing_file"

    def attached(self) -> bool:
        """True while the device still refers to our backing file."""
        try:
            return self._sysfs_backing.read_text().strip() == self.backing_file
        except FileNotFoundError:
            return False

    def detach(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.attached():
            p = subprocess.run(["losetup", "-d", self.device], capture_output=True, text=True)
            if p.returncode == 0:
                # The kernel releases the backing file asynchronously.
                wait_for(lambda: not self.attached(), max(1.0, deadline - time.monotonic()),
                         f"{self.device} to release {self.backing_file}")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"losetup -d {self.device}: {p.stderr.strip()}")
            time.sleep(0.1)


class Swap:
    """mkswap + swapon on a block device, swapoff on teardown; the machine's
    swap lock is held while it is on (`machine.SWAP`)."""

    def __init__(self, teardown: Teardown, device: str, priority: int | None = 32000,
                 discard: bool = False):
        self.device = device
        run(["mkswap", device])
        SWAP.acquire()
        self._locked = True
        teardown.add(f"swap lock for {device}", self._unlock)
        argv = ["swapon"]
        if priority is not None:
            argv += ["-p", str(priority)]
        if discard:
            argv.append("--discard")
        run(argv + [device])
        teardown.add(f"swap on {device}", self.off)

    def active(self) -> bool:
        return self.device in swaps()

    def used_bytes(self) -> int:
        return swaps().get(self.device, 0)

    def off(self) -> None:
        if self.active():
            run(["swapoff", self.device], timeout=600)
        self._unlock()

    def _unlock(self) -> None:
        if self._locked:
            self._locked = False
            SWAP.release()


def swap_slot_caches() -> bool:
    """Whether this kernel has per-CPU swap slot caches (mm/swap_slots.c, up
    to 6.14; Debian 12's 6.1): after a job exits they keep up to 64 freed or
    reserved slots per CPU out of the swap map, and the swap clusters those
    lie in are neither free nor discarded until swap is used again or a swap
    area is switched off."""
    with open("/proc/kallsyms") as f:
        return any(line.endswith(" free_swap_slot\n") for line in f)


def drain_swap_slot_caches(workdir) -> None:
    """Switches a throwaway 16 MiB swap area on and off: swapoff drains every
    CPU's swap slot caches, so the slots they kept are freed and the clusters
    they pinned discarded."""
    path = Path(workdir) / "throwaway.swap"
    with open(path, "wb") as f:
        f.truncate(16 << 20)
    td = Teardown("a throwaway swap area")
    try:
        Swap(td, LoopDevice(td, path).device, priority=None)
    finally:
        errors = td.close()
        path.unlink()
    if errors:
        raise RuntimeError(f"the throwaway swap area: {errors}")


@dataclass
class SwapStack:
    fuse: FuseFile
    loop: LoopDevice
    swap: Swap

    @property
    def device(self) -> str:
        return self.loop.device


def attach_swap(teardown: Teardown, workdir, uri: str, priority: int | None = 32000,
                discard: bool = False, direct_io: bool = True) -> SwapStack:
    """NBD export -> nbdfuse file -> loop device -> active swap."""
    fuse = FuseFile(teardown, workdir, uri)
    loop = LoopDevice(teardown, fuse.path, direct_io)
    swap = Swap(teardown, loop.device, priority, discard)
    return SwapStack(fuse, loop, swap)
