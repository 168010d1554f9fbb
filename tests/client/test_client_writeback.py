"""The serving process's write-back buffer (`--writeback-buffer`,
pagerctl(1) PERFORMANCE) and its request clock: a write acknowledged with
its donor stopped reads back from the buffer, a flush waits for the drain,
a full buffer holds writers back instead of growing; acknowledged writes
survive a kill -9 of a restartable device's serving process (which has no
buffer) and a donor killed in each protected mode, every page checked; and the stage histograms add up to the time the test measured."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest

from netpager_testkit.client import MIB, Job, busiest, donor_report
from netpager_testkit import wait_for

PAGE = 4096


def pattern(tag: int, pages: int = 1) -> bytes:
    return bytes((i * 7 + tag) & 0xFF for i in range(PAGE)) * pages


class Direct:
    """O_DIRECT I/O on a block device, page-aligned buffers."""

    def __init__(self, teardown, device: str):
        self.fd = os.open(device, os.O_RDWR | os.O_DIRECT)
        teardown.add(f"close {device}", self.close)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def write(self, data: bytes, offset: int) -> None:
        buf = mmap.mmap(-1, len(data))
        buf.write(data)
        assert os.pwritev(self.fd, [buf], offset) == len(data)

    def read(self, n: int, offset: int) -> bytes:
        buf = mmap.mmap(-1, n)
        assert os.preadv(self.fd, [buf], offset) == n
        return bytes(buf)


def writeback(client) -> dict:
    return client.device_status().get("writeback") or {}


def test_a_stopped_donor_holds_the_drain_not_the_writer(teardown, donors, client):
    """With the only donor stopped: a write is acknowledged (buffered) and
    reads back from the buffer; a flush waits until the donor runs again;
    writes beyond the buffer wait (back-pressure) instead of growing it.
    (The flush and the overflowing writes go one after the other: FUSE
    holds the file's inode lock through an FSYNC, so writes queue behind
    it in the kernel.)"""
    (d,) = donors(1)
    dev = client.attach([d], mode="none", size="64M",
                        extra=["--writeback-buffer", "256K", "--writeback-ack-early", "--request-timeout", "120"])
    io = Direct(teardown, dev)
    io.write(pattern(1, 4), 0)  # places the extent while the donor runs
    io.read(4 * PAGE, 0)
    d.sigstop()
    teardown.add(f"SIGCONT donor {d.name}", d.sigcont)
    io.write(pattern(2), PAGE)
    assert io.read(PAGE, PAGE) == pattern(2), "the buffered page did not read back"
    flushed = threading.Event()
    t = threading.Thread(target=lambda: (os.fsync(io.fd), flushed.set()), daemon=True)
    t.start()
    # Nothing to wait for but time: the flush must still be held.
    time.sleep(1)
    assert not flushed.is_set(), "fsync returned while the donor could not have the page"
    d.sigcont()
    t.join(60)
    assert flushed.is_set()
    # 256K holds 64 pages: four writes of 16 fit, the fifth cannot while
    # nothing drains (a write of more than half the buffer bypasses it).
    d.sigstop()
    filled = threading.Event()
    done = []

    def fill():
        for j in range(6):
            io.write(pattern(3 + j, 16), (8 + 16 * j) * PAGE)
            done.append(j)
        filled.set()
    w = threading.Thread(target=fill, daemon=True)
    w.start()
    wait_for(lambda: len(done) >= 4, 60, "four writes acknowledged from the buffer")
    time.sleep(1)
    assert len(done) == 4, f"{len(done)} writes of 16 pages acknowledged into 64 slots"
    d.sigcont()
    w.join(60)
    assert filled.is_set()
    assert io.read(PAGE, PAGE) == pattern(2)
    for j in range(6):
        assert io.read(16 * PAGE, (8 + 16 * j) * PAGE) == pattern(3 + j, 16), f"write {j}"
    os.fsync(io.fd)
    # status.json is rewritten about once a second: 4 + 1 + 96 pages in.
    wb = wait_for(lambda: (lambda w: w if w.get("pages_in", 0) >= 101 else None)(writeback(client)), 30,
                  "the buffer's counters in status")
    assert wb["read_hits"] >= 1 and wb["full_waits"] > 0, wb
    io.close()
    client.detach()
    assert client.leftovers() == []


def test_detach_drains_the_buffer(teardown, donors, client, tmp_path):
    """What was acknowledged from the buffer is on the donors after a
    detach: attached again, the device reads it back. (A block device has
    the buffer only as a volatile write cache, --writeback-ack-early.)"""
    (d,) = donors(1)
    args = ["--writeback-buffer", "4M", "--writeback-ack-early"]
    dev = client.attach([d], mode="none", size="64M", extra=args)
    io = Direct(teardown, dev)
    for k in range(64):
        io.write(pattern(k), k * PAGE)
    io.close()
    wait_for(lambda: writeback(client).get("pages_in", 0) >= 64, 30, "64 pages through the buffer")
    client.detach()
    dev = client.attach([d], new_device=False, extra=args)
    io = Direct(teardown, dev)
    for k in range(64):
        assert io.read(PAGE, k * PAGE) == pattern(k), f"page {k} lost at detach"
    io.close()
    client.detach()


LIMIT = 32 * MIB


@pytest.mark.parametrize("mode", ["mirror", "parity", "ec"])
def test_buffered_swap_survives_a_donor_kill(mode, teardown, donors, client, memhog, tmp_path):
    """A job swapping through the buffer (swap that is not restartable),
    a donor killed while it runs: the buffer keeps draining through the
    survivors and every page checks."""
    extra = {"mirror": [], "parity": ["--parity-width", "3"], "ec": ["--data", "2", "--parity", "1"]}[mode]
    ds = donors({"mirror": 3, "parity": 4, "ec": 4}[mode], budget="512M")
    dev = client.attach(ds, mode=mode, size="256M", swap=True,
                        extra=[*extra, "--no-restartable", "--writeback-buffer", "2M", "--request-timeout", "2"])
    job = Job(teardown, [memhog, str(3 * LIMIT), "--passes", "2"], LIMIT, tmp_path / "memhog.log", dev)
    wait_for(lambda: job.swapped() >= 16 * MIB or not job.alive(), 300, "16 MiB swapped out")
    assert job.alive(), job.proc.log_tail()
    victim = busiest(client, ds)
    victim.kill9()
    client.wait_status(lambda s: donor_report(s, victim.name)["failed"], 60, f"donor {victim.name} failed")
    out = job.finish()
    assert "memhog: OK" in out, out
    wb = writeback(client)
    assert wb["pages_drained"] > 0 and wb["drain_failures"] == 0, wb
    assert client.device_status()["totals"]["lost"] == 0
    client.detach()


def test_kill9_of_a_restartable_device(teardown, donors, client, memhog, tmp_path):
    """A restartable device has no buffer, even when one is asked for: a
    write is acknowledged once on the donors, so the serving process
    killed with -9 three times while a job swaps loses no page the kernel
    was told was written."""
    ds = donors(4)
    dev = client.attach(ds, mode="parity", size="256M", swap=True,
                        extra=["--restartable", "--writeback-buffer", "2M", "--parity-width", "3"])
    job = Job(teardown, [memhog, str(3 * LIMIT), "--passes", "2"], LIMIT, tmp_path / "memhog.log", dev)
    wait_for(lambda: job.swapped() >= 16 * MIB or not job.alive(), 300, "16 MiB swapped out")
    for k in range(3):
        assert job.alive(), job.proc.log_tail()
        assert writeback(client).get("capacity_bytes", 0) == 0, writeback(client)
        before = client.device_status()["totals"]["requests"]
        wait_for(lambda: client.device_status()["totals"]["requests"] > before or not job.alive(), 60,
                 "requests in flight", interval=0.05)
        old = client.kill_serving_process()
        wait_for(lambda: client.holder().get("ready_pid") not in (None, old), 60, f"restart {k + 1}")
    out = job.finish()
    assert "memhog: OK" in out, out
    client.detach()


def test_stages_add_up_to_the_requests_time(teardown, donors, client):
    """For requests the test times itself (4 KiB O_DIRECT reads and writes
    through the loop device, one at a time, to a donor that takes 20 ms per
    request), the serving process's stages add up to within 10% of the
    time the test measured: no hop is left out or counted twice. (The
    kernel's own part, the loop device and FUSE, is outside the serving
    process: the donor's delay keeps it small against the 10%, even with
    the machine's load adding a millisecond per request.)"""
    (d,) = donors(1, filters=["delay"], filter_params={"delay-read": "20ms", "delay-write": "20ms"})
    dev = client.attach([d], mode="none", size="64M", extra=["--writeback-buffer", "0"])
    io = Direct(teardown, dev)
    io.write(pattern(0, 64), 0)  # places the extent

    def stage_seconds(op: str) -> tuple[float, int]:
        st = [r for r in client.device_status().get("stages", []) if r["op"] == op]
        total = sum(r["seconds"] for r in st)
        commits = next((r["count"] for r in st if r["stage"] == "commit"), 0)
        return total, commits

    def settled(op):
        """Stage totals once status.json (rewritten about once a second)
        shows the same counts twice in a row."""
        last = [None]

        def same():
            now = stage_seconds(op)
            ok = last[0] is not None and now[1] == last[0][1]
            last[0] = now
            return now if ok else None
        return wait_for(same, 30, f"{op} stages settled", interval=1.2)

    n = 20
    for op in ("read", "write"):
        before, count0 = settled(op)
        took = 0.0
        for k in range(n):
            t0 = time.monotonic()
            if op == "read":
                io.read(PAGE, (k % 64) * PAGE)
            else:
                io.write(pattern(k), (k % 64) * PAGE)
            took += time.monotonic() - t0
        wait_for(lambda: stage_seconds(op)[1] >= count0 + n, 30, f"{n} {op}s counted")
        after, count1 = settled(op)
        assert count1 == count0 + n, f"{op}: {count1 - count0} requests counted, {n} made"
        staged = after - before
        assert abs(staged - took) <= 0.1 * took, \
            f"{op}: stages add up to {staged * 1e3:.1f} ms, the test measured {took * 1e3:.1f} ms"
    io.close()
    client.detach()
