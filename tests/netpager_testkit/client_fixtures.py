"""pytest fixtures for tests that drive the client (tests/client, tests/faults):
donors for a client and clients driven through pagerctl. A conftest imports
the ones it uses (`from netpager_testkit.client_fixtures import donors, ...`)."""

from __future__ import annotations

import pytest

from .ci import skip_or_fail
from .client import PagerClient, client_plugin
from .paths import pagerctl


@pytest.fixture
def client_built():
    """pagerctl and the client plugin; the test is skipped when not built
    (failed under CI=true)."""
    for path in (pagerctl(), client_plugin()):
        if not path.exists():
            skip_or_fail(f"client not built: {path} missing (run `make build`, or set NETPAGER_TARGET_DIR)")


@pytest.fixture
def donors(cluster):
    """Starts n more pager-server donors for a client (default budget 256M each)."""

    def start(n: int = 4, budget="256M", **params):
        params.setdefault("poll_ms", 100)
        return cluster.start_donors(n, budgets=budget, size="1G", **params)

    return start


@pytest.fixture
def client(root, client_built, teardown, tmp_path):
    """A client with its state directory under the test's tmp_path."""
    return PagerClient(teardown, tmp_path / "state")
