"""What the rebalancer costs the I/O it runs beside (issue 38), run by
`bench_client` when named (`make bench-client WHICH=rebalance`).

Each side: donors d1 and d2 (budget 2x the device each) hold a device of
REBAL_SIZE (mode none, epoch 1 s) filled with fio; d3 (4x the device)
joins, so that by the weighted age/load rule d3's share is half the
device and the rebalancer has extents to move to it. fio then reads 4 KiB
pages at queue depth 1 (psync, direct) from the device's first quarter
for REBAL_RUNTIME seconds: that quarter stays hot, so the rebalancer
moves the cold rest, which is what it is for. The sides differ only in
`--rebalance-rate`: "moving" runs at the default rate (REBAL_RATE, and
REBAL_BUSY_RATE while the device serves requests, which it does
throughout here), "idle" at 0; they alternate, each round in the other order, with the same
donors, sizes and timings. Reported: each side's read p50, p99 and p99.9
(fio's clat percentiles), the MiB moved during the reads, and moving/idle.
Target: p99 within 1.3x.

Then the swap job with a join (bench_join's join run: memhog touching 3x
LIMIT in a LIMIT cgroup through 2 donors, a third joining a third of the
way through, swap with discard), with the rebalancer at REBAL_RATE and
off, alternating: the job's seconds and their ratio. Target: within 1.05x.

Knobs (environment): ROUNDS (2), REBAL_SIZE (256M), REBAL_RUNTIME (20 s),
REBAL_RATE (4M), REBAL_BUSY_RATE (1M, the client's default
--rebalance-busy-rate), LIMIT (128M), REBAL_JOB (1; 0 leaves the swap job
out).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from .bench import die, env_int, env_str, fio_json, fmt_row
from .bench_join import join_run
from .cleanup import Teardown
from .client import PagerClient, donor_spec, run_pagerctl
from .demo import parse_size
from .donor import Cluster
from .paths import server_plugin

PROG = "bench-client"
SIDES = ("moving", "idle")
PERCENTILES = (("p50", "50.000000"), ("p99", "99.000000"), ("p99.9", "99.900000"))


def moved_bytes(client: PagerClient) -> int:
    return client.device_status()["totals"]["rebalance"].get("moved_bytes", 0)


def rebalance_run(b, tag: str, rate: list[str], size: int, runtime: int) -> dict:
    """One side: the reads' latency percentiles (us) and the bytes moved."""
    with Teardown(f"rebalance {tag}") as td:
        cluster = Cluster(td, b.work / tag, server_plugin())
        donors = cluster.start_donors(3, size=f"{4 * size >> 20}M",
                                      budgets=[f"{2 * size >> 20}M", f"{2 * size >> 20}M", f"{4 * size >> 20}M"])
        client = PagerClient(td, b.work / f"c-{tag}", client_id="bench")
        dev = client.attach(donors[:2], mode="none", size=f"{size >> 20}M",
                            extra=["--epoch", "1", *rate])
        fio_json(["--name=fill", f"--filename={dev}", "--rw=write", "--bs=1M", f"--size={size}", "--direct=1"],
                 b.work)
        run_pagerctl(["donor-add", "--state-dir", client.state_dir, donor_spec(donors[2])])
        before = moved_bytes(client)
        j = fio_json(["--name=qd1", f"--filename={dev}", "--rw=randread", "--bs=4k", "--iodepth=1",
                      "--ioengine=psync", "--direct=1", f"--size={size // 4}", "--time_based",
                      f"--runtime={runtime}"], b.work)
        time.sleep(1.2)  # status.json is rewritten each second
        moved = moved_bytes(client) - before
        td.close_or_raise()
    pct = j["read"]["clat_ns"]["percentile"]
    return {**{name: round(pct[key] / 1000, 1) for name, key in PERCENTILES}, "moved_mib": moved >> 20,
            "ios": j["read"]["total_ios"]}


def bench_rebalance(b, out: Path) -> None:
    k = b.knobs
    size = parse_size(env_str("REBAL_SIZE", "256M"))
    runtime = env_int(PROG, "REBAL_RUNTIME", 20)
    rate = env_str("REBAL_RATE", "4M")
    busy = env_str("REBAL_BUSY_RATE", "1M")
    b.report.knobs.update({"rebal_size": size, "rebal_runtime": runtime, "rebal_rate": rate,
                           "rebal_busy_rate": busy})
    sides = {"moving": ["--rebalance-rate", rate, "--rebalance-busy-rate", busy],
             "idle": ["--rebalance-rate", "0"]}
    b.report.line(f"== rebalance: QD1 4 KiB reads of a {size >> 22} MiB hot quarter of a {size >> 20} MiB "
                  f"device (mode none) for {runtime} s, right after d3 joins d1 and d2; moving: "
                  f"--rebalance-rate {rate} (--rebalance-busy-rate {busy}), idle: 0; {k.rounds} rounds, "
                  "alternating")
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for rnd in range(1, k.rounds + 1):
        for side in SIDES if rnd % 2 else SIDES[::-1]:
            r = rebalance_run(b, f"{side}-r{rnd}", sides[side], size, runtime)
            runs[side].append(r)
            print(f"round {rnd}: {side} {r}", file=sys.stderr, flush=True)
    w = [8, 26, 26, 26, 14]
    b.report.line(fmt_row(w, ["side", *[f"{n} us per round" for n, _ in PERCENTILES], "MiB moved"]))
    for side in SIDES:
        b.report.line(fmt_row(w, [side, *[" ".join(str(r[n]) for r in runs[side]) for n, _ in PERCENTILES],
                                  " ".join(str(r["moved_mib"]) for r in runs[side])]))
    ratios = {n: round(statistics.median(runs["moving"][i][n] / runs["idle"][i][n] for i in range(k.rounds)), 2)
              for n, _ in PERCENTILES}
    b.report.line(fmt_row(w, ["ratio", *[f"{ratios[n]:.2f}x" for n, _ in PERCENTILES], ""]))
    b.report.line("(ratio: moving/idle, the median of the rounds' ratios; target: p99 within 1.3x)")
    b.report.results = {"runs": runs, "ratios": ratios}
    if env_int(PROG, "REBAL_JOB", 1):
        b.report.results["job"] = swap_job_with_join(b, sides)


def swap_job_with_join(b, sides: dict[str, list[str]]) -> dict:
    """The join run's job with the rebalancer as on each side (its
    pagerctl attach arguments)."""
    k = b.knobs
    b.join_epoch, b.join_discard = 1.0, True
    cal = join_run(b, "rebal-calibrate", None, None)
    if cal.get("oom_killed"):
        die(PROG, "the calibration run was OOM-killed: no time to join at")
    join_at = cal["seconds"] / 3
    secs: dict[str, list[float]] = {s: [] for s in sides}
    for rnd in range(1, k.rounds + 1):
        for side in SIDES if rnd % 2 else SIDES[::-1]:
            r = join_run(b, f"job-{side}-r{rnd}", None, join_at, sides[side])
            if r.get("oom_killed"):
                die(PROG, f"the swap job ({side}, round {rnd}) was OOM-killed")
            secs[side].append(r["seconds"])
            print(f"round {rnd}: swap job, {side}: {r['seconds']} s", file=sys.stderr, flush=True)
    ratio = round(statistics.median(m / i for m, i in zip(secs["moving"], secs["idle"])), 2)
    b.report.line(f"== the swap job ({k.limit} cgroup, 3x touched) with d3 joining at {join_at:.1f} s: "
                  f"seconds per round, moving {' '.join(map(str, secs['moving']))}, idle "
                  f"{' '.join(map(str, secs['idle']))}; moving/idle {ratio:.2f}x (target: within 1.05x)")
    return {"join_at": round(join_at, 1), "seconds": secs, "ratio": ratio}


RUN = {"rebalance": bench_rebalance}
