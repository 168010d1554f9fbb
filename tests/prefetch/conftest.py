"""prefetchd's end-to-end tests need its binaries (`make build`)."""

from __future__ import annotations

import pytest

from netpager_testkit.ci import skip_or_fail
from netpager_testkit.prefetch import missing_binaries


@pytest.fixture(autouse=True)
def built(root):
    missing = missing_binaries()
    if missing:
        skip_or_fail(f"not built: {missing} (run `make build` or set NETPAGER_TARGET_DIR)")
