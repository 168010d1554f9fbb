"""site.yml over two subnets (issue 40): the example inventory's hosts on
the lab's two subnets (idle3 alone behind the router, which forwards no
multicast) and BIND on host ns serving the lab's zone. With
`netpager_discovery: dns` every donor publishes itself there (its TSIG key
from the rollout); busy1's donors file names only the donors of its own
subnet, busy2's is empty (`netpager_client_donors: []`: it attaches through
the DNS alone), and each device browses the zone with its own export token
for the donors it finds (`--discover-export`). busy1 takes idle3 into its set
through the DNS and keeps a job's pages on it: every page comes back
intact. undeploy.yml stops the donors cleanly, and their records go."""

from __future__ import annotations

import signal

from lab_ansible import CLIENTS, DNS_HOST, DONORS, SUBNET2_HOSTS, LabRollout, dns_lab, lab_rollout_dir, recap
from netpager_testkit import Teardown, wait_for
from netpager_testkit.procs import tail
from test_lab_rollout import hold_pages_on


# The client with an empty donors file.
NO_FILE = "busy2"


def joined(ro: LabRollout, client: str) -> dict:
    """{donor: how it joined} of the client's device."""
    return {d["name"]: d["joined"] for d in ro.client_status(client)["status"]["donors"]}


def test_site_yml_on_two_subnets_finds_the_far_donor_through_dns_and_keeps_every_page():
    td = Teardown("lab rollout over two subnets")
    try:
        lab, dns = dns_lab(td, lab_rollout_dir(td) / "lab")
        lab.workdir.chmod(0o755)
        ro = LabRollout(td, lab, dns=dns, no_file=[NO_FILE])
        out = ro.ansible("site.yml").stdout
        assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in recap(out).values()), out
        service = f"_netpager._tcp.{dns.zone}"
        assert sorted(dns.records(service, "PTR")) == sorted(f"{d}.{service}." for d in DONORS)

        far = SUBNET2_HOSTS[0]
        for c in CLIENTS:
            assert lab[c].subnet != lab[far].subnet and lab[c].subnet == lab[DNS_HOST].subnet
            # Not in its donors file: only the DNS can bring it in.
            donors_file = (ro.host_dir(c) / "var" / f"client-{c}" / "donors").read_text()
            assert lab[far].addr not in donors_file, donors_file
            assert ("name=idle1" in donors_file) == (c != NO_FILE), donors_file
            want = {d: ("discovered" if d == far or c == NO_FILE else "file") for d in DONORS}
            wait_for(lambda c=c: joined(ro, c) == want, 60, f"{c} to take {far} in through the DNS")

        # A job in a small memory cgroup parks most of its pages in busy1's
        # device until idle3 holds some of them, then reads every page back.
        device = ro.client_status("busy1")["device"]
        job = Teardown("swap job")
        try:
            holder = hold_pages_on(job, lab, "busy1", device, "holder")
            wait_for(lambda: {d["name"]: d for d in ro.client_status("busy1")["status"]["donors"]}[far]
                     ["extents_held"] > 0, 120, f"busy1's extents on {far}, across the router")
            holder.signal(signal.SIGUSR1)
            assert holder.wait(300) == 0, tail(holder.log_path)
        finally:
            errors = job.close()
        assert not errors, errors
        st = ro.client_status("busy1")["status"]
        assert st["totals"]["lost"] == 0, st["totals"]
        assert {d["name"]: d["state"] for d in st["donors"]}[far] in ("idle", "busy"), st["donors"]

        # A clean stop takes each donor's records with it.
        ro.ansible("undeploy.yml")
        assert dns.records(service, "PTR") == []
    finally:
        errors = td.close()
    assert not errors, errors
