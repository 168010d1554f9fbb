"""What the benchmarks (bench_client, bench_server) share: their knobs from
the environment, a work directory on a real disk, nbdkit and fio runs, what
a job's donors hold (`DonorMemory`), and the results they write (a table as
text and the numbers as JSON).

Results go to OUTDIR/NAME.txt (the table as printed) and OUTDIR/NAME.json:
{"bench": NAME, "knobs": {...}, "results": {...}, "table": [lines]}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .cleanup import Teardown
from .paths import repo_root
from .procs import OwnedProcess, tail, wait_for
from .status import StatusError

# File systems that live in memory: a write-through disk or a swap file on
# one measures RAM, not a disk (and swapon refuses tmpfs files).
MEMORY_FS = {"tmpfs", "ramfs"}


def die(prog: str, msg: str) -> None:
    raise SystemExit(f"{prog}: {msg}")


def arg_parser(prog: str, doc: str, results: str, what: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its module's docstring as --help, and
    --out (default bench-results/RESULTS), where `what` go."""
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=repo_root() / "bench-results" / results,
                    help=f"where {what} go")
    return ap


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(prog: str, name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        die(prog, f"{name}={text!r} is not a whole number")


# pager-server's compress= settings.
COMPRESS_SETTINGS = ("off", "lz4", "zstd")


def compress_settings(prog: str) -> list[str]:
    """COMPRESS: the donors' compress= settings to run side by side, the
    first the base of the ratios ("off lz4"); empty when unset (the
    plugin's default, as without the knob)."""
    settings = env_str("COMPRESS", "").split()
    for c in settings:
        if c not in COMPRESS_SETTINGS:
            die(prog, f"unknown setting {c} in COMPRESS ({', '.join(COMPRESS_SETTINGS)})")
    if len(set(settings)) != len(settings):
        die(prog, f"COMPRESS names a setting twice: {' '.join(settings)}")
    return settings


def require(prog: str, tools: list[str], files: list[Path], root: bool) -> None:
    """Tools on PATH, built files and root if asked, or a message naming what is missing."""
    if root and os.geteuid() != 0:
        die(prog, "must run as root (swapon, losetup, FUSE, cgroups)")
    for f in files:
        if not f.exists():
            die(prog, f"{f} not found (make build, or set NETPAGER_TARGET_DIR)")
    for tool in tools:
        if shutil.which(tool) is None:
            die(prog, f"{tool} not installed (make deps)")


def fs_type(path: Path) -> str:
    """The file system type `path` lies on (findmnt; of mounts stacked on one
    place, the last, the one visible)."""
    p = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"findmnt --target {path}: {p.stderr.strip()}")
    return p.stdout.split()[-1]


def disk_workdir(td: Teardown, prefix: str, candidates: list[Path] | None = None,
                 keep: bool = False) -> Path:
    """A fresh directory on the first of `candidates` (/tmp, /var/tmp, the
    repository's target/) that is a real disk (not tmpfs), removed by `td`
    unless `keep` (what it holds is asked for afterwards)."""
    if candidates is None:
        candidates = [Path("/tmp"), Path("/var/tmp"), repo_root() / "target"]
    for base in candidates:
        if base.is_dir() and fs_type(base) not in MEMORY_FS:
            work = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
            if not keep:
                td.add(f"directory {work}", lambda: shutil.rmtree(work, ignore_errors=True))
            return work
    raise RuntimeError(f"no directory on a real disk among {', '.join(map(str, candidates))}")


def nbdkit(td: Teardown, workdir: Path, name: str, args: list[str], timeout: float = 30.0) -> OwnedProcess:
    """`nbdkit -f --pidfile ... ARGS`, owned by `td`; returns once its pidfile
    names it (nbdkit writes it after binding its socket). --exit-with-parent:
    a benchmark killed with SIGKILL, which no undo survives, leaves no server."""
    pidfile = workdir / f"{name}.pid"
    pidfile.unlink(missing_ok=True)
    proc = OwnedProcess(["nbdkit", "-f", "--exit-with-parent", "--pidfile", pidfile, *args],
                        workdir / f"{name}.log", td, f"nbdkit {name}")
    td.add(f"pidfile {pidfile}", lambda: pidfile.unlink(missing_ok=True))

    def ready():
        if not proc.alive():
            raise RuntimeError(f"nbdkit {name} exited with {proc.popen.returncode}; log "
                               f"{proc.log_path}:\n{tail(proc.log_path)}")
        return pidfile.exists() and pidfile.read_text().strip() == str(proc.pid)

    wait_for(ready, timeout, f"nbdkit {name} (log {proc.log_path})")
    return proc


def drop_cached(path: Path) -> None:
    """Drops the page cache of one file (not the machine's: it is shared)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fio_json(args: list[str], workdir: Path) -> dict:
    """fio ARGS --output-format=json in `workdir` (fio leaves state files
    there); the first job of its report. fio's nbd engine prints a line of
    its own before the JSON."""
    argv = ["fio", *map(str, args), "--output-format=json"]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=workdir)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def fmt_row(widths: list[int], cells, first_left: int = 1) -> str:
    """Cells padded to `widths`, the first `first_left` left-aligned."""
    return " ".join(f"{str(c):<{w}}" if i < first_left else f"{str(c):>{w}}"
                    for i, (c, w) in enumerate(zip(cells, widths)))


class DonorMemory:
    """What a job's donors hold, summed over them from their status: the
    bytes really held (`used_bytes`, what the budget counts: slab pages,
    compressed or raw) and the pages' logical bytes (as written). `read()`
    is now; as a context manager it samples every `interval` seconds while
    the job runs and keeps the peaks (each its own: the two may peak at
    different samples)."""

    def __init__(self, donors, interval: float = 0.5):
        self.donors = list(donors)
        self.interval = interval
        self.peak = {"stored": 0, "logical": 0}
        # The setting each donor reports running with.
        self.compress = sorted({d.status().compress for d in self.donors})
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict:
        statuses = [d.status() for d in self.donors]
        now = {"stored": sum(s.used_bytes for s in statuses), "logical": sum(s.logical_bytes for s in statuses)}
        for key, v in now.items():
            self.peak[key] = max(self.peak[key], v)
        return now

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.read()
            except (OSError, StatusError):
                pass  # a donor slow to answer: the next sample reads it

    def __enter__(self) -> "DonorMemory":
        self._thread = threading.Thread(target=self._sample, name="donor-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """Now (read at once: at the job's end) and the peaks, with the
        donors' compress= setting."""
        return {"compress": self.compress, "end": self.read(), "peak": dict(self.peak)}


def held_cell(m: dict) -> str:
    """"STORED/LOGICAL MiB (RATIOx)": bytes held against bytes written."""
    return f"{m['stored'] / (1 << 20):.0f}/{m['logical'] / (1 << 20):.0f} MiB ({ratio(m['logical'], m['stored'])})"


def mean_held(ms: list[dict]) -> dict:
    """The mean of DonorMemory figures over rounds."""
    return {key: round(mean([m[key] for m in ms])) for key in ("stored", "logical")}


class Report:
    """A benchmark's table, printed as it grows and written with its numbers."""

    def __init__(self, name: str, knobs: dict):
        self.name = name
        self.knobs = knobs
        self.lines: list[str] = []
        self.results: dict = {}

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def write(self, outdir: Path) -> None:
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / f"{self.name}.txt").write_text("\n".join(self.lines) + "\n")
        doc = {"bench": self.name, "knobs": self.knobs, "results": self.results, "table": self.lines}
        (outdir / f"{self.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"({self.name}: {outdir / self.name}.txt, .json)", file=sys.stderr)
