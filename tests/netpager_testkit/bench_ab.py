"""A/B benchmark of the client's request path: did a change make the swap
job, QD1 4 KiB latency or QD16 4 KiB throughput worse?

Side A is a base build (--base REV, built once into target/ab/COMMIT/, or
--base-target DIR, binaries already built there); side B is this tree's
(NETPAGER_TARGET_DIR, default target/release). Each round runs both
sides, ROUNDS rounds, in turn first (A B, B A, A B, ...), every side with
its own build's pagerctl, client plugin and donor plugin, on fresh donors
on loopback, in mode none on FRONTEND:

  swap      the swap job of bench_client's `swap` (memhog touching 3x
            LIMIT in a LIMIT memory cgroup, one verify pass) through the
            client on 3 donors: seconds
  QD1       bench_client's `latency` through the client on 1 donor: mean
            completion time (us) of 4 KiB randread and randwrite, psync
  QD16      bench_client's `depth` through the client on 1 donor: 4 KiB
            randread and randwrite IOPS, libaio at queue depth 16

The table has each side's numbers per round (in the order A B), their medians and B/A; the
same workload binaries (tests/jobs, fio) serve both sides, so only the
builds differ.

A base build: `git worktree add --detach target/ab/COMMIT/tree COMMIT`,
then `cargo build --release --workspace` there with CARGO_TARGET_DIR
target/ab/COMMIT/target (seeded from this tree's target/release, so only
the workspace's crates compile), kept while target/ab/COMMIT/built
exists. The worktree stays registered until `make clean` (or
`python3 -m netpager_testkit.bench_ab --clean`) removes it.

  make bench-ab BASE=REV [ROUNDS=3]
  PYTHONPATH=tests python3 -m netpager_testkit.bench_ab --base REV [--out DIR]
  PYTHONPATH=tests python3 -m netpager_testkit.bench_ab --base-target DIR

Knobs (environment): ROUNDS (3), FRONTEND (fuse-uring), RUNTIME (8 s per
fio run), RAMP (2 s), LIMIT (128M), FIO_SIZE (512M, the QD16 region),
CLIENT_CPUS and DONOR_CPUS (taskset's lists, unset: all; "0" and "1" split
the machine as a lab's client and donor machines are split).
Results: OUTDIR/ab.txt and ab.json (--out, default bench-results/ab).
Run as root; loopback only; every side's set-up is undone on every exit.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .bench import arg_parser, die, disk_workdir, env_int, env_str, fmt_row, require
from .bench_anatomy import machine_cpu
from .bench_client import Bench, Knobs, client_latency, depth_run
from .bench_swap import SwapTargets, swap_once
from .cleanup import Teardown, install_handlers
from .demo import parse_size
from .client import client_plugin
from .paths import pagerctl, repo_root, server_plugin, target_dir, using_target_dir

PROG = "bench-ab"
# key: (label, unit, which way is better)
METRICS = {"swap": ("swap job", "s", "lower"),
           "swap_cpu": ("swap job's CPU", "s", "lower"),
           "qd1_randread": ("QD1 4K randread", "us", "lower"),
           "qd1_randwrite": ("QD1 4K randwrite", "us", "lower"),
           "qd16_randread": ("QD16 4K randread", "IOPS", "higher"),
           "qd16_randwrite": ("QD16 4K randwrite", "IOPS", "higher")}


@dataclass
class Side:
    name: str
    label: str
    target: Path
    version: str = ""


def git(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd or repo_root()), *args], capture_output=True, text=True)


def ab_home() -> Path:
    return repo_root() / "target" / "ab"


def base_build(rev: str) -> tuple[str, Path]:
    """(commit, its release directory): REV built once into target/ab/COMMIT/
    (a lock keeps two runs from building it at once)."""
    p = git("rev-parse", "--verify", "-q", f"{rev}^{{commit}}")
    if p.returncode != 0:
        die(PROG, f"BASE={rev!r} names no commit in {repo_root()}")
    sha = p.stdout.strip()
    home = ab_home() / sha
    release = home / "target" / "release"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / "built").exists():
            build(sha, home)
            (home / "built").write_text(sha + "\n")
    return sha, release


def build(sha: str, home: Path) -> None:
    tree, cargo_target = home / "tree", home / "target"
    if not (tree / ".git").exists():
        shutil.rmtree(tree, ignore_errors=True)
        # -f: a tree that `cargo clean` removed is still registered.
        p = git("worktree", "add", "-f", "--detach", str(tree), sha)
        if p.returncode != 0:
            die(PROG, f"git worktree add {tree} {sha} failed: {p.stderr.strip()}")
    if not cargo_target.exists() and target_dir().is_dir():
        # The dependencies' builds are the same: only the workspace compiles.
        # Copied whole or not at all: cargo would trust a half-copied file.
        print(f"seeding {cargo_target} from {target_dir()}", file=sys.stderr, flush=True)
        seed = home / "seed"
        shutil.rmtree(seed, ignore_errors=True)
        seed.mkdir()
        p = subprocess.run(["cp", "-a", "--reflink=auto", str(target_dir()), str(seed / "release")],
                           capture_output=True, text=True)
        if p.returncode != 0:
            shutil.rmtree(seed, ignore_errors=True)
            die(PROG, f"copying {target_dir()} to seed {cargo_target} failed (a build running there?): "
                      f"{p.stderr.strip()[-500:]}")
        seed.rename(cargo_target)
    env = {**os.environ, "CARGO_TARGET_DIR": str(cargo_target), "NETPAGER_COMMIT": sha}
    # What its --version says: its own version, not this tree's (the Makefile's).
    version = subprocess.run(["bash", str(tree / "scripts" / "version.sh")], capture_output=True, text=True)
    env["NETPAGER_VERSION"] = version.stdout.strip()
    print(f"building {sha} in {tree} (CARGO_TARGET_DIR {cargo_target})", file=sys.stderr, flush=True)
    p = subprocess.run(["cargo", "build", "--release", "--workspace"], cwd=tree, env=env)
    if p.returncode != 0:
        die(PROG, f"cargo build of {sha} in {tree} failed ({p.returncode}); see its output above")


def clean() -> None:
    """Removes every cached base build and its worktree registration."""
    for tree in sorted(ab_home().glob("*/tree")):
        p = git("worktree", "remove", "--force", str(tree))
        if p.returncode != 0:
            print(f"git worktree remove {tree}: {p.stderr.strip()}", file=sys.stderr)
    shutil.rmtree(ab_home(), ignore_errors=True)


def binaries(target: Path) -> list[Path]:
    with using_target_dir(target):
        return [pagerctl(), client_plugin(), server_plugin()]


def measure(b: Bench, side: Side, frontend: str, tag: str) -> dict[str, float]:
    """One round of one side, with its build's binaries."""
    with using_target_dir(side.target):
        # The whole machine's CPU over the swap job: this machine's client
        # and donors share its two CPUs, so what one side saves in a party
        # another may spend.
        cpu0 = machine_cpu()[0]
        out = {"swap": swap_once(b, SwapTargets(b), f"client:{frontend}+none/loopback")}
        out["swap_cpu"] = round(machine_cpu()[0] - cpu0, 2)
        with Teardown(f"ab {tag}") as td:
            donor = b.donors(td, 1, None, f"ab-{tag}")[0]
            for rw, us in client_latency(b, donor, frontend).items():
                out[f"qd1_{rw}"] = us
            dev = b.attach(td, "ab-depth", [donor], "none", "1G", frontend, client_id="bench-depth").device
            target = [f"--filename={dev}"]
            depth_run(b, target, "write", "1M", 8, timed=False)
            for rw in ("randread", "randwrite"):
                out[f"qd16_{rw}"] = depth_run(b, target, rw, "4k", 16)
            td.close_or_raise()
    return out


def cpu_list(text: str) -> set[int]:
    """taskset's CPU list ("0", "0-1,3") as a set."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def change(a: float, b: float, better: str) -> str:
    """B against A in words: how much more time, or how much less
    throughput, B takes or gives (or the other way)."""
    if not a or not b:
        return "-"
    worse = (b / a - 1) if better == "lower" else (1 - b / a)
    return "same" if abs(worse) < 0.005 else f"{abs(worse) * 100:.1f}% {'worse' if worse > 0 else 'better'}"


def report(b: Bench, sides: list[Side], vals: dict[str, dict[str, list[float]]], frontend: str) -> None:
    k = b.knobs
    a_side, b_side = sides
    b.report.line(f"== A/B of the request path: A = {a_side.label}, B = {b_side.label}; {k.rounds} rounds "
                  f"(A B, then B A, in turn), mode none, loopback donors, {frontend}")
    for s in sides:
        b.report.line(f"{s.name}: {s.version} ({s.target})")
    if os.environ.get("CLIENT_CPUS") or os.environ.get("DONOR_CPUS"):
        b.report.line(f"client on CPUs {os.environ.get('CLIENT_CPUS') or 'all'}, donors on CPUs "
                      f"{os.environ.get('DONOR_CPUS') or 'all'}")
    per = max(7 * k.rounds, 12)
    w = [18, 5, per, 9, per, 9, 7, 14]
    b.report.line(fmt_row(w, ["metric", "unit", "A per round", "A median", "B per round", "B median", "B/A",
                              "B vs A"], first_left=2))
    results = {}
    for key, (label, unit, better) in METRICS.items():
        a, bb = vals["A"][key], vals["B"][key]
        am, bm = round(statistics.median(a), 1), round(statistics.median(bb), 1)
        r = round(bm / am, 3) if am else None
        b.report.line(fmt_row(w, [label, unit, " ".join(map(str, a)), am, " ".join(map(str, bb)), bm,
                                  f"{r:.2f}x" if r else "-", change(am, bm, better)], first_left=2))
        results[key] = {"label": label, "unit": unit, "better": better, "a": a, "b": bb,
                        "a_median": am, "b_median": bm, "ratio": r}
    b.report.line(f"(swap: memhog touching {3 * parse_size(k.limit) >> 20} MiB in a {k.limit} "
                  f"cgroup, 3 donors; QD1 and QD16: 1 donor; s and us: lower is better, IOPS: higher)")
    b.report.line()
    b.report.results = {"sides": {s.name: {"label": s.label, "target_dir": str(s.target), "version": s.version}
                                  for s in sides},
                        "frontend": frontend, "metrics": results}


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__, "ab", "ab.txt and ab.json")
    base = ap.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", metavar="REV", help="side A: this commit, built into target/ab/COMMIT/")
    base.add_argument("--base-target", metavar="DIR", type=Path, help="side A: the binaries already in DIR")
    base.add_argument("--clean", action="store_true", help="remove the cached base builds and their worktrees")
    args = ap.parse_args(argv)
    if args.clean:
        clean()
        return 0
    knobs = dataclasses.replace(Knobs.from_env(), rounds=env_int(PROG, "ROUNDS", 3))
    frontend = env_str("FRONTEND", "fuse-uring")
    if args.base:
        sha, a_target = base_build(args.base)
        a_label = f"{args.base} ({sha[:12]})"
    else:
        a_target, a_label = args.base_target.resolve(), f"the build in {args.base_target}"
    head = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    sides = [Side("A", a_label, a_target), Side("B", f"this tree ({head or 'no git'})", target_dir())]
    require(PROG, ["nbdkit", "fio", "losetup", "mkswap", "swapon", "findmnt"],
            [f for s in sides for f in binaries(s.target)], root=True)
    for s in sides:
        p = subprocess.run([str(binaries(s.target)[0]), "--version"], capture_output=True, text=True)
        s.version = p.stdout.strip() if p.returncode == 0 else f"--version failed: {p.stderr.strip()}"
    # A lab's client and donors are machines of their own: CLIENT_CPUS and
    # DONOR_CPUS split this machine's CPUs between them (everything this
    # run starts but the donors is the client's), where sharing them would
    # make one side's CPU placement decide the latency. After the base
    # build, which has every CPU.
    client_cpus = env_str("CLIENT_CPUS", "")
    if client_cpus:
        os.sched_setaffinity(0, cpu_list(client_cpus))
    install_handlers()
    vals = {s.name: {key: [] for key in METRICS} for s in sides}
    with Teardown(PROG) as top:
        work = disk_workdir(top, "np-bench-ab-")
        print(f"work directory {work} (on a real disk)", file=sys.stderr, flush=True)
        b = Bench("ab", knobs, work)
        b.report.knobs = {"rounds": knobs.rounds, "frontend": frontend, "runtime": knobs.runtime,
                          "ramp": knobs.ramp, "limit": knobs.limit, "fio_size": knobs.fio_size}
        for rnd in range(1, knobs.rounds + 1):
            # A B, then B A: a side that always ran second would carry
            # whatever the first left behind.
            for s in sides if rnd % 2 else sides[::-1]:
                got = measure(b, s, frontend, f"{s.name}{rnd}")
                for key, v in got.items():
                    vals[s.name][key].append(v)
                print(f"round {rnd}: {s.name} " + ", ".join(f"{k_} {v}" for k_, v in got.items()),
                      file=sys.stderr, flush=True)
        report(b, sides, vals, frontend)
        b.report.write(args.out)
        top.close_or_raise()
    return 0


if __name__ == "__main__":
    sys.exit(main())
