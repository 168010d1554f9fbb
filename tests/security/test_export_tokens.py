"""Exports belong to their client: a donor started with
`export-secret=FILE` opens `CLIENT~TOKEN[@SIZE]` only with CLIENT's token,
so holding the lab key does not let one client reach another's pages."""

from __future__ import annotations

import nbd
import pytest

from netpager_testkit.nbdio import PAGE, pattern
from netpager_testkit.nbdio import connect


def refused(donor, export: str) -> None:
    with pytest.raises(nbd.Error):
        with connect(donor.uri(export)):
            pass


def test_netpager_token_matches_the_recipe(keys, netpager_token):
    """Expected: the admin tool prints CLIENT~TOKEN with TOKEN the first 32
    hex characters of HMAC-SHA256(secret, "netpager-export-v1" + CLIENT), the
    recipe SECURITY.md gives (computed here in Python)."""
    for client in ("c1", "c2", "node-17.lab"):
        assert netpager_token(keys.export_secret, client) == keys.export(client)


def test_a_client_opens_only_its_own_export(start_donors, keys):
    """Expected: the right token opens the export (over TLS with the lab
    key too); a missing token, a wrong one, or another client's token is
    refused with EACCES and a log line that names the client but not the
    token; c2 never reads c1's pages; status names exports by client only."""
    (donor,) = start_donors(1, tls_psk=keys.lab_psk, psk=keys.lab_psk,
                            export_secret=keys.export_secret)
    offsets = [0, 9 * PAGE + 5, 3 << 20]
    with connect(donor.uri(keys.export("c1", "8M"))) as c1:
        for off in offsets:
            c1.pwrite(pattern("c1", off, 2 * PAGE), off)

    # c2 holds the lab key and its own token, not c1's.
    c1_token, c2_token = keys.token("c1"), keys.token("c2")
    one_off = c1_token[:-1] + ("1" if c1_token.endswith("0") else "0")
    for name in ["c1", "c1@8M", f"c1~{c2_token}", f"c1~{c2_token}@8M", f"c1~{one_off}",
                 f"c1~{c1_token[:16]}", "", f"~{c2_token}"]:
        refused(donor, name)
    log = open(donor.log_path).read()
    assert 'export for client "c1": wrong token' in log
    assert 'export for client "c1": no token' in log
    for client in ("c1", "c2"):
        assert keys.token(client) not in log, "a token leaked into the donor's log"

    # c2's own export is another store: zeros where c1 wrote.
    with connect(donor.uri(keys.export("c2", "8M"))) as c2:
        for off in offsets:
            assert c2.pread(2 * PAGE, off) == bytes(2 * PAGE)
        c2.pwrite(pattern("c2", 0, PAGE), 0)
    # c1's pages are untouched; the name may omit the size on reconnection.
    with connect(donor.uri(keys.export("c1"))) as c1:
        for off in offsets:
            assert c1.pread(2 * PAGE, off) == pattern("c1", off, 2 * PAGE)
    names = sorted(e.name for e in donor.status().exports)
    assert names == ["c1", "c2"], names


def test_a_donor_without_secret_refuses_tokens(start_donors, keys):
    """Expected: without export-secret= a name carrying a token is refused
    (EINVAL: the admin forgot the secret on this donor), plain names work."""
    (donor,) = start_donors(1)
    refused(donor, keys.export("c1", "8M"))
    with connect(donor.uri("c1@8M")) as h:
        h.pwrite(b"x" * PAGE, 0)
    assert "has no export-secret=" in open(donor.log_path).read()
