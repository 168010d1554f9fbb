"""`make nemesis`: schedules drawn from seeds, run one after another in each
mode until the time is up; each prints its seed and the command that
replays it, a failing one is shrunk (shortened as far as it still fails)
and printed as a schedule a regression test can hold. At the end a table
per mode: schedules, operations, faults, bytes verified, bugs found.

    PYTHONPATH=tests /usr/bin/python3 -m netpager_testkit.nemesis \\
        [--duration SECS] [--modes none,mirror,parity,ec] [--seed N] [--ops N] \\
        [--known] [--exclude KIND,...] [--no-shrink] [--schedule 'SETUP | OP; ...']

Results: bench-results/nemesis/nemesis.txt (the table) and nemesis.json
(every schedule: seed, setup, ops, result, replay command).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from ..bench import arg_parser
from ..cleanup import install_handlers
from ..paths import job, pagerctl
from .generator import Features, default_exclude, generate
from .model import KNOWN_BUGS, MODES
from .run import parse_schedule, run_schedule, schedule_text, shrink_failure

PROG = "netpager_testkit.nemesis"


def client_has_grace() -> bool:
    """Whether `pagerctl attach` takes --grace (issue 34): mode none may then
    take faults shorter than it."""
    import subprocess

    out = subprocess.run([str(pagerctl()), "attach", "--help"], capture_output=True, text=True).stdout
    return "--grace" in out


def replay_command(mode: str, seed: int, ops: int, known: bool, exclude) -> str:
    extra = (" KNOWN=1" if known else "") + (f" EXCLUDE={','.join(sorted(exclude))}" if exclude else "")
    return f"make nemesis MODES={mode} SEED={seed} OPS={ops}{extra}"


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def table(rows: dict) -> list[str]:
    head = f"{'mode':<8} {'schedules':>9} {'operations':>10} {'faults':>7} {'bytes verified':>15} " \
           f"{'bugs found':>10} {'run errors':>10}"
    out = [head, "-" * len(head)]
    for mode, r in rows.items():
        out.append(f"{mode:<8} {r['schedules']:>9} {r['ops']:>10} {r['faults']:>7} "
                   f"{human(r['verified_bytes']):>15} {r['bugs']:>10} {r['errors']:>10}")
    return out


def main() -> int:
    ap = arg_parser(PROG, __doc__, "nemesis", "the table and the schedules")
    ap.add_argument("--duration", type=float, default=float(os.environ.get("DURATION") or 600),
                    help="seconds of schedules in all (default 600, $DURATION)")
    ap.add_argument("--modes", default=os.environ.get("MODES") or "none,mirror,parity,ec")
    ap.add_argument("--seed", type=int, default=int(os.environ["SEED"]) if os.environ.get("SEED") else None,
                    help="the first schedule's seed (default: drawn); the next ones count up")
    ap.add_argument("--ops", type=int, default=int(os.environ.get("OPS") or 40),
                    help="operations per schedule (default 40)")
    ap.add_argument("--known", action="store_true", default=bool(os.environ.get("KNOWN")),
                    help=f"also draw the ops of bugs still open ({', '.join(KNOWN_BUGS)})")
    ap.add_argument("--exclude", default=os.environ.get("EXCLUDE") or "",
                    help="op kinds never drawn, comma-separated")
    ap.add_argument("--no-shrink", action="store_true", default=bool(os.environ.get("NO_SHRINK")))
    ap.add_argument("--shrink-budget", type=int, default=6, help="replays a shrink may spend")
    ap.add_argument("--schedule", default=os.environ.get("SCHEDULE") or None,
                    help="run exactly this schedule ('SETUP | OP; OP; ...') once")
    a = ap.parse_args()
    plan = None
    if a.schedule:
        setup, ops = parse_schedule(a.schedule)
        plan = [(setup.mode, a.seed or 1, setup, ops)]
        a.modes = setup.mode
    modes = [m.strip() for m in a.modes.replace(" ", ",").split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"{PROG}: unknown mode {m!r} (modes: {', '.join(MODES)})")
    if os.geteuid() != 0:
        raise SystemExit(f"{PROG}: needs root (lab namespaces, loop devices, swap, cgroups)")
    install_handlers()
    memhog = job("memhog")
    user_exclude = frozenset(x for x in a.exclude.split(",") if x)
    features = Features(grace=client_has_grace(), exclude=default_exclude(a.known, user_exclude))
    print(f"nemesis: modes {modes}, {a.duration:.0f}s, {a.ops} ops a schedule; grace "
          f"{'on' if features.grace else 'not in this client: mode none takes no donor fault'}; "
          f"never drawn: {', '.join(sorted(features.exclude)) or 'nothing'}", flush=True)
    rows = {m: {"schedules": 0, "ops": 0, "faults": 0, "verified_bytes": 0, "bugs": 0, "errors": 0}
            for m in modes}
    runs = []
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    end = time.monotonic() + a.duration
    k = 0
    while True:
        if plan is not None:
            if k == len(plan):
                break
            mode, s, setup, ops = plan[k]
        else:
            if time.monotonic() > end and k >= len(modes):  # each mode once at least
                break
            mode, s = modes[k % len(modes)], seed + k // len(modes)
            sched = generate(s, mode, a.ops, features)
            setup, ops = sched.setup, sched.ops
        k += 1
        replay = (f"make nemesis SCHEDULE='{schedule_text(setup, ops)}'" if plan is not None
                  else replay_command(mode, s, len(ops), a.known, user_exclude))
        print(f"\n== {mode} seed {s}: {setup.text()}\n   replay: {replay}", flush=True)
        keep = a.out / f"{mode}-{s}"
        res = run_schedule(setup, ops, s, memhog, log=lambda m: print(m, flush=True), keep=keep)
        row = rows[mode]
        row["schedules"] += 1
        row["ops"] += len(res.ops)
        row["faults"] += res.faults
        row["verified_bytes"] += res.verified_bytes
        entry = {"mode": mode, "seed": s, "setup": setup.text(), "ops": [o.text() for o in res.ops],
                 "faults": res.faults, "verified_bytes": res.verified_bytes,
                 "seconds": round(res.seconds, 1), "notes": res.notes, "replay": replay}
        for n in res.notes:
            print(f"   note: {n}")
        if res.error:
            row["errors"] += 1
            entry["error"] = res.error
            print(f"   RUN ERROR (not a finding): {res.error}", flush=True)
        if res.failure:
            row["bugs"] += 1
            f = res.failure
            at = (res.ops[res.failed_at].text() if 0 <= res.failed_at < len(res.ops)
                  else "the end checks" if res.failed_at >= 0 else "the setup")
            entry.update(failure=f.kind, message=f.message, failed_at=res.failed_at)
            print(f"   BUG ({f.kind}) at op {res.failed_at} ({at}): {f.message}", flush=True)
            for i, later in res.findings[1:]:
                print(f"   then ({later.kind}) at op {i}: {later.message}", flush=True)
            entry["findings"] = [{"at": i, "kind": x.kind, "message": x.message} for i, x in res.findings]
            if not a.no_shrink and res.ops:
                short, spent = shrink_failure(res, memhog, log=lambda m: print(m, flush=True),
                                              budget=a.shrink_budget, keep=keep)
                entry["shrunk"] = schedule_text(setup, short)
                print(f"   shrunk in {spent} replays to {len(short)} ops:\n   make nemesis "
                      f"SCHEDULE='{entry['shrunk']}'", flush=True)
        else:
            print(f"   ok: {len(res.ops)} ops, {res.faults} faults, {human(res.verified_bytes)} "
                  f"verified, {res.seconds:.0f}s", flush=True)
        runs.append(entry)
    lines = table(rows)
    print("\n" + "\n".join(lines))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "nemesis.txt").write_text("\n".join(lines) + "\n")
    (a.out / "nemesis.json").write_text(json.dumps({"bench": "nemesis", "rows": rows, "runs": runs},
                                                   indent=1) + "\n")
    print(f"\nresults: {a.out / 'nemesis.txt'}, {a.out / 'nemesis.json'}")
    return 1 if any(r["bugs"] or r["errors"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
