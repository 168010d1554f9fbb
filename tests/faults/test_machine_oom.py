"""The whole machine out of memory, no cgroup (pagerctl(1) MEMORY
PRESSURE).

Every other swap test limits its job with a memory cgroup, so the rest of
the machine always has memory for the serving process's sockets and
buffers. Here nothing does: a pressure process (pressure.py) locks all but
KEEP of the machine's available memory, then memhog touches JOB bytes
outside any memory cgroup with one swap area on, and verifies every page:

- netpager parity on 3 donors, as swap;
- for comparison, the same job on a swap file on local disk.

JOB is a quarter of the memory available when the test starts, at most
2 GiB, and KEEP half of JOB: 2 GiB and 1 GiB on a lab machine, about
384 MiB and 192 MiB in the test VM (2 GiB of memory), where this runs
(`make test-vm`): it needs CAP_SYS_RESOURCE, which root lacks on this
machine, so that the serving process can be an I/O flusher.

The donors stand for other machines: `nbdkit memory` with its whole size
allocated and locked before the pressure starts (allocator=malloc,
mlock=true), so their pages are not the pressured machine's to give back.
The kernel must kill nothing: the pressure process is first in line
(oom_score_adj 1000), so a kill ends the pressure early, and the test
fails on it as on the kernel's oom_kill count. The pressure process
bounds itself in time, so the machine comes back even if this test
cannot. It takes the whole machine: `make faults` and `make test-vm` only
(faults_full).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from netpager_testkit.attach import Swap, swaps
from netpager_testkit.cgroup import MemoryCgroup
from netpager_testkit.client import URING_SWITCH
from netpager_testkit.donor import free_ports, nbd_handshake
from netpager_testkit.machine import loopback
from netpager_testkit.procs import OwnedProcess, has_cap_sys_resource, wait_for

GIB = 1 << 30
MIB = 1 << 20
# Upper bound on the whole pressured part (the pressure's own deadline).
PRESSURE_S = 900


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def job_bytes() -> int:
    """A quarter of the memory available now, at most 2 GiB, in 64 MiB
    steps (see the module's doc)."""
    return min(2 * GIB, meminfo("MemAvailable") // 4 // (64 * MIB) * 64 * MIB)


# Runs ARGV in the cgroup whose cgroup.procs is ARG1, an I/O flusher
# (PR_SET_IO_FLUSHER, 57: kept across execve).
AS_FLUSHER = ("import ctypes, os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); "
              "ctypes.CDLL(None).prctl(57, 1, 0, 0, 0) == 0 or sys.exit('PR_SET_IO_FLUSHER refused'); "
              "os.execvp(sys.argv[2], sys.argv[2:])")


class LockedDonor:
    """`nbdkit memory SIZE allocator=malloc,mlock=true` on loopback: a donor
    whose memory is all allocated and locked when it starts. The donors
    stand for other machines, so the rest of their memory (request
    buffers, stacks) must not wait on the swap they serve: each runs in
    `cgroup`, a memory cgroup without swap, and is an I/O flusher, as the
    serving process is. In the test VM a donor without either stopped
    answering for the 30 s request timeout as the pressure began; the device
    failed it, and parity on 3 donors, with no other donor for a stripe,
    answered every write to a new extent with ENOSPC. (Not `nbdkit --swap`:
    its mlockall locked a heap three times the export and whole 8 MiB
    thread stacks, and the VM killed a donor for memory.)"""

    def __init__(self, teardown, workdir: Path, name: str, size: str, cgroup: MemoryCgroup):
        self.name, self.addr = name, loopback(2, net=1)
        self.port = free_ports(self.addr, 1)[0]
        self.status_addr = None
        argv = ["/usr/bin/python3", "-c", AS_FLUSHER, str(cgroup.procs_file),
                "nbdkit", "-f", "-i", self.addr, "--port", str(self.port), "memory", size,
                "allocator=malloc,mlock=true"]
        self.proc = OwnedProcess(argv, workdir / f"{name}.log", teardown, f"donor {name}")
        wait_for(lambda: nbd_handshake(f"nbd://{self.addr}:{self.port}") or not self.proc.alive(),
                 120, f"donor {name} to allocate and lock {size}")
        assert self.proc.alive(), f"donor {name} did not start: {self.proc.log_tail()}"


def abort_when_stuck(teardown, mountpoint: Path, procs: list) -> None:
    """Registers, before `procs` are started (undo runs last first, so this
    runs after they are stopped and before the detach): if one of them is
    still alive (stuck in reclaim on the device), abort the device's FUSE
    connection (fusectl), which fails its requests and frees the machine,
    so that the detach can run."""

    def undo():
        if not any(p.alive() for p in procs):
            return
        conn = next((line.split()[2].split(":")[1] for line in open("/proc/self/mountinfo")
                     if line.split()[4] == str(mountpoint)), None)
        ctl = Path("/sys/fs/fuse/connections")
        mounted_here = not any(ctl.iterdir())
        if mounted_here:
            subprocess.run(["mount", "-t", "fusectl", "none", ctl], check=True)
        try:
            if conn:
                (ctl / conn / "abort").write_text("1")
        finally:
            if mounted_here:
                subprocess.run(["umount", ctl], check=True)
        wait_for(lambda: not any(p.alive() for p in procs), 60, "the stuck processes to end")

    teardown.add(f"abort the FUSE connection of {mountpoint} if the job is stuck", undo)


def vmstat(key: str) -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, v = line.split()
        if k == key:
            return int(v)
    return 0


def run_under_pressure(teardown, tmp_path, memhog, device: str, job_size: int,
                       fuse_dir: Path | None = None) -> dict:
    """Locks all but half of `job_size`, runs memhog over `job_size` bytes
    with `device` the only swap, and checks the job, the pressure and the
    kernel's kills. With `fuse_dir` (netpager's FUSE mount), a job or
    pressure stuck at the end gets the connection aborted."""
    watched = []
    if fuse_dir:
        abort_when_stuck(teardown, fuse_dir, watched)
    pressure = OwnedProcess(["/usr/bin/python3", Path(__file__).with_name("pressure.py"),
                             str(job_size // 2), str(PRESSURE_S)], tmp_path / "pressure.log", teardown,
                            "pressure")
    watched.append(pressure)
    wait_for(lambda: "locked" in pressure.log_tail() or not pressure.alive(), 300,
             "the pressure to lock the machine's memory")
    assert pressure.alive(), f"the pressure process ended: {pressure.log_tail()}"
    t0, kills = time.monotonic(), vmstat("oom_kill")
    job = OwnedProcess([memhog, str(job_size), "--passes", "1"], tmp_path / "memhog.log", teardown,
                       "memhog")
    watched.append(job)
    peak = 0
    while job.alive() and pressure.alive():
        peak = max(peak, swaps().get(device, 0))
        time.sleep(0.2)
    job.popen.wait(timeout=60)
    took = time.monotonic() - t0
    assert pressure.alive(), (f"the pressure ended before the job did (OOM kill or its "
                              f"{PRESSURE_S} s deadline): {pressure.log_tail()}")
    assert job.popen.returncode == 0, f"memhog exited {job.popen.returncode}: {job.log_tail()}"
    assert vmstat("oom_kill") == kills, "the kernel killed a process for memory"
    assert peak >= job_size // 4, f"only {peak >> 20} MiB went to swap: no pressure to speak of"
    summary = job.log_tail().strip().splitlines()[-1]
    return {"job_mib": job_size >> 20, "seconds": round(took, 1), "swap_peak_mib": peak >> 20,
            "memhog": summary}


def record(name: str, row: dict) -> None:
    out = Path(__file__).resolve().parents[2] / "bench-results" / "machine-oom.json"
    out.parent.mkdir(exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else {}
    rows[name] = row
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{name}: {row}")


def only_swap_here() -> None:
    on = swaps()
    assert not on, f"another swap area is on ({', '.join(on)}): this test needs the only one"


@pytest.mark.faults_full
def test_parity_swap_holds_with_the_whole_machine_out_of_memory(root, teardown, tmp_path, client, memhog):
    if not has_cap_sys_resource():
        pytest.skip("no CAP_SYS_RESOURCE here, so the serving process cannot be an I/O flusher "
                    "(PR_SET_IO_FLUSHER) and deadlocks under global reclaim: pagerctl(1) MEMORY PRESSURE")
    only_swap_here()
    job_size = job_bytes()
    # The device holds the whole job (swap takes at most what does not fit
    # in the half of it the machine keeps). Parity on 3 donors keeps half
    # the device on each, and the parity log, bounded here to half the
    # device's data, half as much again: 3/4 of the device, plus 64 MiB.
    # The log's default bound is the device's size, which at worst needs
    # the whole device on each donor, more than these exports hold.
    device_size = job_size
    no_swap = MemoryCgroup(teardown, 1 << 50, swap_limit_bytes=0)
    ds = [LockedDonor(teardown, tmp_path, f"d{i}", f"{(device_size * 3 // 4 + 64 * MIB) >> 20}M", no_swap)
          for i in range(3)]
    # The FUSE front end: its serving process is pagerctl serve, which
    # marks itself an I/O flusher (auto would pick kernel nbd where the
    # module is loaded, as in the test VM: nbdkit never asks).
    frontend = "fuse-uring" if URING_SWITCH.exists() else "fuse"
    # attach trims each donor's whole export in one request: under the
    # test VM's emulation, a few hundred MiB of locked memory take longer
    # than the default 5 s request timeout, and parity on 3 donors needs
    # all three.
    device = client.attach(ds, mode="parity", size=f"{device_size >> 20}M", swap=True, frontend=frontend,
                           extra=["--request-timeout", "30", "--parity-log", f"{device_size // 2 >> 20}M"])
    assert client.status()["io_flusher"], "the serving process is no I/O flusher"
    row = run_under_pressure(teardown, tmp_path, memhog, device, job_size, client.state_dir / "fuse")
    st = client.device_status()
    assert st["totals"]["lost"] == 0, st["totals"]
    row["resent_or_retried"] = sum(d.get("retries", 0) for d in st["donors"])
    record("netpager parity, 3 donors", row)


@pytest.mark.faults_full
def test_a_swap_file_under_the_same_pressure(root, teardown, tmp_path, memhog):
    only_swap_here()
    job_size = job_bytes()
    f = Path("/var/tmp") / f"netpager-oom-{tmp_path.name}.swap"
    teardown.add(f"remove {f}", lambda: f.unlink(missing_ok=True))
    subprocess.run(["fallocate", "-l", str(job_size), f], check=True)
    f.chmod(0o600)
    Swap(teardown, str(f))
    record("swap file on local disk", run_under_pressure(teardown, tmp_path, memhog, str(f), job_size))
