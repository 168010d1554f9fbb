"""Compression on the pages real programs swap (`make bench-compress`): what
a donor holds for them under each `compress=`, beside zram on the same pages.

For each program of `make bench-apps` (apps_jobs.py, at bench-apps' sizes):

 1. a run with all its memory (no swap) measures its peak;
 2. a run in a memory cgroup limited to FRACTION % of that peak, swapping
    to a fresh zram device (ZRAM_ALGORITHM; the kernel's default lzo-rle)
    at the top priority, under the machine's swap lock. When zram holds
    FREEZE % of what the job should swap at its peak (peak - limit), every
    process of the job is stopped (SIGSTOP), zram's writes are let settle,
    and then, with mm_stat read before and after (it must not move):
    zram's `mm_stat` and the pages themselves, read from the zram device
    (O_RDONLY|O_DIRECT, no O_EXCL: it stays swap) into a dump. The job is
    then continued and must finish and check its own answer. A job that
    ends before zram held that much runs once more, stopped at FREEZE % of
    the most zram held in the first run;
 3. the dump through pager-server's real store
    (`examples/compress-replay`: Pool and Export writes as a donor's, every
    page read back and compared) with compress=off, lz4 and zstd, ROUNDS
    rounds alternating, each keeping its least CPU.

What is in a dump: every page zram held for the job. The swap header
(page 0) is left out. Slots never written and slots the kernel freed read
as zeros, and so do zero pages the job did write, which zram keeps as
nothing and counts in `same_pages`: the dump holds the non-zero pages in
slot order, then as many zero pages as zram stored beyond them (its
`orig_data_size` in pages, less the header and the non-zero pages),
written as a hole (the file is sparse). The recorder checks that count
against zram's own: same_pages less the non-zero same-filled pages read.
Both sides' ratios are then bytes as swapped, zero pages included, over
bytes held: zram's orig_data_size / mem_used_total (its pool, all
overhead; the header's one page is in zram's figures), the store's
dump bytes / stored bytes (slab pages held, raw or in zspages: its
budget's use) and / mapped bytes (slabs mapped, spare included: what the
node gives up).

Writes OUTDIR/compress.txt and compress.json (--out, default
bench-results/compress). The dumps go to a work directory on a real disk
(/tmp first), deleted at the end unless KEEP=1 (then their place is
printed); `--dumps DIR` replays dumps kept earlier (DIR/PROGRAM.pages and
PROGRAM.json) without recording: no root, no swap. Knobs (environment):
PROGRAMS ("redis graph sort"), FRACTION (50), FREEZE (80), ZRAM_ALGORITHM
(lzo-rle), ROUNDS (3, of the replay), BATCH (16 pages a request), KEEP
(0), TIMEOUT (600 s a run), LOCK_WAIT (3600 s for the swap lock, taken
once the peaks are measured and held over the recordings), and
bench-apps' program sizes: REDIS_KEYS, REDIS_VALUE, REDIS_GETS,
GRAPH_VERTICES, SORT_MIB. Run as root; the zram device (reset, the
machine's zram devices left as they were), the swap area and the cgroups
are undone on every exit.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import bench_apps
from .attach import Swap, run, swaps
from .bench import Report, arg_parser, die, disk_workdir, env_int, env_str, fmt_row, require
from .cgroup import MemoryCgroup
from .cleanup import Teardown, install_handlers
from .machine import SWAP
from .paths import target_dir
from .procs import OwnedProcess, wait_for

PROG = "bench-compress"
PAGE = 4096
CODECS = ["off", "lz4", "zstd"]
# The recompressor's codecs, each replayed over lz4's pages.
COLD = ["zstd", "lz4hc"]
ZRAM_CONTROL = Path("/sys/class/zram-control")
# mm_stat's fields, in the kernel's order (Documentation/admin-guide/blockdev/zram.rst).
MM_STAT = ["orig_data_size", "compr_data_size", "mem_used_total", "mem_limit", "mem_used_max",
           "same_pages", "pages_compacted", "huge_pages"]
# Reads of the zram device: 1 MiB at a time.
CHUNK = 1 << 20


@dataclass
class Knobs:
    programs: list[str]
    fraction: int
    freeze: int
    zram_algorithm: str
    rounds: int
    batch: int
    keep: bool
    timeout: int
    lock_wait: int

    @classmethod
    def from_env(cls) -> "Knobs":
        k = cls(programs=env_str("PROGRAMS", " ".join(bench_apps.PROGRAMS)).split(),
                fraction=env_int(PROG, "FRACTION", 50), freeze=env_int(PROG, "FREEZE", 80),
                zram_algorithm=env_str("ZRAM_ALGORITHM", "lzo-rle"),
                rounds=env_int(PROG, "ROUNDS", 3), batch=env_int(PROG, "BATCH", 16),
                keep=env_str("KEEP", "0") == "1", timeout=env_int(PROG, "TIMEOUT", 600),
                lock_wait=env_int(PROG, "LOCK_WAIT", 3600))
        for p in k.programs:
            if p not in bench_apps.PROGRAMS:
                die(PROG, f"unknown program {p} in PROGRAMS ({', '.join(bench_apps.PROGRAMS)})")
        if not 0 < k.fraction < 100:
            die(PROG, f"FRACTION: {k.fraction} is not a percentage between 0 and 100")
        if not 0 < k.freeze <= 100:
            die(PROG, f"FREEZE: {k.freeze} is not a percentage between 1 and 100")
        if k.rounds < 1 or k.batch < 1:
            die(PROG, f"ROUNDS ({k.rounds}) and BATCH ({k.batch}) must be at least 1")
        return k


def replayer() -> Path:
    return target_dir() / "examples" / "compress-replay"


def mm_stat(dev: str) -> dict[str, int]:
    fields = (Path("/sys/block") / Path(dev).name / "mm_stat").read_text().split()
    return dict(zip(MM_STAT, map(int, fields)))


def zram_device(td: Teardown, size: int, algorithm: str) -> str:
    """A free zram device of `size` bytes compressing with `algorithm`
    (zramctl --find adds one when none is free), reset on teardown, and
    the machine's zram devices left as they were: zramctl --reset also
    removes the device, so one that was there before is added back."""
    before = {p.name for p in Path("/sys/block").glob("zram*")}
    dev = run(["zramctl", "--find", "--size", str(size), "--algorithm", algorithm]).strip()
    name = Path(dev).name

    def undo() -> None:
        run(["zramctl", "--reset", dev])
        there = (Path("/sys/block") / name).exists()
        if name in before and not there:
            (ZRAM_CONTROL / "hot_add").read_text()
        elif name not in before and there:
            (ZRAM_CONTROL / "hot_remove").write_text(name.removeprefix("zram"))

    td.add(f"zram {dev}", undo)
    return dev


def stopped_or_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "TtZX"


def stop_job(cg: MemoryCgroup) -> list[int]:
    """SIGSTOP to every process of the job's cgroup (only the job and its
    children are in it: a fresh cgroup of ours), again until no new one
    appears, then waits until all are stopped; the pids stopped."""
    stopped: list[int] = []
    while True:
        new = [p for p in cg.pids() if p not in stopped]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            stopped.append(pid)
    wait_for(lambda: all(stopped_or_gone(p) for p in stopped), 60, "the job's processes to stop")
    return stopped


def continue_job(cg: MemoryCgroup, pids: list[int]) -> None:
    alive = set(cg.pids())
    for pid in pids:
        if pid in alive:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def settled(dev: str, timeout: float = 60.0) -> dict[str, int]:
    """mm_stat once zram's writes in flight are done (two reads 0.5 s
    apart agree): the job is stopped, so nothing new comes."""
    last = mm_stat(dev)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = mm_stat(dev)
        if now == last:
            return now
        last = now
    raise RuntimeError(f"{dev}: mm_stat still moving {timeout:.0f} s after the job stopped")


def dump_device(dev: str, out: Path) -> dict:
    """The pages of swap device `dev` past its header into `out` (see the
    module's documentation): counts of what was read."""
    nonzero = same_nonzero = 0
    header_stored = False
    zero = bytes(PAGE)
    size = int((Path("/sys/block") / Path(dev).name / "size").read_text()) * 512
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT wants
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    try:
        with open(out, "wb") as f:
            for at in range(0, size, CHUNK):
                n = os.preadv(fd, [buf], at)
                if n <= 0:
                    raise RuntimeError(f"{dev}: read at {at} gave {n} of {size} bytes")
                view = memoryview(buf[:n])  # a copy: the mmap closes with no view on it
                for off in range(0, n - n % PAGE, PAGE):
                    page = view[off:off + PAGE]
                    if page == zero:
                        continue
                    if at + off == 0:
                        header_stored = True  # the swap header: zram holds it, the job did not
                        continue
                    nonzero += 1
                    if page == page[:8].tobytes() * (PAGE // 8):
                        same_nonzero += 1
                    f.write(page)
    finally:
        os.close(fd)
        buf.close()
    return {"device_bytes": size, "nonzero_pages": nonzero, "same_nonzero_pages": same_nonzero,
            "header_stored": header_stored}


def record(k: Knobs, ak: bench_apps.Knobs, work: Path, program: str, peak: int,
           limit: int, freeze_pages: int, out: Path) -> dict:
    """One run of `program` at `limit` swapping to zram, stopped once zram
    holds `freeze_pages` pages; the dump in `out` and what was seen, or
    {"reached": False, "max_pages": ...} when the job ended first."""
    result_file = work / f"{program}.json"
    result_file.unlink(missing_ok=True)
    log = work / f"{program}.log"
    with Teardown(f"{program} on zram") as td:
        if others := list(swaps()):
            print(f"{PROG}: note: swap already on ({', '.join(others)}): zram gets the job's "
                  f"pages first, at the top priority", file=sys.stderr)
        # Room for all of it: a full zram would send pages elsewhere.
        size = (peak + (64 << 20) + (1 << 20) - 1) // (1 << 20) * (1 << 20)
        dev = zram_device(td, size, k.zram_algorithm)
        Swap(td, dev, priority=32767)
        base = mm_stat(dev)["orig_data_size"] // PAGE  # the header
        with Teardown(f"{program} job") as jt:
            cg = MemoryCgroup(jt, limit)
            wrapper = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.procs_file)]
            proc = OwnedProcess(wrapper + bench_apps.job_argv(ak, program, result_file), log, jt,
                                f"job {program}")
            t0 = time.monotonic()
            most = 0
            rc = None
            while True:
                rc = proc.wait(0.1)
                held = mm_stat(dev)["orig_data_size"] // PAGE - base
                most = max(most, held)
                if rc is not None or held >= freeze_pages:
                    break
                if time.monotonic() - t0 > k.timeout:
                    proc.kill9()
                    raise RuntimeError(f"{program}: no exit within {k.timeout} s (log {log})")
            if rc is not None:
                return {"reached": False, "max_pages": most, "returncode": rc}
            stopped_at = round(time.monotonic() - t0, 1)
            pids = stop_job(cg)
            before = settled(dev)
            seen = dump_device(dev, out)
            after = mm_stat(dev)
            if after != before:
                raise RuntimeError(f"{dev}: mm_stat moved while the job was stopped: "
                                   f"{before} then {after}")
            memory = cg.memory_bytes()
            continue_job(cg, pids)
            rc = proc.wait(k.timeout)
            if rc is None:
                proc.kill9()
            jt.close_or_raise()
        td.close_or_raise()
    stored = before["orig_data_size"] // PAGE - int(seen["header_stored"])
    zero = stored - seen["nonzero_pages"]
    zero_same = before["same_pages"] - seen["same_nonzero_pages"]
    if zero != zero_same:
        raise RuntimeError(f"{program}: zram holds {stored} pages beyond the header and "
                           f"{seen['nonzero_pages']} non-zero ones read: {zero} zero pages; its "
                           f"same_pages says {zero_same} ({before}, {seen})")
    with open(out, "r+b") as f:
        f.truncate((seen["nonzero_pages"] + zero) * PAGE)  # the zero pages: a hole
    return {"reached": True, "stopped_after_s": stopped_at, "limit_bytes": limit,
            "peak_bytes": peak, "cgroup_bytes_at_stop": memory, "zram_algorithm": k.zram_algorithm,
            "mm_stat": before, "pages": stored, "zero_pages": zero, **seen,
            "returncode": rc, "job": (json.loads(result_file.read_text()) if rc == 0 else None),
            "job_log": None if rc == 0 else log.read_text()[-1500:]}


def peak(ak: bench_apps.Knobs, work: Path, program: str) -> dict:
    """The program's run with all its memory (no swap): its peak."""
    with Teardown(f"{program} 100%") as td:
        full = bench_apps.run_program(td, ak, work, program, bench_apps.UNLIMITED, {})
        td.close_or_raise()
    if "failed" in full:
        die(PROG, f"{program} failed with all its memory: {full['failed']}\n{full['log']}")
    print(f"{program}: peak {full['peak_bytes'] >> 20} MiB in {full['seconds']} s with all its "
          f"memory", file=sys.stderr, flush=True)
    return full


def record_program(k: Knobs, ak: bench_apps.Knobs, work: Path, program: str, full: dict,
                   out: Path) -> dict:
    """The recording at FRACTION % of the peak (once more, at the most
    zram held, when the job ended before FREEZE % of its expected swap)."""
    peak = full["peak_bytes"]
    limit = peak * k.fraction // 100
    freeze = max(1, (peak - limit) // PAGE * k.freeze // 100)
    print(f"{program}: at {limit >> 20} MiB, stopping it when zram holds {freeze * PAGE >> 20} MiB",
          file=sys.stderr, flush=True)
    r = record(k, ak, work, program, peak, limit, freeze, out)
    if not r["reached"]:
        again = max(1, r["max_pages"] * k.freeze // 100)
        print(f"{program}: ended (exit {r['returncode']}) with zram at most "
              f"{r['max_pages'] * PAGE >> 20} MiB; once more, stopping it at {again * PAGE >> 20} MiB",
              file=sys.stderr, flush=True)
        r = record(k, ak, work, program, peak, limit, again, out)
        if not r["reached"]:
            die(PROG, f"{program}: zram never held {again} pages in the second run either "
                      f"(at most {r['max_pages']})")
    r["full_seconds"] = full["seconds"]
    return r


def replay(k: Knobs, dump: Path) -> dict:
    argv = [replayer(), dump, "--rounds", str(k.rounds), "--batch", str(k.batch), "--json"]
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({p.returncode}): {p.stderr.strip()}")
    return json.loads(p.stdout)


def cell(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def zram_ratio(rec: dict) -> float | None:
    m = rec["mm_stat"]
    return m["orig_data_size"] / m["mem_used_total"] if m["mem_used_total"] else None


def tables(k: Knobs, rows: dict) -> list[str]:
    """The table of ratios and the table of CPU costs, with their notes."""
    alg = {r["record"].get("zram_algorithm", "?") for r in rows.values()}
    text = [f"== Bytes swapped / bytes held (zero pages included; zram {', '.join(sorted(alg))}; "
            f"store: stored, and mapped in brackets)"]
    cold_heads = [f"->{c}" for c in COLD]
    w = [8, 9, 7, 8] + [15] * (len(CODECS) + len(COLD)) + [11] * (2 + len(COLD))
    text.append(fmt_row(w, ["program", "pages", "zero", "zram", *CODECS, *cold_heads,
                            "lz4/zram", "zstd/zram", *(f"{h}/zram" for h in cold_heads)]))
    for program, r in rows.items():
        rec, rep = r["record"], r["replay"]
        zr = zram_ratio(rec)
        zram_bytes = rec["mm_stat"]["mem_used_total"]
        cells = [program, str(rep["pages"]), str(rep["zero_pages"]), cell(zr)]
        cold = [rep["codecs"]["lz4"]["cold"][c] for c in COLD]
        for x in [rep["codecs"][c] for c in CODECS] + cold:
            cells.append(f"{cell(x['ratio'])} ({cell(x['ratio_mapped'])})")
        for x in [rep["codecs"]["lz4"], rep["codecs"]["zstd"]] + cold:
            cells.append(cell(x["stored_bytes"] / zram_bytes if zram_bytes else None))
        text.append(fmt_row(w, cells))
    text.append("")
    text.append(f"== MB of pages per CPU-second (least of {k.rounds} rounds, {k.batch} pages a "
                f"request): through the store, write / read; the codec alone, compress / "
                f"decompress")
    w2 = [8] + [15] * (5 + len(COLD))
    text.append(fmt_row(w2, ["program", "off store", "lz4 store", "lz4 codec", "zstd store",
                             "zstd codec", *cold_heads]))

    def pair(x: dict, a: str, b: str) -> str:
        return f"{cell(x[a], '{:.0f}')} / {cell(x[b], '{:.0f}')}"

    for program, r in rows.items():
        cells = [program]
        for c in CODECS:
            x = r["replay"]["codecs"][c]
            cells.append(pair(x, "write_mb_per_cpu_s", "read_mb_per_cpu_s"))
            if c != "off":
                cells.append(pair(x, "compress_mb_per_cpu_s", "decompress_mb_per_cpu_s"))
        for c in COLD:
            cells.append(pair(r["replay"]["codecs"]["lz4"]["cold"][c], "recompress_mb_per_cpu_s",
                              "read_mb_per_cpu_s"))
        text.append(fmt_row(w2, cells))
    text.append("")
    text.append("(zram: orig_data_size / mem_used_total; off, lz4, zstd: pager-server's store, "
                "dump bytes / stored bytes (/ mapped bytes: slabs mapped, spare included); "
                "->zstd, ->lz4hc: lz4's pages once the recompressor (recompress=zstd, lz4hc) "
                "packed them again, its pass / the reads after it in the CPU table; "
                "lz4/zram, zstd/zram, ->zstd/zram, ->lz4hc/zram: the store's bytes held over "
                "zram's, the target "
                "at most 1.10; MB/s through the store count its fresh slabs' page faults, which "
                "on a VM whose balloon reports free memory cost a host fault and vary from run to "
                "run: the codec alone is its cost)")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__, "compress", "compress.txt and compress.json")
    ap.add_argument("--dumps", type=Path,
                    help="replay the dumps kept in this directory (KEEP=1) instead of recording")
    args = ap.parse_args(argv)
    k = Knobs.from_env()
    if not replayer().exists():
        die(PROG, f"{replayer()} not found (make build, or set NETPAGER_TARGET_DIR)")
    report = Report("compress", asdict(k))
    rows: dict = {}
    if args.dumps:
        for program in k.programs:
            meta = args.dumps / f"{program}.json"
            if not meta.exists():
                die(PROG, f"{meta} not found (PROGRAMS names the dumps to replay)")
            rows[program] = {"record": json.loads(meta.read_text()),
                             "replay": replay(k, args.dumps / f"{program}.pages")}
    else:
        # bench-apps' knobs for the programs' sizes (REDIS_KEYS and so on):
        # the same jobs as `make bench-apps` runs.
        ak = bench_apps.Knobs.from_env()
        require(PROG, ["mkswap", "swapon", "zramctl", "findmnt"], [], root=True)
        bench_apps.check_programs(ak)
        install_handlers()
        with Teardown(PROG) as top:
            work = disk_workdir(top, "np-compress-", keep=k.keep)
            print(f"work directory {work} (dumps{' kept' if k.keep else ''})", file=sys.stderr,
                  flush=True)
            fulls = {program: peak(ak, work, program) for program in k.programs}
            with Teardown("swap lock") as held:
                print(f"{PROG}: waiting up to {k.lock_wait} s for the swap lock "
                      f"({SWAP.path})", file=sys.stderr, flush=True)
                SWAP.acquire(timeout=k.lock_wait)
                held.add(f"release {SWAP.path}", SWAP.release)
                for program in k.programs:
                    rec = record_program(k, ak, work, program, fulls[program],
                                         work / f"{program}.pages")
                    (work / f"{program}.json").write_text(json.dumps(rec, indent=1) + "\n")
                    print(f"{program}: {rec['pages']} pages recorded ({rec['zero_pages']} zero), "
                          f"zram ratio {cell(zram_ratio(rec))}", file=sys.stderr, flush=True)
                held.close_or_raise()
            for program in k.programs:
                rows[program] = {"record": json.loads((work / f"{program}.json").read_text()),
                                 "replay": replay(k, work / f"{program}.pages")}
            top.close_or_raise()
    for line in tables(k, rows):
        report.line(line)
    report.results = rows
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
