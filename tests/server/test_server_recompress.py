"""The recompressor (`recompress=lz4hc`, on by default with compress=lz4, or
`recompress=zstd`): pages left untouched for `recompress-idle` are packed
again on the donor's idle CPU, the donor holds them in less memory, and
every byte reads back, before and after a rewrite."""

from __future__ import annotations

import random

import pytest

from netpager_testkit import wait_for
from netpager_testkit.nbdio import PAGE, connect

MIB = 1 << 20
WORDS = [b"donor", b"extent", b"epoch", b"page", b"swap", b"weight", b"hint", b"lab",
         b"client", b"budget", b"memory", b"idle", b"busy", b"node", b"rate", b"age"]


def text_pages(n: int, seed: int) -> bytes:
    """Pages of words from a small vocabulary with record numbers: lz4
    packs them, zstd's entropy coding and LZ4-HC's longer search for
    matches pack them further."""
    r = random.Random(seed)
    out = bytearray()
    while len(out) < n * PAGE:
        out += b"%06d " % r.randrange(1_000_000) + b" ".join(r.choices(WORDS, k=6)) + b"\n"
    return bytes(out[:n * PAGE])


@pytest.mark.parametrize("codec", [None, "zstd"], ids=["default", "zstd"])
def test_cold_pages_are_repacked_and_read_back(start_donor, codec):
    donor = start_donor(recompress_idle=1, **({"recompress": codec} if codec else {}))
    data = text_pages(1024, 1)
    with connect(donor.uri("c1@16M")) as h:
        for off in range(0, len(data), 64 * PAGE):
            h.pwrite(data[off:off + 64 * PAGE], off)
        lz4 = donor.status()
        assert lz4.compress == "lz4" and lz4.recompress == (codec or "lz4hc"), lz4
        assert lz4.logical_bytes == 4 * MIB and lz4.used_bytes < 4 * MIB, lz4
        # A second after their last write every page is cold; the
        # recompressor repacks them a poll at a time.
        st = wait_for(lambda: (s := donor.status()).recompressed_pages >= 512 and s, 60,
                      "the recompressor to repack the pages")
        assert st.recompress_saved_bytes > 0
        st = wait_for(lambda: (s := donor.status()).used_bytes < lz4.used_bytes * 0.9 and s, 60,
                      f"the donor to hold the pages in less than {lz4.used_bytes} bytes")
        assert st.logical_bytes == lz4.logical_bytes
        assert h.pread(len(data), 0) == data
        # Rewritten, in part and whole, pages are lz4 again and read back.
        new = text_pages(64, 2)
        h.pwrite(new[:1000], 100)
        h.pwrite(new, 512 * PAGE)
        want = data[:100] + new[:1000] + data[1100:512 * PAGE] + new + data[576 * PAGE:]
        assert h.pread(len(data), 0) == want
        h.trim(len(data), 0)
    wait_for(lambda: donor.status().used_bytes == 0, 30, "the trimmed pages' memory to go back")


def test_recompress_off_keeps_lz4(start_donor):
    donor = start_donor(recompress="off", recompress_idle=0)
    data = text_pages(256, 3)
    with connect(donor.uri("c1@16M")) as h:
        h.pwrite(data, 0)
        used = donor.status().used_bytes
        # Many polls (50 ms each) go by: nothing is repacked.
        first = donor.status().uptime_ms
        wait_for(lambda: donor.status().uptime_ms > first + 1000, 30, "a second of polls")
        st = donor.status()
        assert (st.recompress, st.recompressed_pages, st.used_bytes) == ("", 0, used), st
        assert h.pread(len(data), 0) == data


def test_recompress_needs_lz4(start_donor):
    """recompress=zstd with compress=zstd is refused at start, naming both;
    so is a codec the donor does not have."""
    with pytest.raises(RuntimeError, match="recompress=zstd needs compress=lz4"):
        start_donor(compress="zstd", recompress="zstd")
    with pytest.raises(RuntimeError, match="recompress.*expected zstd, lz4hc or off"):
        start_donor(recompress="lz4")
