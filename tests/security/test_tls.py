"""Pages in flight: a donor started with `--tls=require --tls-psk=FILE`
serves only clients holding the lab key, and a donor without TLS serves
plain text only to this machine (loopback, Unix socket)."""

from __future__ import annotations

import subprocess

import nbd
import pytest

from netpager_testkit import OwnedProcess, StatusClient, StatusError, wait_for
from netpager_testkit.nbdio import PAGE, pattern
from netpager_testkit.status import LabKey

PATH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def nbdinfo(uri: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True,
                          timeout=60, env=PATH_ENV)


def tls_handle(donor, psk_file, username: str = "lab", export: str = "c1@16M") -> nbd.NBD:
    """A libnbd handle on `export`, TLS required, with this key file and user."""
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_psk_file(str(psk_file))
    h.set_tls_username(username)
    h.set_export_name(export)
    h.connect_tcp(donor.addr, str(donor.port))
    return h


def test_tls_psk_donor_serves_only_key_holders(start_donors, keys):
    """Expected: without TLS, with another key or with a user the file does
    not know, the connection fails before any export opens; with the lab
    key (nbdinfo's nbds:// URI, python3-libnbd) pages go both ways intact."""
    (donor,) = start_donors(1, tls_psk=keys.lab_psk, psk=keys.lab_psk)
    plain = f"nbd://{donor.addr}:{donor.port}/c1@16M"
    keyed = f"nbds://lab@{donor.addr}:{donor.port}/c1@16M?tls-psk-file={keys.lab_psk}"
    other = f"nbds://lab@{donor.addr}:{donor.port}/c1@16M?tls-psk-file={keys.wrong_psk}"

    r = nbdinfo(plain)
    assert r.returncode != 0 and r.stdout == "", f"plain text got through: {r.stdout}"
    r = nbdinfo(other)
    assert r.returncode != 0, f"another lab's key got through: {r.stdout}"
    assert "handshake" in r.stderr, r.stderr
    r = nbdinfo(keyed)
    assert r.returncode == 0 and r.stdout.strip() == str(16 << 20), r.stderr

    h = tls_handle(donor, keys.lab_psk)
    try:
        assert h.get_tls_negotiated()
        for off in (0, 7 * PAGE + 3, 5 << 20):
            h.pwrite(pattern("tls", off, 3 * PAGE), off)
        for off in (0, 7 * PAGE + 3, 5 << 20):
            assert h.pread(3 * PAGE, off) == pattern("tls", off, 3 * PAGE)
    finally:
        h.shutdown()

    for psk, user in [(keys.wrong_psk, "lab"), (keys.lab_psk, "stranger")]:
        with pytest.raises(nbd.Error):
            tls_handle(donor, psk, user)
    # The client ids in the file are TLS users too (the client presents its id).
    h = tls_handle(donor, keys.lab_psk, "c2", "c2@16M")
    h.shutdown()
    used = {e.name: e.used_bytes for e in donor.status().exports}
    assert used["c1"] > 0 and used.get("c2", 0) == 0, used


def test_plain_text_is_served_to_this_machine(start_donors, teardown, tmp_path, donor_plugin):
    """Expected: without --tls, a loopback client (TCP on 127.0.0.x) and a
    Unix-socket client are served in plain text: the rule that refuses
    other peers (unit-tested in pager-server's access.rs) leaves them be."""
    (donor,) = start_donors(1)
    with_tcp = nbd.NBD()
    with_tcp.connect_uri(donor.uri("c1@4M"))
    with_tcp.pwrite(pattern("lo", 0, PAGE), 0)
    assert with_tcp.pread(PAGE, 0) == pattern("lo", 0, PAGE)
    with_tcp.shutdown()

    sock = tmp_path / "donor.sock"
    proc = OwnedProcess(["nbdkit", "-f", "-U", sock, donor_plugin, "mlock=false", "budget=16M"],
                        tmp_path / "unix-donor.log", teardown, "unix donor")
    wait_for(lambda: sock.exists() or not proc.alive(), 30, f"nbdkit to listen on {sock}")
    assert proc.alive(), proc.log_tail()
    h = nbd.NBD()
    h.connect_uri(f"nbd+unix:///u@4M?socket={sock}")
    h.pwrite(pattern("unix", 0, PAGE), 0)
    assert h.pread(PAGE, 0) == pattern("unix", 0, PAGE)
    h.shutdown()


def test_replacing_the_key_file_rotates_both_keys(start_donors, keys, tmp_path):
    """Expected: after the lab's key file is replaced (written aside and
    renamed, as Ansible does), new TLS connections and status requests need
    the new key and the old one is refused, without restarting the donor;
    a connection made before keeps working (its TLS session stands)."""
    live = tmp_path / "live.psk"
    old = keys.lab_psk
    live.write_bytes(old.read_bytes())
    (donor,) = start_donors(1, tls_psk=live, psk=live)
    before = tls_handle(donor, old)
    try:
        before.pwrite(pattern("rot", 0, PAGE), 0)
        new = keys.wrong_psk
        aside = tmp_path / "live.psk.new"
        aside.write_bytes(new.read_bytes())
        aside.rename(live)

        uri = f"nbds://lab@{donor.addr}:{donor.port}/c1@16M?tls-psk-file="
        assert nbdinfo(uri + str(new)).returncode == 0
        assert nbdinfo(uri + str(old)).returncode != 0
        host, port = donor.status_addr
        assert StatusClient(host, port, key=LabKey.from_psk_file(new)).query().used_bytes == PAGE
        with pytest.raises(StatusError):
            StatusClient(host, port, key=LabKey.from_psk_file(old)).query()
        assert before.pread(PAGE, 0) == pattern("rot", 0, PAGE)
    finally:
        before.shutdown()
