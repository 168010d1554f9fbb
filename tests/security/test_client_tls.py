"""The client device on TLS-only donors: `pagerctl attach --psk` in mirror
mode, each donor also requiring the client's export token and signed status
requests."""

from __future__ import annotations

import json
import subprocess

import pytest

from netpager_testkit import wait_for
from netpager_testkit.nbdio import pattern
from netpager_testkit.client import pagerctl_status
from netpager_testkit.paths import pagerctl, target_dir
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.nbdio import connect

MIB = 1 << 20
DEVICE = 64 * MIB


@pytest.fixture
def pagerctl_built():
    for path in (pagerctl(), target_dir() / "libpager_client_plugin.so"):
        if not path.exists():
            skip_or_fail(f"client not built: {path} missing (run `make build`)")


def run_pagerctl(*args) -> str:
    argv = [str(pagerctl())] + [str(a) for a in args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr}\n{p.stdout}")
    return p.stdout


def test_mirror_device_over_tls_with_export_tokens(root, pagerctl_built, teardown, tmp_path,
                                                    start_donors, keys):
    """Expected: the device attaches through donors that accept only TLS
    with the lab key and only c1's token, 64 MiB written through it read
    back intact, both donors hold pages, the client reads each donor's
    signed status (state idle, not unreachable), and after one donor is killed
    (kill -9) the mirror still serves every byte."""
    donors = start_donors(2, tls_psk=keys.lab_psk, psk=keys.lab_psk,
                          export_secret=keys.export_secret)
    state = tmp_path / "state"
    # The client presents its id (c1) as TLS user; its export name on each
    # donor carries its token. The donors' status endpoints take only
    # requests signed with the lab key, and sign their replies.
    args = ["attach", "--state-dir", state, "--size", "64M", "--mode", "mirror",
            "--client-id", "c1", "--psk", keys.lab_psk, "--request-timeout", "5",
            # The client's own NBD socket is what this test reads through.
            "--frontend", "nbd"]
    for d in donors:
        host, sport = d.status_addr
        args += ["--donor", f"{d.addr}:{d.port}/{keys.export('c1', '128M')},status={host}:{sport},name={d.name}"]

    def detach():
        if (state / "attach.json").exists():
            run_pagerctl("detach", "--state-dir", state)

    teardown.add(f"pagerctl detach {state}", detach)
    teardown.add_log(state / "nbdkit.log")
    run_pagerctl(*args)

    uri = f"nbd+unix:///c1?socket={state / 'nbd.sock'}"
    with connect(uri) as h:
        for off in range(0, DEVICE, MIB):
            h.pwrite(pattern("tls-dev", off, MIB), off)
        h.flush()
    with connect(uri) as h:
        for off in range(0, DEVICE, MIB):
            assert h.pread(MIB, off) == pattern("tls-dev", off, MIB), f"offset {off}"
    for d in donors:
        # The device's pages are a store of their own: c1/DEVICE.
        used = {e.name: e.used_bytes for e in d.status().exports}
        mine = sum(u for name, u in used.items() if name.startswith("c1/"))
        assert mine > 0, f"{d.name} holds no pages of c1's device: {used}"

    def donor_states():
        st = json.loads(pagerctl_status(state, "--json").stdout)
        return {d["name"]: d["state"] for d in st["status"]["donors"]}
    wait_for(lambda: set(donor_states().values()) <= {"idle", "busy"}, 60,
             "the client to read every donor's signed status")

    donors[0].kill9()
    with connect(uri) as h:
        for off in range(0, DEVICE, MIB):
            assert h.pread(MIB, off) == pattern("tls-dev", off, MIB), f"offset {off} after a kill"
    run_pagerctl("detach", "--state-dir", state)
