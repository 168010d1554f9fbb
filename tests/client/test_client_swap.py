"""The client as swap: 4 donors on loopback, `pagerctl attach --swap` in each
mode and front end (restartable by default: classic FUSE behind a holder),
a job in a memory cgroup touching 3x its limit and verifying every page,
then `pagerctl detach` leaving nothing behind; the donors' memory given
back once a job that swapped exits (swap with discard)."""

from __future__ import annotations

from pathlib import Path

import pytest

from netpager_testkit.client import MIB, donor_spec, job_limit, pagerctl_status, run_memhog, run_pagerctl
from netpager_testkit.procs import has_cap_sys_resource, wait_for
from netpager_testkit import swaps
from netpager_testkit.attach import drain_swap_slot_caches, swap_slot_caches

LIMIT = job_limit(64 * MIB)


# (mode, --frontend, more attach options, the front end it gets, restartable):
# a swap device is restartable by default (classic FUSE and a holder);
# fuse-uring, and nbd without kernel nbd, cannot be, and say so.
CELLS = {
    "none": ("none", "fuse-uring", (), "fuse-uring", False),
    "mirror": ("mirror", "fuse-uring", (), "fuse-uring", False),
    "parity": ("parity", "fuse-uring", (), "fuse-uring", False),
    "disk": ("disk", "fuse-uring", (), "fuse-uring", False),
    "parity-default": ("parity", None, (), "fuse", True),
    "parity-fuse-not-restartable": ("parity", "fuse", ("--no-restartable",), "fuse", False),
    "parity-nbd": ("parity", "nbd", (), "nbd", False),
}


@pytest.mark.parametrize("cell", CELLS)
def test_swap_job_in_each_mode(cell, teardown, donors, client, memhog, tmp_path):
    mode, asked, extra, frontend, restartable = CELLS[cell]
    ds = donors(4)
    device = client.attach(ds, mode=mode, size="256M", swap=True, frontend=asked, extra=extra)
    assert device in swaps(), f"{device} is not swap: {swaps()}"
    assert client.frontend() == frontend
    assert client.status()["restartable"] is restartable
    said = "this swap device is not restartable" in client.attach_stderr
    assert said is (not restartable and not extra), client.attach_stderr
    # Whether the serving process can be an I/O flusher depends on the
    # machine (CAP_SYS_RESOURCE; nbdkit never asks): status says which, and
    # warns when it is not.
    full = client.status()
    if frontend != "nbd":
        assert full["io_flusher"] is has_cap_sys_resource(), full["io_flusher"]
    text = pagerctl_status(client.state_dir).stdout
    assert ("is not an I/O flusher" in text) is (full["io_flusher"] is False), text

    job = run_memhog(teardown, memhog, LIMIT, tmp_path / "memhog.log", device)
    assert "memhog: OK" in job.finish()
    assert job.swap_peak > LIMIT, f"only {job.swap_peak} bytes went to {device}"

    st = client.device_status()
    assert st["mode"] == mode
    # Home units, or (parity and ec) rows of the parity log: small writes
    # may all sit in the log when the job ends.
    placed = st["totals"]["units_placed"] + st["totals"].get("parity_log_used_bytes", 0)
    assert placed > 0 and st["totals"]["lost"] == 0, st["totals"]
    # The job's pages went to the donors (and, in mode disk, to the file too).
    written = sum(d.status().bytes_written for d in ds)
    assert written >= job.swap_peak, written
    if mode == "disk":
        wt = client.state_dir / "writethrough.img"
        assert wt.stat().st_blocks > 0, f"{wt} holds nothing"

    client.detach()
    assert client.leftovers() == []


def test_donors_give_memory_back_when_a_swap_job_exits(teardown, donors, client, memhog, tmp_path):
    """Mode parity swap, attached with discard (the default): when the job
    exits, the kernel discards the swap clusters it freed, the device trims
    them (whole parity groups freed, parity log copies dropped) and the
    donors' used bytes fall back to about what they held before the job."""
    ds = donors(4)
    device = client.attach(ds, mode="parity", size="256M", swap=True)

    def used() -> int:
        return sum(d.status().used_bytes for d in ds)

    before = used()
    job = run_memhog(teardown, memhog, LIMIT, tmp_path / "memhog.log", device)
    assert "memhog: OK" in job.finish()
    assert job.swap_peak > LIMIT, f"only {job.swap_peak} bytes went to {device}"
    written = sum(d.status().bytes_written for d in ds)
    assert written >= job.swap_peak, written

    at_exit = used() - before
    if swap_slot_caches():
        # In the test VM's 6.1 the caches kept 128-192 slots (2 CPUs), and
        # the donors 18-24 MiB for the 13-18 parity groups around them, until
        # something drained them (pagerctl(1), --no-discard).
        drain_swap_slot_caches(tmp_path)

    # What swap still holds (swap cache the kernel has not reclaimed yet)
    # may stay; the rest of the job's pages and their parity must go.
    last = {}

    def given_back():
        last.update(held=used() - before, swapped=swaps().get(device, 0))
        return last["held"] <= 2 * last["swapped"] + job.swap_peak // 8

    try:
        wait_for(given_back, 180, f"the donors to give back the job's {job.swap_peak >> 20} MiB of swap "
                                 f"(at its exit they held {at_exit >> 20} MiB more than before it)",
                 interval=0.5)
    except TimeoutError as e:
        raise AssertionError(f"{e}: they still hold {last['held'] >> 10} KiB more, swap "
                             f"{last['swapped'] >> 10} KiB; {client.device_status()['totals']}") from None
    st = client.device_status()
    assert st["totals"]["lost"] == 0, st["totals"]

    client.detach()
    assert client.leftovers() == []


def test_attach_failure_undoes_every_step(teardown, donors, client):
    # No kernel nbd module here: nbd-client has no device to connect, so the
    # attach fails after nbdkit started, and must stop it again.
    if Path("/sys/block/nbd0").exists():
        pytest.skip("this machine has kernel nbd devices")
    ds = donors(1)
    p = run_pagerctl(["attach", "--state-dir", client.state_dir, "--size", "64M", "--mode", "none",
                      "--donor", donor_spec(ds[0]), "--frontend", "nbd", "--via", "nbd-client"],
                     check=False)
    assert p.returncode != 0
    assert "modprobe nbd" in p.stderr, p.stderr
    assert "undoing" in p.stderr, p.stderr
    assert client.leftovers() == []
    # The device configuration stays: the next attach reuses it.
    assert (client.state_dir / "device.toml").exists()
    assert not (client.state_dir / "nbdkit.pid").exists()
