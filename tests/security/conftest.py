"""Fixtures of the security tests: the lab's keys, donors that require them,
and the tools that compute export names."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest

from netpager_testkit import FakeMeminfo

GIB = 1 << 30
# Clients the tests play; the lab's TLS-PSK file has a line for each, all
# with the lab key, as the Ansible roles write it (clients present their id
# as the TLS user name).
CLIENTS = ("c1", "c2")


@dataclass
class Keys:
    """Key files of one test: the lab's, another lab's, the export secret."""

    lab_psk: Path
    wrong_psk: Path
    export_secret: Path
    secret: bytes

    def token(self, client: str) -> str:
        """The export token, computed here independently of the Rust code."""
        mac = hmac.new(self.secret, b"netpager-export-v1" + client.encode(), hashlib.sha256)
        return mac.hexdigest()[:32]

    def export(self, client: str, size: str | None = None) -> str:
        name = f"{client}~{self.token(client)}"
        return f"{name}@{size}" if size else name


def write_psk(path: Path, key_hex: str, users=("lab",) + CLIENTS) -> Path:
    path.write_text("".join(f"{u}:{key_hex}\n" for u in users))
    path.chmod(0o600)
    return path


@pytest.fixture
def keys(tmp_path) -> Keys:
    secret = secrets.token_bytes(32)
    export_secret = tmp_path / "export.secret"
    export_secret.write_text(secret.hex() + "\n")
    export_secret.chmod(0o600)
    return Keys(
        lab_psk=write_psk(tmp_path / "lab.psk", secrets.token_hex(32)),
        wrong_psk=write_psk(tmp_path / "wrong.psk", secrets.token_hex(32)),
        export_secret=export_secret,
        secret=secret,
    )


@pytest.fixture
def meminfo(tmp_path):
    """A fake meminfo: 16 GiB total, 12 GiB available."""
    return FakeMeminfo(tmp_path / "meminfo", total=16 * GIB, available=12 * GIB)


@pytest.fixture
def start_donors(cluster, meminfo):
    """Starts n pager-server donors judged on the fake meminfo; keyword
    arguments go to `Cluster.start_donors`."""

    def start(n: int = 1, **params):
        params.setdefault("meminfo", meminfo.path)
        params.setdefault("poll_ms", 50)
        params.setdefault("reserve", "1G")
        params.setdefault("budgets", "256M")
        params.setdefault("size", "64M")
        return cluster.start_donors(n, **params)

    return start
