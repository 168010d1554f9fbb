"""Fixtures shared by every end-to-end test (the harness is tests/netpager_testkit).

Run with Debian's /usr/bin/python3 (python3-libnbd and python3-protobuf bind
to it): `make test`, or `/usr/bin/python3 -m pytest tests`.
"""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from netpager_testkit import Cluster, Teardown, install_handlers, job, pb2, server_plugin
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.paths import target_dir
from netpager_testkit.procs import rescue_stuck, tail

_TEARDOWN_KEY = pytest.StashKey[Teardown]()
# How long past its timeout a test may stay stuck before its processes are
# killed to free it (rescue_stuck).
RESCUE_AFTER_S = 60
_RESCUED_KEY = pytest.StashKey[bool]()


def pytest_sessionstart(session):
    # Ctrl-C, SIGTERM (CI timeouts) and exit undo whatever is still set up.
    install_handlers()
    # Generate the protobuf classes once, up front: a broken .proto fails here.
    pb2()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest-timeout's SIGALRM only raises once the main thread is back in
    Python; a test blocked in C would hang the whole run (and CI with it).
    Past its timeout, the rescue frees it."""
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker and marker.args else item.config.getoption("timeout", None)
    rescue = None

    def rescue_item():
        item.stash[_RESCUED_KEY] = True
        rescue_stuck(item.nodeid)

    if timeout:
        rescue = threading.Timer(float(timeout) + RESCUE_AFTER_S, rescue_item)
        rescue.daemon = True
        rescue.start()
    yield
    if rescue:
        rescue.cancel()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if item.stash.get(_RESCUED_KEY, False) and not report.failed:
        # The C call the timeout could not interrupt may return normally once
        # its processes are gone, and the timeout's exception is then lost.
        item.stash[_RESCUED_KEY] = False  # the phase it was stuck in, only
        report.outcome = "failed"
        report.longrepr = (f"stuck past its timeout in {call.when}: its processes were "
                           "killed to free it (stacks above)")
    td = item.stash.get(_TEARDOWN_KEY, None)
    if report.failed and td is not None and td.logs:
        text = []
        for path in dict.fromkeys(td.logs):
            text.append(f"--- {path} (last lines)\n{tail(path, 30)}")
        report.sections.append(("netpager logs", "\n".join(text)))


@pytest.fixture
def teardown(request):
    """The test's undo registry; anything left is undone after the test, and
    a failed undo fails the test (a leak is a bug)."""
    td = Teardown(request.node.nodeid)
    request.node.stash[_TEARDOWN_KEY] = td
    yield td
    errors = td.close()
    if errors:
        pytest.fail("cleanup failed: " + "; ".join(errors))


@pytest.fixture
def root():
    """Swap, loop devices, FUSE mounts and cgroups need root (skipped without,
    failed under CI=true)."""
    if os.geteuid() != 0:
        skip_or_fail("needs root (swapon, losetup, cgroups, FUSE)")


@pytest.fixture
def donor_plugin():
    """Path of libpager_server.so; the test is skipped when it is not built
    (failed under CI=true)."""
    path = server_plugin()
    if not path.exists():
        skip_or_fail(f"pager-server plugin not built: {path} missing "
                    "(run `make build`, or set NETPAGER_TARGET_DIR)")
    return path


@pytest.fixture
def cluster(teardown, tmp_path, donor_plugin):
    """Donors running pager-server: `cluster.start_donors(n, budgets=..., ...)`."""
    return Cluster(teardown, tmp_path, donor_plugin)


@pytest.fixture
def memory_cluster(teardown, tmp_path):
    """Donors running nbdkit's memory plugin (for the harness's self-tests)."""
    return Cluster(teardown, tmp_path, "memory")


@pytest.fixture(scope="session")
def memhog():
    return job("memhog")


@pytest.fixture(scope="session")
def blkhog():
    return job("blkhog")


@pytest.fixture
def netpager_token():
    """Runs `netpager-token SECRET_FILE CLIENT`; skipped when not built."""
    path = target_dir() / "netpager-token"
    if not path.exists():
        skip_or_fail(f"netpager-token not built: {path} missing (run `make build`)")

    def run(secret_file, client: str) -> str:
        p = subprocess.run([str(path), str(secret_file), client], capture_output=True,
                           text=True, timeout=30, env={**os.environ, "RUST_BACKTRACE": "0"})
        if p.returncode != 0:
            raise AssertionError(f"netpager-token failed ({p.returncode}): {p.stderr}")
        return p.stdout.strip()

    return run
