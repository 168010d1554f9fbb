"""Processes the harness starts and owns, and only those.

Every process is started by `OwnedProcess` (a Popen child, in its own
session so a terminal's Ctrl-C reaches the harness first and the harness
stops things in the right order). Signals go only to a pid that is still
ours: not yet reaped by us and with the start time /proc recorded when we
started it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

from .cleanup import Teardown


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is in parentheses and may itself contain spaces.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])


# Every OwnedProcess still referenced, for the stuck-test rescue (rescue_stuck).
_owned: "weakref.WeakSet[OwnedProcess]" = weakref.WeakSet()


def tail(path, lines: int = 40) -> str:
    """Last `lines` lines of a log file, or a note that it is missing."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


class OwnedProcess:
    """A child process with its output in a log file, stopped on teardown;
    `pass_fds` stay open in it (as in subprocess.Popen)."""

    def __init__(self, argv: list[str], log_path, teardown: Teardown, name: str,
                 env: dict | None = None, stop_timeout: float = 10.0, pass_fds=()):
        self.argv = [str(a) for a in argv]
        self.name = name
        self.log_path = Path(log_path)
        self.stop_timeout = stop_timeout
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, pass_fds=pass_fds)
        self.pid = self.popen.pid
        self.start_time = proc_start_time(self.pid)
        teardown.add_log(self.log_path)
        teardown.add(f"process {name} pid {self.pid}", self.stop)
        _owned.add(self)

    def owned(self) -> bool:
        """True while the pid is still the process we started."""
        return (self.popen.poll() is None
                and self.start_time is not None
                and proc_start_time(self.pid) == self.start_time)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Sends `sig` if the pid is still ours; a gone process is not an error."""
        if self.owned():
            os.kill(self.pid, sig)

    def sigstop(self, timeout: float = 10.0) -> None:
        """SIGSTOP, returning once every thread is stopped: kill() returns
        before the threads reach their stop, and a thread still running may
        answer one more request, which a test of a hung process must not see."""
        self.signal(signal.SIGSTOP)

        def all_stopped() -> bool:
            states = []
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                try:
                    stat = (task / "stat").read_text()
                except OSError:
                    continue  # a thread that just ended
                states.append(stat[stat.rindex(")") + 2])
            return bool(states) and all(s in "Tt" for s in states)

        wait_for(all_stopped, timeout, f"{self.name} pid {self.pid} to stop on SIGSTOP",
                 interval=0.01)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill9(self) -> int | None:
        """SIGKILL and reap."""
        self.signal(signal.SIGKILL)
        return self.wait(self.stop_timeout)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case it is stopped), then SIGKILL; reaps it."""
        if not self.alive():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.wait(self.stop_timeout) is None:
            self.signal(signal.SIGKILL)
            if self.wait(self.stop_timeout) is None:
                raise RuntimeError(f"{self.name} pid {self.pid} survived SIGKILL")

    def session_pids(self) -> list[int]:
        """Live processes of the session this process leads (it was started
        in a new one), started after it: the children it left behind."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or self.start_time is None:
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            f = stat[stat.rindex(")") + 2:].split()
            # state, ppid, pgrp, session, ..., starttime (fields 3, 4, 5, 6, 22)
            if int(f[3]) == self.pid and f[0] not in "ZX" and int(f[19]) >= self.start_time:
                out.append(int(d.name))
        return out

    def stop_session(self) -> None:
        """stop(), then SIGKILL to what is left of its session (a tool's
        workers and their ssh connections, say)."""
        self.stop()
        for pid in self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Polls `predicate` until it returns a true value; raises naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def has_cap_sys_resource() -> bool:
    """CAP_SYS_RESOURCE (bit 24) in this process's effective set: what
    PR_SET_IO_FLUSHER and oom_score_adj -1000 need. Root in a container may
    lack it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def rescue_stuck(what: str) -> None:
    """For a test that its timeout could not interrupt (its main thread is
    blocked in C, say libnbd waiting on a stopped donor, where SIGALRM's
    Python handler never runs): prints every thread's stack, then SIGKILLs
    every process the harness owns, so sockets and FUSE mounts they serve
    close, the blocked call returns an error and the timeout, then the
    teardown, run as usual (conftest.py fails the test)."""
    print(f"\nnetpager: {what} is stuck past its timeout; stacks, then its "
          "processes are killed", file=sys.__stderr__, flush=True)
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    for proc in list(_owned):
        for pid in proc.session_pids() if proc.owned() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.signal(signal.SIGCONT)
        proc.signal(signal.SIGKILL)
