#!/usr/bin/env bash
# PGMS's application benchmark (PGMS §4.3, docs/DESIGN.md "3 Reference
# workloads") at reduced scale, keeping its ratios: 8 KiB blocks, 250 us of
# compute between accesses, local memory about 1/3 of the data touched, each
# donor as large as local memory, one disk per node at ~13 ms per random 8 KiB
# read serving one request at a time (nbdkit delay + noparallel; the busy node's
# disk is attached through nbdfuse, each donor's replica is served by its own
# nbdkit), 0 to 4 donors.
#
# For render, hotcold, random and reverse it times the job with no
# prefetching (a demand-only cache), with local-disk prefetching only, and
# with cooperative prefetching and 1..4 donors, and writes
#   OUTDIR/results.json, OUTDIR/table.txt, OUTDIR/speedup.png
# (speedup over no prefetching vs nodes, like PGMS's Figure 3).
#
# Then a real application on a single disk, no donors, no replicas: the
# sqlite3 CLI scanning a database whose leaf pages lie scattered over the
# file (disk BENCH_APP_DELAY per read, one at a time), read directly (page
# cache, cold), through prefetchd unhinted, recorded (job add --record),
# and hinted by that recording; and hot, everything in memory: the page
# cache (the database's local copy) against a hinted run whose file is in
# the mount's page cache, and one served out of prefetchd's own buffers
# (the mount's page cache dropped). The PGMS runs use --direct-io: their
# local memory is prefetchd's --local-cache alone, as in PGMS.
# Ratios to the direct reads go to OUTDIR/app.json and the table.
#
# Usage: scripts/bench-prefetch.sh [OUTDIR]   (default bench-results/prefetch)
# Knobs: BENCH_SCALE (0.04), BENCH_DELAY (13ms), BENCH_DONORS (4),
#        BENCH_WORKLOADS ("render hotcold random reverse"; "" for none),
#        BENCH_HOTCOLD_RECORDS (1152: 6 of its 20 phases),
#        BENCH_APP (1; 0 to skip), BENCH_APP_ROWS (200000: 28 MB),
#        BENCH_APP_DELAY (5ms), BENCH_APP_ROUNDS (3: best of),
#        BENCH_APP_COLD (1; 0: of the cold runs only the recording the hot
#        part needs; with BENCH_WORKLOADS="" this measures the hot part).
# Donors run pager-server when libpager_server.so is built, else nbdkit's
# memory plugin. Every process and mount is undone on every exit path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export NETPAGER_ROOT=$root
export NETPAGER_TARGET_DIR=${NETPAGER_TARGET_DIR:-$root/target/release}
out=${1:-$root/bench-results/prefetch}
mkdir -p "$out"
for b in prefetchd prefetch-job pager-hints; do
  [ -x "$NETPAGER_TARGET_DIR/$b" ] || { echo "bench-prefetch: $NETPAGER_TARGET_DIR/$b missing (make build)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "bench-prefetch: needs root (FUSE mounts)" >&2; exit 1; }
# Debian's python3 has matplotlib and the harness's dependencies.
exec /usr/bin/python3 - "$out" <<'PY'
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

root = Path(os.environ["NETPAGER_ROOT"])
sys.path[:0] = [str(root / "tests"), str(root / "tests" / "prefetch")]
from netpager_testkit import Cluster, Teardown, install_handlers, server_plugin  # noqa: E402
from prefetch_helpers import (Prefetchd, Replica, SlowDisk, binary, donor_arg, generate,  # noqa: E402
                              run_job, scattered_db, sqlite_scan, without_file_declarations)

out = Path(sys.argv[1])
scale = float(os.environ.get("BENCH_SCALE", "0.04"))
delay = os.environ.get("BENCH_DELAY", "13ms")
max_donors = int(os.environ.get("BENCH_DONORS", "4"))
workloads = os.environ.get("BENCH_WORKLOADS", "render hotcold random reverse").split()
hotcold_records = int(os.environ.get("BENCH_HOTCOLD_RECORDS", "1152"))
COMPUTE_US = 250
BS = 8192
plugin = server_plugin() if server_plugin().exists() else "memory"
install_handlers()


def touched_blocks(hints: Path, limit: int | None) -> int:
    """Distinct blocks the job reads (in its first `limit` records)."""
    seen, n = set(), 0
    lines = hints.read_text().splitlines()
    start = lines.index("records") + 1
    for line in lines[start:]:
        if limit is not None and n >= limit:
            break
        path, off, length = line.rsplit(" ", 2)
        off, length = int(off), int(length)
        seen.update((path, b) for b in range(off // BS, (off + length - 1) // BS + 1))
        n += 1
    return len(seen)


def one_run(td, work: Path, ds, data: Path, hints: Path, limit, local_blocks: int, mode: str,
            donors, replicas) -> dict:
    w = Path(tempfile.mkdtemp(dir=work, prefix=f"{mode}-"))
    # PGMS's local memory is bounded: the kernel must not cache beside it.
    extra = ["--direct-io"] + (["--no-prefetch"] if mode == "none" else [])
    dargs = []
    if mode == "coop":
        export = f"prefetchd@{local_blocks * BS}" if plugin != "memory" else ""
        dargs = [donor_arg(d, r, export=export, slots=local_blocks) for d, r in zip(donors, replicas)]
    pd = Prefetchd(td, w, data, donors=dargs, local_cache=str(local_blocks * BS), extra=extra)
    try:
        pd.add_job("bench", hints)
        r = run_job(td, w, hints, pd.mount / "jobs" / "bench", manifest=ds["manifest_path"],
                    compute_us=COMPUTE_US, limit=limit, name="job")
        if r["mismatches"]:
            raise RuntimeError(f"{mode}: job read wrong bytes: {r}")
        j = pd.job("bench")
    finally:
        pd.stop()
    return {"elapsed_s": r["elapsed_s"], "stats": j["stats"], "records": r["records"]}


results = {"scale": scale, "disk_delay": delay, "compute_us": COMPUTE_US, "block_size": BS,
           "donor_plugin": str(plugin), "workloads": {}}
started = time.monotonic()
for wl in workloads:
    with Teardown(f"bench {wl}") as td:
        work = Path(tempfile.mkdtemp(prefix=f"bench-prefetch-{wl}-"))
        td.add(f"workdir {work}", lambda work=work: subprocess.run(["rm", "-rf", str(work)]))
        ds = generate(wl, work / "ds", scale)
        limit = hotcold_records if wl == "hotcold" else None
        f = ds["files"][0]["path"]
        disk = SlowDisk(td, work, ds["data"] / f, f, rdelay=delay)
        hints = without_file_declarations(ds["hints_path"], work / f"{wl}.hints")
        touched = touched_blocks(hints, limit)
        local_blocks = max(16, touched // 3)
        cluster = Cluster(td, work, plugin)
        size = f"{max(1, local_blocks * BS // (1 << 20) + 1)}M"
        donors = cluster.start_donors(max_donors, size=size) if max_donors else []
        replicas = [Replica(td, work, ds["data"], d.addr, d.name, rdelay=delay) for d in donors]
        runs = {}
        print(f"{wl}: {touched} blocks touched, local memory {local_blocks} blocks, "
              f"donors of {local_blocks} blocks ({plugin if plugin == 'memory' else 'pager-server'})",
              flush=True)
        for mode, n in [("none", 0), ("local", 0)] + [("coop", k) for k in range(1, max_donors + 1)]:
            key = mode if mode != "coop" else f"coop{n}"
            runs[key] = one_run(td, work, ds, disk.dir, hints, limit, local_blocks, mode,
                                donors[:n], replicas[:n])
            s = runs[key]["stats"]
            print(f"  {key:6s} {runs[key]['elapsed_s']:7.2f} s  hits L/G/D "
                  f"{s['hits']['local']}/{s['hits']['global']}/{s['hits']['disk']}  "
                  f"d2g used {s['disk_to_global']['used']}  g2l used {s['global_to_local']['used']}  "
                  f"d2l used {s['disk_to_local']['used']}", flush=True)
        results["workloads"][wl] = {"touched_blocks": touched, "local_blocks": local_blocks, "runs": runs}


def drop_cached(path: Path) -> None:
    """Drops the page cache of one file (not the machine's: it is shared)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def app_bench() -> dict:
    rows = int(os.environ.get("BENCH_APP_ROWS", "200000"))
    delay = os.environ.get("BENCH_APP_DELAY", "5ms")
    rounds = int(os.environ.get("BENCH_APP_ROUNDS", "3"))
    with Teardown("bench app") as td:
        work = Path(tempfile.mkdtemp(prefix="bench-prefetch-app-"))
        td.add(f"workdir {work}", lambda: subprocess.run(["rm", "-rf", str(work)]))
        db = scattered_db(work / "app.db", rows)
        expected, _ = sqlite_scan(db)
        disk = SlowDisk(td, work, db, "app.db", rdelay=delay)
        size = db.stat().st_size
        cache = str(2 * size)
        n = [0]

        def daemon():
            n[0] += 1
            return Prefetchd(td, work, disk.dir, local_cache=cache, name=f"pd{n[0]}")

        def scan(path: Path) -> float:
            out, took = sqlite_scan(path)
            if out != expected:
                raise RuntimeError(f"sqlite3 on {path} answered {out!r}, expected {expected!r}")
            return took

        def direct_cold() -> float:
            drop_cached(disk.path)
            return scan(disk.path)

        def through(mode: str) -> tuple[float, dict]:
            pd = daemon()
            try:
                if mode == "unhinted":
                    took = scan(pd.mount / "data" / "app.db")
                    return took, pd.status()["unhinted"]
                if mode == "record":
                    pd.cli("job", "add", "app", "--record", work / "app.hints")
                else:
                    pd.add_job("app", work / "app.hints")
                took = scan(pd.mount / "jobs" / "app" / "app.db")
                stats = pd.job("app")["stats"]
                if mode == "record":
                    pd.cli("job", "remove", "app")
                return took, stats
            finally:
                pd.stop()

        def hot() -> tuple[float, float, float]:
            # The slow disk's FUSE file is not page-cached: the hot baseline
            # is the database's own copy, read twice.
            scan(db)
            direct = scan(db)
            pd = daemon()
            try:
                view = pd.mount / "jobs" / "app" / "app.db"
                pd.add_job("app", work / "app.hints")
                scan(view)
                pd.cli("job", "remove", "app")
                # Hot: the mount's page cache holds the job's file.
                pd.add_job("app", work / "app.hints")
                took = scan(view)
                if pd.job("app")["stats"]["hits"]["disk"]:
                    raise RuntimeError("hot run read from disk")
                pd.cli("job", "remove", "app")
                # The kernel's copy dropped: every read is served out of
                # prefetchd's own local memory.
                drop_cached(view)
                pd.add_job("app", work / "app.hints")
                buffers = scan(view)
                if pd.job("app")["stats"]["hits"]["disk"]:
                    raise RuntimeError("hot run out of prefetchd's buffers read from disk")
                return direct, took, buffers
            finally:
                pd.stop()

        cold = os.environ.get("BENCH_APP_COLD", "1") != "0"
        runs = {"direct": min(direct_cold() for _ in range(rounds if cold else 1))}
        stats = {}
        for mode in ("unhinted", "record", "hinted") if cold else ("record",):
            best = None
            for _ in range(rounds if mode != "record" else 1):
                took, st = through(mode)
                if best is None or took < best[0]:
                    best = (took, st)
            runs[mode], stats[mode] = best
            print(f"  app {mode:9s} {best[0]:7.2f} s (direct {runs['direct']:.2f} s)  hits L/D "
                  f"{best[1]['hits']['local']}/{best[1]['hits']['disk']}", flush=True)
        hot_runs = [hot() for _ in range(rounds)]
        runs["hot_direct"] = min(h[0] for h in hot_runs)
        runs["hot_hinted"] = min(h[1] for h in hot_runs)
        runs["hot_buffers"] = min(h[2] for h in hot_runs)
        records = sum(1 for line in (work / "app.hints").read_text().splitlines()[1:]
                      if line and not line.startswith(("job ", "block-size ", "file ", "records", "repeat ")))
        return {"rows": rows, "db_bytes": size, "disk_delay": delay, "rounds": rounds,
                "recorded_reads": records, "times_s": runs, "stats": stats,
                "ratios": {**{k: runs[k] / runs["direct"] for k in ("unhinted", "record", "hinted")
                              if k in runs},
                           "hot_hinted": runs["hot_hinted"] / runs["hot_direct"],
                           "hot_buffers": runs["hot_buffers"] / runs["hot_direct"]}}


if os.environ.get("BENCH_APP", "1") != "0":
    print("app: sqlite3 table scan of a scattered database, one disk, no donors", flush=True)
    results["app"] = app_bench()
    (out / "app.json").write_text(json.dumps(results["app"], indent=2))
results["wall_s"] = time.monotonic() - started

# Table.
cols = ["none", "local"] + [f"coop{k}" for k in range(1, max_donors + 1)]
lines = [f"PGMS-style prefetch benchmark: scale {scale}, disk {delay}/read one at a time, "
         f"{COMPUTE_US} us compute per access, donors: {results['donor_plugin']}",
         "times in seconds; speedups over no prefetching (xN) and, last column, "
         f"over local-disk prefetching with {max_donors} donors",
         "",
         f"{'workload':10s} " + " ".join(f"{c:>8s}" for c in cols) + "   speedup vs none by nodes (1..)"
         + f"   {max_donors}d/local"]
for wl, r in results["workloads"].items():
    t = {c: r["runs"][c]["elapsed_s"] for c in cols}
    speed = [t["none"] / t[c] for c in cols[1:]]
    last = cols[-1]
    lines.append(f"{wl:10s} " + " ".join(f"{t[c]:8.2f}" for c in cols) + "   "
                 + " ".join(f"{x:4.1f}x" for x in speed)
                 + f"   {t['local'] / t[last]:4.1f}x")
lines.append("")
lines.append("nodes = 1 (local-disk prefetching only) + donors; PGMS on render with 4 donors: "
             "4.9x over none, 3.1x over local-disk prefetching")
if "app" in results:
    a = results["app"]
    t, r = a["times_s"], a["ratios"]
    lines += ["",
              f"sqlite3 scan of a {a['db_bytes'] / 1e6:.1f} MB database with scattered leaf pages, "
              f"one disk ({a['disk_delay']}/read, one at a time), no donors; best of {a['rounds']}",
              f"{'':22s} {'time s':>8s} {'/direct':>8s}",
              f"{'direct from the disk':22s} {t['direct']:8.2f} {1.0:8.2f}"]
    for k in (k for k in ("unhinted", "record", "hinted") if k in t):
        lines.append(f"{'prefetchd ' + k:22s} {t[k]:8.2f} {r[k]:8.2f}")
    lines += [f"{'hot: page cache':22s} {t['hot_direct']:8.3f} {1.0:8.2f}",
              f"{'hot: prefetchd hinted':22s} {t['hot_hinted']:8.3f} {r['hot_hinted']:8.2f}",
              f"{'hot: prefetchd buffers':22s} {t['hot_buffers']:8.3f} {r['hot_buffers']:8.2f}"
              "   (page cache dropped: every read served by the daemon)",
              "targets: hinted <= 1.0x direct, hot hinted <= 1.2x"]
table = "\n".join(lines)
(out / "results.json").write_text(json.dumps(results, indent=2))
(out / "table.txt").write_text(table + "\n")
print()
print(table)

import matplotlib  # noqa: E402
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6.4, 4.4))
for wl, r in results["workloads"].items():
    none = r["runs"]["none"]["elapsed_s"]
    xs = list(range(1, max_donors + 2))
    ys = [none / r["runs"][c]["elapsed_s"] for c in cols[1:]]
    ax.plot(xs, ys, marker="o", label=wl)
ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
ax.set_xlabel("nodes (1 = local-disk prefetching only, + donors)")
ax.set_ylabel("speedup over no prefetching")
ax.set_xticks(list(range(1, max_donors + 2)))
ax.set_title(f"prefetchd, PGMS ratios at scale {scale} (disk {delay}, {COMPUTE_US} us compute)")
ax.grid(True, alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(out / "speedup.png", dpi=110)
print(f"\nwrote {out}/results.json, table.txt, speedup.png ({results['wall_s']:.0f} s)")
PY
