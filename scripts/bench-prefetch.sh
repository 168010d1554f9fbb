#!/usr/bin/env bash
# PGMS's application benchmark (seed 004 §4.3, DESIGN.md §3) at reduced
# scale, keeping its ratios: 8 KiB blocks, 250 us of compute between
# accesses, local memory about 1/3 of the data touched, each donor as large
# as local memory, one disk per node at ~13 ms per random 8 KiB read serving
# one request at a time (nbdkit delay + noparallel; the busy node's disk is
# attached through nbdfuse, each donor's replica is served by its own
# nbdkit), 0 to 4 donors.
#
# For render, hotcold, random and reverse it times the job with no
# prefetching (a demand-only cache), with local-disk prefetching only, and
# with cooperative prefetching and 1..4 donors, and writes
#   OUTDIR/results.json, OUTDIR/table.txt, OUTDIR/speedup.png
# (speedup over no prefetching vs nodes, like PGMS's Figure 3).
#
# Usage: scripts/bench-prefetch.sh [OUTDIR]   (default bench-results/prefetch)
# Knobs: BENCH_SCALE (0.04), BENCH_DELAY (13ms), BENCH_DONORS (4),
#        BENCH_WORKLOADS ("render hotcold random reverse"),
#        BENCH_HOTCOLD_RECORDS (1152: 6 of its 20 phases).
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
                              run_job, without_file_declarations)

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
    extra = ["--no-prefetch"] if mode == "none" else []
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
