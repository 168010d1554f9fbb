"""prefetchd's commands and its life: status as a table and JSON, job
registration, a read-only view, and nothing left behind however it ends."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from netpager_testkit import wait_for
from netpager_testkit.attach import mounted
from netpager_testkit.prefetch import (Prefetchd, Replica, binary, donor_arg, generate, run_job,
                                       start_job, unmount)


@pytest.fixture
def dataset(tmp_path):
    return generate("hotcold", tmp_path / "ds", 0.01)


def test_job_commands_and_status_table_and_json(teardown, tmp_path, dataset):
    # Direct I/O: every one of the job's reads reaches prefetchd and is
    # counted (with the page cache, re-reads never do).
    pd = Prefetchd(teardown, tmp_path, dataset["data"], local_cache="512K", extra=["--direct-io"])
    pd.add_job("hot", dataset["hints_path"])
    assert pd.cli("job", "list").stdout.split() == ["hot"]
    assert os.listdir(pd.mount / "jobs") == ["hot"]
    assert sorted(os.listdir(pd.mount / "jobs" / "hot")) == sorted(os.listdir(dataset["data"]))
    again = pd.cli("job", "add", "hot", dataset["hints_path"], check=False)
    assert again.returncode != 0 and "already registered" in again.stderr
    result = run_job(teardown, tmp_path, dataset["hints_path"], pd.mount / "jobs" / "hot",
                     manifest=dataset["manifest_path"], limit=300)
    assert result["mismatches"] == 0

    table = pd.cli("status").stdout.splitlines()
    assert table[0].split()[:3] == ["JOB", "STATE", "POSITION"]
    row = next(line for line in table if line.startswith("hot "))
    assert row.split()[1] == "following", table
    st = pd.status()
    j = pd.job("hot")
    assert j["position"] >= 300 and j["stats"]["reads"] == 300, j
    hits = j["stats"]["hits"]
    assert hits["local"] + hits["global"] + hits["disk"] == j["stats"]["blocks"], j
    for level in ("global_to_local", "disk_to_local", "disk_to_global"):
        assert set(j["stats"][level]) == {"issued", "used", "wasted"}
    assert st["local"]["blocks"] == 64 and st["block_size"] == 8192, st
    assert json.loads(pd.cli("status", "--json").stdout)["jobs"][0]["name"] == "hot"

    pd.cli("job", "remove", "hot")
    assert pd.cli("job", "list").stdout.strip() == ""
    gone = pd.cli("job", "remove", "hot", check=False)
    assert gone.returncode != 0 and "no job" in gone.stderr
    assert pd.stop() == 0


def test_the_view_is_read_only(teardown, tmp_path, dataset):
    pd = Prefetchd(teardown, tmp_path, dataset["data"])
    name = dataset["files"][0]["path"]
    for path in (pd.mount / "data" / name, pd.mount / "data" / "new-file"):
        with pytest.raises(OSError) as e:
            os.open(path, os.O_WRONLY | os.O_CREAT)
        assert e.value.errno in (errno.EROFS, errno.EACCES), e.value
    assert (dataset["data"] / name).stat().st_size == dataset["files"][0]["size"]
    assert pd.stop() == 0


def test_sigterm_unmounts_and_removes_the_socket(teardown, tmp_path, dataset):
    pd = Prefetchd(teardown, tmp_path, dataset["data"])
    fd = os.open(pd.mount / "data" / dataset["files"][0]["path"], os.O_RDONLY)
    try:
        assert len(os.pread(fd, 100, 0)) == 100
    finally:
        os.close(fd)
    assert pd.stop() == 0
    assert not mounted(pd.mount)
    assert not pd.control.exists()


def test_sigkill_leaves_a_mount_that_teardown_removes(teardown, tmp_path, dataset):
    pd = Prefetchd(teardown, tmp_path, dataset["data"])
    pd.proc.kill9()
    assert mounted(pd.mount)
    unmount(pd.mount)
    assert not mounted(pd.mount)
    # A new daemon can take over the mount point and the stale socket.
    pd2 = Prefetchd(teardown, tmp_path, dataset["data"], name="second")
    assert pd2.stop() == 0


def scratch_mount(teardown, tmp_path):
    """A mount point unmounted by the teardown should prefetchd mount it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    teardown.add(f"mount {mnt}", lambda: unmount(mnt))
    return mnt


def test_an_unreachable_donor_fails_the_start_cleanly(teardown, tmp_path, dataset):
    mnt = scratch_mount(teardown, tmp_path)
    p = subprocess.run([str(binary("prefetchd")), "--control", str(tmp_path / "c.sock"), "serve",
                        "--data", str(dataset["data"]), "--mount", str(mnt),
                        "--donor", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "donor 127.0.0.1:1" in p.stderr, p.stderr
    assert not mounted(mnt) and not (tmp_path / "c.sock").exists()


def test_a_replica_of_the_wrong_size_is_refused(teardown, tmp_path, dataset, memory_cluster):
    d = memory_cluster.start_donors(1, size="1M")
    # The second "replica" is a 64 KiB memory disk, smaller than the 1 MiB data set.
    d += memory_cluster.start_donors(1, size="64K")
    mnt = scratch_mount(teardown, tmp_path)
    p = subprocess.run([str(binary("prefetchd")), "--control", str(tmp_path / "c.sock"), "serve",
                        "--data", str(dataset["data"]), "--mount", str(mnt),
                        "--donor", f"{d[0].addr}:{d[0].port},replica={d[1].addr}:{d[1].port}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "replica layout needs" in p.stderr, p.stderr
    assert not mounted(mnt)


def test_stopping_with_fills_queued_on_its_donors_exits_cleanly(teardown, tmp_path, memory_cluster):
    """SIGTERM while disk-to-global fills wait on slow replicas: the
    stopping lanes fail what they hold, and the planner plans nothing on
    them again. It once did, fill after failed fill on the failing lane's
    own stack, until prefetchd died of a stack overflow (found by the
    flake hunt: it needed fills queued at the moment of the stop)."""
    ds = generate("random", tmp_path / "ds", 0.02)
    donors = memory_cluster.start_donors(2, size="4M")
    reps = [Replica(teardown, tmp_path, ds["data"], d.addr, d.name, rdelay="50ms") for d in donors]
    pd = Prefetchd(teardown, tmp_path, ds["data"], local_cache="256K",
                   donors=[donor_arg(d, r) for d, r in zip(donors, reps)])
    pd.add_job("j", ds["hints_path"])
    job = start_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                    manifest=ds["manifest_path"], compute_us=250, until=True)
    # A replica read takes 50 ms, one at a time: most fills wait in queues.
    wait_for(lambda: pd.job("j")["stats"]["disk_to_global"]["issued"] > 0, 60,
             "disk-to-global fills on the donors")
    # The reader goes (its open files would keep the mount busy); the job's
    # hints, and the fills they planned, stay.
    job.kill9()
    assert pd.stop() == 0, pd.proc.log_tail()
