"""A restartable device (`attach --restartable`, pagerctl(1) RESTARTS): the
serving process killed with -9 while a job swaps through parity 3 on 4
donors (with requests in flight), the same with a donor killed right after
the restart (5 donors), five kills in a row, `pagerctl restart` onto a
second binary, and the holder itself killed. The job verifies every page
each time. A kill gets a donor more than the groups need: Debian's nbdkit
1.32 may abort when the serving process dies with requests in flight
(pagerctl(1) RESTARTS), and the device must then rebuild, not lose."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from netpager_testkit.client import (MIB, Job, busiest, device_ios, donor_report, pagerctl_status, pid_alive,
                                    run_pagerctl)
from netpager_testkit.paths import pagerctl
from netpager_testkit import swaps, wait_for

LIMIT = 32 * MIB


def attach_restartable(client, ds, extra=()):
    device = client.attach(ds, mode="parity", size="256M", swap=True,
                           extra=["--restartable", *extra])
    assert client.frontend() == "fuse", client.status()
    assert client.status()["restartable"]
    return device


def swapping_job(teardown, memhog, tmp_path, device, at_least: int = 16 * MIB, until: bool = False):
    """memhog touching 3x LIMIT in a memory cgroup (one verify round, or
    rounds until `job.stop()` with `until`), in the background, once
    `at_least` of it is on the swap device."""
    job = Job(teardown, [memhog, str(3 * LIMIT), "--passes", "1"], LIMIT,
              tmp_path / "memhog.log", device, until=until)
    wait_for(lambda: job.swapped() >= at_least or not job.alive(), 300,
             f"{at_least >> 20} MiB swapped out to {device}")
    assert job.alive(), f"the job ended before it swapped enough: {job.proc.log_tail()}"
    return job


def loop_inflight(device: str) -> int:
    reads, writes = Path(f"/sys/block/{Path(device).name}/inflight").read_text().split()
    return int(reads) + int(writes)


def kill_with_requests_in_flight(client, device) -> int:
    """kill -9 of the serving process at a moment the loop device has
    requests in flight (so some are read and unanswered at the kill)."""
    client.serving_pid()
    wait_for(lambda: loop_inflight(device) > 0, 60, f"requests in flight on {device}", interval=0.001)
    return client.kill_serving_process()


def test_kill9_of_the_serving_process_while_swapping(teardown, donors, client, memhog, tmp_path):
    ds = donors(4)
    device = attach_restartable(client, ds)
    job = swapping_job(teardown, memhog, tmp_path, device, until=True)
    old = kill_with_requests_in_flight(client, device)
    new = client.serving_pid()
    assert new != old
    served_by_the_new_process(client, device, job)
    job.stop()
    assert "memhog: OK" in job.finish()
    h = client.holder()
    assert h["restarts"] == 1 and h["crashes"] == 1, h
    assert h["resent_total"] >= 1, f"no request was resent after the kill: {h}"
    st = client.status()
    assert st["holder"]["info"]["restarts"] == 1 and st["warning"] is None, st["holder"]
    text = pagerctl_status(client.state_dir).stdout
    assert "1 restarts (1 after a crash)" in text and "requests resent" in text, text
    assert client.device_status()["totals"]["lost"] == 0
    client.detach()
    assert client.leftovers() == []


def test_kill9_then_a_donor_killed_during_recovery(teardown, donors, client, memhog, tmp_path):
    # Two donors to rebuild onto (parity groups are 3 wide): the one killed,
    # and one nbdkit 1.32 may lose to the kill of the serving process.
    ds = donors(5)
    device = attach_restartable(client, ds, extra=["--request-timeout", "2", "--connect-timeout", "2"])
    job = swapping_job(teardown, memhog, tmp_path, device, until=True)
    victim = busiest(client, ds)
    kill_with_requests_in_flight(client, device)
    client.serving_pid()
    victim.kill9()
    served_by_the_new_process(client, device, job)
    job.stop()
    assert "memhog: OK" in job.finish()
    st = client.device_status()
    assert st["totals"]["lost"] == 0, st["totals"]
    assert client.holder()["crashes"] == 1
    client.detach()
    assert client.leftovers() == []


def served_by_the_new_process(client, device, job, requests: int = 256) -> None:
    """Waits until the restarted device has completed `requests` more of the
    job's requests since its new serving process took over."""
    client.serving_pid()
    base = device_ios(device)

    def served():
        assert job.alive(), f"the job ended during the kills: {job.proc.log_tail()}"
        return device_ios(device) - base >= requests

    wait_for(served, 300, f"{requests} requests served on {device} after a restart")


def restart_aborted_donors(client, ds) -> None:
    """A donor that nbdkit 1.32 aborted under the kill (pagerctl(1)
    RESTARTS) is started again once the device has marked it failed, and
    taken back as a new, empty donor before the next kill: the spare
    covers one abort, this any number of them."""
    dead = [d for d in ds if not d.alive()]
    for d in dead:
        client.wait_status(lambda s, d=d: donor_report(s, d.name)["failed"], 120,
                           f"donor {d.name} (aborted) marked failed")
        d.start()
    if dead:
        client.wait_status(lambda s: not any(donor_report(s, d.name)["failed"] for d in dead), 120,
                           "the aborted donors taken back")


def test_five_kills_in_a_row(teardown, donors, client, memhog, tmp_path):
    ds = donors(4)
    device = attach_restartable(client, ds)
    # The job swaps until the five kills are done, then verifies every page.
    job = swapping_job(teardown, memhog, tmp_path, device, until=True)
    for _ in range(5):
        client.kill_serving_process()
        served_by_the_new_process(client, device, job)
        restart_aborted_donors(client, ds)
    job.stop()
    assert "memhog: OK" in job.finish()
    h = client.holder()
    assert h["restarts"] == 5 and h["crashes"] == 5, h
    client.detach()
    assert client.leftovers() == []


def test_restart_onto_a_second_binary_under_the_job(teardown, donors, client, memhog, tmp_path):
    """`pagerctl restart --binary` (an upgrade): the pid changes, the new
    process runs the new binary, swap is never off, every page verifies."""
    ds = donors(3)
    device = attach_restartable(client, ds)
    second = tmp_path / "second" / "pagerctl"
    second.parent.mkdir()
    shutil.copy2(pagerctl(), second)
    job = swapping_job(teardown, memhog, tmp_path, device, until=True)
    old = client.serving_pid()
    off = []
    done = threading.Event()

    def watch_swap():
        while not done.is_set():
            if device not in swaps():
                off.append(time.monotonic())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch_swap)
    watcher.start()
    try:
        out = run_pagerctl(["restart", "--state-dir", client.state_dir, "--binary", second]).stdout
    finally:
        done.set()
        watcher.join()
    assert "requests were held" in out, out
    new = client.serving_pid()
    assert new != old
    assert Path(f"/proc/{new}/exe").resolve() == second.resolve()
    served_by_the_new_process(client, device, job)
    job.stop()
    assert "memhog: OK" in job.finish()
    assert not off, "swap went off during the restart"
    h = client.holder()
    assert h["restarts"] == 1 and h["crashes"] == 0 and h["binary"] == str(second.resolve()), h
    client.detach()
    assert client.leftovers() == []


def test_holder_killed_status_warns_before_anything_is_lost(teardown, donors, client):
    ds = donors(3)
    client.attach(ds, mode="parity", size="64M", extra=["--restartable"])
    serving = client.serving_pid()
    holder = client.server_pid()
    assert json.loads(pagerctl_status(client.state_dir, "--json").stdout)["warning"] is None
    os.kill(holder, 9)
    wait_for(lambda: not pid_alive(holder), 10, f"holder {holder} to die")
    assert pid_alive(serving), "the serving process went with its holder"
    st = client.status()
    assert st["warning"] and "holder is gone" in st["warning"], st
    text = pagerctl_status(client.state_dir).stdout
    assert "WARNING: the connection holder is gone" in text, text
    p = run_pagerctl(["restart", "--state-dir", client.state_dir], check=False)
    assert p.returncode != 0 and "holder" in p.stderr, p.stderr
    client.detach()
    wait_for(lambda: not pid_alive(serving), 30, f"serving process {serving} to exit")
    assert client.leftovers() == []
