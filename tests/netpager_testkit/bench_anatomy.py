"""The fault path's anatomy (make bench-client WHICH=anatomy): where a
swap-in's microseconds and a swapped GiB's CPU go.

The swap job (memhog touching 3x LIMIT in a LIMIT memory cgroup, one
shuffled verify pass and a reverse one) runs through each of ANATOMY_TARGETS,
alternating round by round:

  client       pagerctl attach, mode none, one donor on loopback, fuse-uring,
               the write-back buffer at its default
  client-wb0   the same with --writeback-buffer 0 (swap-outs on the fault
               path, as before the buffer)
  client-spin0 the same with --spin-us 0
  file         a swap file on this machine's disk
  zram         zram

A sampler reads, every 0.2 s, the swap-ins and swap-outs (/proc/vmstat)
and the CPU time of each party: the serving process, the donor, the job
itself (its system time is its share of reclaim and faults), kernel
threads (loop workers, kswapd: every child of kthreadd), softirq
(/proc/stat) and the whole machine. Each party's CPU per swapped GiB, in
and out, is the least-squares fit of its CPU in each interval to the GiB
swapped in and out in it (the job's first pass only writes, its last only
reads, so both are seen apart). The serving process's stage histograms
(status.json) give where a request's microseconds go inside it. Where
bpftrace and the kernel's tracepoints allow it (ANATOMY_KERNEL=1), one more
client run traces the kernel's side of each swap-in: fault to the loop
device's request, loop to the FUSE request, the FUSE request's life (the
serving process), FUSE to the loop request's end, and that to the faulting
task running again.

On a machine shared with other work, the kernel-thread, softirq and
machine columns count that work too: read them from a quiet run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .attach import Swap, run
from .bench import env_int, env_str, mean
from .cgroup import MemoryCgroup
from .cleanup import Teardown
from .client import PagerClient
from .demo import parse_size
from .donor import Cluster
from .paths import job, server_plugin
from .procs import OwnedProcess

PROG = "bench-client"
TCK = os.sysconf("SC_CLK_TCK")
GIB = 1 << 30
PARTIES = ("serve", "donor", "job_sys", "job_user", "kthreads", "softirq", "machine")


def proc_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds; 0 once gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(f[11]) + int(f[12])) / TCK


def proc_user_sys(pid: int) -> tuple[float, float]:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0, 0.0
    return int(f[11]) / TCK, int(f[12]) / TCK


def kthreads_cpu() -> dict[int, float]:
    """CPU of every kernel thread (child of kthreadd), by pid."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            f = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f[1] == "2":
            out[int(p.name)] = (int(f[11]) + int(f[12])) / TCK
    return out


def machine_cpu() -> tuple[float, float]:
    """(busy, softirq) seconds of the whole machine (/proc/stat)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(v[:8]) - v[3] - v[4]
    return busy / TCK, v[6] / TCK


def vmstat_swap() -> tuple[int, int]:
    """Pages swapped in and out so far."""
    d = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return int(d["pswpin"]), int(d["pswpout"])


class Sampler(threading.Thread):
    """Counters of swapping and CPU every `interval` seconds."""

    def __init__(self, serve: int | None, donors: list[int], job_pid, interval: float = 0.2):
        super().__init__(daemon=True)
        self.serve, self.donors, self.job_pid, self.interval = serve, donors, job_pid, interval
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        self.kt_prev = kthreads_cpu()

    def sample(self) -> None:
        kt = kthreads_cpu()
        kdelta = sum(v - self.kt_prev[p] for p, v in kt.items() if p in self.kt_prev)
        self.kt_prev = kt
        busy, softirq = machine_cpu()
        pin, pout = vmstat_swap()
        jp = self.job_pid()
        ju, js = proc_user_sys(jp) if jp else (0.0, 0.0)
        self.samples.append({
            "t": time.monotonic(), "in": pin, "out": pout,
            "serve": proc_cpu(self.serve) if self.serve else 0.0,
            "donor": sum(proc_cpu(p) for p in self.donors), "job_user": ju, "job_sys": js,
            "kthreads_delta": kdelta, "softirq": softirq, "machine": busy,
        })

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.sample()


def intervals(samples: list[dict]) -> list[dict]:
    """Per-interval deltas: GiB in and out, each party's CPU seconds. A
    counter that went backwards (the job's, once it exited and its pid is
    gone) counts nothing for that interval."""
    out = []
    for a, b in zip(samples, samples[1:]):
        d = {"in": (b["in"] - a["in"]) * 4096 / GIB, "out": (b["out"] - a["out"]) * 4096 / GIB}
        for p in PARTIES:
            if p == "kthreads":
                d[p] = b["kthreads_delta"]
            else:
                d[p] = max(0.0, b[p] - a[p])
        out.append(d)
    return out


def fit_per_gib(iv: list[dict], party: str) -> tuple[float, float]:
    """Least squares cpu = a*in + b*out over the intervals (a, b >= 0):
    CPU seconds per GiB swapped in and per GiB swapped out."""
    sii = sum(d["in"] ** 2 for d in iv)
    soo = sum(d["out"] ** 2 for d in iv)
    sio = sum(d["in"] * d["out"] for d in iv)
    sic = sum(d["in"] * d[party] for d in iv)
    soc = sum(d["out"] * d[party] for d in iv)
    det = sii * soo - sio * sio
    a = b = -1.0
    if det > 1e-12:
        a = (sic * soo - soc * sio) / det
        b = (soc * sii - sic * sio) / det
    if a >= 0 and b >= 0:
        return a, b
    # One side's fit went negative: it is 0, the other alone explains it.
    if a < 0 <= b or not sii:
        return 0.0, max(soc / soo, 0.0) if soo else 0.0
    return max(sic / sii, 0.0), 0.0


# ------------------------------------------------------------ kernel side
# Swap-outs are the loop device's writes (rwbs W, WS, ...): its discards
# and flushes are other FUSE requests, and pairing their ends with a
# write's would measure the time since the last write.
BPF = r"""
tracepoint:exceptions:page_fault_user /pid == $1/ { @f[tid] = nsecs; }
tracepoint:block:block_rq_issue /args->dev == $2/ {
  if (args->rwbs == "R" && @f[tid]) { @fault_to_loop = stats(nsecs - @f[tid]); @w[args->sector] = tid; @f[tid] = 0; }
  if (args->rwbs == "R") { @ri = nsecs; } else if (strncmp(args->rwbs, "W", 1) == 0) { @wi = nsecs; }
}
tracepoint:fuse:fuse_request_send /args->opcode == 15 || args->opcode == 16/ {
  @fs[args->unique] = nsecs; @op[args->unique] = args->opcode;
  if (args->opcode == 15 && @ri) { @r_loop_to_fuse = stats(nsecs - @ri); @ri = 0; }
  if (args->opcode == 16 && @wi) { @w_loop_to_fuse = stats(nsecs - @wi); @wi = 0; }
}
tracepoint:fuse:fuse_request_end /@fs[args->unique]/ {
  if (@op[args->unique] == 15) { @r_fuse = stats(nsecs - @fs[args->unique]); @re = nsecs; }
  else { @w_fuse = stats(nsecs - @fs[args->unique]); @we = nsecs; }
  delete(@fs[args->unique]); delete(@op[args->unique]);
}
tracepoint:block:block_rq_complete /args->dev == $2/ {
  if (args->rwbs == "R" && @re) { @r_fuse_to_loop_end = stats(nsecs - @re); @re = 0;
    if (@w[args->sector]) { @c[@w[args->sector]] = nsecs; delete(@w[args->sector]); } }
  if (strncmp(args->rwbs, "W", 1) == 0 && @we) { @w_fuse_to_loop_end = stats(nsecs - @we); @we = 0; }
}
tracepoint:sched:sched_switch /@c[args->next_pid]/ {
  @loop_end_to_task = stats(nsecs - @c[args->next_pid]); delete(@c[args->next_pid]);
}
END { clear(@f); clear(@w); clear(@fs); clear(@op); clear(@c); clear(@ri); clear(@wi); clear(@re); clear(@we); }
"""

KERNEL_STAGES = [
    ("fault_to_loop", "swap-in: the fault to its read on the loop device"),
    ("r_loop_to_fuse", "swap-in: the loop request to its FUSE request"),
    ("r_fuse", "swap-in: the FUSE request's life (the serving process)"),
    ("r_fuse_to_loop_end", "swap-in: the FUSE reply to the loop request's end"),
    ("loop_end_to_task", "swap-in: the loop request's end to the task running"),
    ("w_loop_to_fuse", "swap-out: the loop request to its FUSE request"),
    ("w_fuse", "swap-out: the FUSE request's life (the serving process)"),
    ("w_fuse_to_loop_end", "swap-out: the FUSE reply to the loop request's end"),
]


def tracefs(td: Teardown) -> bool:
    """/sys/kernel/tracing mounted (mounted here, and unmounted after, if it was not)."""
    t = Path("/sys/kernel/tracing")
    if (t / "events").exists():
        return True
    if subprocess.run(["mount", "-t", "tracefs", "nodev", str(t)], capture_output=True).returncode:
        return False
    td.add(f"umount {t}", lambda: run(["umount", str(t)]))
    return True


def parse_bpftrace(text: str) -> dict[str, tuple[int, float]]:
    """@name: count N, average A, total T lines -> {name: (count, mean us)}."""
    out = {}
    for m in re.finditer(r"@(\w+): count (\d+), average (\d+), total \d+", text):
        out[m.group(1)] = (int(m.group(2)), int(m.group(3)) / 1000)
    return out


# ----------------------------------------------------------------- runs
def attach_client(b, td: Teardown, tag: str, extra: list[str]):
    cluster = Cluster(td, b.work / f"d-{tag}", server_plugin())
    donors = cluster.start_donors(1, size="2G", budgets="2G", reserve=0, busy_load=1000)
    state = b.work / f"c-{tag}"
    shutil.rmtree(state, ignore_errors=True)
    c = PagerClient(td, state, client_id="anatomy")
    c.attach(donors, mode="none", size="1G", swap=True, frontend="fuse-uring", extra=extra)
    return c, [d.pid for d in donors]


def swap_target(b, td: Teardown, target: str):
    """(device, serving pid, donor pids, client) of one target."""
    extra = {"client": [], "client-wb0": ["--writeback-buffer", "0"], "client-spin0": ["--spin-us", "0"]}
    if target in extra:
        c, donors = attach_client(b, td, target, extra[target])
        return c.device, c.server_pid() or c.serving_pid(), donors, c
    if target == "zram":
        dev = run(["zramctl", "--find", "--size", "1G"]).strip()
        td.add(f"zram {dev}", lambda: run(["zramctl", "--reset", dev]))
        Swap(td, dev, priority=32767)
        return dev, None, [], None
    if target == "file":
        f = b.work / "swapfile"
        run(["fallocate", "-l", "1G", f])
        f.chmod(0o600)
        td.add(f"swap file {f}", lambda: f.unlink(missing_ok=True))
        Swap(td, str(f), priority=32767)
        return str(f), None, [], None
    raise ValueError(f"unknown anatomy target {target} (client, client-wb0, client-spin0, file, zram)")


def one_run(b, target: str, limit: int, kernel: bool = False) -> dict:
    with Teardown(f"anatomy {target}") as td:
        dev, serve, donors, client = swap_target(b, td, target)
        before = client.device_status().get("stages", []) if client else []
        cg = MemoryCgroup(td, limit)
        log = b.work / f"memhog-{target}.log"
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.procs_file), str(job("memhog")),
                str(3 * limit), "--passes", "1"]
        bpf = None
        proc = OwnedProcess(argv, log, td, "memhog")
        pids = []

        def job_pid():
            if not pids:
                got = cg.pids()
                if got:
                    pids.append(got[0])
            return pids[0] if pids else None

        if kernel:
            while job_pid() is None and proc.alive():
                time.sleep(0.001)
            kdev = (os.major(os.stat(dev).st_rdev) << 20) | os.minor(os.stat(dev).st_rdev)
            bpf = OwnedProcess(["bpftrace", "-e", BPF, str(job_pid()), str(kdev)], b.work / "bpftrace.log",
                               td, "bpftrace")
        s = Sampler(serve, donors, job_pid)
        t0 = time.monotonic()
        s.sample()
        s.start()
        rc = proc.wait(900)
        seconds = time.monotonic() - t0
        s.stop_event.set()
        s.join()
        s.sample()
        if rc != 0 or "memhog: OK" not in (log.read_text() if log.exists() else ""):
            raise RuntimeError(f"memhog through {target} failed ({rc}): {proc.log_tail()}")
        kernel_stages = {}
        if bpf:
            bpf.popen.send_signal(2)
            bpf.wait(30)
            kernel_stages = parse_bpftrace((b.work / "bpftrace.log").read_text())
        after = client.device_status().get("stages", []) if client else []
        td.close_or_raise()
    return {"seconds": round(seconds, 2), "samples": s.samples, "stages": stage_delta(before, after),
            "kernel": kernel_stages}


def stage_delta(before: list[dict], after: list[dict]) -> dict[str, dict[str, list[float]]]:
    """{op: {stage: [count, seconds]}} between two looks at status."""
    old = {(r["op"], r["stage"]): r for r in before}
    out: dict[str, dict[str, list[float]]] = {}
    for r in after:
        o = old.get((r["op"], r["stage"]), {"count": 0, "seconds": 0.0})
        out.setdefault(r["op"], {})[r["stage"]] = [r["count"] - o["count"], r["seconds"] - o["seconds"]]
    return out


def summarize(runs: list[dict]) -> dict:
    """Per party: total CPU seconds (mean of rounds) and CPU s per GiB in/out."""
    iv = [d for r in runs for d in intervals(r["samples"])]
    gin = sum(d["in"] for d in iv) / len(runs)
    gout = sum(d["out"] for d in iv) / len(runs)
    out = {"seconds": [r["seconds"] for r in runs], "gib_in": round(gin, 2), "gib_out": round(gout, 2)}
    for p in PARTIES:
        a, b = fit_per_gib(iv, p)
        out[p] = {"cpu_s": round(sum(d[p] for d in iv) / len(runs), 2), "per_gib_in": round(a, 2),
                  "per_gib_out": round(b, 2)}
    return out


def bench_anatomy(b, out: Path) -> None:
    k = b.knobs
    limit = parse_size(k.limit)
    targets = env_str("ANATOMY_TARGETS", "client client-wb0 file zram").split()
    kernel = env_int(PROG, "ANATOMY_KERNEL", 1) != 0
    b.report.knobs.update({"anatomy_targets": targets, "anatomy_kernel": kernel})
    load = os.getloadavg()
    b.report.line(f"== anatomy: memhog touching {3 * limit >> 20} MiB in a {k.limit} cgroup (one verify pass), "
                  f"{k.rounds} rounds alternating; load average at start {load[0]:.2f}")
    runs: dict[str, list[dict]] = {t: [] for t in targets}
    for rnd in range(k.rounds):
        for t in targets:
            r = one_run(b, t, limit)
            runs[t].append(r)
            print(f"round {rnd + 1}: {t} {r['seconds']} s", file=sys.stderr, flush=True)
    summary = {t: summarize(runs[t]) for t in targets}
    w = [13, 7, 11, 17, 17, 17, 17, 10]
    b.report.line("CPU seconds for the job (mean of rounds), and per GiB swapped in / out (fit over 0.2 s intervals):")
    head = ["target", "job s", "GiB in/out", "serving process", "donor", "job's kernel", "kernel threads",
            "softirq"]
    b.report.line(" ".join(f"{h:<{x}}" if i == 0 else f"{h:>{x}}" for i, (h, x) in enumerate(zip(head, w))))
    for t in targets:
        s = summary[t]

        def cell(p):
            c = s[p]
            return f"{c['cpu_s']} ({c['per_gib_in']}/{c['per_gib_out']})"

        cells = [t, f"{mean(s['seconds']):.1f}", f"{s['gib_in']}/{s['gib_out']}", cell("serve"), cell("donor"),
                 cell("job_sys"), cell("kthreads"), cell("softirq")]
        b.report.line(" ".join(f"{c:<{x}}" if i == 0 else f"{c:>{x}}" for i, (c, x) in enumerate(zip(cells, w))))
    b.report.line("(cells: CPU seconds (per GiB in / per GiB out); whole machine: "
                  + ", ".join(f"{t} {summary[t]['machine']['cpu_s']}" for t in targets) + ")")
    if "client" in summary and "client-wb0" in summary:
        c, z = summary["client"]["serve"]["cpu_s"], summary["client-wb0"]["serve"]["cpu_s"]
        b.report.line(f"serving process CPU, buffer vs none: {c / z:.2f}x" if z else "")
    b.report.line()
    stage_tables(b, targets, runs)
    kernel_side = {}
    if kernel and any(t.startswith("client") for t in targets):
        with Teardown("tracefs") as td:
            if shutil.which("bpftrace") and tracefs(td):
                kernel_side = one_run(b, "client", limit, kernel=True)["kernel"]
            td.close_or_raise()
        b.report.line("Kernel side of the client's swap path (bpftrace, one more run; mean us, count):")
        if not kernel_side:
            b.report.line("  (not available here: bpftrace or the kernel's tracepoints are missing)")
        for name, label in KERNEL_STAGES:
            if name in kernel_side:
                n, us = kernel_side[name]
                b.report.line(f"  {label:<62} {us:>9.1f} {n:>9}")
        b.report.line()
    b.report.results = {"summary": summary, "stages": {t: [r["stages"] for r in runs[t]] for t in targets},
                        "kernel": kernel_side, "load_at_start": load}


def stage_tables(b, targets: list[str], runs: dict[str, list[dict]]) -> None:
    """Mean microseconds per request in each stage of the serving process."""
    stages = ["frontend", "device", "donor", "wakeup", "complete", "commit"]
    for t in targets:
        if not t.startswith("client"):
            continue
        b.report.line(f"Stages inside the serving process, {t} (mean us per request that passed it; requests):")
        b.report.line("  " + f"{'op':<6}" + "".join(f"{s:>10}" for s in stages) + f"{'total':>10}{'requests':>10}")
        for op in ("read", "write", "drain"):
            tot = {s: [0, 0.0] for s in stages}
            for r in runs[t]:
                for s, (n, secs) in r["stages"].get(op, {}).items():
                    tot[s][0] += n
                    tot[s][1] += secs
            reqs = tot["commit"][0]
            if not reqs:
                continue
            cells = [tot[s][1] * 1e6 / reqs for s in stages]
            b.report.line("  " + f"{op:<6}" + "".join(f"{c:>10.1f}" for c in cells)
                          + f"{sum(cells):>10.1f}{reqs // len(runs[t]):>10}")
        b.report.line("  (per request: a stage's time over all requests, so the columns add up to the total)")
    b.report.line()


RUN = {"anatomy": bench_anatomy}
