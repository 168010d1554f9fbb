"""Donors failing under a running client: killed (-9) or hung (SIGSTOP) in
mirror and parity mode while a swapping job runs, two killed at once in
mode ec 4+2, killed in mode none (lost
extents reported, the rest intact), and drained while the job runs."""

from __future__ import annotations

import json
import signal

import pytest

from netpager_testkit.client import MIB, busiest, donor_report, nbd_errno, run_memhog, pagerctl_status, run_pagerctl
from netpager_testkit import wait_for
from netpager_testkit.machine import URING_SWITCH

LIMIT = 64 * MIB


def start_swapping_job(teardown, memhog, tmp_path, device, at_least=32 * MIB, until=False):
    """memhog touching 3x LIMIT in a memory cgroup, in the background, once
    `at_least` of it is on the swap device (`until`: swapping until
    `job.stop()`)."""
    job = run_memhog(teardown, memhog, LIMIT, tmp_path / "memhog.log", device, until=until)
    wait_for(lambda: job.swapped() >= at_least or not job.alive(), 300,
             f"{at_least >> 20} MiB swapped out to {device}")
    assert job.alive(), f"the job ended before it swapped enough: {job.proc.log_tail()}"
    return job


def after_failure_round(job) -> None:
    """Lets a job started with `until` verify one more round of every page
    (through the degraded device), then end."""
    rounds = job.rounds()
    wait_for(lambda: job.rounds() > rounds or not job.alive(), 600,
             "a verify round of the job after the failure")
    job.stop()


@pytest.mark.parametrize("mode", ["mirror", "parity"])
@pytest.mark.parametrize("failure", ["killed", "hung"])
def test_job_survives_a_failed_donor(mode, failure, teardown, donors, client, memhog, tmp_path):
    ds = donors(4)
    device = client.attach(ds, mode=mode, size="256M", swap=True,
                           extra=["--request-timeout", "2", "--connect-timeout", "2"])
    # The job swaps until the failure is detected and it has swapped on.
    job = start_swapping_job(teardown, memhog, tmp_path, device, until=True)
    victim = busiest(client, ds)
    if failure == "killed":
        victim.kill9()
    else:
        victim.sigstop()

    # Detected (by a broken connection, or by the request timeout when hung)
    # and reported: degraded units or a rebuild under way.
    seen = client.wait_status(lambda s: donor_report(s, victim.name)["failed"], 120,
                              f"donor {victim.name} marked failed")
    t = seen["totals"]
    assert t["degraded"] > 0 or t["rebuild"]["done"] > 0 or t["rebuild"]["active"], t
    after_failure_round(job)
    job.finish()
    # Rebuilt: every unit has all its copies again, none on the failed donor.
    final = client.wait_status(
        lambda s: s["totals"]["degraded"] == 0 and not s["totals"]["rebuild"]["active"], 180,
        "rebuild to finish")
    assert final["totals"]["lost"] == 0, final["totals"]
    gone = donor_report(final, victim.name)
    assert gone["failed"] and gone["extents_held"] == 0, gone
    if failure == "hung":
        victim.sigcont()
    client.detach()
    assert client.leftovers() == []


def test_ec_job_survives_two_donors_killed_at_once(teardown, donors, client, memhog, tmp_path):
    """Mode ec 4+2 as swap on 8 donors: the two busiest are killed with -9 at
    once mid-swap; the job completes with every page verified, the status
    shows the device degraded, then rebuilt onto the 6 left."""
    ds = donors(8)
    device = client.attach(ds, mode="ec", size="256M", swap=True,
                           extra=["--data", "4", "--parity", "2",
                                  "--request-timeout", "2", "--connect-timeout", "2"])
    job = start_swapping_job(teardown, memhog, tmp_path, device, until=True)
    st = client.wait_status(lambda s: any(d["extents_held"] > 0 for d in s["donors"]), 30,
                            "extents placed on donors")
    assert (st["code"], st["memory_overhead"], st["totals"]["can_lose"]) == ("4+2", 1.5, 2), st
    ranked = sorted(st["donors"], key=lambda d: d["extents_held"], reverse=True)
    victims = [next(d for d in ds if d.name == r["name"]) for r in ranked[:2]]
    # Both signalled before either is reaped: no rebuild comes between.
    for v in victims:
        v.proc.signal(signal.SIGKILL)
    for v in victims:
        v.kill9()

    seen = client.wait_status(lambda s: all(donor_report(s, v.name)["failed"] for v in victims), 120,
                              "both killed donors marked failed")
    t = seen["totals"]
    assert t["degraded"] > 0 or t["rebuild"]["done"] > 0 or t["rebuild"]["active"], t
    assert t["lost"] == 0, t
    after_failure_round(job)
    job.finish()
    final = client.wait_status(
        lambda s: s["totals"]["degraded"] == 0 and not s["totals"]["rebuild"]["active"], 300,
        "rebuild to finish")
    t = final["totals"]
    assert t["lost"] == 0 and t["can_lose"] == 2 and t["rebuild"]["done"] > 0, t
    for v in victims:
        gone = donor_report(final, v.name)
        assert gone["failed"] and gone["extents_held"] == 0, gone
    table = pagerctl_status(client.state_dir).stdout
    assert "ec (code 4+2)" in table and "1.50x" in table, table
    client.detach()
    assert client.leftovers() == []


def test_mode_none_reports_lost_extents_and_keeps_the_rest(teardown, donors, client):
    import nbd

    from netpager_testkit.nbdio import connect, pattern

    ds = donors(4)
    client.attach(ds, mode="none", size="64M", frontend="nbd", extra=["--request-timeout", "2"])
    size = 64 * MIB
    with connect(client.uri()) as h:
        for off in range(0, size, MIB):
            h.pwrite(pattern("none", off, MIB), off)
        h.flush()
    victim = busiest(client, ds)
    victim.kill9()

    with connect(client.uri()) as h:
        # Touch every extent so the client finds out which are gone.
        bad = set()
        for off in range(0, size, MIB):
            try:
                got = h.pread(MIB, off)
            except nbd.Error as e:
                assert nbd_errno(e) == "EIO", f"extent at {off}: {e}"
                bad.add(off // MIB)
                continue
            assert got == pattern("none", off, MIB), f"extent at {off} came back wrong"
    st = client.wait_status(lambda s: s["totals"]["lost"] > 0, 60, "lost extents reported")
    t = st["totals"]
    assert donor_report(st, victim.name)["failed"]
    assert set(t["lost_extents"]) == bad, (t["lost_extents"], sorted(bad))
    assert t["lost"] == len(bad) and 0 < len(bad) < 64
    table = pagerctl_status(client.state_dir).stdout
    assert "LOST extents:" in table and "FAILED" in table, table
    client.detach()
    assert client.leftovers() == []


def test_drain_moves_extents_while_the_job_runs(teardown, donors, client, memhog, tmp_path):
    ds = donors(4)
    device = client.attach(ds, mode="mirror", size="256M", swap=True, extra=["--epoch", "1"])
    job = start_swapping_job(teardown, memhog, tmp_path, device, until=True)
    victim = busiest(client, ds)
    host, port = victim.status_addr
    p = run_pagerctl(["donor-drain", f"{host}:{port}", "--wait", "--wait-timeout", "300"], timeout=360)
    assert "is empty" in p.stdout, p.stdout
    assert job.alive(), f"the job ended during the drain: {job.proc.log_tail()}"
    job.stop()
    job.finish()
    st = json.loads(run_pagerctl(["donor-status", f"{host}:{port}", "--json"]).stdout)
    assert st["used_bytes"] == 0 and st["state"] == "draining", st
    final = client.wait_status(lambda s: donor_report(s, victim.name)["extents_held"] == 0, 30,
                               f"status to show nothing on {victim.name}")
    assert final["totals"]["lost"] == 0 and final["totals"]["degraded"] == 0, final["totals"]
    run_pagerctl(["donor-drain", f"{host}:{port}", "--undo"])
    client.detach()
    assert client.leftovers() == []


def test_client_killed_while_swapping_leaves_a_kernel_that_answers(teardown, donors, client, memhog,
                                                                  tmp_path):
    """kill -9 of the serving process with a job swapping through it: the
    FUSE connection aborts, the job's swapped pages fail (it may die), but
    nothing hangs, and detach cleans everything up (pagerctl(1), CRASHES)."""
    ds = donors(3)
    device = client.attach(ds, mode="parity", size="256M", swap=True, frontend="fuse-uring")
    job = start_swapping_job(teardown, memhog, tmp_path, device)
    client.kill_server()
    # The job either finishes (its pages read back before the kill) or dies
    # of a failed swap-in; what it must not do is hang.
    assert job.proc.wait(120) is not None, "the job hangs after the client died"
    p = pagerctl_status(client.state_dir, "--json")
    st = json.loads(p.stdout)
    assert st["server"] and not st["server"]["alive"], st["server"]
    client.detach()
    assert client.leftovers() == []


def test_attach_turns_io_uring_on_and_detach_turns_it_back(teardown, donors, client):
    from pathlib import Path

    switch = Path("/sys/module/fuse/parameters/enable_uring")
    if not switch.exists():
        pytest.skip("this kernel has no FUSE over io_uring")
    # Machine-wide: no other test run mounts or flips it meanwhile.
    URING_SWITCH.hold(teardown)
    old = switch.read_text().strip()
    teardown.add(f"{switch} back to {old}", lambda: switch.write_text(old))
    switch.write_text("N")
    ds = donors(1)
    client.attach(ds, mode="none", size="64M", frontend="fuse-uring")
    assert switch.read_text().strip() == "Y"
    st = client.status()
    assert st["transport"] == "fuse-uring" and st["transport_fallback"] is None, st
    assert any(s["step"] == "uring-switch" and s["old"] == "N" for s in st["steps"]), st["steps"]
    client.detach()
    assert switch.read_text().strip() == "N"
    assert client.leftovers() == []
