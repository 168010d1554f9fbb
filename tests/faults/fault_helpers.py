"""Pieces of the fault matrix (tests/faults): the faults that need more
than a signal (a network partition, memory pressure on the donor's node, a
status flood) and the row each cell appends to the results file. The
verifying block workload that keeps I/O in flight while a fault is
injected is the harness's (netpager_testkit.blockio).

Everything that changes the machine registers its undo in the test's
Teardown the moment it exists.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import threading
import tomllib
import uuid
from pathlib import Path

from netpager_testkit import MemoryCgroup, OwnedProcess, Teardown
from netpager_testkit.paths import repo_root

MIB = 1 << 20


def results_path() -> Path:
    """Where cells append their rows (one JSON object a line)."""
    env = os.environ.get("NETPAGER_FAULTS_ROWS")
    return Path(env) if env else repo_root() / "bench-results" / "faults-rows.jsonl"


def append_row(row: dict) -> None:
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
    print("fault row: " + json.dumps(row, sort_keys=True))


def extent_size(state_dir: Path) -> int:
    config = tomllib.loads((Path(state_dir) / "device.toml").read_text())
    v = config["extent_size"]
    return v if isinstance(v, int) else parse_size(v)


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    return int(s.rstrip("KMGT")) * mult


class Partition:
    """iptables DROP rules (no RST) for every TCP packet to or from a donor's
    loopback address and ports, removed on teardown (and by `heal`)."""

    def __init__(self, teardown: Teardown, addr: str, ports: list[int]):
        assert addr.startswith("127."), f"loopback addresses only, not {addr}"
        self.tag = f"netpager-test-{uuid.uuid4().hex[:8]}"
        self.rules: list[list[str]] = []
        for port in ports:
            self.rules.append(["INPUT", "-d", addr, "-p", "tcp", "--dport", str(port)])
            self.rules.append(["INPUT", "-s", addr, "-p", "tcp", "--sport", str(port)])
        self.added: list[list[str]] = []
        teardown.add(f"iptables rules {self.tag} on {addr}", self.heal)
        for rule in self.rules:
            self._iptables("-I", rule)
            self.added.append(rule)

    def _spec(self, rule: list[str]) -> list[str]:
        return [rule[0]] + rule[1:] + ["-m", "comment", "--comment", self.tag, "-j", "DROP"]

    def _iptables(self, op: str, rule: list[str], check: bool = True) -> int:
        p = subprocess.run(["iptables", "-w", "10", op] + self._spec(rule),
                           capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise RuntimeError(f"iptables {op} {' '.join(self._spec(rule))}: {p.stderr.strip()}")
        return p.returncode

    def heal(self) -> None:
        while self.added:
            rule = self.added[-1]
            for _ in range(10):  # a rule inserted twice is deleted twice
                if self._iptables("-C", rule, check=False) != 0:
                    break
                self._iptables("-D", rule)
            self.added.pop()
        left = subprocess.run(["iptables", "-w", "10", "-S"], capture_output=True, text=True).stdout
        if self.tag in left:
            raise RuntimeError(f"iptables rules {self.tag} still present:\n{left}")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class MemoryHog:
    """stress-ng holding `size` bytes of anonymous memory in a memory cgroup
    of its own (limit a little above it), so the node's MemAvailable drops;
    it holds them until stopped (by the test or its teardown)."""

    def __init__(self, teardown: Teardown, size: int, log_path):
        self.size = size
        self.cgroup = MemoryCgroup(teardown, size + 512 * MIB)
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup.procs_file),
                "stress-ng", "--vm", "1", "--vm-bytes", f"{size // MIB}M", "--vm-keep",
                "--vm-populate", "--timeout", "0"]
        self.proc = OwnedProcess(argv, log_path, teardown, "memory hog")

    def holding(self) -> bool:
        """Once it holds its whole size (raises if it died)."""
        assert self.proc.alive(), f"the memory hog ended: {self.proc.log_tail()}"
        return self.cgroup.memory_bytes() >= self.size

    def stop(self) -> None:
        self.proc.stop()


class StatusFlood:
    """Threads opening connections to status endpoints as fast as they can:
    half ask a real query and read the reply, half send garbage and hang up."""

    def __init__(self, addrs: list[tuple[str, int]], threads: int = 8):
        from netpager_testkit import pb2
        from netpager_testkit.status import delimited

        self.addrs = addrs
        self.stop_event = threading.Event()
        self.sent = [0] * threads
        self.query = delimited(pb2().Request(status=pb2().StatusQuery()))
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop_event.is_set():
            host, port = rng.choice(self.addrs)
            try:
                with socket.create_connection((host, port), timeout=2) as s:
                    if i % 2:
                        s.sendall(self.query)
                    else:
                        s.sendall(os.urandom(rng.randrange(1, 512)))
                    s.shutdown(socket.SHUT_WR)
                    while s.recv(4096):
                        pass
            except OSError:
                pass
            self.sent[i] += 1

    def start(self) -> "StatusFlood":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)
