"""A restartable kernel nbd device (`attach --restartable --frontend nbd`,
pagerctl(1) RESTARTS): `pagerctl hold-nbd` holds /dev/nbdN while a job
swaps through parity and verifies every page:

- nbdkit is killed with -9, then replaced with `pagerctl restart`;
- nbdkit is stopped (SIGSTOP) for longer than `--nbd-timeout`: the kernel
  gives up on its connection and says so (`NBD_CMD_LINK_DEAD`); the holder
  kills the stuck nbdkit and reconnects the device to the next one.

They need /dev/nbd0 (the nbd module), which this machine's kernel lacks:
they run in the test VM (`make test-vm`, tests/vm), whose Debian kernel
has it, and are skipped elsewhere whatever CI says (the module is no
dependency the tree can install). Without the module, attach and the
holder are checked to refuse with the modprobe hint instead."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from netpager_testkit import swaps, wait_for
from netpager_testkit.client import MIB, Job, run_pagerctl

# Small: they run under software emulation in the test VM.
LIMIT = 16 * MIB
# The kernel's request timeout in the stall test: a stall past it makes
# the kernel give up on the connection.
NBD_TIMEOUT = 5

no_kernel_nbd = pytest.mark.skipif(
    not Path("/dev/nbd0").exists(),
    reason="no /dev/nbd0: the kernel nbd module is not loaded (modprobe nbd), so a restartable kernel nbd "
           "device cannot run here (make test-vm runs it in the test VM)",
)


@pytest.mark.skipif(Path("/dev/nbd0").exists(), reason="kernel nbd is there: the refusal is for machines without it")
def test_without_kernel_nbd_attach_and_the_holder_say_modprobe_nbd(client_built, tmp_path):
    state = tmp_path / "state"
    p = run_pagerctl(["attach", "--state-dir", state, "--restartable", "--frontend", "nbd", "--size", "64M",
                      "--mode", "none", "--client-id", "c", "--donor", "127.0.0.1:1"], check=False)
    assert p.returncode != 0 and "modprobe nbd" in p.stderr, p.stderr
    assert not (state / "attach.json").exists()
    # The holder itself, asked anyway: refused before it starts anything.
    p = run_pagerctl(["hold-nbd", "--state-dir", state, "--device", "/dev/nbd0", "--plugin", "/nonexistent"],
                     check=False)
    assert p.returncode != 0 and "modprobe nbd" in p.stderr, p.stderr
    assert not (state / "holder.sock").exists() and not (state / "nbd.sock").exists()


def swapping_job(teardown, donors, client, memhog, tmp_path, extra=()) -> tuple[str, Job]:
    """Parity on 4 donors (one more than a group needs) attached
    restartable on kernel nbd as swap, and a job (3x its cgroup's limit,
    one verify pass) that has swapped half its limit out to it and runs
    on."""
    ds = donors(4)
    device = client.attach(ds, mode="parity", size="256M", swap=True, frontend="nbd",
                           extra=["--restartable", *extra])
    assert device.startswith("/dev/nbd"), device
    assert client.status()["restartable"]
    # The job swaps until the kill and the restart are done, then verifies.
    job = Job(teardown, [memhog, str(3 * LIMIT)], LIMIT, tmp_path / "memhog.log", device, until=True)
    wait_for(lambda: job.swapped() >= LIMIT // 2 or not job.alive(), 300,
             f"{LIMIT // 2 >> 20} MiB swapped out to {device}")
    assert job.alive(), f"the job ended before it swapped enough: {job.proc.log_tail()}"
    return device, job


@no_kernel_nbd
def test_kill9_of_nbdkit_then_a_restart_while_swapping(teardown, donors, client, memhog, tmp_path):
    device, job = swapping_job(teardown, donors, client, memhog, tmp_path)
    old = client.kill_serving_process()
    assert client.serving_pid() != old
    out = run_pagerctl(["restart", "--state-dir", client.state_dir]).stdout
    assert "replaced by" in out, out
    assert job.alive(), f"the job ended during the restarts: {job.proc.log_tail()}"
    job.stop()
    assert "memhog: OK" in job.finish()
    h = client.holder()
    assert h["restarts"] == 2 and h["crashes"] == 1 and h["expired"] == 0, h
    assert h["link_dead"] == 0 and h["refused"] == 0, h
    assert client.device_status()["totals"]["lost"] == 0
    client.detach()
    assert client.leftovers() == []
    assert device not in swaps()


@no_kernel_nbd
def test_a_stall_past_the_request_timeout_replaces_the_stuck_nbdkit(teardown, donors, client, memhog,
                                                                    tmp_path):
    """nbdkit stopped while the job swaps: its requests go unanswered past
    --nbd-timeout, the kernel marks the connection dead and announces it
    (NBD_CMD_LINK_DEAD). The holder kills the stopped nbdkit (nothing it
    read may land after the kernel's retries) and gives the kernel the
    next one's socket. Without the notice the device would wait for a
    reconnect that never comes, then fail every request at the dead-conn
    timeout."""
    device, job = swapping_job(teardown, donors, client, memhog, tmp_path,
                               extra=["--nbd-timeout", str(NBD_TIMEOUT)])
    stuck = client.serving_pid()
    os.kill(stuck, signal.SIGSTOP)

    def replaced():
        h = client.holder()
        return h.get("link_dead", 0) >= 1 and h.get("ready_pid") not in (None, stuck)

    wait_for(replaced, 300, f"the holder to replace the stopped nbdkit {stuck}")
    assert "memhog: OK" in job.finish()
    h = client.holder()
    # Under emulation a slow request may outlast the timeout once more: the
    # kernel gives up again and the holder replaces that nbdkit too.
    assert h["link_dead"] >= 1 and h["restarts"] == h["link_dead"], h
    assert h["crashes"] == 0 and h["expired"] == 0 and h["refused"] == 0, h
    assert client.device_status()["totals"]["lost"] == 0
    client.detach()
    assert client.leftovers() == []
    assert device not in swaps()
