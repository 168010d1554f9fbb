"""The swap benchmark of `make bench-client` (3. in bench_client's doc, its
--help): the swap job (memhog in a memory cgroup) through each swap target,
alternating round by round; with COMPRESS, each client set-up once per
donor compress= setting, side by side with what the donors held. Its
targets (`SwapTargets`) and one run of the job (`swap_once`) serve
bench_apps, bench_ab and bench_client's depth too.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from . import machine
from .attach import FuseFile, LoopDevice, Swap, run
from .bench import (DonorMemory, compress_settings, die, env_int, env_str, fmt_row, held_cell, mean, mean_held,
                    nbdkit, ratio)
from .cgroup import run_job_in_cgroup
from .cleanup import Teardown
from .client import URING_SWITCH
from .demo import parse_size
from .donor import Donor
from .paths import job, target_dir
from .procs import OwnedProcess, tail, wait_for

if TYPE_CHECKING:
    from .bench_client import Bench, Knobs

PROG = "bench-client"
# What the client's swap is compared with (SWAP_TARGETS): per link setting,
# then local.
REFERENCES = ["proxy", "memory", "floor", "zram", "file"]


def swap_donors(mode: str) -> int:
    """Donors the swap job's client uses (ec 4+2 needs 6)."""
    return 6 if mode == "ec" else 3


def loop_swap(td: Teardown, path: Path) -> str:
    """What pagerctl does over its FUSE file: a loop device with direct I/O
    and the same queue depth, swap on it."""
    loop = LoopDevice(td, path, direct_io=True)
    q = Path("/sys/block") / Path(loop.device).name / "queue" / "nr_requests"
    depth = q.read_text().strip()
    q.write_text("16")
    td.add(f"{q} back to {depth}", lambda: q.write_text(depth))
    Swap(td, loop.device, priority=32767)
    return loop.device


def memory_server(b: Bench, td: Teardown, rate: str | None) -> Donor:
    """One `nbdkit memory` over TCP on a loopback address of its own, as a
    remote memory server would be."""
    filters = {"filters": ["rate"], "filter_params": {"rate": rate}} if rate else {}
    return Donor(td, b.work, "mem", machine.loopback(9, net=1), "memory", {"size": "1G"}, **filters).start()


class SwapTargets:
    """Each target sets up a swap area, its undo in `td`, and returns its device."""

    def __init__(self, b: Bench):
        self.b = b

    def client(self, td: Teardown, donors: list[Donor], frontend: str, mode: str) -> str:
        """The client in `mode` on `donors` (swap_donors(mode) of them)."""
        return self.b.attach(td, "swap", donors, mode, "1G", frontend, swap=True, width=3).device

    def memory(self, td: Teardown, rate, *_) -> str:
        mem = memory_server(self.b, td, rate)
        return loop_swap(td, FuseFile(td, self.b.work, mem.uri()).path)

    def proxy(self, td: Teardown, rate, *_) -> str:
        """The same nbdkit memory reached the way the client reaches its donors:
        through a local nbdkit on a unix socket (its nbd plugin) that relays
        each request over TCP. Against `memory`, this prices the extra hop
        alone; against the client, what the client does besides."""
        mem = memory_server(self.b, td, rate)
        sock = self.b.work / "proxy.sock"
        sock.unlink(missing_ok=True)
        nbdkit(td, self.b.work, "proxy", ["-U", sock, "nbd", f"hostname={mem.addr}", f"port={mem.port}"])
        return loop_swap(td, FuseFile(td, self.b.work, f"nbd+unix:///?socket={sock}").path)

    def floor(self, td: Teardown, *_) -> str:
        """The floor of the client's path: the same FUSE front end, loop device
        and queue depth, answering from its own memory with no donor behind
        it (examples/fuse-memory.rs). A loop device over a tmpfs file is no
        floor to swap on: loop charges the file's pages to the swapping job's
        cgroup, which then swaps them to the same loop device, and swap-in
        deadlocks."""
        return loop_swap(td, self.floor_file(td))

    def floor_file(self, td: Teardown) -> Path:
        """examples/fuse-memory mounted in the work directory; its file."""
        if URING_SWITCH.exists():
            # On, as pagerctl attach turns it on for the client (and detach back);
            # no other test run flips it meanwhile.
            machine.URING_SWITCH.hold(td)
            was = URING_SWITCH.read_text().strip()
            td.add(f"{URING_SWITCH} back to {was}", lambda: URING_SWITCH.write_text(was))
            URING_SWITCH.write_text("Y")
        mnt = self.b.work / "floor"
        mnt.mkdir(exist_ok=True)
        proc = OwnedProcess([target_dir() / "examples" / "fuse-memory", mnt, "1024", "fuse-uring"],
                            self.b.work / "floor.log", td, "fuse-memory")
        td.add(f"fuse-memory mount {mnt}", lambda: (run(["umount", mnt]), proc.wait(30)))

        def ready():
            if not proc.alive():
                raise RuntimeError(f"fuse-memory exited: {tail(proc.log_path)}")
            return (mnt / "device").exists()

        wait_for(ready, 30, f"fuse-memory (log {proc.log_path})")
        return mnt / "device"

    def floor_device(self, td: Teardown) -> str:
        """The floor as a block device (no swap on it): the FUSE front end
        from memory under a loop device with direct I/O, as pagerctl attach
        sets one up."""
        return LoopDevice(td, self.floor_file(td), direct_io=True).device

    def zram(self, td: Teardown, *_) -> str:
        dev = run(["zramctl", "--find", "--size", "1G"]).strip()
        td.add(f"zram {dev}", lambda: run(["zramctl", "--reset", dev]))
        Swap(td, dev, priority=32767)
        return dev

    def file(self, td: Teardown, *_) -> str:
        f = self.b.work / "swapfile"
        run(["fallocate", "-l", "1G", f])
        f.chmod(0o600)
        td.add(f"swap file {f}", lambda: f.unlink(missing_ok=True))
        Swap(td, str(f), priority=32767)
        return str(f)


def parse_run(name: str) -> tuple[str, str, str, str, str]:
    """A run's name as bench_swap names them,
    KIND[:FRONTEND+MODE][/SETTING[@COMPRESS]] (client:fuse-uring+parity/links,
    client:fuse-uring+parity/loopback@lz4): (kind, frontend, mode, setting,
    compress), "" where absent."""
    target, _, rest = name.partition("/")
    setting, _, compress = rest.partition("@")
    kind, _, spec = target.partition(":")
    frontend, _, mode = spec.partition("+")
    return kind, frontend, mode, setting, compress


def swap_label(run_name: str, k: Knobs) -> str:
    kind, frontend, mode, setting, compress = parse_run(run_name)
    if kind == "client":
        label = f"client, {mode}, {swap_donors(mode)} donors, {frontend}"
    else:
        label = {"proxy": "one nbdkit memory via a local proxy", "memory": "one nbdkit memory",
                 "floor": "FUSE from memory + loop (the floor)", "zram": "zram",
                 "file": "swap file on local disk"}[kind]
    if setting == "links":
        label = f"{label}, {k.link_rate} links"
    elif setting:
        label = f"{label}, loopback"
    return f"{label}, compress={compress}" if compress else label


def swap_once(b: Bench, targets: SwapTargets, name: str) -> float:
    """The swap job's seconds through one target (named as parse_run reads)."""
    return swap_run(b, targets, name)[0]


def swap_run(b: Bench, targets: SwapTargets, name: str, compressible: int = 0) -> tuple[float, dict | None]:
    """The swap job's seconds through one target, and for a client run with
    a compress setting (@COMPRESS: its donors started with it) what its
    donors held (DonorMemory.summary: at the job's end, read before the
    teardown, and at peak). `compressible`: memhog's --compressible."""
    k = b.knobs
    limit = parse_size(k.limit)
    kind, frontend, mode, setting, compress = parse_run(name)
    rate = k.link_rate if setting == "links" else None
    hog = [job("memhog"), 3 * limit, "--passes", "1", *(["--compressible", compressible] if compressible else [])]
    with Teardown(f"swap {name}") as td:
        if kind == "client":
            donors = b.donors(td, swap_donors(mode), rate, "swap", compress=compress or None)
            device = targets.client(td, donors, frontend, mode)
        else:
            donors, device = [], getattr(targets, kind)(td, rate, frontend, mode)
        meter = DonorMemory(donors) if compress else None
        with meter or nullcontext():
            r = run_job_in_cgroup(td, hog, limit, b.work / f"memhog-{kind}.log", swap_devices=[device])
        held = meter.summary() if meter else None
        td.close_or_raise()
    if r.returncode != 0 or r.timed_out:
        die(PROG, f"memhog through {name} failed: {r.describe()}")
    return round(r.seconds, 1), held


def bench_swap(b: Bench) -> None:
    k = b.knobs
    limit = parse_size(k.limit)
    touch = 3 * limit
    compress = compress_settings(PROG)
    compressible = env_int(PROG, "COMPRESSIBLE", 0)
    if not 0 <= compressible <= 90:
        die(PROG, f"COMPRESSIBLE={compressible}: a percentage from 0 to 90")
    if compress:
        b.report.knobs["compress"] = compress
    if compressible:
        b.report.knobs["compressible"] = compressible
    refs = env_str("SWAP_TARGETS", " ".join(REFERENCES)).split()
    for r in refs:
        if r not in REFERENCES:
            die(PROG, f"unknown target {r} in SWAP_TARGETS ({', '.join(REFERENCES)})")
    if refs != REFERENCES:
        b.report.knobs["swap_targets"] = refs
    b.report.line(f"== 3. Swap: memhog touching {touch >> 20} MiB in a {k.limit} memory cgroup "
                  f"(1 verify pass), {k.rounds} rounds")
    if compress or compressible:
        b.report.line(f"(memhog's pages {compressible}% zeros; client set-ups with their donors at compress="
                      f"{', '.join(compress) or 'the default'}, alternating)")
    b.report.line(f"(swap file {b.work / 'swapfile'})")
    at = [f"@{c}" for c in compress] or [""]
    runs = []
    for setting in k.swap_settings:
        runs += [f"client:{f}+{m}/{setting}{c}" for m in k.swap_modes for f in k.frontends for c in at]
        runs += [f"{r}/{setting}" for r in ("proxy", "memory") if r in refs]
    runs += [r for r in ("floor", "zram", "file") if r in refs]
    targets = SwapTargets(b)
    t: dict[str, list[float]] = {name: [] for name in runs}
    held: dict[str, list[dict]] = {name: [] for name in runs if "@" in name.partition("/")[2]}
    for rnd in range(1, k.rounds + 1):
        for name in runs:
            seconds, h = swap_run(b, targets, name, compressible)
            t[name].append(seconds)
            note = ""
            if h:
                held[name].append(h)
                note = f", donors ({'/'.join(h['compress'])}) hold {held_cell(h['end'])} at its end, " \
                       f"{held_cell(h['peak'])} at peak"
            print(f"round {rnd}: {name} {seconds}s{note}", file=sys.stderr, flush=True)
    w = [max([52, *(len(swap_label(n, k)) for n in runs)]), 24, 10, 16]
    b.report.line(fmt_row(w, ["target", "seconds per round", "mean", "vs nbdkit memory"], first_left=2))
    for name in runs:
        setting = parse_run(name)[3] or "loopback"
        # Local targets compare with the loopback nbdkit memory if it ran.
        base = t.get(f"memory/{setting}") or t.get(f"memory/{k.swap_settings[-1]}")
        b.report.line(fmt_row(w, [swap_label(name, k), " ".join(map(str, t[name])), f"{mean(t[name]):.1f}",
                                  ratio(mean(t[name]), mean(base)) if base else "-"], first_left=2))
    for setting in k.swap_settings:
        for m in k.swap_modes:
            for f in k.frontends:
                for c in at:
                    on = f", compress={c[1:]}" if c else ""
                    secs = mean(t[f"client:{f}+{m}/{setting}{c}"])
                    if "file" in t:
                        b.report.line(f"client ({m}) on {f} vs the swap file, {setting}{on}: "
                                      f"{ratio(secs, mean(t['file']))}")
                    parity = t.get(f"client:{f}+parity/{setting}{c}")
                    if m == "ec" and parity:
                        b.report.line(f"client on {f}, ec 4+2 vs parity, {setting}{on}: "
                                      f"{ratio(secs, mean(parity))} (target <= 1.1x)")
    b.report.line("(targets: client on fuse-uring <= 1.0x one nbdkit memory and <= 1.0x the swap file)")
    b.report.results = {"touch_bytes": touch, "limit_bytes": limit,
                        "seconds": {name: {"label": swap_label(name, k), "rounds": t[name],
                                           **({"donors": held[name]} if name in held else {})} for name in runs}}
    if compress:
        b.report.results["compress"] = compress_lines(b, t, held, compress)
    b.report.line()


def compress_lines(b: Bench, t: dict, held: dict, compress: list[str]) -> dict:
    """Each client set-up's time and donor memory with each compress setting
    against the first: table lines, and the numbers for the JSON."""
    k, first = b.knobs, compress[0]
    b.report.line(f"donors' compression: each client set-up's time and its donors' memory, held/written "
                  f"(ratio), mean of the rounds, at the job's end and at peak, against compress={first}:")
    out = {}
    for setting in k.swap_settings:
        for m in k.swap_modes:
            for f in k.frontends:
                setup = f"client:{f}+{m}/{setting}"
                secs = {c: mean(t[f"{setup}@{c}"]) for c in compress}
                end = {c: mean_held([h["end"] for h in held[f"{setup}@{c}"]]) for c in compress}
                peak = {c: mean_held([h["peak"] for h in held[f"{setup}@{c}"]]) for c in compress}
                b.report.line(f"  client ({m}) on {f}, {setting}:")
                for c in compress:
                    b.report.line(f"    {c}: {secs[c]:.1f} s, donors {held_cell(end[c])} at the end, "
                                  f"{held_cell(peak[c])} at peak")
                for c in compress[1:]:
                    b.report.line(f"    {c} / {first}: {ratio(secs[c], secs[first])} (target <= 1.05x); "
                                  f"donor memory at the end {ratio(end[c]['stored'], end[first]['stored'])}, "
                                  f"at peak {ratio(peak[c]['stored'], peak[first]['stored'])}")
                out[setup] = {c: {"seconds": round(secs[c], 2), "end": end[c], "peak": peak[c],
                                  "time_ratio": round(secs[c] / secs[first], 3),
                                  "end_ratio": round(end[c]["stored"] / end[first]["stored"], 3)
                                  if end[first]["stored"] else None,
                                  "peak_ratio": round(peak[c]["stored"] / peak[first]["stored"], 3)
                                  if peak[first]["stored"] else None}
                              for c in compress}
    return out
