"""Benchmarks of the netpager client, each printing a table and its ratios:

  1. donors: fio 4 KiB random and 1 MiB sequential I/O through the client
     (fio's nbd engine on the client's unix socket) with 1, 2 and 4 donors,
     each behind nbdkit's rate filter emulating a 1 Gbit/s link
     (rate=1G: the filter counts bits per second). Target: 4 donors >= 3.5x
     one donor.
  2. modes: none / mirror / parity / parity without its log / disk / ec
     4+2 side by side on 4 such donors (ec on 6, the fewest it takes,
     compared with none on 6 as well), as ratios to none, with the donor
     memory held per byte fio wrote, right after the writes and once the
     idle device has moved its parity log home. Targets: parity reads >=
     0.95x, writes >= 0.6x; ec reads >= 0.95x, writes >= 0.5x, memory
     1.5x once idle.
  3. swap: a job touching 3x its memory cgroup limit swapping through the
     client (3 donors, parity; SWAP_MODES="parity ec" adds ec 4+2 on 6
     donors, with its ratio to parity, target <= 1.1x) on each front end
     (FRONTENDS: fuse-uring, fuse, nbd), through one `nbdkit memory` over
     TCP (a remote memory server, as a donor is) attached through nbdfuse +
     a loop device, through the same FUSE front end answering from memory
     (the floor of the client's path), through zram and through a swap file
     on local disk, alternating A B C D A B C D ... Completion times and
     ratios to nbdkit memory. The same nbdkit memory is also reached through
     a local nbdkit proxy on a unix socket (its nbd plugin), the path the
     client takes to a donor: that prices the extra hop apart from the
     client. Two settings (SWAP_SETTINGS): "links" puts each donor and the
     one nbdkit memory behind its own emulated LINK_RATE link, as remote
     memory is in a lab; "loopback" runs all of them at loopback speed,
     which shows whether bandwidth binds at all. Targets: client on
     fuse-uring <= 1.0x nbdkit memory and <= 1.0x the swap file.
     COMPRESS="off lz4" (pager-server's compress=, off|lz4|zstd; unset:
     the plugin's default, one run each as without it) runs every client
     set-up once per setting, alternating within each round (A B A B),
     its donors started with that setting: each setting's seconds and
     mean, its ratio to the first (target: lz4 / off <= 1.05x), and what
     the donors held, summed over them from their status (used_bytes, the
     bytes really held, against logical_bytes, the bytes written), at the
     job's end (read before the teardown) and at peak (sampled every
     0.5 s). memhog's pages are pseudo-random, which no compressor
     shrinks: COMPRESSIBLE=PCT (0-90) leaves the last PCT% of every page
     zero (memhog --compressible), so that lz4 has something to keep small.
     SWAP_TARGETS ("proxy memory floor zram file") names the targets run
     beside the client ("": the client alone).
  4. latency: QD1 4 KiB random reads and writes (fio, psync, direct=1)
     through the client's loop device (mode none, one donor, each front
     end) against fio's nbd engine straight to that donor over TCP,
     alternating. Target: fuse-uring <= 1.2x direct.
  5. depth: fio libaio 4 KiB random I/O at QD 1, 4, 16, 64 and 1 MiB
     sequential through the loop device in modes none (1 donor), parity
     (3) and ec 4+2 (6), with the FUSE floor and fio's nbd engine straight
     to the none donor, all attached at once, rounds alternating. Targets:
     none QD16 >= 0.8x direct; parity QD16 randwrite >= 0.5x none.
  6. restart: a restartable client (attach --restartable, parity, 3
     donors, loopback) under the swap job, its serving process killed with
     -9 every RESTART_EVERY seconds, RESTARTS times: per restart the time
     from the old process's end to the new one serving (the holder's
     measure) and the job's stall (from the kill to the loop device's next
     completed request); median and worst. The job runs again whenever it
     ends, each run verifying every page. Targets: median < 1 s, worst <
     3 s. The restartable set-up's cost is the front end "fuse-held" in
     FRONTENDS of swap and latency (FRONTENDS="fuse-uring fuse-held").
  discard (only when named: make bench-client WHICH=discard): the swap job
     through the client (SWAP_MODE, loopback, the first of FRONTENDS)
     attached with discard (pagerctl's default, swapon --discard=pages)
     and with --no-discard, alternating: the job's time as a ratio to no
     discard, and the donors' used bytes at the job's exit and SETTLE
     (10) seconds later.

  python3 -m netpager_testkit.bench_client                 # all five (make bench-client)
  python3 -m netpager_testkit.bench_client join epochs     # live membership's (bench_join), only when named
  python3 -m netpager_testkit.bench_client discard          # swap with and without discard, only when named
  python3 -m netpager_testkit.bench_client anatomy          # the fault path's anatomy (bench_anatomy), only when named
  python3 -m netpager_testkit.bench_client spread           # where redis's reads land among donors (bench_spread), only when named
  python3 -m netpager_testkit.bench_client donors modes    # some of them
  RUNTIME=10 ROUNDS=3 LIMIT=128M ... swap
  SWAP_MODE=none ... swap                  # the client in another mode
  SWAP_MODES="parity ec" ... swap          # modes side by side
  SWAP_SETTINGS=links ... swap
  COMPRESS="off lz4" COMPRESSIBLE=60 ... swap   # the donors' compression side by side
  SWAP_TARGETS="" ... swap                 # the client alone
  FRONTENDS="fuse-uring@0 fuse-uring@50" ... latency   # FRONTEND@US: --spin-us US
  MODES=parity ... modes                   # none and parity only
  FIO_ROUNDS=3 ... modes                   # best of 3 fio runs each

Knobs (environment): RUNTIME (8 s per fio run), RAMP (fio's unmeasured
start: 3 s, 2 s for latency), FIO_ROUNDS (2, the best kept), ROUNDS (2,
rounds of swap and latency), LIMIT (128M, the swap job's memory limit; it
touches 3x), LINK_RATE (1G bits/s per emulated link), FIO_SIZE (512M),
SWAP_MODE (parity) / SWAP_MODES, SWAP_SETTINGS ("links loopback"), MODES
("mirror parity parity-nolog disk ec"), FRONTENDS ("fuse-uring fuse nbd";
fuse-held: fuse attached --restartable, the others --no-restartable), DEPTH_QDS ("1 4 16 64"),
DEPTH_MODES ("none parity ec"), RESTARTS (20), RESTART_EVERY (2 s), SETTLE
(10 s, discard's wait after the job), COMPRESS (unset; "off lz4": swap's
client set-ups with their donors at each compress= setting), COMPRESSIBLE
(0, % of each page of swap's job that is zeros), SWAP_TARGETS ("proxy
memory floor zram file", swap's targets beside the client).

Each benchmark writes OUTDIR/NAME.txt and OUTDIR/NAME.json (--out, default
bench-results/client). The work directory (client state, the disk mode's
write-through file, the swap file) is on a real disk: /tmp unless it is
tmpfs, else /var/tmp, else the repository's target/. Run as root; binaries
come from NETPAGER_TARGET_DIR (default target/release). Loopback only. Each
benchmark has its own Teardown: every process it started is stopped by pid,
every attach detached, every swap area, loop device, zram device and cgroup
undone, on every exit.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import bench_anatomy, bench_join, bench_rebalance, bench_spread
from .bench import Report, arg_parser, die, disk_workdir, env_int, env_str, fio_json, fmt_row, mean, ratio, require
from .bench_swap import SwapTargets, bench_swap, swap_donors
from .cgroup import run_job_in_cgroup
from .cleanup import Teardown, install_handlers
from .client import Job, PagerClient, client_plugin
from .demo import parse_size
from .donor import Cluster, Donor
from .paths import job, pagerctl, server_plugin, target_dir
from .procs import wait_for

PROG = "bench-client"


@dataclass
class Knobs:
    runtime: int
    ramp: int | None
    fio_rounds: int
    rounds: int
    limit: str
    link_rate: str
    fio_size: str
    swap_modes: list[str]
    swap_settings: list[str]
    modes: list[str]
    frontends: list[str]
    restarts: int
    restart_every: int

    @classmethod
    def from_env(cls) -> "Knobs":
        ramp = env_str("RAMP", "")
        swap_mode = env_str("SWAP_MODE", "parity")
        k = cls(runtime=env_int(PROG, "RUNTIME", 8),
                ramp=int(ramp) if ramp else None,
                fio_rounds=env_int(PROG, "FIO_ROUNDS", 2),
                rounds=env_int(PROG, "ROUNDS", 2),
                limit=env_str("LIMIT", "128M"),
                link_rate=env_str("LINK_RATE", "1G"),
                fio_size=env_str("FIO_SIZE", "512M"),
                swap_modes=env_str("SWAP_MODES", swap_mode).split(),
                swap_settings=env_str("SWAP_SETTINGS", "links loopback").split(),
                modes=env_str("MODES", "mirror parity parity-nolog disk ec").split(),
                frontends=env_str("FRONTENDS", "fuse-uring fuse nbd").split(),
                restarts=env_int(PROG, "RESTARTS", 20),
                restart_every=env_int(PROG, "RESTART_EVERY", 2))
        for s in k.swap_settings:
            if s not in ("links", "loopback"):
                die(PROG, f"unknown swap setting {s} in SWAP_SETTINGS (links, loopback)")
        return k


class Bench:
    """One benchmark's run: its knobs, Teardown, work directory and report."""

    def __init__(self, name: str, knobs: Knobs, work: Path):
        self.knobs = knobs
        self.work = work / name
        self.work.mkdir()
        self.report = Report(name, asdict(knobs))

    # ------------------------------------------------------------ set-up
    def donors(self, td: Teardown, n: int, rate: str | None, tag: str, compress: str | None = None) -> list[Donor]:
        """n pager-server donors on 127.0.0.2.., each behind a `rate` bits/s
        link (None: loopback speed), with compress=`compress` (None: the
        plugin's default)."""
        filters = {"filters": ["rate"], "filter_params": {"rate": rate}} if rate else {}
        cluster = Cluster(td, self.work / tag, server_plugin())
        return cluster.start_donors(n, size="2G", budgets="2G", compress=compress, **filters)

    def attach(self, td: Teardown, tag: str, donors, mode: str, size: str, frontend: str,
               swap: bool = False, width: int | None = None, client_id: str = "bench",
               extra=()) -> PagerClient:
        """`pagerctl attach` in mode `mode` (parity-nolog: parity with its
        log off; disk: its write-through file in the work directory), with
        `extra` arguments. Clients sharing donors need their own
        `client_id` (their export)."""
        extra = [*mode_args(mode, self.work / "writethrough.img", width), *spin_args(frontend), *extra]
        frontend = frontend.split("@")[0]
        # Each front end as named: a swap device is restartable by default
        # where it can be (classic FUSE), so plain "fuse" says it is not.
        if frontend == "fuse-held":
            frontend, extra = "fuse", extra + ["--restartable"]
        else:
            extra = extra + ["--no-restartable"]
        state = self.work / f"c-{tag}"
        shutil.rmtree(state, ignore_errors=True)
        client = PagerClient(td, state, client_id=client_id)
        client.attach(donors, mode=mode.removesuffix("-nolog"), size=size, swap=swap, extra=extra,
                      frontend=frontend)
        return client

    # --------------------------------------------------------------- fio
    def fio_run(self, uri: str, rw: str, bs: str, depth: int, *extra) -> tuple[float, float]:
        """(IOPS, MB/s) of one fio run through the nbd engine."""
        j = fio_json([f"--name={rw}", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
                      f"--iodepth={depth}", "--numjobs=1", f"--size={self.knobs.fio_size}", *extra],
                     self.work)
        return (j["read"]["iops"] + j["write"]["iops"],
                (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6)

    def fio_best(self, *args) -> tuple[float, float]:
        """fio_run FIO_ROUNDS times in a row, the best kept. Noise on a shared
        machine only ever slows a run down, and the first pass over a fresh
        device pays one-time costs (donor memory touched for the first time,
        the parity log's units placed) that a long-lived swap device does not."""
        return max((self.fio_run(*args) for _ in range(self.knobs.fio_rounds)), key=lambda r: r[0])

    def fio_suite(self, uri: str) -> list[float]:
        """Fills the region, then [rr_iops, rw_iops, seqr_MBps, seqw_MBps].
        Every measured run starts with a ramp (3 s) that fio leaves out: the
        rate filter lets 2 s worth of traffic through at once after idling
        (burstiness=2), which would inflate short runs."""
        ramp = 3 if self.knobs.ramp is None else self.knobs.ramp
        timed = ["--time_based", f"--runtime={self.knobs.runtime}", f"--ramp_time={ramp}"]
        # Fill first, unmeasured, so that reads hit placed extents.
        self.fio_run(uri, "write", "1M", 8)
        sw = self.fio_best(uri, "write", "1M", 8, *timed)
        sr = self.fio_best(uri, "read", "1M", 8, *timed)
        rr = self.fio_best(uri, "randread", "4k", 32, *timed)
        rw = self.fio_best(uri, "randwrite", "4k", 32, *timed)
        return [round(rr[0]), round(rw[0]), round(sr[1], 1), round(sw[1], 1)]

    def fio_lat(self, target: str, rw: str, *extra) -> float:
        """Mean completion latency (us) of QD1 4 KiB random I/O over the first 64 MiB."""
        ramp = 2 if self.knobs.ramp is None else self.knobs.ramp
        j = fio_json(["--name=lat", *extra, target, f"--rw={rw}", "--bs=4k", "--iodepth=1",
                      "--size=64M", f"--runtime={self.knobs.runtime}", "--time_based",
                      f"--ramp_time={ramp}", "--randrepeat=0"], self.work)
        d = j["read"] if j["read"]["io_bytes"] else j["write"]
        return round(d["clat_ns"]["mean"] / 1000, 1)


def mode_args(mode: str, disk_file: Path, width: int | None) -> list[str]:
    """What `pagerctl attach` needs for MODE besides --mode."""
    args = {"disk": ["--disk-file", str(disk_file)], "parity-nolog": ["--parity-log", "0"],
            "ec": ["--data", "4", "--parity", "2"]}.get(mode, [])
    if mode.startswith("parity") and width:
        args += ["--parity-width", str(width)]
    return args


def spin_args(frontend: str) -> list[str]:
    """A FRONTENDS entry FRONTEND@US spins US microseconds before sleeping on a reply."""
    _, at, us = frontend.partition("@")
    return ["--spin-us", us] if at else []


# ------------------------------------------------------------ 1. donors
def bench_donors(b: Bench) -> None:
    k = b.knobs
    b.report.line(f"== 1. Scaling with donors: fio through the client, mode none, each donor at "
                  f"{k.link_rate} bit/s")
    r = {}
    for n in (1, 2, 4):
        with Teardown(f"donors {n}") as td:
            donors = b.donors(td, n, k.link_rate, f"donors{n}")
            # fio's nbd engine needs the client's NBD socket: the nbd front end.
            client = b.attach(td, f"donors{n}", donors, "none", "1G", "nbd")
            r[n] = b.fio_suite(client.uri())
            td.close_or_raise()
    w = [8, 14, 14, 14, 14]
    b.report.line(fmt_row(w, ["donors", "4K randread", "4K randwrite", "1M read", "1M write"]))
    b.report.line(fmt_row(w, ["", "IOPS", "IOPS", "MB/s", "MB/s"]))
    for n in (1, 2, 4):
        b.report.line(fmt_row(w, [n, *r[n]]))
    for n in (2, 4):
        b.report.line(fmt_row(w, [f"{n} vs 1", *(ratio(a, o) for a, o in zip(r[n], r[1]))]))
    b.report.line("(target: 4 donors >= 3.5x one donor)")
    b.report.line()
    b.report.results = {"columns": ["randread_iops", "randwrite_iops", "read_MBps", "write_MBps"],
                        "donors": {str(n): v for n, v in r.items()}}


# ------------------------------------------------------------- 2. modes
def mode_donors(mode: str) -> int:
    return 6 if mode in ("ec", "none@6") else 4


def memory_per_byte(client: PagerClient, fio_size: str) -> str:
    """Donor memory the device holds (extent slots on donors) per byte fio
    wrote, as "BUSY/IDLE": right after the writes, the parity log included
    (random writes fill it up to --parity-log, the device's size by
    default), and once the device has been idle long enough for the
    cleaner to move the log's pages home and free it (parity_log_idle_ms)."""
    def held(s: dict) -> int:
        return sum(d["extents_held"] for d in s["donors"]) * s["extent_bytes"]

    def drained() -> dict | None:
        s = client.status()["status"]
        return s if s["totals"].get("parity_log_used_bytes", 0) == 0 else None

    wrote = parse_size(fio_size)
    busy = held(client.status()["status"])
    idle = held(wait_for(drained, 900, "the idle device's parity log to drain", interval=1))
    return f"{busy / wrote:.2f}/{idle / wrote:.2f}"


def bench_modes(b: Bench) -> None:
    k = b.knobs
    b.report.line(f"== 2. Modes side by side: 4 donors at {k.link_rate} bit/s each, fio through the client")
    # ec 4+2 needs 6 donors; none on 6 is its baseline (more links, more
    # bandwidth: comparing with none on 4 would flatter it).
    modes = ["none", *(["none@6"] if "ec" in k.modes else []), *k.modes]
    if "disk" in k.modes:
        b.report.line(f"(disk mode: write-through file {b.work / 'writethrough.img'})")
    r, mem = {}, {}
    for mode in modes:
        with Teardown(f"mode {mode}") as td:
            donors = b.donors(td, mode_donors(mode), k.link_rate, f"mode-{mode}")
            client = b.attach(td, mode, donors, mode.split("@")[0], "1G", "nbd")
            r[mode] = b.fio_suite(client.uri())
            mem[mode] = memory_per_byte(client, k.fio_size)
            td.close_or_raise()
        (b.work / "writethrough.img").unlink(missing_ok=True)
    w = [17, 7, 14, 14, 14, 14, 9]
    b.report.line(fmt_row(w, ["mode", "donors", "4K randread", "4K randwrite", "1M read", "1M write", "memory"]))
    b.report.line(fmt_row(w, ["", "", "IOPS", "IOPS", "MB/s", "MB/s", "busy/idle"]))
    for mode in modes:
        b.report.line(fmt_row(w, [mode, mode_donors(mode), *r[mode], mem[mode]]))
    for mode in modes[1:]:
        if mode == "none@6":
            continue
        base = r["none@6" if mode_donors(mode) == 6 else "none"]
        b.report.line(fmt_row(w[:1] + w[2:6], [f"{mode}/none", *(ratio(a, o) for a, o in zip(r[mode], base))]))
    b.report.line("(targets: parity reads >= 0.95x none, parity writes >= 0.6x none;")
    b.report.line(" ec reads >= 0.95x none@6, ec writes >= 0.5x none@6, ec memory 1.5x per byte idle;")
    b.report.line(" memory: donor bytes held per byte written, right after the writes / once idle,")
    b.report.line(" when the parity log's pages have gone home)")
    b.report.line()
    b.report.results = {"columns": ["randread_iops", "randwrite_iops", "read_MBps", "write_MBps"],
                        "modes": {m: {"donors": mode_donors(m), "fio": r[m], "memory": mem[m]} for m in modes}}


# ---------------------------------------------------------- 4. latency
def client_latency(b: Bench, donor: Donor, frontend: str) -> dict[str, float]:
    """QD1 4 KiB randread and randwrite latency (us) through a fresh client, mode none, on `donor`."""
    with Teardown(f"latency {frontend}") as td:
        dev = b.attach(td, f"lat-{frontend}", [donor], "none", "256M", frontend).device
        # The device is new: written once first, so reads find data
        # on the donor and writes find their extents placed.
        fio_json(["--name=fill", f"--filename={dev}", "--rw=write", "--bs=1M",
                  "--size=64M", "--direct=1"], b.work)
        us = {rw: b.fio_lat(f"--filename={dev}", rw, "--ioengine=psync", "--direct=1")
              for rw in ("randread", "randwrite")}
        td.close_or_raise()
    return us


def bench_latency(b: Bench) -> None:
    k = b.knobs
    b.report.line(f"== 4. Latency: QD1 4 KiB random I/O, mean completion time (us), {k.rounds} rounds")
    lat: dict[str, dict[str, list[float]]] = {p: {"randread": [], "randwrite": []}
                                              for p in [*k.frontends, "direct"]}
    with Teardown("latency") as donors_td:
        donor = b.donors(donors_td, 1, None, "latency")[0]
        for _ in range(k.rounds):
            for f in k.frontends:
                for rw, us in client_latency(b, donor, f).items():
                    lat[f][rw].append(us)
            for rw in ("randread", "randwrite"):
                lat["direct"][rw].append(b.fio_lat(f"--uri=nbd://{donor.addr}:{donor.port}/direct@256M",
                                                   rw, "--ioengine=nbd"))
        donors_td.close_or_raise()
    w = [44, 12, 12, 12, 12]
    b.report.line(fmt_row(w, ["path", "read us", "vs direct", "write us", "vs direct"]))
    rd, wd = mean(lat["direct"]["randread"]), mean(lat["direct"]["randwrite"])
    for p in [*k.frontends, "direct"]:
        r, wr = mean(lat[p]["randread"]), mean(lat[p]["randwrite"])
        label = "fio nbd engine to the donor" if p == "direct" else f"client, none, 1 donor, {p}"
        b.report.line(fmt_row(w, [label, f"{r:.1f}", ratio(r, rd), f"{wr:.1f}", ratio(wr, wd)]))
    b.report.line("(target: fuse-uring <= 1.2x direct)")
    b.report.line()
    b.report.results = {"us": lat}


# ------------------------------------------------------------ 5. depth
DEPTH_QDS = (1, 4, 16, 64)


def depth_jobs(qds) -> list[tuple[str, str, str, int]]:
    """(column, fio rw, block size, queue depth) of the depth benchmark."""
    jobs = [(f"{rw} QD{q}", rw, "4k", q) for q in qds for rw in ("randread", "randwrite")]
    return jobs + [("1M read", "read", "1M", 16), ("1M write", "write", "1M", 16)]


def depth_run(b: Bench, target: list[str], rw: str, bs: str, qd: int, timed: bool = True) -> float:
    """One fio run over a depth target's FIO_SIZE region with the engine it
    names (nbd), else libaio, direct: IOPS (4k) or MB/s (1M). Untimed, the
    region written once (depth_run(b, t, "write", "1M", 8, timed=False))."""
    k = b.knobs
    ramp = 2 if k.ramp is None else k.ramp
    engine = [] if any(a.startswith("--ioengine=") for a in target) else ["--ioengine=libaio", "--direct=1"]
    timing = ["--time_based", f"--runtime={k.runtime}", f"--ramp_time={ramp}", "--randrepeat=0"] if timed else []
    j = fio_json([f"--name={rw}", *target, *engine, f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
                  f"--size={k.fio_size}", *timing], b.work)
    iops = j["read"]["iops"] + j["write"]["iops"]
    mbps = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
    return round(mbps, 1) if bs == "1M" else round(iops)


def bench_depth(b: Bench) -> None:
    """Throughput at depth: fio (libaio, direct) 4 KiB random I/O at queue
    depths 1-64 and 1 MiB sequential I/O through the client's loop device
    (fuse-uring) in modes none (one donor), parity (3 donors) and ec 4+2 (6
    donors), beside the same FUSE front end answering from memory (the
    floor) and fio's nbd engine straight to the none client's donor; every
    target attached at once, rounds alternating A B C ... A B C."""
    k = b.knobs
    qds = [int(q) for q in env_str("DEPTH_QDS", " ".join(map(str, DEPTH_QDS))).split()]
    modes = env_str("DEPTH_MODES", "none parity ec").split()
    jobs = depth_jobs(qds)
    b.report.line(f"== 5. Throughput at depth: fio libaio direct, {k.runtime} s per run, "
                  f"{k.rounds} rounds alternating, {k.fio_size} region")
    with Teardown("depth") as td:
        donors = b.donors(td, 6, None, "depth")
        # Each target's fio arguments; the region is written once first.
        targets: dict[str, list[str]] = {"floor": ["--filename=" + SwapTargets(b).floor_device(td)]}
        for mode in modes:
            ds = {"none": donors[:1], "parity": donors[:3]}.get(mode, donors)
            dev = b.attach(td, f"depth-{mode}", ds, mode, "1G", "fuse-uring", width=3,
                           client_id=f"bench-{mode}").device
            targets[mode] = [f"--filename={dev}"]
        d0 = donors[0]
        targets["direct"] = ["--ioengine=nbd", f"--uri=nbd://{d0.addr}:{d0.port}/direct@{k.fio_size}"]
        for t in targets.values():
            depth_run(b, t, "write", "1M", 8, timed=False)
        res: dict[str, dict[str, list[float]]] = {n: {j[0]: [] for j in jobs} for n in targets}
        for _ in range(k.rounds):
            for name, t in targets.items():
                for col, rw, bs, q in jobs:
                    res[name][col].append(depth_run(b, t, rw, bs, q))
        td.close_or_raise()
    best = {n: [max(res[n][c]) for c, *_ in jobs] for n in targets}
    w = [12, *([11] * len(jobs))]
    b.report.line(fmt_row(w, ["target", *(c.replace("rand", "") for c, *_ in jobs)]))
    b.report.line(fmt_row(w, ["", *("MB/s" if bs == "1M" else "IOPS" for _, _, bs, _ in jobs)]))
    if "floor" in best and "direct" in best:
        # The client's path is the kernel's (the floor) and the donor's
        # (direct), both on this machine's CPUs: 1/(1/floor + 1/direct).
        best["bound"] = [round(1 / (1 / f + 1 / d), 1 if bs == "1M" else 0) if f and d else 0
                         for f, d, (_, _, bs, _) in zip(best["floor"], best["direct"], jobs)]
    for n in best:
        b.report.line(fmt_row(w, [n, *best[n]]))
    for n, base in [("none", "bound"), ("none", "direct"), ("none", "floor"), ("parity", "none"), ("ec", "none")]:
        if n in best and base in best:
            b.report.line(fmt_row(w, [f"{n}/{base}", *(ratio(a, o) for a, o in zip(best[n], best[base]))]))
    b.report.line("(best of the rounds; bound: both paths' CPU together, 1/(1/floor + 1/direct), since the")
    b.report.line(" client and its donor share this machine's CPUs; targets: none QD16 4 KiB read and write")
    b.report.line(" >= 0.9x the bound, parity QD16 4 KiB write >= 0.5x none)")
    b.report.line()
    b.report.results = {"columns": [c for c, *_ in jobs], "rounds": res, "best": best}


# ---------------------------------------------------------- 6. restart
def loop_completions(device: str) -> int:
    """Requests the block device has completed (reads + writes)."""
    f = Path("/sys/block") / Path(device).name / "stat"
    v = f.read_text().split()
    return int(v[0]) + int(v[4])


def bench_restart(b: Bench) -> None:
    k = b.knobs
    limit = parse_size(k.limit)
    b.report.line(f"== 6. Restart: the serving process killed (-9) {k.restarts} times, every "
                  f"{k.restart_every} s, under memhog touching {3 * limit >> 20} MiB in a {k.limit} "
                  f"cgroup (client, parity, 3 donors, loopback, fuse-held)")
    held, stall, jobs = [], [], 0
    memhog = job("memhog")
    with Teardown("restart") as td:
        donors = b.donors(td, 3, None, "restart")
        client = b.attach(td, "restart", donors, "parity", "1G", "fuse-held", swap=True, width=3)
        device = client.device

        def start_job() -> Job:
            nonlocal jobs
            jobs += 1
            return Job(td, [memhog, 3 * limit, "--passes", "1"], limit, b.work / f"memhog-{jobs}.log", device)

        def finish(j: Job) -> None:
            out = j.finish()
            if "memhog: OK" not in out:
                die(PROG, f"memhog under restarts: {out}")

        j = start_job()
        wait_for(lambda: j.swapped() >= limit // 2 or not j.alive(), 300, f"the job swapping to {device}")
        for i in range(1, k.restarts + 1):
            deadline = time.monotonic() + k.restart_every
            while time.monotonic() < deadline:
                j.swapped()
                time.sleep(0.05)
            if not j.alive():
                finish(j)
                j = start_job()
                wait_for(lambda: j.swapped() >= limit // 2 or not j.alive(), 300, "the next job swapping")
            pid = client.serving_pid()
            t0 = time.monotonic()
            os.kill(pid, 9)
            before = loop_completions(device)
            while loop_completions(device) == before and time.monotonic() - t0 < 60:
                time.sleep(0.0005)
            stall.append(round((time.monotonic() - t0) * 1000, 1))
            new = wait_for(lambda: (lambda r: r if r and r != pid else None)(client.holder().get("ready_pid")),
                           60, f"restart {i} serving")
            assert client.holder()["restarts"] >= i, client.holder()
            held.append(client.holder()["last_held_ms"])
            print(f"restart {i}: pid {pid} -> {new}, held {held[-1]} ms, job stalled {stall[-1]} ms",
                  file=sys.stderr, flush=True)
        finish(j)
        h = client.holder()
        td.close_or_raise()
    w = [58, 10, 10]
    b.report.line(fmt_row(w, ["", "median ms", "worst ms"]))
    for label, ms in (("kill to the new process serving (holder)", held),
                      ("job's stall (kill to the device's next completion)", stall)):
        b.report.line(fmt_row(w, [label, statistics.median(ms), max(ms)]))
    b.report.line(f"restarts {h['restarts']} (after a crash {h['crashes']}), requests resent {h['resent_total']}, "
                  f"jobs run {jobs}, every one verified")
    b.report.line("(targets: median < 1000 ms, worst < 3000 ms)")
    b.report.line()
    b.report.results = {"held_ms": held, "stall_ms": stall, "restarts": h["restarts"],
                        "resent": h["resent_total"], "jobs": jobs}


# ---------------------------------------------------------- discard
def bench_discard(b: Bench, out: Path) -> None:
    """The swap job through the client (SWAP_MODE, its donors on loopback,
    the first of FRONTENDS) attached with discard (pagerctl's default:
    swapon --discard=pages) and with --no-discard, alternating round by
    round: the job's time, and the bytes its donors hold when it exits and
    SETTLE seconds later (beyond what they held before the attach)."""
    k = b.knobs
    mode, frontend = k.swap_modes[0], k.frontends[0]
    settle = env_int(PROG, "SETTLE", 10)
    limit = parse_size(k.limit)
    touch = 3 * limit
    b.report.knobs["settle"] = settle
    b.report.line(f"== discard: memhog touching {touch >> 20} MiB in a {k.limit} memory cgroup (1 verify "
                  f"pass), client {mode} on {swap_donors(mode)} donors, {frontend}, loopback, "
                  f"{k.rounds} rounds alternating")
    variants = {"discard": [], "no-discard": ["--no-discard"]}
    runs = {v: {"seconds": [], "held_at_exit": [], "held_after": []} for v in variants}
    memhog = job("memhog")
    for rnd in range(1, k.rounds + 1):
        for v, extra in variants.items():
            with Teardown(f"discard {v}") as td:
                donors = b.donors(td, swap_donors(mode), None, f"discard-{v}-{rnd}")

                def used() -> int:
                    return sum(d.status().used_bytes for d in donors)

                before = used()
                device = b.attach(td, f"discard-{v}", donors, mode, "1G", frontend, swap=True, width=3,
                                  extra=extra).device
                r = run_job_in_cgroup(td, [memhog, touch, "--passes", "1"], limit,
                                      b.work / f"memhog-discard-{v}.log", swap_devices=[device])
                at_exit = used() - before
                time.sleep(settle)
                after = used() - before
                td.close_or_raise()
            if r.returncode != 0 or r.timed_out:
                die(PROG, f"memhog through the client with {v} failed: {r.describe()}")
            for key, x in (("seconds", round(r.seconds, 1)), ("held_at_exit", at_exit), ("held_after", after)):
                runs[v][key].append(x)
            print(f"round {rnd}: {v} {r.seconds:.1f}s, donors hold {at_exit >> 20} MiB at its exit, "
                  f"{after >> 20} MiB {settle} s later", file=sys.stderr, flush=True)
    w = [12, 20, 8, 15, 22, 22]
    b.report.line(fmt_row(w, ["swap", "seconds per round", "mean", "vs no-discard", "MiB held at exit",
                              f"MiB held {settle} s after"]))
    base = mean(runs["no-discard"]["seconds"])
    for v, r in runs.items():
        b.report.line(fmt_row(w, [v, " ".join(map(str, r["seconds"])), f"{mean(r['seconds']):.1f}",
                                  ratio(mean(r["seconds"]), base),
                                  " ".join(str(x >> 20) for x in r["held_at_exit"]),
                                  " ".join(str(x >> 20) for x in r["held_after"])]))
    b.report.line("(held: the donors' used bytes beyond what they held before the attach)")
    b.report.line()
    b.report.results = {"mode": mode, "frontend": frontend, "touch_bytes": touch, "limit_bytes": limit,
                        "settle_s": settle, "runs": runs}


RUN = {"donors": bench_donors, "modes": bench_modes, "swap": bench_swap, "latency": bench_latency,
       "depth": bench_depth, "restart": bench_restart}
# Run only when named: live membership's (WHICH=join, WHICH=epochs, in
# bench_join), the fault path's anatomy (WHICH=anatomy, bench_anatomy), the
# rebalancer's cost (WHICH=rebalance, bench_rebalance), where a program's
# reads land (WHICH=spread, bench_spread) and swap with and without
# discard (WHICH=discard).
NAMED = {**bench_join.RUN, **bench_anatomy.RUN, **bench_rebalance.RUN, **bench_spread.RUN,
         "discard": bench_discard}


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__, "client", "NAME.txt and NAME.json")
    ap.add_argument("bench", nargs="*", help=f"which ({', '.join([*RUN, *NAMED])}; default all six)")
    args = ap.parse_args(argv)
    for name in args.bench:
        if name not in RUN and name not in NAMED:
            die(PROG, f"unknown benchmark {name} ({', '.join([*RUN, *NAMED])})")
    knobs = Knobs.from_env()
    tdir = target_dir()
    require(PROG, ["nbdkit", "nbdfuse", "fio", "losetup", "mkswap", "swapon", "zramctl", "findmnt"],
            [pagerctl(), server_plugin(), client_plugin(), tdir / "examples" / "fuse-memory"], root=True)
    install_handlers()
    with Teardown(PROG) as top:
        work = disk_workdir(top, "np-bench-")
        print(f"work directory {work} (on a real disk)", file=sys.stderr, flush=True)
        for name in args.bench or RUN:
            b = Bench(name, knobs, work)
            if name in NAMED:
                NAMED[name](b, args.out)
            else:
                RUN[name](b)
            b.report.write(args.out)
        top.close_or_raise()
    return 0


if __name__ == "__main__":
    sys.exit(main())
