"""The swap benchmark of `make bench-client` (3. in bench_client's doc, its
--help): the swap job (memhog in a memory cgroup) through each swap target,
alternating round by round. Its targets (`SwapTargets`) and one run of the
job (`swap_once`) serve bench_apps, bench_ab and bench_client's depth too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import machine
from .attach import FuseFile, LoopDevice, Swap, run
from .bench import die, fmt_row, mean, nbdkit, ratio
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

    def client(self, td: Teardown, rate, frontend: str, mode: str) -> str:
        donors = self.b.donors(td, swap_donors(mode), rate, "swap")
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


def swap_label(run_name: str, k: Knobs) -> str:
    target, _, setting = run_name.partition("/")
    if target.startswith("client:"):
        frontend, _, mode = target.removeprefix("client:").partition("+")
        label = f"client, {mode}, {swap_donors(mode)} donors, {frontend}"
    else:
        label = {"proxy": "one nbdkit memory via a local proxy", "memory": "one nbdkit memory",
                 "floor": "FUSE from memory + loop (the floor)", "zram": "zram",
                 "file": "swap file on local disk"}[target]
    if setting == "links":
        return f"{label}, {k.link_rate} links"
    return f"{label}, loopback" if setting else label


def swap_once(b: Bench, targets: SwapTargets, name: str) -> float:
    """The swap job's seconds through one target, named as bench_swap names
    them: KIND[:FRONTEND+MODE][/SETTING] (client:fuse-uring+parity/links)."""
    k = b.knobs
    limit = parse_size(k.limit)
    target, _, setting = name.partition("/")
    kind, _, spec = target.partition(":")
    frontend, _, mode = spec.partition("+")
    with Teardown(f"swap {name}") as td:
        device = getattr(targets, kind)(td, k.link_rate if setting == "links" else None, frontend, mode)
        r = run_job_in_cgroup(td, [job("memhog"), 3 * limit, "--passes", "1"], limit,
                              b.work / f"memhog-{kind}.log", swap_devices=[device])
        td.close_or_raise()
    if r.returncode != 0 or r.timed_out:
        die(PROG, f"memhog through {name} failed: {r.describe()}")
    return round(r.seconds, 1)


def bench_swap(b: Bench) -> None:
    k = b.knobs
    limit = parse_size(k.limit)
    touch = 3 * limit
    b.report.line(f"== 3. Swap: memhog touching {touch >> 20} MiB in a {k.limit} memory cgroup "
                  f"(1 verify pass), {k.rounds} rounds")
    b.report.line(f"(swap file {b.work / 'swapfile'})")
    runs = []
    for setting in k.swap_settings:
        runs += [f"client:{f}+{m}/{setting}" for m in k.swap_modes for f in k.frontends]
        runs += [f"proxy/{setting}", f"memory/{setting}"]
    runs += ["floor", "zram", "file"]
    targets = SwapTargets(b)
    t: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(1, k.rounds + 1):
        for name in runs:
            t[name].append(swap_once(b, targets, name))
            print(f"round {rnd}: {name} {t[name][-1]}s", file=sys.stderr, flush=True)
    w = [52, 24, 10, 16]
    b.report.line(fmt_row(w, ["target", "seconds per round", "mean", "vs nbdkit memory"], first_left=2))
    for name in runs:
        setting = name.partition("/")[2] or "loopback"
        # Local targets compare with the loopback nbdkit memory if it ran.
        base = t.get(f"memory/{setting}") or t[f"memory/{k.swap_settings[-1]}"]
        b.report.line(fmt_row(w, [swap_label(name, k), " ".join(map(str, t[name])),
                                  f"{mean(t[name]):.1f}", ratio(mean(t[name]), mean(base))], first_left=2))
    for setting in k.swap_settings:
        for m in k.swap_modes:
            for f in k.frontends:
                c = mean(t[f"client:{f}+{m}/{setting}"])
                b.report.line(f"client ({m}) on {f} vs the swap file, {setting}: {ratio(c, mean(t['file']))}")
                parity = t.get(f"client:{f}+parity/{setting}")
                if m == "ec" and parity:
                    b.report.line(f"client on {f}, ec 4+2 vs parity, {setting}: "
                                  f"{ratio(c, mean(parity))} (target <= 1.1x)")
    b.report.line("(targets: client on fuse-uring <= 1.0x one nbdkit memory and <= 1.0x the swap file)")
    b.report.line()
    b.report.results = {"touch_bytes": touch, "limit_bytes": limit,
                        "seconds": {name: {"label": swap_label(name, k), "rounds": t[name]} for name in runs}}
