"""Donors behind links with added latency (netem on the lab's hosts): the
request timeout must tell a slow donor from a dead one.

A job swaps through parity on 4 lab donors, each host's link delayed
40 ms each way, far below the request timeout: no donor is failed over
for latency alone. Then one donor's delay goes past the request timeout
(a stall without a partition or a RST): that donor, and only it, is
failed over, and the job still verifies every page. The timeout is 20 s,
not the fault matrix's 2 s: under the VM's software emulation on a busy
machine a request already takes some 80 ms without any added delay.

netem (sch_netem) is missing from this machine's kernel: the test runs in
the test VM (`make test-vm`, tests/vm), whose Debian kernel has it, and is
skipped elsewhere whatever CI says (a kernel module is no dependency the
tree can install). The lab's tbf links (tests/faults/test_fault_matrix.py,
test_slow_link) run everywhere."""

from __future__ import annotations

import pytest

from netpager_testkit.client import MIB, Job, busiest, donor_report, job_limit
from netpager_testkit.procs import wait_for

import netlab
from netlab import Latency

LIMIT = job_limit(32 * MIB)
REQUEST_TIMEOUT = 20

# Asked before the lab is built.
pytestmark = pytest.mark.skipif(not netlab.netem_available(),
                                reason="this kernel has no netem (sch_netem): the test VM runs this "
                                       "test (make test-vm)")


def test_latency_fails_over_only_the_donor_past_the_request_timeout(teardown, lab_donors, client, memhog,
                                                                   tmp_path):
    ds = lab_donors(4)
    links = {d.name: Latency(teardown, lab_donors.lab, d.name, "40ms") for d in ds}
    timeouts = ["--request-timeout", str(REQUEST_TIMEOUT), "--connect-timeout", str(REQUEST_TIMEOUT)]
    device = client.attach(ds, mode="parity", size="256M", swap=True,
                           extra=["--psk", lab_donors.psk, *timeouts])
    job = Job(teardown, [memhog, str(3 * LIMIT), "--passes", "1"], LIMIT, tmp_path / "memhog.log", device)
    wait_for(lambda: job.swapped() >= LIMIT // 2 or not job.alive(), 600,
             f"{LIMIT // 2 >> 20} MiB swapped out over the delayed links")
    assert job.alive(), f"the job ended before it swapped enough: {job.proc.log_tail()}"
    st = client.status()["status"]
    assert not any(donor_report(st, d.name)["failed"] for d in ds), \
        f"a donor failed over for 80 ms of round trip: {st['donors']}"

    victim = busiest(client, ds)
    links[victim.name].set(f"{REQUEST_TIMEOUT * 3 // 2}s")
    client.wait_status(lambda s: donor_report(s, victim.name)["failed"], 300,
                       f"{victim.name} failed over past the request timeout")
    assert "memhog: OK" in job.finish()
    st = client.status()["status"]
    failed = [d.name for d in ds if donor_report(st, d.name)["failed"]]
    assert failed == [victim.name], failed
    assert st["totals"]["lost"] == 0, st["totals"]
    links[victim.name].heal()
    client.detach()
    assert client.leftovers() == []
