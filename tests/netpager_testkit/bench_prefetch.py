"""Benchmarks of prefetchd, each printing a table and its ratios:

  1. pgms: PGMS's application benchmark (PGMS §4.3, docs/DESIGN.md "3
     Reference workloads") at reduced scale, keeping its ratios: 8 KiB
     blocks, 250 us of compute between accesses, local memory about 1/3 of
     the data touched, each donor as large as local memory, one disk per
     node at ~13 ms per random 8 KiB read serving one request at a time
     (nbdkit delay + noparallel; the busy node's disk is attached through
     nbdfuse, each donor's replica is served by its own nbdkit). For each
     workload it times the job with no prefetching (a demand-only cache),
     with local-disk prefetching only, and with cooperative prefetching and
     1..BENCH_DONORS donors, alternating these sides round by round; the
     runs use --direct-io, so local memory is prefetchd's --local-cache
     alone, as in PGMS. Speedups over no prefetching by nodes (like PGMS's
     Figure 3, also drawn in OUTDIR/speedup.png) and over local-disk
     prefetching. PGMS on render with 5 nodes: 4.9x over none, 3.1x over
     local-disk prefetching.
  2. app: a real application on a single disk, no donors, no replicas: the
     sqlite3 CLI scanning a database whose leaf pages lie scattered over
     the file (BENCH_APP_DELAY per read, one at a time). Cold: read
     directly (page cache, cold), through prefetchd unhinted, and hinted by
     a recording (job add --record, made once, first). Hot, everything in
     memory: the page cache (the database's local copy) against a hinted
     run whose file is in the mount's page cache, and one served out of
     prefetchd's own buffers (the mount's page cache dropped). The sides
     alternate round by round; the best of the rounds is kept. Ratios to
     the direct reads. Targets: hinted <= 1.0x direct, hot hinted <= 1.2x.

  python3 -m netpager_testkit.bench_prefetch              # both (make bench-prefetch)
  BENCH_WORKLOADS=render BENCH_DONORS=2 BENCH_APP=0 ...   # render only, 0..2 donors
  BENCH_WORKLOADS= BENCH_APP_COLD=0 ...                   # the app's hot part only

Knobs (environment): BENCH_SCALE (0.04), BENCH_DELAY (13ms), BENCH_DONORS
(4), BENCH_WORKLOADS ("render hotcold random reverse"; "" for none),
BENCH_HOTCOLD_RECORDS (1152: 6 of its 20 phases), BENCH_ROUNDS (1, rounds
of pgms, best kept), BENCH_APP (1; 0 to skip), BENCH_APP_ROWS (200000: 28
MB), BENCH_APP_DELAY (5ms), BENCH_APP_ROUNDS (3, best kept), BENCH_APP_COLD
(1; 0: of the cold runs only one direct read and the recording the hot part
needs).

Each benchmark writes OUTDIR/NAME.txt and OUTDIR/NAME.json (--out, default
bench-results/prefetch); pgms also OUTDIR/speedup.png. Donors run
pager-server when libpager_server.so is built, else nbdkit's memory
plugin. Run as root (FUSE mounts); binaries come from NETPAGER_TARGET_DIR
(default target/release). Loopback only. The work directory is on a real
disk (/tmp unless it is tmpfs, else /var/tmp, else the repository's
target/). Each run has its own Teardown: every process it started is
stopped by pid and every mount unmounted, on every exit.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .bench import Report, arg_parser, die, disk_workdir, drop_cached, env_int, env_str, ratio, require
from .cleanup import Teardown, install_handlers
from .donor import Cluster
from .paths import server_plugin
from .prefetch import (Prefetchd, Replica, SlowDisk, binary, donor_arg, generate, run_job,
                       scattered_db, sqlite_scan, without_file_declarations)

PROG = "bench-prefetch"
COMPUTE_US = 250
BS = 8192


@dataclass
class Knobs:
    scale: float
    delay: str
    donors: int
    workloads: list[str]
    hotcold_records: int
    rounds: int
    app: bool
    app_rows: int
    app_delay: str
    app_rounds: int
    app_cold: bool

    @classmethod
    def from_env(cls) -> "Knobs":
        scale = env_str("BENCH_SCALE", "0.04")
        try:
            scale_f = float(scale)
        except ValueError:
            die(PROG, f"BENCH_SCALE={scale!r} is not a number")
        return cls(scale=scale_f,
                   delay=env_str("BENCH_DELAY", "13ms"),
                   donors=env_int(PROG, "BENCH_DONORS", 4),
                   workloads=env_str("BENCH_WORKLOADS", "render hotcold random reverse").split(),
                   hotcold_records=env_int(PROG, "BENCH_HOTCOLD_RECORDS", 1152),
                   rounds=env_int(PROG, "BENCH_ROUNDS", 1),
                   app=env_str("BENCH_APP", "1") != "0",
                   app_rows=env_int(PROG, "BENCH_APP_ROWS", 200000),
                   app_delay=env_str("BENCH_APP_DELAY", "5ms"),
                   app_rounds=env_int(PROG, "BENCH_APP_ROUNDS", 3),
                   app_cold=env_str("BENCH_APP_COLD", "1") != "0")


def best(runs: list[dict]) -> dict:
    """The fastest of a side's runs (a shared machine only ever slows one down)."""
    return min(runs, key=lambda r: r["elapsed_s"])


# ---------------------------------------------------------- 1. pgms
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


@dataclass
class Workload:
    """One data set on its slow disk, its donors and their replicas."""
    ds: dict
    disk: SlowDisk
    hints: Path
    limit: int | None
    local_blocks: int
    plugin: str
    donors: list
    replicas: list


def one_run(work: Path, w: Workload, side: str, n_donors: int) -> dict:
    """The job once through a fresh prefetchd: `side` none, local or coop
    (with the first `n_donors` donors)."""
    with Teardown(f"{PROG} {work.name} {side}{n_donors or ''}") as td:
        run_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"{side}-"))
        # PGMS's local memory is bounded: the kernel must not cache beside it.
        extra = ["--direct-io"] + (["--no-prefetch"] if side == "none" else [])
        dargs = []
        if side == "coop":
            export = f"prefetchd@{w.local_blocks * BS}" if w.plugin != "memory" else ""
            dargs = [donor_arg(d, r, export=export, slots=w.local_blocks)
                     for d, r in zip(w.donors[:n_donors], w.replicas[:n_donors])]
        pd = Prefetchd(td, run_dir, w.disk.dir, donors=dargs, local_cache=str(w.local_blocks * BS),
                       extra=extra)
        pd.add_job("bench", w.hints)
        r = run_job(td, run_dir, w.hints, pd.mount / "jobs" / "bench", manifest=w.ds["manifest_path"],
                    compute_us=COMPUTE_US, limit=w.limit, name="job")
        if r["mismatches"]:
            raise RuntimeError(f"{side}: job read wrong bytes: {r}")
        stats = pd.job("bench")["stats"]
        td.close_or_raise()
    return {"elapsed_s": r["elapsed_s"], "stats": stats, "records": r["records"]}


def bench_pgms(k: Knobs, top: Path, out: Path) -> None:
    plugin = str(server_plugin()) if server_plugin().exists() else "memory"
    report = Report("pgms", asdict(k))
    sides = [("none", 0), ("local", 0)] + [("coop", n) for n in range(1, k.donors + 1)]
    cols = [s if s != "coop" else f"coop{n}" for s, n in sides]
    results = {"scale": k.scale, "disk_delay": k.delay, "compute_us": COMPUTE_US, "block_size": BS,
               "donor_plugin": plugin, "workloads": {}}
    for wl in k.workloads:
        with Teardown(f"{PROG} {wl}") as td:
            work = Path(tempfile.mkdtemp(dir=top, prefix=f"{wl}-"))
            td.add(f"directory {work}", lambda work=work: shutil.rmtree(work, ignore_errors=True))
            ds = generate(wl, work / "ds", k.scale)
            limit = k.hotcold_records if wl == "hotcold" else None
            f = ds["files"][0]["path"]
            hints = without_file_declarations(ds["hints_path"], work / f"{wl}.hints")
            touched = touched_blocks(hints, limit)
            local_blocks = max(16, touched // 3)
            donors = Cluster(td, work, plugin).start_donors(
                k.donors, size=f"{max(1, local_blocks * BS // (1 << 20) + 1)}M") if k.donors else []
            w = Workload(ds=ds, disk=SlowDisk(td, work, ds["data"] / f, f, rdelay=k.delay), hints=hints,
                         limit=limit, local_blocks=local_blocks, plugin=plugin, donors=donors,
                         replicas=[Replica(td, work, ds["data"], d.addr, d.name, rdelay=k.delay)
                                   for d in donors])
            report.line(f"{wl}: {touched} blocks touched, local memory {local_blocks} blocks, donors of "
                        f"{local_blocks} blocks ({'memory' if plugin == 'memory' else 'pager-server'})")
            runs: dict[str, list[dict]] = {c: [] for c in cols}
            for rnd in range(1, k.rounds + 1):
                for col, (side, n) in zip(cols, sides):
                    r = one_run(work, w, side, n)
                    runs[col].append(r)
                    s = r["stats"]
                    report.line(f"  round {rnd} {col:6s} {r['elapsed_s']:7.2f} s  hits L/G/D "
                                f"{s['hits']['local']}/{s['hits']['global']}/{s['hits']['disk']}  "
                                f"d2g used {s['disk_to_global']['used']}  "
                                f"g2l used {s['global_to_local']['used']}  "
                                f"d2l used {s['disk_to_local']['used']}")
            td.close_or_raise()
        results["workloads"][wl] = {"touched_blocks": touched, "local_blocks": local_blocks,
                                    "runs": {c: best(runs[c]) for c in cols},
                                    "rounds_s": {c: [r["elapsed_s"] for r in runs[c]] for c in cols}}
    last = cols[-1]
    report.line()
    report.line(f"PGMS-style prefetch benchmark: scale {k.scale}, disk {k.delay}/read one at a time, "
                f"{COMPUTE_US} us compute per access, donors: {plugin}, best of {k.rounds}")
    report.line("times in seconds; speedups over no prefetching (xN) and, last column, "
                f"over local-disk prefetching with {k.donors} donors")
    report.line()
    report.line(f"{'workload':10s} " + " ".join(f"{c:>8s}" for c in cols)
                + "   speedup vs none by nodes (1..)" + f"   {k.donors}d/local")
    for wl, r in results["workloads"].items():
        t = {c: r["runs"][c]["elapsed_s"] for c in cols}
        r["speedup_vs_none"] = {c: t["none"] / t[c] for c in cols[1:]}
        r["speedup_vs_local"] = t["local"] / t[last]
        report.line(f"{wl:10s} " + " ".join(f"{t[c]:8.2f}" for c in cols) + "   "
                    + " ".join(f"{x:4.1f}x" for x in r["speedup_vs_none"].values())
                    + f"   {r['speedup_vs_local']:4.1f}x")
    report.line()
    report.line("nodes = 1 (local-disk prefetching only) + donors; PGMS on render with 4 donors: "
                "4.9x over none, 3.1x over local-disk prefetching")
    report.results = results
    report.write(out)
    plot(results, k, cols, out / "speedup.png")


def plot(results: dict, k: Knobs, cols: list[str], path: Path) -> None:
    """Speedup over no prefetching by nodes, one line a workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    xs = list(range(1, len(cols)))
    for wl, r in results["workloads"].items():
        ax.plot(xs, [r["speedup_vs_none"][c] for c in cols[1:]], marker="o", label=wl)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("nodes (1 = local-disk prefetching only, + donors)")
    ax.set_ylabel("speedup over no prefetching")
    ax.set_xticks(xs)
    ax.set_title(f"prefetchd, PGMS ratios at scale {k.scale} (disk {k.delay}, {COMPUTE_US} us compute)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"({path})", file=sys.stderr)


# ---------------------------------------------------------- 2. app
class App:
    """The scattered database on its slow disk, and each way of scanning it."""

    def __init__(self, td: Teardown, work: Path, k: Knobs):
        self.work = work
        self.db = scattered_db(work / "app.db", k.app_rows)
        self.expected, _ = sqlite_scan(self.db)
        self.disk = SlowDisk(td, work, self.db, "app.db", rdelay=k.app_delay)
        self.cache = str(2 * self.db.stat().st_size)
        self.hints = work / "app.hints"
        self.daemons = 0

    def daemon(self, td: Teardown) -> Prefetchd:
        self.daemons += 1
        return Prefetchd(td, self.work, self.disk.dir, local_cache=self.cache, name=f"pd{self.daemons}")

    def scan(self, path: Path) -> float:
        out, took = sqlite_scan(path)
        if out != self.expected:
            raise RuntimeError(f"sqlite3 on {path} answered {out!r}, expected {self.expected!r}")
        return took

    def direct(self) -> dict:
        drop_cached(self.disk.path)
        return {"elapsed_s": self.scan(self.disk.path), "stats": {}}

    def through(self, side: str) -> dict:
        """One cold scan through a fresh prefetchd: unhinted, record or hinted."""
        with Teardown(f"{PROG} app {side}") as td:
            pd = self.daemon(td)
            if side == "unhinted":
                took = self.scan(pd.mount / "data" / "app.db")
                stats = pd.status()["unhinted"]
            else:
                if side == "record":
                    pd.cli("job", "add", "app", "--record", self.hints)
                else:
                    pd.add_job("app", self.hints)
                took = self.scan(pd.mount / "jobs" / "app" / "app.db")
                stats = pd.job("app")["stats"]
                if side == "record":
                    # Removing the job writes the recording.
                    pd.cli("job", "remove", "app")
            td.close_or_raise()
        return {"elapsed_s": took, "stats": stats}

    def hot(self) -> dict[str, float]:
        """The page cache, a hinted run out of the mount's page cache and one
        out of prefetchd's buffers, in that order."""
        # The slow disk's FUSE file is not page-cached: the hot baseline is
        # the database's own copy, read twice.
        self.scan(self.db)
        times = {"hot_direct": self.scan(self.db)}
        with Teardown(f"{PROG} app hot") as td:
            pd = self.daemon(td)
            view = pd.mount / "jobs" / "app" / "app.db"
            pd.add_job("app", self.hints)
            self.scan(view)
            pd.cli("job", "remove", "app")
            # Hot: the mount's page cache holds the job's file.
            pd.add_job("app", self.hints)
            times["hot_hinted"] = self.scan(view)
            if pd.job("app")["stats"]["hits"]["disk"]:
                raise RuntimeError("hot run read from disk")
            pd.cli("job", "remove", "app")
            # The kernel's copy dropped: every read is served out of
            # prefetchd's own local memory.
            drop_cached(view)
            pd.add_job("app", self.hints)
            times["hot_buffers"] = self.scan(view)
            if pd.job("app")["stats"]["hits"]["disk"]:
                raise RuntimeError("hot run out of prefetchd's buffers read from disk")
            td.close_or_raise()
        return times

    def recorded_reads(self) -> int:
        return sum(1 for line in self.hints.read_text().splitlines()[1:]
                   if line and not line.startswith(("job ", "block-size ", "file ", "records", "repeat ")))


def bench_app(k: Knobs, top: Path, out: Path) -> None:
    report = Report("app", asdict(k))
    report.line("app: sqlite3 table scan of a scattered database, one disk, no donors")
    cold = ["direct", "unhinted", "hinted"] if k.app_cold else ["direct"]
    hot = ["hot_direct", "hot_hinted", "hot_buffers"]
    runs: dict[str, list[dict]] = {s: [] for s in ["record", *cold]}
    hot_s: dict[str, list[float]] = {s: [] for s in hot}
    with Teardown(f"{PROG} app") as td:
        work = Path(tempfile.mkdtemp(dir=top, prefix="app-"))
        td.add(f"directory {work}", lambda: shutil.rmtree(work, ignore_errors=True))
        app = App(td, work, k)
        # The hinted and hot runs replay this recording.
        runs["record"].append(app.through("record"))
        report.line(f"  record            {runs['record'][0]['elapsed_s']:7.3f} s")
        for rnd in range(1, k.app_rounds + 1):
            # Without the cold part, one direct read still prices the disk.
            for side in cold if k.app_cold or rnd == 1 else []:
                runs[side].append(app.direct() if side == "direct" else app.through(side))
                report.line(f"  round {rnd} {side:11s} {runs[side][-1]['elapsed_s']:7.3f} s")
            for side, took in app.hot().items():
                hot_s[side].append(took)
                report.line(f"  round {rnd} {side:11s} {took:7.3f} s")
        recorded = app.recorded_reads()
        size = app.db.stat().st_size
        td.close_or_raise()
    kept = {s: best(r) for s, r in runs.items()}
    t = {**{s: r["elapsed_s"] for s, r in kept.items()}, **{s: min(v) for s, v in hot_s.items()}}
    ratios = {**{s: t[s] / t["direct"] for s in ("unhinted", "record", "hinted") if s in t},
              "hot_hinted": t["hot_hinted"] / t["hot_direct"],
              "hot_buffers": t["hot_buffers"] / t["hot_direct"]}
    report.line()
    report.line(f"sqlite3 scan of a {size / 1e6:.1f} MB database with scattered leaf pages, "
                f"one disk ({k.app_delay}/read, one at a time), no donors; best of {k.app_rounds}")
    report.line(f"{'':22s} {'time s':>8s} {'/direct':>8s}")
    report.line(f"{'direct from the disk':22s} {t['direct']:8.2f} {ratio(1, 1):>8s}")
    for s in (s for s in ("unhinted", "record", "hinted") if s in t):
        report.line(f"{'prefetchd ' + s:22s} {t[s]:8.2f} {ratio(t[s], t['direct']):>8s}")
    report.line(f"{'hot: page cache':22s} {t['hot_direct']:8.3f} {ratio(1, 1):>8s}")
    report.line(f"{'hot: prefetchd hinted':22s} {t['hot_hinted']:8.3f} "
                f"{ratio(t['hot_hinted'], t['hot_direct']):>8s}")
    report.line(f"{'hot: prefetchd buffers':22s} {t['hot_buffers']:8.3f} "
                f"{ratio(t['hot_buffers'], t['hot_direct']):>8s}"
                "   (page cache dropped: every read served by the daemon)")
    report.line("targets: hinted <= 1.0x direct, hot hinted <= 1.2x")
    report.results = {"rows": k.app_rows, "db_bytes": size, "disk_delay": k.app_delay,
                      "rounds": k.app_rounds, "recorded_reads": recorded, "times_s": t,
                      "rounds_s": {**{s: [r["elapsed_s"] for r in v] for s, v in runs.items()}, **hot_s},
                      "stats": {s: r["stats"] for s, r in kept.items() if s != "direct"},
                      "ratios": ratios}
    report.write(out)


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__, "prefetch", "NAME.txt, NAME.json and speedup.png")
    args = ap.parse_args(argv)
    k = Knobs.from_env()
    require(PROG, ["nbdkit", "nbdfuse", "fusermount3", "findmnt"] + (["sqlite3"] if k.app else []),
            [binary(b) for b in ("prefetchd", "prefetch-job", "pager-hints")], root=True)
    install_handlers()
    with Teardown(PROG) as top:
        work = disk_workdir(top, "np-bench-prefetch-")
        print(f"work directory {work} (on a real disk)", file=sys.stderr, flush=True)
        if k.workloads:
            bench_pgms(k, work, args.out)
        if k.app:
            bench_app(k, work, args.out)
        top.close_or_raise()
    return 0


if __name__ == "__main__":
    sys.exit(main())
