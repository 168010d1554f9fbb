"""Real programs at a fraction of their memory (`make bench-apps`): what a
lab admin choosing between netpager, a swap file, zram and zswap would
measure on their own programs.

Each program (apps_jobs.py, in a memory cgroup) first runs unlimited (100%,
no swap), which measures its peak; then at each FRACTION of that peak
through each swap set-up, alternating set-ups round by round:

  none         netpager, mode none, 3 donors, fuse-uring
  parity       netpager, mode parity, 3 donors, fuse-uring
  parity+pf    the same with the client's stride prefetcher (PREFETCH_PAGES)
  file         a swap file on local disk
  zram         zram (lzo-rle, the kernel's default)
  zswap+parity zswap in front of netpager parity (pool capped at ZSWAP_POOL %)
  zswap+file   zswap in front of the swap file

REGIME picks the disks and links compared (default loopback, the set-ups
above); the others put netpager (none and parity, donors on loopback)
beside a swap area on a disk a lab actually has (netpager_testkit.disks:
each emulated disk reached through the same loop path as netpager):

  disk         the swap file on this machine's disk, and the emulation's
               path over that same disk with no filter (disk-path)
  ssd          an SSD-class disk (500 MB/s; the path's own latency)
  hdd          an HDD-class disk (8 ms per request, 150 MB/s)
  lab          netpager with its donors on the lab's hosts (network
               namespaces, tests/lab/netlab.py) behind 10 Gbit/s and
               1 Gbit/s links (tbf on both ends: none/10g, parity/10g,
               none/1g, parity/1g), beside netpager on loopback and the
               swap file (netpager_testkit.lab_links)
  shared       a shared disk: the sort reads its array from a file on the
               disk its swap file is on (written once, its page cache
               dropped before each run), so that its swap-outs and its
               own input meet on one disk; netpager's donors are not on
               it. Programs: the sort only, unless PROGRAMS says otherwise

Programs: redis (redis-server loaded with REDIS_KEYS values of REDIS_VALUE
bytes, then REDIS_GETS random GETs from redis-benchmark: ops/s, p50, p99),
graph (PageRank with python3-igraph on a Barabasi graph of GRAPH_VERTICES,
seconds) and sort (numpy sorting SORT_MIB of float64 in place, seconds).

Reported per program and fraction: each set-up's result and its
performance relative to 100% (ops/s ratio, or 100%'s seconds over its
seconds: 1.00 is as fast as all in memory), the memory it took from the
node (zram's pool, zswap's pool, the netpager client's resident memory) and
from donors, the swap it held, and for netpager the mean size of the read
requests that reached the client (how much the kernel's swap readahead
gathers: vm.page-cluster). A combination that fails (OOM kill, timeout) is
a row saying so. Also the disk's and a donor's QD1 4 KiB read latency,
measured in the same run. Knobs (environment): ROUNDS (1), FRACTIONS
("75 50"), SETUPS (all of the above), PROGRAMS ("redis graph sort"),
REDIS_KEYS (150000), REDIS_VALUE (1024), REDIS_GETS (60000),
GRAPH_VERTICES (400000), SORT_MIB (192), ZSWAP_POOL (1, percent of RAM),
PREFETCH_PAGES (32), TIMEOUT (600 s per run), RUNTIME (5 s per latency run),
COMPRESS (unset: the donors at pager-server's default compress=).

COMPRESS="off lz4" (off|lz4|zstd) runs each netpager set-up (none, parity,
parity+pf, zswap+parity) once per setting, alternating, its 3 donors
started with that compress=, named SETUP@SETTING (parity@off, parity@lz4)
in the tables and the JSON; the other set-ups run once as before. Beside
each, the donors' memory by their own status, sampled every 0.2 s while
the program runs (its peak: used_bytes, the bytes held, against
logical_bytes, the bytes written), and per program and fraction a line
with each setting against the first: the time ratio (for redis, of its
GETs per second inverted; target lz4 / off <= 1.05x) and the ratio of the
donors' memory at peak. (The JSON has the donors' own figures, at peak
and at the job's end, for every netpager run: `donor_held`.)

Writes OUTDIR/apps.txt, apps.md, apps.json and apps-PROGRAM.png (--out,
with REGIME other than loopback apps-REGIME.txt and so on;
default bench-results/apps). Run as root; every swap area, zram device,
zswap setting, cgroup, donor and client it sets up is undone on every exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from .attach import Swap, swaps
from .bench import (DonorMemory, Report, arg_parser, compress_settings, die, disk_workdir, drop_cached, env_int,
                    env_str, fio_json, fmt_row, held_cell, ratio, require)
from .bench_client import Bench as ClientBench
from .bench_client import Knobs as ClientKnobs
from .bench_client import mode_args
from .bench_swap import SwapTargets
from .client import PagerClient
from .cgroup import MemoryCgroup
from .cleanup import Teardown, install_handlers
from .paths import pagerctl, server_plugin
from .disks import emulated_disk
from .lab_links import LINKS, LabLinks
from .procs import OwnedProcess

PROG = "bench-apps"
JOBS = Path(__file__).with_name("apps_jobs.py")
SETUPS = ["none", "parity", "parity+pf", "file", "zram", "zswap+parity", "zswap+file"]
# The set-ups with netpager donors behind them (zswap+parity too).
NETPAGER = ["none", "parity", "parity+pf"]
# REGIME: the set-ups each compares by default.
REGIMES = {"loopback": SETUPS, "disk": ["none", "parity", "file", "disk-path"],
           "ssd": ["none", "parity", "ssd"], "hdd": ["none", "parity", "hdd"],
           "shared": ["none", "parity", "file"],
           "lab": ["none", "none/10g", "parity/10g", "none/1g", "parity/1g", "file"]}
DISK_SETUPS = ["disk-path", "ssd", "hdd"]
LAB_SETUPS = [f"{m}/{link}" for link in LINKS for m in ("none", "parity")]
PROGRAMS = ["redis", "graph", "sort"]
# The programs a REGIME runs by default, where not all of them: only the
# sort reads an input from the disk.
REGIME_PROGRAMS = {"shared": ["sort"]}
ZSWAP = Path("/sys/module/zswap/parameters")
# The unlimited (100%) run's cgroup limit: more than the machine has.
UNLIMITED = 1 << 50


@dataclass
class Knobs:
    rounds: int
    regime: str
    fractions: list[int]
    setups: list[str]
    programs: list[str]
    redis_keys: int
    redis_value: int
    redis_gets: int
    graph_vertices: int
    sort_mib: int
    zswap_pool: int
    prefetch_pages: int
    timeout: int
    runtime: int
    compress: list[str]

    @classmethod
    def from_env(cls) -> "Knobs":
        regime = env_str("REGIME", "loopback")
        if regime not in REGIMES:
            die(PROG, f"unknown REGIME {regime} ({', '.join(REGIMES)})")
        k = cls(rounds=env_int(PROG, "ROUNDS", 1), regime=regime,
                fractions=[int(f) for f in env_str("FRACTIONS", "75 50").split()],
                setups=env_str("SETUPS", " ".join(REGIMES[regime])).split(),
                programs=env_str("PROGRAMS", " ".join(REGIME_PROGRAMS.get(regime, PROGRAMS))).split(),
                redis_keys=env_int(PROG, "REDIS_KEYS", 150000),
                redis_value=env_int(PROG, "REDIS_VALUE", 1024),
                redis_gets=env_int(PROG, "REDIS_GETS", 60000),
                graph_vertices=env_int(PROG, "GRAPH_VERTICES", 400000),
                sort_mib=env_int(PROG, "SORT_MIB", 192),
                zswap_pool=env_int(PROG, "ZSWAP_POOL", 1),
                prefetch_pages=env_int(PROG, "PREFETCH_PAGES", 32),
                timeout=env_int(PROG, "TIMEOUT", 600),
                runtime=env_int(PROG, "RUNTIME", 5),
                compress=compress_settings(PROG))
        for s in k.setups:
            if s not in SETUPS + DISK_SETUPS + LAB_SETUPS:
                die(PROG, f"unknown set-up {s} in SETUPS ({', '.join(SETUPS + DISK_SETUPS + LAB_SETUPS)})")
        for p in k.programs:
            if p not in PROGRAMS:
                die(PROG, f"unknown program {p} in PROGRAMS ({', '.join(PROGRAMS)})")
        for f in k.fractions:
            if not 0 < f < 100:
                die(PROG, f"FRACTIONS: {f} is not a percentage between 0 and 100")
        return k


def setup_names(k: Knobs) -> list[str]:
    """SETUPS as run and reported: with COMPRESS, each netpager set-up once
    per setting, side by side (parity@off, parity@lz4)."""
    names = []
    for s in k.setups:
        netpager = s.removeprefix("zswap+").partition("/")[0] in NETPAGER
        names += [f"{s}@{c}" for c in k.compress] if netpager and k.compress else [s]
    return names


def job_argv(k: Knobs, program: str, out: Path) -> list[str]:
    size = {"redis": [k.redis_keys, k.redis_value, k.redis_gets],
            "graph": [k.graph_vertices], "sort": [k.sort_mib]}[program]
    src = input_file(k, out.parent, program)
    return ["/usr/bin/python3", str(JOBS), program, *map(str, size), str(out), *([str(src)] if src else [])]


def input_file(k: Knobs, work: Path, program: str) -> Path | None:
    """The file `program` reads its input from (REGIME shared's sort), if any."""
    return work / "sort-input.f64" if k.regime == "shared" and program == "sort" else None


def write_input(td: Teardown, k: Knobs, work: Path) -> None:
    """REGIME shared: the sort's input, written once on the work directory's disk."""
    src = input_file(k, work, "sort")
    if src is None or "sort" not in k.programs:
        return
    td.add(f"file {src}", lambda: src.unlink(missing_ok=True))
    subprocess.run(["/usr/bin/python3", str(JOBS), "sort-input", str(k.sort_mib), str(src)], check=True)
    with open(src, "rb") as f:
        os.fsync(f.fileno())


def higher_is_better(program: str) -> bool:
    return program == "redis"


def score(program: str, res: dict, seconds: float) -> float:
    """The program's result: GET ops/s for redis, else the job's seconds."""
    return res["ops"] if higher_is_better(program) else seconds


def relative(program: str, value: float, full: float) -> float:
    """Performance against 100%: 1.0 is as fast as all in memory."""
    return value / full if higher_is_better(program) else full / value


def meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


class Zswap:
    """zswap on with its pool capped; every parameter put back on teardown."""

    def __init__(self, td: Teardown, pool_percent: int):
        for name, value in (("max_pool_percent", str(pool_percent)), ("enabled", "Y")):
            f = ZSWAP / name
            was = f.read_text().strip()
            td.add(f"{f} back to {was}", lambda f=f, was=was: f.write_text(was))
            f.write_text(value)


class Setups:
    """Each method sets up a swap set-up under `td` and returns what the
    sampler watches: the swap device, and where node memory goes."""

    def __init__(self, cb: ClientBench, k: Knobs, top: Teardown):
        self.t = SwapTargets(cb)
        self.cb = cb
        self.k = k
        self.lab = LabLinks(top, cb.work)

    def make(self, td: Teardown, setup: str) -> dict:
        setup, _, compress = setup.partition("@")
        front, _, back = setup.rpartition("+") if setup.startswith("zswap+") else ("", "", setup)
        if front:
            Zswap(td, self.k.zswap_pool)
        back, _, link = back.partition("/")
        if back in ("none", "parity", "parity+pf"):
            mode = back.split("+")[0]
            pf = self.k.prefetch_pages if back.endswith("+pf") else 0
            donors = (self.lab.donors(td, 3, link, "swap", compress=compress or None) if link else
                      self.cb.donors(td, 3, None, "swap", compress=compress or None))
            state = self.cb.work / "client"
            shutil.rmtree(state, ignore_errors=True)
            client = PagerClient(td, state, client_id="apps")
            extra = mode_args(mode, state / "unused", 3) + ["--prefetch-pages", str(pf)]
            client.attach(donors, mode=mode, size="1G", swap=True, extra=extra,
                          frontend="fuse-uring")
            return {"device": client.device, "client": client, "donors": donors}
        if back == "file":
            return {"device": self.t.file(td)}
        if back in DISK_SETUPS:
            dev = emulated_disk(td, self.cb.work, back)
            Swap(td, dev, priority=32767)
            return {"device": dev}
        if back == "zram":
            dev = self.t.zram(td)
            return {"device": dev, "zram": Path("/sys/block") / Path(dev).name / "mm_stat"}
        raise ValueError(setup)


class Sampler(threading.Thread):
    """Peaks of node memory the set-up takes and of swap used, while a job runs."""

    def __init__(self, cg: MemoryCgroup, watch: dict):
        super().__init__(daemon=True)
        self.cg, self.watch = cg, watch
        self.stop_event = threading.Event()
        self.peak = {"memory": 0, "swap": 0, "node": 0, "donors": 0}
        client = watch.get("client")
        self.client_pid = client.server_pid() if client else None
        # The device rewrites it every second or so.
        self.status_file = client.state_dir / "status.json" if client else None

    def sample(self) -> None:
        node = meminfo_kib("Zswap") * 1024
        if "zram" in self.watch:
            # mm_stat: orig_data_size compr_data_size mem_used_total ...
            node += int(self.watch["zram"].read_text().split()[2])
        if self.client_pid:
            node += rss_bytes(self.client_pid)
        dev = self.watch.get("device")
        used = swaps().get(dev, 0) if dev else 0
        donors = 0
        if self.status_file:
            try:
                donors = sum(d["used_bytes"] for d in json.loads(self.status_file.read_text())["donors"])
            except (FileNotFoundError, ValueError, KeyError):
                pass  # being rewritten: the next sample reads it
        for key, v in (("memory", self.cg.memory_bytes()), ("swap", used), ("node", node),
                       ("donors", donors)):
            self.peak[key] = max(self.peak[key], v)

    def run(self) -> None:
        while not self.stop_event.wait(0.2):
            self.sample()


def run_program(td: Teardown, k: Knobs, work: Path, program: str, limit: int, watch: dict) -> dict:
    """One run of `program` in a fresh cgroup limited to `limit`: its
    result, or how it failed."""
    out = work / f"{program}.json"
    out.unlink(missing_ok=True)
    log = work / f"{program}.log"
    log.unlink(missing_ok=True)
    with Teardown(f"{program} job") as jt:
        cg = MemoryCgroup(jt, limit)
        src = input_file(k, work, program)
        if src:
            drop_cached(src)  # the job reads it from the disk
        wrapper = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.procs_file)]
        client = watch.get("client")
        before = client.status()["status"]["requests"] if client else None
        sampler = Sampler(cg, watch)
        # What the donors hold by their own status, sampled beside.
        meter = DonorMemory(watch["donors"], interval=0.2) if "donors" in watch else None
        t0 = time.monotonic()
        proc = OwnedProcess(wrapper + job_argv(k, program, out), log, jt, f"job {program}")
        sampler.start()
        with meter or nullcontext():
            rc = proc.wait(k.timeout)
        seconds = time.monotonic() - t0
        if rc is None:
            proc.kill9()
        sampler.stop_event.set()
        sampler.join()
        sampler.sample()
        r = {"seconds": round(seconds, 2), "returncode": rc, "oom_kills": cg.oom_kills(),
             "peak_bytes": max(sampler.peak["memory"], cg.peak_memory_bytes() or 0),
             "swap_bytes": sampler.peak["swap"], "node_bytes": sampler.peak["node"]}
        if rc == 0:
            r["result"] = json.loads(out.read_text())
        else:
            r["failed"] = ("timed out" if rc is None else
                           "OOM-killed" if r["oom_kills"] else f"exit {rc}")
            r["log"] = log.read_text()[-1500:]
        if meter:
            r["donor_held"] = meter.summary()
        if client:
            st = client.status()["status"]
            r["donor_bytes"] = max(sampler.peak["donors"], sum(d["used_bytes"] for d in st["donors"]))
            reads = next(x for x in st["requests"] if x["op"] == "read")
            was = next(x for x in before if x["op"] == "read")
            n = reads["count"] - was["count"]
            r["reads"] = n
            r["read_kib"] = round((reads["bytes"] - was["bytes"]) / n / 1024, 1) if n else 0.0
            t = st["totals"]
            if t.get("prefetch_pages"):
                r["prefetch"] = {k: t[f"prefetch_{k}"] for k in ("issued", "hits", "wasted")}
        jt.close_or_raise()
    return r


def qd1_latency(cb: ClientBench, td: Teardown, k: Knobs) -> dict:
    """QD1 4 KiB random-read latency (us) of this machine's disk (a file in
    the work directory, O_DIRECT) and of one donor over loopback (fio's nbd
    engine), as the swap-ins see them."""
    f = cb.work / "latency.img"
    fio_json(["--name=fill", f"--filename={f}", "--rw=write", "--bs=1M", "--size=64M",
              "--direct=1"], cb.work)
    td.add(f"file {f}", lambda: f.unlink(missing_ok=True))
    disk = cb.fio_lat(f"--filename={f}", "randread", "--ioengine=psync", "--direct=1")
    f.unlink()
    donor = cb.donors(td, 1, None, "latency")[0]
    uri = f"--uri=nbd://{donor.addr}:{donor.port}/lat@256M"
    fio_json(["--name=fill", "--ioengine=nbd", uri, "--rw=write", "--bs=1M", "--size=64M"], cb.work)
    remote = cb.fio_lat(uri, "randread", "--ioengine=nbd")
    return {"disk_us": disk, "donor_us": remote}


def kernel_readahead() -> dict:
    """The kernel's swap readahead settings in force."""
    vma = Path("/sys/kernel/mm/swap/vma_ra_enabled")
    return {"page_cluster": int(Path("/proc/sys/vm/page-cluster").read_text()),
            "vma_ra_enabled": vma.read_text().strip() if vma.exists() else None}


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}"


def donor_peak(r: dict) -> int:
    """The donors' memory at peak, by their own status (DonorMemory); 0
    for a set-up without donors."""
    return r["donor_held"]["peak"]["stored"] if "donor_held" in r else 0


def result_cell(program: str, r: dict) -> str:
    if "failed" in r:
        return r["failed"]
    if program == "redis":
        res = r["result"]
        return f"{res['ops']:.0f} ops/s p50 {res['p50_ms']} p99 {res['p99_ms']} ms"
    return f"{r['seconds']:.1f} s"


def tables(k: Knobs, lat: dict, ra: dict, runs: dict) -> tuple[list[str], list[str], dict, dict]:
    """The text table, the Markdown table, the summary and, with COMPRESS,
    the settings side by side (compress_lines), from every run."""
    text, md, summary, compared = [], [], {}, {}
    text.append(f"QD1 4 KiB random read: local disk {lat['disk_us']} us, donor over loopback "
                f"{lat['donor_us']} us; vm.page-cluster {ra['page_cluster']}, "
                f"VMA readahead {ra['vma_ra_enabled']}")
    md += [f"QD1 4 KiB random read: local disk **{lat['disk_us']} us**, donor over loopback "
           f"**{lat['donor_us']} us**; vm.page-cluster {ra['page_cluster']}, VMA readahead "
           f"{ra['vma_ra_enabled']}.", ""]
    w = [max([14, *map(len, setup_names(k))]), 8, 40, 8, 8, 8, 8, 8]
    head = ["set-up", "local", "result (best round)", "vs 100%", "swap", "node", "donors", "read KiB"]
    for program in k.programs:
        full = runs[program]["100"]["full"]
        ok = [r for r in full if "failed" not in r]
        summary[program] = {}
        text.append("")
        text.append(f"== {program}: peak {mib(runs[program]['peak'])} MiB "
                    f"({'ops/s, higher is better' if higher_is_better(program) else 'seconds'})")
        text.append(fmt_row(w, head, first_left=3))
        text.append(fmt_row(w, ["", "", "", "", "MiB", "MiB", "MiB", "mean"], first_left=3))
        md += [f"### {program} (peak {mib(runs[program]['peak'])} MiB)", "",
               "| set-up | local | result | vs 100% | swap MiB | node MiB | donors MiB | read KiB |",
               "|---|---|---|---|---|---|---|---|"]
        if not ok:
            text.append(f"(100% failed: {full[0].get('failed')})")
            md.append(f"| 100% failed: {full[0].get('failed')} |||||||")
            continue
        base = best(program, ok)
        cells = ["(no swap)", "100%", result_cell(program, base), "1.00", "0", "0", "0", "-"]
        text.append(fmt_row(w, cells, first_left=3))
        md.append("| " + " | ".join(cells) + " |")
        full_score = score(program, base["result"], base["seconds"])
        for frac in k.fractions:
            summary[program][str(frac)] = {}
            for setup in setup_names(k):
                rs = runs[program][str(frac)][setup]
                good = [r for r in rs if "failed" not in r]
                if good:
                    r = best(program, good)
                    rel = relative(program, score(program, r["result"], r["seconds"]), full_score)
                    summary[program][str(frac)][setup] = round(rel, 3)
                    cells = [setup, f"{frac}%", result_cell(program, r), f"{rel:.2f}",
                             mib(r["swap_bytes"]), mib(r["node_bytes"]),
                             mib(donor_peak(r)), str(r.get("read_kib", "-"))]
                else:
                    summary[program][str(frac)][setup] = None
                    cells = [setup, f"{frac}%", f"FAILED: {rs[0]['failed']}", "-",
                             mib(rs[0]["swap_bytes"]), mib(rs[0]["node_bytes"]),
                             mib(donor_peak(rs[0])), "-"]
                text.append(fmt_row(w, cells, first_left=3))
                md.append("| " + " | ".join(cells) + " |")
        md.append("")
        if k.compress:
            lines, compared[program] = compress_lines(k, program, runs[program])
            text += [f"   {line}" for line in lines]
            md += [f"- {line}" for line in lines] + [""]
    text.append("")
    text.append("(vs 100%: performance against the program all in memory, 1.00 = as fast; "
                "node: memory the set-up took from this machine (zram or zswap pool, the "
                "netpager client's resident memory); donors: donor memory used at peak (the "
                "donors' used bytes by their status); read KiB: mean read request reaching the "
                "netpager client)")
    md.append(text[-1])
    return text, md, summary, compared


def compress_lines(k: Knobs, program: str, runs: dict) -> tuple[list[str], dict]:
    """Per fraction and netpager set-up, each COMPRESS setting against the
    first (best rounds): the time ratio (the inverse of performance: for
    redis, of GETs per second) and what the donors held at peak, by their
    status (bytes held / bytes written). The lines, and the numbers."""
    first, lines, out = k.compress[0], [], {}
    for frac in k.fractions:
        out[str(frac)] = {}
        for setup in k.setups:
            if setup.removeprefix("zswap+") not in NETPAGER:
                continue
            got = {}
            for c in k.compress:
                good = [r for r in runs[str(frac)][f"{setup}@{c}"] if "failed" not in r]
                if good:
                    r = best(program, good)
                    got[c] = {"score": score(program, r["result"], r["seconds"]), "peak": r["donor_held"]["peak"]}
            if first not in got:
                continue
            cells = []
            for c in k.compress[1:]:
                if c not in got:
                    cells.append(f"{c} failed")
                    continue
                a, b = got[c], got[first]
                # Time: seconds, or 1/ops for redis.
                t = a["score"] / b["score"] if not higher_is_better(program) else b["score"] / a["score"]
                a["time_ratio"] = round(t, 3)
                a["memory_ratio"] = round(a["peak"]["stored"] / b["peak"]["stored"], 3) if b["peak"]["stored"] else None
                cells.append(f"{c} / {first}: time {t:.2f}x (target <= 1.05x), donor memory at peak "
                             f"{ratio(a['peak']['stored'], b['peak']['stored'])}")
            held = ", ".join(f"{c} {held_cell(g['peak'])}" for c, g in got.items())
            lines.append(f"{setup} at {frac}%: {'; '.join(cells)} (donors held/written at peak: {held})")
            out[str(frac)][setup] = got
    return lines, out


def best(program: str, rs: list[dict]) -> dict:
    """The best round: noise on a shared machine only ever slows a run down."""
    if higher_is_better(program):
        return max(rs, key=lambda r: r["result"]["ops"])
    return min(rs, key=lambda r: r["seconds"])


def plot(outdir: Path, k: Knobs, summary: dict, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for program in k.programs:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [100] + k.fractions
        for setup in setup_names(k):
            ys = [1.0] + [summary[program].get(str(f), {}).get(setup) for f in k.fractions]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=setup)
        ax.set_xlabel("local memory, % of peak")
        ax.set_ylabel("performance vs 100%")
        ax.set_title(f"{program}" + ("" if k.regime == "loopback" else f", {k.regime}"))
        ax.invert_xaxis()
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = outdir / f"{name}-{program}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def check_programs(k: Knobs) -> None:
    need = {"redis": ["redis-server", "redis-cli", "redis-benchmark"]}
    for p in k.programs:
        for tool in need.get(p, []):
            if shutil.which(tool) is None:
                die(PROG, f"{tool} not installed (make deps: redis-server, redis-tools)")
        module = {"graph": "igraph", "sort": "numpy"}.get(p)
        if module and subprocess.run(["/usr/bin/python3", "-c", f"import {module}"],
                                     capture_output=True).returncode != 0:
            die(PROG, f"python3 module {module} missing (make deps: python3-{module})")


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__, "apps", "apps.txt, apps.md, apps.json and the plots")
    args = ap.parse_args(argv)
    k = Knobs.from_env()
    require(PROG, ["nbdkit", "fio", "losetup", "mkswap", "swapon", "zramctl", "findmnt"],
            [pagerctl(), server_plugin()], root=True)
    check_programs(k)
    if any(s.startswith("zswap") for s in k.setups) and not (ZSWAP / "enabled").exists():
        die(PROG, "this kernel has no zswap (/sys/module/zswap); drop the zswap set-ups from SETUPS")
    if swaps():
        # Ours go on at the highest priority, so the kernel fills them first.
        print(f"{PROG}: note: swap already on ({', '.join(swaps())})", file=sys.stderr)
    install_handlers()
    name = "apps" if k.regime == "loopback" else f"apps-{k.regime}"
    report = Report(name, asdict(k))
    with Teardown(PROG) as top:
        work = disk_workdir(top, "np-apps-")
        print(f"work directory {work} (on a real disk)", file=sys.stderr, flush=True)
        ck = ClientKnobs(runtime=k.runtime, ramp=1, fio_rounds=1, rounds=1, limit="0",
                         link_rate="1G", fio_size="64M", swap_modes=[], swap_settings=[],
                         modes=[], frontends=[], restarts=0, restart_every=0)
        cb = ClientBench("apps", ck, work)
        write_input(top, k, cb.work)
        with Teardown("latency") as td:
            lat = qd1_latency(cb, td, k)
            td.close_or_raise()
        ra = kernel_readahead()
        setups = Setups(cb, k, top)
        runs: dict = {p: {"100": {"full": []}, "peak": 0,
                          **{str(f): {s: [] for s in setup_names(k)} for f in k.fractions}}
                      for p in k.programs}
        for rnd in range(1, k.rounds + 1):
            for program in k.programs:
                with Teardown(f"{program} 100%") as td:
                    r = run_program(td, k, cb.work, program, UNLIMITED, {})
                    td.close_or_raise()
                runs[program]["100"]["full"].append(r)
                runs[program]["peak"] = max(runs[program]["peak"], r["peak_bytes"])
                print(f"round {rnd}: {program} 100%: {result_cell(program, r)}, peak "
                      f"{mib(r['peak_bytes'])} MiB", file=sys.stderr, flush=True)
                if "failed" in r:
                    die(PROG, f"{program} failed with all its memory: {r['failed']}\n{r['log']}")
                peak = runs[program]["peak"]
                for frac in k.fractions:
                    limit = peak * frac // 100
                    for setup in setup_names(k):
                        with Teardown(f"{program} {frac}% {setup}") as td:
                            watch = setups.make(td, setup)
                            r = run_program(td, k, cb.work, program, limit, watch)
                            td.close_or_raise()
                        r["limit_bytes"] = limit
                        runs[program][str(frac)][setup].append(r)
                        print(f"round {rnd}: {program} {frac}% {setup}: {result_cell(program, r)}, "
                              f"swap {mib(r['swap_bytes'])} MiB", file=sys.stderr, flush=True)
        top.close_or_raise()
    text, md, summary, compared = tables(k, lat, ra, runs)
    for line in text:
        report.line(line)
    report.results = {"latency_us": lat, "readahead": ra, "relative": summary, "runs": runs,
                      **({"compress": compared} if k.compress else {})}
    report.write(args.out)
    (args.out / f"{name}.md").write_text("\n".join(md) + "\n")
    for p in plot(args.out, k, summary, name):
        print(f"({p})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
