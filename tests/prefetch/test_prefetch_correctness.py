"""Every byte read through prefetchd's mount is the file's byte: for every
reference workload, with and without donors, with hints that are right,
wrong, stale, malformed or absent, and when a donor dies mid-run."""

from __future__ import annotations

import os
import random

import pytest

from netpager_testkit.prefetch import (Prefetchd, Replica, donor_arg, generate, run_job,
                              write_hints)

WORKLOADS = ["render", "oo7", "hotcold", "random", "reverse", "cyclic-hotcold", "cyclic-random",
             "cyclic-reverse", "sequential", "hashjoin"]
# ~2-3 MB per data set: a few hundred blocks, far more than the caches below.
SCALE = 0.025


def check_job(result: dict) -> None:
    assert result["mismatches"] == 0, result
    assert result["records"] > 0 and result["bytes"] > 0, result


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_workload_reads_true_bytes_without_donors(teardown, tmp_path, workload):
    ds = generate(workload, tmp_path / "ds", SCALE)
    # 32 blocks of local cache: constant eviction.
    pd = Prefetchd(teardown, tmp_path, ds["data"], local_cache="256K")
    pd.add_job("j", ds["hints_path"])
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                      manifest=ds["manifest_path"]))
    j = pd.job("j")
    assert j["stats"]["disk_to_local"]["issued"] > 0, j
    # The same reads again without hints.
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "data",
                      manifest=ds["manifest_path"], name="unhinted"))
    assert pd.status()["unhinted"]["blocks"] > 0
    assert pd.stop() == 0


@pytest.mark.parametrize("workload", ["render", "cyclic-random", "hashjoin"])
def test_workloads_read_true_bytes_with_donors_and_replicas(teardown, tmp_path, workload, memory_cluster):
    ds = generate(workload, tmp_path / "ds", SCALE)
    donors = memory_cluster.start_donors(2, size="1M")
    # One donor reads from its replica, the other from the local disk;
    # 64 slots each, far less than the data set: global evictions too.
    rep = Replica(teardown, tmp_path, ds["data"], donors[0].addr, "d1", rdelay="1ms")
    args = [donor_arg(donors[0], rep, slots=64), donor_arg(donors[1], slots=64)]
    pd = Prefetchd(teardown, tmp_path, ds["data"], donors=args, local_cache="256K")
    pd.add_job("j", ds["hints_path"])
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                      manifest=ds["manifest_path"], compute_us=50))
    st = pd.status()
    j = pd.job("j")
    assert j["stats"]["disk_to_global"]["issued"] > 0, j
    assert j["stats"]["global_to_local"]["used"] + j["stats"]["hits"]["global"] > 0, j
    assert all(d["alive"] for d in st["donors"]), st["donors"]
    assert pd.stop() == 0


def test_wrong_hints_demote_the_job_and_never_break_reads(teardown, tmp_path, memory_cluster):
    ds = generate("random", tmp_path / "ds", SCALE)
    f = ds["files"][0]
    nblocks = f["size"] // 8192
    order = list(range(nblocks))
    random.Random(5).shuffle(order)
    wrong = write_hints(tmp_path / "wrong.hints", "wrong", [(f["path"], b * 8192, 8192) for b in order])
    donors = memory_cluster.start_donors(1, size="1M")
    pd = Prefetchd(teardown, tmp_path, ds["data"], donors=[donor_arg(donors[0])], local_cache="256K")
    pd.add_job("j", wrong)
    # The job really reads in the generator's order, not the hinted one.
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                      manifest=ds["manifest_path"]))
    j = pd.job("j")
    assert j["demotions"] >= 1 and j["missed"] > j["matched"], j
    # Demoted (or, having searched its way through the hints, finished).
    assert j["state"] in ("unhinted", "finished"), j
    assert pd.stop() == 0


def test_stale_hints_are_reported_and_ignored(teardown, tmp_path):
    ds = generate("reverse", tmp_path / "ds", SCALE)
    f = ds["data"] / ds["files"][0]["path"]
    # Same bytes, new mtime: the hints no longer describe this file.
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    pd = Prefetchd(teardown, tmp_path, ds["data"], local_cache="256K")
    out = pd.add_job("j", ds["hints_path"])
    assert "stale hints ignored" in out.stderr and "mtime differs" in out.stderr, out.stderr
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                      manifest=ds["manifest_path"]))
    j = pd.job("j")
    assert j["stale"] and j["hint_stream"]["ignored_stale"] == j["hint_stream"]["records"] > 0, j
    assert j["stats"]["disk_to_local"]["issued"] == 0, j
    assert "stale hints ignored" in pd.cli("status").stdout
    assert pd.stop() == 0


def test_a_file_changed_while_served_is_never_served_stale(teardown, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    f = data / "f.bin"
    f.write_bytes(os.urandom(64 * 1024))
    pd = Prefetchd(teardown, tmp_path, data, local_cache="1M")
    view = pd.mount / "data" / "f.bin"
    assert view.read_bytes() == f.read_bytes()
    new = os.urandom(80 * 1024)
    f.write_bytes(new)
    assert view.read_bytes() == new
    assert pd.stop() == 0


def test_malformed_hints_are_refused_and_the_daemon_keeps_serving(teardown, tmp_path):
    ds = generate("random", tmp_path / "ds", SCALE)
    bad = tmp_path / "bad.hints"
    bad.write_text("netpager-hints 1\njob bad\nblock-size 8192\nrecords\nrandom.dat 0 8192\nrandom.dat x 1\n")
    pd = Prefetchd(teardown, tmp_path, ds["data"])
    p = pd.cli("job", "add", "bad", bad, check=False)
    assert p.returncode != 0 and "bad.hints:6" in p.stderr, p.stderr
    assert pd.cli("job", "list").stdout.strip() == ""
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "data",
                      manifest=ds["manifest_path"]))
    assert pd.stop() == 0


def test_a_donor_killed_mid_run_loses_only_speed(teardown, tmp_path, memory_cluster):
    ds = generate("cyclic-random", tmp_path / "ds", SCALE)
    donors = memory_cluster.start_donors(2, size="2M")
    pd = Prefetchd(teardown, tmp_path, ds["data"], donors=[donor_arg(d) for d in donors],
                   local_cache="256K")
    pd.add_job("j", ds["hints_path"])
    # Read some, kill a donor holding prefetched blocks, read everything.
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                      manifest=ds["manifest_path"], limit=200))
    assert pd.status()["donors"][0]["used"] > 0
    donors[0].kill9()
    check_job(run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "data",
                      manifest=ds["manifest_path"]))
    st = pd.status()
    assert [d["alive"] for d in st["donors"]] == [False, True], st["donors"]
    assert pd.stop() == 0
