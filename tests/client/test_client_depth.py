"""Many requests in flight (issue 24): tests/jobs/blkhog (64 threads, each
with a direct 4 KiB read or write in flight, every block checked against
what was written last) through the loop device in every mode, with a donor
killed while it runs in the modes that survive one. The job runs until the
kill is detected and the device has served it on, then checks every
block: no job sized to outlast the kill."""

from __future__ import annotations

import pytest

from netpager_testkit import wait_for
from netpager_testkit.client import busiest, device_ios, donor_report
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
def test_blocks_verify_at_depth(mode, teardown, donors, client, blkhog, tmp_path):
    n, extra, kill = MODES[mode]
    if mode == "disk":
        extra = ["--disk-file", str(tmp_path / "writethrough.img")]
    ds = donors(n, budget="512M")
    dev = client.attach(ds, mode=mode, size="256M", frontend="fuse-uring",
                        extra=[*extra, "--request-timeout", "2", "--connect-timeout", "2"])
    log = tmp_path / "blkhog.log"
    stop = tmp_path / "blkhog.stop"
    job = OwnedProcess([blkhog, dev, "128M", "--threads", "64", "--until", stop], log, teardown, "blkhog")

    def served(requests: int, what: str) -> None:
        base = device_ios(dev)
        wait_for(lambda: device_ios(dev) - base >= requests or not job.alive(), 300, what)
        assert job.alive(), f"blkhog ended: {log.read_text()[-2000:]}"

    wait_for(lambda: "blkhog: filled" in log.read_text() or not job.alive(), 300, "blkhog's fill")
    served(4096, "blkhog's random reads and writes")
    if kill:
        # Killed with requests in flight: the job runs until told to stop.
        victim = busiest(client, ds)
        victim.kill9()
        client.wait_status(lambda s: donor_report(s, victim.name)["failed"], 60,
                           f"donor {victim.name} marked failed")
        served(4096, "requests served after the kill")
    stop.touch()
    rc = job.wait(600)
    out = log.read_text()
    assert rc == 0, f"blkhog failed ({rc}):\n{out[-3000:]}"
    assert "blkhog: OK blocks=32768 threads=64 " in out, out[-2000:]
    st = client.device_status()
    assert st["totals"]["lost"] == 0, st["totals"]
    client.detach()
    assert client.leftovers() == []
