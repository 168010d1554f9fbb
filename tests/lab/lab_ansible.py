"""The Ansible rollout on the lab (tests/lab/netlab.py): an inventory of the
lab's hosts reached over SSH, in the example inventory's layout (three
donors idle1..idle3, two clients busy1 and busy2, TLS and export tokens on),
and the playbooks run against it. Used by the rollout test and by
`make lab-demo`.

Every host gets its own install paths under the lab's directory (the
namespaces share the machine's filesystem) and the supervise service
manager: its daemons are started over SSH, so they live in the host's
network namespace. The lab's teardown runs undeploy.yml, then closes the
SSH connections Ansible keeps open.

With `install="deb"` the hosts install the Debian packages (`make deb`'s
scripts/deb.sh, built into the lab's directory) instead of copying the
build: as the hosts share the machine's filesystem, the packages are
installed on the machine once, and undeploy (or, should it fail, the
teardown) purges them again.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import netlab
from netpager_testkit import Teardown
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.machine import SWAP
from netpager_testkit.paths import repo_root, target_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ansible"))

from test_ansible import AnsibleFailed, ansible_env, recap, run_playbook, write_inventory_files  # noqa: E402

DONORS = ["idle1", "idle2", "idle3"]
CLIENTS = ["busy1", "busy2"]
HOSTS = DONORS + CLIENTS
# The two-subnet layout (`dns_lab`): the lab's DNS server on host ns and
# every host but idle3 on subnet 1; idle3 alone behind the router.
DNS_HOST = "ns"
SUBNET2_HOSTS = ["idle3"]
BINARIES = ["libpager_server.so", "libpager_client_plugin.so", "pagerctl", "prefetchd", "pager-hints",
            "netpager-token"]
DONOR_BUDGET = "96M"
CLIENT_SIZE_MIB = 64
# busy1's device is used first by the machine's swapping jobs.
SWAP_PRIORITY = {"busy1": 32767, "busy2": 32766}
NBD_PORT = 10809
STATUS_PORT = 10810
PACKAGES = ["netpager-donor", "netpager-client", "netpager-prefetchd"]


def installed_packages() -> list[str]:
    """The netpager packages dpkg has installed (or half-installed) on this machine."""
    p = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\\n", *PACKAGES],
                       capture_output=True, text=True, timeout=60)
    return [line.split()[0] for line in p.stdout.splitlines() if not line.endswith(" not-installed")]


def purge_packages() -> None:
    if installed_packages():
        subprocess.run(["apt-get", "purge", "-y", "-q", *PACKAGES], check=True, capture_output=True,
                       timeout=600, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def lab_rollout_dir(td: Teardown) -> Path:
    """For a rollout test: skipped without root or a build; holds the
    machine's swap (the clients' swap areas are the machine's: no other
    test run's alongside) and makes the lab's parent directory, open to the
    donor account (the hosts' daemons drop to it and must reach their run
    directories inside), removed on teardown."""
    if os.geteuid() != 0:
        skip_or_fail("needs root (network namespaces, swapon, FUSE)")
    missing = [b for b in BINARIES if not (target_dir() / b).exists()]
    if missing:
        skip_or_fail(f"not built in {target_dir()}: {', '.join(missing)} (run `make build`)")
    SWAP.hold(td)
    parent = Path(tempfile.mkdtemp(prefix="netpager-lab-", dir="/tmp"))
    td.add(f"directory {parent}", parent.rmdir)
    parent.chmod(0o755)
    return parent


def dns_lab(td: Teardown, root: Path):
    """The example inventory's hosts on two subnets (idle3 behind the
    router, which forwards no multicast) and BIND on host ns serving the
    lab's zone, taking the donors' signed updates. Returns (lab, dns); named
    is stopped after the rollout's undeploy (teardown order), so the donors
    remove their records at their clean stop."""
    from netpager_testkit.dns import DnsServer

    lab = netlab.Lab(td, root, [DNS_HOST] + [h for h in HOSTS if h not in SUBNET2_HOSTS], subnet2=SUBNET2_HOSTS)
    return lab, DnsServer(td, root, addr=lab[DNS_HOST].addr, wrap=lab[DNS_HOST].netns_argv)


class LabRollout:
    """The lab's inventory and ansible-playbook runs against it. With `dns`
    (a DnsServer: `dns_lab`) donors publish themselves in its zone
    (`netpager_discovery: dns`) and each client's donors file names only the
    donors on its own subnet: the others it finds through the DNS. The
    clients of `no_file` have an empty donors file: they find every donor
    through the DNS."""

    def __init__(self, td: Teardown, lab: netlab.Lab, bin_src: Path | None = None, install: str = "build",
                 donors: list[str] = DONORS, clients: list[str] = CLIENTS, dns=None, no_file=()):
        self.lab = lab
        self.dns = dns
        self.no_file = set(no_file)
        # The inventory's groups; a test may change them and write_inventory.
        self.donors, self.clients, self.retired = list(donors), list(clients), []
        self.root = lab.workdir
        self.inv = self.root / "inventory"
        self.install = install
        if install == "deb":
            self.deb_src = self.root / "debs"
            subprocess.run(["bash", str(repo_root() / "scripts" / "deb.sh"), str(self.deb_src)], check=True,
                           capture_output=True, timeout=1200)
            # Undeploy purges them; this is for a run that never got there.
            td.add("the netpager packages", purge_packages)
            self.bin_src = Path("/usr/bin")
        else:
            self.bin_src = self.shipped_binaries(bin_src or target_dir())
        self.user = "netpager-l" + secrets.token_hex(3)
        self.cp_dir = self.root / "ssh-cp"
        self.cp_dir.mkdir()
        self.env = ansible_env(self.root)
        self.env.update({
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.cp_dir),
            "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=60s",
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_FORKS": "5",
        })
        (self.root / "ansible-tmp").mkdir()
        self.td = td
        td.add("ansible's SSH connections", self.close_connections)
        td.add("undeploy.yml", self.undeploy_quietly)
        self.write_inventory(u_star=0.5)

    def shipped_binaries(self, build: Path) -> Path:
        """The release build without its debug info (`debug = 1` makes it
        five times larger), as a release would ship it: what every host
        gets over SSH."""
        out = self.root / "bin"
        out.mkdir()
        for b in BINARIES:
            subprocess.run(["strip", "--strip-debug", "-o", str(out / b), str(build / b)], check=True,
                           capture_output=True, timeout=120)
        return out

    def host_dir(self, host: str) -> Path:
        return self.lab[host].dir

    def paths(self, host: str) -> dict:
        d = self.host_dir(host)
        return {"netpager_prefix": str(d / "opt"), "netpager_etc_dir": str(d / "etc"),
                "netpager_state_dir": str(d / "var"), "netpager_run_dir": str(d / "run"),
                "netpager_log_dir": str(d / "log"), "netpager_systemd_dir": str(d / "systemd")}

    def write_inventory(self, u_star: float) -> None:
        def donor(h):
            return {"ansible_host": self.lab[h].addr, "netpager_donor_address": self.lab[h].addr, **self.paths(h)}

        donors = {h: donor(h) for h in self.donors}
        # Retired hosts stay donors (their settings apply) until undeployed.
        retired = {h: {} for h in self.retired}
        clients = {h: {"ansible_host": self.lab[h].addr,
                       "netpager_client_swap_priority": SWAP_PRIORITY[h], **self.paths(h),
                       **({"netpager_client_donors": self.file_donors(h)} if self.dns else {})}
                   for h in self.clients}
        ssh_args = " ".join(["-F", "/dev/null", "-o", "IdentitiesOnly=yes",
                             "-o", f"UserKnownHostsFile={self.lab.known_hosts}",
                             "-o", "StrictHostKeyChecking=yes"])
        inventory = {"all": {
            "vars": {"ansible_connection": "ssh", "ansible_user": "root",
                     "ansible_ssh_private_key_file": str(self.lab.ssh_key),
                     "ansible_ssh_common_args": ssh_args,
                     "ansible_python_interpreter": "/usr/bin/python3"},
            "children": {"donors": {"hosts": donors}, "clients": {"hosts": clients},
                         **({"retired": {"hosts": retired}} if retired else {})},
        }}
        common = {
            "netpager_install": self.install,
            **({"netpager_deb_src": str(self.deb_src), "netpager_deb_cache": str(self.root / "deb-cache")}
               if self.install == "deb" else {"netpager_bin_src": str(self.bin_src)}),
            "netpager_service_manager": "supervise",
            "netpager_user": self.user,
            "netpager_donor_mlock": False,
            "netpager_donor_budget": DONOR_BUDGET,
            "netpager_donor_port": NBD_PORT,
            "netpager_donor_status_port": STATUS_PORT,
            # The machine's own load (other builds) must not turn donors busy.
            "netpager_donor_busy_load": 1000,
            "netpager_donor_u_star": u_star,
            "netpager_client_size": f"{CLIENT_SIZE_MIB}M",
            "netpager_client_mode": "mirror",
            # A TLS donor stops only once its clients send, and an idle
            # client's next request is its heartbeat, each epoch
            # (pager-server(1) BUGS): 1 s epochs keep a rolling update's
            # restarts short.
            "netpager_client_extra_args": ["--epoch", "1"],
            "netpager_start_timeout": 60,
            "netpager_donor_drain_timeout": 300,
            **(self.dns_vars() if self.dns else {}),
        }
        write_inventory_files(self.inv, inventory, common)

    def file_donors(self, client: str) -> list[str]:
        """The donors a client's donors file names with `dns`: its own subnet's
        (none for a client of `no_file`)."""
        if client in self.no_file:
            return []
        return [d for d in self.donors if self.lab[d].subnet == self.lab[client].subnet]

    def dns_vars(self) -> dict:
        """Donors publish themselves in the lab's zone, clients browse it."""
        return {"netpager_discovery": "dns", "netpager_dns_publish": "donor", "netpager_dns_zone": self.dns.zone,
                "netpager_dns_server": self.dns.server, "netpager_dns_key_controller_file": str(self.dns.key_file)}

    def ansible(self, playbook: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_playbook(self.root, self.inv / "hosts.yml", self.env, playbook, check, teardown=self.td)

    def undeploy_quietly(self) -> None:
        """Teardown: undeploy whatever is there; the lab's own teardown then
        removes by namespace whatever undeploy could not."""
        if (self.inv / "hosts.yml").exists() and all(
                self.lab.ssh(h, "true", check=False, timeout=30).returncode == 0
                for h in self.donors + self.clients):
            self.ansible("undeploy.yml", check=False)

    def close_connections(self) -> None:
        for sock in sorted(self.cp_dir.iterdir()):
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "lab"],
                           capture_output=True, timeout=30)

    # --- reading the hosts, over SSH -------------------------------------

    def pagerctl(self, host: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        binary = self.bin_src / "pagerctl" if self.install == "deb" else self.host_dir(host) / "opt" / "bin" / "pagerctl"
        return self.lab.ssh(host, " ".join([str(binary), *args]), check=check)

    def client_status(self, host: str) -> dict:
        state = self.host_dir(host) / "var" / f"client-{host}"
        # Exits 0 (ok), 3, 4 or 5 by the device's health; JSON in every case.
        p = self.pagerctl(host, "status", "--state-dir", str(state), "--json", check=False)
        assert p.returncode in (0, 3, 4, 5), p.stderr
        return json.loads(p.stdout)

    def psk_file(self, host: str) -> Path:
        return self.host_dir(host) / "etc" / "netpager.psk"

    def lab_key(self) -> Path:
        return self.inv / "netpager.psk"

    def token(self, client: str) -> str:
        """CLIENT~TOKEN, derived on the controller as the client role does."""
        return subprocess.run([str(self.bin_src / "netpager-token"), str(self.inv / "netpager-export.secret"),
                               client], capture_output=True, text=True, check=True).stdout.strip()

    def donor_pid(self, host: str) -> int:
        return int((self.host_dir(host) / "run" / f"donor-{host}" / "nbdkit.pid").read_text())

    def roles_table(self) -> str:
        """Each host's role and status, one line each (for the demo)."""
        from netpager_testkit.status import LabKey, StatusClient, state_word

        key = LabKey.from_psk_file(self.psk_file(self.donors[0]))
        rows = [f"{'host':<7} {'address':<14} {'role':<7} status"]
        if self.dns:
            rows.append(f"{DNS_HOST:<7} {self.dns.addr:<14} {'dns':<7} BIND serving {self.dns.zone}, "
                        f"{len(self.dns.records(f'_netpager._tcp.{self.dns.zone}', 'PTR'))} donors published")
        for h in self.donors:
            st = StatusClient(self.lab[h].addr, STATUS_PORT, key=key).query()
            rows.append(f"{h:<7} {self.lab[h].addr:<14} {'donor':<7} {state_word(st)}, "
                        f"budget {st.budget_bytes >> 20} MiB, used {st.used_bytes >> 20} MiB")
        for h in self.clients:
            st = self.client_status(h)
            # How each donor joined: its donors file's line, or the DNS.
            donors = ", ".join(f"{d['name']} {d['state']}" + (" (found through DNS)" if d["joined"] == "discovered"
                                                              else "")
                               for d in (st["status"] or {}).get("donors", []))
            rows.append(f"{h:<7} {self.lab[h].addr:<14} {'client':<7} "
                        f"{'attached' if st['attached'] else 'detached'} {st['device']} "
                        f"({'swap' if st['swap'] else 'no swap'}; donors: {donors})")
        return "\n".join(rows)


def ssh_masters(lab_root: Path) -> list[int]:
    """ssh control masters still serving the lab's control sockets."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if str(lab_root / "ssh-cp").encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


__all__ = ["LabRollout", "AnsibleFailed", "recap", "DONORS", "CLIENTS", "HOSTS", "BINARIES", "dns_lab",
           "lab_rollout_dir",
           "DNS_HOST", "SUBNET2_HOSTS",
           "CLIENT_SIZE_MIB", "SWAP_PRIORITY", "NBD_PORT", "STATUS_PORT", "ssh_masters"]
