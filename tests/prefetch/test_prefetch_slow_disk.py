"""With a slow one-request-at-a-time disk (nbdkit delay + noparallel behind
nbdfuse) and donors on loopback that have their own slow replicas, a hinted
job's reads are served by prefetched data: disk-to-global fills into the
donors, then global-to-local prefetches just in time. The assertions count
prefetches and hits, never time."""

from __future__ import annotations

import pytest

from netpager_testkit.prefetch import (Prefetchd, Replica, SlowDisk, donor_arg, generate, run_job,
                              without_file_declarations)

SCALE = 0.02  # 256 blocks of 8 KiB
RDELAY = "4ms"
# The donor tests read one block per local disk request: coalesced, the
# 2 MiB file takes the local disk about eight requests, leaving the donors
# little to do.
ONE_BLOCK = ["--coalesce", "8K"]


@pytest.fixture
def slow_random(teardown, tmp_path):
    """The random workload's data set on a slow disk: (manifest, data dir)."""
    ds = generate("random", tmp_path / "ds", SCALE)
    f = ds["files"][0]["path"]
    disk = SlowDisk(teardown, tmp_path, ds["data"] / f, f, rdelay=RDELAY)
    ds["hints_path"] = without_file_declarations(ds["hints_path"], tmp_path / "random.hints")
    return ds, disk.dir


def prefetched_share(stats: dict) -> float:
    """Share of the job's block reads served by data that prefetching
    brought closer: local hits (prefetched or re-read) plus global hits."""
    h = stats["hits"]
    return (h["local"] + h["global"]) / stats["blocks"]


def run_hinted(teardown, tmp_path, ds, data, donors, extra=()):
    # Direct I/O: every read reaches prefetchd, so its counters are the
    # job's whole read stream (the page cache would serve re-reads and,
    # with no readahead, split each block into page-sized reads).
    pd = Prefetchd(teardown, tmp_path, data, donors=donors, local_cache="1M",
                   extra=["--direct-io", *extra])
    pd.add_job("random", ds["hints_path"])
    result = run_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "random",
                     manifest=ds["manifest_path"], compute_us=250)
    assert result["mismatches"] == 0, result
    j = pd.job("random")
    assert pd.stop() == 0
    return j["stats"]


def test_slow_disk_without_prefetching_reads_every_block_from_disk(teardown, tmp_path, slow_random):
    ds, data = slow_random
    s = run_hinted(teardown, tmp_path, ds, data, [], extra=["--no-prefetch", "--readahead", "0"])
    assert s["hits"]["disk"] == s["blocks"] > 0, s
    assert s["disk_to_local"]["issued"] == s["global_to_local"]["issued"] == 0, s


def test_local_disk_prefetching_alone_hides_part_of_the_disk(teardown, tmp_path, slow_random):
    ds, data = slow_random
    s = run_hinted(teardown, tmp_path, ds, data, [])
    assert s["disk_to_local"]["used"] > s["blocks"] // 2, s
    assert s["disk_to_local"]["wasted"] == 0, s


def test_donors_with_replicas_serve_most_reads_from_prefetched_data(teardown, tmp_path, slow_random,
                                                                    memory_cluster):
    ds, data = slow_random
    donors = memory_cluster.start_donors(2, size="4M")
    reps = [Replica(teardown, tmp_path, ds["data"], d.addr, d.name, rdelay=RDELAY) for d in donors]
    s = run_hinted(teardown, tmp_path, ds, data, [donor_arg(d, r) for d, r in zip(donors, reps)],
                   extra=ONE_BLOCK)
    blocks = s["blocks"]
    assert s["disk_to_global"]["issued"] > blocks // 2, s
    assert s["disk_to_global"]["used"] > blocks // 2, s
    # How many blocks Forestall pulls ahead versus reads straight from a
    # donor depends on scheduling (a loaded machine delays the pulls); that
    # it pulls and that its pulls are used does not.
    assert s["global_to_local"]["used"] > 0, s
    assert prefetched_share(s) >= 0.8, s
    assert s["hits"]["disk"] < blocks // 5, s


def test_pager_server_donors_hold_prefetched_blocks(teardown, tmp_path, slow_random, cluster):
    """The same with the real donor plugin: one export per prefetchd."""
    ds, data = slow_random
    donors = cluster.start_donors(2, size="4M")
    reps = [Replica(teardown, tmp_path, ds["data"], d.addr, d.name, rdelay=RDELAY) for d in donors]
    s = run_hinted(teardown, tmp_path, ds, data,
                   [donor_arg(d, r, export="prefetchd@4M") for d, r in zip(donors, reps)], extra=ONE_BLOCK)
    assert s["disk_to_global"]["used"] > s["blocks"] // 2, s
    assert prefetched_share(s) >= 0.8, s
