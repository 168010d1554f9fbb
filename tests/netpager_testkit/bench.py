"""What the benchmarks (bench_client, bench_server) share: their knobs from
the environment, a work directory on a real disk, nbdkit and fio runs, and
the results they write (a table as text and the numbers as JSON).

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
from pathlib import Path

from .cleanup import Teardown
from .paths import repo_root
from .procs import OwnedProcess, tail, wait_for

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
