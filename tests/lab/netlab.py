"""A lab in a box: hosts in network namespaces on one bridge (issue 18).

    with Teardown("lab") as td:
        lab = Lab(td, workdir, ["idle1", "idle2", "busy1"], ssh=True)
        lab.ssh("idle1", "hostname -I")

Each host is a network namespace `nplab-NAME` joined by a veth pair
(`nplab-NAME` on the machine's side, `eth0` inside) to the bridge
`nplab-br` on the lab's own subnet, SUBNET. The bridge holds the
controller's address (.1): the test, Ansible and a client running on the
machine itself reach the hosts through it. No host has a default route,
so nothing in the lab can reach any address outside SUBNET.

With `subnet2=[...]` those hosts sit on a second bridge `nplab-br2` on
SUBNET2 instead, and a router namespace `nplab-router` (.254 on each
bridge) forwards unicast between the two; it runs no multicast routing,
so mDNS stays on its own segment. Every host gets a route to the other
subnet through the router, still no default route. The controller holds
.1 on both bridges.

With `ssh=True` every host runs its own sshd (`ip netns exec`, started by
pid, in the foreground) on a host key, an authorized key and a config that
the lab generates in its working directory; the machine's /etc/ssh and its
ssh service are never touched. `known_hosts` names every host key, so
clients check them strictly.

One lab at a time: the lab holds an exclusive lock (LOCK_FILE) while it
exists and records its working directory in STATE_FILE. A lab that starts
while holding the lock and finds namespaces or the bridge with the prefix
knows they are a crashed run's, and removes them (what and why goes to
stderr). Teardown is idempotent; it runs on every exit path through the
Teardown it was given (pass, fail, timeout, Ctrl-C).

Faults on a host: `LinkDown` (its link down), `SlowLink` (tbf on both ends
of its link), `Partition` (iptables DROP inside its namespace). A host can
take a second address on the lab's subnet (`Lab.add_alias`), so one
server there answers under two addresses.

Removing a host: swap areas and loop devices whose backing file lies in
the lab's working directory go first (their FUSE server may run in the
host), then every process in the namespace (`ip netns pids`: the lab's
own, whoever started it there), then the namespace itself.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from netpager_testkit import OwnedProcess, Teardown, wait_for
from netpager_testkit.attach import swaps
from netpager_testkit.donor import Donor

PREFIX = "nplab"
BRIDGE = f"{PREFIX}-br"
# A private /24 that this machine does not use; the lab refuses to start
# if any address or route of the machine overlaps it.
SUBNET = ipaddress.ip_network("10.213.47.0/24")
SUBNET2 = ipaddress.ip_network("10.213.48.0/24")
BRIDGE2 = f"{PREFIX}-br2"
CONTROLLER = SUBNET.network_address + 1
# The router's leg on each subnet.
ROUTER_HOST = 254
LOCK_FILE = Path("/run/netpager-lab.lock")
STATE_FILE = Path("/run/netpager-lab.json")
# Seconds to wait for another lab (another test run) to finish.
LOCK_WAIT = 900
SSHD = "/usr/sbin/sshd"
# The privilege-separation directory compiled into Debian's sshd.
SSHD_PRIVSEP = Path("/run/sshd")
TOOLS = ("ip", "tc", "ssh", "ssh-keygen", "swapoff", "losetup")


class LabError(RuntimeError):
    """The lab cannot start here (subnet taken, tool missing, ...)."""


def run(argv: list[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """Runs a command; with `check`, a failure raises with its stderr."""
    argv = [str(a) for a in argv]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def namespaces() -> list[str]:
    """The lab's namespaces that exist now (this run's or a crashed one's)."""
    out = run(["ip", "-j", "netns", "list"]).stdout.strip()
    return sorted(n["name"] for n in json.loads(out or "[]") if n["name"].startswith(PREFIX + "-"))


def bridge_exists() -> bool:
    return run(["ip", "link", "show", "dev", BRIDGE], check=False).returncode == 0


def subnet_users(subnet=SUBNET) -> list[str]:
    """The machine's addresses and routes that overlap `subnet`."""
    users = []
    for a in json.loads(run(["ip", "-4", "-j", "addr"]).stdout or "[]"):
        for info in a.get("addr_info", []):
            net = ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False)
            if net.overlaps(subnet):
                users.append(f"address {info['local']}/{info['prefixlen']} on {a['ifname']}")
    for r in json.loads(run(["ip", "-4", "-j", "route", "show", "table", "all"]).stdout or "[]"):
        dst = r.get("dst", "")
        if dst in ("default", "") or dst.startswith(("broadcast", "local")):
            continue
        if ipaddress.ip_network(dst, strict=False).overlaps(subnet):
            users.append(f"route {dst} dev {r.get('dev', '?')} table {r.get('table', 'main')}")
    return users


def loops_under(root: Path) -> list[str]:
    """Loop devices whose backing file lies under `root`."""
    out = []
    for b in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if b.read_text().strip().startswith(str(root) + "/"):
                out.append("/dev/" + b.parent.parent.name)
        except OSError:
            continue
    return out


def release_devices(root: Path) -> list[str]:
    """Swaps off and detaches the loop devices backed under `root`, while
    their server still runs. swapoff fails with ENOMEM while some memory
    cgroup cannot take its pages back: retried, bounded."""
    done = []
    for dev in loops_under(root):
        if dev in swaps():
            wait_for(lambda: run(["swapoff", dev], timeout=300, check=False).returncode == 0
                     or dev not in swaps(), 300, f"swapoff {dev}", interval=5)
        run(["losetup", "--detach", dev], check=False)
        done.append(dev)
    return done


def netns_pids(ns: str) -> list[int]:
    p = run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def kill_netns_processes(ns: str, timeout: float = 15) -> None:
    """SIGCONT + SIGTERM, then SIGKILL, to every process in the namespace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in netns_pids(ns):
            for s in ((signal.SIGCONT, sig) if sig == signal.SIGTERM else (sig,)):
                try:
                    os.kill(pid, s)
                except ProcessLookupError:
                    pass
        try:
            wait_for(lambda: not netns_pids(ns), timeout, f"the processes in {ns} to exit", interval=0.1)
            return
        except TimeoutError:
            continue
    raise LabError(f"processes in {ns} survived SIGKILL: {netns_pids(ns)}")


def lab_links() -> list[str]:
    """The machine's interfaces with the lab's prefix (bridge, veth ends)."""
    return sorted(link["ifname"] for link in json.loads(run(["ip", "-j", "link", "show"]).stdout or "[]")
                  if link["ifname"].startswith(PREFIX + "-"))


def remove_link(name: str) -> None:
    if name in lab_links():
        run(["ip", "link", "delete", name])


def remove_netns(ns: str) -> None:
    """Stops the namespace's processes, deletes its veth pair from the
    machine's side (at once: the kernel frees a deleted namespace's devices
    later, and a new lab could meet the old name), then the namespace."""
    kill_netns_processes(ns)
    remove_link(ns)
    if ns in namespaces():
        run(["ip", "netns", "delete", ns])


def remove_bridge(name: str = BRIDGE) -> None:
    remove_link(name)


def clean_crashed_run() -> list[str]:
    """Removes what a lab that is gone left behind; the caller holds the lock,
    so no live lab owns these. Returns what was removed."""
    removed = []
    root = None
    state = json.loads(STATE_FILE.read_text()) if STATE_FILE.exists() else {}
    if state:
        root = Path(state["workdir"])
        removed += [f"swap/loop {d}" for d in release_devices(root)]
    for ns in namespaces():
        remove_netns(ns)
        removed.append(f"namespace {ns}")
    for link in lab_links():
        remove_link(link)
        removed.append(f"interface {link}")
    if root is not None and root.exists():
        shutil.rmtree(root)
        removed.append(f"directory {root}")
    if state.get("privsep_created") and SSHD_PRIVSEP.is_dir() and not any(SSHD_PRIVSEP.iterdir()):
        SSHD_PRIVSEP.rmdir()
        removed.append(f"directory {SSHD_PRIVSEP}")
    STATE_FILE.unlink(missing_ok=True)
    if removed:
        print(f"netlab: removed what a crashed earlier lab left: {', '.join(removed)}",
              file=sys.stderr, flush=True)
    return removed


class Host:
    """One host: a namespace, its address, and (with ssh) its sshd."""

    def __init__(self, name: str, addr: ipaddress.IPv4Address, workdir: Path,
                 subnet=SUBNET, bridge: str = BRIDGE):
        self.name = name
        self.subnet = subnet
        self.bridge = bridge
        self.ns = f"{PREFIX}-{name}"
        self.veth = self.ns  # the machine's end of the host's veth pair
        if len(self.veth) > 15:
            raise LabError(f"host name {name!r}: interface {self.veth!r} is longer than 15 characters")
        self.addr = str(addr)
        self.dir = workdir / "hosts" / name
        self.sshd: OwnedProcess | None = None

    def netns_argv(self, argv) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns] + [str(a) for a in argv]

    @property
    def alias(self) -> str:
        """A second address the host can be given (`Lab.add_alias`): .111 on
        for .11 on, so one host answers under two addresses."""
        a = ipaddress.ip_address(self.addr)
        return str(a + 100)

    def link(self, up: bool) -> None:
        """Takes the host's link to the bridge down (a partition: packets are
        dropped, nobody sends a RST) or up again."""
        run(["ip", "link", "set", "dev", self.veth, "up" if up else "down"])


class Lab:
    """Hosts in network namespaces on one bridge; see the module's doc."""

    def __init__(self, teardown: Teardown, workdir, names: list[str], ssh: bool = True,
                 subnet2: list[str] = ()):
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces, a bridge)")
        missing = [t for t in TOOLS if not shutil.which(t)] + ([SSHD] if ssh and not Path(SSHD).exists() else [])
        if missing:
            raise LabError(f"missing {', '.join(missing)} (run scripts/deps.sh: iproute2, openssh-server)")
        every = list(names) + list(subnet2)
        if not 1 <= len(names) <= 100 or len(subnet2) > 100 or len(set(every)) != len(every) or "router" in every:
            raise LabError(f"host names must be 1 to 100 distinct names per subnet, none 'router', got {every}")
        self.td = teardown
        self.workdir = Path(workdir)
        self.hosts = {n: Host(n, SUBNET.network_address + 11 + i, self.workdir) for i, n in enumerate(names)}
        self.hosts.update({n: Host(n, SUBNET2.network_address + 11 + i, self.workdir, SUBNET2, BRIDGE2)
                           for i, n in enumerate(subnet2)})
        self.subnets = [SUBNET, SUBNET2] if subnet2 else [SUBNET]
        self.controller = str(CONTROLLER)
        self.ssh_key = self.workdir / "ssh" / "id_ed25519"
        self.known_hosts = self.workdir / "ssh" / "known_hosts"
        self._lock()
        clean_crashed_run()
        for subnet in self.subnets:
            taken = subnet_users(subnet)
            if taken:
                raise LabError(f"the lab's subnet {subnet} is already in use on this machine: "
                               f"{'; '.join(taken)}; the lab does not start on a routed subnet")
        # Keys, configs and logs: the lab's own directory, removed with it.
        self.workdir.mkdir(parents=True)
        self.td.add(f"directory {self.workdir}", lambda: shutil.rmtree(self.workdir, ignore_errors=True))
        self.state = {"workdir": str(self.workdir), "pid": os.getpid(), "privsep_created": False}
        self._write_state()
        self.td.add(f"lab state {STATE_FILE}", lambda: STATE_FILE.unlink(missing_ok=True))
        for subnet, bridge in zip(self.subnets, (BRIDGE, BRIDGE2)):
            self._bridge(bridge, subnet)
        if subnet2:
            self._router()
        for h in self.hosts.values():
            self._host(h)
        # Before any host's processes are stopped: the devices they serve.
        self.td.add(f"swap and loop devices under {self.workdir}", lambda: release_devices(self.workdir))
        if ssh:
            self._keys()
            for h in self.hosts.values():
                self._sshd(h)
            for h in self.hosts.values():
                wait_for(lambda h=h: self.ssh(h.name, "true", check=False).returncode == 0, 30,
                         f"sshd on {h.name} ({h.addr}); log {h.dir / 'sshd.log'}", interval=0.2)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # --- setup, each step's undo registered as soon as it exists ---------

    def _lock(self) -> None:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        self.td.add(f"lab lock {LOCK_FILE}", lambda: os.close(fd))
        deadline = time.monotonic() + LOCK_WAIT
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LabError(f"another lab held {LOCK_FILE} for {LOCK_WAIT}s "
                                   f"({STATE_FILE}: {STATE_FILE.read_text().strip() if STATE_FILE.exists() else '?'})")
                if not told:
                    print(f"netlab: another lab is running ({LOCK_FILE}); waiting", file=sys.stderr, flush=True)
                    told = True
                time.sleep(1)

    def _write_state(self) -> None:
        STATE_FILE.write_text(json.dumps(self.state) + "\n")

    def _bridge(self, bridge: str, subnet) -> None:
        run(["ip", "link", "add", bridge, "type", "bridge"])
        self.td.add(f"bridge {bridge}", lambda: remove_bridge(bridge))
        run(["ip", "addr", "add", f"{subnet.network_address + 1}/{subnet.prefixlen}", "dev", bridge])
        run(["ip", "link", "set", "dev", bridge, "up"])

    def _router(self) -> None:
        """The namespace joining the two bridges: a leg on each, forwarding on."""
        ns = f"{PREFIX}-router"
        run(["ip", "netns", "add", ns])
        self.td.add(f"namespace {ns}", lambda: remove_netns(ns))
        for i, (subnet, bridge) in enumerate(zip(self.subnets, (BRIDGE, BRIDGE2)), start=1):
            veth = f"{ns}{i}"
            self.td.add(f"interface {veth}", lambda veth=veth: remove_link(veth))
            run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"eth{i}", "netns", ns])
            run(["ip", "link", "set", "dev", veth, "master", bridge, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{subnet.network_address + ROUTER_HOST}/{subnet.prefixlen}",
                 "dev", f"eth{i}"])
            run(["ip", "-n", ns, "link", "set", "dev", f"eth{i}", "up"])
        run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])

    def _host(self, h: Host) -> None:
        h.dir.mkdir(parents=True, exist_ok=True)
        run(["ip", "netns", "add", h.ns])
        self.td.add(f"namespace {h.ns}", lambda: remove_netns(h.ns))
        run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns])
        run(["ip", "link", "set", "dev", h.veth, "master", h.bridge, "up"])
        run(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/{h.subnet.prefixlen}", "dev", "eth0"])
        run(["ip", "-n", h.ns, "link", "set", "dev", "eth0", "up"])
        run(["ip", "-n", h.ns, "link", "set", "dev", "lo", "up"])
        for other in self.subnets:
            if other != h.subnet:
                run(["ip", "-n", h.ns, "route", "add", str(other), "via", str(h.subnet.network_address + ROUTER_HOST)])

    def _keys(self) -> None:
        self.ssh_key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "netpager-lab", "-f", self.ssh_key])
        (self.workdir / "ssh" / "authorized_keys").write_text(self.ssh_key.with_suffix(".pub").read_text())
        lines = []
        for h in self.hosts.values():
            key = h.dir / "ssh_host_ed25519_key"
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", key])
            kind, blob = key.with_suffix(".pub").read_text().split()[:2]
            lines.append(f"{h.addr} {kind} {blob}\n")
        self.known_hosts.write_text("".join(lines))
        if not SSHD_PRIVSEP.exists():
            SSHD_PRIVSEP.mkdir(mode=0o755)
            self.state["privsep_created"] = True
            self._write_state()
            self.td.add(f"directory {SSHD_PRIVSEP}", lambda: SSHD_PRIVSEP.rmdir())

    def _sshd(self, h: Host) -> None:
        config = h.dir / "sshd_config"
        config.write_text(
            f"# The lab's sshd for host {h.name}: nothing of /etc/ssh is read.\n"
            f"ListenAddress {h.addr}\n"
            "Port 22\n"
            f"HostKey {h.dir / 'ssh_host_ed25519_key'}\n"
            f"PidFile {h.dir / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.workdir / 'ssh' / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            # The keys live under /tmp (sticky, world-writable): owned by root, mode 0600.
            "StrictModes no\n"
            "PrintMotd no\n"
            "AcceptEnv LANG LC_*\n"
            "Subsystem sftp internal-sftp\n")
        h.sshd = OwnedProcess(h.netns_argv([SSHD, "-D", "-e", "-f", config]), h.dir / "sshd.log",
                              self.td, f"sshd {h.name}")

    # --- using the lab ----------------------------------------------------

    def ssh_options(self) -> list[str]:
        """Options of every ssh to the lab: its key, its known_hosts, strict."""
        return ["-F", "/dev/null", "-i", str(self.ssh_key), "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR"]

    def ssh(self, host: str, command: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Runs a shell command on a host as root, over SSH."""
        argv = ["ssh", *self.ssh_options(), f"root@{self.hosts[host].addr}", command]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise LabError(f"ssh {host} {command!r} failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
        return p

    def netns_run(self, host: str, argv, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Runs a command inside a host's namespace, without SSH."""
        return run(self.hosts[host].netns_argv(argv), timeout=timeout, check=check)

    def add_alias(self, host: str) -> str:
        """Gives a host its second address (`Host.alias`, on the lab's
        subnet; gone with the namespace); returns it."""
        h = self.hosts[host]
        run(["ip", "-n", h.ns, "addr", "add", f"{h.alias}/{h.subnet.prefixlen}", "dev", "eth0"])
        return h.alias


class LabDonor(Donor):
    """A harness donor (netpager_testkit.donor) serving from a lab host: nbdkit
    runs in the host's namespace on its address, at fixed ports (the
    namespace is the donor's alone)."""

    NBD_PORT = 10809
    STATUS_PORT = 10810

    def __init__(self, host: Host, teardown: Teardown, workdir, plugin, params: dict, **kw):
        self.host = host
        super().__init__(teardown, workdir, host.name, host.addr, plugin, params, **kw)

    def _pick_ports(self) -> None:
        self.port = self.NBD_PORT
        if self._own_status_port:
            self.params["status"] = f"{self.addr}:{self.STATUS_PORT}"

    def argv(self) -> list[str]:
        return self.host.netns_argv(super().argv())


class _LinkQdisc:
    """A root qdisc on both ends of a host's link (the machine's veth end
    and the host's eth0); removed by `heal` and on teardown."""

    def __init__(self, teardown: Teardown, lab: Lab, host: str, qdisc: list[str], what: str):
        self.lab, self.host = lab, lab[host]
        self.active = True
        teardown.add(f"{what} qdiscs on {self.host.veth}", self.heal)
        run(["tc", "qdisc", "add", "dev", self.host.veth, "root"] + qdisc)
        lab.netns_run(host, ["tc", "qdisc", "add", "dev", "eth0", "root"] + qdisc)

    def change(self, qdisc: list[str]) -> None:
        """Replaces the qdisc's parameters on both ends."""
        run(["tc", "qdisc", "change", "dev", self.host.veth, "root"] + qdisc)
        self.lab.netns_run(self.host.name, ["tc", "qdisc", "change", "dev", "eth0", "root"] + qdisc)

    def heal(self) -> None:
        if not self.active:
            return
        for argv in (["tc", "qdisc", "del", "dev", self.host.veth, "root"],
                     self.host.netns_argv(["tc", "qdisc", "del", "dev", "eth0", "root"])):
            p = run(argv, check=False)
            if p.returncode != 0 and "No such file" not in p.stderr and "Cannot find" not in p.stderr \
                    and "Cannot delete qdisc with handle of zero" not in p.stderr:
                raise LabError(f"{' '.join(argv)}: {p.stderr.strip()}")
        self.active = False


class SlowLink(_LinkQdisc):
    """A token-bucket filter on both ends of a host's link: `rate` each way,
    packets queued up to `latency`, dropped beyond. Removed by `heal` and on
    teardown."""

    def __init__(self, teardown: Teardown, lab: Lab, host: str, rate: str = "4mbit",
                 burst: str = "32kb", latency: str = "200ms"):
        super().__init__(teardown, lab, host, ["tbf", "rate", rate, "burst", burst, "latency", latency],
                         "tbf")


def netem_available() -> bool:
    """Whether this kernel has netem (sch_netem; loaded now if it is a
    module). The test VM's kernel has it; this machine's does not."""
    return subprocess.run(["modprobe", "-q", "sch_netem"], capture_output=True).returncode == 0


class Latency(_LinkQdisc):
    """netem on both ends of a host's link: `delay` added each way. Needs
    sch_netem (`netem_available`). The queue holds 100000 packets (netem's
    default 1000 drops a swap burst's packets within a long delay, and TCP's
    backoff then stalls the link for seconds). No jitter: netem reorders
    packets to make it. Removed by `heal` and on teardown."""

    def __init__(self, teardown: Teardown, lab: Lab, host: str, delay: str = "40ms"):
        super().__init__(teardown, lab, host, self.spec(delay), "netem")

    @staticmethod
    def spec(delay: str) -> list[str]:
        return ["netem", "delay", delay, "limit", "100000"]

    def set(self, delay: str) -> None:
        self.change(self.spec(delay))


class Partition:
    """iptables DROP of every packet into and out of a host, inside its own
    namespace (the machine's rules are never touched): a partition without
    a RST. Removed by `heal` and on teardown."""

    RULES = (["INPUT", "-j", "DROP"], ["OUTPUT", "-j", "DROP"])

    def __init__(self, teardown: Teardown, lab: Lab, host: str):
        self.lab, self.host = lab, host
        self.added: list[list[str]] = []
        teardown.add(f"iptables DROP in {lab[host].ns}", self.heal)
        for rule in self.RULES:
            lab.netns_run(host, ["iptables", "-w", "10", "-I", *rule])
            self.added.append(rule)

    def heal(self) -> None:
        if self.lab[self.host].ns not in namespaces():
            self.added = []
        while self.added:
            self.lab.netns_run(self.host, ["iptables", "-w", "10", "-D", *self.added[-1]])
            self.added.pop()


class LinkDown:
    """A host's link taken down: a partition without a RST. Up again by `heal`
    and on teardown."""

    def __init__(self, teardown: Teardown, lab: Lab, host: str):
        self.host = lab[host]
        self.down = True
        teardown.add(f"link {self.host.veth} up", self.heal)
        self.host.link(up=False)

    def heal(self) -> None:
        if self.down and self.host.ns in namespaces():
            self.host.link(up=True)
        self.down = False
