"""Memory a donor is given back goes back to its node: the nbdkit process's
resident set shrinks when clients trim their pages, and does not creep up
over many rounds of clients that come, write, trim and go.

RSS is read from /proc/PID/status of the donor's nbdkit; the margins are in
bytes, never in time. Both tests run with mlock=true (the default), where
freed memory could otherwise only ever be reused, never returned.
"""

from __future__ import annotations

import threading

from netpager_testkit import wait_for
from netpager_testkit.nbdio import connect, pattern

MIB = 1 << 20


def proc_status(pid: int, field: str) -> int:
    """A size field (VmRSS, VmLck) of /proc/PID/status in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no {field} line")


def rss(pid: int) -> int:
    return proc_status(pid, "VmRSS")


def test_rss_returns_after_trimming_everything(start_donor):
    donor = start_donor(budget="512M", size="1G")
    uri = donor.uri("rss@512M")
    # A first connection settles nbdkit's own per-connection memory.
    with connect(uri) as h:
        h.pread(4096, 0)
    start = rss(donor.pid)
    chunk = pattern("rss", 0, MIB)
    with connect(uri) as h:
        for i in range(256):
            h.pwrite(chunk, i * MIB)
        full = rss(donor.pid)
        locked = proc_status(donor.pid, "VmLck")
        assert donor.status().used_bytes == 256 * MIB
        h.trim(256 * MIB, 0)
        assert donor.status().used_bytes == 0
    after = rss(donor.pid)
    print(f"RSS start {start / MIB:.1f} MiB, 256 MiB written {full / MIB:.1f} MiB, "
          f"all trimmed {after / MIB:.1f} MiB")
    assert full >= start + 200 * MIB, "the pages were resident while held"
    assert locked >= 256 * MIB, f"mlock=true locks the pages: VmLck {locked / MIB:.1f} MiB"
    assert after <= start + 16 * MIB, (
        f"RSS {after / MIB:.1f} MiB after trimming everything, {start / MIB:.1f} MiB at start")


def test_rss_does_not_creep_over_rounds_of_clients(start_donor):
    donor = start_donor(budget="512M", size="1G")
    clients, per_client = 16, 2 * MIB
    rounds = 50

    def client(i: int, errors: list) -> None:
        try:
            off = i * per_client
            with connect(donor.uri(f"round-{i % 4}@64M")) as h:
                for o in range(0, per_client, MIB):
                    h.pwrite(pattern(f"c{i}", off + o, MIB), off + o)
                assert h.pread(4096, off) == pattern(f"c{i}", off, 4096)
                h.trim(per_client, off)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    samples = []
    for _ in range(rounds):
        errors: list = []
        threads = [threading.Thread(target=client, args=(i, errors)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        samples.append(rss(donor.pid))
    assert donor.status().used_bytes == 0
    first, last = max(samples[:10]), max(samples[-10:])
    print("RSS per round (MiB):", " ".join(f"{s / MIB:.0f}" for s in samples))
    assert last <= first + 8 * MIB, (
        f"RSS crept from {first / MIB:.1f} MiB (max of rounds 1-10) to "
        f"{last / MIB:.1f} MiB (max of rounds {rounds - 9}-{rounds})")


def test_slabs_left_part_used_are_given_back(start_donor):
    """Three pages of four trimmed all over the export leave every 2 MiB
    slab a quarter used: the donor moves the pages left into fewer slabs
    and unmaps the rest, without losing a byte."""
    donor = start_donor(budget="512M", size="1G")
    chunk = pattern("scatter", 0, 64 * MIB)
    with connect(donor.uri("scatter@64M")) as h:
        for off in range(0, 64 * MIB, 4 * MIB):
            h.pwrite(chunk[off:off + 4 * MIB], off)
        full = rss(donor.pid)
        for page in range(64 * MIB // 4096):
            if page % 4:
                h.trim(4096, page * 4096)
        assert donor.status().used_bytes == 16 * MIB
        wait_for(lambda: rss(donor.pid) <= full - 40 * MIB, 60,
                 f"the donor's RSS to fall 40 MiB below {full / MIB:.0f} MiB, 16 MiB of 64 kept")
        kept = b"".join(chunk[p * 4096:(p + 1) * 4096] if p % 4 == 0 else bytes(4096)
                        for p in range(64 * MIB // 4096))
        assert h.pread(64 * MIB, 0) == kept
