"""Where a real program's reads land (issue 38's spread), run by
`bench_client` when named (`make bench-client WHICH=spread`).

The redis job of `make bench-apps` (its REDIS_* knobs) first runs with all
its memory, which measures its peak; then at SPREAD_FRACTION percent of
that peak (default 50) swapping through a client in mode none on 4
donors, with the rebalancer at its defaults ("on") and off
(`--rebalance-rate 0`), alternating sides round by round (ROUNDS). Per
donor, from the client's status before and after the job: its target
share (f_i normalised: what the weighted age/load rule gives it), its
share of the read requests the job sent, and reads over target. Extent
shares are not reported: swap discard frees the job's extents as it
exits, before status can be read. Target: no donor serves more than 1.5x
its share of the reads.
"""

from __future__ import annotations

import statistics
import sys
import time

from .bench import die, env_int, fmt_row
from .client import PagerClient
from .cleanup import Teardown

PROG = "bench-client"
SIDES = {"on": [], "off": ["--rebalance-rate", "0"]}
DONORS = 4
TARGET = 1.5


def donor_reads(client: PagerClient) -> dict[str, dict]:
    """Each donor's read count and target share, from status."""
    return {d["name"]: {"reads": d["reads"], "target": d["target_share"]}
            for d in client.status()["status"]["donors"]}


def spread_run(b, apps, k, tag: str, extra: list[str], limit: int) -> dict:
    """One side: the job's result and each donor's reads against its share."""
    with Teardown(f"spread {tag}") as td:
        donors = b.donors(td, DONORS, None, tag)
        client = b.attach(td, tag, donors, "none", "1G", "fuse-uring", swap=True, extra=extra)
        before = donor_reads(client)
        r = apps.run_program(td, k, b.work, "redis", limit, {"device": client.device, "client": client})
        time.sleep(1.2)  # status.json is rewritten each second
        after = donor_reads(client)
        td.close_or_raise()
    if "failed" in r:
        die(PROG, f"redis at {limit >> 20} MiB ({tag}) failed: {r['failed']}\n{r.get('log', '')}")
    reads = {n: after[n]["reads"] - before[n]["reads"] for n in after}
    total = sum(reads.values()) or 1
    rows = {n: {"reads": reads[n], "read_share": round(reads[n] / total, 3), "target": round(after[n]["target"], 3),
                "over_target": round(reads[n] / total / after[n]["target"], 2) if after[n]["target"] else None}
            for n in sorted(after)}
    worst = max((x["over_target"] for x in rows.values() if x["over_target"] is not None), default=0.0)
    return {"ops": r["result"]["ops"], "donors": rows, "worst": worst}


def bench_spread(b, _out) -> None:
    # bench_apps imports bench_client, which imports this module.
    from . import bench_apps as apps

    k = apps.Knobs.from_env()
    k.programs = ["redis"]
    apps.check_programs(k)
    frac = env_int(PROG, "SPREAD_FRACTION", 50)
    with Teardown("spread 100%") as td:
        full = apps.run_program(td, k, b.work, "redis", apps.UNLIMITED, {})
        td.close_or_raise()
    if "failed" in full:
        die(PROG, f"redis failed with all its memory: {full['failed']}\n{full['log']}")
    limit = full["peak_bytes"] * frac // 100
    b.report.knobs.update({"spread_fraction": frac, "redis_keys": k.redis_keys, "redis_value": k.redis_value,
                           "redis_gets": k.redis_gets})
    b.report.line(f"== spread: redis ({k.redis_keys} values of {k.redis_value} B, {k.redis_gets} GETs) at "
                  f"{frac}% of its {full['peak_bytes'] >> 20} MiB peak, swapping through mode none on "
                  f"{DONORS} donors; rebalancer on (defaults) and off, {b.knobs.rounds} rounds, alternating")
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for rnd in range(1, b.knobs.rounds + 1):
        for side in SIDES if rnd % 2 else list(SIDES)[::-1]:
            r = spread_run(b, apps, k, f"spread-{side}-r{rnd}", SIDES[side], limit)
            runs[side].append(r)
            print(f"round {rnd}: {side}: {r['ops']:.0f} GET/s, worst reads/target {r['worst']}x",
                  file=sys.stderr, flush=True)
    w = [6, 7, 8, 10, 10, 12]
    for side in SIDES:
        for rnd, r in enumerate(runs[side], 1):
            b.report.line(f"rebalancer {side}, round {rnd}: {r['ops']:.0f} GET/s")
            b.report.line(fmt_row(w, ["side", "donor", "reads", "of reads", "target", "reads/target"]))
            for name, x in r["donors"].items():
                b.report.line(fmt_row(w, [side, name, x["reads"], f"{x['read_share']:.3f}", f"{x['target']:.3f}",
                                          f"{x['over_target']}x"]))
    worst = {s: max(r["worst"] for r in runs[s]) for s in SIDES}
    ops = {s: statistics.mean(r["ops"] for r in runs[s]) for s in SIDES}
    b.report.line(f"worst reads/target: on {worst['on']}x, off {worst['off']}x (target <= {TARGET}x); "
                  f"GET/s on/off {ops['on'] / ops['off']:.2f}x")
    b.report.results = {"limit_bytes": limit, "runs": runs, "worst": worst}


RUN = {"spread": bench_spread}
