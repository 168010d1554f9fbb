"""Side-by-side benchmark of the donor plugin against `nbdkit memory`:
fio 4 KiB random I/O at iodepth 32 through fio's nbd engine, alternating
the servers (A B C A B C ...) so that drift on the machine hits all alike.
Each round starts a fresh server and runs, for RUNTIME seconds:
  randwrite-new  random writes into an empty export (pages get allocated)
  randread       random reads after a sequential fill of the export
  randwrite      random rewrites of existing pages
nbdkit's null plugin (stores nothing) runs alongside as the ceiling: what
nbdkit, fio and the kernel allow on this machine with no storage at all.
Prints IOPS per round, then per test the mean IOPS of each server and the
median of the per-round ratios pager-server / nbdkit-memory.

  python3 -m netpager_testkit.bench_server     # 3 rounds of 10 s per test, 2G export (make bench-server)
  ROUNDS=5 RUNTIME=20 SIZE=4G python3 -m netpager_testkit.bench_server

COMPRESS="off lz4 zstd cold cold-hc" (make bench-server COMPRESS=...) runs the
donor's compression side by side instead, one pager-server per setting in
turn, on data that compresses as swapped pages do (fio's
buffer_compress_percentage, COMPRESSIBLE=60): QD1 4 KiB randread and
randwrite latency (mean, and p99), QD32 IOPS, and the donor's CPU seconds
per GiB written and read, each setting's ratio to the first. `lz4` runs
without the recompressor (lz4 alone); `cold` is lz4 with every page
repacked by the recompressor (recompress=zstd, recompress-idle=0) before
the reads, as a swap-in of a page left alone for recompress-idle meets it,
`cold-hc` the same with recompress=lz4hc; their writes run beside the
recompressor repacking at full rate. fio's compressible data is
random bytes and zeros, which zstd packs no smaller than lz4; PAGES=FILE
(a dump of real pages kept by `make bench-compress KEEP=1`) fills the
export with those pages instead (nbdcopy), and the export is their size.

Writes OUTDIR/server.txt and OUTDIR/server.json (--out, default
bench-results/server). Binaries: NETPAGER_TARGET_DIR/libpager_server.so
(default target/release). Loopback only; every nbdkit started here is
stopped by pid on every exit path.
"""

from __future__ import annotations

import os
import statistics
import sys
from subprocess import run
from pathlib import Path

from .bench import Report, arg_parser, disk_workdir, env_int, env_str, fio_json, fmt_row, nbdkit, require
from .bench_anatomy import proc_cpu
from .cleanup import Teardown, install_handlers
from .donor import free_ports
from .paths import server_plugin
from .procs import wait_for
from .status import StatusClient

PROG = "bench-server"
SERVERS = ("pager", "memory", "null")
TESTS = ("randwrite-new", "randread", "randwrite")


def start_server(td: Teardown, work: Path, server: str, size: str) -> str:
    """A fresh nbdkit serving `server` on 127.0.0.1; returns its URI."""
    port = free_ports("127.0.0.1", 1)[0]
    plugin = [str(server_plugin()), f"size={size}", "budget=100%"] if server == "pager" else [server, f"size={size}"]
    nbdkit(td, work, server, ["-p", str(port), "-i", "127.0.0.1", *plugin])
    return f"nbd://127.0.0.1:{port}/"


def run_fio(work: Path, uri: str, size: str, rw: str, *extra) -> int:
    """The IOPS of one fio run (4 KiB, iodepth 32 unless `extra` says otherwise)."""
    j = fio_json([f"--name={rw}", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", "--bs=4k",
                  "--iodepth=32", "--numjobs=1", f"--size={size}", *extra], work)
    return round(j["read"]["iops"] + j["write"]["iops"])


# key: (label, unit, which way is better)
COMPRESS_METRICS = {"qd1_read_us": ("QD1 4K randread mean", "us", "lower"),
                    "qd1_read_p99_us": ("QD1 4K randread p99", "us", "lower"),
                    "qd1_write_us": ("QD1 4K randwrite mean", "us", "lower"),
                    "qd1_write_p99_us": ("QD1 4K randwrite p99", "us", "lower"),
                    "qd32_read_iops": ("QD32 4K randread", "IOPS", "higher"),
                    "qd32_write_iops": ("QD32 4K randwrite", "IOPS", "higher"),
                    "cpu_per_gib_written": ("donor CPU per GiB written", "s", "lower"),
                    "cpu_per_gib_read": ("donor CPU per GiB read", "s", "lower")}


# The donor's parameters for each COMPRESS word. The recompressor waits
# while its donor is busy: the cold donor never is, whatever the machine's
# load.
COMPRESS_PARAMS = {"off": ["compress=off"], "lz4": ["compress=lz4", "recompress=off"],
                   "zstd": ["compress=zstd"],
                   **{word: ["compress=lz4", f"recompress={codec}", "recompress-idle=0", "recompress-rate=1G",
                             "busy-load=1000"]
                      for word, codec in (("cold", "zstd"), ("cold-hc", "lz4hc"))}}


def wait_repacked(status: StatusClient, what: str) -> int:
    """Waits until the recompressor stops repacking (the same count over
    3 s: at recompress-rate=1G it looks at every page of an export of a
    few GiB well within that); returns the count."""
    seen = []

    def settled():
        seen.append(status.query().recompressed_pages)
        return len(seen) > 6 and seen[-1] == seen[-7]
    wait_for(settled, 600, f"{what}: the recompressor to repack every page", interval=0.5)
    return seen[-1]


def compress_round(work: Path, setting: str, size: str, runtime: int, pct: int,
                   pages: Path | None) -> dict[str, float]:
    """One pager-server with the COMPRESS word `setting`: its metrics above."""
    data = [f"--buffer_compress_percentage={pct}", "--refill_buffers", "--buffer_compress_chunk=4k"]
    timed = ["--time_based", f"--runtime={runtime}", *data]
    out = {}
    with Teardown(f"{PROG} compress={setting}") as td:
        port, sport = free_ports("127.0.0.1", 2)
        proc = nbdkit(td, work, f"pager-{setting}", ["-p", str(port), "-i", "127.0.0.1", str(server_plugin()),
                                                      f"size={size}", "budget=100%", f"status=127.0.0.1:{sport}",
                                                      *COMPRESS_PARAMS[setting]])
        uri = f"nbd://127.0.0.1:{port}/"
        fio = ["--ioengine=nbd", f"--uri={uri}", "--bs=4k", "--numjobs=1", f"--size={size}"]
        cpu = proc_cpu(proc.pid)
        if pages:
            run(["nbdcopy", str(pages), uri], check=True, timeout=600)
            filled = pages.stat().st_size
        else:
            fill = fio_json(["--name=fill", *fio, "--rw=write", "--bs=1M", "--iodepth=4", *data], work)
            filled = fill["write"]["io_bytes"]
        out["cpu_per_gib_written"] = (proc_cpu(proc.pid) - cpu) / (filled / 2**30)
        if setting.startswith("cold"):
            n = wait_repacked(StatusClient("127.0.0.1", sport), f"{PROG} {setting}")
            print(f"{PROG}: cold: {n} pages repacked before the reads", file=sys.stderr, flush=True)
        cpu = proc_cpu(proc.pid)
        seq = fio_json(["--name=read", *fio, "--rw=read", "--bs=1M", "--iodepth=4"], work)
        out["cpu_per_gib_read"] = (proc_cpu(proc.pid) - cpu) / (seq["read"]["io_bytes"] / 2**30)
        for rw, key in (("randread", "read"), ("randwrite", "write")):
            j = fio_json([f"--name={rw}", *fio, f"--rw={rw}", "--iodepth=1", *timed], work)[key]
            out[f"qd1_{key}_us"] = j["clat_ns"]["mean"] / 1000
            out[f"qd1_{key}_p99_us"] = j["clat_ns"]["percentile"]["99.000000"] / 1000
            out[f"qd32_{key}_iops"] = fio_json([f"--name={rw}", *fio, f"--rw={rw}", "--iodepth=32", *timed],
                                               work)[key]["iops"]
        td.close_or_raise()
    return {k: round(v, 2) for k, v in out.items()}


def compress_main(args, settings: list[str], rounds: int, runtime: int, size: str) -> int:
    pct = env_int(PROG, "COMPRESSIBLE", 60)
    pages = Path(env_str("PAGES", "")) if env_str("PAGES", "") else None
    if pages:
        if not pages.is_file() or pages.stat().st_size % 4096:
            raise SystemExit(f"{PROG}: PAGES={pages}: not a file of whole 4 KiB pages")
        size = str(pages.stat().st_size)
    report = Report("server", {"rounds": rounds, "runtime": runtime, "size": size, "compress": settings,
                               "compressible": pct, "pages": str(pages) if pages else None})
    vals = {c: {k: [] for k in COMPRESS_METRICS} for c in settings}
    with Teardown(PROG) as top:
        work = disk_workdir(top, "np-bench-server-")
        for rnd in range(1, rounds + 1):
            # Each round in another order, so no setting always runs first.
            order = settings[rnd - 1:] + settings[:rnd - 1]
            for c in order:
                r = compress_round(work, c, size, runtime, pct, pages)
                for k, v in r.items():
                    vals[c][k].append(v)
                print(f"round {rnd}: compress={c} {r}", file=sys.stderr, flush=True)
        top.close_or_raise()
    base = settings[0]
    data = f"filled with {pages.name}, writes {pct}% compressible (fio)" if pages else \
        f"data {pct}% compressible (fio)"
    report.line(f"== the donor's compression side by side: {rounds} rounds (each in another order), export "
                f"{size}, {data}, {os.cpu_count()} CPUs; medians, and each setting against "
                f"compress={base}")
    w = [28, 5] + [16] * len(settings)
    report.line(fmt_row(w, ["metric", "unit", *[f"compress={c}" for c in settings]], first_left=2))
    results = {}
    for key, (label, unit, better) in COMPRESS_METRICS.items():
        med = {c: statistics.median(vals[c][key]) for c in settings}
        cells = [f"{med[c]:.1f}" + (f" ({med[c] / med[base]:.2f}x)" if c != base and med[base] else "")
                 for c in settings]
        report.line(fmt_row(w, [label, unit, *cells], first_left=2))
        results[key] = {"label": label, "unit": unit, "better": better, "rounds": {c: vals[c][key] for c in settings},
                        "median": med}
    report.results = {"compress": results}
    report.write(args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__, "server", "server.txt and server.json")
    args = ap.parse_args(argv)
    rounds = env_int(PROG, "ROUNDS", 3)
    runtime = env_int(PROG, "RUNTIME", 10)
    size = env_str("SIZE", "2G")
    require(PROG, ["nbdkit", "fio", "findmnt"], [server_plugin()], root=False)
    install_handlers()
    settings = env_str("COMPRESS", "").split()
    bad = [c for c in settings if c not in COMPRESS_PARAMS]
    if bad:
        raise SystemExit(f"{PROG}: COMPRESS={' '.join(settings)}: unknown {', '.join(bad)} "
                         f"(words: {', '.join(COMPRESS_PARAMS)})")
    if settings:
        return compress_main(args, settings, rounds, runtime, size)
    report = Report("server", {"rounds": rounds, "runtime": runtime, "size": size})
    timed = ["--time_based", f"--runtime={runtime}"]
    # iops[test][server][round]
    iops = {t: {s: {} for s in SERVERS} for t in TESTS}
    with Teardown(PROG) as top:
        work = disk_workdir(top, "np-bench-server-")
        report.line(f"{'round':<6} {'server':<8} {'randwrite-new':>14} {'randread':>12} {'randwrite':>12}")
        for rnd in range(1, rounds + 1):
            for server in SERVERS:
                with Teardown(f"{PROG} {server}") as td:
                    uri = start_server(td, work, server, size)
                    new = run_fio(work, uri, size, "randwrite", *timed)
                    # Fill every page so both servers read and rewrite real data.
                    run_fio(work, uri, size, "write", "--bs=1M", "--iodepth=4")
                    rr = run_fio(work, uri, size, "randread", *timed)
                    rw = run_fio(work, uri, size, "randwrite", *timed)
                    td.close_or_raise()
                for test, n in zip(TESTS, (new, rr, rw)):
                    iops[test][server][rnd] = n
                report.line(f"{rnd:<6} {server:<8} {new:>14} {rr:>12} {rw:>12}")
        top.close_or_raise()
    report.line()
    report.line(f"{rounds} rounds of {runtime}s per test, 4 KiB, iodepth 32, export {size}, "
                f"{os.cpu_count()} CPUs:")
    summary = {}
    for test in TESTS:
        p, m, n = (iops[test][s] for s in SERVERS)
        med = statistics.median(p[r] / m[r] for r in p)
        summary[test] = {"pager_mean": statistics.mean(p.values()), "memory_mean": statistics.mean(m.values()),
                         "null_mean": statistics.mean(n.values()), "median_ratio": round(med, 3)}
        report.line(f"{test:14} pager-server {summary[test]['pager_mean']:7.0f}  nbdkit-memory "
                    f"{summary[test]['memory_mean']:7.0f}  (null ceiling {summary[test]['null_mean']:7.0f})"
                    f"  median ratio pager/memory {med:.2f}x")
    report.results = {"iops": {t: {s: {str(r): v for r, v in iops[t][s].items()} for s in SERVERS}
                               for t in TESTS}, "summary": summary}
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
