"""The budget caps what a donor stores; memory pressure on the donor's own
node (faked through `meminfo=`) and the drain command stop new pages
without losing stored ones. The data is random (it does not compress), so
every page takes a page of the budget whatever the donor's `compress=`; a
page of one repeated byte would take none."""

from __future__ import annotations

import nbd
import pytest

from netpager_testkit import state_word
from netpager_testkit.nbdio import PAGE, connect, pattern

MIB = 1 << 20
GIB = 1 << 30


def expect_enospc(h, data: bytes, offset: int) -> None:
    with pytest.raises(nbd.Error) as e:
        h.pwrite(data, offset)
    assert e.value.errno == "ENOSPC", e.value


def test_writes_past_the_budget_fail_with_enospc(start_donor):
    budget_pages = 256
    donor = start_donor(budget=budget_pages * PAGE)
    with connect(donor.uri("x@8M")) as x, connect(donor.uri("y@8M")) as y:
        # Half the budget on each export, in 16-page writes.
        for i in range(budget_pages // 2 // 16):
            x.pwrite(pattern("x", i * 64 * 1024, 64 * 1024), i * 64 * 1024)
            y.pwrite(pattern("y", i * 64 * 1024, 64 * 1024), i * 64 * 1024)
        s = donor.status()
        assert (s.used_bytes, s.free_bytes) == (budget_pages * PAGE, 0)
        expect_enospc(x, pattern("x7", 0, PAGE), 4 * MIB)
        expect_enospc(y, pattern("y7", 0, 100), 6 * MIB + 5)
        # A write needing two new pages when none is free changes nothing:
        # it overlaps a stored page and a new one; the stored one keeps its data.
        expect_enospc(x, pattern("x9", 0, 2 * PAGE), budget_pages // 2 * PAGE - PAGE)
        # Overwriting stored pages needs no new page.
        x.pwrite(pattern("x2", 0, 3 * PAGE), 0)
        # Everything stored before is intact.
        half = budget_pages // 2 * PAGE
        assert x.pread(half, 0) == pattern("x2", 0, 3 * PAGE) + pattern("x", 3 * PAGE, half - 3 * PAGE)
        assert y.pread(half, 0) == pattern("y", 0, half)
        assert x.pread(PAGE, 4 * MIB) == bytes(PAGE)
        # Freeing one page makes room for exactly one.
        y.trim(PAGE, 0)
        x.pwrite(pattern("x5", 0, PAGE), 4 * MIB)
        expect_enospc(x, pattern("x5", PAGE, PAGE), 5 * MIB)
        assert x.pread(PAGE, 4 * MIB) == pattern("x5", 0, PAGE)
    s = donor.status()
    assert s.used_bytes == budget_pages * PAGE
    assert s.enospc == 4


def test_memory_pressure_drains_and_relief_restores(start_donor, meminfo):
    donor = start_donor(reserve="1G")
    assert state_word(donor.status()) == "idle"
    with connect(donor.uri("p@64M")) as h:
        h.pwrite(pattern("p", 0, 32 * PAGE), 0)

        meminfo.set(512 * MIB)
        s = donor.wait_state("draining")
        assert s.free_bytes == 0
        assert s.mem_available_bytes == 512 * MIB
        assert "MemAvailable" in s.state_reason and "reserve" in s.state_reason, s.state_reason
        expect_enospc(h, pattern("one", 0, PAGE), 40 * PAGE)
        # Stored pages are kept and may still be rewritten in place.
        assert h.pread(32 * PAGE, 0) == pattern("p", 0, 32 * PAGE)
        h.pwrite(pattern("q", 0, PAGE), 0)
        assert h.pread(PAGE, 0) == pattern("q", 0, PAGE)
        assert donor.status().used_bytes == 32 * PAGE

        meminfo.set(8 * GIB)
        s = donor.wait_state("idle")
        assert s.free_bytes == s.budget_bytes - 32 * PAGE
        h.pwrite(b"\x01" * PAGE, 40 * PAGE)
        assert h.pread(PAGE, 40 * PAGE) == b"\x01" * PAGE
        assert h.pread(31 * PAGE, PAGE) == pattern("p", PAGE, 31 * PAGE)


def test_drain_command(start_donor):
    donor = start_donor()
    client = donor.status_client()
    with connect(donor.uri("d")) as h:
        h.pwrite(pattern("d", 0, PAGE), 0)
        s = client.drain(True)
        assert state_word(s) == "draining"
        assert "drain requested" in s.state_reason, s.state_reason
        expect_enospc(h, pattern("two", 0, PAGE), 8 * PAGE)
        assert h.pread(PAGE, 0) == pattern("d", 0, PAGE)
        assert state_word(client.drain(False)) == "idle"
        h.pwrite(b"\x02" * PAGE, 8 * PAGE)


def test_budget_and_reserve_as_shares_of_memtotal(start_donor, meminfo):
    donor = start_donor(budget="25%", reserve="10%")
    s = donor.status()
    assert s.budget_bytes == meminfo.total // 4
    assert s.reserve_bytes == int(meminfo.total * 10 / 100.0)
