"""The slice of the VM's tests that `make test` runs (`make test-vm` runs
them all): the restartable kernel-nbd front end's stall past the request
timeout (the kernel's NBD_CMD_LINK_DEAD, the holder replacing the stuck
nbdkit, every page verified), which this machine's kernel cannot run (no
nbd module), booted once under Debian's kernel in the test VM
(netpager_testkit.vm). A few minutes on a quiet 2-CPU machine.

It runs only when asked (NETPAGER_TEST_VM=1; `make test-vm` runs the
whole VM suite): under software emulation on a shared 2-CPU machine its
duration is the machine's business, and a test whose outcome depends on
how busy the machine is does not belong in `make test` (a run here under
load took past its 10-minute bound). Asked, it is skipped, saying why,
when the VM cannot run here (no qemu, not root: failed instead under
CI=true, where `make deps` installs qemu) or when the suite has no time
left for it: it must end within NETPAGER_TEST_BUDGET seconds (default
1800) of NETPAGER_TEST_STARTED, which the Makefile sets. Inside the VM
the slice must pass: a skip there is a failure."""

from __future__ import annotations

import os
import time

import pytest

from netpager_testkit import vm
from netpager_testkit.ci import skip_or_fail

SLICE = ["tests/client/test_client_nbd_restart.py", "-k", "stall"]
# The tests' own bound in the VM; the run ends vm.GRACE_S later at worst.
SLICE_TIMEOUT = 600


def test_kernel_nbd_stall_in_the_vm(root, tmp_path):
    if os.environ.get("NETPAGER_VM"):
        pytest.skip("this is the VM already")
    if not os.environ.get("NETPAGER_TEST_VM"):
        pytest.skip("the VM slice runs when asked: NETPAGER_TEST_VM=1 make test, or make test-vm")
    reason = vm.why_not()
    if reason:
        skip_or_fail(f"the test VM cannot run here: {reason}")
    started = os.environ.get("NETPAGER_TEST_STARTED")
    budget = float(os.environ.get("NETPAGER_TEST_BUDGET", 1800))
    if started:
        used = time.time() - float(started)
        need = SLICE_TIMEOUT + vm.GRACE_S
        if used + need > budget:
            pytest.skip(f"no time left for the VM slice: make test has run {used / 60:.0f} min "
                        f"of its {budget / 60:.0f}, and the slice may take {need / 60:.0f} more "
                        f"(make test-vm runs it alone)")
    with open(tmp_path / "vm.log", "w") as echo:
        r = vm.run_vm(SLICE, SLICE_TIMEOUT, echo=echo)
    print(r.summary())
    bad = [c for c in r.cases if c.outcome != "passed"]
    detail = "\n".join(f"{c.outcome}: {c.name}: {c.message[:2000]}" for c in bad)
    assert not r.timed_out and r.rc == 0 and r.cases and not bad, (
        f"{r.summary()}\n{detail}\n--- console (last lines)\n{r.tail()}")
