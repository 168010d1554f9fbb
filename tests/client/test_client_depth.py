"""Many requests in flight (issue 24): fio verifying its data (crc32c,
randrw, QD32, 4 jobs) through the loop device in every mode, with a donor
killed while the jobs run in the modes that survive one."""

from __future__ import annotations

import pytest

from netpager_testkit.client import busiest, donor_report
from netpager_testkit.procs import OwnedProcess

# mode: (donors, extra attach arguments, whether a donor is killed mid-run).
# One donor more than a unit takes, so that units placed after the kill
# (and the parity log's) still find distinct donors.
MODES = {
    "none": (1, [], False),
    "mirror": (3, [], True),
    "parity": (4, ["--parity-width", "3"], True),
    "ec": (7, ["--data", "4", "--parity", "2"], True),
    "disk": (2, [], True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_fio_verifies_at_depth(mode, teardown, donors, client, tmp_path):
    n, extra, kill = MODES[mode]
    if mode == "disk":
        extra = ["--disk-file", str(tmp_path / "writethrough.img")]
    ds = donors(n, budget="512M")
    dev = client.attach(ds, mode=mode, size="256M", frontend="fuse-uring",
                        extra=[*extra, "--request-timeout", "2", "--connect-timeout", "2"])
    log = tmp_path / "fio.log"
    # Four jobs of 64 MiB each, 32 requests in flight each; fio checks every
    # block it reads against what it wrote (verify_fatal: the first bad one
    # fails the run). One pass (fio's verify takes a block written again in
    # a later --loops pass for a bad one, even on a plain file). 16 MiB each
    # took under a second on a quiet machine, less than status takes to show
    # the first extents (status.json is rewritten about once a second), so
    # the kill could come after fio had ended.
    job = OwnedProcess(["fio", "--name=depth", f"--filename={dev}", "--direct=1", "--ioengine=libaio",
                        "--iodepth=32", "--rw=randrw", "--numjobs=4", "--bs=4k", "--size=64M",
                        "--offset_increment=64M", "--verify=crc32c", "--verify_fatal=1",
                        "--do_verify=1", "--randrepeat=0", "--group_reporting"],
                       log, teardown, "fio")
    if kill:
        # Killed while requests are in flight: as soon as the jobs have
        # placed extents, with fio still running.
        victim = busiest(client, ds)
        assert job.alive(), f"fio ended before the donor was killed: {log.read_text()[-2000:]}"
        victim.kill9()
        client.wait_status(lambda s: donor_report(s, victim.name)["failed"], 60,
                           f"donor {victim.name} marked failed")
    rc = job.wait(300)
    out = log.read_text()
    assert rc == 0, f"fio failed ({rc}):\n{out[-3000:]}"
    st = client.device_status()
    assert st["totals"]["lost"] == 0, st["totals"]
    client.detach()
    assert client.leftovers() == []
