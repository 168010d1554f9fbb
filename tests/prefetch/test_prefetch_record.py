"""A real application through the mount: the sqlite3 CLI scanning a
database whose leaf pages lie scattered over a slow one-request-at-a-time
disk. Its first run is recorded (`job add --record`), the second follows
the recording. The assertions check bytes, the recording and the status
counters, never time."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from netpager_testkit.ci import skip_or_fail
from netpager_testkit.prefetch import Prefetchd, SlowDisk, binary, scattered_db, sqlite_scan

RDELAY = "2ms"


@pytest.fixture(autouse=True)
def sqlite3_installed():
    if shutil.which("sqlite3") is None:
        skip_or_fail("sqlite3 is not installed (scripts/deps.sh)")


def test_a_recorded_run_makes_the_next_run_hinted(teardown, tmp_path):
    db = scattered_db(tmp_path / "scan.db", rows=12000)
    expected, _ = sqlite_scan(db)
    disk = SlowDisk(teardown, tmp_path, db, "scan.db", rdelay=RDELAY)
    pd = Prefetchd(teardown, tmp_path, disk.dir, local_cache="4M")
    rec = tmp_path / "scan.hints"
    pd.cli("job", "add", "scan", "--record", rec)
    j = pd.job("scan")
    assert j["recording"] == str(rec) and j["hints"] is None, j
    out, _ = sqlite_scan(pd.mount / "jobs" / "scan" / "scan.db")
    assert out == expected
    removed = pd.cli("job", "remove", "scan")
    assert str(rec) in removed.stderr
    assert not rec.with_name("scan.hints.part").exists()

    # The recording declares the file as it is: fresh against the data.
    check = subprocess.run([binary("pager-hints"), "check", rec, "--root", disk.dir],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    text = rec.read_text()
    assert "job scan" in text and "file scan.db " in text, text[:500]
    distinct = tmp_path / "distinct.hints"
    subprocess.run([binary("pager-hints"), "distinct", rec, distinct], check=True, capture_output=True)

    # The next run, by a daemon that has not cached anything yet.
    assert pd.stop() == 0
    pd = Prefetchd(teardown, tmp_path, disk.dir, local_cache="4M", name="prefetchd2")
    pd.add_job("scan", rec)
    out, _ = sqlite_scan(pd.mount / "jobs" / "scan" / "scan.db")
    assert out == expected
    j = pd.job("scan")
    s = j["stats"]
    assert j["stale"] == [] and j["missed"] <= j["matched"] // 10, j
    # sqlite reads 4 KiB pages: two reads per 8 KiB block.
    assert s["disk_to_local"]["used"] > s["blocks"] // 4, s
    assert s["hits"]["local"] > s["hits"]["disk"], s
    assert pd.stop() == 0


def test_a_recording_of_a_changed_file_is_stale(teardown, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    db = scattered_db(data / "scan.db", rows=2000)
    pd = Prefetchd(teardown, tmp_path, data, local_cache="1M")
    rec = tmp_path / "scan.hints"
    pd.cli("job", "add", "scan", "--record", rec)
    sqlite_scan(pd.mount / "jobs" / "scan" / "scan.db")
    pd.cli("job", "remove", "scan")
    with open(db, "ab") as f:
        f.write(b"\0" * 4096)
    added = pd.add_job("scan", rec)
    assert "stale hints ignored" in added.stderr and "scan.db" in added.stderr, added.stderr
    assert pd.stop() == 0
