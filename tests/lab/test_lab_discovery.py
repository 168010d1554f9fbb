"""Discovery on the lab's network (DNS-SD over multicast DNS): donors on lab
hosts started with `announce=true` are seen by `pagerctl discover` on
another host; one whose status is signed with another lab key is seen but
never usable; a donor that stops says goodbye and is no longer announced.
prefetchd and a client device with discovery on use the verified donor and
never the other. Without a lab key only loopback is trusted: the lab's own
network counts only when named (`--trust-network`, `trust_network`)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time

import pytest

import netlab
from netpager_testkit import Teardown, nbdio, wait_for
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.client import client_plugin
from netpager_testkit.paths import pagerctl
from netpager_testkit.prefetch import Prefetchd, finish_job, generate, missing_binaries, start_job
from netpager_testkit.procs import OwnedProcess


@pytest.fixture
def lab_root(tmp_path):
    if os.geteuid() != 0:
        skip_or_fail("needs root (network namespaces, a bridge)")
    if not pagerctl().exists():
        skip_or_fail(f"pagerctl not built: {pagerctl()} missing (run `make build`)")
    return tmp_path / "lab"


def discover(lab: netlab.Lab, host: str, *args: str, expect=(), listen: float = 15) -> dict:
    """`pagerctl discover --json` on a lab host: {node id: row}."""
    argv = [pagerctl(), "discover", "--json", "--for", str(listen), "--timeout", "3", *args]
    for node in expect:
        argv += ["--expect", node]
    p = lab.netns_run(host, argv, timeout=listen + 30)
    return {row["node_id"]: row for row in json.loads(p.stdout)}


def test_announced_donors_are_discovered_and_verified_with_the_lab_key(lab_root, donor_plugin):
    td = Teardown("discovery")
    try:
        lab = netlab.Lab(td, lab_root, ["d1", "d2", "d3", "d4", "c1"], ssh=False)
        key, wrong = lab_root / "lab.psk", lab_root / "wrong.psk"
        key.write_text(f"lab:{secrets.token_hex(32)}\n")
        wrong.write_text(f"lab:{secrets.token_hex(32)}\n")
        params = {"size": "64M", "budget": "64M", "mlock": False}
        good = netlab.LabDonor(lab["d1"], td, lab_root, donor_plugin,
                               {**params, "psk": key, "announce": True}, tls_psk=key).start()
        stranger = netlab.LabDonor(lab["d2"], td, lab_root, donor_plugin,
                                   {**params, "psk": wrong, "announce": True}, tls_psk=wrong).start()
        # A donor without announce=true is never seen.
        netlab.LabDonor(lab["d3"], td, lab_root, donor_plugin, {**params, "psk": key}, tls_psk=key).start()
        # A donor without a lab key (its status unsigned, plain NBD).
        netlab.LabDonor(lab["d4"], td, lab_root, donor_plugin,
                        {**params, "insecure": True, "announce": True}).start()
        lab_donors = ["d1", "d2", "d4"]

        seen = discover(lab, "c1", "--psk", str(key), expect=lab_donors)
        assert sorted(seen) == lab_donors, seen
        d1, d2 = seen["d1"], seen["d2"]
        assert (d1["nbd"], d1["status"]) == (f"{lab['d1'].addr}:{good.port}",
                                             f"{lab['d1'].addr}:{good.status_addr[1]}")
        assert d1["usable"] and d1["why"] == "verified with the lab key", d1
        assert d1["spec"] == f"{d1['nbd']},status={d1['status']},name=d1"
        assert not d2["usable"] and "status not verified with the lab key" in d2["why"], d2
        assert stranger.alive()

        assert not seen["d4"]["usable"] and "not signed" in seen["d4"]["why"], seen["d4"]

        # Without a key only loopback is trusted (the rule of attach
        # --discover without --psk): no donor of the lab's network counts,
        # and each says why.
        seen = discover(lab, "c1", expect=lab_donors)
        for n in lab_donors:
            assert not seen[n]["usable"], seen[n]
            assert f"{lab[n].addr} is not on a trusted network (loopback)" in seen[n]["why"], seen[n]
            assert "--trust-network" in seen[n]["why"], seen[n]
        # The lab's network named as trusted: the keyless donor counts; the
        # keyed ones still not, their status wants the key.
        seen = discover(lab, "c1", "--trust-network", str(netlab.SUBNET), expect=lab_donors)
        assert seen["d4"]["usable"] and seen["d4"]["why"] == "no lab key: on a trusted network", seen
        assert not seen["d1"]["usable"] and "status not read" in seen["d1"]["why"], seen["d1"]

        # A donor that stops withdraws its announcement (nbdkit's unload).
        good.terminate()
        deadline = time.monotonic() + 30
        while "d1" in (seen := discover(lab, "c1", "--psk", str(key), listen=3)):
            assert time.monotonic() < deadline, f"d1 still announced after it stopped: {seen}"
        assert "d2" in seen
    finally:
        errors = td.close()
    assert errors == []


def test_a_donor_stopped_while_it_probes_and_started_again_is_discovered(lab_root, donor_plugin):
    """A donor stopped in its first second (its announcement still being
    probed) and started again at once is seen by a browser that ran all
    along. Its goodbye used to go out before any announcement: the
    browser cached the withdrawn records for a second, took the new
    announcement for a refresh of them and never resolved the donor (the
    nemesis, ec: "announce-stranger; unannounce aw; announce-stranger")."""
    td = Teardown("discovery")
    try:
        lab = netlab.Lab(td, lab_root, ["d1", "c1"], ssh=False)
        key = lab_root / "lab.psk"
        key.write_text(f"lab:{secrets.token_hex(32)}\n")
        out = lab_root / "discover.json"
        browse = OwnedProcess(lab["c1"].netns_argv(
            ["sh", "-c", f'exec "$0" discover --json --for 20 --timeout 3 --psk {key} > {out}',
             pagerctl()]), lab_root / "discover.log", td, "pagerctl discover on c1")
        # The browser's first query goes out after a second; started later,
        # it would see only the second announcement and the test could
        # pass without the fix, never fail with it.
        time.sleep(2)
        donor = netlab.LabDonor(lab["d1"], td, lab_root, donor_plugin,
                                {"size": "64M", "budget": "64M", "mlock": False, "psk": key,
                                 "announce": True}, tls_psk=key).start()
        donor.terminate()
        donor.start()
        assert browse.wait(60) == 0, (lab_root / "discover.log").read_text()
        seen = {row["node_id"]: row for row in json.loads(out.read_text())}
        assert "d1" in seen, f"the donor started again is not seen: {seen}"
        assert seen["d1"]["usable"], seen["d1"]
    finally:
        errors = td.close()
    assert errors == []


def test_announce_needs_a_status_endpoint(lab_root, donor_plugin):
    p = subprocess.run(["nbdkit", "-f", "-U", "-", str(donor_plugin), "budget=1M", "mlock=false",
                        "announce=true", "--run", "true"], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0
    assert "announce=true needs status=ADDR:PORT" in p.stderr, p.stderr


def test_prefetchd_uses_a_discovered_donor_only_when_its_status_verifies(lab_root, donor_plugin, tmp_path):
    if missing_binaries():
        skip_or_fail(f"not built: {missing_binaries()} (run `make build`)")
    td = Teardown("prefetchd discovery")
    try:
        lab = netlab.Lab(td, lab_root, ["d1", "d2"], ssh=False)
        key, wrong = lab_root / "lab.psk", lab_root / "wrong.psk"
        key.write_text(f"lab:{secrets.token_hex(32)}\n")
        wrong.write_text(f"lab:{secrets.token_hex(32)}\n")
        params = {"size": "4M", "budget": "4M", "mlock": False, "poll_ms": 100, "announce": True}
        good = netlab.LabDonor(lab["d1"], td, lab_root, donor_plugin, {**params, "psk": key},
                               tls_psk=key).start()
        netlab.LabDonor(lab["d2"], td, lab_root, donor_plugin, {**params, "psk": wrong}, tls_psk=wrong).start()
        ds = generate("cyclic-random", tmp_path / "ds", 0.025)
        pd = Prefetchd(td, tmp_path, ds["data"], local_cache="256K",
                       extra=["--discover", "--psk", key, "--discover-export", "prefetchd@2M",
                              "--status-poll-ms", "100"])
        name = f"{lab['d1'].addr}:{good.port}/prefetchd@2M"
        lane = wait_for(lambda: next((d for d in pd.status()["donors"] if d["name"] == name), None), 30,
                        f"a lane for the discovered donor {name}")
        assert (lane["joined"], lane["state"], lane["status_endpoint"]) == \
            ("discovered", "serving", f"{lab['d1'].addr}:{good.status_addr[1]}"), lane
        pd.add_job("j", ds["hints_path"])
        result = finish_job(start_job(td, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                                      manifest=ds["manifest_path"], compute_us=500))
        assert result["mismatches"] == 0 and result["records"] > 0, result
        assert good.status().used_bytes > 0
        # The host announcing with another key was seen and refused, never used.
        log = pd.proc.log_path.read_text()
        assert "discovered donor d2 not used: status not verified with the lab key" in log, log[-3000:]
        assert [d["name"] for d in pd.status()["donors"]] == [name]
        assert pd.stop() == 0
    finally:
        errors = td.close()
    assert errors == []



def lab_device(td: Teardown, lab: netlab.Lab, host: str, state, settings: str):
    """A client device with no donors of its own (nbdkit with the client
    plugin on `host`, so nothing is mounted), `settings` added to its
    device.toml: its state directory, its socket and a reader of its status."""
    state.mkdir(mode=0o700)
    (state / "device.toml").write_text(
        f'client_id = "{host}"\nsize = "16M"\nmlock = false\n{settings}donors = []\n'
        '[mode]\nkind = "none"\n[policy]\nepoch_ms = 1000\n')
    sock = state / "nbd.sock"
    OwnedProcess(lab[host].netns_argv(["nbdkit", "-f", "-U", sock, client_plugin(), f"state={state}"]),
                 state / "nbdkit.log", td, f"client nbdkit on {host}")

    def status() -> dict:
        try:
            return json.loads((state / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    return state, sock, status


def test_a_device_with_discover_adds_the_verified_donor_and_never_the_stranger(lab_root, donor_plugin,
                                                                                 tmp_path):
    """A client device (nbdkit with the client plugin on host c1, so nothing
    is mounted) with `discover = true` and the lab key and no donors of its
    own: the donor announcing with the lab key joins as discovered within a
    few epochs and takes the device's extents; the one announcing with
    another key is listed as not used, never joins."""
    plugin = client_plugin()
    if not plugin.exists():
        skip_or_fail(f"client plugin not built: {plugin} missing (run `make build`)")
    td = Teardown("device discovery")
    try:
        lab = netlab.Lab(td, lab_root, ["d1", "d2", "c1"], ssh=False)
        key, wrong = lab_root / "lab.psk", lab_root / "wrong.psk"
        key.write_text(f"lab:{secrets.token_hex(32)}\n")
        wrong.write_text(f"lab:{secrets.token_hex(32)}\n")
        params = {"size": "64M", "budget": "64M", "mlock": False, "poll_ms": 100, "announce": True}
        netlab.LabDonor(lab["d1"], td, lab_root, donor_plugin, {**params, "psk": key}, tls_psk=key).start()
        netlab.LabDonor(lab["d2"], td, lab_root, donor_plugin, {**params, "psk": wrong},
                        tls_psk=wrong).start()
        state, sock, status = lab_device(td, lab, "c1", tmp_path / "state",
                                         f'lab_key = "{key}"\ndiscover = true\n')

        st = wait_for(lambda: (lambda s: s if [d["name"] for d in s.get("donors", [])] == ["d1"]
                               and "d2" in s.get("not_admitted", {}) else None)(status()),
                      60, "d1 to join and d2 to be refused")
        d1 = st["donors"][0]
        assert d1["joined"] == "discovered" and not d1["failed"], d1
        assert "status not verified with the lab key" in st["not_admitted"]["d2"], st["not_admitted"]
        # Epochs run between the device's start and d1's join (one a second).
        assert len([e for e in st["epochs"] if e[0] // 1000 <= d1["joined_unix"]]) <= 10, st["epochs"]

        data = secrets.token_bytes(1 << 20)
        with nbdio.connect(f"nbd+unix:///c1?socket={sock}") as h:
            for off in range(0, 8 << 20, 1 << 20):
                h.pwrite(data, off)
            h.flush()
            for off in range(0, 8 << 20, 1 << 20):
                assert h.pread(1 << 20, off) == data, f"mismatch at {off}"
        st = wait_for(lambda: (lambda s: s if s["donors"][0]["extents_held"] > 0 else None)(status()),
                      30, "d1 to hold extents")
        assert [d["name"] for d in st["donors"]] == ["d1"], st["donors"]
    finally:
        errors = td.close()
    assert errors == []


def test_a_keyless_device_uses_announced_donors_only_on_networks_it_trusts(lab_root, donor_plugin,
                                                                             tmp_path):
    """Two keyless devices with `discover = true` and a keyless donor
    announcing on the lab's network: the one without `trust_network` never
    uses it and its status says why; the one trusting the lab's network uses
    it."""
    if not client_plugin().exists():
        skip_or_fail(f"client plugin not built: {client_plugin()} missing (run `make build`)")
    td = Teardown("keyless discovery")
    try:
        lab = netlab.Lab(td, lab_root, ["d1", "c1", "c2"], ssh=False)
        netlab.LabDonor(lab["d1"], td, lab_root, donor_plugin,
                        {"size": "64M", "budget": "64M", "mlock": False, "poll_ms": 100,
                         "announce": True, "insecure": True}).start()
        _, _, untrusting = lab_device(td, lab, "c1", tmp_path / "c1", "discover = true\n")
        _, sock, trusting = lab_device(td, lab, "c2", tmp_path / "c2",
                                       f'discover = true\ntrust_network = ["{netlab.SUBNET}"]\n')
        st = wait_for(lambda: (lambda s: s if [d["name"] for d in s.get("donors", [])] == ["d1"]
                               else None)(trusting()), 60, "d1 to join the trusting device")
        assert st["donors"][0]["joined"] == "discovered", st["donors"]
        assert "d1" not in st.get("not_admitted", {}), st
        data = secrets.token_bytes(1 << 20)
        with nbdio.connect(f"nbd+unix:///c2?socket={sock}") as h:
            h.pwrite(data, 0)
            h.flush()
            assert h.pread(1 << 20, 0) == data
        st = wait_for(lambda: (lambda s: s if "d1" in s.get("not_admitted", {}) else None)(untrusting()),
                      60, "the untrusting device to say why d1 is not used")
        why = st["not_admitted"]["d1"]
        assert f"{lab['d1'].addr} is not on a trusted network (loopback)" in why, why
        assert st["donors"] == [], st["donors"]
        text = subprocess.run([pagerctl(), "status", "--state-dir", str(tmp_path / "c1")],
                              capture_output=True, text=True, timeout=30)
        assert "announced d1, not used:" in text.stdout and "--trust-network" in text.stdout, \
            text.stdout + text.stderr
    finally:
        errors = td.close()
    assert errors == []


def test_donors_published_in_the_labs_dns_are_found_from_another_host(lab_root, donor_plugin):
    """BIND on lab host ns serves the lab's zone; donor d1 publishes itself
    there (announce=dns, from its own address) and not by multicast DNS;
    `pagerctl discover --domain` on c1 finds and verifies it through the
    DNS, plain `pagerctl discover` there does not see it; d1's clean stop
    removes its records."""
    from netpager_testkit.dns import DnsServer

    td = Teardown("dns discovery")
    try:
        lab = netlab.Lab(td, lab_root, ["ns", "d1", "c1"], ssh=False)
        dns = DnsServer(td, lab_root, addr=lab["ns"].addr, wrap=lab["ns"].netns_argv)
        key = lab_root / "lab.psk"
        key.write_text(f"lab:{secrets.token_hex(32)}\n")
        d1 = netlab.LabDonor(lab["d1"], td, lab_root, donor_plugin,
                             {"size": "64M", "budget": "64M", "mlock": False, "psk": key,
                              "announce": "dns", "dns_zone": dns.zone, "dns_key": dns.key_file,
                              "dns_server": dns.server}, tls_psk=key).start()
        seen = discover(lab, "c1", "--psk", str(key), "--domain", dns.zone, "--dns-server", dns.server,
                        expect=["d1"])
        assert list(seen) == ["d1"], seen
        assert seen["d1"]["usable"] and seen["d1"]["why"] == "verified with the lab key", seen["d1"]
        assert seen["d1"]["nbd"] == f"{lab['d1'].addr}:{d1.port}", seen["d1"]
        assert "d1" not in discover(lab, "c1", "--psk", str(key), listen=3)
        d1.terminate()
        assert dns.records(f"_netpager._tcp.{dns.zone}", "PTR") == []
    finally:
        errors = td.close()
    assert errors == []
