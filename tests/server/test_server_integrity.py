"""Data written to a donor through real NBD clients comes back bit-exact:
libnbd (aligned, unaligned, multi-page, trim, zero, block status) and fio
with crc32c verification through its nbd engine."""

from __future__ import annotations

import nbd
import pytest

from netpager_testkit.nbdio import PAGE, allocation, connect, fio, hole_bytes, pattern

MIB = 1 << 20


def test_libnbd_round_trip_with_trim_and_zero(start_donor):
    donor = start_donor(size="32M")
    size = 64 * MIB
    writes = [
        (0, PAGE),                      # one aligned page
        (1000, 10_000),                 # unaligned, spans three pages
        (8 * MIB, MIB),                 # 256 pages at once
        (20 * MIB + 4095, 2),           # two bytes straddling a page boundary
        (size - PAGE - 100, PAGE + 100),  # ends exactly at the end of the export
    ]
    with connect(donor.uri(f"data@{size >> 20}M"), allocation=True) as h:
        assert h.get_size() == size
        assert h.can_trim() and h.can_zero()
        for off, n in writes:
            h.pwrite(pattern("a", off, n), off)
        for off, n in writes:
            assert h.pread(n, off) == pattern("a", off, n), f"{n} bytes at {off}"
        # Never written: zeros, reported as a hole.
        assert h.pread(PAGE, 4 * MIB) == bytes(PAGE)
        assert hole_bytes(allocation(h, 4 * MIB, MIB)) == MIB
        assert hole_bytes(allocation(h, 8 * MIB, MIB)) == 0

        # Trim the middle half of the 1 MiB run: zeros there, data around it.
        h.trim(MIB // 2, 8 * MIB + MIB // 4)
        assert h.pread(MIB // 2, 8 * MIB + MIB // 4) == bytes(MIB // 2)
        assert h.pread(MIB // 4, 8 * MIB) == pattern("a", 8 * MIB, MIB // 4)
        assert h.pread(MIB // 4, 8 * MIB + 3 * MIB // 4) == pattern("a", 8 * MIB + 3 * MIB // 4, MIB // 4)
        assert hole_bytes(allocation(h, 8 * MIB + MIB // 4, MIB // 2)) == MIB // 2

        # Zero part of a page: only those bytes change.
        h.zero(100, 200)
        page0 = bytearray(pattern("a", 0, PAGE))
        page0[200:300] = bytes(100)
        assert h.pread(PAGE, 0) == bytes(page0)

        # Trim an unaligned range inside the unaligned write.
        h.trim(3000, 2000)
        expect = bytearray(pattern("a", 1000, 10_000))
        expect[1000:4000] = bytes(3000)
        assert h.pread(10_000, 1000) == bytes(expect)

        # Zero whole pages, then rewrite them with other data.
        h.zero(2 * PAGE, size - 2 * PAGE)
        assert h.pread(2 * PAGE, size - 2 * PAGE) == bytes(2 * PAGE)
        h.pwrite(pattern("b", size - 2 * PAGE, 2 * PAGE), size - 2 * PAGE)
        assert h.pread(2 * PAGE, size - 2 * PAGE) == pattern("b", size - 2 * PAGE, 2 * PAGE)

        with pytest.raises(nbd.Error):
            h.pwrite(b"x" * PAGE, size - PAGE // 2)


def test_data_outlives_the_connection(start_donor):
    donor = start_donor()
    with connect(donor.uri("keep")) as h:
        h.pwrite(pattern("k", 0, 256 * 1024), 12 * PAGE)
        h.flush()
    with connect(donor.uri("keep")) as h:
        assert h.pread(256 * 1024, 12 * PAGE) == pattern("k", 0, 256 * 1024)


def test_fio_crc32c_verify_with_trim(start_donor, tmp_path):
    donor = start_donor(size="64M")
    uri = donor.uri("fio@64M")
    common = ["--ioengine=nbd", f"--uri={uri}", "--verify=crc32c", "--size=32M"]

    # Mixed block sizes, several requests in flight, verified after writing.
    fio(common + ["--name=randwrite", "--rw=randwrite", "--bsrange=512-64k",
                  "--iodepth=8", "--do_verify=1"], tmp_path / "fio-randwrite.log")

    # Trim then write each block. NBD does not order in-flight requests, so
    # one at a time: otherwise a trim may land after the write it precedes.
    fio(common + ["--name=trimwrite", "--rw=trimwrite", "--bs=4k", "--iodepth=1",
                  "--do_verify=0"], tmp_path / "fio-trimwrite.log")
    fio(common + ["--name=trimwrite", "--rw=write", "--bs=4k", "--iodepth=8",
                  "--verify_only=1"], tmp_path / "fio-verify1.log")

    # Trim the first half: it reads as zeros and holes, the second half verifies.
    fio(["--ioengine=nbd", f"--uri={uri}", "--name=trim", "--rw=trim", "--bs=64k",
         "--size=16M", "--iodepth=8"], tmp_path / "fio-trim.log")
    fio(["--ioengine=nbd", f"--uri={uri}", "--verify=crc32c", "--name=trimwrite",
         "--rw=write", "--bs=4k", "--offset=16M", "--size=16M", "--iodepth=8",
         "--verify_only=1"], tmp_path / "fio-verify2.log")
    with connect(uri, allocation=True) as h:
        assert h.pread(16 * MIB, 0) == bytes(16 * MIB)
        assert hole_bytes(allocation(h, 0, 16 * MIB)) == 16 * MIB
    status = donor.status()
    assert status.trims > 0
    [usage] = [e for e in status.exports if e.name == "fio"]
    assert usage.used_bytes == 16 * MIB, "the trimmed half holds no pages, the rest all of them"
