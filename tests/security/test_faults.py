"""Donor faults seen from a client's connection: killed, hung, paused,
failing requests, restarted, and the status port flooded. Each test states
the outcome the donor guarantees; what the client device makes of it in
mirror and parity mode is tested in tests/client (see SECURITY.md)."""

from __future__ import annotations

import os
import random
import socket
import threading

import nbd
import pytest

from netpager_testkit import StatusError, pb2, wait_for
from netpager_testkit.nbdio import PAGE, pattern
from netpager_testkit.status import LabKey, delimited, encode_varint
from netpager_testkit.nbdio import connect

MIB = 1 << 20


def open_handle(uri: str) -> nbd.NBD:
    h = nbd.NBD()
    h.set_uri_allow_local_file(True)
    h.connect_uri(uri)
    return h


def wait_done(h: nbd.NBD, cookie: int) -> None:
    """Polls the handle until the command `cookie` completes (errors raise)."""
    while not h.aio_command_completed(cookie):
        h.poll(1000)


def assert_held(h: nbd.NBD, cookie: int) -> None:
    """The command has not completed after the handle had a while to read
    any reply: the donor holds it."""
    for _ in range(5):
        h.poll(100)
    assert not h.aio_command_completed(cookie), "a held donor answered"


def test_killed_donor_fails_fast_and_restarts_empty(start_donors, keys):
    """Expected: after kill -9 the next request on the donor's connection
    fails (an error, not a hang); the other donor keeps serving its pages;
    the restarted donor, on the same address and port, serves again, empty:
    its pages lived in the killed process (mirror/parity clients keep
    another copy: tests/client/test_client_failures.py)."""
    d1, d2 = start_donors(2, psk=keys.lab_psk)
    h1, h2 = open_handle(d1.uri("c1@8M")), open_handle(d2.uri("c1@8M"))
    try:
        for h in (h1, h2):
            h.pwrite(pattern("kill", 0, 4 * PAGE), 0)
        d1.kill9()
        with pytest.raises(nbd.Error):
            h1.pread(PAGE, 0)
        assert h2.pread(4 * PAGE, 0) == pattern("kill", 0, 4 * PAGE)
    finally:
        for h in (h1, h2):
            try:
                h.shutdown()
            except nbd.Error:
                pass  # h1's donor is gone
    d1.start()
    with connect(d1.uri("c1@8M")) as h:
        assert h.pread(4 * PAGE, 0) == bytes(4 * PAGE)
    assert d1.status().used_bytes == 0


def test_hung_donor_holds_requests_and_loses_nothing(start_donors, keys):
    """Expected: while the donor is stopped (SIGSTOP) a read waits and the
    status endpoint does not answer (a client's timeouts decide, see
    tests/client); after SIGCONT the read completes with the data written
    before, and the donor serves on."""
    (d,) = start_donors(1, psk=keys.lab_psk)
    h = open_handle(d.uri("c1@8M"))
    try:
        h.pwrite(pattern("hung", 0, 8 * PAGE), 0)
        d.sigstop()
        buf = nbd.Buffer(8 * PAGE)
        cookie = h.aio_pread(buf, 0)
        with pytest.raises(OSError):
            d.status_client(timeout=1).query()
        assert_held(h, cookie)
        d.sigcont()
        wait_done(h, cookie)
        assert bytes(buf.to_bytearray()) == pattern("hung", 0, 8 * PAGE)
        h.pwrite(pattern("after", 0, PAGE), 0)
        assert h.pread(PAGE, 0) == pattern("after", 0, PAGE)
    finally:
        # shutdown waits for the held read: never while the donor is stopped.
        d.sigcont()
        h.shutdown()
    assert d.status().state_reason


def test_paused_donor_holds_requests_and_keeps_status(start_donors, tmp_path):
    """Expected: behind nbdkit's pause filter, a write sent while paused is
    held before it reaches the store (the status still answers and counts
    one write); on resume it completes and reads back, nothing lost."""
    ctl_path = tmp_path / "pause.sock"
    (d,) = start_donors(1, filters=["pause"], filter_params={"pause-control": ctl_path})
    h = open_handle(d.uri("c1@8M"))
    ctl = socket.socket(socket.AF_UNIX)
    ctl.settimeout(30)
    try:
        h.pwrite(pattern("before", 0, 2 * PAGE), 0)
        ctl.connect(str(ctl_path))
        ctl.sendall(b"p")
        assert ctl.recv(1) == b"P"
        cookie = h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(pattern("paused", 0, 2 * PAGE))), 0)
        assert_held(h, cookie)
        assert d.status().writes == 1, "the held write reached the store"
        ctl.sendall(b"r")
        assert ctl.recv(1) == b"R"
        wait_done(h, cookie)
        assert h.pread(2 * PAGE, 0) == pattern("paused", 0, 2 * PAGE)
        assert d.status().writes == 2
    finally:
        # shutdown waits for the held write: never while the donor is paused.
        try:
            ctl.sendall(b"r")
        except OSError:
            pass  # never connected, or the donor is gone
        ctl.close()
        h.shutdown()


def test_failing_requests_change_nothing(start_donors, tmp_path):
    """Expected: behind nbdkit's error filter (error=EIO, error-rate=30%,
    injected while a flag file exists) every request either succeeds or
    fails with EIO; a failed write leaves the block as it was, a successful
    one is stored; once errors stop every block reads back as the last
    write that succeeded, and the donor never went down."""
    flag = tmp_path / "inject-errors"
    (d,) = start_donors(1, filters=["error"],
                        filter_params={"error": "EIO", "error-rate": "30%", "error-file": flag})
    block = 16 * 1024
    blocks = 64
    want = {}
    with connect(d.uri("c1@8M")) as h:
        for b in range(blocks):
            data = pattern(f"b{b}g0", 0, block)
            h.pwrite(data, b * block)
            want[b] = data
        flag.touch()
        failed = succeeded = 0
        rng = random.Random(6)
        for gen in range(1, 400):
            b = rng.randrange(blocks)
            try:
                if rng.random() < 0.5:
                    data = pattern(f"b{b}g{gen}", 0, block)
                    h.pwrite(data, b * block)
                    want[b] = data
                else:
                    assert h.pread(block, b * block) == want[b]
                succeeded += 1
            except nbd.Error as e:
                assert e.errno == "EIO", e
                failed += 1
        flag.unlink()
        assert failed and succeeded, (failed, succeeded)
        for b in range(blocks):
            assert h.pread(block, b * block) == want[b], f"block {b}"
    assert d.alive() and d.status().used_bytes == blocks * block


def test_status_flood_leaves_nbd_io_correct(start_donors, keys):
    """Expected: 4 threads flooding the keyed status port with random bytes,
    huge length prefixes, requests signed with a wrong key and connections
    that close at once do not disturb NBD I/O running meanwhile (every
    block reads back as written), the donor answers every signed status
    query asked during the flood (each within 3 tries of 5 s), and it
    answers afterwards."""
    (d,) = start_donors(1, psk=keys.lab_psk)
    host, port = d.status_addr
    wrong = LabKey.from_psk_file(keys.wrong_psk)
    pb = pb2()
    stop = threading.Event()
    sent = [0] * 4

    def flood(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            kind = rng.randrange(4)
            try:
                with socket.create_connection((host, port), timeout=2) as s:
                    if kind == 0:
                        s.sendall(os.urandom(rng.randrange(1, 4096)))
                    elif kind == 1:
                        s.sendall(encode_varint(1 << 40) + os.urandom(64))
                    elif kind == 2:
                        s.sendall(delimited(wrong.sign_request(pb.Request(status=pb.StatusQuery()))))
                    s.shutdown(socket.SHUT_WR)
                    while s.recv(4096):
                        pass
            except OSError:
                pass
            sent[i] += 1

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    block = 64 * 1024
    asked = answered = 0

    def ask_status() -> None:
        nonlocal asked, answered
        asked += 1
        for _ in range(3):
            try:
                d.status_client(timeout=5).query()
                answered += 1
                return
            except (OSError, StatusError):
                continue

    try:
        with connect(d.uri("c1@16M")) as h:
            for rnd in range(3):
                for b in range(16 * MIB // block):
                    h.pwrite(pattern(f"flood{rnd}", b * block, block), b * block)
                    if b % 64 == 0:
                        ask_status()
                for b in range(16 * MIB // block):
                    assert h.pread(block, b * block) == pattern(f"flood{rnd}", b * block, block)
                    if b % 64 == 0:
                        ask_status()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert sum(sent) > 0
    assert answered == asked, f"status unanswered during the flood: {answered} of {asked} answered"
    assert d.alive()

    def answers():
        try:
            return d.status()
        except (OSError, StatusError):
            return None

    assert wait_for(answers, 30, "the status endpoint after the flood").used_bytes == 16 * MIB
    print(f"status flood: {sum(sent)} garbage connections during the I/O, "
          f"{answered}/{asked} status queries answered meanwhile")
