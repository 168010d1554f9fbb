"""The netpager client as the tests drive it: `pagerctl` attach/detach/status
around a state directory, with its detach registered in the test's Teardown
the moment an attach starts, and a check that a detach left nothing behind.
Attach and detach hold the machine's FUSE io_uring switch lock, and a device
attached as swap the machine's swap lock until its detach (`machine`)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

from .cgroup import MemoryCgroup
from .cleanup import Teardown
from . import machine
from .machine import SWAP
from .procs import OwnedProcess, wait_for
from .attach import mounted, swaps
from .paths import pagerctl, target_dir

MIB = 1 << 20
# Present where the kernel has FUSE over io_uring (Linux 6.14+): not in the
# test VM's Debian 6.1.
URING_SWITCH = Path("/sys/module/fuse/parameters/enable_uring")


def job_limit(size: int) -> int:
    """A swap job's memory cgroup limit: `size`, or a quarter of it (16 MiB
    at least) in the test VM (NETPAGER_VM, netpager_testkit.vm), where
    software emulation makes every page cost some hundred times more; what
    the test checks is the same."""
    if os.environ.get("NETPAGER_VM"):
        return max(16 * MIB, size // 4)
    return size


def client_plugin() -> Path:
    return target_dir() / "libpager_client_plugin.so"


def run_pagerctl(args, timeout: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
    """Runs pagerctl; with `check`, a failure raises with its stderr."""
    argv = [str(pagerctl())] + [str(a) for a in args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr}\n{p.stdout}")
    return p


# What `pagerctl status` exits with besides errors (pagerctl(1), EXIT STATUS).
STATUS_EXITS = {0: "ok", 3: "not attached", 4: "not serving", 5: "degraded"}


def pagerctl_status(state_dir, *extra) -> subprocess.CompletedProcess:
    """`pagerctl status`, whatever health it reports; an error raises."""
    p = run_pagerctl(["status", "--state-dir", state_dir, *extra], check=False)
    if p.returncode not in STATUS_EXITS:
        raise AssertionError(f"pagerctl status --state-dir {state_dir} failed ({p.returncode}):\n{p.stderr}")
    return p


def nbd_errno(e) -> str:
    """The errno name of a libnbd error (python3-libnbd 1.14 gives the name)."""
    return e.errno if isinstance(e.errno, str) else errno.errorcode.get(e.errno, str(e.errno))


class Job:
    """A job in a fresh memory cgroup, started in the background.

    The cgroup and the process are undone by the test's Teardown; the job is
    started after the attach, so it is killed before the detach (swapoff
    could not bring a live job's pages back into its small cgroup).

    `until=True` appends `--until FILE` (memhog, prefetch-job): the job runs
    until `stop()` creates FILE, then verifies and ends, so a test that must
    do things while it runs never sizes it to outlast them.
    """

    def __init__(self, teardown: Teardown, cmd, limit_bytes: int, log_path, swap_device: str | None = None,
                 until: bool = False):
        self.cgroup = MemoryCgroup(teardown, limit_bytes)
        self.swap_device = swap_device
        self.swap_peak = 0
        self.stop_file = Path(str(log_path) + ".stop")
        self.stop_file.unlink(missing_ok=True)
        cmd = [str(c) for c in cmd] + (["--until", str(self.stop_file)] if until else [])
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup.procs_file)]
        self.proc = OwnedProcess(argv + cmd, log_path, teardown, f"job {Path(cmd[0]).name}")

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        """Tells a job started with `until=True` to verify and end."""
        self.stop_file.touch()

    def rounds(self) -> int:
        """memhog's verify rounds so far (its "round N verified" lines)."""
        return sum(1 for line in self.proc.log_path.read_text(errors="replace").splitlines()
                   if line.startswith("memhog: round "))

    def swapped(self) -> int:
        """Bytes on the swap device now (and the peak so far)."""
        used = swaps().get(self.swap_device, 0) if self.swap_device else 0
        self.swap_peak = max(self.swap_peak, used)
        return used

    def finish(self, timeout: float = 900) -> str:
        """Waits for the job, sampling the swap device; raises with its log
        unless it exited 0. Returns the log's last lines."""
        deadline = time.monotonic() + timeout
        while self.proc.wait(0.1) is None and time.monotonic() < deadline:
            self.swapped()
        rc = self.proc.popen.poll()
        if rc != 0:
            raise AssertionError(f"job {'timed out' if rc is None else f'exited {rc}'}, "
                                 f"memory {self.cgroup.memory_bytes() >> 20} MiB, swap peak "
                                 f"{self.swap_peak >> 20} MiB, oom kills {self.cgroup.oom_kills()}; "
                                 f"log {self.proc.log_path}:\n{self.proc.log_tail()}")
        return self.proc.log_tail()


def run_memhog(teardown: Teardown, memhog, limit_bytes: int, log_path, device: str,
               until: bool = False) -> Job:
    """memhog touching 3x `limit_bytes` (one verify pass, or passes until
    `job.stop()` with `until`) swapping to `device`."""
    return Job(teardown, [memhog, str(3 * limit_bytes), "--passes", "1"], limit_bytes, log_path, device,
               until=until)


def device_ios(device: str) -> int:
    """Requests a block device has completed (reads + writes, /sys/block/DEV/stat)."""
    f = Path(f"/sys/block/{Path(device).name}/stat").read_text().split()
    return int(f[0]) + int(f[4])


def donor_report(status: dict, name: str) -> dict:
    """The donor called `name` in a client's device status."""
    return next(d for d in status["donors"] if d["name"] == name)


def busiest(client: "PagerClient", donors, exclude=()):
    """The harness donor holding most of the client's extents (once the
    status shows any), leaving out the names in `exclude`."""
    st = client.wait_status(lambda s: any(d["extents_held"] > 0 for d in s["donors"]), 30,
                            "extents placed on donors")
    ranked = sorted(st["donors"], key=lambda d: -d["extents_held"])
    best = next(d for d in ranked if d["name"] not in exclude)
    return next(d for d in donors if d.name == best["name"])


def donor_spec(donor) -> str:
    """HOST:PORT,status=HOST:PORT,name=NAME for a harness donor."""
    spec = f"{donor.addr}:{donor.port},name={donor.name}"
    if donor.status_addr:
        host, port = donor.status_addr
        spec += f",status={host}:{port}"
    return spec


def loop_devices_on(path: Path) -> list[str]:
    """Loop devices whose backing file is `path`."""
    out = []
    for d in Path("/sys/block").glob("loop*"):
        try:
            if (d / "loop" / "backing_file").read_text().strip() == str(path):
                out.append(f"/dev/{d.name}")
        except (FileNotFoundError, OSError):
            pass
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line mentions `text` (e.g. a state dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if any(text.encode() in a for a in argv) and pid_alive(int(d.name)):
            out.append(f"pid {d.name}: {b' '.join(argv).decode(errors='replace').strip()}")
    return out


class PagerClient:
    """One client state directory driven through pagerctl."""

    def __init__(self, teardown: Teardown, state_dir, client_id: str | None = None,
                 default_id: bool = False):
        """`default_id`: attach without --client-id, so the device takes
        pagerctl's default, the host name."""
        self.teardown = teardown
        self.state_dir = Path(state_dir)
        self.default_id = default_id
        self.client_id = socket.gethostname() if default_id else client_id or f"t{uuid.uuid4().hex[:8]}"
        self.device: str | None = None
        # What the last attach said on stderr (its warnings).
        self.attach_stderr = ""
        self._registered = False
        self._pids: list[int] = []
        self._swap_held = False

    @property
    def socket(self) -> Path:
        return self.state_dir / "nbd.sock"

    def uri(self) -> str:
        """The client's own NBD export on its unix socket (for libnbd and fio;
        attach with frontend="nbd")."""
        return f"nbd+unix:///{self.client_id}?socket={self.socket}"

    def attach(self, donors, *, mode: str | None = "none", size: str | None = "128M",
               swap: bool = False, extra=(), new_device: bool = True,
               frontend: str | None = None) -> str:
        """`pagerctl attach`; returns the device. `new_device=False` re-attaches
        the device the state directory holds (no device options). `frontend`
        None is pagerctl's auto (fuse-uring here)."""
        if frontend == "fuse-uring" and not URING_SWITCH.exists():
            import pytest

            # A kernel feature, not a dependency the tree can install.
            pytest.skip(f"this kernel ({os.uname().release}) has no FUSE over io_uring "
                        f"({URING_SWITCH} is missing)")
        args = ["attach", "--state-dir", self.state_dir]
        if frontend:
            args += ["--frontend", frontend]
        if new_device:
            args += ["--size", size, "--mode", mode]
            if not self.default_id:
                args += ["--client-id", self.client_id]
            for d in donors:
                args += ["--donor", donor_spec(d)]
        if swap:
            args += ["--swap", "--priority", "32767"]
        args += list(extra)
        if not self._registered:
            # Registered before the attach runs: an interrupted attach leaves
            # attach.json, which detach undoes (and then lets the swap lock go).
            self.teardown.add(f"swap lock of {self.state_dir}", self._release_swap)
            self.teardown.add(f"pagerctl detach {self.state_dir}", self._teardown_detach)
            self.teardown.add_log(self.state_dir / "nbdkit.log")
            self.teardown.add_log(self.state_dir / "serve.log")
            self._registered = True
        if "--swap" in args and not self._swap_held:
            SWAP.acquire()
            self._swap_held = True
        with machine.URING_SWITCH.held():
            p = run_pagerctl(args)
        self.attach_stderr = p.stderr
        self.device = p.stdout.strip().splitlines()[-1]
        pid = self.server_pid()
        if pid:
            self._pids.append(pid)
        return self.device

    def attach_json(self) -> dict | None:
        try:
            return json.loads((self.state_dir / "attach.json").read_text())
        except FileNotFoundError:
            return None

    def server_pid(self) -> int | None:
        """The process serving the device: `pagerctl serve`, nbdkit, or a
        restartable device's holder."""
        rec = self.attach_json()
        for step in (rec or {}).get("steps", []):
            if step["step"] in ("nbdkit", "fuse-server", "nbd-holder"):
                return step["pid"]
        return None

    def frontend(self) -> str | None:
        """The front end in use: fuse-uring, fuse or nbd."""
        st = self.status()
        return st["transport"] or st["frontend"]

    def detach(self) -> None:
        with machine.URING_SWITCH.held():
            run_pagerctl(["detach", "--state-dir", self.state_dir])
        self.device = None
        self._release_swap()

    def _release_swap(self) -> None:
        if self._swap_held:
            self._swap_held = False
            SWAP.release()

    def _teardown_detach(self) -> None:
        if self.attach_json() is not None:
            self.detach()

    def status(self) -> dict:
        """`pagerctl status --json`."""
        return json.loads(pagerctl_status(self.state_dir, "--json").stdout)

    def device_status(self) -> dict:
        """The device's own part of the status (status.json), once written."""
        return wait_for(lambda: self.status()["status"], 30, f"{self.state_dir}/status.json")

    def wait_status(self, predicate, timeout: float, what: str) -> dict:
        """Polls the device status until `predicate(status)` holds; returns it."""
        last = {}

        def check():
            nonlocal last
            last = self.status()["status"] or {}
            return last if last and predicate(last) else None

        try:
            return wait_for(check, timeout, what, interval=0.2)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last status: {json.dumps(last, indent=1)[:4000]}") from None

    def kill_server(self) -> None:
        """Crashes the client: SIGKILL to its serving process (a pid this test
        started through pagerctl, read from attach.json)."""
        pid = self.server_pid()
        assert pid and pid in self._pids, f"server pid {pid} is not one this test started"
        os.kill(pid, 9)
        wait_for(lambda: not pid_alive(pid), 10, f"client server {pid} to die")

    def holder(self) -> dict:
        """holder.json of a device attached --restartable (pagerctl hold)."""
        return json.loads((self.state_dir / "holder.json").read_text())

    def serving_pid(self, timeout: float = 30) -> int:
        """The restartable device's serving process, once one serves: a
        child of the holder this test started through pagerctl."""
        holder = self.server_pid()
        assert holder in self._pids, f"holder pid {holder} is not one this test started"

        nbd = (self.attach_json() or {}).get("frontend") == "nbd"

        def serving():
            try:
                h = self.holder()
                # Kernel nbd: the holder's nbdkit, once the kernel has it.
                pid = h["ready_pid"] if nbd else json.loads((self.state_dir / "serve.json").read_text())["pid"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                return None
            return pid if h.get("serve_pid") == pid and pid_alive(pid) and parent_pid(pid) == holder else None

        return wait_for(serving, timeout, "a serving process of the holder")

    def kill_serving_process(self) -> int:
        """kill -9 of the restartable device's serving process (a child of
        the holder this test started); returns its pid once it is gone."""
        pid = self.serving_pid()
        os.kill(pid, 9)
        wait_for(lambda: not pid_alive(pid), 10, f"serving process {pid} to die")
        return pid

    def leftovers(self) -> list[str]:
        """What a detach should have removed and is still there."""
        left = []
        if (self.state_dir / "attach.json").exists():
            left.append("attach.json")
        fuse_dir = self.state_dir / "fuse"
        if mounted(fuse_dir):
            left.append(f"FUSE mount {fuse_dir}")
        for dev in loop_devices_on(fuse_dir / "device"):
            left.append(f"loop device {dev}")
            if dev in swaps():
                left.append(f"swap on {dev}")
        left += [f"server pid {p}" for p in self._pids if pid_alive(p)]
        left += processes_mentioning(str(self.state_dir))
        if self.socket.exists():
            left.append(f"socket {self.socket}")
        for name in ("serve.json", "holder.json", "holder.sock"):
            if (self.state_dir / name).exists():
                left.append(name)
        return left
