"""Memory cgroups for jobs that must swap (cgroup v1 and v2).

`run_job_in_cgroup(cmd, limit_bytes)` creates `netpager-test-PID-START-XXXX`
(its owner's `machine.owner_tag()`: each new one first sweeps those whose
owner was killed before its teardown could run) under the
memory controller, limits its memory (swap stays unlimited unless asked),
starts the job inside it (the wrapper shell writes its own pid into the
cgroup before it execs the job, so not one page is charged elsewhere),
samples memory and swap use while it runs, waits with a timeout, and removes
the cgroup again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import machine
from .cleanup import Teardown
from .procs import OwnedProcess, tail, wait_for

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


def cgroup_version() -> int:
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        return 1
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return 2
    raise RuntimeError("no memory cgroup controller: neither "
                       f"{V1_ROOT}/memory.limit_in_bytes nor memory in {controllers}")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, OSError):
        return None
    return None if text == "max" else int(text)


def _read_kv(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except (FileNotFoundError, OSError):
        return {}
    out = {}
    for line in lines:
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


PREFIX = "netpager-test-"


def sweep_leftovers(root: Path) -> None:
    """Removes the cgroups of test processes that are gone (killed with
    SIGKILL, or the machine's session ended under them), ending what still
    runs in them: only this harness makes such names."""
    for path in root.glob(f"{PREFIX}*-*-*"):
        tag = path.name[len(PREFIX):].rsplit("-", 1)[0]
        if path.is_dir() and machine.owner_gone(tag):
            try:
                _empty_and_remove(path, 10.0)
            except (OSError, RuntimeError, TimeoutError):
                pass  # its owner's teardown or the next sweep gets it


def _pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _empty_and_remove(path: Path, timeout: float) -> None:
    """Kills what is left in cgroup `path`, waits until it is empty, then
    removes it."""
    if not path.exists():
        return
    if (path / "cgroup.kill").exists() and _pids(path):
        (path / "cgroup.kill").write_text("1")
    for pid in _pids(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not _pids(path), timeout, f"{path} to be empty")
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rmdir {path}: {e}") from None
            time.sleep(0.1)


class MemoryCgroup:
    """A memory cgroup named netpager-test-PID-START-XXXX, removed on
    teardown (and by the next run's sweep if its owner was killed first)."""

    def __init__(self, teardown: Teardown, limit_bytes: int, swap_limit_bytes: int | None = None,
                 prefix: str = PREFIX):
        self.version = cgroup_version()
        root = V1_ROOT if self.version == 1 else V2_ROOT
        if self.version == 2:
            subtree = (V2_ROOT / "cgroup.subtree_control").read_text().split()
            if "memory" not in subtree:
                (V2_ROOT / "cgroup.subtree_control").write_text("+memory")
        sweep_leftovers(root)
        self.path = root / f"{prefix}{machine.owner_tag()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        teardown.add(f"cgroup {self.path}", self.remove)
        self.limit_bytes = limit_bytes
        if self.version == 1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if swap_limit_bytes is not None:
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if not memsw.exists():
                    raise RuntimeError(f"{memsw} missing: swap accounting is off, cannot limit swap")
                memsw.write_text(str(limit_bytes + swap_limit_bytes))
        else:
            (self.path / "memory.max").write_text(str(limit_bytes))
            (self.path / "memory.swap.max").write_text(
                "max" if swap_limit_bytes is None else str(swap_limit_bytes))

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        return _pids(self.path)

    def memory_bytes(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return _read_int(self.path / name) or 0

    def swap_bytes(self) -> int:
        if self.version == 1:
            return _read_kv(self.path / "memory.stat").get("swap", 0)
        return _read_int(self.path / "memory.swap.current") or 0

    def peak_memory_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return _read_int(self.path / name)

    def oom_kills(self) -> int:
        if self.version == 1:
            return _read_kv(self.path / "memory.oom_control").get("oom_kill", 0)
        return _read_kv(self.path / "memory.events").get("oom_kill", 0)

    def remove(self, timeout: float = 30.0) -> None:
        """Kills what is left in the cgroup (only our job and its children can
        be in it: we created it under a fresh name), waits until it is empty,
        then removes it."""
        _empty_and_remove(self.path, timeout)


@dataclass
class JobResult:
    argv: list[str]
    returncode: int | None
    timed_out: bool
    seconds: float
    limit_bytes: int
    peak_memory_bytes: int
    peak_swap_bytes: int
    oom_kills: int
    log_path: Path
    cgroup: Path
    swap_device_peak_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def output(self) -> str:
        return tail(self.log_path, 60)

    def describe(self) -> str:
        status = "timed out" if self.timed_out else f"exit {self.returncode}"
        return (f"{' '.join(self.argv)}: {status} after {self.seconds:.1f}s, limit "
                f"{self.limit_bytes >> 20} MiB, peak memory {self.peak_memory_bytes >> 20} MiB, "
                f"peak swap {self.peak_swap_bytes >> 20} MiB, oom kills {self.oom_kills}, "
                f"swap devices {self.swap_device_peak_bytes}; log {self.log_path}:\n{self.output}")

    def check(self) -> "JobResult":
        """Raises unless the job exited 0."""
        if self.timed_out or self.returncode != 0:
            raise AssertionError(self.describe())
        return self


class _Sampler(threading.Thread):
    """Records the highest memory/swap use of a cgroup and of swap devices."""

    def __init__(self, cg: MemoryCgroup, devices: list[str], interval: float = 0.05):
        super().__init__(daemon=True)
        self.cg, self.devices, self.interval = cg, devices, interval
        self.stop_event = threading.Event()
        self.peak_memory = 0
        self.peak_swap = 0
        self.device_peaks = {d: 0 for d in devices}

    def sample(self) -> None:
        from .attach import swaps

        self.peak_memory = max(self.peak_memory, self.cg.memory_bytes())
        self.peak_swap = max(self.peak_swap, self.cg.swap_bytes())
        if self.devices:
            used = swaps()
            for d in self.devices:
                self.device_peaks[d] = max(self.device_peaks[d], used.get(d, 0))

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.sample()


def run_job_in_cgroup(teardown: Teardown, cmd: list, limit_bytes: int, log_path,
                      timeout: float = 600.0, swap_limit_bytes: int | None = None,
                      swap_devices: list[str] | None = None) -> JobResult:
    """Runs `cmd` in a fresh memory cgroup limited to `limit_bytes`; see module doc.

    `swap_devices` are swap areas whose peak use is sampled while the job runs.
    The cgroup is removed before this returns, whatever happened.
    """
    cg_td = Teardown(f"job {cmd[0]}")
    try:
        cg = MemoryCgroup(cg_td, limit_bytes, swap_limit_bytes)
        argv = [str(c) for c in cmd]
        wrapper = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.procs_file)] + argv
        sampler = _Sampler(cg, list(swap_devices or []))
        start = time.monotonic()
        proc = OwnedProcess(wrapper, log_path, cg_td, f"job {Path(argv[0]).name}")
        teardown.add_log(log_path)
        sampler.start()
        rc = proc.wait(timeout)
        timed_out = rc is None
        if timed_out:
            proc.kill9()
        seconds = time.monotonic() - start
        sampler.stop_event.set()
        sampler.join()
        sampler.sample()
        peak_memory = max(sampler.peak_memory, cg.peak_memory_bytes() or 0)
        if cg.version == 2:
            sampler.peak_swap = max(sampler.peak_swap, _read_int(cg.path / "memory.swap.peak") or 0)
        result = JobResult(argv, proc.popen.returncode, timed_out, seconds, limit_bytes,
                           peak_memory, sampler.peak_swap, cg.oom_kills(), Path(log_path),
                           cg.path, sampler.device_peaks)
    finally:
        cg_td.close_or_raise()
    return result


def oom_killed(result: JobResult) -> bool:
    """True when the kernel's OOM killer ended the job."""
    return result.oom_kills > 0 and result.returncode == -signal.SIGKILL

