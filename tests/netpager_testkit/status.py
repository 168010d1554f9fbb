"""Client of the donor status endpoint, on the real wire format.

The Python classes are generated from `proto/proto/netpager.proto` with
`protoc --python_out` into a temporary directory the first time they are
needed, so the tests speak exactly what the Rust side speaks. Framing is
protobuf's length-delimited form: a varint byte count, then the message.

A donor started with `psk=FILE` answers only requests signed with the lab
key: `LabKey` signs and checks exactly as `proto/src/auth.rs` does.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from .paths import repo_root

MAX_MESSAGE_BYTES = 1 << 20

_pb2 = None


def pb2():
    """The generated `netpager_pb2` module (generated once per process)."""
    global _pb2
    if _pb2 is None:
        proto_dir = repo_root() / "proto" / "proto"
        out = tempfile.mkdtemp(prefix="netpager-pb2-")
        # Once imported the module lives in memory: the directory can go at
        # once, so no exit path (not even SIGKILL) leaves it behind.
        try:
            subprocess.run(["protoc", f"--proto_path={proto_dir}", f"--python_out={out}",
                            str(proto_dir / "netpager.proto")], check=True)
            sys.path.insert(0, out)
            try:
                _pb2 = importlib.import_module("netpager_pb2")
            finally:
                sys.path.remove(out)
        finally:
            shutil.rmtree(out)
    return _pb2


class StatusError(RuntimeError):
    """The status endpoint answered with an error body, or not at all."""


REQUEST_TAG = b"netpager-status-request-v1"
REPLY_TAG = b"netpager-status-reply-v1"
NONCE_BYTES = 16


class LabKey:
    """The lab's key from a TLS-PSK file (`username:hexkey` lines)."""

    def __init__(self, username: str, key: bytes):
        self.username, self.key = username, key

    @classmethod
    def from_psk_file(cls, path, username: str | None = None) -> "LabKey":
        """The key of `username`, or of the first line (as the donor takes it)."""
        for line in open(path).read().splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            user, hexkey = line.split(":", 1)
            if username is None or user == username:
                return cls(user, bytes.fromhex(hexkey.strip()))
        raise ValueError(f"{path}: no key for {username or 'any user'}")

    def _mac(self, *parts: bytes) -> bytes:
        m = hmac.new(self.key, digestmod=hashlib.sha256)
        for p in parts:
            m.update(p)
        return m.digest()

    def sign_request(self, request, timestamp_ms: int | None = None, nonce: bytes | None = None):
        """Adds a fresh Auth to `request` (in place) and returns it."""
        nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        request.ClearField("auth")
        mac = self._mac(REQUEST_TAG, ts.to_bytes(8, "little"), nonce, request.SerializeToString())
        request.auth.timestamp_ms, request.auth.nonce, request.auth.mac = ts, nonce, mac
        return request

    def reply_mac(self, nonce: bytes, reply) -> bytes:
        unsigned = type(reply)()
        unsigned.CopyFrom(reply)
        unsigned.ClearField("mac")
        return self._mac(REPLY_TAG, nonce, unsigned.SerializeToString(deterministic=True))

    def verify_reply(self, nonce: bytes, reply) -> bool:
        return hmac.compare_digest(self.reply_mac(nonce, reply), reply.mac)


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise StatusError(f"{peer}: connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_delimited(sock: socket.socket, cls, peer: str):
    """Reads one length-delimited message of type `cls`; None on a clean EOF."""
    length = 0
    for i in range(10):
        b = sock.recv(1)
        if not b:
            if i == 0:
                return None
            raise StatusError(f"{peer}: connection closed inside a length prefix")
        length |= (b[0] & 0x7F) << (7 * i)
        if not b[0] & 0x80:
            break
    else:
        raise StatusError(f"{peer}: length prefix longer than 10 bytes")
    if length > MAX_MESSAGE_BYTES:
        raise StatusError(f"{peer}: reply announces {length} bytes, over {MAX_MESSAGE_BYTES}")
    msg = cls()
    msg.ParseFromString(_recv_exact(sock, length, peer))
    return msg


def delimited(msg) -> bytes:
    body = msg.SerializeToString()
    return encode_varint(len(body)) + body


class StatusClient:
    """One donor's status endpoint at `host:port`; with `key`, requests are
    signed and replies must carry the key's signature."""

    def __init__(self, host: str, port: int, timeout: float = 5.0, key: LabKey | None = None):
        self.host, self.port, self.timeout, self.key = host, port, timeout, key
        self.peer = f"{host}:{port}"

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def exchange(self, request):
        """Sends `request` as it is (signed or not) on a new connection;
        returns the Reply unchecked."""
        with self.connect() as sock:
            sock.sendall(delimited(request))
            reply = read_delimited(sock, pb2().Reply, self.peer)
        if reply is None:
            raise StatusError(f"{self.peer}: closed the connection without a reply")
        return reply

    def call(self, request):
        """Sends one Request (signed when we hold a key), returns the Reply."""
        if self.key is None:
            return self.exchange(request)
        self.key.sign_request(request)
        reply = self.exchange(request)
        if not self.key.verify_reply(request.auth.nonce, reply):
            raise StatusError(f"{self.peer}: reply not signed by the lab key: {reply}")
        return reply

    def _status_of(self, reply):
        which = reply.WhichOneof("body")
        if which == "status":
            return reply.status
        if which == "error":
            raise StatusError(f"{self.peer} refused: {reply.error}")
        raise StatusError(f"{self.peer}: reply without a body")

    def query(self):
        """The donor's DonorStatus."""
        pb = pb2()
        return self._status_of(self.call(pb.Request(status=pb.StatusQuery())))

    def drain(self, drain: bool):
        """Starts or stops draining; returns the status afterwards."""
        pb = pb2()
        return self._status_of(self.call(pb.Request(drain=pb.DrainCommand(drain=drain))))

    def raw(self, data: bytes, read_timeout: float = 2.0, close_write: bool = True) -> bytes:
        """Sends raw bytes (malformed requests); returns whatever comes back
        until the donor closes the connection or `read_timeout` passes."""
        with self.connect() as sock:
            try:
                sock.sendall(data)
                if close_write:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the donor may hang up before taking it all in
            sock.settimeout(read_timeout)
            got = bytearray()
            try:
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    got += chunk
            except (socket.timeout, ConnectionResetError):
                pass
            return bytes(got)


def parse_reply(data: bytes):
    """Decodes a length-delimited Reply from raw bytes (None if empty)."""
    if not data:
        return None
    length, i = 0, 0
    while True:
        b = data[i]
        length |= (b & 0x7F) << (7 * i)
        i += 1
        if not b & 0x80:
            break
    reply = pb2().Reply()
    reply.ParseFromString(data[i:i + length])
    return reply


def state_word(status) -> str:
    """idle / busy / draining, as the Rust side's DonorState::word()."""
    name = pb2().DonorState.Name(status.state)
    return name.removeprefix("DONOR_STATE_").lower()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def format_table(statuses: list) -> str:
    """Donors side by side, then each donor's exports."""
    rows = [
        ("node", lambda s: s.node_id),
        ("state", state_word),
        ("reason", lambda s: s.state_reason or "-"),
        ("budget", lambda s: _mib(s.budget_bytes)),
        ("used", lambda s: _mib(s.used_bytes)),
        ("free", lambda s: _mib(s.free_bytes)),
        ("reserve", lambda s: _mib(s.reserve_bytes)),
        ("MemAvailable", lambda s: _mib(s.mem_available_bytes)),
        ("age of x-th oldest", lambda s: f"x={s.age_x}: {s.age_x_ms} ms"),
        ("utilisation / U*", lambda s: f"{s.utilisation:.3f} / {s.u_star:.2f} (unused {s.u_unused:.3f})"),
        ("mean service", lambda s: f"{s.mean_service_us:.1f} us"),
        ("reads / writes", lambda s: f"{s.reads} / {s.writes}"),
        ("bytes read / written", lambda s: f"{_mib(s.bytes_read)} / {_mib(s.bytes_written)}"),
        ("trims / zeroes", lambda s: f"{s.trims} / {s.zeroes}"),
        ("ENOSPC refusals", lambda s: str(s.enospc)),
        ("uptime", lambda s: f"{s.uptime_ms / 1000:.1f} s"),
    ]
    cells = [[label] + [fn(s) for s in statuses] for label, fn in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    for s in statuses:
        if s.exports:
            lines.append("")
            lines.append(f"exports of {s.node_id}:")
            w = max(len(e.name) for e in s.exports)
            for e in s.exports:
                lines.append(f"  {e.name.ljust(w)}  size {_mib(e.size_bytes):>12}  used {_mib(e.used_bytes):>12}")
    return "\n".join(lines)
