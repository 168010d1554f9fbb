"""prefetchd follows a donors file while a hinted job runs (--donors-file,
re-read each status-poll period): a line added is a donor joining (a lane
that gets blocks), a line removed is the donor let go as a draining one is
(its blocks forgotten, its export trimmed: the donor holds nothing of
prefetchd's), a file that does not parse changes nothing and is reported
with its line number. The job's bytes all verify throughout."""

from __future__ import annotations

from netpager_testkit import wait_for
from netpager_testkit.prefetch import Prefetchd, donor_arg, finish_job, generate, start_job

SCALE = 0.025


def line(d) -> str:
    return donor_arg(d, export="prefetchd@2M") + f",status={d.params['status']}"


def lanes_named(pd: Prefetchd, name: str) -> list[dict]:
    return [d for d in pd.status()["donors"] if d["name"] == name]


def test_donors_file_lines_added_and_removed_while_a_job_runs(teardown, tmp_path, cluster):
    ds = generate("cyclic-random", tmp_path / "ds", SCALE)
    d1, d2 = cluster.start_donors(2, size="4M", poll_ms=100)
    name1, name2 = (f"{d.addr}:{d.port}/prefetchd@2M" for d in (d1, d2))
    donors_file = tmp_path / "donors"
    donors_file.write_text(f"# prefetchd's donors\n{line(d1)}\n")
    pd = Prefetchd(teardown, tmp_path, ds["data"], local_cache="256K",
                   extra=["--donors-file", donors_file, "--status-poll-ms", "100"])
    wait_for(lambda: lanes_named(pd, name1), 30, "donor d1 to join from the donors file")
    assert [(d["joined"], d["state"]) for d in lanes_named(pd, name1)] == [("file", "serving")]
    pd.add_job("j", ds["hints_path"])
    job = start_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                    manifest=ds["manifest_path"], compute_us=4000, until=True)
    wait_for(lambda: lanes_named(pd, name1)[0]["used"] > 0 or not job.alive(), 60,
             "prefetchd to place blocks in donor d1")

    # A bad line: nothing changes, and the log names the line.
    donors_file.write_text(f"{line(d1)}\n{line(d2)}\n{d2.addr}:{d2.port}/x,slots=many\n")
    wait_for(lambda: "line 3" in pd.proc.log_path.read_text(), 30, "the bad donors file reported")
    assert lanes_named(pd, name2) == []

    # A line added: d2 joins and gets blocks.
    donors_file.write_text(f"{line(d1)}\n{line(d2)}\n")
    wait_for(lambda: lanes_named(pd, name2) and lanes_named(pd, name2)[0]["used"] > 0 or not job.alive(),
             60, "donor d2 to join and get blocks")
    assert job.alive(), job.log_tail()
    assert lanes_named(pd, name2)[0]["joined"] == "file"

    # A line removed: d1 is let go, its export trimmed, never taken back.
    donors_file.write_text(f"{line(d2)}\n")
    wait_for(lambda: lanes_named(pd, name1)[0]["state"] == "let go (removed)", 30, "d1 let go")
    wait_for(lambda: d1.status().used_bytes == 0, 30, "donor d1 to get its memory back")
    assert job.alive(), job.log_tail()

    result = finish_job(job)
    assert result["mismatches"] == 0 and result["records"] > 0, result
    lanes = {d["name"]: (d["life"], d["state"]) for d in pd.status()["donors"]}
    assert lanes == {name1: (1, "let go (removed)"), name2: (1, "serving")}, lanes
    assert d1.status().used_bytes == 0
    assert pd.stop() == 0
