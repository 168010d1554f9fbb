"""The benchmarks' harness cannot rot: each benchmark of `make bench-client`,
`make bench-server`, `make bench-prefetch`, `make bench-apps` and `make
bench-ab` runs here in its shortest configuration (tiny sizes, one round,
one front end), in-process so that the test's own exit paths undo
what it set up. Checks the structure of the files each writes, never timing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from netpager_testkit import Teardown, bench_ab, bench_apps, bench_client, bench_prefetch, bench_server
from netpager_testkit.bench import MEMORY_FS, disk_workdir, fs_type
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.client import client_plugin
from netpager_testkit.paths import pagerctl, server_plugin, target_dir, using_target_dir
from netpager_testkit.prefetch import missing_binaries

# The shortest configuration of every knob the benchmarks read.
TINY_CLIENT = {"RUNTIME": "1", "RAMP": "0", "FIO_ROUNDS": "1", "ROUNDS": "1", "FIO_SIZE": "16M",
               "LIMIT": "16M", "LINK_RATE": "1G", "MODES": "parity disk", "SWAP_MODES": "parity",
               "SWAP_SETTINGS": "loopback", "FRONTENDS": "fuse-uring@0", "DEPTH_QDS": "16",
               "DEPTH_MODES": "none", "RESTARTS": "2", "RESTART_EVERY": "1"}
TINY_PREFETCH = {"BENCH_SCALE": "0.002", "BENCH_DELAY": "1ms", "BENCH_DONORS": "1",
                 "BENCH_WORKLOADS": "render", "BENCH_ROUNDS": "1", "BENCH_APP_ROWS": "2000",
                 "BENCH_APP_DELAY": "1ms", "BENCH_APP_ROUNDS": "1"}
# Each program once, at its shortest size, through one set-up (netpager
# parity with the prefetcher, so every part of the netpager path runs).
TINY_APPS = {"ROUNDS": "1", "FRACTIONS": "50", "SETUPS": "parity+pf", "REDIS_KEYS": "20000",
             "REDIS_VALUE": "512", "REDIS_GETS": "5000", "GRAPH_VERTICES": "20000",
             "SORT_MIB": "16", "RUNTIME": "1", "TIMEOUT": "300"}
TINY_AB = {"ROUNDS": "1", "RUNTIME": "1", "RAMP": "0", "LIMIT": "16M", "FIO_SIZE": "16M",
           "FRONTEND": "fuse-uring"}
FIO_COLUMNS = ["randread_iops", "randwrite_iops", "read_MBps", "write_MBps"]


@pytest.fixture
def tools():
    for tool in ("nbdkit", "nbdfuse", "fio", "zramctl", "findmnt"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} not installed (make deps)")


def written(out, name: str) -> dict:
    """The JSON a benchmark wrote, checked against its text table."""
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["bench"] == name
    assert (out / f"{name}.txt").read_text().splitlines() == doc["table"]
    return doc


def test_work_directory_skips_memory_file_systems(tmp_path):
    if shutil.which("findmnt") is None:
        skip_or_fail("findmnt not installed (make deps)")
    if fs_type(tmp_path) in MEMORY_FS:
        skip_or_fail(f"{tmp_path} is itself on {fs_type(tmp_path)}: no real disk to pick")
    # /dev/shm is tmpfs on Linux: a write-through file there would be RAM.
    assert fs_type(Path("/dev/shm")) == "tmpfs"
    with Teardown("work directory") as td:
        work = disk_workdir(td, "np-bench-", [Path("/dev/shm"), tmp_path])
        assert work.parent == tmp_path and work.is_dir()
        td.close_or_raise()
    assert not work.exists()


def test_bench_server_tiny(tools, donor_plugin, tmp_path, monkeypatch):
    for k, v in {"ROUNDS": "1", "RUNTIME": "1", "SIZE": "16M"}.items():
        monkeypatch.setenv(k, v)
    assert bench_server.main(["--out", str(tmp_path)]) == 0
    doc = written(tmp_path, "server")
    assert doc["knobs"] == {"rounds": 1, "runtime": 1, "size": "16M"}
    assert set(doc["results"]["iops"]) == set(bench_server.TESTS)
    for test, by_server in doc["results"]["iops"].items():
        assert set(by_server) == set(bench_server.SERVERS)
        assert all(list(rounds) == ["1"] and rounds["1"] > 0 for rounds in by_server.values())
        assert doc["results"]["summary"][test]["median_ratio"] > 0
    assert any(line.startswith("randread       pager-server") for line in doc["table"])


def test_bench_server_compress_tiny(tools, donor_plugin, tmp_path, monkeypatch, capsys):
    # Pages of log lines, which zstd packs smaller than lz4: the cold
    # setting's reads meet repacked pages.
    pages = tmp_path / "text.pages"
    lines = b"".join(b"%08d netpager donor extent epoch level=%d\n" % (i, i % 7) for i in range(80_000))
    pages.write_bytes(lines[:(len(lines) // 4096) * 4096])
    for k, v in {"ROUNDS": "1", "RUNTIME": "1", "PAGES": str(pages), "COMPRESS": "off cold"}.items():
        monkeypatch.setenv(k, v)
    assert bench_server.main(["--out", str(tmp_path)]) == 0
    repacked = re.search(r"cold: (\d+) pages repacked", capsys.readouterr().err)
    assert repacked and int(repacked[1]) > 0
    doc = written(tmp_path, "server")
    assert doc["knobs"]["compress"] == ["off", "cold"] and doc["knobs"]["pages"] == str(pages)
    res = doc["results"]["compress"]
    assert list(res) == list(bench_server.COMPRESS_METRICS)
    assert all(len(m["rounds"][c]) == 1 for m in res.values() for c in ("off", "cold"))
    # CPU seconds come in clock ticks: a tiny run may read 0.
    assert all(min(m["rounds"][c]) > 0 for k, m in res.items() for c in ("off", "cold") if not k.startswith("cpu"))
    assert any(line.startswith("QD1 4K randread mean") and "x)" in line for line in doc["table"])
    monkeypatch.setenv("COMPRESS", "off lz5")
    with pytest.raises(SystemExit, match="unknown lz5"):
        bench_server.main(["--out", str(tmp_path)])


def test_bench_client_tiny(root, tools, donor_plugin, memhog, tmp_path, monkeypatch):
    for path in (pagerctl(), client_plugin(), target_dir() / "examples" / "fuse-memory"):
        if not path.exists():
            skip_or_fail(f"{path} missing (make build)")
    for k, v in TINY_CLIENT.items():
        monkeypatch.setenv(k, v)
    assert bench_client.main(["--out", str(tmp_path)]) == 0

    donors = written(tmp_path, "donors")["results"]
    assert donors["columns"] == FIO_COLUMNS
    assert set(donors["donors"]) == {"1", "2", "4"}
    assert all(len(v) == 4 and min(v) > 0 for v in donors["donors"].values())

    modes = written(tmp_path, "modes")
    assert modes["knobs"]["modes"] == ["parity", "disk"]
    assert list(modes["results"]["modes"]) == ["none", "parity", "disk"]
    for m in modes["results"]["modes"].values():
        assert m["donors"] == 4 and len(m["fio"]) == 4 and m["memory"].count("/") == 1
    assert "parity/none" in "\n".join(modes["table"])
    # The disk mode's write-through file sat on a real disk, and the table says where.
    assert any("write-through file" in line for line in modes["table"])

    swap = written(tmp_path, "swap")["results"]
    assert list(swap["seconds"]) == ["client:fuse-uring@0+parity/loopback", "proxy/loopback",
                                     "memory/loopback", "floor", "zram", "file"]
    assert all(len(s["rounds"]) == 1 for s in swap["seconds"].values())
    assert swap["touch_bytes"] == 3 * swap["limit_bytes"] == 48 << 20

    latency = written(tmp_path, "latency")["results"]["us"]
    assert set(latency) == {"fuse-uring@0", "direct"}
    assert all(len(v["randread"]) == len(v["randwrite"]) == 1 for v in latency.values())

    depth = written(tmp_path, "depth")
    cols = ["randread QD16", "randwrite QD16", "1M read", "1M write"]
    assert depth["results"]["columns"] == cols
    assert list(depth["results"]["best"]) == ["floor", "none", "direct", "bound"]
    assert all(len(v) == 4 and min(v) > 0 for v in depth["results"]["best"].values())
    assert any(line.startswith("none/direct") for line in depth["table"])

    restart = written(tmp_path, "restart")["results"]
    assert len(restart["held_ms"]) == len(restart["stall_ms"]) == restart["restarts"] == 2
    assert restart["jobs"] >= 1


def held_ratio(m: dict) -> float:
    """Bytes written over bytes held, of DonorMemory figures."""
    return m["logical"] / m["stored"]


def test_bench_client_swap_compress_tiny(root, tools, donor_plugin, memhog, tmp_path, monkeypatch):
    """COMPRESS: the swap job's client set-up once per donor compress=
    setting, alternating, with what the donors held; COMPRESSIBLE makes
    memhog's pages three quarters zeros, which lz4 keeps small. The
    client alone (SWAP_TARGETS=""): test_bench_client_tiny runs the rest."""
    for path in (pagerctl(), client_plugin(), target_dir() / "examples" / "fuse-memory"):
        if not path.exists():
            skip_or_fail(f"{path} missing (make build)")
    for k, v in {**TINY_CLIENT, "COMPRESS": "off lz4", "COMPRESSIBLE": "75", "SWAP_TARGETS": ""}.items():
        monkeypatch.setenv(k, v)
    assert bench_client.main(["swap", "--out", str(tmp_path)]) == 0
    doc = written(tmp_path, "swap")
    assert (doc["knobs"]["compress"], doc["knobs"]["compressible"]) == (["off", "lz4"], 75)
    assert doc["knobs"]["swap_targets"] == []
    r = doc["results"]
    client = "client:fuse-uring@0+parity/loopback"
    assert list(r["seconds"]) == [f"{client}@off", f"{client}@lz4"]
    for c in ("off", "lz4"):
        (held,) = r["seconds"][f"{client}@{c}"]["donors"]
        # The donors ran with the setting, by their own status.
        assert held["compress"] == [c]
        assert held["peak"]["stored"] > 0 and held["peak"]["logical"] > 0
        assert min(held["end"].values()) >= 0
    both = r["compress"][client]
    assert both["off"]["time_ratio"] == 1.0 and both["lz4"]["time_ratio"] > 0
    # off keeps pages raw (a status reads its two figures a write apart:
    # 1%); lz4 keeps a page three quarters zeros in far less.
    assert held_ratio(both["off"]["peak"]) <= 1.01
    assert held_ratio(both["lz4"]["peak"]) > 1.5
    assert both["lz4"]["peak_ratio"] < 1.0
    assert any(line.strip().startswith("lz4 / off: ") and "(target <= 1.05x)" in line for line in doc["table"])


def test_bench_client_discard_tiny(root, tools, donor_plugin, memhog, tmp_path, monkeypatch):
    """`make bench-client WHICH=discard`: the swap job with and without discard."""
    for path in (pagerctl(), client_plugin()):
        if not path.exists():
            skip_or_fail(f"{path} missing (make build)")
    for k, v in {**TINY_CLIENT, "SETTLE": "1"}.items():
        monkeypatch.setenv(k, v)
    assert bench_client.main(["discard", "--out", str(tmp_path)]) == 0
    doc = written(tmp_path, "discard")
    assert doc["knobs"]["settle"] == 1
    r = doc["results"]
    assert (r["mode"], r["frontend"], r["touch_bytes"]) == ("parity", "fuse-uring@0", 48 << 20)
    assert list(r["runs"]) == ["discard", "no-discard"]
    for run in r["runs"].values():
        assert len(run["seconds"]) == len(run["held_at_exit"]) == len(run["held_after"]) == 1
        assert run["seconds"][0] > 0
    assert any(line.startswith("no-discard") for line in doc["table"])


def test_bench_client_rebalance_tiny(root, tools, donor_plugin, memhog, tmp_path, monkeypatch):
    """`make bench-client WHICH=rebalance`: reads beside the rebalancer's
    moves and beside none, then the swap job with a join, the rebalancer
    on and off."""
    if not pagerctl().exists():
        skip_or_fail(f"{pagerctl()} missing (make build)")
    for k, v in {**TINY_CLIENT, "REBAL_SIZE": "32M", "REBAL_RUNTIME": "3"}.items():
        monkeypatch.setenv(k, v)
    assert bench_client.main(["rebalance", "--out", str(tmp_path)]) == 0
    r = written(tmp_path, "rebalance")["results"]
    assert list(r["runs"]) == ["moving", "idle"]
    assert all(len(runs) == 1 and runs[0]["ios"] > 0 for runs in r["runs"].values())
    # The idle side's rebalancer is off: it moves nothing.
    assert r["runs"]["idle"][0]["moved_mib"] == 0
    assert set(r["ratios"]) == {"p50", "p99", "p99.9"}
    job = r["job"]
    assert all(len(job["seconds"][s]) == 1 and job["seconds"][s][0] > 0 for s in ("moving", "idle"))
    assert job["ratio"] > 0


def test_bench_client_spread_tiny(root, tools, donor_plugin, tmp_path, monkeypatch):
    """`make bench-client WHICH=spread`: redis swapping on 4 donors, the
    rebalancer on and off, each donor's reads against its share."""
    if not pagerctl().exists():
        skip_or_fail(f"{pagerctl()} missing (make build)")
    # Values of 1 KiB: at half its peak, most are on the donors, and the
    # GETs must read them back.
    for k, v in {**TINY_CLIENT, "REDIS_KEYS": "20000", "REDIS_VALUE": "1024", "REDIS_GETS": "5000",
                 "TIMEOUT": "300"}.items():
        monkeypatch.setenv(k, v)
    assert bench_client.main(["spread", "--out", str(tmp_path)]) == 0
    r = written(tmp_path, "spread")["results"]
    assert list(r["runs"]) == ["on", "off"]
    for runs in r["runs"].values():
        assert len(runs) == 1 and runs[0]["ops"] > 0
        donors = runs[0]["donors"]
        assert len(donors) == 4
        # The job swapped: its reads came back from the donors, and they add up.
        assert sum(x["reads"] for x in donors.values()) > 0
        assert abs(sum(x["read_share"] for x in donors.values()) - 1) < 0.01
        assert all(x["target"] > 0 for x in donors.values())
    assert set(r["worst"]) == {"on", "off"}


def test_bench_prefetch_tiny(root, donor_plugin, tmp_path, monkeypatch):
    for tool in ("nbdkit", "nbdfuse", "fusermount3", "sqlite3", "findmnt"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} not installed (make deps)")
    if missing_binaries():
        skip_or_fail(f"not built: {missing_binaries()} (make build)")
    for k, v in TINY_PREFETCH.items():
        monkeypatch.setenv(k, v)
    assert bench_prefetch.main(["--out", str(tmp_path)]) == 0

    pgms = written(tmp_path, "pgms")
    assert pgms["knobs"]["workloads"] == ["render"] and pgms["knobs"]["donors"] == 1
    render = pgms["results"]["workloads"]["render"]
    assert list(render["runs"]) == ["none", "local", "coop1"]
    assert all(len(v) == 1 for v in render["rounds_s"].values())
    assert all(r["records"] > 0 and "hits" in r["stats"] for r in render["runs"].values())
    assert list(render["speedup_vs_none"]) == ["local", "coop1"]
    assert any(line.startswith("render ") for line in pgms["table"])
    assert (tmp_path / "speedup.png").read_bytes().startswith(b"\x89PNG")

    app = written(tmp_path, "app")["results"]
    assert set(app["times_s"]) == {"record", "direct", "unhinted", "hinted",
                                   "hot_direct", "hot_hinted", "hot_buffers"}
    assert all(len(v) == 1 for v in app["rounds_s"].values())
    assert set(app["ratios"]) == {"unhinted", "record", "hinted", "hot_hinted", "hot_buffers"}
    assert app["recorded_reads"] > 0 and app["rows"] == 2000


def test_bench_apps_tiny(root, tools, donor_plugin, tmp_path, monkeypatch):
    if not pagerctl().exists():
        skip_or_fail(f"{pagerctl()} missing (make build)")
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} not installed (make deps)")
    for k, v in TINY_APPS.items():
        monkeypatch.setenv(k, v)
    assert bench_apps.main(["--out", str(tmp_path)]) == 0

    doc = written(tmp_path, "apps")
    res = doc["results"]
    assert res["latency_us"]["disk_us"] > 0 and res["latency_us"]["donor_us"] > 0
    assert res["readahead"]["page_cluster"] >= 0
    assert list(res["relative"]) == bench_apps.PROGRAMS
    for program in bench_apps.PROGRAMS:
        runs = res["runs"][program]
        full = runs["100"]["full"]
        assert len(full) == 1 and full[0]["returncode"] == 0 and runs["peak"] > 0
        assert full[0]["result"]["program"] == program
        (r,) = runs["50"]["parity+pf"]
        assert r["limit_bytes"] == runs["peak"] // 2
        # A run that failed is reported, with why; one that ran checked itself.
        if "failed" in r:
            assert res["relative"][program]["50"]["parity+pf"] is None and r["failed"]
        else:
            assert r["result"]["program"] == program and r["reads"] >= 0
            # Structure only: a tiny run may swap too little for a
            # donor's status to show it before the pages are freed.
            assert "donor_bytes" in r and set(r["prefetch"]) == {"issued", "hits", "wasted"}
            assert 0 < res["relative"][program]["50"]["parity+pf"]
        assert (tmp_path / f"apps-{program}.png").read_bytes().startswith(b"\x89PNG")
    assert res["runs"]["redis"]["100"]["full"][0]["result"]["keys"] == 20000
    md = (tmp_path / "apps.md").read_text()
    assert all(f"### {p}" in md for p in bench_apps.PROGRAMS)
    assert any(line.startswith("parity+pf") for line in doc["table"])


def test_bench_apps_shared_disk_tiny(root, tools, donor_plugin, tmp_path, monkeypatch):
    """REGIME=shared: the sort reads its input from the swap file's disk,
    in every run, and the input goes with the run. The swap file only:
    the netpager set-ups are the other tests' (their input is the same)."""
    if not pagerctl().exists():
        skip_or_fail(f"{pagerctl()} missing (make build)")
    for k, v in {**TINY_APPS, "REGIME": "shared", "SETUPS": "file"}.items():
        monkeypatch.setenv(k, v)
    assert bench_apps.main(["--out", str(tmp_path)]) == 0
    res = written(tmp_path, "apps-shared")["results"]
    assert list(res["runs"]) == ["sort"]
    runs = res["runs"]["sort"]
    done = [runs["100"]["full"][0], runs["50"]["file"][0]]
    for r in done:
        assert r["returncode"] == 0 and r["result"]["input"].endswith("sort-input.f64")
    assert not Path(done[0]["result"]["input"]).exists()


def test_bench_apps_lab_links_tiny(root, tools, donor_plugin, tmp_path, monkeypatch):
    """REGIME=lab: the sort swapping to donors on the lab's hosts behind a
    1 Gbit/s link (the lab's own teardown is tests/lab's)."""
    if not pagerctl().exists():
        skip_or_fail(f"{pagerctl()} missing (make build)")
    for k, v in {**TINY_APPS, "REGIME": "lab", "SETUPS": "none/1g", "PROGRAMS": "sort"}.items():
        monkeypatch.setenv(k, v)
    assert bench_apps.main(["--out", str(tmp_path)]) == 0
    (r,) = written(tmp_path, "apps-lab")["results"]["runs"]["sort"]["50"]["none/1g"]
    assert r["returncode"] == 0 and r["reads"] > 0


def test_bench_apps_compress_tiny(root, tools, donor_plugin, tmp_path, monkeypatch):
    """COMPRESS: each netpager set-up once per donor compress= setting,
    with the donors' memory at peak beside, on redis (its values half
    random, half one byte: they compress)."""
    if not pagerctl().exists():
        skip_or_fail(f"{pagerctl()} missing (make build)")
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} not installed (make deps)")
    for k, v in {**TINY_APPS, "PROGRAMS": "redis", "SETUPS": "parity", "COMPRESS": "off lz4"}.items():
        monkeypatch.setenv(k, v)
    assert bench_apps.main(["--out", str(tmp_path)]) == 0
    doc = written(tmp_path, "apps")
    res = doc["results"]
    assert doc["knobs"]["compress"] == ["off", "lz4"]
    runs = res["runs"]["redis"]["50"]
    assert list(runs) == ["parity@off", "parity@lz4"]
    for c in ("off", "lz4"):
        (r,) = runs[f"parity@{c}"]
        assert "failed" not in r, r
        assert r["donor_held"]["compress"] == [c]
        assert r["donor_held"]["peak"]["stored"] > 0 and r["donor_held"]["peak"]["logical"] > 0
    both = res["compress"]["redis"]["50"]["parity"]
    assert held_ratio(both["off"]["peak"]) <= 1.01 < held_ratio(both["lz4"]["peak"])
    assert both["lz4"]["time_ratio"] > 0 and both["lz4"]["memory_ratio"] < 1.0
    assert any(line.strip().startswith("parity at 50%: lz4 / off: time ") for line in doc["table"])
    assert "- parity at 50%: lz4 / off: time " in (tmp_path / "apps.md").read_text()


def test_bench_ab_tiny(root, tools, donor_plugin, memhog, tmp_path, monkeypatch):
    """`make bench-ab` with this tree's build on both sides (a base build
    takes minutes): A then B, each measured, its medians and ratios written."""
    for path in (pagerctl(), client_plugin()):
        if not path.exists():
            skip_or_fail(f"{path} missing (make build)")
    for k, v in TINY_AB.items():
        monkeypatch.setenv(k, v)
    assert bench_ab.main(["--base-target", str(target_dir()), "--out", str(tmp_path)]) == 0
    doc = written(tmp_path, "ab")
    assert doc["knobs"]["rounds"] == 1 and doc["knobs"]["frontend"] == "fuse-uring"
    r = doc["results"]
    assert list(r["sides"]) == ["A", "B"]
    for side in r["sides"].values():
        assert Path(side["target_dir"]).resolve() == target_dir().resolve()
        assert side["version"].startswith("pagerctl ")
    assert list(r["metrics"]) == list(bench_ab.METRICS)
    for m in r["metrics"].values():
        assert len(m["a"]) == len(m["b"]) == 1 and m["a"][0] > 0 and m["b"][0] > 0
        assert m["ratio"] == round(m["b_median"] / m["a_median"], 3)
    rows = doc["table"][4:9]
    assert all(row.startswith(label) for row, (label, *_) in zip(rows, bench_ab.METRICS.values()))


def test_bench_ab_names_a_missing_base():
    with pytest.raises(SystemExit, match="BASE='no-such-revision' names no commit"):
        bench_ab.main(["--base", "no-such-revision"])


def test_target_dir_switches_for_one_side(tmp_path, monkeypatch):
    """What an A/B side runs, and what it starts, come from its own build."""
    monkeypatch.delenv("NETPAGER_TARGET_DIR", raising=False)
    before = server_plugin()
    with using_target_dir(tmp_path):
        assert pagerctl() == tmp_path / "pagerctl" and server_plugin() == tmp_path / "libpager_server.so"
        assert client_plugin() == tmp_path / "libpager_client_plugin.so"
        started = subprocess.run(["sh", "-c", "echo $NETPAGER_TARGET_DIR"], capture_output=True, text=True)
        assert started.stdout.strip() == str(tmp_path)
    assert server_plugin() == before and "NETPAGER_TARGET_DIR" not in os.environ


def test_bench_ab_clean_removes_base_builds_and_worktrees(tmp_path, monkeypatch):
    """`make clean` (bench_ab --clean): a cached base build goes, and git
    forgets its worktree."""
    if shutil.which("git") is None:
        skip_or_fail("git not installed")
    repo = tmp_path / "repo"

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout

    repo.mkdir()
    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "base")
    sha = git("rev-parse", "HEAD").strip()
    tree = repo / "target" / "ab" / sha / "tree"
    git("worktree", "add", "-q", "--detach", str(tree), sha)
    (tree.parent / "built").write_text(sha)
    monkeypatch.setenv("NETPAGER_ROOT", str(repo))
    assert str(tree) in git("worktree", "list")
    assert bench_ab.main(["--clean"]) == 0
    assert not (repo / "target" / "ab").exists()
    assert str(tree) not in git("worktree", "list")
