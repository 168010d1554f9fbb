"""A real DNS server for the wide-area discovery tests: BIND's `named`
(Debian's bind9, installed by scripts/deps.sh) serving one zone on
127.0.0.1 at a free port of the test's own (or on a lab host's address,
run in its namespace: `addr`, `wrap`), taking dynamic updates signed
with a TSIG key it is given, as a lab's DNS would. Started in the
foreground by pid with its configuration, zone, journal and log in the
test's directory; stopped on teardown. Nothing of the machine's (its
/etc/bind, its resolver, port 53) is used.

`include` names a file the zone $INCLUDEs (with `soa=False` it holds the
zone's SOA).
`records(name, type)` asks it (dig), `update(lines)` changes the zone as an
admin or an attacker holding the key would (nsupdate)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path

from .ci import skip_or_fail
from .cleanup import Teardown
from .donor import free_ports
from .procs import OwnedProcess, wait_for

ADDR = "127.0.0.1"
KEY_NAME = "netpager-lab"


def missing_tools() -> list[str]:
    return [t for t in ("named", "dig", "nsupdate")
            if not shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin")]


class DnsServer:
    def __init__(self, teardown: Teardown, workdir, zone: str = "lab.test", addr: str = ADDR,
                 wrap=lambda argv: argv, include: Path | None = None, soa: bool = True):
        missing = missing_tools()
        if missing:
            skip_or_fail(f"no {', '.join(missing)} (Debian's bind9 and bind9-dnsutils: make deps)")
        self.zone = zone
        self.addr = addr
        self.dir = Path(workdir) / "named"
        self.dir.mkdir(parents=True, exist_ok=True)
        # A lab host's namespace is its own: any port is free there.
        self.port = free_ports(ADDR, 1)[0] if addr == ADDR else 53
        self.server = f"{addr}:{self.port}"
        self.key_file = self.dir / "tsig.key"
        secret = base64.b64encode(os.urandom(32)).decode()
        self.key_file.write_text(
            f'key "{KEY_NAME}" {{\n\talgorithm hmac-sha256;\n\tsecret "{secret}";\n}};\n')
        self.zone_file = self.dir / f"{zone}.zone"
        self.zone_file.write_text(
            f"$ORIGIN {zone}.\n$TTL 60\n"
            # soa=False: the included fragment holds the zone's SOA
            # (ansible's netpager_dns_zonefile_soa).
            + (f"@ IN SOA ns.{zone}. admin.{zone}. 1 60 60 600 60\n" if soa else "")
            + f"@ IN NS ns.{zone}.\nns IN A {addr}\n"
            # Records written elsewhere, as an admin's zone includes a
            # fragment (ansible's netpager_dns_publish zonefile).
            + (f"$INCLUDE {include}\n" if include else ""))
        conf = self.dir / "named.conf"
        d = self.dir
        conf.write_text(f"""options {{
    directory "{d}";
    pid-file none;
    listen-on port {self.port} {{ {addr}; }};
    listen-on-v6 {{ none; }};
    recursion no;
    allow-query {{ any; }};
    allow-transfer {{ any; }};
    dnssec-validation no;
    // The flood test publishes 200 instances under one PTR name.
    max-records-per-type 0;
    session-keyfile "{d}/session.key";
    managed-keys-directory "{d}";
}};
controls {{ }};
include "{self.key_file}";
zone "{zone}" {{
    type primary;
    file "{d}/{zone}.zone";
    allow-update {{ key "{KEY_NAME}"; }};
}};
""")
        # -g: foreground, logging to stderr (the log file); as root, so it
        # can write its journal in the test's directory.
        self.proc = OwnedProcess(wrap([shutil.which("named", path="/usr/sbin:/usr/bin"), "-g", "-c", conf]),
                                 self.dir / "named.log", teardown, "named")
        wait_for(lambda: self._answers() or (None if self.proc.alive() else self._died()), 30,
                 f"named to serve {zone} on {self.server}")

    def _died(self):
        raise RuntimeError(f"named exited: {self.proc.log_path.read_text()[-3000:]}")

    def _answers(self) -> bool:
        return bool(self.records(self.zone, "SOA"))

    def records(self, name: str, rtype: str) -> list[str]:
        """The zone's records of `rtype` at `name` (dig +short)."""
        p = subprocess.run(["dig", f"@{self.addr}", "-p", str(self.port), "+short", "+tries=1", "+time=2",
                            name, rtype], capture_output=True, text=True, timeout=30)
        return [l for l in p.stdout.splitlines() if l and not l.startswith(";")]

    def update(self, lines: list[str]) -> None:
        """nsupdate with the zone's key: `lines` such as "update add NAME TTL TYPE DATA"."""
        script = "\n".join([f"server {self.addr} {self.port}", f"zone {self.zone}", *lines, "send", ""])
        p = subprocess.run(["nsupdate", "-k", str(self.key_file)], input=script, capture_output=True,
                           text=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"nsupdate failed: {p.stderr}")

    def forge(self, node: str, addr: str, nbd: int, status: int, ttl: int = 60) -> list[str]:
        """The update lines of an announcement of `node` at addr:nbd (status
        port `status`), as a donor publishes itself, written by someone else."""
        inst = f"{node}._netpager._tcp.{self.zone}"
        host = f"{node}-netpager.{self.zone}"
        return [f"update add _netpager._tcp.{self.zone} {ttl} PTR {inst}",
                f"update add {inst} {ttl} SRV 0 0 {nbd} {host}",
                f'update add {inst} {ttl} TXT "v=1" "node={node}" "nbd={nbd}" "status={status}"',
                f"update add {host} {ttl} A {addr}"]
