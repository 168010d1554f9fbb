"""Benchmarks of live membership (issue 23), run by `bench_client` when named:

  join: Voelker's thesis §3.4 ("Naive Load Balancing") on real processes.
     memhog touches 3x LIMIT in a LIMIT memory cgroup, swapping through
     the client (mode none, fuse-uring) on 2 donors of LIMIT each; a third
     donor of 2x LIMIT joins (`pagerctl donor-add`) a third of the way
     through the job (a third of a calibration run's time on the 2 donors
     alone, run first). Swap is on with discard (JOIN_DISCARD), so freed
     swap clusters free their extents and are placed anew when reused. Device and fallback file (local disk: Voelker's
     disk) are 4x LIMIT. For each b (JOIN_BS, alternating round by round,
     same donors and sizes on every side): seconds from the join until the
     newcomer holds its share, the job's time, and each donor's extents and
     utilisation over time, sampled from status.json every 0.2 s (the
     device rewrites it about once a second). Its share: its capacity share
     of the donors' budgets (2/4 here); it holds it once its extents are at
     least 90% of that share of all extents the donors hold. One plot,
     join.png, of the last round. Then `pagerctl simulate --shape join`
     of the same shape (its epochs until the newcomer holds its share).
  epochs: epoch cost at scale. One client (mode none, fuse-uring, epoch
     EPOCH_SECS) on 8, 32 and 64 donors (EPOCH_DONORS; size=64M budget=32M,
     on 127.0.0.2..), its 128M device filled, then QD1 4 KiB random reads
     (fio, psync, direct) for EPOCH_RUNTIME seconds with a per-I/O latency
     log (log_unix_epoch=1: completion time in ms since the Unix epoch).
     The device's status lists each epoch's start (ms) and wall time (us);
     an I/O overlapped an epoch when it completed at or after the epoch's
     start and started (completion minus latency) before its end, both to
     the ms the logs give (so the overlapping side also takes in I/Os up to
     1 ms either side). p50/p99 of each side and their ratio; target: p99
     during an epoch <= 1.1x between at 64 donors.

Knobs (environment): ROUNDS (2), LIMIT (128M), JOIN_BS ("0 0.9 1"),
JOIN_EPOCH (1 s, the join run's epoch), JOIN_DISCARD (1: swapon --discard;
0: without, so an extent stays placed after the job and only the rebalancer
moves it: the share is then looked for up to JOIN_SETTLE seconds after the
job too), EPOCH_DONORS ("8 32 64"),
EPOCH_SECS (0.5), EPOCH_RUNTIME (20 s).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .attach import Swap
from .bench import die, env_int, env_str, fio_json, mean
from .cleanup import Teardown
from .client import Job, PagerClient, donor_spec, run_pagerctl
from .demo import parse_size
from .donor import Cluster
from .paths import job, pagerctl, server_plugin

PROG = "bench-client"
# Sampling period of status.json (the device rewrites it about once a second).
SAMPLE_S = 0.2
# The newcomer holds its share once it holds this fraction of it.
SHARE_TOLERANCE = 0.9
# Without discard: how long after the job the newcomer's share is waited for.
JOIN_SETTLE = 120


def fmt_row(widths: list[int], cells) -> str:
    """Cells padded to `widths`, the first left-aligned."""
    return " ".join(f"{str(c):<{w}}" if i == 0 else f"{str(c):>{w}}"
                    for i, (c, w) in enumerate(zip(cells, widths)))


def env_float(name: str, default: float) -> float:
    text = env_str(name, str(default))
    try:
        return float(text)
    except ValueError:
        die(PROG, f"{name}={text!r} is not a number")


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of `values`."""
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


# ----------------------------------------------------------------- join
def share_reached(samples: list[dict], newcomer: str, share: float, after: float,
                  until: float = math.inf) -> float | None:
    """Seconds (from the job's start) of the first sample from `after` to
    `until` in which `newcomer` holds at least SHARE_TOLERANCE of `share`
    of the extents the donors hold; None if none does."""
    for s in samples:
        if not after <= s["t"] <= until:
            continue
        held = s["extents"]
        total = sum(held.values())
        if total and held.get(newcomer, 0) >= SHARE_TOLERANCE * share * total:
            return s["t"]
    return None


class StatusSampler(threading.Thread):
    """Reads STATE_DIR/status.json every SAMPLE_S seconds, keeping each
    version once (by its write time): per donor extents held, utilisation
    and f, and the extents on the fallback, at seconds since `t0`."""

    def __init__(self, state_dir: Path, t0: float):
        super().__init__(daemon=True)
        self.path = state_dir / "status.json"
        self.t0 = t0
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        self._seen = None

    def sample(self) -> None:
        try:
            st = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return  # not written yet (the write itself is atomic)
        if st["updated_unix_ms"] == self._seen:
            return
        self._seen = st["updated_unix_ms"]
        self.samples.append({
            "t": round(time.monotonic() - self.t0, 2),
            "extents": {d["name"]: d["extents_held"] for d in st["donors"]},
            "utilisation": {d["name"]: d["utilisation"] for d in st["donors"]},
            "f": {d["name"]: d["f"] for d in st["donors"]},
            "fallback": st["totals"]["on_fallback"],
        })

    def run(self) -> None:
        while not self.stop_event.wait(SAMPLE_S):
            self.sample()


def join_run(b, tag: str, bval: float | None, join_at: float | None, rebalance=()) -> dict:
    """One job on 2 donors; with `join_at`, the third joins that many
    seconds after the job started. `bval` None: the device's default b;
    `rebalance`: pagerctl attach arguments for its rebalancer (none: the
    defaults)."""
    limit = parse_size(b.knobs.limit)
    device = 4 * limit
    with Teardown(f"join {tag}") as td:
        cluster = Cluster(td, b.work / tag, server_plugin())
        donors = cluster.start_donors(3, size=f"{device >> 20}M",
                                      budgets=[f"{limit >> 20}M", f"{limit >> 20}M", f"{2 * limit >> 20}M"])
        client = PagerClient(td, b.work / f"c-{tag}", client_id="bench")
        fallback = b.work / f"fallback-{tag}.img"
        td.add(f"fallback file {fallback}", lambda: fallback.unlink(missing_ok=True))
        extra = ["--epoch", str(b.join_epoch), "--fallback", fallback, "--fallback-size", str(device),
                 *rebalance]
        if bval is not None:
            extra += ["--b", str(bval)]
        dev = client.attach(donors[:2], mode="none", size=f"{device >> 20}M", extra=extra)
        capacity = {d.name: parse_size(str(d.params["budget"])) for d in donors}
        share = capacity[donors[2].name] / sum(capacity.values())
        # With discard the kernel trims each swap cluster it frees, the device
        # frees the extents under it, and reuse places them anew: a stream of
        # placements, as GMS's putpages are. Without, an extent stays on the
        # donor it was first written to.
        Swap(td, dev, priority=32767, discard=b.join_discard)
        t0 = time.monotonic()
        sampler = StatusSampler(client.state_dir, t0)
        sampler.start()
        j = Job(td, [job("memhog"), 3 * limit, "--passes", "1"], limit, b.work / f"memhog-{tag}.log", dev)
        joined = None
        if join_at is not None:
            while j.proc.wait(0.05) is None and time.monotonic() - t0 < join_at:
                pass
            if j.alive():
                run_pagerctl(["donor-add", "--state-dir", client.state_dir, donor_spec(donors[2])])
                joined = round(time.monotonic() - t0, 2)
        while j.proc.wait(0.05) is None:
            if time.monotonic() - t0 > 900:
                die(PROG, f"memhog {tag} still running after 900 s")
        seconds = time.monotonic() - t0
        if j.cgroup.oom_kills():
            sampler.stop_event.set()
            # A loaded machine's swap device can fall behind a cgroup v1's
            # reclaim: reported as such, the other runs go on.
            print(f"memhog {tag} was OOM-killed after {seconds:.1f} s", file=sys.stderr, flush=True)
            td.close_or_raise()
            return {"oom_killed": True, "seconds": round(seconds, 1)}
        out = j.finish(0)
        if "memhog: OK" not in out:
            die(PROG, f"memhog {tag} did not verify: {out}")
        if joined is not None and not b.join_discard:
            # Without discard the extents outlive the job and the
            # rebalancer goes on moving them: the newcomer's share is
            # looked for after the job too, for up to JOIN_SETTLE seconds.
            deadline = time.monotonic() + JOIN_SETTLE
            while (time.monotonic() < deadline
                   and share_reached(sampler.samples, donors[2].name, share, joined) is None):
                time.sleep(SAMPLE_S)
        time.sleep(1.2)  # one more status.json, after the job
        sampler.stop_event.set()
        sampler.join()
        sampler.sample()
        td.close_or_raise()
    # With discard only while the job runs: its exit frees its swap.
    until = seconds if b.join_discard else math.inf
    reached = (share_reached(sampler.samples, donors[2].name, share, joined, until)
               if joined is not None else None)
    last = sampler.samples[-1] if sampler.samples else {"extents": {}, "fallback": 0}
    total = sum(last["extents"].values())
    return {"seconds": round(seconds, 1), "joined_s": joined, "share_target": share,
            "share_s": None if reached is None else round(reached - joined, 2),
            "final_share": round(last["extents"].get(donors[2].name, 0) / total, 3) if total else 0.0,
            "final_extents": last["extents"], "final_fallback": last["fallback"],
            "newcomer": donors[2].name, "samples": sampler.samples}


SIM_EPOCHS = 60


def simulate_join(bs: list[float]) -> dict:
    """`pagerctl simulate --shape join`: 2 equal idle donors, a third of
    twice their size joining empty after a third of the epochs, one client.
    Per b, the epochs from the join until the newcomer holds its share, by
    the same rule as the real run (None: never)."""
    p = subprocess.run([pagerctl(), "simulate", "--donors", "3", "--clients", "1", "--shape", "join",
                        "--epochs", str(SIM_EPOCHS), "--b", ",".join(map(str, bs)), "--json"],
                       capture_output=True, text=True, check=True)
    report = json.loads(p.stdout)
    join = report["config"]["idle_epoch"]
    out = {}
    for row in report["rows"]:
        if row["policy"] != "weighted":
            continue
        samples = [{"t": e, "extents": {str(i): h for i, h in enumerate(p["held"])}}
                   for e, p in enumerate(row["per_epoch"])]
        # Epoch e's sample is taken at its end: e - join + 1 epochs after the join.
        at = share_reached(samples, "2", 0.5, join)
        out[str(row["b"])] = {"epochs_to_share": None if at is None else at - join + 1,
                              "age_deviation": row["age_deviation"], "skew": row["skew"]}
    return {"join_epoch": join, "rows": out}


def plot_join(runs: dict, path: Path, title: str) -> None:
    """Per b, each donor's extents over time (top) and its utilisation
    (bottom), with the join marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 6.4), sharex="col", squeeze=False)
    for col, (label, r) in enumerate(runs.items()):
        names = sorted({n for s in r["samples"] for n in s["extents"]})
        ts = [s["t"] for s in r["samples"]]
        for n in names:
            axes[0][col].plot(ts, [s["extents"].get(n, 0) for s in r["samples"]], label=n)
            axes[1][col].plot(ts, [s["utilisation"].get(n, 0.0) for s in r["samples"]], label=n)
        axes[0][col].plot(ts, [s["fallback"] for s in r["samples"]], ":", color="grey", label="fallback")
        for ax in (axes[0][col], axes[1][col]):
            if r["joined_s"] is not None:
                ax.axvline(r["joined_s"], color="black", linewidth=0.8, linestyle="--")
            if r["share_s"] is not None:
                ax.axvline(r["joined_s"] + r["share_s"], color="green", linewidth=0.8)
            ax.grid(True, alpha=0.3)
        axes[0][col].set_title(label)
        axes[1][col].set_xlabel("seconds since the job started")
    axes[0][0].set_ylabel("extents held")
    axes[1][0].set_ylabel("donor utilisation")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"({path})", file=sys.stderr)


def bench_join(b, out: Path) -> None:
    k = b.knobs
    bs = [float(x) for x in env_str("JOIN_BS", "0 0.9 1").split()]
    b.join_epoch = env_float("JOIN_EPOCH", 1.0)
    b.join_discard = env_int(PROG, "JOIN_DISCARD", 1) != 0
    b.report.knobs.update({"join_bs": bs, "join_epoch": b.join_epoch, "join_discard": b.join_discard})
    limit = parse_size(k.limit)
    b.report.line(f"== join: memhog touching {3 * limit >> 20} MiB in a {k.limit} memory cgroup "
                  f"(1 verify pass), mode none, device and fallback {4 * limit >> 20} MiB;")
    b.report.line(f"   donors d1, d2 of {limit >> 20} MiB from the start, d3 of {2 * limit >> 20} MiB "
                  f"joins a third of the way through; epoch {b.join_epoch} s, {k.rounds} rounds, "
                  f"swap {'with' if b.join_discard else 'without'} discard")
    cal = join_run(b, "calibrate", None, None)
    if cal.get("oom_killed"):
        die(PROG, "the calibration run was OOM-killed: no time to join at")
    join_at = cal["seconds"] / 3
    b.report.line(f"   2 donors alone (calibration, default b): {cal['seconds']} s; join at {join_at:.1f} s")
    runs: dict[str, list[dict]] = {str(x): [] for x in bs}
    for rnd in range(1, k.rounds + 1):
        for x in bs:
            r = join_run(b, f"b{x}-r{rnd}", x, join_at)
            runs[str(x)].append(r)
            if not r.get("oom_killed"):
                print(f"round {rnd}: b={x} job {r['seconds']} s, share after {r['share_s']} s, "
                      f"final share {r['final_share']}", file=sys.stderr, flush=True)
    b.report.line(f"   its share: >= {SHARE_TOLERANCE:.0%} of {2 / 4:.2f} (its part of the donors' "
                  f"budgets) of the extents donors hold")
    w = [6, 22, 14, 22, 18, 14]
    b.report.line(fmt_row(w, ["b", "s to share, per round", "job s (mean)", "job s per round",
                              "final d3 share", "on fallback"]))

    def cells(rs, fn):
        return " ".join("OOM" if r.get("oom_killed") else fn(r) for r in rs)

    for x in bs:
        rs = runs[str(x)]
        done = [r["seconds"] for r in rs if not r.get("oom_killed")]
        b.report.line(fmt_row(w, [x, cells(rs, lambda r: "-" if r["share_s"] is None else f"{r['share_s']:.1f}"),
                                  f"{mean(done):.1f}" if done else "-",
                                  cells(rs, lambda r: f"{r['seconds']:.1f}"),
                                  cells(rs, lambda r: f"{r['final_share']:.2f}"),
                                  cells(rs, lambda r: str(r["final_fallback"]))]))
    by = "the job ended" if b.join_discard else f"{JOIN_SETTLE} s after the job"
    b.report.line(f"(-: the newcomer never held its share before {by}; OOM: the job was OOM-killed)")
    out.mkdir(parents=True, exist_ok=True)
    last = {f"b = {x}": next((r for r in reversed(runs[str(x)]) if not r.get("oom_killed")), None) for x in bs}
    plot_join({label: r for label, r in last.items() if r}, out / "join.png",
              f"d3 joins at {join_at:.1f} s (dashed); green: holds its share")
    sim = simulate_join(bs)
    b.report.line(f"pagerctl simulate --shape join --donors 3 --clients 1 --epochs {SIM_EPOCHS} "
                  f"(d3 joins at epoch {sim['join_epoch']}), epochs from the join until d3 holds its share:")
    for x in bs:
        r = sim["rows"][str(x)]
        b.report.line(f"   b={x}: {r['epochs_to_share'] if r['epochs_to_share'] is not None else '-'}"
                      f" (age deviation {r['age_deviation']:.1%}, skew {r['skew']:.2f})")
    b.report.line()
    b.report.results = {"calibration": {k2: v for k2, v in cal.items() if k2 != "samples"},
                        "join_at_s": round(join_at, 2), "share_tolerance": SHARE_TOLERANCE,
                        "b": runs, "simulate": sim}


# --------------------------------------------------------------- epochs
def read_lat_log(path: Path) -> list[tuple[int, float]]:
    """(completion ms since the Unix epoch, latency us) of each I/O in a fio
    latency log (`time, value ns, direction, bs, ...` per line)."""
    out = []
    with open(path) as f:
        for line in f:
            fields = line.split(",")
            out.append((int(fields[0]), int(fields[1]) / 1000))
    return out


def split_by_epochs(ios: list[tuple[int, float]], epochs: list[tuple[int, int]]) -> tuple[list[float], list[float]]:
    """Latencies (us) of the I/Os that overlapped an epoch and of the rest.
    An I/O completed at `c` ms after taking `lat` us overlapped the epoch
    starting at `s` ms and lasting `w` us when c >= s and c - lat <= s + w,
    both ends widened to whole ms (the logs' resolution)."""
    spans = sorted((s, s + math.ceil(w / 1000)) for s, w in epochs)
    during, between = [], []
    i = 0
    for c, lat in sorted(ios):
        start = c - lat / 1000
        while i < len(spans) and spans[i][1] + 1 < start:
            i += 1
        hit = any(s <= c and start <= e + 1 for s, e in spans[i:i + 2])
        (during if hit else between).append(lat)
    return during, between


def epoch_run(b, n: int, rnd: int) -> dict:
    # Half the donors' memory at most (room for labels and uneven placement).
    size = f"{min(128, n * (parse_size(b.epoch_budget) >> 20) // 2)}M"
    with Teardown(f"epochs {n}") as td:
        cluster = Cluster(td, b.work / f"e{n}-r{rnd}", server_plugin())
        donors = cluster.start_donors(n, size=b.epoch_donor_size, budgets=b.epoch_budget)
        client = PagerClient(td, b.work / f"c-e{n}-r{rnd}", client_id="bench")
        dev = client.attach(donors, mode="none", size=size, extra=["--epoch", str(b.epoch_secs)])
        fio_json(["--name=fill", f"--filename={dev}", "--rw=write", "--bs=1M", f"--size={size}",
                  "--direct=1"], b.work)
        prefix = b.work / f"lat-e{n}-r{rnd}"
        fio_json(["--name=qd1", f"--filename={dev}", "--rw=randread", "--bs=4k", "--iodepth=1",
                  "--ioengine=psync", "--direct=1", f"--size={size}", "--time_based",
                  f"--runtime={b.epoch_runtime}", f"--write_lat_log={prefix}", "--log_unix_epoch=1"],
                 b.work)
        time.sleep(1.5)  # status.json (rewritten each second) then lists every epoch of the run
        st = client.device_status()
        held = [d["extents_held"] for d in st["donors"]]
        td.close_or_raise()
    ios = read_lat_log(Path(f"{prefix}_lat.1.log"))
    for f in b.work.glob(f"{prefix.name}_*.log"):
        f.unlink()
    # The first second is left out: the first reads of a fresh run.
    # Before the oldest epoch status still lists, I/Os cannot be told apart.
    first = max(min(c for c, _ in ios) + 1000, st["epochs"][0][0])
    ios = [io for io in ios if io[0] >= first]
    last = max(c for c, _ in ios)
    epochs = [(s, w) for s, w in st["epochs"] if first <= s <= last]
    during, between = split_by_epochs(ios, epochs)
    walls = [w for _, w in epochs]
    return {"epochs": len(epochs), "wall_us": walls, "ios_during": len(during), "ios_between": len(between),
            "during_p50": percentile(during, 50) if during else None,
            "during_p99": percentile(during, 99) if during else None,
            "between_p50": percentile(between, 50), "between_p99": percentile(between, 99),
            "extents_held_min_max": [min(held), max(held)]}


def bench_epochs(b, out: Path) -> None:
    k = b.knobs
    sizes = [int(x) for x in env_str("EPOCH_DONORS", "8 32 64").split()]
    b.epoch_secs = env_float("EPOCH_SECS", 0.5)
    b.epoch_runtime = env_int(PROG, "EPOCH_RUNTIME", 20)
    b.epoch_donor_size, b.epoch_budget = "64M", "32M"
    b.report.knobs.update({"epoch_donors": sizes, "epoch_secs": b.epoch_secs, "epoch_runtime": b.epoch_runtime})
    b.report.line(f"== epochs: one client, mode none, 128M device (at most half the donors' memory) filled, epoch {b.epoch_secs} s; QD1 4 KiB "
                  f"random reads (fio psync, direct) for {b.epoch_runtime} s; donors size=64M budget=32M; "
                  f"{k.rounds} rounds")
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for rnd in range(1, k.rounds + 1):
        for n in sizes:
            r = epoch_run(b, n, rnd)
            runs[n].append(r)
            print(f"round {rnd}: {n} donors: epoch p50 {statistics.median(r['wall_us']) / 1000:.1f} ms, "
                  f"read p99 during {r['during_p99']} between {r['between_p99']} us",
                  file=sys.stderr, flush=True)
    w = [8, 9, 11, 11, 11, 11, 11, 11, 11, 10]
    b.report.line(fmt_row(w, ["donors", "epochs", "wall p50", "wall max", "during p50", "during p99",
                              "betw. p50", "betw. p99", "p99 ratio", "I/Os in"]))
    b.report.line(fmt_row(w, ["", "", "ms", "ms", "us", "us", "us", "us", "", "epochs"]))
    summary = {}
    for n in sizes:
        rs = runs[n]
        walls = [x for r in rs for x in r["wall_us"]]
        dp99 = [r["during_p99"] for r in rs if r["during_p99"] is not None]
        bp99 = [r["between_p99"] for r in rs]
        ratio = mean(dp99) / mean(bp99) if dp99 else None
        summary[n] = {"wall_p50_ms": statistics.median(walls) / 1000, "wall_max_ms": max(walls) / 1000,
                      "p99_ratio": ratio}
        dp50 = [r["during_p50"] for r in rs if r["during_p50"] is not None]
        ios_in = sum(r["ios_during"] for r in rs) / sum(r["ios_during"] + r["ios_between"] for r in rs)
        b.report.line(fmt_row(w, [n, sum(r["epochs"] for r in rs), f"{summary[n]['wall_p50_ms']:.2f}",
                                  f"{summary[n]['wall_max_ms']:.2f}",
                                  f"{mean(dp50):.1f}" if dp50 else "-", f"{mean(dp99):.1f}" if dp99 else "-",
                                  f"{mean([r['between_p50'] for r in rs]):.1f}", f"{mean(bp99):.1f}",
                                  f"{ratio:.2f}x" if ratio else "-", f"{ios_in:.1%}"]))
    b.report.line("(percentiles: mean over rounds; target: p99 during an epoch <= 1.1x between at 64 donors)")
    b.report.line()
    b.report.results = {"rounds": {str(n): v for n, v in runs.items()},
                        "summary": {str(n): v for n, v in summary.items()}}


RUN = {"join": bench_join, "epochs": bench_epochs}
