"""The lab harness itself (tests/lab/netlab.py): hosts that reach each other
and nothing else, strict SSH, a teardown that leaves nothing, a crashed
run's leftovers removed at the next start, a routed subnet refused; and
pager-server's plain-text rule (insecure=false) on a real interface."""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import netlab
from netpager_testkit import Teardown
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.paths import repo_root

TESTS = repo_root() / "tests"


@pytest.fixture
def lab_root(tmp_path):
    if os.geteuid() != 0:
        skip_or_fail("needs root (network namespaces, a bridge)")
    return tmp_path / "lab"


def lab_gone(workdir: Path) -> dict:
    return {"namespaces": netlab.namespaces(), "bridge": netlab.bridge_exists(), "links": netlab.lab_links(),
            "directory": workdir.exists(), "state": netlab.STATE_FILE.exists()}


NOTHING = {"namespaces": [], "bridge": False, "links": [], "directory": False, "state": False}


def test_hosts_reach_each_other_only_and_teardown_leaves_nothing(lab_root):
    td = Teardown("lab")
    try:
        lab = netlab.Lab(td, lab_root, ["h1", "h2", "h3"])
        sshd_pids = [h.sshd.pid for h in lab.hosts.values()]
        assert lab.ssh("h1", "hostname -I").stdout.split() == [lab["h1"].addr]
        # The lab's subnet is the hosts' only route: no default route.
        assert lab.ssh("h2", "ip -4 route").stdout.split()[0] == str(netlab.SUBNET)
        assert lab.ssh("h2", f"echo > /dev/tcp/{lab['h3'].addr}/22 && echo open").stdout.strip() == "open"
        # The host keys are checked: a known_hosts with another key refuses.
        other = lab_root / "other_known_hosts"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", lab_root / "other"], check=True)
        kind, blob = (lab_root / "other.pub").read_text().split()[:2]
        other.write_text(f"{lab['h1'].addr} {kind} {blob}\n")
        opts = [o.replace(str(lab.known_hosts), str(other)) for o in lab.ssh_options()]
        p = subprocess.run(["ssh", *opts, f"root@{lab['h1'].addr}", "true"], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode != 0 and "host key" in p.stderr.lower(), p.stderr
    finally:
        errors = td.close()
    assert errors == []
    assert lab_gone(lab_root) == NOTHING
    assert [p for p in sshd_pids if Path(f"/proc/{p}").exists()] == []
    # Idempotent: a second close has nothing left to do.
    assert td.close() == []


def test_two_subnets_reach_each_other_through_the_router_only(lab_root):
    td = Teardown("lab")
    try:
        lab = netlab.Lab(td, lab_root, ["a1"], subnet2=["b1"])
        assert ipaddress.ip_address(lab["b1"].addr) in netlab.SUBNET2
        router = str(netlab.SUBNET.network_address + netlab.ROUTER_HOST)
        # Its own subnet and the other one through the router; no default route.
        assert lab.ssh("a1", "ip -4 route").stdout.splitlines()[1].split()[:3] == [str(netlab.SUBNET2), "via", router]
        assert lab.ssh("a1", f"echo > /dev/tcp/{lab['b1'].addr}/22 && echo open").stdout.strip() == "open"
        # Nothing outside the lab's two subnets has a route (asked of the
        # routing table: no packet is sent anywhere).
        outside = lab.ssh("b1", "ip -4 route get 192.0.2.1", check=False)
        assert outside.returncode != 0 and "unreachable" in outside.stderr.lower(), outside.stderr
    finally:
        errors = td.close()
    assert errors == []
    assert lab_gone(lab_root) == NOTHING


def test_a_crashed_lab_is_removed_at_the_next_start(lab_root):
    crash = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / 'lab')!r}]
        import netlab
        from netpager_testkit import Teardown
        netlab.Lab(Teardown("crash"), {str(lab_root)!r}, ["h1", "h2"])
        os.kill(os.getpid(), 9)
    """)
    p = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    assert netlab.namespaces() == ["nplab-h1", "nplab-h2"] and netlab.bridge_exists()
    td = Teardown("lab after a crash")
    try:
        netlab.Lab(td, lab_root.with_name("lab2"), ["h1"], ssh=False)
        assert netlab.namespaces() == ["nplab-h1"]
        assert not lab_root.exists()
    finally:
        errors = td.close()
    assert errors == []
    assert lab_gone(lab_root.with_name("lab2")) == NOTHING
    # The crashed run's sshd processes went with their namespaces.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(lab_root) not in ps, ps


def test_a_routed_subnet_is_refused(lab_root):
    # Not the lab's prefix: a starting lab removes those as a crashed run's.
    dummy = "nptest-route"
    td = Teardown("a route to the lab's subnet")
    try:
        # (no dummy interfaces in this kernel: an empty bridge holds the route)
        netlab.run(["ip", "link", "add", dummy, "type", "bridge"])
        td.add(f"interface {dummy}", lambda: netlab.run(["ip", "link", "delete", dummy]))
        netlab.run(["ip", "addr", "add", f"{netlab.SUBNET.network_address + 250}/{netlab.SUBNET.prefixlen}",
                    "dev", dummy])
        netlab.run(["ip", "link", "set", "dev", dummy, "up"])
        inner = Teardown("lab")
        try:
            with pytest.raises(netlab.LabError, match=f"subnet {netlab.SUBNET} is already in use"):
                netlab.Lab(inner, lab_root, ["h1"], ssh=False)
        finally:
            assert inner.close() == []
        assert lab_gone(lab_root) == NOTHING
    finally:
        assert td.close() == []


def test_a_donor_refuses_plain_text_from_another_host(lab_root, donor_plugin):
    """pager-server's own rule (insecure=false, no TLS): a plain-text
    connection from another host's address is refused at open with the
    rule's message; the same donor with insecure=true serves it."""
    td = Teardown("plain text")
    try:
        lab = netlab.Lab(td, lab_root, ["d1", "d2", "c1"], ssh=False)
        psk = lab_root / "lab.psk"
        psk.write_text(f"lab:{secrets.token_hex(32)}\n")
        strict = netlab.LabDonor(lab["d1"], td, lab_root, donor_plugin,
                                 {"size": "64M", "budget": "64M", "psk": psk}).start()
        loose = netlab.LabDonor(lab["d2"], td, lab_root, donor_plugin,
                                {"size": "64M", "budget": "64M", "psk": psk, "insecure": True}).start()
        refused = lab.netns_run("c1", ["nbdinfo", "--size", f"{strict.uri()}c1@1M"], check=False)
        assert refused.returncode != 0, refused.stdout
        assert f"refusing a plain-text connection from {lab['c1'].addr}" in strict.log_tail(), strict.log_tail()
        served = lab.netns_run("c1", ["nbdinfo", "--size", f"{loose.uri()}c1@1M"])
        assert served.stdout.strip() == str(1 << 20)
    finally:
        errors = td.close()
    assert errors == []
