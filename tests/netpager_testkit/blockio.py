"""A verifying block workload: generations of a deterministic pattern
written and read back with O_DIRECT on a block device, from a few threads
on disjoint blocks, so that requests are in flight whenever a fault is
injected, and every read is checked against the last write acknowledged
(tests/faults and the nemesis, tests/nemesis)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import random
import struct
import threading
import time
import uuid

from .cleanup import Teardown
from .nbdio import pattern
from .procs import wait_for

PAGE = 4096
BLOCK = 256 * 1024
BLKDISCARD = 0x1277  # _IO(0x12, 119), linux/fs.h


class BlockWorkload:
    """Writes and read-verifies generations of a deterministic pattern on a
    block device with O_DIRECT, from `threads` threads on disjoint blocks, so
    that requests are in flight whenever a fault is injected.

    Per block it knows the last generation whose write succeeded; a write
    that failed leaves the block either as it was or as the new generation
    (both are accepted). Generation 0 is the zeros of a fresh device, and
    of a block discarded (BLKDISCARD of its aligned group of `group`
    blocks, with probability `discard` instead of a write: the device frees
    what held them, and a discarded block reads as zeros; a thread owns
    whole groups). A block's generations only grow, so an older copy never
    passes for the last one. A read-back that returns any other content is
    corruption, recorded with the block and time; an EIO is a lost block.
    """

    def __init__(self, device: str, size: int, seed: str | None = None, threads: int = 2,
                 block: int = BLOCK, offset: int = 0, discard: float = 0.0, group: int = 1):
        self.device, self.size, self.block = device, size, block
        # Where block 0 starts on the device (the rest may be another job's).
        self.offset = offset
        self.seed = seed or uuid.uuid4().hex[:8]
        self.nblocks = size // block
        self.threads_n = threads
        self.gen = [0] * self.nblocks
        self.top = [0] * self.nblocks  # the highest generation each block was given
        self.discard, self.group = discard, group
        self.discards = 0
        self.maybe: dict[int, set[int]] = {}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.writes = self.reads = self.attempts = 0
        # Bytes read back and found right, in flight and by verify_all.
        self.verified_bytes = 0
        self.write_errors: dict[str, int] = {}
        self.read_errors: dict[str, int] = {}
        self.corrupt: list[str] = []
        self.first_error_at: float | None = None
        self.fd = os.open(device, os.O_RDWR | os.O_DIRECT)

    def at(self, b: int) -> int:
        """Block b's byte offset on the device."""
        return self.offset + b * self.block

    def expected(self, b: int, gen: int) -> bytes:
        if gen == 0:
            return bytes(self.block)
        return pattern(f"{self.seed}:{gen}", b * self.block, self.block)

    def _write(self, buf: mmap.mmap, b: int, gen: int | None = None) -> bool:
        """Writes block b's next generation (or `gen`); a failure is kept."""
        with self.lock:
            gen = gen if gen is not None else self.top[b] + 1
            self.top[b] = max(self.top[b], gen)
        buf[:] = self.expected(b, gen)
        self.attempts += 1
        try:
            os.pwrite(self.fd, buf, self.at(b))
        except OSError as e:
            self._failed(b, gen, e)
            return False
        self._done(b, gen)
        return True

    def _failed(self, b: int, gen: int, e: OSError) -> None:
        with self.lock:
            name = errno.errorcode.get(e.errno, str(e.errno))
            self.write_errors[name] = self.write_errors.get(name, 0) + 1
            self.maybe.setdefault(b, {self.gen[b]}).add(gen)
            self.first_error_at = self.first_error_at or time.monotonic()

    def _done(self, b: int, gen: int) -> None:
        with self.lock:
            self.gen[b] = gen
            self.maybe.pop(b, None)
            self.writes += 1

    def _discard(self, b: int) -> None:
        """BLKDISCARD of block b's group: its blocks read as zeros
        (generation 0) after."""
        first = b - b % self.group
        blocks = range(first, min(first + self.group, self.nblocks))
        self.attempts += 1
        try:
            fcntl.ioctl(self.fd, BLKDISCARD, struct.pack("QQ", self.at(first), len(blocks) * self.block))
        except OSError as e:
            if e.errno == errno.EOPNOTSUPP:
                self.discard = 0.0  # the device cannot: writes only
                return
            for x in blocks:
                self._failed(x, 0, e)
            return
        for x in blocks:
            self._done(x, 0)
        self.discards += 1

    def accepted(self, b: int) -> set[int]:
        with self.lock:
            return set(self.maybe.get(b, ())) | {self.gen[b]}

    def check_block(self, buf: mmap.mmap, b: int) -> str:
        """'ok', 'EIO' (or another errno name) or 'corrupt'."""
        try:
            n = os.preadv(self.fd, [buf], self.at(b))
        except OSError as e:
            return errno.errorcode.get(e.errno, str(e.errno))
        if n != self.block:
            return "short"
        data = bytes(buf)
        gens = self.accepted(b)
        if any(data == self.expected(b, g) for g in gens) or (
                len(gens) > 1 and self.torn_ok(b, data, gens)):  # a failed write may be torn
            with self.lock:
                self.verified_bytes += self.block
            return "ok"
        return "corrupt"

    def torn_ok(self, b: int, data: bytes, gens: set[int]) -> bool:
        want = [self.expected(b, g) for g in gens]
        return all(any(data[o:o + PAGE] == w[o:o + PAGE] for w in want)
                   for o in range(0, self.block, PAGE))

    def diagnose(self, b: int, reads: int = 4) -> str:
        """What a corrupt block holds: which generation each page matches,
        read `reads` times (copies of a mirror are read in turn: reads
        that differ say one copy is wrong)."""
        buf = mmap.mmap(-1, self.block)
        gens = self.accepted(b)
        top = self.top[b] + 2
        seen: list[str] = []
        for _ in range(reads):
            try:
                os.preadv(self.fd, [buf], self.at(b))
            except OSError as e:
                seen.append(f"read fails ({e})")
                continue
            data = bytes(buf)
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
            seen.append(" ".join(runs))
        distinct = list(dict.fromkeys(seen))
        what = (f"pages hold generations {distinct[0]}" if len(distinct) == 1 else
                f"{reads} reads disagree (one copy is wrong): " + "; ".join(distinct))
        return (f"block {b} (offset {self.at(b)}): accepted generations {sorted(gens)}, {what} "
                f"('?' matches none, 0 is zeros)")

    def fill(self) -> None:
        """Generation 1 on every block, then fsync: the device is full of data."""
        buf = mmap.mmap(-1, self.block)
        for b in range(self.nblocks):
            self._write(buf, b, 1)
        os.fsync(self.fd)

    def _run(self, t: int) -> None:
        rng = random.Random(f"{self.seed}:{t}")
        mine = [b for b in range(self.nblocks) if b // self.group % self.threads_n == t]
        wbuf, rbuf = mmap.mmap(-1, self.block), mmap.mmap(-1, self.block)
        ops = 0
        while not self.stop_event.is_set():
            b = rng.choice(mine)
            if self.discard and rng.random() < self.discard:
                self._discard(b)
            else:
                self._write(wbuf, b)
            r = rng.choice(mine)
            res = self.check_block(rbuf, r)
            with self.lock:
                self.reads += 1
                if res == "corrupt":
                    self.corrupt.append(f"block {r} (offset {self.at(r)}) at {time.monotonic():.3f}")
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
    """A BlockWorkload on `device`, stopped and closed on teardown."""
    w = BlockWorkload(device, size, **kw)
    teardown.add(f"block workload on {device}", lambda: (w.stop(), w.close()))
    return w
