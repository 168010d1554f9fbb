"""The nemesis's verifying workloads, each running until told to stop and
then verifying: fio (verify=crc32c, several jobs) and the history writer
on device A, memhog through swap in a memory cgroup on device C. Each keeps
what went wrong as `Trouble` for the runner to pick up after every op."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..attach import swap_priorities
from ..blockio import BlockWorkload
from ..cgroup import MemoryCgroup
from ..cleanup import Teardown
from ..procs import OwnedProcess, tail

MIB = 1 << 20
PAGE = 4096


@dataclass
class Trouble:
    """What a workload saw: `kind` is corrupt (a read returned other
    bytes than the last written), eio (an I/O error), oom or job (the job
    failed otherwise); `what` says where, with its log."""
    kind: str
    what: str


def fio_errors(output: str, log: Path) -> str:
    """fio's lines that say what went wrong (else its log's tail)."""
    lines = [ln.strip() for ln in output.splitlines()
             if re.search(r"verify|error|bad |fio: ", ln) and "verify_" not in ln
             and not ln.startswith("$ fio")
             # fio warns of this whenever jobs share a file; ours never overlap.
             and "multiple writers may overwrite" not in ln]
    return " | ".join(lines[:6]) + f" (log {log})" if lines else tail(log, 12)


def classify_fio(output: str) -> str:
    """eio (an I/O error: EIO or another errno, ENOSPC say), corrupt (a
    verify failure) or job (fio failed otherwise)."""
    out = "\n".join(ln for ln in output.splitlines() if not ln.startswith("$ fio"))
    if re.search(r"verify: |verify failed|bad magic|bad header", out):
        return "corrupt"
    if re.search(r"io_u error|error=\w", out):
        return "eio"
    return "job"


class FioLoop:
    """fio on `jobs` disjoint regions of a block device, pass after pass
    until `stop`: a pass writes every block of each region in random
    order (`verify=crc32c`: random bytes, a header with the offset and the
    pass's seed, a checksum), then reads them all back and verifies, so it
    holds writes in flight while ops and faults happen. A pass's blocks sit
    4 KiB off the last pass's (the shift cycles over four): a block a lost
    write left from the pass before has no header where one is expected,
    which fio's checks see (they would not see an older copy of a block
    at the same place: its header and checksum are right). `stop` lets the
    pass under way finish, verification included."""

    SHIFTS = 4

    def __init__(self, teardown: Teardown, device: str, workdir: Path, seed: int, jobs: int = 4,
                 region: int = 8 * MIB, offset: int = 0, iodepth: int = 8):
        self.device, self.workdir, self.seed = device, Path(workdir), seed
        self.jobs, self.region, self.offset, self.iodepth = jobs, region, offset, iodepth
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.passes = 0
        self.verified_bytes = 0
        self.trouble: list[Trouble] = []
        self.last: int | None = None     # the last pass that completed
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.proc: subprocess.Popen | None = None
        teardown.add(f"fio loop on {device}", self.kill)

    @property
    def size(self) -> int:
        """Bytes of the device the loop uses, from `offset`."""
        return self.jobs * self.region

    def args(self, n: int) -> list[str]:
        shift = (n % self.SHIFTS) * PAGE
        bs = 16 * 1024
        return ["--name=nemesis", f"--filename={self.device}", "--direct=1", "--ioengine=libaio",
                f"--iodepth={self.iodepth}", "--rw=randwrite", f"--bs={bs}",
                f"--size={self.region - self.SHIFTS * PAGE}", f"--offset={self.offset + shift}",
                f"--offset_increment={self.region}", f"--numjobs={self.jobs}",
                "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_dump=0",
                f"--randseed={self.seed * 100003 + n}", "--group_reporting",
                "--output-format=normal"]

    def _fio(self, args: list[str], log: Path) -> tuple[int, str]:
        with open(log, "w") as f:
            f.write("$ fio " + " ".join(args) + "\n")
            f.flush()
            self.proc = subprocess.Popen(["fio"] + args, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir,
                                         start_new_session=True)
            rc = self.proc.wait()
        return rc, log.read_text(errors="replace")

    def _run(self) -> None:
        n = self.passes
        while not self.stop_event.is_set():
            log = self.workdir / f"fio-{n % 2}.log"
            rc, out = self._fio(self.args(n), log)
            if rc != 0:
                if rc in (-signal.SIGKILL, -signal.SIGTERM) and self.stop_event.is_set():
                    return
                self.trouble.append(Trouble(classify_fio(out), f"fio pass {n} on {self.device} "
                                            f"failed ({rc}): {fio_errors(out, log)}"))
                return
            self.passes, self.last = n + 1, n
            self.verified_bytes += self.jobs * (self.region - self.SHIFTS * PAGE)
            n += 1

    def start(self) -> "FioLoop":
        self.stop_event.clear()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fio loop")
        self.thread.start()
        return self

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self, timeout: float = 300) -> None:
        """Lets the pass under way finish (and verify), starts no other."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                self.kill()
                self.trouble.append(Trouble("job", f"fio on {self.device} did not finish its pass "
                                            f"within {timeout:.0f}s of the stop: I/O hangs"))
            self.thread = None

    def kill(self) -> None:
        self.stop_event.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def verify_last(self, device: str) -> None:
        """Reads back and verifies the last completed pass's blocks
        (`--verify_only`) on `device` (the device again, after a re-attach)."""
        self.device = device
        if self.last is None:
            return
        log = self.workdir / "fio-verify-only.log"
        rc, out = self._fio(self.args(self.last) + ["--verify_only"], log)
        if rc != 0:
            self.trouble.append(Trouble(classify_fio(out), f"fio --verify_only of pass {self.last} "
                                        f"on {device} failed ({rc}): {fio_errors(out, log)}"))
        else:
            self.verified_bytes += self.jobs * (self.region - self.SHIFTS * PAGE)


class History(BlockWorkload):
    """The history workload: every block's generations as acknowledged, every
    read checked against them (netpager_testkit.blockio), with its troubles
    in the nemesis's terms. `pause` stops its threads (for a full read or a
    detach) and `resume` starts them again."""

    def troubles(self) -> list[Trouble]:
        out = []
        if self.corrupt:
            out.append(Trouble("corrupt", f"history on {self.device}: reads returned other bytes "
                                          f"than the last written: {self.corrupt[:5]}"))
        errs = {**self.write_errors, **{f"read {k}": v for k, v in self.read_errors.items()}}
        if errs:
            out.append(Trouble("eio", f"history on {self.device}: I/O errors {errs}"))
        return out

    def pause(self) -> None:
        self.stop()

    def resume(self) -> None:
        self.stop_event.clear()
        self.start()

    def check_all(self) -> list[Trouble]:
        """Reads every block (threads paused): wrong bytes or errors."""
        res = self.verify_all()
        out = []
        if res["corrupt"]:
            out.append(Trouble("corrupt", f"history on {self.device}: {len(res['corrupt'])} blocks "
                               f"read back wrong: {[self.diagnose(b) for b in res['corrupt'][:3]]}"))
        if res["lost"]:
            out.append(Trouble("eio", f"history on {self.device}: {len(res['lost'])} blocks fail to "
                               f"read: {res['lost'][:10]}"))
        return out


class MemhogLoop:
    """tests/jobs/memhog in a memory cgroup, one run after another until
    `stop`: each touches 3x the cgroup's limit, so most of it goes through
    the swap device, and verifies every page twice (a wrong page ends it
    with status 1 naming the page; a page the device could not read back
    kills it with SIGBUS). `stop` lets the run under way finish.

    Swap is the kernel's, not the job's: while another swap area of the
    same priority or higher is on (another test's, on a shared machine),
    the job's pages may go there, and what happens to them says nothing
    about `device`. A run that fails then ends the loop with a note naming
    the other areas, not a trouble. A run the cgroup's OOM killer ends
    (reclaim outran the swap device, under a fault) is a note too: no
    byte was read wrong."""

    def __init__(self, teardown: Teardown, memhog: Path, limit: int, workdir: Path, seed: int,
                 device: str):
        self.teardown, self.memhog, self.limit, self.device = teardown, memhog, limit, device
        self.workdir, self.seed = Path(workdir), seed
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cgroup = MemoryCgroup(teardown, limit)
        self.runs = 0
        self.verified_bytes = 0
        self.trouble: list[Trouble] = []
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.proc: OwnedProcess | None = None
        self.shared: set[str] = set()  # other swap areas the run under way shared
        self.notes: list[str] = []

    def _run(self) -> None:
        while not self.stop_event.is_set():
            n = self.runs
            log = self.workdir / f"memhog-{n % 2}.log"
            log.unlink(missing_ok=True)
            oom_before = self.cgroup.oom_kills()
            argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup.procs_file),
                    str(self.memhog), str(3 * self.limit), "--passes", "1",
                    "--seed", str(self.seed * 1000 + n)]
            # A killed run may wait for its swap-ins first: a minute to go.
            self.proc = OwnedProcess(argv, log, self.teardown, f"memhog run {n}", stop_timeout=60)
            self.shared = set()
            deadline = time.monotonic() + 1800
            rc = None
            while rc is None and time.monotonic() < deadline:
                prio = swap_priorities()
                mine = prio.get(self.device, 1 << 16)
                self.shared |= {f"{d} (priority {p})" for d, p in prio.items()
                                if d != self.device and p >= mine}
                rc = self.proc.wait(1)
            if rc == -signal.SIGKILL and self.stop_event.is_set():
                return  # stop() gave up waiting and killed it: said there
            if rc != 0 and self.shared:
                self.notes.append(f"memhog run {n} exited {rc} while other swap areas took its "
                                  f"pages too ({', '.join(sorted(self.shared))}): its verdict says "
                                  "nothing of this device; no more runs")
                return
            if rc is None:
                self.proc.kill9()
                self.trouble.append(Trouble("job", f"memhog run {n} still running after 30 min: "
                                            f"{tail(log, 5)}"))
                return
            out = log.read_text(errors="replace")
            if rc == 0:
                m = re.search(r"pages=(\d+)", out)
                self.verified_bytes += 2 * int(m.group(1)) * PAGE if m else 0
                self.runs = n + 1
                continue
            if self.cgroup.oom_kills() > oom_before:
                self.notes.append(f"memhog run {n} was OOM-killed in its cgroup")
                self.runs = n + 1
                continue
            if rc == -signal.SIGBUS:
                kind = "eio"
            elif rc == 1:
                kind = "corrupt"
            else:
                kind = "job"
            self.trouble.append(Trouble(kind, f"memhog run {n} exited {rc}: {tail(log, 6)}"))
            return

    def start(self) -> "MemhogLoop":
        self.stop_event.clear()
        self.thread = threading.Thread(target=self._run, daemon=True, name="memhog loop")
        self.thread.start()
        return self

    def stop(self, timeout: float = 600) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                if self.proc is not None:
                    self.proc.kill9()
                what = f"memhog did not finish its run within {timeout:.0f}s of the stop"
                if self.shared:
                    self.notes.append(f"{what}, while other swap areas took its pages too "
                                      f"({', '.join(sorted(self.shared))})")
                else:
                    self.trouble.append(Trouble("job", f"{what}: swap hangs"))
            self.thread = None

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

