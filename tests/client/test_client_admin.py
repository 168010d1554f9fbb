"""What a lab admin meets on the first day (issue 37): attach refuses donors
it cannot use and says why in words, waits for them with --wait-donors,
never turns swap on for a device that cannot place a unit; donor-add and
donors-file lines get the same words; status exits by the device's health;
broken pipes end quietly; top --batch; detach names who holds the device;
release frees a detached device's pages; the lab key file from `pagerctl
psk new` serves both sides; netpager-drain; a budget above the node's
memory is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tomllib
from pathlib import Path

from netpager_testkit import wait_for
from netpager_testkit.client import MIB, donor_spec, loop_devices_on, pagerctl_status, run_pagerctl
from netpager_testkit.donor import Donor
from netpager_testkit.paths import pagerctl, target_dir
from netpager_testkit.status import state_word


def spec(addr: str, status: str | None = None, name: str | None = None) -> str:
    s = addr + (f",status={status}" if status else "") + (f",name={name}" if name else "")
    return s


def refused_attach(state: Path, *args) -> str:
    """An attach that must fail and leave nothing; its stderr."""
    p = run_pagerctl(["attach", "--state-dir", state, "--frontend", "fuse", *args], check=False)
    assert p.returncode == 1, f"attach exited {p.returncode}:\n{p.stderr}\n{p.stdout}"
    assert p.stdout == "", p.stdout
    assert not (state / "attach.json").exists()
    assert not (state / "device.toml").exists(), "a new device's device.toml was written"
    assert loop_devices_on(state / "fuse" / "device") == []
    assert "nothing was attached" in p.stderr or "swap is not turned on" in p.stderr, p.stderr
    return p.stderr


def psk_new(path: Path, *clients: str) -> Path:
    args = ["psk", "new", path] + [a for c in clients for a in ("--client", c)]
    run_pagerctl(args)
    return path


def test_attach_names_each_donor_it_cannot_use(root, client_built, cluster, tmp_path):
    key, other = psk_new(tmp_path / "lab.psk", "c1"), psk_new(tmp_path / "other.psk", "c1")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    (tls,) = cluster.start_donors(1, tls_psk=key, psk=key, budget="64M", size="1G")
    nbd, status = f"{tls.addr}:{tls.port}", "{}:{}".format(*tls.status_addr)
    common = ["--size", "32M", "--mode", "none"]
    cases = {
        "unreachable": (["--psk", key, "--donor", spec("127.0.0.1:1")],
                        "nothing listens at 127.0.0.1:1"),
        "ports swapped": (["--psk", key, "--donor", spec(status, nbd)],
                          f"{status} is a status endpoint, not NBD"),
        "wrong lab key": (["--psk", other, "--donor", spec(nbd, status)],
                          "the donor does not hold this lab key"),
        "no psk": (["--donor", spec(nbd, status)], "requires TLS: give the lab key"),
        "id missing here": (["--psk", key, "--client-id", "c9", "--donor", spec(nbd, status)],
                            'has no line for this client\'s TLS identity "c9"'),
    }
    # The client's own file has c9, the donor's does not: TLS alone cannot
    # tell this from a wrong key; the signed status can.
    mine = tmp_path / "c9.psk"
    mine.write_text(key.read_text())
    run_pagerctl(["psk", "add", mine, "c9"])
    cases["id missing on the donor"] = (["--psk", mine, "--client-id", "c9", "--donor", spec(nbd, status)],
                                        'the donor holds this lab key but its PSK file has no line for '
                                        'this client\'s identity "c9"')
    donors_file = tmp_path / "donors"
    donors_file.write_text("127.0.0.1:1,status=127.0.0.1:2,name=bad\n")
    cases["donors file"] = (["--psk", key, "--donors-file", donors_file],
                            "donor bad (127.0.0.1:1): nothing listens at 127.0.0.1:1")
    for name, (args, words) in cases.items():
        if "--client-id" not in args:
            args = args + ["--client-id", "c1"]
        err = refused_attach(tmp_path / name.replace(" ", "-"), *common, *args)
        assert "places each unit on a donor, and 0 of the 1 given can take pages now" in err, f"{name}: {err}"
        assert words in err, f"{name}: {err}"


def test_wait_donors_allow_degraded_and_never_swap_without_room(root, client_built, donor_plugin,
                                                                 teardown, cluster, client, tmp_path):
    (d1,) = cluster.start_donors(1, budget="64M", size="1G")
    late = Donor(teardown, tmp_path, "late", "127.0.0.9", donor_plugin,
                 {"size": "1G", "budget": "64M", "mlock": False})
    late_spec = spec(f"{late.addr}:{late.port}", "{}:{}".format(*late.status_addr), "late")
    mirror = ["--size", "32M", "--mode", "mirror", "--client-id", client.client_id,
              "--donor", donor_spec(d1), "--donor", late_spec]

    # Swap is never turned on with too few donors, --allow-degraded or not.
    err = refused_attach(tmp_path / "swap", *mirror, "--swap", "--allow-degraded")
    assert "swap is not turned on for a device that cannot place a unit" in err, err
    assert "donor late (127.0.0.9" in err and "nothing listens" in err, err

    # --wait-donors: attach waits, saying so, and goes on once the donor is up.
    state = client.state_dir
    teardown.add(f"pagerctl detach {state}", lambda: (state / "attach.json").exists()
                 and run_pagerctl(["detach", "--state-dir", state]))
    log = tmp_path / "attach.log"
    with open(log, "w") as out:
        waiting = subprocess.Popen([str(pagerctl()), "attach", "--state-dir", str(state), "--frontend", "fuse",
                                    *map(str, mirror), "--wait-donors", "120"],
                                   stdout=subprocess.PIPE, stderr=out, text=True)
    teardown.add("the waiting attach", lambda: waiting.poll() is None and waiting.kill())
    wait_for(lambda: "waiting for donors (--wait-donors): 1 of 2 needed take pages" in log.read_text(),
             60, "attach to say it waits")
    assert waiting.poll() is None and not (state / "device.toml").exists()
    late.start()
    out, _ = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, log.read_text()
    device = out.strip().splitlines()[-1]
    assert device.startswith("/dev/loop"), out
    assert pagerctl_status(state).returncode == 0
    run_pagerctl(["detach", "--state-dir", state])

    # --allow-degraded: a block device without room attaches, and status
    # says it cannot place (exit 5) until a donor joins.
    late.terminate()
    p = run_pagerctl(["attach", "--state-dir", state, "--frontend", "fuse", "--allow-degraded"])
    assert "attaching anyway" in p.stderr, p.stderr
    p = pagerctl_status(state)
    assert p.returncode == 5, p.stdout
    assert "CANNOT PLACE new extents: mode mirror places each unit on 2 distinct donors" in p.stdout, p.stdout
    assert "health: degraded (exit status 5)" in p.stdout, p.stdout
    assert json.loads(pagerctl_status(state, "--json").stdout)["health"] == "degraded"
    run_pagerctl(["detach", "--state-dir", state])
    assert pagerctl_status(state).returncode == 3


def test_donor_add_and_donors_file_lines_say_why(root, client_built, donors, client, tmp_path):
    ds = donors(2)
    donors_file = tmp_path / "donors"
    donors_file.write_text("")
    client.attach(ds, mode="none", size="32M", extra=["--donors-file", donors_file])
    status = "{}:{}".format(*ds[0].status_addr)
    p = run_pagerctl(["donor-add", "--state-dir", client.state_dir, f"{status},name=swapped"], check=False)
    assert p.returncode == 1 and f"{status} is a status endpoint, not NBD" in p.stderr, p.stderr
    donors_file.write_text("127.0.0.1:1,name=gone\n")
    st = client.wait_status(lambda s: any(d["name"] == "gone" for d in s["donors"]), 60,
                            "the file's donor in the set")
    gone = next(d for d in st["donors"] if d["name"] == "gone")
    assert gone["failed"] and "nothing listens at 127.0.0.1:1" in gone["failure"], gone


def test_status_exits_by_health_and_broken_pipes_end_quietly(root, client_built, donors, client, tmp_path):
    assert pagerctl_status(tmp_path).returncode == 3
    ds = donors(2)
    client.attach(ds, mode="mirror", size="32M", frontend="fuse")
    assert pagerctl_status(client.state_dir).returncode == 0

    def into_closed_pipe(args) -> subprocess.CompletedProcess:
        r, w = os.pipe()
        os.close(r)
        try:
            return subprocess.run([str(pagerctl()), *map(str, args)], stdout=w, stderr=subprocess.PIPE,
                                  text=True, timeout=60)
        finally:
            os.close(w)

    # A report: SIGPIPE ends it, as it ends cat.
    p = into_closed_pipe(["status", "--state-dir", client.state_dir])
    assert p.returncode == -signal.SIGPIPE and p.stderr == "", (p.returncode, p.stderr)
    # Any other command: no panic, the status a SIGPIPE gives.
    p = into_closed_pipe(["psk", "new", tmp_path / "pipe.psk"])
    assert p.returncode == 128 + signal.SIGPIPE and p.stderr == "", (p.returncode, p.stderr)

    # top --batch: frames as text.
    p = run_pagerctl(["top", "--state-dir", client.state_dir, "--batch", "-n", "2", "--interval", "0.2",
                      "--width", "120"])
    frames = [f for f in p.stdout.split("\n\n") if f.strip()]
    assert len(frames) == 2 and all("netpager top" in f for f in frames), p.stdout
    assert all(d.name in frames[-1] for d in ds), frames[-1]

    client.kill_server()
    assert pagerctl_status(client.state_dir).returncode == 4
    client.detach()


def test_detach_names_who_holds_the_device(root, client_built, donors, client, teardown, tmp_path):
    client.attach(donors(1), mode="none", size="32M", frontend="fuse")
    with open(client.device, "rb") as dev:
        holder = subprocess.Popen(["sleep", "600"], stdin=dev)
    teardown.add("the device's holder", lambda: holder.poll() is None and (holder.kill(), holder.wait()))
    p = run_pagerctl(["detach", "--state-dir", client.state_dir], check=False)
    assert p.returncode == 1, p.stderr
    assert f"{client.device} is in use: pid {holder.pid} (sleep) has it open" in p.stderr, p.stderr
    assert (client.state_dir / "attach.json").exists(), "detach went on past a held device"
    holder.kill()
    holder.wait()
    client.detach()
    assert client.leftovers() == []


def test_release_frees_a_detached_devices_pages(root, client_built, donors, client):
    ds = donors(2)
    client.attach(ds, mode="mirror", size="32M", frontend="fuse")
    with open(client.device, "r+b", buffering=0) as f:
        f.write(os.urandom(8 * MIB))
        os.fsync(f.fileno())
    client.detach()
    # The device's store on each donor: CLIENT/DEVICE.
    store = f"{client.client_id}/{tomllib.loads((client.state_dir / 'device.toml').read_text())['device_id']}"
    for d in ds:
        # The donor counts a connection until nbdkit has closed it, a moment
        # after the serving process let go.
        wait_for(lambda: next(e for e in d.status().exports if e.name == store).clients == 0, 60,
                 f"{d.name} to see no client on {store}")
        export = next(e for e in d.status().exports if e.name == store)
        assert export.used_bytes >= 8 * MIB, export
    text = run_pagerctl(["donor-status", "{}:{}".format(*ds[0].status_addr)]).stdout
    assert f"UNCLAIMED: no client is connected to {store} (" in text, text
    p = run_pagerctl(["release", "--state-dir", client.state_dir])
    assert p.stdout.count("released") == 2 and "its next attach starts empty" in p.stdout, p.stdout
    for d in ds:
        assert sum(e.used_bytes for e in d.status().exports) == 0
    # The data is gone, not lost: the device reads zeros and lost nothing.
    client.attach([], new_device=False, frontend="fuse")
    with open(client.device, "rb") as f:
        assert f.read(MIB) == bytes(MIB)
    assert client.device_status()["totals"]["lost"] == 0
    p = run_pagerctl(["release", "--state-dir", client.state_dir], check=False)
    assert p.returncode == 1 and "is attached" in p.stderr, p.stderr
    client.detach()


def test_two_devices_of_one_client_id_keep_apart(root, client_built, donors, client, teardown, tmp_path):
    """Two devices under one client id (the default: the host name) each
    get a store of their own on a donor, named by their device ids: the
    second attach neither fails nor clears the first's pages."""
    (d,) = donors(1)
    client.attach([d], mode="none", size="32M", frontend="fuse")
    second = tmp_path / "second"
    teardown.add(f"pagerctl detach {second}", lambda: (second / "attach.json").exists()
                 and run_pagerctl(["detach", "--state-dir", second]))
    run_pagerctl(["attach", "--state-dir", second, "--frontend", "fuse", "--size", "64M", "--mode", "none",
                  "--client-id", client.client_id, "--donor", donor_spec(d)])
    ids = [tomllib.loads((s / "device.toml").read_text())["device_id"] for s in (client.state_dir, second)]
    assert ids[0] and ids[1] and ids[0] != ids[1], ids
    run_pagerctl(["detach", "--state-dir", second])
    client.detach()


def test_donor_status_and_drain_name_the_problem(root, client_built, cluster, client, tmp_path):
    key = psk_new(tmp_path / "lab.psk", client.client_id)
    ds = cluster.start_donors(3, tls_psk=key, psk=key, budget="64M", size="1G")
    nbd = f"{ds[0].addr}:{ds[0].port}"
    p = run_pagerctl(["donor-status", nbd, "--psk", key], check=False)
    assert p.returncode == 1 and f"{nbd} is not a status endpoint: it speaks NBD" in p.stderr, p.stderr
    status = "{}:{}".format(*ds[0].status_addr)
    p = run_pagerctl(["donor-status", status], check=False)
    assert "requires signed requests: give the lab key" in p.stderr, p.stderr

    # The key file from `pagerctl psk new` serves TLS and signed status on
    # both sides.
    client.attach(ds[:2], mode="mirror", size="32M", frontend="fuse", extra=["--psk", key])
    with open(client.device, "r+b", buffering=0) as f:
        f.write(os.urandom(4 * MIB))
        os.fsync(f.fileno())
    run_pagerctl(["donor-add", "--state-dir", client.state_dir, donor_spec(ds[2])])
    # netpager-drain: the client moves its pages, the drain ends empty.
    drain = [str(target_dir() / "netpager-drain"), "--psk", str(key), "--timeout", "300", status]
    p = subprocess.run(drain, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "holds nothing" in p.stdout, p.stderr + p.stdout
    run_pagerctl(["donor-drain", status, "--undo", "--psk", key])
    # A detached device's pages: no drain moves them, and it says so.
    client.detach()
    busy = next(d for d in ds if d.status().used_bytes > 0)
    busy_status = "{}:{}".format(*busy.status_addr)
    drain[-1], drain[-2] = busy_status, "1"
    p = subprocess.run(drain, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout
    assert f"no client is connected to {client.client_id}" in p.stderr, p.stderr
    assert "told to stop draining" in p.stderr, p.stderr
    assert state_word(busy.status()) != "draining", "left draining"


def test_a_budget_above_the_nodes_memory_is_refused(donor_plugin):
    p = subprocess.run(["nbdkit", "-f", "-U", "-", str(donor_plugin), "budget=1E", "mlock=false", "--run", "true"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0
    assert "budget=1 EiB is more than this node's memory (MemTotal" in p.stderr, p.stderr
