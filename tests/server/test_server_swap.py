"""Swap end to end: donor -> nbdfuse -> loop -> swapon -> a job in a memory
cgroup touching 3x its limit, verified page by page -> all undone."""

from __future__ import annotations

from pathlib import Path

from netpager_testkit import attach_swap, run_job_in_cgroup
from netpager_testkit.attach import mounted

MIB = 1 << 20
LIMIT = 128 * MIB


def test_job_swaps_through_a_donor(root, teardown, cluster, tmp_path, memhog):
    donor = cluster.start_donors(1, size="1G", budget="1G")[0]
    stack = attach_swap(teardown, tmp_path, donor.uri("swap"), discard=True)
    assert stack.fuse.size() == 1 << 30

    result = run_job_in_cgroup(teardown, [memhog, str(3 * LIMIT), "--passes", "1"], LIMIT,
                               tmp_path / "memhog.log", timeout=900,
                               swap_devices=[stack.device])
    result.check()
    assert "memhog: OK" in result.output
    assert result.peak_swap_bytes > 0, result.describe()
    assert result.swap_device_peak_bytes[stack.device] > 0, result.describe()
    assert not result.cgroup.exists()

    s = donor.status()
    assert s.writes > 0 and s.bytes_written >= result.peak_swap_bytes, s
    # The cgroup holds at most LIMIT of the job's 3 x LIMIT (swap cache
    # included), so the final pass alone reads back more than LIMIT.
    assert s.bytes_read > LIMIT, f"only {s.bytes_read} bytes came back from the donor"
    [usage] = [e for e in s.exports if e.name == "swap"]
    assert usage.size_bytes == 1 << 30

    teardown.close_or_raise()
    # By what backs them, not by name: another test run may have taken the
    # loop device's name since.
    assert not stack.loop.attached()
    assert not mounted(stack.fuse.mountdir) and not Path(stack.fuse.mountdir).exists()
    assert not stack.fuse.proc.alive() and not donor.alive()
