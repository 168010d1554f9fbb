"""`make bench-compress` without swap: the replay (examples/compress-replay)
on synthetic dumps gives back every byte and holds compressible pages in
less than they are, and the benchmark's table is made from kept dumps
(`--dumps`). The recording itself needs root, zram and the swap lock: it is
the benchmark's, not a test's."""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from netpager_testkit import bench_compress
from netpager_testkit.ci import skip_or_fail

PAGE = 4096


@pytest.fixture
def replayer():
    path = bench_compress.replayer()
    if not path.exists():
        skip_or_fail(f"{path} not built (make build)")
    return path


def synthetic_dump(path, each: int) -> dict:
    """`each` pages of zeros, of noise and of text-like bytes, interleaved;
    the counts of each kind."""
    rng = random.Random(39)
    words = ["page", "swap", "donor", "netpager", "client"]
    line = 0
    with open(path, "wb") as f:
        for _ in range(each):
            f.write(bytes(PAGE))
            f.write(rng.randbytes(PAGE))
            text = b""
            while len(text) < PAGE:  # log lines: a counter, a word, a level
                line += 1
                text += f"{line:08d} {rng.choice(words)} level={line % 7}\n".encode()
            f.write(text[:PAGE])
    return {"zero": each, "noise": each, "text": each}


def replay(replayer, dump, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([str(replayer), str(dump), "--rounds", "1", "--json", *extra],
                          capture_output=True, text=True, timeout=300)


def test_replay_gives_back_every_byte_and_compresses_text(replayer, tmp_path):
    dump = tmp_path / "synthetic.pages"
    # Enough pages that each size class's partly filled zspage is small
    # beside them.
    n = synthetic_dump(dump, 200)
    p = replay(replayer, dump)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["pages"] == 600 and doc["zero_pages"] == n["zero"]
    assert doc["dump_bytes"] == 600 * PAGE
    off, lz4, zstd = (doc["codecs"][c] for c in ("off", "lz4", "zstd"))
    # Zero pages are held as nothing: what is left is one page each, raw.
    assert off["logical_bytes"] == off["stored_bytes"] == (n["noise"] + n["text"]) * PAGE
    for name, c in (("lz4", lz4), ("zstd", zstd)):
        assert c["logical_bytes"] == off["logical_bytes"], name
        # Noise stays raw (one page each); text takes well under half a page.
        assert n["noise"] * PAGE <= c["stored_bytes"] < (n["noise"] + n["text"] // 2) * PAGE, name
        assert c["ratio"] > off["ratio"], name
        assert c["mapped_bytes"] >= c["stored_bytes"], name
        assert c["compress_mb_per_cpu_s"] > 0 and c["decompress_mb_per_cpu_s"] > 0, name
    # The recompressor's pass over lz4's pages, with each of its codecs: no
    # more bytes than lz4 (zstd's about what compress=zstd holds); every
    # byte read back again.
    assert set(lz4["cold"]) == set(bench_compress.COLD)
    for name, cold in lz4["cold"].items():
        assert cold["pages"] > 0 and cold["stored_bytes"] <= lz4["stored_bytes"], name
        assert cold["recompress_mb_per_cpu_s"] > 0 and cold["read_mb_per_cpu_s"] > 0, name
    assert lz4["cold"]["zstd"]["stored_bytes"] <= zstd["stored_bytes"] + PAGE
    assert off["cold"] == {} and zstd["cold"] == {}
    # compress=off has no codec to time, only the store.
    assert off["compress_mb_per_cpu_s"] is None and off["write_mb_per_cpu_s"] > 0


def test_replay_refuses_a_dump_of_partial_pages(replayer, tmp_path):
    dump = tmp_path / "partial.pages"
    dump.write_bytes(bytes(PAGE) + b"x" * 100)
    p = replay(replayer, dump)
    assert p.returncode != 0
    assert "not a whole, non-zero number of 4 KiB pages" in p.stderr


def test_bench_compress_tables_kept_dumps(replayer, tmp_path, monkeypatch):
    dumps, out = tmp_path / "dumps", tmp_path / "out"
    dumps.mkdir()
    n = synthetic_dump(dumps / "sort.pages", 20)
    pages = sum(n.values())
    # What the recorder writes beside a dump, with zram's figures for it.
    mm = dict(zip(bench_compress.MM_STAT,
                  [(pages + 1) * PAGE, 30 * PAGE, 32 * PAGE, 0, 32 * PAGE, n["zero"], 0, 0]))
    (dumps / "sort.json").write_text(json.dumps({"mm_stat": mm, "zram_algorithm": "lzo-rle",
                                                 "pages": pages, "zero_pages": n["zero"]}))
    for k, v in {"PROGRAMS": "sort", "ROUNDS": "1"}.items():
        monkeypatch.setenv(k, v)
    assert bench_compress.main(["--dumps", str(dumps), "--out", str(out)]) == 0
    doc = json.loads((out / "compress.json").read_text())
    assert doc["bench"] == "compress"
    assert (out / "compress.txt").read_text().splitlines() == doc["table"]
    assert set(doc["results"]) == {"sort"}
    assert set(doc["results"]["sort"]["replay"]["codecs"]) == set(bench_compress.CODECS)
    row = next(line for line in doc["table"] if line.startswith("sort "))
    assert row.split()[1:4] == [str(pages), str(n["zero"]), f"{(pages + 1) / 32:.2f}"]
    assert "->zstd/zram" in doc["table"][1] and "->lz4hc/zram" in doc["table"][1]
