"""Exports are isolated from each other, and memory a trim gave back never
carries old data into another export."""

from __future__ import annotations

import nbd
import pytest

from netpager_testkit.nbdio import PAGE, connect, pattern

MIB = 1 << 20


def test_one_export_never_sees_another(start_donor):
    donor = start_donor()
    offsets = [0, 5 * PAGE + 17, 3 * MIB]
    with connect(donor.uri("alpha@16M")) as a, connect(donor.uri("beta@16M")) as b:
        for off in offsets:
            a.pwrite(pattern("alpha", off, 3 * PAGE), off)
        for off in offsets:
            assert b.pread(3 * PAGE, off) == bytes(3 * PAGE), f"beta sees alpha's data at {off}"
        for off in offsets:
            b.pwrite(pattern("beta", off, PAGE), off)
        for off in offsets:
            assert a.pread(3 * PAGE, off) == pattern("alpha", off, 3 * PAGE)
            assert b.pread(PAGE, off) == pattern("beta", off, PAGE)
    usage = {e.name: e.logical_bytes for e in donor.status().exports}
    # Unaligned writes at 5 pages + 17 bytes touch one page more.
    assert usage["alpha"] == (3 + 4 + 3) * PAGE, usage
    assert usage["beta"] == (1 + 2 + 1) * PAGE, usage


def test_reused_memory_reads_as_zeros(start_donor):
    pages = 64
    donor = start_donor(budget=pages * PAGE)
    with connect(donor.uri("first@1M")) as first, connect(donor.uri("second@1M")) as second:
        # Fill the whole budget with data on the first export.
        first.pwrite(pattern("first", 0, pages * PAGE), 0)
        with pytest.raises(nbd.Error) as full:
            second.pwrite(b"\x01" * 512, 0)
        assert full.value.errno == "ENOSPC"
        # Give every page back, then let the second export take them all
        # with writes that cover only the start of each page.
        first.trim(pages * PAGE, 0)
        assert donor.status().used_bytes == 0
        for p in range(pages):
            second.pwrite(pattern("second", p * PAGE, 512), p * PAGE)
        # Pages written in part hold zeros elsewhere: they may compress.
        assert donor.status().logical_bytes == pages * PAGE
        for p in range(pages):
            got = second.pread(PAGE, p * PAGE)
            assert got[:512] == pattern("second", p * PAGE, 512)
            assert got[512:] == bytes(PAGE - 512), f"page {p} of 'second' carries old bytes"
        assert first.pread(pages * PAGE, 0) == bytes(pages * PAGE)


def test_export_names_sizes_and_default(start_donor):
    donor = start_donor(size="48M")
    with connect(donor.uri("sized@256M")) as h:
        assert h.get_size() == 256 * MIB
    with connect(donor.uri("plain")) as h:
        assert h.get_size() == 48 * MIB
    # The empty name is the export called "default".
    with connect(donor.uri("")) as h:
        h.pwrite(pattern("dflt", 0, PAGE), 7 * PAGE)
    with connect(donor.uri("default")) as h:
        assert h.pread(PAGE, 7 * PAGE) == pattern("dflt", 0, PAGE)
    # An existing export cannot be reopened with another size, and names
    # outside the allowed characters (a device part too) are refused.
    for bad in ["sized@128M", "a/b/c", "-dash", "a/-b"]:
        with pytest.raises(nbd.Error):
            with connect(donor.uri(bad)):
                pass
    names = sorted(e.name for e in donor.status().exports)
    assert names == ["default", "plain", "sized"], names
