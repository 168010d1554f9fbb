"""Discovery across a router (issue 40): BIND on lab host ns serves the
lab's zone; donors on both subnets publish themselves there. A client
device on subnet 1 with the zone as its discovery domain finds the donors
of both subnets and places extents on each; multicast DNS from the same
host sees only its own segment's donors announcing that way (a2, not b2:
the router forwards no multicast)."""

from __future__ import annotations

import secrets

import netlab
from netpager_testkit import Teardown, nbdio, wait_for
from netpager_testkit.client import client_plugin
from netpager_testkit.ci import skip_or_fail
from test_lab_discovery import discover, lab_device, lab_root  # noqa: F401 (lab_root: a fixture)

MIB = 1 << 20


def test_a_client_finds_donors_on_both_subnets_through_dns_and_only_its_own_by_mdns(lab_root, donor_plugin,
                                                                                      tmp_path):
    from netpager_testkit.dns import DnsServer

    if not client_plugin().exists():
        skip_or_fail(f"client plugin not built: {client_plugin()} missing (run `make build`)")
    td = Teardown("dns discovery across subnets")
    try:
        lab = netlab.Lab(td, lab_root, ["ns", "a1", "a2", "c1"], ssh=False, subnet2=["b1", "b2"])
        dns = DnsServer(td, lab_root, addr=lab["ns"].addr, wrap=lab["ns"].netns_argv)
        key = lab_root / "lab.psk"
        key.write_text(f"lab:{secrets.token_hex(32)}\n")
        params = {"size": "64M", "budget": "64M", "mlock": False, "poll_ms": 100, "psk": key}
        for d in ("a1", "b1"):
            netlab.LabDonor(lab[d], td, lab_root, donor_plugin,
                            {**params, "announce": "dns", "dns_zone": dns.zone, "dns_key": dns.key_file,
                             "dns_server": dns.server}, tls_psk=key).start()
        for d in ("a2", "b2"):
            netlab.LabDonor(lab[d], td, lab_root, donor_plugin, {**params, "announce": True}, tls_psk=key).start()
        _, sock, status = lab_device(td, lab, "c1", tmp_path / "state",
                                     f'lab_key = "{key}"\ndiscover_domain = ["{dns.zone}"]\n'
                                     f'dns_server = "{dns.server}"\n')
        wait_for(lambda: sorted(d["name"] for d in status().get("donors", [])) == ["a1", "b1"], 60,
                 "a1 (subnet 1) and b1 (subnet 2) to join the device through the DNS")

        data = {off: secrets.token_bytes(MIB) for off in range(0, 16 * MIB, MIB)}
        with nbdio.connect(f"nbd+unix:///c1?socket={sock}") as h:
            for off, chunk in data.items():
                h.pwrite(chunk, off)
            h.flush()
            for off, chunk in data.items():
                assert h.pread(MIB, off) == chunk, f"mismatch at {off}"
        st = wait_for(lambda: (lambda s: s if all(d["extents_held"] > 0 for d in s["donors"]) else None)(status()),
                      60, "a1 and b1 both to hold extents")
        assert {d["name"]: d["joined"] for d in st["donors"]} == {"a1": "discovered", "b1": "discovered"}, st

        # By mDNS each segment hears only its own: b2 is heard on subnet 2.
        assert sorted(discover(lab, "c1", "--psk", str(key), expect=["a2"])) == ["a2"]
        assert sorted(discover(lab, "b1", "--psk", str(key), expect=["b2"])) == ["b2"]
    finally:
        errors = td.close()
    assert errors == []
