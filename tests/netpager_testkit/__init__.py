"""netpager's end-to-end test harness.

Every later test reuses these pieces; each resource registers its undo in a
`Teardown` the moment it exists, so every exit path leaves nothing behind:

- `Teardown`, `install_handlers` (cleanup): the undo registry, plus atexit
  and SIGINT/SIGTERM/SIGHUP handlers.
- `OwnedProcess` (procs): a child process, signalled only while it is ours.
- `Cluster`, `Donor` (donor): nbdkit donors on 127.N.0.2, .3, ...
- `machine`: what concurrent test runs keep apart (loopback blocks, the
  swap and FUSE io_uring switch locks).
- `stress` (`python3 -m netpager_testkit.stress`): `make test-stress`.
- `StatusClient`, `pb2` (status): the donor status endpoint, on the wire.
- `attach_swap`, `FuseFile`, `LoopDevice`, `Swap` (attach): NBD export as swap.
- `run_job_in_cgroup`, `MemoryCgroup` (cgroup): jobs in a memory cgroup.
- `nbdio`: libnbd and fio helpers (imported on its own: it needs python3-libnbd).
- `client` (`PagerClient`), `client_fixtures`: the client driven through
  pagerctl, and the pytest fixtures of the tests that drive it.
- `prefetch`: prefetchd, slow disks, replicas and jobs (imported on its own).
- `bench_client`, `bench_server`, `bench_prefetch` (`python3 -m ...`; shared
  parts in `bench`): `make bench-client`, `bench-server`, `bench-prefetch`.
"""

from .attach import FuseFile, LoopDevice, Swap, SwapStack, attach_swap, swaps
from .cgroup import JobResult, MemoryCgroup, cgroup_version, oom_killed, run_job_in_cgroup
from .cleanup import CleanupError, Teardown, close_all, install_handlers
from .donor import Cluster, Donor, FakeMeminfo, write_meminfo
from .paths import job, repo_root, server_plugin, target_dir
from .procs import OwnedProcess, wait_for
from .status import StatusClient, StatusError, format_table, pb2, state_word

__all__ = [
    "FuseFile", "LoopDevice", "Swap", "SwapStack", "attach_swap", "swaps",
    "JobResult", "MemoryCgroup", "cgroup_version", "oom_killed", "run_job_in_cgroup",
    "CleanupError", "Teardown", "close_all", "install_handlers",
    "Cluster", "Donor", "FakeMeminfo", "write_meminfo",
    "job", "repo_root", "server_plugin", "target_dir",
    "OwnedProcess", "wait_for",
    "StatusClient", "StatusError", "format_table", "pb2", "state_word",
]
