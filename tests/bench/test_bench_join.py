"""Live membership's benchmarks (`make bench-client WHICH=join`, `WHICH=epochs`,
netpager_testkit.bench_join): how they tell when a newcomer holds its share
and which reads overlapped an epoch, then each in its shortest configuration,
checking the files it writes (never the numbers)."""

from __future__ import annotations

import json
import shutil

from netpager_testkit import bench_client
from netpager_testkit.bench_join import share_reached, split_by_epochs
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.client import client_plugin
from netpager_testkit.paths import pagerctl

TINY = {"ROUNDS": "1", "LIMIT": "8M", "JOIN_BS": "1", "JOIN_EPOCH": "0.5",
        "EPOCH_DONORS": "2", "EPOCH_SECS": "0.2", "EPOCH_RUNTIME": "2"}


def sample(t, d1, d2, d3=None):
    extents = {"d1": d1, "d2": d2, **({} if d3 is None else {"d3": d3})}
    return {"t": t, "extents": extents}


def test_share_is_counted_from_the_join_on_the_extents_donors_hold():
    samples = [sample(1, 10, 10), sample(2, 10, 10, 30), sample(3, 10, 10, 0),
               sample(4, 20, 20, 35), sample(5, 20, 20, 36)]
    # Half of the 75 held at t=4 is 37.5, 90% of that 33.75: d3 holds 35.
    assert share_reached(samples, "d3", 0.5, after=3) == 4
    # Before the join nothing counts, even a sample that would qualify.
    assert share_reached(samples, "d3", 0.5, after=1.5) == 2
    assert share_reached(samples, "d3", 0.6, after=3) is None
    # Nor after the job ended.
    assert share_reached(samples, "d3", 0.5, after=3, until=3.5) is None


def test_reads_are_split_by_whether_they_overlapped_an_epoch():
    # Epochs at 1000 ms (2.5 ms long) and 2000 ms (0.3 ms long).
    epochs = [(1000, 2500), (2000, 300)]
    ios = [(990, 50.0),      # well before: between
           (1000, 60.0),     # completed in the epoch's first ms: during
           (1003, 70.0),     # within the epoch widened to whole ms: during
           (1004, 900.0),    # started at 1003.1, before the epoch's end widened: during
           (1006, 80.0),     # after: between
           (2001, 40.0),     # the short epoch: during
           (2500, 40.0)]     # between
    during, between = split_by_epochs(ios, epochs)
    assert sorted(during) == [40.0, 60.0, 70.0, 900.0]
    assert sorted(between) == [40.0, 50.0, 80.0]


def test_join_and_epochs_tiny(root, donor_plugin, memhog, tmp_path, monkeypatch):
    for tool in ("nbdkit", "fio", "findmnt", "losetup", "swapon", "zramctl", "nbdfuse"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} not installed (make deps)")
    for path in (pagerctl(), client_plugin()):
        if not path.exists():
            skip_or_fail(f"{path} missing (make build)")
    for k, v in TINY.items():
        monkeypatch.setenv(k, v)
    assert bench_client.main(["join", "epochs", "--out", str(tmp_path)]) == 0

    join = json.loads((tmp_path / "join.json").read_text())
    assert (tmp_path / "join.txt").read_text().splitlines() == join["table"]
    r = join["results"]
    assert set(r["b"]) == {"1.0"}
    for runs in r["b"].values():
        (run,) = runs
        assert run["joined_s"] is not None and run["seconds"] > 0
        assert run["share_target"] == 0.5
        # The newcomer is in the set by the end (a tiny job may have placed
        # nothing more after the join), and samples name only the device's donors.
        assert run["newcomer"] in run["samples"][-1]["extents"], run["samples"]
        assert all(set(s["extents"]) <= {"d1", "d2", "d3"} for s in run["samples"])
    assert set(r["simulate"]["rows"]) == {"1.0"}
    assert (tmp_path / "join.png").read_bytes().startswith(b"\x89PNG")

    epochs = json.loads((tmp_path / "epochs.json").read_text())
    assert (tmp_path / "epochs.txt").read_text().splitlines() == epochs["table"]
    assert set(epochs["results"]["summary"]) == {"2"}
    for n, (run,) in epochs["results"]["rounds"].items():
        assert run["epochs"] > 0 and len(run["wall_us"]) == run["epochs"]
        assert run["ios_between"] > 0
