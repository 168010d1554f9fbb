"""Child process for the harness's cleanup test (not a test itself).

Sets up a donor (nbdkit memory), its nbdfuse mount, a loop device, swap on
it and a memory cgroup holding a sleeping job, prints what it made as one
JSON line, then waits to be signalled. The harness's handlers must undo all
of it before the process dies.
"""

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from netpager_testkit import Cluster, MemoryCgroup, OwnedProcess, Teardown, attach_swap, install_handlers


def main() -> None:
    install_handlers()
    td = Teardown("cleanup-child")
    workdir = Path(tempfile.mkdtemp(prefix="netpager-cleanup-child-"))
    td.add(f"directory {workdir}", lambda: shutil.rmtree(workdir))
    donor = Cluster(td, workdir, "memory").start_donors(1, size="256M")[0]
    stack = attach_swap(td, workdir, donor.uri())
    cg = MemoryCgroup(td, 64 << 20)
    sleeper = OwnedProcess(["sh", "-c", 'echo $$ > "$0" && exec sleep 600', cg.procs_file],
                           workdir / "sleeper.log", td, "sleeper")
    while str(sleeper.pid) not in cg.procs_file.read_text().split():
        time.sleep(0.05)
    print(json.dumps({
        "workdir": str(workdir),
        "pids": {"donor": [donor.pid, donor.proc.start_time],
                 "nbdfuse": [stack.fuse.proc.pid, stack.fuse.proc.start_time],
                 "sleeper": [sleeper.pid, sleeper.start_time]},
        "mountdir": str(stack.fuse.mountdir),
        "fuse_file": str(stack.fuse.path),
        "loop": stack.loop.device,
        "cgroup": str(cg.path),
    }), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
