"""NBD I/O from the tests through libnbd's Python binding (Debian python3-libnbd)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from contextlib import contextmanager

import nbd

PAGE = 4096


def pattern(seed: str, offset: int, length: int) -> bytes:
    """Deterministic bytes for (seed, offset): a rewrite with another seed differs."""
    out = bytearray()
    block = offset // 32
    skip = offset - block * 32
    while len(out) < skip + length:
        out += hashlib.blake2s(f"{seed}:{block}".encode(), digest_size=32).digest()
        block += 1
    return bytes(out[skip:skip + length])


@contextmanager
def connect(uri: str, allocation: bool = False):
    """An open libnbd handle on `uri`; `allocation` asks for base:allocation.
    `uri` may be an `nbds://` URI naming its key file (libnbd reads such local
    files only when allowed)."""
    h = nbd.NBD()
    h.set_uri_allow_local_file(True)
    if allocation:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.connect_uri(uri)
    try:
        yield h
    finally:
        try:
            h.shutdown()
        except nbd.Error:
            pass


def allocation(h, offset: int, length: int) -> list[tuple[int, int, int]]:
    """(offset, length, flags) runs covering [offset, offset+length) from block status.

    flags carry nbd.STATE_HOLE and nbd.STATE_ZERO.
    """
    runs: list[tuple[int, int, int]] = []
    pos = offset
    end = offset + length

    def cb(metacontext, off, entries, err):
        nonlocal pos
        if metacontext != nbd.CONTEXT_BASE_ALLOCATION:
            return 0
        p = off
        for i in range(0, len(entries), 2):
            n, flags = entries[i], entries[i + 1]
            n = min(n, end - p)
            if n <= 0:
                break
            runs.append((p, n, flags))
            p += n
        pos = p
        return 0

    while pos < end:
        before = pos
        h.block_status(min(end - pos, 1 << 30), pos, cb)
        if pos == before:
            raise RuntimeError(f"block status at {pos} made no progress")
    return runs


def hole_bytes(runs) -> int:
    """Bytes reported as holes (unallocated) among `runs`."""
    return sum(n for _, n, flags in runs if flags & nbd.STATE_HOLE)


def fio(args: list[str], log_path, timeout: float = 600.0) -> str:
    """Runs fio with `args`, raising with its output on failure; returns the output."""
    argv = ["fio", "--output-format=normal"] + args
    # fio leaves *-verify.state files in its working directory: keep them
    # beside the log, not in the caller's directory.
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                       cwd=os.path.dirname(os.path.abspath(log_path)))
    with open(log_path, "w") as f:
        f.write(f"$ {' '.join(argv)}\n{p.stdout}\n{p.stderr}")
    if p.returncode != 0:
        raise AssertionError(f"fio failed ({p.returncode}), log {log_path}:\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout
