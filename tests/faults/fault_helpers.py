"""Pieces of the fault matrix (tests/faults): a verifying block workload
that keeps I/O in flight while a fault is injected, the faults that need
more than a signal (a network partition, memory pressure on the donor's
node, a status flood), and the row each cell appends to the results file.

Everything that changes the machine registers its undo in the test's
Teardown the moment it exists.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import socket
import subprocess
import threading
import time
import tomllib
import uuid
from pathlib import Path

from netpager_testkit import MemoryCgroup, OwnedProcess, Teardown, wait_for
from netpager_testkit.nbdio import pattern
from netpager_testkit.paths import repo_root

MIB = 1 << 20
PAGE = 4096
BLOCK = 256 * 1024


def results_path() -> Path:
    """Where cells append their rows (one JSON object a line)."""
    env = os.environ.get("NETPAGER_FAULTS_ROWS")
    return Path(env) if env else repo_root() / "bench-results" / "faults-rows.jsonl"


def append_row(row: dict) -> None:
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
    print("fault row: " + json.dumps(row, sort_keys=True))


def extent_size(state_dir: Path) -> int:
    config = tomllib.loads((Path(state_dir) / "device.toml").read_text())
    v = config["extent_size"]
    return v if isinstance(v, int) else parse_size(v)


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    return int(s.rstrip("KMGT")) * mult


class BlockWorkload:
    """Writes and read-verifies generations of a deterministic pattern on a
    block device with O_DIRECT, from `threads` threads on disjoint blocks, so
    that requests are in flight whenever a fault is injected.

    Per block it knows the last generation whose write succeeded; a write
    that failed leaves the block either as it was or as the new generation
    (both are accepted). Generation 0 is the zeros of a fresh device. A
    read-back that returns any other content is corruption, recorded with
    the block and time; an EIO is a lost block.
    """

    def __init__(self, device: str, size: int, seed: str | None = None, threads: int = 2,
                 block: int = BLOCK):
        self.device, self.size, self.block = device, size, block
        self.seed = seed or uuid.uuid4().hex[:8]
        self.nblocks = size // block
        self.threads_n = threads
        self.gen = [0] * self.nblocks
        self.maybe: dict[int, set[int]] = {}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.writes = self.reads = self.attempts = 0
        self.write_errors: dict[str, int] = {}
        self.read_errors: dict[str, int] = {}
        self.corrupt: list[str] = []
        self.first_error_at: float | None = None
        self.fd = os.open(device, os.O_RDWR | os.O_DIRECT)

    def expected(self, b: int, gen: int) -> bytes:
        if gen == 0:
            return bytes(self.block)
        return pattern(f"{self.seed}:{gen}", b * self.block, self.block)

    def _write(self, buf: mmap.mmap, b: int, gen: int) -> bool:
        buf[:] = self.expected(b, gen)
        self.attempts += 1
        try:
            os.pwrite(self.fd, buf, b * self.block)
        except OSError as e:
            with self.lock:
                name = errno.errorcode.get(e.errno, str(e.errno))
                self.write_errors[name] = self.write_errors.get(name, 0) + 1
                self.maybe.setdefault(b, {self.gen[b]}).add(gen)
                self.first_error_at = self.first_error_at or time.monotonic()
            return False
        with self.lock:
            self.gen[b] = gen
            self.maybe.pop(b, None)
            self.writes += 1
        return True

    def accepted(self, b: int) -> set[int]:
        with self.lock:
            return set(self.maybe.get(b, ())) | {self.gen[b]}

    def check_block(self, buf: mmap.mmap, b: int) -> str:
        """'ok', 'EIO' (or another errno name) or 'corrupt'."""
        try:
            n = os.preadv(self.fd, [buf], b * self.block)
        except OSError as e:
            return errno.errorcode.get(e.errno, str(e.errno))
        if n != self.block:
            return "short"
        data = bytes(buf)
        gens = self.accepted(b)
        if any(data == self.expected(b, g) for g in gens):
            return "ok"
        if len(gens) > 1 and self.torn_ok(b, data, gens):
            return "ok"  # a failed write may have reached some of its pages
        return "corrupt"

    def torn_ok(self, b: int, data: bytes, gens: set[int]) -> bool:
        want = [self.expected(b, g) for g in gens]
        return all(any(data[o:o + PAGE] == w[o:o + PAGE] for w in want)
                   for o in range(0, self.block, PAGE))

    def diagnose(self, b: int) -> str:
        """What a corrupt block holds: which generation each page matches."""
        buf = mmap.mmap(-1, self.block)
        try:
            os.preadv(self.fd, [buf], b * self.block)
        except OSError as e:
            return f"block {b}: read fails now ({e})"
        data = bytes(buf)
        gens = self.accepted(b)
        top = max(gens) + 2
        pages = []
        for o in range(0, self.block, PAGE):
            page = data[o:o + PAGE]
            match = [g for g in range(top) if page == self.expected(b, g)[o:o + PAGE]]
            pages.append(str(match[0]) if match else "?")
        runs, prev, n = [], None, 0
        for p in pages + [None]:
            if p != prev and prev is not None:
                runs.append(f"{prev}x{n}")
                n = 0
            prev, n = p, n + 1
        return (f"block {b} (offset {b * self.block}): accepted generations {sorted(gens)}, "
                f"pages hold generations {' '.join(runs)} ('?' matches none, 0 is zeros)")

    def fill(self) -> None:
        """Generation 1 on every block, then fsync: the device is full of data."""
        buf = mmap.mmap(-1, self.block)
        for b in range(self.nblocks):
            self._write(buf, b, 1)
        os.fsync(self.fd)

    def _run(self, t: int) -> None:
        rng = random.Random(f"{self.seed}:{t}")
        mine = list(range(t, self.nblocks, self.threads_n))
        wbuf, rbuf = mmap.mmap(-1, self.block), mmap.mmap(-1, self.block)
        ops = 0
        while not self.stop_event.is_set():
            b = rng.choice(mine)
            self._write(wbuf, b, max(self.accepted(b)) + 1)
            r = rng.choice(mine)
            res = self.check_block(rbuf, r)
            with self.lock:
                self.reads += 1
                if res == "corrupt":
                    self.corrupt.append(f"block {r} (offset {r * self.block}) at {time.monotonic():.3f}")
                elif res != "ok":
                    self.read_errors[res] = self.read_errors.get(res, 0) + 1
                    self.first_error_at = self.first_error_at or time.monotonic()
            ops += 1
            if ops % 64 == 0:
                try:
                    os.fsync(self.fd)
                except OSError:
                    pass

    def start(self) -> "BlockWorkload":
        for t in range(self.threads_n):
            th = threading.Thread(target=self._run, args=(t,), daemon=True)
            th.start()
            self.threads.append(th)
        return self

    def wait_ops(self, n: int, timeout: float = 60) -> None:
        """Waits for n more writes done or refused (a full device refuses them all)."""
        start = self.attempts
        wait_for(lambda: self.attempts - start >= n or self.stop_event.is_set(), timeout,
                 f"{n} writes on {self.device} (done {self.writes}, refused {self.write_errors})")

    def stop(self) -> None:
        self.stop_event.set()
        for th in self.threads:
            th.join(120)
            if th.is_alive():
                raise AssertionError(f"I/O on {self.device} hangs: a writer thread did not "
                                     "finish within 120 s of the stop")
        self.threads = []

    def verify_all(self) -> dict:
        """Reads every block once: {'ok': n, 'lost': [blocks], 'corrupt': [blocks]}."""
        buf = mmap.mmap(-1, self.block)
        out = {"ok": 0, "lost": [], "corrupt": []}
        for b in range(self.nblocks):
            res = self.check_block(buf, b)
            if res == "ok":
                out["ok"] += 1
            elif res == "corrupt":
                out["corrupt"].append(b)
            else:
                out["lost"].append(b)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def reopen(self, device: str) -> None:
        """Goes on with the same expectations on `device` (the device again,
        after a re-attach gave it another name)."""
        self.close()
        self.device = device
        self.fd = os.open(device, os.O_RDWR | os.O_DIRECT)


def start_block_workload(teardown: Teardown, device: str, size: int, **kw) -> BlockWorkload:
    w = BlockWorkload(device, size, **kw)
    teardown.add(f"block workload on {device}", lambda: (w.stop(), w.close()))
    return w


class Partition:
    """iptables DROP rules (no RST) for every TCP packet to or from a donor's
    loopback address and ports, removed on teardown (and by `heal`)."""

    def __init__(self, teardown: Teardown, addr: str, ports: list[int]):
        assert addr.startswith("127."), f"loopback addresses only, not {addr}"
        self.tag = f"netpager-test-{uuid.uuid4().hex[:8]}"
        self.rules: list[list[str]] = []
        for port in ports:
            self.rules.append(["INPUT", "-d", addr, "-p", "tcp", "--dport", str(port)])
            self.rules.append(["INPUT", "-s", addr, "-p", "tcp", "--sport", str(port)])
        self.added: list[list[str]] = []
        teardown.add(f"iptables rules {self.tag} on {addr}", self.heal)
        for rule in self.rules:
            self._iptables("-I", rule)
            self.added.append(rule)

    def _spec(self, rule: list[str]) -> list[str]:
        return [rule[0]] + rule[1:] + ["-m", "comment", "--comment", self.tag, "-j", "DROP"]

    def _iptables(self, op: str, rule: list[str], check: bool = True) -> int:
        p = subprocess.run(["iptables", "-w", "10", op] + self._spec(rule),
                           capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise RuntimeError(f"iptables {op} {' '.join(self._spec(rule))}: {p.stderr.strip()}")
        return p.returncode

    def heal(self) -> None:
        while self.added:
            rule = self.added[-1]
            for _ in range(10):  # a rule inserted twice is deleted twice
                if self._iptables("-C", rule, check=False) != 0:
                    break
                self._iptables("-D", rule)
            self.added.pop()
        left = subprocess.run(["iptables", "-w", "10", "-S"], capture_output=True, text=True).stdout
        if self.tag in left:
            raise RuntimeError(f"iptables rules {self.tag} still present:\n{left}")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class MemoryHog:
    """stress-ng holding `size` bytes of anonymous memory in a memory cgroup
    of its own (limit a little above it), so the node's MemAvailable drops;
    it holds them until stopped (by the test or its teardown)."""

    def __init__(self, teardown: Teardown, size: int, log_path):
        self.size = size
        self.cgroup = MemoryCgroup(teardown, size + 512 * MIB)
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup.procs_file),
                "stress-ng", "--vm", "1", "--vm-bytes", f"{size // MIB}M", "--vm-keep",
                "--vm-populate", "--timeout", "0"]
        self.proc = OwnedProcess(argv, log_path, teardown, "memory hog")

    def holding(self) -> bool:
        """Once it holds its whole size (raises if it died)."""
        assert self.proc.alive(), f"the memory hog ended: {self.proc.log_tail()}"
        return self.cgroup.memory_bytes() >= self.size

    def stop(self) -> None:
        self.proc.stop()


class StatusFlood:
    """Threads opening connections to status endpoints as fast as they can:
    half ask a real query and read the reply, half send garbage and hang up."""

    def __init__(self, addrs: list[tuple[str, int]], threads: int = 8):
        from netpager_testkit import pb2
        from netpager_testkit.status import delimited

        self.addrs = addrs
        self.stop_event = threading.Event()
        self.sent = [0] * threads
        self.query = delimited(pb2().Request(status=pb2().StatusQuery()))
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop_event.is_set():
            host, port = rng.choice(self.addrs)
            try:
                with socket.create_connection((host, port), timeout=2) as s:
                    if i % 2:
                        s.sendall(self.query)
                    else:
                        s.sendall(os.urandom(rng.randrange(1, 512)))
                    s.shutdown(socket.SHUT_WR)
                    while s.recv(4096):
                        pass
            except OSError:
                pass
            self.sent[i] += 1

    def start(self) -> "StatusFlood":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)
