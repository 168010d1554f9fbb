"""Donors: nbdkit running the pager-server plugin on loopback addresses.

`Cluster.start_donors(n, ...)` starts N donors on 127.N.0.2, 127.N.0.3, ...
(this process's own loopback block, `machine.loopback`), each on a free
port, in the foreground (`-f`) so the harness owns the pid,
with a pidfile and a log file in the test's directory. A donor can be
killed (-9), stopped (SIGSTOP), continued and restarted on the same address
and port, and asked for its status over the protobuf endpoint.

`plugin="memory"` runs nbdkit's own memory plugin instead (same NBD
behaviour, no budget and no status): the harness's self-tests use it so they
do not depend on the donor being built.

`tls_psk=FILE` starts nbdkit with `--tls=require --tls-psk=FILE` (URIs
become `nbds://USER@...?tls-psk-file=FILE`); `filters=[...]` and
`filter_params={...}` put nbdkit filters (error, pause, ...) in front of the
plugin; a donor with `psk=` is queried with signed status requests.

The machine's own load and memory never decide a test's result: a
pager-server donor is never busy (`busy-load=1000`) and never drains for
the machine's memory (`reserve=0`) unless the test sets `busy_load=`,
`reserve=` or a fake `meminfo=`, as the tests about those states do.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from .cleanup import Teardown
from .machine import loopback
from .procs import OwnedProcess, tail, wait_for
from .status import LabKey, StatusClient, StatusError, state_word

PAGER_PARAMS = ("size", "budget", "reserve", "mlock", "status", "node-id", "age-x",
                "u-star", "window", "busy-load", "poll-ms", "meminfo", "psk",
                "export-secret", "insecure", "metrics", "announce", "compress", "recompress",
                "recompress-idle", "recompress-rate", "dns-zone",
                "dns-key", "dns-server", "dns-ttl", "dns-lease", "dns-prune")


def free_ports(addr: str, n: int) -> list[int]:
    """n distinct ports free on `addr` right now (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((addr, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _param_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def write_meminfo(path, total_bytes: int, available_bytes: int) -> None:
    """Writes a /proc/meminfo look-alike for the donor's `meminfo=` hook.

    Written to a temporary name and renamed, so the donor never reads half a file.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    free = max(0, available_bytes - (64 << 20))
    tmp.write_text(
        f"MemTotal:       {total_bytes // 1024:>10} kB\n"
        f"MemFree:        {free // 1024:>10} kB\n"
        f"MemAvailable:   {available_bytes // 1024:>10} kB\n"
        f"Buffers:        {0:>10} kB\n"
        f"Cached:         {(64 << 20) // 1024:>10} kB\n"
        f"SwapTotal:      {0:>10} kB\n"
        f"SwapFree:       {0:>10} kB\n")
    os.replace(tmp, path)


class FakeMeminfo:
    """The file a donor's `meminfo=` hook reads instead of /proc/meminfo."""

    def __init__(self, path, total: int, available: int):
        self.path = Path(path)
        self.total = total
        self.set(available)

    def set(self, available: int) -> None:
        """New MemAvailable; the donor sees it at its next poll."""
        self.available = available
        write_meminfo(self.path, self.total, available)


def nbd_handshake(uri: str) -> bool:
    """True when an NBD server answers the handshake at `uri` (no export is opened)."""
    import nbd

    h = nbd.NBD()
    try:
        h.set_opt_mode(True)
        # TLS URIs name their key file (tls-psk-file=).
        h.set_uri_allow_local_file(True)
        h.connect_uri(uri)
        h.opt_abort()
        return True
    except nbd.Error:
        return False
    finally:
        del h  # the binding closes the handle when it is freed


class PortTaken(RuntimeError):
    """nbdkit could not bind its port: another process took it first."""


class Donor:
    """One nbdkit process serving one donor."""

    def __init__(self, teardown: Teardown, workdir: Path, name: str, addr: str,
                 plugin: str, params: dict, verbose: bool = False, tls_psk=None,
                 filters=(), filter_params: dict | None = None):
        self.verbose = verbose
        self.tls_psk = Path(tls_psk) if tls_psk else None
        self.filters = list(filters)
        self.filter_params = dict(filter_params or {})
        self.teardown = teardown
        self.workdir = Path(workdir)
        self.name = name
        self.addr = addr
        self.plugin = str(plugin)
        self.is_pager = self.plugin != "memory"
        self.params = {k.replace("_", "-"): v for k, v in params.items() if v is not None}
        if self.is_pager:
            unknown = set(self.params) - set(PAGER_PARAMS)
            if unknown:
                raise ValueError(f"donor {name}: unknown pager-server parameters {sorted(unknown)}")
            self.params.setdefault("node-id", name)
            self.params.setdefault("busy-load", 1000)
            if "meminfo" not in self.params:
                self.params.setdefault("reserve", 0)
        elif set(self.params) - {"size"}:
            raise ValueError(f"donor {name}: nbdkit memory takes only size=, got {self.params}")
        # Ports are ours to pick (and re-pick) unless the caller set status=.
        self._own_status_port = self.is_pager and "status" not in self.params
        self._pick_ports()
        self.pidfile = self.workdir / f"donor-{name}.pid"
        self.log_path = self.workdir / f"donor-{name}.log"
        self.proc: OwnedProcess | None = None
        self.starts = 0

    def _pick_ports(self) -> None:
        ports = free_ports(self.addr, 2)
        self.port = ports[0]
        if self._own_status_port:
            self.params["status"] = f"{self.addr}:{ports[1]}"

    @property
    def status_addr(self) -> tuple[str, int] | None:
        s = self.params.get("status")
        if not s:
            return None
        host, port = s.rsplit(":", 1)
        return host, int(port)

    def uri(self, export: str = "") -> str:
        if self.tls_psk:
            user = LabKey.from_psk_file(self.tls_psk).username
            return (f"nbds://{user}@{self.addr}:{self.port}/{export}"
                    f"?tls-psk-file={self.tls_psk}")
        return f"nbd://{self.addr}:{self.port}/{export}"

    def argv(self) -> list[str]:
        # A benchmark's DONOR_CPUS (taskset's list) puts donors on CPUs of
        # their own, as on machines of their own (bench-ab's CLIENT_CPUS).
        cpus = os.environ.get("DONOR_CPUS")
        argv = (["taskset", "-c", cpus] if cpus else []) + ["nbdkit", "-f"] + (["-v"] if self.verbose else [])
        argv += ["--port", str(self.port), "-i", self.addr, "--pidfile", str(self.pidfile)]
        if self.tls_psk:
            argv += ["--tls=require", f"--tls-psk={self.tls_psk}"]
        argv += [f"--filter={f}" for f in self.filters]
        argv.append(self.plugin)
        params = {**self.params, **self.filter_params}
        return argv + [f"{k}={_param_value(v)}" for k, v in params.items()]

    def start(self, timeout: float = 30.0) -> "Donor":
        """Starts nbdkit and waits until it answers NBD (and status) requests.

        A first start that loses its free port to another process before
        binding it retries on fresh ports; a restart keeps its ports.
        """
        if self.proc is not None and self.proc.alive():
            raise RuntimeError(f"donor {self.name} is already running (pid {self.proc.pid})")
        first, failures = self.starts == 0, 0
        while True:
            try:
                return self._start_once(timeout)
            except PortTaken:
                failures += 1
                if not first or failures == 3:
                    raise
                self._pick_ports()

    def _start_once(self, timeout: float) -> "Donor":
        self.pidfile.unlink(missing_ok=True)
        self.starts += 1
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.proc = OwnedProcess(self.argv(), self.log_path, self.teardown,
                                 f"donor {self.name}")

        def ready():
            if not self.proc.alive():
                with open(self.log_path, errors="replace") as f:
                    f.seek(log_start)
                    log = f.read()
                cls = PortTaken if "Address already in use" in log else RuntimeError
                raise cls(f"donor {self.name} exited with {self.proc.popen.returncode} while "
                          f"starting; log {self.log_path}:\n{tail(self.log_path)}")
            try:
                if self.pidfile.read_text().strip() != str(self.proc.pid):
                    return False
            except FileNotFoundError:
                return False
            if not nbd_handshake(self.uri()):
                return False
            if self.status_addr:
                try:
                    self.status_client().query()
                except (OSError, StatusError):
                    return False
            return True

        try:
            wait_for(ready, timeout, f"donor {self.name} at {self.uri()} (log {self.log_path})")
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{tail(self.log_path)}") from None
        return self

    def status_client(self, timeout: float = 5.0) -> StatusClient:
        """A client of the status endpoint, signing with the donor's `psk=` key."""
        if not self.status_addr:
            raise RuntimeError(f"donor {self.name} has no status endpoint")
        key = LabKey.from_psk_file(self.params["psk"]) if "psk" in self.params else None
        return StatusClient(*self.status_addr, timeout=timeout, key=key)

    def status(self):
        """The donor's DonorStatus message."""
        return self.status_client().query()

    def wait_state(self, word: str, timeout: float = 30.0):
        """Waits until the status says `word` (idle/busy/draining); returns it."""
        def check():
            s = self.status()
            return s if state_word(s) == word else None

        return wait_for(check, timeout, f"donor {self.name} to become {word}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def kill9(self) -> None:
        self.proc.kill9()

    def sigstop(self) -> None:
        self.proc.sigstop()

    def sigcont(self) -> None:
        self.proc.signal(signal.SIGCONT)

    def terminate(self) -> None:
        self.proc.stop()

    def restart(self, timeout: float = 30.0) -> "Donor":
        """Stops the donor if it runs, then starts it again on the same address and port."""
        if self.alive():
            self.proc.stop()
        return self.start(timeout)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)


class Cluster:
    """A set of donors on distinct loopback addresses, undone by `teardown`."""

    def __init__(self, teardown: Teardown, workdir, plugin, verbose: bool = False):
        self.verbose = verbose
        self.teardown = teardown
        self.workdir = Path(workdir)
        self.plugin = str(plugin)
        self.donors: list[Donor] = []

    def start_donors(self, n: int, budgets=None, size="1G", tls_psk=None, filters=(),
                     filter_params=None, **params) -> list[Donor]:
        """Starts n more donors; `budgets` is one value for all or one per donor.

        Other keyword arguments are plugin parameters (age_x= becomes age-x=);
        a list gives one value per donor. `tls_psk`, `filters` and
        `filter_params` apply to every donor (see the module's doc).
        """
        if budgets is not None and not isinstance(budgets, (list, tuple)):
            budgets = [budgets] * n
        started = []
        for i in range(n):
            index = len(self.donors)
            name = f"d{index + 1}"
            p = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in params.items()}
            p["size"] = size
            if budgets is not None:
                p["budget"] = budgets[i]
            donor = Donor(self.teardown, self.workdir, name, loopback(index + 2),
                          self.plugin, p, self.verbose, tls_psk=tls_psk, filters=filters,
                          filter_params=filter_params)
            self.donors.append(donor)
            started.append(donor.start())
        return started

    def statuses(self) -> list:
        return [d.status() for d in self.donors]

    def __getitem__(self, i) -> Donor:
        return self.donors[i]

    def __iter__(self):
        return iter(self.donors)

    def __len__(self) -> int:
        return len(self.donors)
