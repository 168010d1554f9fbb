"""Ansible over SSH on the lab (issue 23): donor hosts are added and retired
by editing the inventory and re-running site.yml while a job swaps on a
client. The client's device follows its donors file: no re-attach (its
serving process keeps its pid), the new host's donor gets extents; a host
put in the group retired holds nothing of the client's before its donor is
stopped; the job verifies every page."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

import netlab
from lab_ansible import LabRollout, lab_rollout_dir, recap
from netpager_testkit import MemoryCgroup, OwnedProcess, Teardown, swaps, wait_for
from netpager_testkit.procs import tail

MIB = 1 << 20
HOLD_PAGES = Path(__file__).resolve().parents[1] / "ansible" / "hold_pages.py"


def donors_of(ro: LabRollout, client: str) -> dict:
    return {d["name"]: d for d in ro.client_status(client)["status"]["donors"]}


# Three site.yml runs over SSH: too long for `make test` (the full set).
@pytest.mark.lab_full
def test_donor_hosts_added_and_retired_while_a_job_swaps():
    td = Teardown("lab membership rollout")
    try:
        lab = netlab.Lab(td, lab_rollout_dir(td) / "lab", ["idle1", "idle2", "idle3", "idle4", "busy1"])
        lab.workdir.chmod(0o755)
        ro = LabRollout(td, lab, donors=["idle1", "idle2", "idle3"], clients=["busy1"])
        ro.ansible("site.yml")
        st = ro.client_status("busy1")
        device, server = st["device"], st["server"]["pid"]
        assert sorted(donors_of(ro, "busy1")) == ["idle1", "idle2", "idle3"]

        # A job that keeps rewriting and checking 48 MiB in a 32 MiB cgroup:
        # its pages go in and out of busy1's device all along.
        cg = MemoryCgroup(td, 32 * MIB)
        ready, progress = lab.workdir / "job.ready", lab.workdir / "job.progress"
        job = OwnedProcess(["sh", "-c", 'echo $$ > "$0" && exec "$@"', cg.procs_file,
                            *lab["busy1"].netns_argv([sys.executable, HOLD_PAGES, "48", ready,
                                                      "--churn", progress])],
                           lab.workdir / "job.log", td, "hold_pages --churn on busy1")
        wait_for(lambda: ready.exists() or not job.alive(), 300, "the job to fill its memory")
        assert ready.exists(), job.log_tail()
        assert swaps().get(device, 0) > 0, f"nothing in {device}: {swaps()}"

        # One more donor host: deployed, in busy1's donors file, in its set.
        ro.donors.append("idle4")
        ro.write_inventory(u_star=0.5)
        out = ro.ansible("site.yml").stdout
        assert "re-attaching" not in out, out
        assert recap(out)["busy1"]["failed"] == 0
        assert ro.client_status("busy1")["server"]["pid"] == server, "busy1's device was re-attached"
        d4 = wait_for(lambda: (donors_of(ro, "busy1").get("idle4") or {}).get("extents_held", 0) > 0
                      and donors_of(ro, "busy1")["idle4"], 120, "idle4 to get extents of busy1")
        assert d4["joined"] == "file", d4
        assert job.alive(), job.log_tail()

        # idle1 retired: busy1 moves every page off it, then its donor stops.
        held = donors_of(ro, "busy1")["idle1"]["extents_held"]
        assert held > 0
        ro.retired = ["idle1"]
        ro.write_inventory(u_star=0.5)
        out = ro.ansible("site.yml").stdout
        assert "re-attaching" not in out, out
        st = ro.client_status("busy1")
        assert st["server"]["pid"] == server, "busy1's device was re-attached"
        assert "idle1" not in donors_of(ro, "busy1")
        # Drained and let go before its donor stopped: by retire.yml's
        # donor-remove --wait, or already by the device itself, which
        # follows the donors file idle1's line left first.
        left = {d["name"]: d["why"] for d in st["status"]["left"]}
        assert left.get("idle1") in ("removed", "file"), st["status"]["left"]
        if left["idle1"] == "removed":
            assert "donor idle1 holds nothing of ours and left the set" in out, out
        assert not (ro.host_dir("idle1") / "run" / "donor-idle1" / "nbdkit.pid").exists() or \
            not netlab.netns_pids(lab["idle1"].ns) or \
            ro.donor_pid("idle1") not in netlab.netns_pids(lab["idle1"].ns), "idle1's donor still runs"

        # Every page the job wrote, through both changes, reads back intact.
        job.signal(signal.SIGUSR1)
        assert job.wait(300) == 0, tail(job.log_path)
        assert ro.client_status("busy1")["status"]["totals"]["lost"] == 0
    finally:
        errors = td.close()
    assert not errors, errors
