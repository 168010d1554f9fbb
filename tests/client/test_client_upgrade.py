"""The client package's upgrade (packaging/deb/client/postinst) with real
devices attached: a restartable one moves onto the new pagerctl while it
stays attached (`pagerctl restart --binary`), and says so; one attached
--no-restartable is left as it is, and says when the new version takes
effect. The script runs as dpkg runs it (`postinst configure OLD`), with
the tree's pagerctl first on PATH, in a mount namespace of the test's
own where /var/lib is a directory of the test: the machine's
/var/lib/netpager is never touched. tests/deb installs the real package
(a device record without a device there)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from netpager_testkit import OwnedProcess, wait_for
from netpager_testkit.client import MIB, donor_spec, pid_alive
from netpager_testkit.paths import pagerctl, repo_root

POSTINST = repo_root() / "packaging" / "deb" / "client" / "postinst"


def test_an_upgrade_moves_restartable_devices_onto_the_new_pagerctl(teardown, donors, client_built, tmp_path):
    var_lib = tmp_path / "var-lib"
    (var_lib / "netpager").mkdir(parents=True)
    # A mount namespace where /var/lib is var_lib, kept by a process of ours.
    keeper = OwnedProcess(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f"mount --bind {var_lib} /var/lib && exec sleep infinity"],
                          tmp_path / "keeper.log", teardown, "mount namespace keeper")
    wait_for(lambda: " /var/lib " in Path(f"/proc/{keeper.pid}/mountinfo").read_text(), 10,
             "/var/lib bound in the test's mount namespace")
    inside = ["nsenter", f"--mount=/proc/{keeper.pid}/ns/mnt", "--"]
    env = {**os.environ, "PATH": f"{Path(pagerctl()).parent}:/usr/sbin:/usr/bin:/sbin:/bin"}

    def run(*argv, check=True) -> subprocess.CompletedProcess:
        p = subprocess.run([*inside, *map(str, argv)], capture_output=True, text=True, env=env, timeout=300)
        assert not check or p.returncode == 0, f"{argv}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p

    ds = donors(1)
    devices = {}
    for name, flag in (("held", "--restartable"), ("plain", "--no-restartable")):
        state = f"/var/lib/netpager/{name}"
        # Undone on every exit path, before the namespace's keeper goes.
        teardown.add(f"pagerctl detach {state} (in the test's mount namespace)",
                     lambda s=state: keeper.owned() and (var_lib / s.removeprefix("/var/lib/") / "attach.json").exists()
                     and run("pagerctl", "detach", "--state-dir", s))
        out = run("pagerctl", "attach", "--state-dir", state, "--size", "64M", "--mode", "none",
                  "--client-id", f"up-{name}", "--donor", donor_spec(ds[0]), "--frontend", "fuse", flag).stdout
        devices[name] = out.strip().splitlines()[-1]
    pattern = tmp_path / "pattern"
    pattern.write_bytes(os.urandom(4 * MIB))
    for dev in devices.values():
        subprocess.run(["dd", f"if={pattern}", f"of={dev}", "bs=1M", "oflag=direct", "status=none"],
                       check=True, timeout=300)

    def serve_pid(name: str) -> int:
        return json.loads((var_lib / "netpager" / name / "serve.json").read_text())["pid"]

    serving, plain = serve_pid("held"), serve_pid("plain")

    out = run("sh", POSTINST, "configure", "0.1.0+git20260101000000.0000000").stdout
    assert "/var/lib/netpager/held: moved onto the new version while attached: " \
           f"serving process {serving} replaced by " in out, out
    assert "/var/lib/netpager/plain: attached, not restartable, left as it is: " \
           "the new version takes effect at its next attach" in out, out
    # The held device has a new serving process; the other kept its own.
    assert not pid_alive(serving)
    assert pid_alive(plain)
    back = tmp_path / "back"
    for dev in devices.values():
        subprocess.run(["dd", f"if={dev}", f"of={back}", "bs=1M", "count=4", "iflag=direct", "status=none"],
                       check=True, timeout=300)
        assert back.read_bytes() == pattern.read_bytes(), f"{dev} changed across the upgrade"
    for name in devices:
        run("pagerctl", "detach", "--state-dir", f"/var/lib/netpager/{name}")
