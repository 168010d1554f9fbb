"""The status endpoint reports what a known request pattern did, and bad
input on it never stops the donor."""

from __future__ import annotations

import socket

import pytest

from netpager_testkit import StatusError, state_word, wait_for
from netpager_testkit.nbdio import PAGE, connect, pattern
from netpager_testkit.status import encode_varint, parse_reply

MIB = 1 << 20
GIB = 1 << 30


def test_status_counts_a_known_pattern(start_donor, meminfo):
    donor = start_donor(budget="4M", age_x=4, u_star=0.3, node_id="donor-under-test")
    with connect(donor.uri("e1@64M")) as a, connect(donor.uri("e2@32M")) as b:
        for i in range(10):
            a.pwrite(pattern("a", i * 8 * PAGE, PAGE), i * 8 * PAGE)
        for i in range(3):
            b.pwrite(pattern("b", i * PAGE, PAGE), i * PAGE)
        a.pwrite(pattern("a2", 0, PAGE), 0)     # overwrite: no new page
        a.trim(PAGE, 8 * PAGE)                   # frees one page of e1
        b.zero(PAGE, 0)                          # frees one page of e2
        for i in range(5):
            a.pread(PAGE, i * 8 * PAGE)
    s = donor.status()
    used = (9 + 2) * PAGE
    assert s.node_id == "donor-under-test"
    assert state_word(s) == "idle"
    assert (s.budget_bytes, s.used_bytes, s.free_bytes) == (4 * MIB, used, 4 * MIB - used)
    assert {e.name: (e.size_bytes, e.used_bytes) for e in s.exports} == {
        "e1": (64 * MIB, 9 * PAGE), "e2": (32 * MIB, 2 * PAGE)}
    assert (s.writes, s.bytes_written) == (14, 14 * PAGE)
    assert (s.reads, s.bytes_read) == (5, 5 * PAGE)
    assert (s.trims, s.zeroes, s.enospc) == (1, 1, 0)
    assert s.page_size == 4096
    assert (s.reserve_bytes, s.mem_available_bytes) == (GIB, meminfo.available)
    assert s.age_x == 4
    assert s.u_star == pytest.approx(0.3)
    assert 0.0 <= s.utilisation <= 1.0
    assert s.u_unused == pytest.approx(max(0.0, 0.3 - s.utilisation))
    assert s.mean_service_us > 0
    assert s.uptime_ms > 0
    # Pages age while nobody touches them.
    first = s.age_x_ms
    wait_for(lambda: donor.status().age_x_ms > first, 10, "the 4th oldest page to age")


def _nbd_still_works(donor, tag: str) -> None:
    with connect(donor.uri("alive")) as h:
        h.pwrite(pattern(tag, 0, PAGE), 0)
        assert h.pread(PAGE, 0) == pattern(tag, 0, PAGE)


def _assert_error_or_nothing(raw: bytes, what: str) -> None:
    reply = parse_reply(raw)
    if reply is not None:
        assert reply.WhichOneof("body") == "error", f"{what}: {reply}"


def test_malformed_requests_leave_the_donor_serving(start_donor):
    donor = start_donor()
    client = donor.status_client()
    cases = {
        "endless varint": b"\xff" * 16,
        "huge length prefix": encode_varint(1 << 40),
        "length over the limit with a body": encode_varint((1 << 20) + 1) + b"\x00" * 1000,
        "truncated message": encode_varint(100) + b"\x0a" * 10,
        "undecodable body": encode_varint(5) + b"\xff" * 5,
        "random bytes": bytes(range(7, 250, 3)),
    }
    for what, data in cases.items():
        _assert_error_or_nothing(client.raw(data), what)
        assert client.query().node_id == donor.name, f"status endpoint gone after {what}"
        _nbd_still_works(donor, what)

    # An empty message is a request without a body: refused with a reason.
    reply = parse_reply(client.raw(encode_varint(0)))
    assert reply is not None and reply.WhichOneof("body") == "error" and reply.error

    # A peer that stalls halfway through its request does not block others.
    with client.connect() as stalled:
        stalled.sendall(encode_varint(50) + b"\x0a\x00")
        assert client.query().node_id == donor.name
        _nbd_still_works(donor, "stalled")

    # A pile of idle connections (the donor may refuse queries meanwhile)
    # neither stops NBD nor the endpoint once they are gone.
    idle = [client.connect() for _ in range(40)]
    try:
        _nbd_still_works(donor, "crowded")
    finally:
        for sock in idle:
            sock.close()

    def answers():
        try:
            return client.query()
        except (StatusError, OSError):
            return None

    assert wait_for(answers, 30, "the status endpoint after idle connections closed")
    assert donor.alive()


def test_status_port_speaks_only_the_protocol(start_donor):
    donor = start_donor()
    host, port = donor.status_addr
    # An HTTP request is just another malformed message.
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    _assert_error_or_nothing(got, "HTTP request")
    assert donor.status().node_id == donor.name
