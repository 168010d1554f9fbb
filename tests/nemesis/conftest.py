"""Fixtures of the nemesis's tests (tests/nemesis): what a schedule needs
to run (root, the built binaries, memhog), and running one."""

from __future__ import annotations

import os

import pytest

from netpager_testkit.ci import skip_or_fail
from netpager_testkit.client import client_plugin
from netpager_testkit.nemesis.run import parse_schedule, run_schedule, schedule_text
from netpager_testkit.paths import pagerctl, server_plugin


@pytest.fixture
def nemesis(memhog, tmp_path):
    """`nemesis(text_or_setup, ops=None, seed=1, op_seconds=None)` runs a
    schedule (its text 'SETUP | OP; ...', or a setup and its ops) and
    returns the RunResult; what it set up is undone before it returns."""
    if os.geteuid() != 0:
        skip_or_fail("needs root (lab namespaces, loop devices, swap, cgroups)")
    for path in (pagerctl(), client_plugin(), server_plugin()):
        if not path.exists():
            skip_or_fail(f"not built: {path} missing (run `make build`)")

    def run(schedule, ops=None, seed: int = 1, op_seconds=None):
        setup, ops = parse_schedule(schedule) if ops is None else (schedule, ops)
        print(f"schedule: {schedule_text(setup, ops)}")
        return run_schedule(setup, ops, seed, memhog, op_seconds=op_seconds, workdir=tmp_path / "world",
                            keep=tmp_path / "logs")

    return run

