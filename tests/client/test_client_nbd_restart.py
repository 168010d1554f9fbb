"""A restartable kernel nbd device (`attach --restartable --frontend nbd`,
pagerctl(1) RESTARTS): `pagerctl hold-nbd` holds /dev/nbdN; nbdkit is
killed with -9 while a job swaps through parity on 3 donors, then
replaced with `pagerctl restart`; the job verifies every page.

It needs /dev/nbd0 (the nbd module). Without it that test is skipped
whatever CI or NETPAGER_REQUIRE_SERVER say: no machine we test on has the
module, and that is no missing dependency of the tree. There, attach and
the holder are checked to refuse with the modprobe hint instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from netpager_testkit import swaps, wait_for
from netpager_testkit.client import MIB, Job, run_pagerctl

LIMIT = 32 * MIB

no_kernel_nbd = pytest.mark.skipif(
    not Path("/dev/nbd0").exists(),
    reason="no /dev/nbd0: the kernel nbd module is not loaded (modprobe nbd), so a restartable kernel nbd device cannot run here",
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


@no_kernel_nbd
def test_kill9_of_nbdkit_then_a_restart_while_swapping(teardown, donors, client, memhog, tmp_path):
    ds = donors(3)
    device = client.attach(ds, mode="parity", size="256M", swap=True, frontend="nbd",
                           extra=["--restartable"])
    assert device.startswith("/dev/nbd"), device
    assert client.status()["restartable"]
    # The job swaps until the kill and the restart are done, then verifies.
    job = Job(teardown, [memhog, str(3 * LIMIT)], LIMIT, tmp_path / "memhog.log", device, until=True)
    wait_for(lambda: job.swapped() >= 16 * MIB or not job.alive(), 300, f"16 MiB swapped out to {device}")
    assert job.alive(), f"the job ended before it swapped enough: {job.proc.log_tail()}"
    old = client.kill_serving_process()
    assert client.serving_pid() != old
    out = run_pagerctl(["restart", "--state-dir", client.state_dir]).stdout
    assert "replaced by" in out, out
    assert job.alive(), f"the job ended during the restarts: {job.proc.log_tail()}"
    job.stop()
    assert "memhog: OK" in job.finish()
    h = client.holder()
    assert h["restarts"] == 2 and h["crashes"] == 1 and h["expired"] == 0, h
    assert client.device_status()["totals"]["lost"] == 0
    client.detach()
    assert client.leftovers() == []
    assert device not in swaps()
