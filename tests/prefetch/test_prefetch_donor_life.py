"""prefetchd follows its donors' lives through their status endpoints: a
donor turned draining while a hinted job runs is let go (its lane stops,
its blocks are forgotten, its export is trimmed so the donor's memory comes
back), and once it stops draining it gets a fresh lane. A drain that waits
for the donor to empty (`pagerctl donor-drain --wait`, what a rolling
update runs before it restarts a donor) finishes although prefetchd holds
blocks there. The job's bytes all verify throughout."""

from __future__ import annotations

import subprocess

from netpager_testkit import wait_for
from netpager_testkit.paths import pagerctl
from netpager_testkit.prefetch import Prefetchd, donor_arg, finish_job, generate, start_job

SCALE = 0.025


def lanes_of(pd: Prefetchd, donor: int) -> list[dict]:
    return [d for d in pd.status()["donors"] if d["donor"] == donor]


def hinted_job_on_watched_donors(teardown, tmp_path, cluster):
    """Two pager-server donors whose status prefetchd polls, and a hinted
    job running (until `finish_job`) once prefetchd has placed blocks in
    the first: (donors, prefetchd, job process)."""
    ds = generate("cyclic-random", tmp_path / "ds", SCALE)
    donors = cluster.start_donors(2, size="4M", poll_ms=100)
    args = [donor_arg(d, export="prefetchd@2M") + f",status={d.params['status']}" for d in donors]
    pd = Prefetchd(teardown, tmp_path, ds["data"], donors=args, local_cache="256K",
                   extra=["--status-poll-ms", "100"])
    pd.add_job("j", ds["hints_path"])
    job = start_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                    manifest=ds["manifest_path"], compute_us=4000, until=True)
    wait_for(lambda: pd.status()["donors"][0]["used"] > 0 or not job.alive(), 60,
             "prefetchd to place blocks in donor d1")
    return donors, pd, job


def test_a_draining_donor_is_let_go_and_taken_back_fresh(teardown, tmp_path, cluster):
    donors, pd, job = hinted_job_on_watched_donors(teardown, tmp_path, cluster)
    assert job.alive(), job.log_tail()
    assert donors[0].status().used_bytes > 0
    donors[0].status_client().drain(True)

    first = wait_for(lambda: next((d for d in lanes_of(pd, 0) if d["state"] == "let go (draining)"),
                                  None), 30, "prefetchd to let draining donor d1 go")
    assert first["life"] == 1 and not first["alive"] and first["used"] == 0, first
    # The export was trimmed: the donor holds nothing of prefetchd's.
    wait_for(lambda: donors[0].status().used_bytes == 0, 30, "donor d1 to get its memory back")
    assert job.alive(), job.log_tail()

    donors[0].status_client().drain(False)
    fresh = wait_for(lambda: next((d for d in lanes_of(pd, 0) if d["life"] == 2), None), 30,
                     "a fresh lane for donor d1")
    assert fresh["state"] == "serving" and fresh["alive"], fresh
    assert fresh["id"] != first["id"] and fresh["name"] == first["name"], (first, fresh)
    # The other donor served throughout.
    assert [d["life"] for d in lanes_of(pd, 1)] == [1]

    result = finish_job(job)
    assert result["mismatches"] == 0 and result["records"] > 0, result
    st = pd.status()
    assert [(d["donor"], d["life"], d["alive"]) for d in st["donors"]] == \
        [(0, 1, False), (1, 1, True), (0, 2, True)], st["donors"]
    assert "let go (draining)" in pd.cli("status").stdout
    assert pd.stop() == 0


def test_a_drain_that_waits_on_prefetchds_blocks_finishes(teardown, tmp_path, cluster):
    donors, pd, job = hinted_job_on_watched_donors(teardown, tmp_path, cluster)
    assert job.alive(), job.log_tail()
    assert donors[0].status().used_bytes > 0
    teardown.add("end donor d1's drain", lambda: donors[0].status_client().drain(False))
    drain = subprocess.run([str(pagerctl()), "donor-drain", donors[0].params["status"], "--wait",
                            "--wait-timeout", "120"], capture_output=True, text=True, timeout=180)
    assert drain.returncode == 0, f"the drain did not finish: {drain.stderr}"
    assert donors[0].status().used_bytes == 0
    lane = next(d for d in lanes_of(pd, 0) if d["life"] == 1)
    assert lane["state"] == "let go (draining)" and lane["used"] == 0, lane
    assert job.alive(), job.log_tail()
    result = finish_job(job)
    assert result["mismatches"] == 0 and result["records"] > 0, result
    assert pd.stop() == 0


def test_a_donor_killed_and_restarted_mid_job_comes_back_empty(teardown, tmp_path, cluster):
    donors, pd, job = hinted_job_on_watched_donors(teardown, tmp_path, cluster)
    donors[0].kill9()
    donors[0].start()
    fresh = wait_for(lambda: next((d for d in lanes_of(pd, 0) if d["life"] == 2), None), 30,
                     "a fresh lane for the restarted donor d1")
    assert fresh["state"] == "serving", fresh
    old = next(d for d in lanes_of(pd, 0) if d["life"] == 1)
    # The first life's blocks died with it: none is counted, none is read.
    assert not old["alive"] and old["used"] == 0, old
    assert job.alive(), job.log_tail()
    result = finish_job(job)
    assert result["mismatches"] == 0 and result["records"] > 0, result
    assert pd.stop() == 0
