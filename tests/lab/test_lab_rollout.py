"""Ansible over SSH on the lab (issue 18): site.yml rolls three donors and
two clients out to five hosts in network namespaces, from the Debian
packages (issue 28; installed on the machine, which the hosts share, and
purged at the end), with TLS and export tokens; the client's swap works
across the bridge; plain text, a wrong lab
key and another client's export are refused from another host; a rolling
update keeps every page (the full set: NETPAGER_FAULTS=full); undeploy.yml
leaves nothing. The tests run in order on one lab.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import netlab
from lab_ansible import (BINARIES, CLIENTS, DONORS, HOSTS, NBD_PORT, PACKAGES, STATUS_PORT, LabRollout,
                         installed_packages, recap, ssh_masters)
from netpager_testkit import MemoryCgroup, OwnedProcess, StatusClient, Teardown, swaps, wait_for
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.machine import SWAP
from netpager_testkit.paths import target_dir
from netpager_testkit.procs import tail
from netpager_testkit.status import LabKey, StatusError

MIB = 1 << 20
HOLD_PAGES = Path(__file__).resolve().parents[1] / "ansible" / "hold_pages.py"


@pytest.fixture(scope="module")
def rollout():
    if os.geteuid() != 0:
        skip_or_fail("needs root (network namespaces, swapon, FUSE)")
    missing = [b for b in BINARIES if not (target_dir() / b).exists()]
    if missing:
        pytest.fail(f"not built in {target_dir()}: {', '.join(missing)} (run `make build`)")
    if subprocess.run(["cargo", "deb", "--version"], capture_output=True).returncode != 0:
        skip_or_fail("cargo-deb is not installed (scripts/deps.sh installs it)")
    if installed_packages():
        skip_or_fail(f"netpager packages are installed on this machine ({', '.join(installed_packages())}): "
                     "the rollout would replace and then purge them")
    td = Teardown("lab rollout")
    try:
        # The clients' swap areas are the machine's: no other test run's alongside.
        SWAP.hold(td)
        parent = Path(tempfile.mkdtemp(prefix="netpager-lab-", dir="/tmp"))
        td.add(f"directory {parent}", parent.rmdir)
        lab = netlab.Lab(td, parent / "lab", HOSTS)
        # The hosts' daemons drop to the donor account: it must reach their
        # run directories.
        for d in (parent, lab.workdir):
            d.chmod(0o755)
        yield LabRollout(td, lab, install="deb")
    finally:
        errors = td.close()
    assert not errors, errors


def hold_pages_on(td: Teardown, lab: netlab.Lab, host: str, device: str, tag: str) -> OwnedProcess:
    """tests/ansible/hold_pages.py filling 48 MiB in a 32 MiB memory cgroup
    on `host`; returns once it is full and some of it is in `device`. It
    joins the cgroup before entering the namespace: `ip netns exec` mounts
    a /sys of the namespace's own, without the cgroup hierarchy."""
    cg = MemoryCgroup(td, 32 * MIB)
    ready = lab.workdir / f"{tag}.ready"
    holder = OwnedProcess(["sh", "-c", 'echo $$ > "$0" && exec "$@"', cg.procs_file,
                           *lab[host].netns_argv([sys.executable, HOLD_PAGES, "48", ready])],
                          lab.workdir / f"{tag}.log", td, f"hold_pages on {host}")
    wait_for(lambda: ready.exists() or not holder.alive(), 300, "the job to fill its memory")
    assert ready.exists(), holder.log_tail()
    assert swaps().get(device, 0) > 0, f"nothing in {device}: {swaps()}"
    return holder


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def nbdinfo_on(ro: LabRollout, host: str, uri: str):
    return ro.lab.ssh(host, f"nbdinfo --size {shlex.quote(uri)}", check=False, timeout=60)


def tls_uri(user: str, donor_addr: str, export: str, psk: Path) -> str:
    return f"nbds://{user}@{donor_addr}:{NBD_PORT}/{export}?tls-psk-file={psk}"


def test_rollout_over_ssh_serves_the_clients_across_the_bridge(rollout):
    ro, lab = rollout, rollout.lab
    out = ro.ansible("site.yml").stdout
    assert set(recap(out)) == set(HOSTS), out
    assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in recap(out).values()), out

    key = LabKey.from_psk_file(ro.psk_file("idle1"))
    for d in DONORS:
        # Each donor serves from its own host: the status endpoint answers on
        # the host's address, signed with the lab key, from the controller.
        st = StatusClient(lab[d].addr, STATUS_PORT, key=key).query()
        assert st.node_id == d and st.budget_bytes == 96 * MIB, st
        pid = ro.donor_pid(d)
        assert pid in netlab.netns_pids(lab[d].ns), f"donor {d} (pid {pid}) is not in its host's namespace"
    # Every host runs the packages' commands, which name their version.
    versions = {p: subprocess.run(["dpkg-query", "-W", "-f", "${Version}", p], capture_output=True, text=True,
                                  check=True).stdout for p in PACKAGES}
    for h in HOSTS:
        assert ro.pagerctl(h, "--version").stdout.startswith(f"pagerctl {versions['netpager-client']} (commit "), h
    lab_key_hex = ro.lab_key().read_text().strip()
    assert lab_key_hex not in out, "the lab key appeared in ansible's output"
    secret = (ro.inv / "netpager-export.secret").read_text().strip()
    assert secret not in out, "the export secret appeared in ansible's output"
    for c in CLIENTS:
        assert not (ro.host_dir(c) / "etc" / "export.secret").exists(), f"{c} holds the export secret"

    # Each client: attached, its device in use as swap, reading every
    # donor's signed status across the bridge.
    for c in CLIENTS:
        st = ro.client_status(c)
        assert st["attached"] and st["swap"] and st["server"]["alive"], (c, st)
        assert st["device"] in swaps(), (c, st["device"], swaps())
        wait_for(lambda c=c: all(d["state"] in ("idle", "busy") for d in ro.client_status(c)["status"]["donors"]),
                 60, f"{c} to read every donor's status")

    # The client's swap works across the bridge: a job in a small memory
    # cgroup on busy1 parks most of its pages in busy1's device, whose
    # extents sit on the donors' hosts, and gets every page back intact.
    device = ro.client_status("busy1")["device"]
    td = Teardown("swap job")
    try:
        holder = hold_pages_on(td, lab, "busy1", device, "holder")
        held = wait_for(lambda: sum(d["extents_held"] for d in ro.client_status("busy1")["status"]["donors"]),
                        30, "busy1's extents on the donors")
        assert held > 0
        holder.signal(signal.SIGUSR1)
        assert holder.wait(300) == 0, tail(holder.log_path)
    finally:
        errors = td.close()
    assert not errors, errors
    st = ro.client_status("busy1")
    assert st["status"]["totals"]["lost"] == 0, st["status"]["totals"]


def test_other_hosts_get_nothing_without_tls_key_and_token(rollout):
    """From busy2, a host holding the lab key and its own token: plain text,
    a wrong lab key and busy1's export are refused; its own export opens."""
    ro, lab = rollout, rollout.lab
    donor = lab["idle1"].addr
    psk = ro.psk_file("busy2")
    own = ro.token("busy2")
    assert nbdinfo_on(ro, "busy2", tls_uri("busy2", donor, own, psk)).returncode == 0

    plain = nbdinfo_on(ro, "busy2", f"nbd://{donor}:{NBD_PORT}/{own}@1M")
    assert plain.returncode != 0, "a donor served plain text to another host"

    wrong = ro.host_dir("busy2") / "wrong.psk"
    wrong.write_text(f"busy2:{secrets.token_hex(32)}\n")
    wrong.chmod(0o600)
    bad = nbdinfo_on(ro, "busy2", tls_uri("busy2", donor, own, wrong))
    assert bad.returncode != 0, "a donor accepted a wrong lab key"
    with pytest.raises(StatusError):
        StatusClient(donor, STATUS_PORT, key=LabKey.from_psk_file(wrong)).query()

    # busy1's export, asked for with busy2's token, and with none.
    other = "busy1~" + own.split("~", 1)[1]
    for export in (other, "busy1"):
        p = nbdinfo_on(ro, "busy2", tls_uri("busy2", donor, export, psk))
        assert p.returncode != 0, f"busy2 opened {export} on idle1"
    log = (ro.host_dir("idle1") / "log" / "netpager-donor-idle1.log").read_text(errors="replace")
    assert re.search(r'export for client "busy1": (wrong|no) token', log), tail(
        ro.host_dir("idle1") / "log" / "netpager-donor-idle1.log")


@pytest.mark.lab_full
def test_rolling_update_over_ssh_keeps_every_page(rollout):
    ro, lab = rollout, rollout.lab
    device = ro.client_status("busy1")["device"]
    td = Teardown("rolling update job")
    try:
        holder = hold_pages_on(td, lab, "busy1", device, "holder2")
        before = {d: ro.donor_pid(d) for d in DONORS}
        ro.write_inventory(u_star=0.6)
        out = ro.ansible("site.yml").stdout
        key = LabKey.from_psk_file(ro.psk_file("idle1"))
        for d in DONORS:
            assert ro.donor_pid(d) != before[d], f"{d} was not restarted"
            assert StatusClient(lab[d].addr, STATUS_PORT, key=key).query().u_star == pytest.approx(0.6)
        assert all(recap(out)[c]["changed"] == 0 for c in CLIENTS), out
        for c in CLIENTS:
            st = ro.client_status(c)
            assert st["attached"] and st["status"]["totals"]["lost"] == 0, (c, st["status"]["totals"])
        holder.signal(signal.SIGUSR1)
        assert holder.wait(300) == 0, tail(holder.log_path)
    finally:
        errors = td.close()
    assert not errors, errors


def test_undeploy_over_ssh_leaves_nothing(rollout):
    ro, lab = rollout, rollout.lab
    ro.ansible("undeploy.yml")
    # (by backing file: other tests may reuse the loop devices' numbers)
    assert netlab.loops_under(lab.workdir) == []
    for h in HOSTS:
        # Nothing but the host's sshd (and its session for this check) runs there.
        assert [p for p in netlab.netns_pids(lab[h].ns) if comm(p) not in ("sshd", "")] == [], h
        left = [p for p in ("opt", "etc", "var", "run", "log") if (ro.host_dir(h) / p).exists()]
        assert left == [], (h, left)
    # The packages are purged: nothing of them is left on the machine.
    assert installed_packages() == []
    assert not (lab.workdir / "deb-cache").exists()
    for path in ("/etc/netpager/donor.conf", "/etc/netpager/client.conf", "/etc/netpager/prefetchd.conf",
                 "/usr/lib/netpager", "/usr/bin/pagerctl"):
        assert not Path(path).exists(), path
    ro.close_connections()
    wait_for(lambda: not ssh_masters(lab.workdir), 30, "ansible's ssh masters to exit")
