"""Fixtures for the donor's end-to-end tests."""

from __future__ import annotations

import pytest

from netpager_testkit import FakeMeminfo

GIB = 1 << 30


@pytest.fixture
def meminfo(tmp_path):
    """A fake meminfo: 16 GiB total, 12 GiB available until a test says otherwise."""
    return FakeMeminfo(tmp_path / "meminfo", total=16 * GIB, available=12 * GIB)


@pytest.fixture
def start_donor(cluster, meminfo):
    """Starts one pager-server donor judged on the fake meminfo (never busy
    from the machine's load: the harness's default)."""

    def start(**params):
        params.setdefault("meminfo", meminfo.path)
        params.setdefault("poll_ms", 50)
        params.setdefault("reserve", "1G")
        params.setdefault("budget", "256M")
        return cluster.start_donors(1, **params)[0]

    return start
