"""Live membership under a swapping job: donors join (`pagerctl donor-add`)
and leave (`pagerctl donor-remove --wait`) an attached swap device while
memhog swaps and verifies every page, in parity (add one, remove one) and
ec 2+2 (add two, remove one); the serving process keeps its pid, so swap
never went off; a removal the mode cannot spare is refused; a detach and
re-attach keeps the added donors and not the removed ones, through both
front ends (the serving process, and nbdkit with the client plugin)."""

from __future__ import annotations

import pytest

from netpager_testkit.client import MIB, donor_report, donor_spec, run_memhog, run_pagerctl
from netpager_testkit import wait_for

LIMIT = 64 * MIB


def names(st: dict) -> list[str]:
    return [d["name"] for d in st["donors"]]


@pytest.mark.parametrize("mode,start,extra,add", [
    ("parity", 3, [], 1),
    ("ec", 4, ["--data", "2", "--parity", "2"], 2),
])
def test_donors_join_and_leave_while_a_job_swaps(mode, start, extra, add, teardown, donors, client,
                                                   memhog, tmp_path):
    ds = donors(start + add)
    first, late = ds[:start], ds[start:]
    device = client.attach(first, mode=mode, size="256M", swap=True, extra=extra)
    pid = client.server_pid()
    # The job swaps until the donors have joined and one has left.
    job = run_memhog(teardown, memhog, LIMIT, tmp_path / "memhog.log", device, until=True)
    wait_for(lambda: job.swapped() >= 16 * MIB or not job.alive(), 300, "the job to swap")
    assert job.alive(), job.proc.log_tail()

    for d in late:
        out = run_pagerctl(["donor-add", "--state-dir", client.state_dir, donor_spec(d)]).stdout
        assert "added" in out, out
    st = client.wait_status(lambda s: set(names(s)) >= {d.name for d in late}, 30,
                            "the added donors in the status")
    for d in late:
        assert donor_report(st, d.name)["joined"] == "added"

    leaving = first[0]
    p = run_pagerctl(["donor-remove", "--state-dir", client.state_dir, leaving.name, "--wait"],
                     timeout=600)
    assert "left the set" in p.stdout, p.stdout + p.stderr
    st = client.device_status()
    assert leaving.name not in names(st)
    assert any(l["name"] == leaving.name and l["why"] == "removed" for l in st["left"]), st["left"]
    # The donor holds nothing of ours: its export is empty.
    assert leaving.status().used_bytes == 0
    # The newcomers took extents: new placements and the leaver's moves.
    for d in late:
        assert donor_report(st, d.name)["extents_held"] > 0, donor_report(st, d.name)

    assert job.alive(), f"the job ended while donors joined and left: {job.proc.log_tail()}"
    job.stop()
    assert "memhog: OK" in job.finish()
    assert client.server_pid() == pid, "the serving process was replaced: swap went off"
    assert client.device_status()["totals"]["lost"] == 0


@pytest.mark.parametrize("frontend", ["fuse-uring", "nbd"])
def test_a_removal_the_mode_needs_is_refused_and_the_set_survives_reattach(frontend, teardown, donors,
                                                                          client):
    ds = donors(4)
    client.attach(ds[:3], mode="parity", size="64M", frontend=frontend)
    p = run_pagerctl(["donor-remove", "--state-dir", client.state_dir, ds[0].name], check=False)
    assert p.returncode != 0
    assert "add one first" in p.stderr, p.stderr
    p = run_pagerctl(["donor-add", "--state-dir", client.state_dir, "127.0.0.1:1,name=bogus"],
                     check=False)
    assert p.returncode != 0 and "nothing listens at 127.0.0.1:1" in p.stderr, p.stderr
    run_pagerctl(["donor-add", "--state-dir", client.state_dir, donor_spec(ds[3])])
    run_pagerctl(["donor-remove", "--state-dir", client.state_dir, ds[1].name, "--wait"], timeout=300)
    client.detach()
    client.attach([], new_device=False, frontend=frontend)
    st = client.device_status()
    assert names(st) == [ds[0].name, ds[2].name, ds[3].name], names(st)
    client.detach()
    assert client.leftovers() == []
