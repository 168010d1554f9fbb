"""Donors found through the lab's DNS (wide-area DNS-SD, issue 40), against
a real BIND on loopback (netpager_testkit.dns): a donor started with
`announce=dns` publishes its records by TSIG-signed dynamic updates and
removes them when it stops; `pagerctl discover --domain` and a device
attached with `--discover-domain` find it and admit it only once its signed
status verifies, never a record forged to point at a host with another key.
A flood of bogus records costs the device's epochs nothing (issue 34). A
client with no donors file attaches through the DNS alone, `--wait-donors`
counting the donors it found and admitted; a killed donor's records expire
by their lease (`seq=`/`lease=` in the TXT, judged on the reader's own
clock) and another donor removes them from the zone."""

from __future__ import annotations

import json
import os
import secrets
import socket
import statistics

from netpager_testkit import wait_for
from netpager_testkit.client import pagerctl_status, run_pagerctl
from netpager_testkit.dns import DnsServer

ZONE = "lab.test"
SERVICE = f"_netpager._tcp.{ZONE}"


def dns_params(dns: DnsServer, ttl: int = 30) -> dict:
    return {"announce": "dns", "dns_zone": ZONE, "dns_key": dns.key_file, "dns_server": dns.server,
            "dns_ttl": ttl}


def discover(dns: DnsServer, *args: str) -> tuple[dict, str]:
    p = run_pagerctl(["discover", "--json", "--for", "5", "--timeout", "3", "--domain", ZONE,
             "--dns-server", dns.server, *args])
    return {r["node_id"]: r for r in json.loads(p.stdout)}, p.stderr


def write_every_byte(device: str, size: int) -> None:
    """The whole device written (each MiB its own bytes), flushed, dropped
    from the page cache and read back."""
    chunks = [secrets.token_bytes(1 << 20) for _ in range(size >> 20)]
    fd = os.open(device, os.O_RDWR)
    try:
        for i, c in enumerate(chunks):
            os.pwrite(fd, c, i << 20)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for i, c in enumerate(chunks):
            assert os.pread(fd, 1 << 20, i << 20) == c, f"mismatch in MiB {i}"
    finally:
        os.close(fd)


def write_and_read_back(device: str) -> None:
    """8 MiB written, flushed, dropped from the page cache and read back."""
    data = secrets.token_bytes(1 << 20)
    fd = os.open(device, os.O_RDWR)
    try:
        for off in range(0, 8 << 20, 1 << 20):
            os.pwrite(fd, data, off)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for off in range(0, 8 << 20, 1 << 20):
            assert os.pread(fd, 1 << 20, off) == data, f"mismatch at {off}"
    finally:
        os.close(fd)

def test_a_donor_in_the_labs_dns_is_found_verified_used_and_removed_at_its_stop(
        teardown, tmp_path, cluster, client):
    dns = DnsServer(teardown, tmp_path)
    key, wrong = tmp_path / "lab.psk", tmp_path / "wrong.psk"
    key.write_text(f"lab:{secrets.token_hex(32)}\n")
    wrong.write_text(f"lab:{secrets.token_hex(32)}\n")
    common = {"budget": "64M", "mlock": False, "poll_ms": 100, "busy_load": 1000}
    (d1,) = cluster.start_donors(1, tls_psk=key, psk=key, **common, **dns_params(dns))
    # A host with another lab key, published by someone holding the zone's
    # key under a name of its own: seen, never used.
    (stranger,) = cluster.start_donors(1, tls_psk=wrong, psk=wrong, **common)
    dns.update(dns.forge("forged", stranger.addr, stranger.port, stranger.status_addr[1]))
    inst = f"d1.{SERVICE}."
    assert inst in wait_for(lambda: (lambda r: r if inst in r else None)(dns.records(SERVICE, "PTR")),
                            30, "d1's PTR record")
    assert dns.records(f"d1.{SERVICE}", "SRV") == [f"0 0 {d1.port} d1-netpager.{ZONE}."]
    assert dns.records(f"d1-netpager.{ZONE}", "A") == [d1.addr]

    seen, _ = discover(dns, "--psk", str(key), "--expect", "d1", "--expect", "forged")
    assert sorted(seen) == ["d1", "forged"], seen
    assert seen["d1"]["usable"] and seen["d1"]["why"] == "verified with the lab key", seen["d1"]
    assert seen["d1"]["nbd"] == f"{d1.addr}:{d1.port}", seen["d1"]
    assert not seen["forged"]["usable"], seen["forged"]
    assert "status not verified with the lab key" in seen["forged"]["why"], seen["forged"]

    client.attach([], mode="none", size="32M",
                  extra=["--discover-domain", ZONE, "--dns-server", dns.server, "--psk", str(key),
                         "--epoch", "0.2"])
    st = wait_for(lambda: (lambda s: s if [d["name"] for d in s.get("donors", [])] == ["d1"]
                           and "forged" in s.get("not_admitted", {}) else None)(client.device_status()),
                  60, "d1 to join and the forged record to be refused")
    assert st["donors"][0]["joined"] == "discovered", st["donors"]
    assert "status not verified with the lab key" in st["not_admitted"]["forged"], st["not_admitted"]
    assert st["discover_domain"] == [ZONE], st
    write_and_read_back(client.device)
    wait_for(lambda: client.device_status()["donors"][0]["extents_held"] > 0, 30, "d1 to hold extents")
    assert stranger.status().used_bytes == 0

    # A clean stop removes the donor's records; the forged ones stay.
    d1.terminate()
    wait_for(lambda: inst not in dns.records(SERVICE, "PTR"), 30, "d1's PTR record to go")
    assert dns.records(f"d1.{SERVICE}", "SRV") == []
    assert dns.records(f"d1-netpager.{ZONE}", "A") == []
    assert dns.records(SERVICE, "PTR") == [f"forged.{SERVICE}."]


def test_a_donor_requiring_export_tokens_is_asked_for_the_token_given(teardown, tmp_path, cluster, client,
                                                                      netpager_token):
    """An announcement carries no token, and a donor with `export-secret=`
    opens only CLIENT~TOKEN: the device asks its discovered donors for the
    export `--discover-export` names (as Ansible gives it), and the donor
    takes its pages."""
    dns = DnsServer(teardown, tmp_path)
    secret = tmp_path / "export.secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    (d1,) = cluster.start_donors(1, budget="64M", mlock=False, poll_ms=100, busy_load=1000,
                                 export_secret=secret, **dns_params(dns))
    client.attach([], mode="none", size="32M",
                  extra=["--discover-domain", ZONE, "--dns-server", dns.server, "--epoch", "0.2",
                         "--discover-export", netpager_token(secret, client.client_id)])
    wait_for(lambda: [d["name"] for d in client.device_status().get("donors", [])] == ["d1"], 60,
             "d1 to join through the DNS")
    write_and_read_back(client.device)
    wait_for(lambda: client.device_status()["donors"][0]["extents_held"] > 0, 30, "d1 to hold extents")
    # (its refusals read `export for client "ID": no token`)
    assert "export for client" not in d1.log_path.read_text(), "d1 refused an export"


def test_a_flood_of_bogus_records_leaves_the_epochs_as_they_were(teardown, tmp_path, cluster, client):
    """200 records point at a port that takes no connection (a full
    backlog: every status query waits out the connect timeout). The checks
    run on the admission thread: the device's epochs last as long as before
    the flood (on the epoch thread they would take 200 timeouts each)."""
    dns = DnsServer(teardown, tmp_path)
    (d1,) = cluster.start_donors(1, budget="64M", mlock=False, poll_ms=100, busy_load=1000)
    tarpit = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    teardown.add("the tarpit socket", tarpit.close)
    tarpit.bind(("127.0.0.1", 0))
    tarpit.listen(0)
    port = tarpit.getsockname()[1]
    client.attach([d1], mode="none", size="32M",
                  extra=["--discover-domain", ZONE, "--dns-server", dns.server, "--epoch", "0.2",
                         "--connect-timeout", "1"])

    def epochs(after_ms: int = 0, n: int = 20) -> list[int]:
        """Durations (µs) of the device's epochs that started after `after_ms`, once there are n."""
        return wait_for(lambda: (lambda e: e if len(e) >= n else None)(
            [us for at, us in client.device_status()["epochs"] if at > after_ms]), 60, f"{n} epochs")

    baseline = epochs()
    flood_ms = client.device_status()["updated_unix_ms"]
    lines = []
    for i in range(200):
        lines += dns.forge(f"fake{i:03}", "127.0.0.1", port, port)
    dns.update(lines)
    st = wait_for(lambda: (lambda s: s if sum(n.startswith("fake") for n in s.get("not_admitted", {})) >= 200
                           else None)(client.device_status()), 120, "every bogus record checked")
    during = epochs(after_ms=flood_ms)
    assert all(n.startswith("fake") or n == "d1" for n in st["not_admitted"]), st["not_admitted"]
    assert "status not read" in st["not_admitted"]["fake000"], st["not_admitted"]["fake000"]
    # A slower epoch or two from the machine's other load is noise; the
    # epoch thread waiting on the checks would be 200 connect timeouts.
    ratio = statistics.median(during) / max(statistics.median(baseline), 1)
    print(f"epoch median: {statistics.median(baseline)} µs before the flood, "
          f"{statistics.median(during)} µs during it ({ratio:.2f}x)")
    assert ratio < 10, (baseline, during)
    assert [d["name"] for d in client.device_status()["donors"]] == ["d1"]


def test_prefetchd_follows_the_domain_and_uses_only_the_verified_donor(teardown, tmp_path, cluster):
    from netpager_testkit.ci import skip_or_fail
    from netpager_testkit.prefetch import Prefetchd, finish_job, generate, missing_binaries, start_job

    if missing_binaries():
        skip_or_fail(f"not built: {missing_binaries()} (run `make build`)")
    dns = DnsServer(teardown, tmp_path)
    key, wrong = tmp_path / "lab.psk", tmp_path / "wrong.psk"
    key.write_text(f"lab:{secrets.token_hex(32)}\n")
    wrong.write_text(f"lab:{secrets.token_hex(32)}\n")
    common = {"budget": "8M", "size": "4M", "mlock": False, "poll_ms": 100, "busy_load": 1000}
    (good,) = cluster.start_donors(1, tls_psk=key, psk=key, **common, **dns_params(dns))
    (stranger,) = cluster.start_donors(1, tls_psk=wrong, psk=wrong, **common)
    dns.update(dns.forge("forged", stranger.addr, stranger.port, stranger.status_addr[1]))
    ds = generate("cyclic-random", tmp_path / "ds", 0.025)
    pd = Prefetchd(teardown, tmp_path, ds["data"], local_cache="256K",
                   extra=["--discover-domain", ZONE, "--dns-server", dns.server, "--psk", key,
                          "--discover-export", "prefetchd@2M", "--status-poll-ms", "100"])
    name = f"{good.addr}:{good.port}/prefetchd@2M"
    lane = wait_for(lambda: next((d for d in pd.status()["donors"] if d["name"] == name), None), 30,
                    f"a lane for the donor published in DNS, {name}")
    assert lane["joined"] == "discovered", lane
    pd.add_job("j", ds["hints_path"])
    result = finish_job(start_job(teardown, tmp_path, ds["hints_path"], pd.mount / "jobs" / "j",
                                  manifest=ds["manifest_path"], compute_us=500))
    assert result["mismatches"] == 0 and result["records"] > 0, result
    assert good.status().used_bytes > 0
    log = pd.proc.log_path.read_text()
    assert "discovered donor forged not used: status not verified with the lab key" in log, log[-3000:]
    assert [d["name"] for d in pd.status()["donors"]] == [name]
    assert pd.stop() == 0


def test_a_dns_server_that_does_not_answer_delays_no_io_and_shows_in_status(teardown, tmp_path, cluster,
                                                                             client):
    """The domain's server takes queries and never answers (a UDP socket
    nobody reads): every browse waits out its timeout on discovery's
    thread; the device serves its I/O meanwhile and says what is wrong."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    teardown.add("the silent DNS socket", silent.close)
    silent.bind(("127.0.0.1", 0))
    server = f"127.0.0.1:{silent.getsockname()[1]}"
    (d1,) = cluster.start_donors(1, budget="64M", mlock=False, poll_ms=100, busy_load=1000)
    client.attach([d1], mode="none", size="32M",
                  extra=["--discover-domain", ZONE, "--dns-server", server, "--epoch", "0.2",
                         "--connect-timeout", "2"])
    st = wait_for(lambda: (lambda s: s if s.get("discovery_error") else None)(client.device_status()),
                  60, "the DNS server's silence in status")
    assert f"domain {ZONE}: DNS server {server}: no answer" in st["discovery_error"], st["discovery_error"]
    write_and_read_back(client.device)
    text = pagerctl_status(client.state_dir).stdout
    assert f"discovery: browsing _netpager._tcp on domain {ZONE}; domain {ZONE}: DNS server" in text, text


def test_a_client_with_no_donors_file_attaches_mirror_through_the_dns_alone(teardown, tmp_path, cluster,
                                                                          client):
    """No --donor, no donors file: `--wait-donors` counts the donors found in
    the domain and admitted (their signed status verified), as the device's
    epochs admit them. With one donor published, mode mirror (2) fails at
    the end of its wait naming what it found and what it refused; with two
    it attaches, the device opening with both (what swap's check reads), and
    every byte written reads back."""
    dns = DnsServer(teardown, tmp_path)
    key = tmp_path / "lab.psk"
    key.write_text(f"lab:{secrets.token_hex(32)}\n")
    common = {"budget": "64M", "mlock": False, "poll_ms": 100, "busy_load": 1000}
    (d1,) = cluster.start_donors(1, tls_psk=key, psk=key, **common, **dns_params(dns))
    # A record pointing at a port where nothing listens: found, refused.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    dns.update(dns.forge("ghost", "127.0.0.1", dead, dead))
    inst = f"d1.{SERVICE}."
    wait_for(lambda: inst in dns.records(SERVICE, "PTR"), 30, "d1's PTR record")
    discovery = ["--discover-domain", ZONE, "--dns-server", dns.server, "--psk", str(key), "--epoch", "0.2"]
    base = ["attach", "--state-dir", client.state_dir, "--client-id", client.client_id, "--size", "16M",
            "--mode", "mirror", *discovery]
    p = run_pagerctl([*base, "--wait-donors", "3"], check=False)
    if p.returncode == 0:
        run_pagerctl(["detach", "--state-dir", client.state_dir])
        raise AssertionError(f"mirror attached with one donor: {p.stdout}{p.stderr}")
    assert ("mode mirror places each unit on 2 distinct donors, and 1 can take pages now: none given "
            f"(--donor, --donors-file); 1 donor found through DNS domain {ZONE} (d1 at {d1.addr}:{d1.port})"
            in p.stderr), p.stderr
    assert f"found ghost at 127.0.0.1:{dead}, not admitted: " in p.stderr, p.stderr
    assert "nothing was attached after waiting 3 s" in p.stderr, p.stderr
    assert client.attach_json() is None and not (client.state_dir / "device.toml").exists()

    (d2,) = cluster.start_donors(1, tls_psk=key, psk=key, **common, **dns_params(dns))
    client.attach([], mode="mirror", size="16M", extra=[*discovery, "--wait-donors", "60"])
    # status.json is written as the device opened: both donors were in it.
    st = client.device_status()
    assert sorted(d["name"] for d in st["donors"]) == ["d1", "d2"], st["donors"]
    assert all(d["joined"] == "discovered" for d in st["donors"]), st["donors"]
    assert "ghost" in st.get("not_admitted", {}), st
    write_every_byte(client.device, 16 << 20)
    wait_for(lambda: all(d["extents_held"] > 0 for d in client.device_status()["donors"]), 30,
             "both donors to hold extents")


def dig_all(dns: DnsServer, name: str) -> list[str]:
    """Every record at `name` (PTR, SRV, TXT, A), as dig lists them."""
    return [r for t in ("PTR", "SRV", "TXT", "A") for r in dns.records(name, t)]


def test_a_killed_donors_records_expire_for_clients_and_another_donor_removes_them(
        teardown, tmp_path, cluster, client):
    """d1 is killed (SIGKILL: no clean stop) while a device uses it: its
    records stop being published again, the device shows them expired once
    their counter stood still for the lease, and a donor that publishes in
    the zone removes them (a conditional update, with the zone's key).
    d2 prunes nothing (dns-prune=false) so that the client's view is
    checked first; d3, started then, removes d1's records."""
    dns = DnsServer(teardown, tmp_path)
    common = {"budget": "64M", "mlock": False, "poll_ms": 100, "busy_load": 1000}
    lease = {**dns_params(dns, ttl=1), "dns_lease": 6, "dns_prune": "false"}
    d1, d2 = cluster.start_donors(2, **common, **lease)
    client.attach([], mode="none", size="32M",
                  extra=["--discover-domain", ZONE, "--dns-server", dns.server, "--epoch", "0.2"])
    wait_for(lambda: sorted(d["name"] for d in client.device_status().get("donors", [])) == ["d1", "d2"],
             60, "d1 and d2 to join through the DNS")
    txt = dns.records(f"d1.{SERVICE}", "TXT")
    assert len(txt) == 1 and '"lease=6"' in txt[0] and '"seq=' in txt[0], txt
    d1.kill9()
    st = client.wait_status(lambda s: "d1" in s.get("expired", {}), 60, "d1's records to show expired")
    assert "past its lease of 6 s" in st["expired"]["d1"], st["expired"]
    assert "d2" not in st.get("expired", {}), st["expired"]
    text = pagerctl_status(client.state_dir).stdout
    assert "announced d1, domain lab.test: expired: " in text, text
    # d1's records are still in the zone: nobody has removed them yet.
    assert dig_all(dns, f"d1.{SERVICE}"), "d1's records went without a pruning donor"

    (d3,) = cluster.start_donors(1, **common, **dns_params(dns, ttl=1), dns_lease=6)
    wait_for(lambda: not dig_all(dns, f"d1.{SERVICE}") and not dns.records(f"d1-netpager.{ZONE}", "A"),
             60, "d1's records to be removed from the zone")
    ptrs = sorted(dns.records(SERVICE, "PTR"))
    assert ptrs == [f"d2.{SERVICE}.", f"d3.{SERVICE}."], ptrs
    assert dns.records(f"d2-netpager.{ZONE}", "A") == [d2.addr]
    assert "removed donor d1's records" in d3.log_path.read_text(), d3.log_tail()
    # Gone from the zone, gone from the device's list of expired records;
    # the live donors' records never expired.
    client.wait_status(lambda s: not s.get("expired"), 30, "d1 to leave the expired records")
