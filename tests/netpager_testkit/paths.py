"""Where the repository, the built binaries and the test jobs are."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path


def repo_root() -> Path:
    env = os.environ.get("NETPAGER_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[2]


def target_dir() -> Path:
    """Release binaries: $NETPAGER_TARGET_DIR, else target/release."""
    env = os.environ.get("NETPAGER_TARGET_DIR")
    return Path(env) if env else repo_root() / "target" / "release"


@contextmanager
def using_target_dir(path: Path):
    """Inside, target_dir() is `path` (and so is NETPAGER_TARGET_DIR for the
    processes started meanwhile): an A/B benchmark runs two builds' binaries
    in one process, each side's set-up and undo inside its own `with`."""
    old = os.environ.get("NETPAGER_TARGET_DIR")
    os.environ["NETPAGER_TARGET_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            del os.environ["NETPAGER_TARGET_DIR"]
        else:
            os.environ["NETPAGER_TARGET_DIR"] = old


def server_plugin() -> Path:
    """The donor plugin (it may not be built yet: check `.exists()`)."""
    return target_dir() / "libpager_server.so"


def pagerctl() -> Path:
    return target_dir() / "pagerctl"


def job(name: str) -> Path:
    """A job from tests/jobs, built on first use if `make build` has not."""
    path = repo_root() / "tests" / "jobs" / name
    if not path.exists():
        subprocess.run(["make", "-s", "-C", str(path.parent), name], check=True)
    return path
