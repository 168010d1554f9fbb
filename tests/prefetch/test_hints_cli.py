"""End-to-end tests of the `pager-hints` command (hints/FORMAT.md).

They run the release binary from $NETPAGER_TARGET_DIR (default
target/release) on real files: every reference workload is generated,
validated, converted both ways and its data checked against an independent
Python implementation of the documented content function; a hint file of
millions of records is read with the process's heap capped far below
the file's size.
"""

import json
import os
import pathlib
import random
import resource
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TARGET = pathlib.Path(os.environ.get("NETPAGER_TARGET_DIR", REPO / "target" / "release"))
PAGER_HINTS = TARGET / "pager-hints"

WORKLOADS = [
    "render", "oo7", "hotcold", "random", "reverse",
    "cyclic-hotcold", "cyclic-random", "cyclic-reverse", "sequential", "hashjoin",
]

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


@pytest.fixture(scope="module")
def tool():
    if not PAGER_HINTS.is_file():
        pytest.fail(f"{PAGER_HINTS} missing: run `make build` or set NETPAGER_TARGET_DIR")
    return str(PAGER_HINTS)


def run(*args, check=True):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}: {p.stderr}")
    return p


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def file_seed(seed, path):
    return mix64(seed ^ fnv1a64(path.encode()))


def content_word(fseed, word):
    return mix64((fseed + (word + 1) * GAMMA) & MASK)


# Heap cap for the bounded-memory test: far below the hint file's size.
DATA_LIMIT = 16 << 20


def run_capped(*cmd):
    """Runs cmd with its data segment (heap and private mappings,
    RLIMIT_DATA) capped at DATA_LIMIT bytes."""
    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))
    return subprocess.run([str(c) for c in cmd], preexec_fn=cap, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_generated_workload_validates_converts_and_has_the_documented_bytes(tool, tmp_path, workload):
    out = tmp_path / workload
    run(tool, "gen", workload, "--out", out, "--seed", "11")
    manifest = json.loads((out / "manifest.json").read_text())
    hints = out / manifest["hints"]
    root = out / manifest["root"]

    v = run(tool, "validate", hints).stdout
    assert f'job "{workload}"' in v
    stats = json.loads(run(tool, "stats", hints, "--json").stdout)
    assert stats["records_per_pass"] == manifest["records"]
    assert stats["passes"] == (3 if workload.startswith("cyclic") else 1)
    assert stats["files"] == len(manifest["files"])
    assert 0 < stats["distinct_bytes"] <= sum(f["size"] for f in manifest["files"])

    binary = tmp_path / "h.bin"
    back = tmp_path / "h.txt"
    run(tool, "convert", hints, binary)
    run(tool, "convert", binary, back)
    assert back.read_text() == hints.read_text()
    assert binary.stat().st_size < hints.stat().st_size
    assert json.loads(run(tool, "stats", binary, "--json").stdout)["distinct_blocks"] == stats["distinct_blocks"]

    assert "fresh" in run(tool, "check", hints, "--root", root).stdout

    rng = random.Random(workload)
    for f in manifest["files"]:
        assert f["file_seed"] == file_seed(11, f["path"])
        data = (root / f["path"]).read_bytes()
        assert len(data) == f["size"]
        words = len(data) // 8
        for w in [0, words - 1] + [rng.randrange(words) for _ in range(500)]:
            got = int.from_bytes(data[8 * w:8 * w + 8], "little")
            assert got == content_word(f["file_seed"], w), f"{f['path']} word {w}"


def test_check_reports_changed_files_with_exit_status_3(tool, tmp_path):
    run(tool, "gen", "hashjoin", "--out", tmp_path)
    hints = tmp_path / "hashjoin.hints"
    root = tmp_path / "data"
    (root / "probe.rel").unlink()
    with open(root / "build.rel", "ab") as f:
        f.write(b"more")
    p = run(tool, "check", hints, "--root", root, "--json", check=False)
    assert p.returncode == 3, p.stderr
    problems = {(s["path"], s["problem"]) for s in json.loads(p.stdout)}
    assert ("probe.rel", "missing") in problems
    assert ("build.rel", "size-differs") in problems


def test_invalid_file_exits_1_naming_line_and_field(tool, tmp_path):
    bad = tmp_path / "hints.txt"
    bad.write_text("netpager-hints 1\njob j\nblock-size 8K\nrecords\na 0 8K\na 0 0\n")
    p = run(tool, "validate", bad, check=False)
    assert p.returncode == 1
    assert f"{bad}:6: field 'length': zero length" in p.stderr


def test_millions_of_records_are_read_in_bounded_memory(tool, tmp_path):
    records = 3_000_000
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        f.write("netpager-hints 1\njob big\nblock-size 4K\nrecords\n")
        step = 100_000
        for start in range(0, records, step):
            f.write("".join(f"data/big.db {i * 4096} 4096\n" for i in range(start, start + step)))
    assert big.stat().st_size > 5 * DATA_LIMIT

    # Control: the cap does stop a program that loads the file whole.
    slurp = run_capped(sys.executable, "-c", f"open({str(big)!r}, 'rb').read()")
    assert slurp.returncode != 0 and "MemoryError" in slurp.stderr

    for cmd in (["validate", big], ["stats", big, "--json"]):
        p = run_capped(tool, *cmd)
        assert p.returncode == 0, f"{cmd[0]} under a {DATA_LIMIT >> 20} MiB heap cap: {p.stderr}"
    stats = json.loads(p.stdout)
    assert stats["records"] == records
    assert stats["distinct_blocks"] == records

    binary = tmp_path / "big.bin"
    p = run_capped(tool, "convert", big, binary)
    assert p.returncode == 0, p.stderr
    assert binary.stat().st_size < 4 * records
    p = run_capped(tool, "validate", binary)
    assert p.returncode == 0, p.stderr
    assert f"{records} records" in p.stdout
