"""The lab's tests (tests/lab): `pytest tests` (so `make test`) runs one
rollout and the harness's own checks; tests marked `lab_full` (the rolling
update over SSH) run with NETPAGER_FAULTS=full (`make faults`) or when
asked for with `-m lab_full`."""

from __future__ import annotations

import os


def pytest_configure(config):
    config.addinivalue_line("markers", "lab_full: a lab test outside `make test` "
                            "(runs with NETPAGER_FAULTS=full or -m lab_full)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NETPAGER_FAULTS") == "full" or config.option.markexpr:
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("lab_full") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
