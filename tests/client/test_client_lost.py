"""Lost extents as a new user meets them (issue 25, hazard 7): a parity
block device on 3 donors is written and detached, its donors restart (their
memory is gone), and the same state directory is attached again. attach
says loudly which extents are lost and what to do, status shows them, a
write into a lost extent works (the pages not written keep failing), and
`pagerctl forget-lost` makes them read as zeros. A swap attach over a state
directory whose donors lost everything starts from an empty map: mkswap
and swapon work."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from netpager_testkit.client import MIB, pagerctl_status, run_pagerctl
from netpager_testkit.attach import swaps

PAGE = 4096


def pwrite_direct(device: str, data: bytes, off: int) -> None:
    buf = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT wants
    buf.write(data)
    fd = os.open(device, os.O_WRONLY | os.O_DIRECT)
    try:
        assert os.pwritev(fd, [buf], off) == len(data)
    finally:
        os.close(fd)


def pread_direct(device: str, length: int, off: int) -> bytes:
    buf = mmap.mmap(-1, length)
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
    return bytes(buf[:n])


def restart_all(ds) -> None:
    for d in ds:
        d.restart()


def test_lost_extents_are_named_and_can_be_written_forgotten_or_swapped_over(teardown, donors,
                                                                              client):
    ds = donors(3)
    device = client.attach(ds, mode="parity", size="64M")
    assert "LOST" not in client.attach_stderr
    for off in range(0, 8 * MIB, MIB):
        pwrite_direct(device, bytes([off // MIB + 1]) * MIB, off)
    client.detach()
    restart_all(ds)

    device = client.attach([], new_device=False)
    err = client.attach_stderr
    assert "WARNING" in err and "are LOST: 0.." in err, err
    assert f"pagerctl forget-lost --state-dir {client.state_dir.resolve()}" in err, err
    totals = client.device_status()["totals"]
    assert totals["lost"] > 0 and totals["lost_extents"][0] == 0, totals
    table = pagerctl_status(client.state_dir).stdout
    assert "LOST extents: 0.." in table, table
    with pytest.raises(OSError) as e:
        pread_direct(device, PAGE, 0)
    assert e.value.errno == errno.EIO

    # A write into a lost extent: it reads back, its neighbours still fail.
    pwrite_direct(device, b"\x5a" * PAGE, 0)
    assert pread_direct(device, PAGE, 0) == b"\x5a" * PAGE
    with pytest.raises(OSError) as e:
        pread_direct(device, PAGE, PAGE)
    assert e.value.errno == errno.EIO
    st = client.wait_status(lambda s: s["totals"]["unfound_pages"] > 0, 30,
                            "the extent written into to show unfound pages")
    assert st["totals"]["unfound_extents"][0] == 0, st["totals"]
    assert "UNFOUND" in pagerctl_status(client.state_dir).stdout

    out = run_pagerctl(["forget-lost", "--state-dir", client.state_dir]).stdout
    assert "read as zeros now" in out, out
    assert pread_direct(device, PAGE, PAGE) == bytes(PAGE)
    assert pread_direct(device, PAGE, 0) == b"\x5a" * PAGE
    client.wait_status(lambda s: (s["totals"]["lost"], s["totals"]["unfound_pages"]) == (0, 0),
                       30, "nothing lost after forget-lost")
    p = run_pagerctl(["forget-lost", "--state-dir", client.state_dir], check=False)
    assert p.returncode != 0 and "nothing is lost" in p.stderr, p.stderr
    client.detach()
    p = run_pagerctl(["forget-lost", "--state-dir", client.state_dir, "--extents", "0..3"],
                     check=False)
    assert p.returncode != 0 and "is not attached" in p.stderr, p.stderr

    # The donors lose everything again; swap over the same state directory
    # starts afresh (mkswap writes where the old map says data was lost).
    restart_all(ds)
    device = client.attach([], new_device=False, swap=True)
    assert "LOST" not in client.attach_stderr, client.attach_stderr
    assert device in swaps(), swaps()
    totals = client.device_status()["totals"]
    assert (totals["lost"], totals["unfound_pages"]) == (0, 0), totals
    client.detach()
    assert client.leftovers() == []
