"""The kernel's page cache in front of prefetchd: a block read once is read
again without reaching the daemon, the hinted job's later references to it
are passed over (not counted as misses), a file changed between opens is
never served from the old cache, and `--direct-io` sends every read to the
daemon. The assertions count reads and references, never time."""

from __future__ import annotations

import os

import pytest

from netpager_testkit.prefetch import Prefetchd, run_job, write_hints

BS = 8192
BLOCKS = 16


@pytest.fixture
def twice(tmp_path):
    """A 16-block file, a hint file reading all of it twice and one
    reading it once."""
    data = tmp_path / "data"
    data.mkdir()
    f = data / "f.bin"
    f.write_bytes(os.urandom(BLOCKS * BS))
    records = [("f.bin", b * BS, BS) for b in range(BLOCKS)]
    hints = write_hints(tmp_path / "twice.hints", "twice", records, repeat=2)
    write_hints(tmp_path / "once.hints", "once", records)
    return data, f, hints


def test_a_second_pass_is_served_by_the_page_cache(teardown, tmp_path, twice):
    data, f, hints = twice
    once = tmp_path / "once.hints"
    pd = Prefetchd(teardown, tmp_path, data, local_cache="1M")
    assert pd.status()["page_cache"] is True
    pd.add_job("twice", hints)
    r = run_job(teardown, tmp_path, once, pd.mount / "jobs" / "twice", reference=data)
    assert r["mismatches"] == 0 and r["records"] == BLOCKS, r
    first = pd.job("twice")
    assert first["stats"]["blocks"] >= BLOCKS and first["missed"] == 0, first
    # The second pass is the kernel's: no read reaches the daemon, and the
    # job's hinted references to it are passed over, not missed.
    r = run_job(teardown, tmp_path, once, pd.mount / "jobs" / "twice", reference=data, name="again")
    assert r["mismatches"] == 0, r
    j = pd.job("twice")
    assert j["stats"]["blocks"] == first["stats"]["blocks"], (first, j)
    assert j["page_cache_refs"] == BLOCKS and j["missed"] == 0, j
    assert j["state"] == "finished", j
    # The unhinted view is its own inode: its own first reads, then none.
    assert (pd.mount / "data" / "f.bin").read_bytes() == f.read_bytes()
    blocks = pd.status()["unhinted"]["blocks"]
    assert blocks >= BLOCKS
    assert (pd.mount / "data" / "f.bin").read_bytes() == f.read_bytes()
    assert pd.status()["unhinted"]["blocks"] == blocks
    assert pd.stop() == 0


def test_direct_io_sends_every_read_to_the_daemon(teardown, tmp_path, twice):
    data, _, hints = twice
    pd = Prefetchd(teardown, tmp_path, data, local_cache="1M", extra=["--direct-io"])
    assert pd.status()["page_cache"] is False
    pd.add_job("twice", hints)
    r = run_job(teardown, tmp_path, hints, pd.mount / "jobs" / "twice", reference=data)
    assert r["mismatches"] == 0, r
    j = pd.job("twice")
    assert j["stats"]["reads"] == j["stats"]["blocks"] == 2 * BLOCKS, j
    assert j["page_cache_refs"] == 0 and j["matched"] == 2 * BLOCKS, j
    assert pd.stop() == 0


def test_a_file_rewritten_with_its_size_is_not_served_from_the_old_cache(teardown, tmp_path, twice):
    data, f, _ = twice
    pd = Prefetchd(teardown, tmp_path, data, local_cache="1M")
    view = pd.mount / "data" / "f.bin"
    assert view.read_bytes() == f.read_bytes()
    # Unchanged: the next open keeps the kernel's copy.
    assert view.read_bytes() == f.read_bytes()
    blocks = pd.status()["unhinted"]["blocks"]
    st = f.stat()
    new = os.urandom(BLOCKS * BS)
    f.write_bytes(new)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert view.read_bytes() == new
    assert pd.status()["unhinted"]["blocks"] > blocks
    assert pd.stop() == 0
