"""`pagerctl serve` under a service manager keeps its FUSE connection in the
manager's fd store (systemd's `FileDescriptorStoreMax=`, pagerctl(1)
RESTARTS). PID 1 here is not systemd, so the test is the service manager,
over the real protocol: it binds the notify socket, starts serve with
NOTIFY_SOCKET, receives the connection (`FDSTORE=1`, `FDNAME=`, the fd
over SCM_RIGHTS), kill -9s serve while dd writes through a loop device
on it (writes in flight), starts a new serve with the fd as
LISTEN_FDS/LISTEN_FDNAMES, and checks every byte dd wrote. A manager that
does not say it keeps fds ($FDSTORE unset: FileDescriptorStoreMax=0, or
systemd before 254) gets the fd all the same, but serve says it is not
known to be kept and does not hand over on SIGUSR1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from netpager_testkit import LoopDevice, OwnedProcess, wait_for
from netpager_testkit.attach import mounted
from netpager_testkit.client import MIB
from netpager_testkit.paths import pagerctl

NAME = "netpager-fuse"
# argv: FD PROGRAM ARGS...: FD as fd 3, LISTEN_PID set, then exec.
PASS_FD = """
import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 3)
os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[2], sys.argv[2:])
"""
WRITTEN = 96 * MIB


def inflight(device: str) -> int:
    reads, writes = Path(f"/sys/block/{Path(device).name}/inflight").read_text().split()
    return int(reads) + int(writes)


class Manager:
    """The service manager's side: a device made by attach (then detached:
    serve runs it alone), the notify socket, and the fds stored in it,
    closed on teardown after the mount is gone."""

    def __init__(self, teardown, donors, client, tmp_path, size: str):
        client.attach(donors(3), mode="parity", size=size, frontend="fuse")
        client.detach()
        self.state = Path(client.state_dir)
        self.mnt = self.state / "fuse"
        self.stored: list[int] = []
        teardown.add("the stored FUSE fd", self.close_stored)
        teardown.add(f"FUSE mount {self.mnt}", self.unmount)
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        teardown.add("the notify socket", self.socket.close)
        self.notify = tmp_path / "notify.sock"
        self.socket.bind(str(self.notify))
        self.socket.settimeout(60)
        self.serve = [pagerctl(), "serve", "--state-dir", self.state, "--transport", "fuse"]

    def unmount(self):
        if mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], check=True)

    def close_stored(self):
        while self.stored:
            os.close(self.stored.pop())

    def receive(self) -> bytes:
        """One notification, its fds kept."""
        msg, fds, _, _ = socket.recv_fds(self.socket, 4096, 4)
        self.stored.extend(fds)
        return msg


def test_a_killed_serve_hands_its_connection_through_the_fd_store(teardown, donors, client, tmp_path):
    m = Manager(teardown, donors, client, tmp_path, "128M")
    mnt, stored, serve = m.mnt, m.stored, m.serve
    first = OwnedProcess(serve, tmp_path / "serve1.log", teardown, "serve 1",
                         env={**os.environ, "NOTIFY_SOCKET": str(m.notify), "FDSTORE": "1"})
    msg = m.receive()
    assert msg == f"FDSTORE=1\nFDNAME={NAME}\n".encode(), msg
    assert len(stored) == 1, stored
    device_file = mnt / "device"
    wait_for(lambda: mounted(mnt) and device_file.stat().st_size > 0, 30, f"{device_file} served")
    wait_for(lambda: "it keeps up to 1 fds: FDSTORE=1" in (tmp_path / "serve1.log").read_text(), 10,
             "serve 1 saying the manager keeps the connection")

    # Should the test fail with no serve left, requests on the connection
    # would wait forever (the stored fd keeps it): abort it first.
    abort = Path(f"/sys/fs/fuse/connections/{os.minor(os.stat(mnt).st_dev)}/abort")

    def abort_connection():
        if mounted(mnt) and abort.exists():
            abort.write_text("1")

    loop = LoopDevice(teardown, device_file, direct_io=True)
    pattern = tmp_path / "pattern"
    pattern.write_bytes(os.urandom(WRITTEN))
    dd = OwnedProcess(["dd", f"if={pattern}", f"of={loop.device}", "bs=256K", "oflag=direct",
                       "conv=fsync"], tmp_path / "dd.log", teardown, "dd")
    teardown.add("abort the FUSE connection", abort_connection)
    wait_for(lambda: inflight(loop.device) > 0 or not dd.alive(), 60, f"writes in flight on {loop.device}",
             interval=0.001)
    assert dd.alive(), "dd ended before the kill: write more"
    first.kill9()
    assert mounted(mnt), "the connection went with the serving process"

    # The stored fd becomes fd 3 of the next serve, as systemd passes it,
    # with LISTEN_PID its own pid.
    fd = stored[0]
    restart = [sys.executable, "-c", PASS_FD, str(fd), *serve]
    second = OwnedProcess(restart, tmp_path / "serve2.log", teardown, "serve 2",
                          env={**os.environ, "LISTEN_FDS": "1", "LISTEN_FDNAMES": NAME},
                          pass_fds=(fd,))
    assert dd.wait(300) == 0, Path(tmp_path / "dd.log").read_text()
    back = tmp_path / "back"
    subprocess.run(["dd", f"if={loop.device}", f"of={back}", "bs=1M", f"count={WRITTEN // MIB}",
                    "iflag=direct", "status=none"], check=True, timeout=300)
    assert back.read_bytes() == pattern.read_bytes(), "bytes differ after the restart"
    log = (tmp_path / "serve2.log").read_text()
    assert "took the FUSE connection from the service manager's fd store" in log, log
    # What serve 1 had read and not answered came again, to serve 2.
    wait_for(lambda: re.search(r"answered [1-9]\d* requests a dead serving process had left",
                               (tmp_path / "serve2.log").read_text()), 10, "requests resent to serve 2")

    loop.detach()
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 0, (tmp_path / "serve2.log").read_text()
    assert not mounted(mnt)


def test_a_manager_that_does_not_say_it_keeps_fds_is_not_trusted_with_the_connection(
        teardown, donors, client, tmp_path):
    m = Manager(teardown, donors, client, tmp_path, "64M")
    mnt = m.mnt
    env = {k: v for k, v in os.environ.items() if k != "FDSTORE"}
    log = tmp_path / "serve.log"
    serve = OwnedProcess(m.serve, log, teardown, "serve", env={**env, "NOTIFY_SOCKET": str(m.notify)})
    msg = m.receive()
    # Sent all the same: a systemd before 254 may keep it without saying.
    assert msg == f"FDSTORE=1\nFDNAME={NAME}\n".encode(), msg
    wait_for(lambda: "NOT known to be kept: FDSTORE is not set" in log.read_text(), 30,
             "serve saying the connection is not known to be kept")
    text = log.read_text()
    assert "gave the FUSE connection" not in text, text
    assert "(restartable)" not in text, text
    # A hand-over would leave the connection to a manager that may have
    # dropped it: SIGUSR1 is refused, and serve goes on serving.
    serve.signal(signal.SIGUSR1)
    wait_for(lambda: "SIGUSR1: not restartable" in log.read_text(), 10, "SIGUSR1 refused")
    assert serve.alive() and mounted(mnt), log.read_text()
    serve.signal(signal.SIGTERM)
    assert serve.wait(30) == 0, log.read_text()
    assert not mounted(mnt)
