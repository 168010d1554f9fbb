"""Donors published in the lab's DNS by the rollout itself (issue 40,
`netpager_dns_publish`), against a real BIND on loopback
(netpager_testkit.dns): with `ansible` the controller writes each donor's
PTR/SRV/TXT/A with nsupdate and undeploy.yml removes them; with `zonefile`
it renders them as a zone file fragment that named-checkzone accepts and a
BIND including it serves. Either way the records are the ones a donor
publishes itself, so `pagerctl discover --domain` admits them once their
signed status verifies, and the donors never hold the zone's key.

Two donors as inventory aliases on their own loopback addresses, the
supervise service manager, everything under a temporary prefix (as
test_ansible.py); no client, so no swap. Each test's teardown undeploys and
then removes by pid and by path whatever is still there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from netpager_testkit import Teardown
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.dns import DnsServer
from netpager_testkit.machine import loopback
from netpager_testkit.paths import target_dir
from test_ansible import Lab, free_port, recap, write_inventory_files

ZONE = "lab.test"
SERVICE = f"_netpager._tcp.{ZONE}."
# Node ids: d2's is not a DNS label as it is (node_label makes it one).
NODES = {"d1": "d1", "d2": "rack2.d_2"}
LABELS = {"d1": "d1", "d2": "rack2-d-2"}
BINARIES = ["libpager_server.so", "pagerctl", "netpager-token"]


class DnsLab(Lab):
    """Test_ansible's lab with donors only, found through `dns` in ZONE."""

    def __init__(self, root: Path, bin_src: Path, publish: str, dns: DnsServer | None):
        self.install_into(root, bin_src)
        self.mount = root / "mnt"
        self.hints = root / "hints"
        self.zonefile = root / "zone" / "netpager-dns.zone"
        self.zonefile.parent.mkdir()
        # The reload command's trace: it runs only when the fragment changed.
        self.reloaded = root / "zone" / "reloads"
        self.addr = {d: loopback(11 + i, net=4) for i, d in enumerate(NODES)}
        self.port = {d: free_port(self.addr[d]) for d in NODES}
        self.sport = {d: free_port(self.addr[d]) for d in NODES}
        hosts = {d: {"netpager_node_id": NODES[d], "netpager_donor_address": self.addr[d],
                     "netpager_donor_port": self.port[d], "netpager_donor_status_port": self.sport[d]}
                 for d in NODES}
        inventory = {"all": {
            "vars": {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3"},
            "children": {"donors": {"hosts": hosts}},
        }}
        common = self.install_vars() | {
            "netpager_donor_budget": "32M",
            "netpager_start_timeout": 60,
            "netpager_discovery": "dns",
            "netpager_dns_zone": ZONE,
            "netpager_dns_publish": publish,
            "netpager_dns_ttl": 60,
            "netpager_dns_zonefile": str(self.zonefile),
            "netpager_dns_zonefile_reload": ["sh", "-c", f"echo reload >> {self.reloaded}"],
        }
        if publish == "zonefile":
            # The fragment holds the zone's SOA, its serial raised with the records.
            common["netpager_dns_zonefile_soa"] = f"ns.{ZONE}. admin.{ZONE}. 60 60 600 60"
        if dns is not None:
            common["netpager_dns_server"] = dns.server
            common["netpager_dns_key_controller_file"] = str(dns.key_file)
        write_inventory_files(self.inv, inventory, common)

    def names(self, d: str) -> tuple[str, str]:
        """d's DNS-SD instance and SRV target names."""
        return f"{LABELS[d]}.{SERVICE}", f"{LABELS[d]}-netpager.{ZONE}."

    def assert_published(self, dns: DnsServer) -> None:
        """Every donor's records, as its own announce=dns writes them."""
        assert sorted(dns.records(SERVICE, "PTR")) == sorted(self.names(d)[0] for d in NODES)
        for d, node in NODES.items():
            instance, target = self.names(d)
            assert dns.records(instance, "SRV") == [f"0 0 {self.port[d]} {target}"], d
            assert dns.records(instance, "TXT") == [
                f'"v=1" "node={node}" "nbd={self.port[d]}" "status={self.sport[d]}"'], d
            assert dns.records(target, "A") == [self.addr[d]], d

    def assert_admitted(self, dns: DnsServer) -> None:
        """pagerctl discover --domain (the built binary) lists every donor
        and would use it: its signed status verified with the lab key."""
        argv = [str(self.bin_src / "pagerctl"), "discover", "--json", "--for", "10", "--timeout", "3",
                "--domain", ZONE, "--dns-server", dns.server, "--psk", str(self.etc / "netpager.psk")]
        for node in NODES.values():
            argv += ["--expect", node]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        seen = {r["node_id"]: r for r in json.loads(p.stdout)}
        assert sorted(seen) == sorted(NODES.values()), (seen, p.stderr)
        for d, node in NODES.items():
            assert seen[node]["usable"] and seen[node]["why"] == "verified with the lab key", seen[node]
            assert seen[node]["nbd"] == f"{self.addr[d]}:{self.port[d]}", seen[node]

    def assert_donors_hold_no_key(self) -> None:
        assert not (self.etc / "dns.key").exists()
        for d, node in NODES.items():
            conf = (self.etc / "services" / f"netpager-donor-{node}.conf").read_text()
            assert " announce=" not in conf and " dns-key=" not in conf, conf


    def leftovers_but(self, dns: DnsServer) -> dict[str, list]:
        """What undeploy left, but for the test's named (in the lab's directory)."""
        left = self.leftovers()
        left["processes"] = [p for p in left["processes"] if p != dns.proc.pid]
        return {k: v for k, v in left.items() if v}


def checkzone(zone_file: Path) -> None:
    p = subprocess.run(["named-checkzone", ZONE, str(zone_file)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def make_lab(publish: str, with_dns: bool):
    """The lab, its DNS server (taking updates) if `with_dns`, and the
    teardown that undeploys (while that server still runs) and removes."""
    if os.geteuid() != 0:
        skip_or_fail("needs root (users, the donors' directories)")
    src = target_dir()
    missing = [b for b in BINARIES if not (src / b).exists()]
    if missing:
        skip_or_fail(f"not built in {src}: {', '.join(missing)} (run `make build`, or set NETPAGER_TARGET_DIR)")
    if not shutil.which("named-checkzone"):
        skip_or_fail("no named-checkzone (Debian's bind9-utils: make deps)")
    root = Path(tempfile.mkdtemp(prefix="netpager-ansible-dns-", dir="/tmp"))
    # The donors' account must reach its run directory inside.
    root.chmod(0o755)
    td = Teardown(f"ansible dns lab ({publish})")
    td.add(f"directory {root}", lambda: shutil.rmtree(root))
    try:
        dns = DnsServer(td, root, zone=ZONE) if with_dns else None
        lab = DnsLab(root, src, publish, dns)
        td.add("what undeploy left", lab.remove_leftovers)
        td.add("undeploy.yml", lambda: lab.ansible("undeploy.yml", check=False))
    except BaseException:
        td.close()
        raise
    return lab, dns, td


def close(td: Teardown) -> None:
    errors = td.close()
    if errors:
        pytest.fail("lab cleanup failed: " + "; ".join(errors))


def test_publish_ansible_writes_and_removes_each_donors_records():
    lab, dns, td = make_lab("ansible", with_dns=True)
    try:
        out = lab.ansible("site.yml").stdout
        assert set(recap(out)) == set(NODES), out
        lab.assert_published(dns)
        lab.assert_donors_hold_no_key()
        lab.assert_admitted(dns)

        # The records are read back before they are written: nothing changes.
        again = lab.ansible("site.yml").stdout
        assert all(r["changed"] == 0 for r in recap(again).values()), again

        lab.ansible("undeploy.yml")
        for d in NODES:
            instance, target = lab.names(d)
            assert dns.records(instance, "SRV") == [] and dns.records(instance, "TXT") == [], d
            assert dns.records(target, "A") == [], d
        assert dns.records(SERVICE, "PTR") == []
        # The zone itself is as it was.
        assert dns.records(ZONE, "SOA")
        assert lab.leftovers_but(dns) == {}
    finally:
        close(td)


def test_publish_zonefile_renders_a_fragment_bind_serves():
    lab, _, td = make_lab("zonefile", with_dns=False)
    try:
        lab.ansible("site.yml")
        assert lab.reloaded.read_text() == "reload\n"
        # A zone that $INCLUDEs it, as the lab's admin writes it.
        dns = DnsServer(td, lab.root / "served", zone=ZONE, include=lab.zonefile, soa=False)
        checkzone(dns.zone_file)
        lab.assert_published(dns)
        lab.assert_donors_hold_no_key()
        lab.assert_admitted(dns)
        serial = int(dns.records(ZONE, "SOA")[0].split()[2])
        assert f"; serial {serial} of " in lab.zonefile.read_text()

        # Unchanged, so no reload, and the serial stays.
        again = lab.ansible("site.yml").stdout
        assert all(r["changed"] == 0 for r in recap(again).values()), again
        assert lab.reloaded.read_text() == "reload\n"
        assert f"; serial {serial} of " in lab.zonefile.read_text()

        lab.ansible("undeploy.yml")
        # No donor left, the serial raised, and the including zone still loads.
        left = [line for line in lab.zonefile.read_text().splitlines() if line and not line.startswith(";")]
        assert len(left) == 1 and " IN SOA " in left[0], left
        assert int(left[0].split()[6]) > serial, left
        assert lab.reloaded.read_text() == "reload\nreload\n"
        checkzone(dns.zone_file)
        assert lab.leftovers_but(dns) == {}
    finally:
        close(td)
