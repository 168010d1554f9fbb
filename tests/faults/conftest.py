"""Fixtures of the fault matrix (tests/faults): donors and clients as in
tests/client (its helpers are reused), donors on the lab's hosts
(tests/lab) for the link faults, and the choice of cells.

`pytest tests` (so `make test`) runs the fast subset: one cell per fault
kind, in mode parity. The whole matrix (every fault in every mode) is
marked `faults_full` and runs when NETPAGER_FAULTS=full (`make faults`) or
when asked for with `-m faults_full`.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))

import netlab  # noqa: E402
from netpager_testkit.client import PagerClient, client_plugin  # noqa: E402
from netpager_testkit.client_fixtures import client, donors  # noqa: E402,F401
from netpager_testkit.paths import pagerctl  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "faults_full: a fault-matrix cell outside the fast "
                            "subset (runs with NETPAGER_FAULTS=full or -m faults_full)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NETPAGER_FAULTS") == "full" or config.option.markexpr:
        return  # the whole matrix, or what -m selects
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("faults_full") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the item (a cell's row says how it ended)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def client_built():
    """Fails even off CI: a fault table with cells skipped would mislead."""
    for path in (pagerctl(), client_plugin()):
        if not path.exists():
            pytest.fail(f"client not built: {path} missing (run `make build`, or set NETPAGER_TARGET_DIR)")


@pytest.fixture
def second_client(root, client_built, teardown, tmp_path):
    return PagerClient(teardown, tmp_path / "state2")


@pytest.fixture
def lab_donors(root, teardown, tmp_path, donor_plugin, client):
    """Starts n pager-server donors, each on its own lab host (d1, d2, ...: a
    network namespace on the lab's bridge), requiring TLS with a lab key
    that has a line for `client`; the client runs on the machine, the lab's
    controller address. `lab_donors.lab` is the lab, `lab_donors.psk` the
    key file (give the client `--psk`)."""
    lab = netlab.Lab(teardown, tmp_path / "lab", ["d1", "d2", "d3", "d4"], ssh=False)
    psk = tmp_path / "lab.psk"
    key = secrets.token_hex(32)
    psk.write_text(f"lab:{key}\n{client.client_id}:{key}\n")
    psk.chmod(0o600)

    def start(n: int = 4, budget="256M", **params):
        params.setdefault("poll_ms", 100)
        return [netlab.LabDonor(lab[f"d{i + 1}"], teardown, tmp_path, donor_plugin,
                                {"size": "1G", "budget": budget, "psk": psk, **params}, tls_psk=psk).start()
                for i in range(n)]

    start.lab, start.psk = lab, psk
    return start
