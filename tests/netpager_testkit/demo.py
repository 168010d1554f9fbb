"""The whole netpager path on one machine, then a clean teardown.

    python3 -m netpager_testkit.demo [--donors N] [--mode parity] [--limit 128M] [--factor 3]

1. donors: nbdkit + pager-server on 127.N.0.2, ... (`machine.loopback`)
2. attach: `pagerctl attach --swap --frontend auto`: the client process
   serves its device (extents on the donors, parity) as a file on its own
   FUSE mount -> loop device -> swapon; restartable, as every swap device
   is by default: a small holder keeps the FUSE connection (classic
   /dev/fuse), so the serving process may crash or be upgraded under the
   job
3. job: memhog in a memory cgroup touches FACTOR x its limit, so most of
   its pages live on the donors, and verifies every page
4. the client's status (donors, weights, extents) and the donors' own
5. teardown (`pagerctl detach`, donors), and a check that nothing is left
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import os

from .attach import mounted, swaps
from .cgroup import JobResult, run_job_in_cgroup
from .cleanup import Teardown, install_handlers
from . import machine
from .client import STATUS_EXITS
from .donor import Cluster, Donor
from .paths import job, pagerctl, server_plugin
from .status import format_table

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in UNITS else ""
    return int(t[: len(t) - len(unit)]) * UNITS[unit]


def heading(n: int, title: str) -> None:
    print(f"\n=== {n}. {title} " + "=" * max(0, 60 - len(title)), flush=True)


def start_donors(td: Teardown, workdir: Path, n: int, size: str) -> list[Donor]:
    plugin = server_plugin()
    if not plugin.exists():
        raise SystemExit(f"demo: {plugin} is missing; run `make build` first")
    donors = Cluster(td, workdir, plugin).start_donors(n, size=size, budget=size)
    for d in donors:
        print(f"donor {d.name}: {d.uri()}  status {d.params['status']}  pid {d.pid}")
        print(f"  $ {' '.join(d.argv())}")
    return donors


def pagerctl_run(args: list[str]) -> str:
    argv = [str(pagerctl())] + [str(a) for a in args]
    print(f"  $ {' '.join(argv)}", flush=True)
    p = subprocess.run(argv, capture_output=True, text=True)
    # status reports the device's health in its exit status.
    if p.returncode != 0 and not (args[0] == "status" and p.returncode in STATUS_EXITS):
        raise SystemExit(f"demo: pagerctl {args[0]} failed ({p.returncode}):\n{p.stderr}{p.stdout}")
    return p.stdout


def attach(td: Teardown, state: Path, donors: list[Donor], mode: str, size: int) -> str:
    """Attaches the client as swap; its detach is registered before it runs,
    so an interrupted attach is undone too (attach.json records each step).
    Like the tests, it holds the machine's swap and FUSE io_uring switch
    locks (`machine`) so that a test run beside it is not disturbed."""
    machine.SWAP.hold(td)

    def detach():
        if (state / "attach.json").exists():
            with machine.URING_SWITCH.held():
                pagerctl_run(["detach", "--state-dir", state])

    td.add(f"pagerctl detach --state-dir {state}", detach)
    args = ["attach", "--state-dir", state, "--size", f"{size >> 20}M", "--mode", mode,
            "--client-id", "demo", "--swap", "--priority", "32000"]
    if mode == "parity":
        args += ["--parity-width", str(min(len(donors), 4))]
    for d in donors:
        args += ["--donor", f"{d.addr}:{d.port},status={d.params['status']},name={d.name}"]
    args += ["--frontend", "auto"]
    with machine.URING_SWITCH.held():
        device = pagerctl_run(args).strip().splitlines()[-1]
    status = json.loads(pagerctl_run(["status", "--state-dir", state, "--json"]))
    holder = status.get("holder") or {}
    serving = (f"pagerctl serve pid {holder.get('serving_pid')}, restartable: "
               f"holder pid {status['server']['pid']}" if status.get("restartable")
               else f"pagerctl serve pid {status['server']['pid']}")
    print(f"client         {serving} (mode {mode}), "
          f"front end {status['transport'] or status['frontend']}")
    if status.get("transport_fallback"):
        print(f"               io_uring not used: {status['transport_fallback']}")
    print(f"swap on        {device} (loop device with direct I/O over {state / 'fuse' / 'device'})")
    return device


def run_job(td: Teardown, workdir: Path, device: str, limit: int, factor: int) -> JobResult:
    size = factor * limit
    print(f"memhog touches {size >> 20} MiB in a cgroup limited to {limit >> 20} MiB ...", flush=True)
    r = run_job_in_cgroup(td, [job("memhog"), str(size), "--passes", "2"], limit,
                          workdir / "memhog.log", swap_devices=[device])
    last = r.output.strip().splitlines()[-1] if r.output.strip() else "(no output)"
    print(f"  {last}")
    print(f"  exit {r.returncode} after {r.seconds:.1f} s; peak memory {r.peak_memory_bytes >> 20} MiB, "
          f"peak swap {r.peak_swap_bytes >> 20} MiB, "
          f"swap device peak {r.swap_device_peak_bytes[device] >> 20} MiB")
    return r


def show_status(state: Path, donors: list[Donor]) -> None:
    print(pagerctl_run(["status", "--state-dir", state]).rstrip())
    print()
    print(format_table([d.status() for d in donors]))


def leftovers(state: Path, device: str | None, donors: list[Donor] | None,
              result: JobResult | None) -> list[str]:
    left = []
    if device is not None:
        if device in swaps():
            left.append(f"swap {device}")
        if os.path.exists(f"/sys/block/{Path(device).name}/loop/backing_file"):
            left.append(f"loop {device}")
    if mounted(state / "fuse"):
        left.append(f"mount {state / 'fuse'}")
    if (state / "attach.json").exists():
        left.append(f"attach record {state / 'attach.json'}")
    left += [f"donor {d.name} pid {d.pid}" for d in donors or [] if d.alive()]
    if result is not None and result.cgroup.exists():
        left.append(f"cgroup {result.cgroup}")
    return left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netpager demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--donors", type=int, default=4, help="donors to start")
    ap.add_argument("--mode", default="parity", choices=["none", "mirror", "parity", "disk"],
                    help="the client's reliability mode")
    ap.add_argument("--size", default="512M", help="each donor's export size and budget")
    ap.add_argument("--limit", default="128M", help="the job's memory cgroup limit")
    ap.add_argument("--factor", type=int, default=3, help="the job touches FACTOR x limit")
    args = ap.parse_args(argv)

    install_handlers()
    td = Teardown("demo", announce=lambda what: print(f"undo: {what}", flush=True))
    workdir = Path(tempfile.mkdtemp(prefix="netpager-demo-"))
    # Logs go when the demo passes or is interrupted, stay when it fails.
    keep_logs = []
    td.add(f"directory {workdir}", lambda: keep_logs or shutil.rmtree(workdir))
    ok = interrupted = False
    device = donors = result = None
    state = workdir / "client"
    limit = parse_size(args.limit)
    try:
        heading(1, "Donors: nbdkit + pager-server on loopback")
        donors = start_donors(td, workdir, args.donors, args.size)
        heading(2, f"Attach: pagerctl attach --swap ({args.mode} over {args.donors} donors)")
        # The device holds the job's pages with room to spare.
        device = attach(td, state, donors, args.mode, (args.factor + 1) * limit)
        heading(3, "Job: memhog in a memory cgroup, verifying every page")
        result = run_job(td, workdir, device, limit, args.factor)
        heading(4, "Status: the client, then each donor")
        show_status(state, donors)
        ok = result.returncode == 0 and result.peak_swap_bytes > 0
    except KeyboardInterrupt:
        interrupted = True
    finally:
        heading(5, "Teardown")
        if not ok and not interrupted:
            keep_logs.append(True)
        errors = td.close()
        left = leftovers(state, device, donors, result)
        for e in errors:
            print(f"cleanup error: {e}")
        if left:
            print("LEFT BEHIND: " + ", ".join(left))
        elif not errors:
            print("nothing left behind (swap, loop, mount, processes, cgroup all gone)")
        if workdir.exists():
            print(f"logs kept in {workdir}")
    if interrupted:
        print("\ndemo INTERRUPTED")
        return 130
    passed = ok and not errors and not left
    print("\ndemo " + ("PASSED: the job's pages went to the donors and came back intact"
                       if passed else "FAILED"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
