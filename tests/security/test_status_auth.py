"""The status endpoint of a donor started with `psk=FILE`: only requests
signed with the lab key get an answer, replies are signed, and a drain
needs the key too."""

from __future__ import annotations

import json
import subprocess
import time

from netpager_testkit import StatusClient, pb2, state_word
from netpager_testkit.paths import pagerctl
from netpager_testkit.status import LabKey


def status_request():
    pb = pb2()
    return pb.Request(status=pb.StatusQuery())


def drain_request(on: bool):
    pb = pb2()
    return pb.Request(drain=pb.DrainCommand(drain=on))


def assert_refused(reply, why: str, node_id: str):
    """An error naming `why`, no status, and nothing of the status inside."""
    assert reply.WhichOneof("body") == "error", reply
    assert why in reply.error, reply.error
    assert not reply.HasField("status")
    assert node_id.encode() not in reply.SerializeToString()


def test_status_needs_the_lab_key(start_donors, keys):
    """Expected: unsigned, wrongly signed, stale and replayed requests get an
    error reply without any status field; a signed request gets the status,
    signed over its nonce; replies to unverified requests are unsigned."""
    (donor,) = start_donors(1, psk=keys.lab_psk, node_id="keyed-donor")
    host, port = donor.status_addr
    anyone = StatusClient(host, port)
    lab = LabKey.from_psk_file(keys.lab_psk)
    other_lab = LabKey.from_psk_file(keys.wrong_psk)

    reply = anyone.exchange(status_request())
    assert_refused(reply, "authentication required", "keyed-donor")
    assert reply.mac == b""

    reply = anyone.exchange(other_lab.sign_request(status_request()))
    assert_refused(reply, "bad MAC", "keyed-donor")
    assert reply.mac == b""

    stale = lab.sign_request(status_request(), timestamp_ms=int((time.time() - 3600) * 1000))
    assert_refused(anyone.exchange(stale), "away from the donor's clock", "keyed-donor")

    signed = lab.sign_request(status_request())
    reply = anyone.exchange(signed)
    assert reply.WhichOneof("body") == "status" and reply.status.node_id == "keyed-donor"
    assert lab.verify_reply(signed.auth.nonce, reply), "the reply is signed over our nonce"
    assert not other_lab.verify_reply(signed.auth.nonce, reply)

    # The same signed request again: a replay, refused.
    reply = anyone.exchange(signed)
    assert_refused(reply, "replayed", "keyed-donor")
    assert lab.verify_reply(signed.auth.nonce, reply)

    # A signature covers the body: a signed status query turned into a drain fails.
    tampered = lab.sign_request(status_request())
    tampered.drain.drain = True
    assert_refused(anyone.exchange(tampered), "bad MAC", "keyed-donor")

    # The harness's keyed client (signs, checks the signature) just works.
    assert donor.status().node_id == "keyed-donor"


def test_drain_needs_the_lab_key(start_donors, keys):
    """Expected: a drain command without the key, or with another lab's key,
    is refused and the donor stays idle; with the key it drains and the
    undo lifts the drain."""
    (donor,) = start_donors(1, psk=keys.lab_psk)
    host, port = donor.status_addr
    anyone = StatusClient(host, port)
    for req in (drain_request(True), LabKey.from_psk_file(keys.wrong_psk).sign_request(drain_request(True))):
        reply = anyone.exchange(req)
        assert reply.WhichOneof("body") == "error", reply
        assert state_word(donor.status()) == "idle"

    keyed = donor.status_client()
    assert state_word(keyed.drain(True)) == "draining"
    assert state_word(donor.status()) == "draining"
    assert state_word(keyed.drain(False)) == "idle"


def test_pagerctl_signs_with_the_lab_key(start_donors, keys):
    """Expected: `pagerctl donor-status` without --psk is refused by a keyed
    donor (the donor's reason is printed), with the lab key it prints the
    status, with another lab's key it fails; `donor-drain --psk` drains and
    `--undo` lifts it."""
    (donor,) = start_donors(1, psk=keys.lab_psk, node_id="ctl-donor")
    addr = "%s:%d" % donor.status_addr

    def ctl(*args):
        return subprocess.run([str(pagerctl()), *map(str, args)], capture_output=True, text=True, timeout=60)

    p = ctl("donor-status", addr, "--json")
    assert p.returncode != 0 and "requires signed requests: give the lab key" in p.stderr, p.stderr
    p = ctl("donor-status", addr, "--json", "--psk", keys.wrong_psk)
    assert p.returncode != 0, p.stdout
    p = ctl("donor-status", addr, "--json", "--psk", keys.lab_psk)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["node_id"] == "ctl-donor"
    assert ctl("donor-drain", addr, "--psk", keys.lab_psk).returncode == 0
    assert state_word(donor.status()) == "draining"
    assert ctl("donor-drain", addr, "--undo", "--psk", keys.lab_psk).returncode == 0
    assert state_word(donor.status()) == "idle"
