"""prefetchd's harness: the pieces its end-to-end tests and its benchmark
(`bench_prefetch`) set up.

- `generate(workload, out, scale)`: a reference data set + hint file
  (`pager-hints gen`).
- `Prefetchd`: the daemon serving a data directory at a FUSE mount, with
  its control socket; stopped and unmounted on every exit path.
- `SlowDisk`: a data file behind `nbdkit file` with `noparallel` + `delay`
  filters, shown as a file by nbdfuse: a one-request-at-a-time disk that
  prefetchd's io_uring reads (O_DIRECT, so no page cache) really wait for.
  (`serialize=all-requests`: the default serializes each connection
  alone, and nbdfuse opens several.)
- `Replica`: a donor's copy of the data set on its own slow disk, served as
  one export of the files concatenated in manifest order (`nbdkit split`).
- `run_job`: `prefetch-job` replaying a hint file through the mount,
  verifying every byte.

Every resource registers its undo in the test's Teardown when it exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from .attach import mounted
from .cleanup import Teardown
from .donor import free_ports, nbd_handshake
from .paths import target_dir
from .procs import OwnedProcess, tail, wait_for


def binary(name: str) -> Path:
    return target_dir() / name


def missing_binaries() -> list[str]:
    return [n for n in ("prefetchd", "prefetch-job", "pager-hints") if not binary(n).exists()]


def generate(workload: str, out: Path, scale: float, seed: int = 1, block_size: int = 8192) -> dict:
    """Writes data set `workload` under `out`; returns its manifest (with
    `data` and `hints` as absolute paths)."""
    subprocess.run([str(binary("pager-hints")), "gen", workload, "--out", str(out),
                    "--scale", str(scale), "--seed", str(seed), "--block-size", str(block_size)],
                   check=True, capture_output=True, text=True)
    m = json.loads((out / "manifest.json").read_text())
    m["data"] = out / m["root"]
    m["hints_path"] = out / m["hints"]
    m["manifest_path"] = out / "manifest.json"
    return m


def write_hints(path: Path, job: str, records, block_size: int = 8192, repeat: int = 1) -> Path:
    """A text hint file (hints/FORMAT.md) with `records` = [(path, offset, length)]."""
    lines = ["netpager-hints 1", f"job {job}", f"block-size {block_size}", f"repeat {repeat}", "records"]
    lines += [f"{p} {o} {n}" for p, o, n in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def without_file_declarations(hints: Path, out: Path) -> Path:
    """A copy of text hint file `hints` without its `file` header lines
    (size and mtime): for a data set moved to another file system (an
    nbdfuse file has its own mtime), where they would mark every hint stale."""
    lines = hints.read_text().splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.strip() == "records")
    out.write_text("".join(line for line in lines[:end] if not line.startswith("file "))
                   + "".join(lines[end:]))
    return out


def unmount(path: Path, timeout: float = 30.0) -> None:
    """fusermount3 -u, retried while busy; lazily detached as a last resort."""
    deadline = time.monotonic() + timeout
    while mounted(path):
        p = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, text=True)
        if p.returncode == 0:
            return
        if time.monotonic() > deadline:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
            raise RuntimeError(f"fusermount3 -u {path}: {p.stderr.strip()} (detached lazily)")
        time.sleep(0.1)


class Prefetchd:
    """`prefetchd serve` owned by a Teardown."""

    def __init__(self, td: Teardown, workdir: Path, data: Path, donors=(), local_cache: str = "1M",
                 extra=(), name: str = "prefetchd", timeout: float = 30.0):
        self.workdir = Path(workdir)
        self.mount = self.workdir / f"{name}-mnt"
        self.control = self.workdir / f"{name}.sock"
        self.mount.mkdir(parents=True)
        td.add(f"mountpoint {self.mount}", lambda: self.mount.exists() and not mounted(self.mount)
               and self.mount.rmdir())
        # Registered before the process: undone after it is stopped, in case
        # it died without unmounting.
        td.add(f"prefetchd mount {self.mount}", lambda: unmount(self.mount))
        argv = [binary("prefetchd"), "--control", self.control, "serve", "--data", data,
                "--mount", self.mount, "--local-cache", local_cache]
        for d in donors:
            argv += ["--donor", d]
        argv += list(extra)
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "prefetchd=info"))
        self.proc = OwnedProcess(argv, self.workdir / f"{name}.log", td, name, env=env)

        def ready():
            if not self.proc.alive():
                raise RuntimeError(f"prefetchd exited with {self.proc.popen.returncode}:\n"
                                   f"{tail(self.proc.log_path)}")
            return self.control.exists() and mounted(self.mount)

        wait_for(ready, timeout, f"prefetchd mounted at {self.mount}")

    def cli(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([str(binary("prefetchd")), "--control", str(self.control), *map(str, args)],
                           capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise RuntimeError(f"prefetchd {' '.join(map(str, args))} failed ({p.returncode}): {p.stderr}")
        return p

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def job(self, name: str) -> dict:
        for j in self.status()["jobs"]:
            if j["name"] == name:
                return j
        raise KeyError(f"no job {name} in status")

    def add_job(self, name: str, hints: Path) -> subprocess.CompletedProcess:
        return self.cli("job", "add", name, hints)

    def stop(self) -> int:
        """SIGTERM; returns the exit status."""
        self.proc.stop()
        return self.proc.popen.returncode


class SlowDisk:
    """`file` served one request at a time with `rdelay` per read, shown as
    DIR/NAME by nbdfuse (DIR is the data directory)."""

    def __init__(self, td: Teardown, workdir: Path, file: Path, name: str, rdelay: str = "5ms",
                 timeout: float = 30.0):
        workdir = Path(workdir)
        self.dir = workdir / f"slow-{name}"
        self.dir.mkdir(parents=True)
        td.add(f"mountpoint {self.dir}", lambda: self.dir.exists() and not mounted(self.dir)
               and self.dir.rmdir())
        sock = workdir / f"slow-{name}.sock"
        self.server = OwnedProcess(
            ["nbdkit", "-f", "-U", sock, "--filter=noparallel", "--filter=delay",
             "file", file, "serialize=all-requests", f"rdelay={rdelay}"],
            workdir / f"slow-{name}-nbdkit.log", td, f"nbdkit slow disk {name}")
        wait_for(lambda: sock.exists(), timeout, f"nbdkit socket {sock}")
        self.path = self.dir / name
        self.fuse = OwnedProcess(["nbdfuse", "-r", self.path, f"nbd+unix:///?socket={sock}"],
                                 workdir / f"slow-{name}-nbdfuse.log", td, f"nbdfuse {name}")
        td.add(f"nbdfuse mount {self.dir}", lambda: unmount(self.dir))

        def ready():
            if not self.fuse.alive():
                raise RuntimeError(f"nbdfuse exited: {tail(self.fuse.log_path)}")
            return mounted(self.dir) and self.path.exists()

        wait_for(ready, timeout, f"nbdfuse file {self.path}")


def manifest_order(data: Path) -> list[tuple[int, int, str]]:
    """(offset, size, path) of each file in the replica layout."""
    out = subprocess.run([str(binary("prefetchd")), "manifest", str(data)],
                         check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        off, size, rel = line.split("\t", 2)
        rows.append((int(off), int(size), rel))
    return rows


class Replica:
    """A donor's replica of data set `data` on its own slow disk, at
    nbd://ADDR:PORT/ (read-only, one request at a time)."""

    def __init__(self, td: Teardown, workdir: Path, data: Path, addr: str, name: str,
                 rdelay: str = "5ms", timeout: float = 30.0):
        files = [Path(data) / rel for _, _, rel in manifest_order(Path(data))]
        self.addr = addr
        self.port = free_ports(addr, 1)[0]
        argv = ["nbdkit", "-f", "-r", "-i", addr, "--port", str(self.port),
                "--filter=noparallel", "--filter=delay", "split"]
        argv += [f"file={f}" for f in files] + ["serialize=all-requests", f"rdelay={rdelay}"]
        self.proc = OwnedProcess(argv, Path(workdir) / f"replica-{name}.log", td, f"replica {name}")
        uri = f"nbd://{addr}:{self.port}/"

        def ready():
            if not self.proc.alive():
                raise RuntimeError(f"replica nbdkit exited: {tail(self.proc.log_path)}")
            return nbd_handshake(uri)

        wait_for(ready, timeout, f"replica at {uri}")

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"


def donor_arg(donor, replica: Replica | None = None, export: str = "", slots: int | None = None) -> str:
    """The `--donor` argument for a harness Donor (and its replica)."""
    arg = f"{donor.addr}:{donor.port}/{export}"
    if replica is not None:
        arg += f",replica={replica.endpoint}"
    if slots is not None:
        arg += f",slots={slots}"
    return arg


def start_job(td: Teardown, workdir: Path, hints: Path, root: Path, manifest: Path | None = None,
              reference: Path | None = None, compute_us: int = 0, name: str = "job",
              limit: int | None = None, until: bool = False) -> OwnedProcess:
    """Starts prefetch-job replaying `hints` under `root`; see `finish_job`.
    With `until` it replays them again and again until `finish_job` tells
    it to stop: a test that does things while the job runs never sizes the
    job to outlast them."""
    argv = [binary("prefetch-job"), "--hints", hints, "--root", root, "--compute-us", str(compute_us)]
    if manifest is not None:
        argv += ["--manifest", manifest]
    if reference is not None:
        argv += ["--reference", reference]
    if limit is not None:
        argv += ["--limit", str(limit)]
    stop = Path(workdir) / f"{name}.stop"
    stop.unlink(missing_ok=True)
    if until:
        argv += ["--until", stop]
    log = Path(workdir) / f"{name}.log"
    log.unlink(missing_ok=True)
    proc = OwnedProcess(argv, log, td, name)
    proc.stop_file = stop if until else None
    return proc


def run_job(td: Teardown, workdir: Path, hints: Path, root: Path, manifest: Path | None = None,
            reference: Path | None = None, compute_us: int = 0, name: str = "job",
            limit: int | None = None, timeout: float = 300.0) -> dict:
    """Runs prefetch-job to the end; returns its JSON summary (fails on error)."""
    proc = start_job(td, workdir, hints, root, manifest, reference, compute_us, name, limit)
    return finish_job(proc, name, timeout)


def finish_job(proc: OwnedProcess, name: str = "job", timeout: float = 300.0) -> dict:
    """Waits for a started prefetch-job (first telling one started with
    `until` to stop); returns its JSON summary (fails on error)."""
    if getattr(proc, "stop_file", None) is not None:
        proc.stop_file.touch()
    log = proc.log_path
    rc = proc.wait(timeout)
    if rc is None:
        proc.kill9()
        raise TimeoutError(f"{name} did not finish in {timeout:.0f}s:\n{tail(log)}")
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    if rc not in (0, 1) or not lines:
        raise RuntimeError(f"{name} failed ({rc}):\n{tail(log)}")
    return json.loads(lines[-1])


# A table scan: every row's key and value are looked at.
SCAN_QUERY = "SELECT count(*), sum(length(v)), max(k), sum(instr(k, '77')) FROM t"


def scattered_db(path: Path, rows: int, seed: int = 1) -> Path:
    """An SQLite database of one table filled in random key order, so its
    leaf pages lie scattered over the file and a scan reads them out of
    file order (4 KiB pages, 50-150 byte values)."""
    import random
    import sqlite3

    rng = random.Random(seed)
    ids = list(range(rows))
    rng.shuffle(ids)
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA page_size=4096")
        db.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, k TEXT, v BLOB)")
        db.executemany("INSERT INTO t VALUES(?,?,?)",
                       ((i, f"key{i:08d}", rng.randbytes(rng.randint(50, 150))) for i in ids))
        db.commit()
    finally:
        db.close()
    return path


def sqlite_scan(db: Path, query: str = SCAN_QUERY, timeout: float = 300.0) -> tuple[str, float]:
    """Runs `query` with the sqlite3 CLI on `db`, read-only and immutable
    (no locks, no journal: the mount is read-only); returns its output and
    the elapsed seconds."""
    started = time.monotonic()
    p = subprocess.run(["sqlite3", "-readonly", f"file:{db}?immutable=1", query],
                       capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - started
    if p.returncode != 0:
        raise RuntimeError(f"sqlite3 {db}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout, took
