"""The nemesis's world, for real: donors (nbdkit pager-server) on lab hosts
in network namespaces (tests/lab/netlab.py), device A (a block device
under fio and the history workload) and device C (swap under memhog),
both attached and driven through `pagerctl` only, and the faults (signals,
iptables DROP and tbf inside a host's namespace). `World.do` carries out
one op of a schedule and checks what the model says it must produce; a
`Failure` says what went wrong."""

from __future__ import annotations

import json
import secrets
import socket
import sys
import time
from pathlib import Path

from ..client import PagerClient, donor_spec, pid_alive, run_pagerctl
from ..cleanup import Teardown
from ..donor import FakeMeminfo
from ..procs import wait_for
from . import checker
from .model import ANNOUNCER, LONG_FAULT, MODES, REQUEST_TIMEOUT, SHORT_FAULT, STRANGER, WRONG_KEY, Op, Setup
from ..blockio import BLOCK
from .workloads import MIB, FioLoop, History, MemhogLoop, Trouble

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab"))
import netlab  # noqa: E402

GIB = 1 << 30
DEVICE_A = 64 * MIB     # fio on the first half, the history on the second
DEVICE_C = 96 * MIB
SWAP_LIMIT = 16 * MIB   # memhog's cgroup; it touches three times this
SETTLE_TIMEOUT = 300
REBALANCE_RATE = "8M"   # a Setup's rebalance=1: device A's 64 MiB in 8 s


class Failure(Exception):
    """A bug, or what looks like one: `kind` is corrupt, eio, expect (an op
    did not do what it must), invariant, stuck (a settle never came), crash
    (a process died), status (status --json malformed), oom or job."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class NemesisDonor(netlab.LabDonor):
    """A lab donor that listens on every address of its host (the namespace
    is its own: its loopback and its lab addresses), so that the host's
    alias reaches the same nbdkit as its address."""

    def argv(self) -> list[str]:
        argv = super().argv()
        i = argv.index("-i")
        return argv[:i] + argv[i + 2:]


class World:
    def __init__(self, td: Teardown, workdir: Path, setup: Setup, seed: int, memhog: Path, log):
        self.td, self.workdir, self.setup, self.seed = td, Path(workdir), setup, seed
        self.memhog, self.log = memhog, log
        self.mode = MODES[setup.mode]
        self.faults: dict[str, tuple[object, float]] = {}  # donor -> (undo handle, started)
        self.file_lines: list[tuple[str, str]] = []        # (donor or "bad", line)
        self.notes: list[str] = []
        # An op did what it must not: the model no longer knows the world,
        # and a settle cannot be expected to come.
        self.diverged = False
        # A serving process was killed: donors may abort until the next settle.
        self.abort_excused = False
        self.second_n = 0
        self.lab = netlab.Lab(td, self.workdir / "lab", setup.hosts(), ssh=False)
        for h in setup.hosts():
            self.lab.add_alias(h)
        self._keys()
        self.meminfo = {n: FakeMeminfo(self.workdir / f"meminfo-{n}", 64 * GIB, 48 * GIB)
                        for n in setup.pool() + [ANNOUNCER]}
        self.donors: dict[str, NemesisDonor] = {}
        for n in setup.pool() + [WRONG_KEY]:
            self.donor(n).start()
        self.donors_file = self.workdir / "donors"
        self._write_file()
        self.a = PagerClient(td, self.workdir / "A", default_id=True)
        self.c = PagerClient(td, self.workdir / "C", client_id="swap") if setup.swap else None
        self.fio: FioLoop | None = None
        self.history: History | None = None
        self.swapjob: MemhogLoop | None = None

    # --- the pieces --------------------------------------------------------

    def _keys(self) -> None:
        self.psk = self.workdir / "lab.psk"
        key = secrets.token_hex(32)
        ids = ["lab", socket.gethostname(), "swap", "second"]
        self.psk.write_text("".join(f"{i}:{key}\n" for i in ids))
        self.wrong_psk = self.workdir / "wrong.psk"
        self.wrong_psk.write_text(f"lab:{secrets.token_hex(32)}\n")
        for p in (self.psk, self.wrong_psk):
            p.chmod(0o600)

    def donor(self, name: str) -> NemesisDonor:
        """The donor on host `name` (made once; started by the caller)."""
        if name in self.donors:
            return self.donors[name]
        from ..paths import server_plugin

        params = {"size": "1G", "budget": "256M", "busy_load": 1000, "poll_ms": 100,
                  "node_id": name}
        tls = None
        if name in (WRONG_KEY, STRANGER):
            params["psk"] = tls = self.wrong_psk
            params["announce"] = name == STRANGER
        elif self.setup.tls:
            params["psk"] = tls = self.psk
        else:
            params["insecure"] = True
        if name in self.meminfo:
            params["meminfo"] = self.meminfo[name].path
            params["reserve"] = "2G"
        if name == ANNOUNCER:
            params["announce"] = True
        d = NemesisDonor(self.lab[name], self.td, self.workdir, server_plugin(), params, tls_psk=tls)
        self.donors[name] = d
        return d

    def spec_of(self, name: str, alias: bool = False) -> str:
        d = self.donor(name)
        if not alias:
            return donor_spec(d)
        host, port = d.status_addr
        return f"{self.lab[name].alias}:{d.port},name={name}-alias,status={host}:{port}"

    def host_of(self) -> dict[str, str]:
        """Every address a donor can be reached at -> its host."""
        out = {}
        for n, d in self.donors.items():
            out[f"{d.addr}:{d.port}"] = n
            out[f"{self.lab[n].alias}:{d.port}"] = n
        return out

    def _write_file(self) -> None:
        tmp = self.donors_file.with_suffix(".tmp")
        tmp.write_text("# the nemesis's donors file\n" + "".join(f"{line}\n" for _, line in self.file_lines))
        tmp.replace(self.donors_file)

    def common_args(self) -> list[str]:
        args = list(self.mode.attach) + ["--epoch", "1", "--request-timeout", str(REQUEST_TIMEOUT),
                                         "--connect-timeout", "3", "--forget-after", "0"]
        if self.setup.tls:
            args += ["--psk", str(self.psk)]
        if self.setup.mode in ("parity", "ec") and not self.setup.parity_log:
            args += ["--parity-log", "0"]
        if self.setup.grace:
            args += ["--grace", "30"]
        if self.setup.rebalance:
            # Fast enough that members move within a slice's 30 s; the
            # workloads touch every extent each epoch, so none would be
            # cold enough to move: here every extent may, under the I/O.
            args += ["--rebalance-rate", REBALANCE_RATE, "--rebalance-busy-rate", REBALANCE_RATE,
                     "--rebalance-hot-epochs", "0"]
        else:
            args += ["--rebalance-rate", "0"]
        return args

    def clients(self) -> dict[str, PagerClient]:
        return {k: v for k, v in (("A", self.a), ("C", self.c)) if v is not None}

    # --- start and stop ------------------------------------------------------

    def start(self) -> None:
        s = self.setup
        first = [self.donor(n) for n in s.pool()[:s.members]]
        extra = self.common_args() + ["--donors-file", str(self.donors_file)]
        if s.tls:
            extra.append("--discover")
        if s.restartable:
            extra.append("--restartable")
        dev = self.a.attach(first, mode=s.mode, size=f"{DEVICE_A // MIB}M", extra=extra)
        self.fio = FioLoop(self.td, dev, self.workdir / "fio", self.seed, jobs=4, region=8 * MIB)
        # Discards of whole MiBs free units, so that placements go on all the time.
        self.history = History(dev, DEVICE_A - self.fio.size, seed=f"{self.seed}", threads=2,
                               offset=self.fio.size, discard=0.1, group=MIB // BLOCK)
        self.td.add(f"history on {dev}", lambda: (self.history.stop(), self.history.close()))
        self.history.fill()
        self.history.start()
        self.fio.start()
        if self.c is not None:
            extra = self.common_args() + (["--restartable"] if s.swap_restartable else [])
            devc = self.c.attach([self.donor(n) for n in s.swap_members()], mode=s.mode,
                                 size=f"{DEVICE_C // MIB}M", swap=True, extra=extra)
            self.swapjob = MemhogLoop(self.td, self.memhog, SWAP_LIMIT, self.workdir / "memhog",
                                      self.seed, devc)
            self.log(f"  swap on {devc} under memhog")
            self.swapjob.start()

    def troubles(self) -> list[Trouble]:
        out = []
        for w in (self.fio, self.swapjob):
            if w is not None:
                out += w.trouble
        if self.history is not None:
            out += self.history.troubles()
        return out

    def verified_bytes(self) -> int:
        return sum(w.verified_bytes for w in (self.fio, self.history, self.swapjob) if w is not None)

    def check(self, model) -> None:
        """After every op: what the workloads saw, and no process gone that
        the model has running."""
        self._raise(self.troubles())
        for name, c in self.clients().items():
            pid = c.server_pid()
            if pid is None or not pid_alive(pid):
                raise Failure("crash", f"device {name}'s serving process {pid} is gone: "
                                       f"{self._log_tail(c)}")
        self.check_donors(model, "")

    NBDKIT_ABORT = "raw_send_socket: Assertion `sock >= 0' failed"

    def check_donors(self, model, when: str) -> None:
        """Every donor the model has running runs. Debian 12's nbdkit 1.32
        aborts when a client hangs up while replies are on their way
        (DESIGN.md, "Many requests in flight"): named as such."""
        for n, d in model.donors.items():
            if d.running and not self.donors[n].alive():
                log = self.donors[n].log_tail(8)
                if self.NBDKIT_ABORT in log and self.abort_excused:
                    self.notes.append(f"donor {n}'s nbdkit 1.32 aborted after a serving process "
                                      "was killed; started again")
                    self.donors[n].start()
                    continue
                why = (" (nbdkit 1.32 aborted: a client hung up with replies on their way)"
                       if self.NBDKIT_ABORT in log else "")
                raise Failure("crash", f"donor {n} died{when}{why} (exit "
                                       f"{self.donors[n].proc.popen.returncode}): {log}")

    @staticmethod
    def _log_tail(c: PagerClient) -> str:
        from ..procs import tail

        return tail(c.state_dir / "serve.log", 8)

    def finish(self, model) -> None:
        """The end: workloads stopped (each finishes and verifies what it
        has), every block read, the invariants, then device A detached
        and attached again, read again, checked again."""
        self.fio.stop()
        if self.swapjob is not None:
            self.swapjob.stop()
        self.history.pause()
        h = self.history
        self.notes.append(f"history: {h.writes} writes, {h.discards} discards of 1 MiB, {h.reads} "
                          f"reads; fio: {self.fio.passes} passes"
                          + (f"; memhog: {self.swapjob.runs} runs" if self.swapjob else ""))
        self._raise(self.troubles() + self.history.check_all())
        if self.setup.rebalance:
            # What it did, so a hunt shows the moves ran under the faults.
            r = self.a.device_status()["totals"]["rebalance"]
            paused = f" (now: {r['paused']})" if r.get("paused") else ""
            self.notes.append(f"rebalancer at {r.get('rate_bytes', 0) >> 20} MiB/s: "
                              f"{r.get('moves', 0)} moves, {r.get('moved_bytes', 0) >> 20} MiB "
                              f"moved on A since it last opened{paused}")
        self.check_invariants(model)
        self.reattach_a(model, resume=False)

    @staticmethod
    def _raise(troubles: list[Trouble]) -> None:
        if troubles:
            raise Failure(troubles[0].kind, "; ".join(t.what for t in troubles))

    def reattach_a(self, model, resume: bool = True) -> None:
        """Detach of the idle device A and attach again: everything reads
        back, the invariants hold, the donors are those it had."""
        if self.fio.running():
            self.fio.stop()
        self.history.pause()
        self._raise(self.troubles() + self.history.check_all())
        self.history.close()  # an open fd would keep the loop device
        self.a.detach()
        # What the front end is is the attach's, not the device's: again.
        extra = ["--restartable"] if self.setup.restartable else []
        if any(k == "bad" for k, _ in self.file_lines):
            # Attach refuses a donors file with a bad line, naming the line
            # (a running device only reports it): the admin fixes the file.
            try:
                self.a.attach([], new_device=False, extra=extra)
            except AssertionError as e:
                if f"{self.donors_file}, line" not in str(e):
                    raise
            else:
                raise Failure("attach", f"attach took {self.donors_file} with a bad line")
            self.file_lines = [x for x in self.file_lines if x[0] != "bad"]
            self._write_file()
            # Fixed, as a file-fix op would (the model's reattach says so
            # too; the end checks' re-attach is no op): the settles from
            # here expect status to report no bad line.
            model.file_bad = False
        dev = self.a.attach([], new_device=False, extra=extra)
        self.history.reopen(dev)
        self.fio.verify_last(dev)
        self._raise(self.troubles() + self.history.check_all())
        self.settle({"A": model.view()["A"]}, model)
        if resume:
            self.fio.device = dev
            self.fio.start()
            self.history.resume()

    # --- settle and invariants ------------------------------------------------

    def used_bytes(self, keys: set[str], model) -> dict[str, int | None]:
        """Bytes each running donor keeps for the exports `keys`
        (checker.export_key), None where it has none of them."""
        out = {}
        for n, d in self.donors.items():
            if not d.alive() or n in (WRONG_KEY, STRANGER) or model.donors[n].fault:
                continue
            mine = [e.used_bytes for e in d.status().exports if checker.export_key(e.name) in keys]
            out[n] = sum(mine) if mine else None
        return out

    def settle(self, view: dict, model, timeout: float = SETTLE_TIMEOUT) -> None:
        if self.diverged:
            timeout = 30
        for name, want in view.items():
            c = self.clients()[name]
            last: list[str] = []

            def reached():
                nonlocal last
                self._raise(self.troubles())
                self.check_donors(model, " while the devices settled")
                full = c.status()
                last = checker.status_problems(full)
                if last:
                    return None
                last = checker.settle_problems(full["status"], want)
                return not last

            try:
                wait_for(reached, timeout, f"device {name} to settle", interval=0.5)
            except TimeoutError:
                raise Failure("stuck", f"device {name} did not settle within {timeout:.0f}s: "
                                       f"{'; '.join(last)}") from None
        self.check_invariants(model, list(view))

    def check_invariants(self, model, names=None, timeout: float = 30) -> None:
        for name in names or list(self.clients()):
            c = self.clients()[name]
            last: list[str] = []

            def hold():
                nonlocal last
                full = c.status()
                last = checker.status_problems(full)
                if last:
                    return False
                st = full["status"]
                asked_ms = time.time() * 1000
                used = self.used_bytes(checker.export_keys(st), model)
                # The device's status written after the donors answered.
                after = wait_for(lambda: (lambda s: s if s and s["updated_unix_ms"] > asked_ms
                                          else None)(c.status()["status"]), 10,
                                 f"device {name}'s next status")
                last = checker.invariant_problems(st, self.host_of(), used, after)
                return not last

            try:
                wait_for(hold, timeout, f"device {name}'s invariants", interval=1)
            except TimeoutError:
                raise Failure("invariant", f"device {name}: {'; '.join(last)}") from None

    # --- one op --------------------------------------------------------------

    def ctl(self, *args, timeout: float = 300):
        return run_pagerctl([str(a) for a in args], timeout=timeout, check=False)

    def do(self, op: Op, expect: dict, model) -> None:
        getattr(self, "op_" + op.kind.replace("-", "_"))(op, expect, model)

    def _donor_add(self, spec: str, accepted: bool, what: str) -> None:
        p = self.ctl("donor-add", "--state-dir", self.a.state_dir, spec)
        if accepted and p.returncode != 0:
            raise Failure("expect", f"{what}: donor-add {spec} refused: {p.stderr.strip()}")
        if not accepted and p.returncode == 0:
            raise Failure("expect", f"{what}: donor-add {spec} must be refused, and was accepted: "
                                    f"{p.stdout.strip()}")

    def op_add(self, op, expect, model):
        self._donor_add(self.spec_of(op.target), expect["accepted"], f"add {op.target}")

    def op_add_alias(self, op, expect, model):
        self._donor_add(self.spec_of(op.target, alias=True), False,
                        f"{op.target} under its other address {self.lab[op.target].alias}")

    def op_add_wrongkey(self, op, expect, model):
        self._donor_add(self.spec_of(WRONG_KEY), False, "a donor with another lab key")

    def op_add_unreachable(self, op, expect, model):
        d = self.donor(self.setup.pool()[0])
        self._donor_add(f"{d.addr}:{d.port + 100},name=ghost", False, "nothing listens there")

    def op_remove(self, op, expect, model):
        p = self.ctl("donor-remove", "--state-dir", self.a.state_dir, op.target, "--wait",
                     "--wait-timeout", "300", timeout=400)
        if p.returncode != 0 or "left the set" not in p.stdout:
            raise Failure("expect", f"donor-remove {op.target} --wait: exit {p.returncode}: "
                                    f"{p.stdout.strip()[-500:]} {p.stderr.strip()}")
        d = self.donors[op.target]
        if d.alive():
            keys = checker.export_keys(self.a.status()["status"])
            used = self.used_bytes(keys, model).get(op.target)
            if used:
                raise Failure("invariant", f"{op.target} left device A's set but keeps {used} bytes "
                                           f"of its export")

    def _refused(self, args, what):
        p = self.ctl(*args)
        if p.returncode == 0:
            raise Failure("expect", f"{what} must be refused, and was accepted: {p.stdout.strip()}")

    def op_remove_refused(self, op, expect, model):
        self._refused(["donor-remove", "--state-dir", self.a.state_dir, op.target],
                      f"donor-remove {op.target} (the mode needs it)")

    def op_remove_unknown(self, op, expect, model):
        self._refused(["donor-remove", "--state-dir", self.a.state_dir, "ghost"],
                      "donor-remove of a donor that is not a member")

    def op_file_add(self, op, expect, model):
        self.file_lines.append((op.target, self.spec_of(op.target)))
        self._write_file()

    def op_file_remove(self, op, expect, model):
        self.file_lines = [x for x in self.file_lines if x[0] != op.target]
        self._write_file()

    BAD_LINES = {
        "spaces": lambda self: f"{self.spec_of(self.setup.pool()[0])} {self.spec_of(self.setup.pool()[1])}",
        "syntax": lambda self: "10.213.47.11,name=noport",
        "dupname": lambda self: f"{self.spec_of(self.setup.pool()[0]).split(',name=')[0]},name=dup\n"
                                f"{self.spec_of(self.setup.pool()[1]).split(',name=')[0]},name=dup",
    }

    def op_file_bad(self, op, expect, model):
        self.file_lines.append(("bad", self.BAD_LINES[op.arg](self)))
        self._write_file()

    def op_file_fix(self, op, expect, model):
        self.file_lines = [x for x in self.file_lines if x[0] != "bad"]
        self._write_file()

    def op_announce(self, op, expect, model):
        self.donor(ANNOUNCER).start()

    def op_announce_stranger(self, op, expect, model):
        self.donor(STRANGER).start()

    def op_unannounce(self, op, expect, model):
        self.donors[op.target or ANNOUNCER].terminate()

    def _admin_drain(self, name: str, undo: bool) -> None:
        host, port = self.donors[name].status_addr
        args = ["donor-drain", f"{host}:{port}"] + (["--undo"] if undo else [])
        if self.setup.tls:
            args += ["--psk", self.psk]
        p = self.ctl(*args)
        if p.returncode != 0:
            raise Failure("expect", f"pagerctl {' '.join(map(str, args))}: {p.stderr.strip()}")

    def op_drain(self, op, expect, model):
        if op.arg == "admin":
            self._admin_drain(op.target, undo=False)
        else:
            self.meminfo[op.target].set(1 * GIB)

    def op_undrain(self, op, expect, model):
        if expect["how"] == "admin":
            self._admin_drain(op.target, undo=True)
        else:
            self.meminfo[op.target].set(48 * GIB)

    def op_restart(self, op, expect, model):
        c = self.clients()[op.target]
        p = self.ctl("restart", "--state-dir", c.state_dir, timeout=120)
        if p.returncode != 0:
            raise Failure("expect", f"pagerctl restart of device {op.target}: {p.stderr.strip()}")

    def op_kill_serve(self, op, expect, model):
        # Debian's nbdkit 1.32 may abort when a client vanishes mid-reply
        # (DESIGN.md, "Many requests in flight"): until the next settle,
        # such a donor is started again (check_donors), the abort noted.
        self.abort_excused = True
        c = self.clients()[op.target]
        old = c.kill_serving_process()
        wait_for(lambda: c.holder().get("ready_pid") not in (None, old), 60,
                 f"device {op.target}'s next serving process")

    def op_reattach(self, op, expect, model):
        self.reattach_a(model)

    def op_second(self, op, expect, model):
        """A second block device on device A's donors, attached, written
        and read back, detached; device A must not notice."""
        self.second_n += 1
        same = op.arg == "same"
        b = PagerClient(self.td, self.workdir / f"B{self.second_n}", default_id=same,
                        client_id=None if same else "second")
        healthy = [self.donors[n] for n in sorted(model.a.members) if model.healthy(n)]
        try:
            dev = b.attach(healthy, mode=self.setup.mode, size=f"{DEVICE_A // MIB}M",
                           extra=self.common_args())
        except AssertionError as e:
            if same:
                self.notes.append(f"second device with A's client id refused: {str(e)[-300:]}")
                return
            raise Failure("expect", f"a second device (own client id) on A's donors: {e}") from None
        w = History(dev, 16 * MIB, seed=f"{self.seed}-b{self.second_n}", threads=2)
        try:
            w.fill()
            w.start()
            w.wait_ops(64)
            w.stop()
            t = w.troubles() + w.check_all()
            if t:
                raise Failure(t[0].kind, f"the second device ({'same' if same else 'own'} client id): "
                              + "; ".join(x.what for x in t))
        finally:
            w.stop()
            w.close()
        b.detach()
        self.history.pause()
        self._raise(self.history.check_all())
        self.history.resume()

    # faults --------------------------------------------------------------------

    def op_kill(self, op, expect, model):
        self.donors[op.target].kill9()

    def op_start(self, op, expect, model):
        self.donors[op.target].start()

    def _fault(self, op, begin, end) -> None:
        if op.arg == "long":
            self.faults[op.target] = (end, time.monotonic())
            begin()
            return
        begin()
        try:
            time.sleep(SHORT_FAULT)
        finally:
            end()

    def op_stop(self, op, expect, model):
        d = self.donors[op.target]
        self._fault(op, d.sigstop, d.sigcont)

    def op_partition(self, op, expect, model):
        holder = {}

        def begin():
            holder["p"] = netlab.Partition(self.td, self.lab, op.target)
        self._fault(op, begin, lambda: holder["p"].heal())

    def op_slow(self, op, expect, model):
        holder = {}
        rate = "1mbit" if op.arg == "long" else "8mbit"

        def begin():
            holder["s"] = netlab.SlowLink(self.td, self.lab, op.target, rate=rate)
        self._fault(op, begin, lambda: holder["s"].heal())

    def op_heal(self, op, expect, model):
        end, started = self.faults.pop(op.target)
        left = LONG_FAULT - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)
        failed = []
        for name, c in self.clients().items():
            st = c.status()["status"] or {}
            failed += [name for d in st.get("donors", []) if d["name"] == op.target and d["failed"]]
        end()
        self.notes.append(f"{op.text()}: {op.target} was failed by {failed or 'no device'}")

    def op_settle(self, op, expect, model):
        self.settle(expect, model)
        self.abort_excused = False

    def op_pause(self, op, expect, model):
        time.sleep(float(op.arg or 2))

    def keep_logs(self, dest: Path) -> None:
        """Copies what a failure leaves to read (the devices' serving logs,
        every donor's log, the workloads' logs) to `dest`, before the
        teardown removes the world."""
        import shutil

        dest.mkdir(parents=True, exist_ok=True)
        files = [p for c in self.clients().values() for p in (c.state_dir / "serve.log",
                                                               c.state_dir / "nbdkit.log",
                                                               c.state_dir / "status.json")]
        files += [d.log_path for d in self.donors.values()]
        files += sorted((self.workdir / "fio").glob("*.log")) + sorted((self.workdir / "memhog").glob("*.log"))
        for f in files:
            if f.exists():
                name = f"{f.parent.name}-{f.name}" if f.parent != self.workdir else f.name
                shutil.copy(f, dest / name)

    def describe_status(self) -> str:
        out = []
        for name, c in self.clients().items():
            try:
                st = c.status()["status"]
                out.append(f"{name}: " + json.dumps({d["name"]: (d["extents_held"], d["failed"])
                                                     for d in st["donors"]}))
            except Exception as e:  # noqa: BLE001 - a description only
                out.append(f"{name}: status unreadable ({e})")
        return "; ".join(out)
