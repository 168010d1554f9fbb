"""A donor whose status endpoint listens on a network address must
authenticate it. The endpoint binds 0.0.0.0 here, but the tests only ever
connect to this test process's own loopback addresses (traffic stays on
loopback)."""

from __future__ import annotations

from netpager_testkit import OwnedProcess, StatusClient, StatusError, pb2, wait_for
from netpager_testkit.donor import free_ports, nbd_handshake
from netpager_testkit.machine import loopback
from netpager_testkit.status import LabKey


def addr() -> str:
    return loopback(1, net=2)


def start_nbdkit(teardown, tmp_path, plugin, name: str, *params: str):
    """nbdkit on this process's loopback address with `params` (the status
    endpoint on every address, on a port free on all of them); returns
    (process, NBD port, status port)."""
    nbd_port, status_port = free_ports(addr(), 1)[0], free_ports("0.0.0.0", 1)[0]
    argv = ["nbdkit", "-f", "--port", nbd_port, "-i", addr(), plugin, "mlock=false",
            "budget=16M", f"status=0.0.0.0:{status_port}", *params]
    proc = OwnedProcess(argv, tmp_path / f"{name}.log", teardown, name)
    return proc, nbd_port, status_port


def test_network_status_endpoint_requires_psk(teardown, tmp_path, donor_plugin, keys):
    """Expected: status=0.0.0.0:PORT without psk= stops nbdkit at start with
    a message naming psk= and insecure=true; with psk= it starts and answers
    signed requests (asked on loopback) and refuses unsigned ones; with
    insecure=true it starts without a key."""
    proc, _, _ = start_nbdkit(teardown, tmp_path, donor_plugin, "open")
    assert proc.wait(60) not in (None, 0), "nbdkit started with an open status endpoint"
    log = proc.log_tail()
    assert "is not a loopback address" in log and "psk=FILE" in log and "insecure=true" in log, log

    proc, nbd_port, status_port = start_nbdkit(teardown, tmp_path, donor_plugin, "keyed",
                                               f"psk={keys.lab_psk}", "node-id=keyed")
    keyed = StatusClient(addr(), status_port, key=LabKey.from_psk_file(keys.lab_psk))

    def up():
        assert proc.alive(), proc.log_tail()
        try:
            return nbd_handshake(f"nbd://{addr()}:{nbd_port}/") and keyed.query()
        except (OSError, StatusError):
            return None

    assert wait_for(up, 30, "the keyed donor").node_id == "keyed"
    pb = pb2()
    reply = StatusClient(addr(), status_port).exchange(pb.Request(status=pb.StatusQuery()))
    assert reply.WhichOneof("body") == "error" and "authentication required" in reply.error
    proc.stop()

    proc, nbd_port, status_port = start_nbdkit(teardown, tmp_path, donor_plugin, "insecure",
                                               "insecure=true", "node-id=insecure")
    plain = StatusClient(addr(), status_port)

    def up_plain():
        assert proc.alive(), proc.log_tail()
        try:
            return plain.query()
        except (OSError, StatusError):
            return None

    assert wait_for(up_plain, 30, "the insecure donor").node_id == "insecure"

