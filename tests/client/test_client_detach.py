"""detach has a deadline (`--timeout`, pagerctl(1) detach): a device whose
processes do not answer is detached all the same. The process serving it
is stopped (SIGSTOP) with the device attached, so the flush detach sends
through the device is never answered; detach ends once its deadline
passed, kills the processes attach started (SIGKILL, by pid) and names
them, and leaves nothing mounted, attached or running. Cases: pagerctl
serve, a restartable device's serving process (its holder killed with
it), and nbdkit behind nbdfuse."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from netpager_testkit.client import MIB, pid_alive
from netpager_testkit.paths import pagerctl

DEADLINE = 3

CASES = {
    "serve": ("fuse", ()),
    "held": ("fuse", ("--restartable",)),
    "nbdkit": ("nbd", ("--via", "nbdfuse")),
}


@pytest.mark.parametrize("case", CASES)
def test_detach_kills_processes_that_do_not_answer_at_its_deadline(case, teardown, donors, client, tmp_path):
    frontend, extra = CASES[case]
    ds = donors(1)
    device = client.attach(ds, mode="none", size="64M", frontend=frontend, extra=extra)
    # Written, so there is something to flush.
    with open(device, "wb") as f:
        f.write(os.urandom(4 * MIB))
    stopped = client.serving_pid() if case == "held" else client.server_pid()
    os.kill(stopped, signal.SIGSTOP)
    teardown.add(f"SIGCONT {stopped}", lambda: pid_alive(stopped) and os.kill(stopped, signal.SIGCONT))
    # A detach that waits forever fails here, at the harness's limit, not
    # at a guess of how long a detach takes.
    p = subprocess.run([str(pagerctl()), "detach", "--state-dir", str(client.state_dir),
                        "--timeout", str(DEADLINE)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"was not answered within the detach deadline ({DEADLINE}s)" in p.stderr, p.stderr
    assert "killed" in p.stderr and f"(pid {stopped}" in p.stderr, p.stderr
    assert not pid_alive(stopped)
    assert client.leftovers() == []
