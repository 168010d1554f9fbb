"""The nemesis's model of the world: pure code, no I/O.

A schedule is a list of operations (`Op`) against one world: donors on lab
hosts, device A (a block device carrying fio and the history workload,
attached with the host name as its client id, a donors file, discovery
when the world has a lab key), optionally device C (swap under memhog) on
A's first donors. The `Model` follows what each operation must do to the
world, so that the generator only draws operations that are legal and
within what the mode promises, and the runner knows what each must
produce (`expect`): accepted or refused, the donor set a settle must
reach, the donors that must hold nothing.

Promises, per mode (`MODES`): a unit keeps `members` members on distinct
donors and survives `tolerates` of them failing. A donor-failing fault is
drawn only while fewer than `tolerates` donors are compromised (a fault
active or not yet settled) and every device holding the donor keeps at
least `members` healthy, non-draining donors besides it (so a rebuild has
somewhere to go and a new unit can still be placed). Mode none gets no
donor-failing fault on a member, unless the client has `--grace` and the
fault is shorter than it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Operations that hit a bug still open on main: drawn only when asked
# (`--known`), so that `make test`'s slice stays green until the fix lands.
# The lead removes an entry with its fix (and tests/nemesis/test_known_bugs.py's
# xfail marker).
KNOWN_BUGS: dict[str, str] = {}


@dataclass(frozen=True)
class ModeSpec:
    name: str
    attach: tuple[str, ...]  # attach's options besides --mode
    members: int     # members of a unit, on distinct donors
    tolerates: int   # members a unit survives losing
    data: int        # members a unit needs to be read


MODES = {
    "none": ModeSpec("none", (), 1, 0, 1),
    "mirror": ModeSpec("mirror", (), 2, 1, 1),
    "parity": ModeSpec("parity", ("--parity-width", "3"), 3, 1, 2),
    "ec": ModeSpec("ec", ("--data", "2", "--parity", "2"), 4, 2, 2),
}

# The donor hosts besides the pool of members and spares.
WRONG_KEY = "wk"      # runs from the start with another lab key (or TLS where the device has none)
ANNOUNCER = "an"      # started by `announce` with announce=true and the lab key
STRANGER = "aw"       # started by `announce-stranger`: announces, signs with another key

# Seconds: a short fault stays well below every timeout (and the grace), a
# long one outlasts the request timeout.
REQUEST_TIMEOUT = 4
SHORT_FAULT = 1.0
LONG_FAULT = REQUEST_TIMEOUT + 4


@dataclass(frozen=True)
class Op:
    """One operation: `kind`, the donor it targets (if any), an argument."""
    kind: str
    target: str = ""
    arg: str = ""

    def text(self) -> str:
        return " ".join(p for p in (self.kind, self.target, self.arg) if p)

    @staticmethod
    def parse(text: str) -> "Op":
        parts = text.split()
        if not parts or len(parts) > 3:
            raise ValueError(f"operation {text!r}: KIND [TARGET [ARG]]")
        kind = parts[0]
        if kind not in WEIGHTS:
            raise ValueError(f"operation {text!r}: unknown kind {kind!r} (known: {', '.join(sorted(WEIGHTS))})")
        target = parts[1] if len(parts) > 1 else ""
        arg = parts[2] if len(parts) > 2 else ""
        # Kinds that take only an argument (pause SECS, second-* KIND...).
        if kind in ARG_ONLY and target and not arg:
            target, arg = "", target
        return Op(kind, target, arg)

    def __str__(self) -> str:
        return self.text()


# Relative weights of the kinds the generator draws (an illegal one is
# left out of the draw). Faults are ops too: Jepsen's nemesis is just
# another client.
WEIGHTS = {
    # membership
    "add": 6, "add-alias": 3, "add-wrongkey": 2, "add-unreachable": 1,
    "remove": 5, "remove-refused": 2, "remove-unknown": 1,
    "file-add": 4, "file-remove": 3, "file-bad": 2, "file-fix": 4,
    "announce": 3, "announce-stranger": 2, "unannounce": 2,
    "drain": 4, "undrain": 5,
    # the device's own processes
    "restart": 3, "kill-serve": 3, "reattach": 2, "second": 2,
    # faults
    "kill": 4, "start": 6, "stop": 5, "partition": 4, "slow": 3, "heal": 8,
    # waiting
    "settle": 3, "pause": 3,
}
ARG_ONLY = {"pause", "second", "file-bad"}
FAULTS = {"kill", "stop", "partition", "slow"}


@dataclass
class DonorM:
    """A donor host as the model sees it."""
    name: str
    running: bool = True
    killed: bool = False        # kill -9, not started again
    draining: str = ""          # "", "meminfo" or "admin"
    fault: str = ""             # an active fault: stop, partition, slow
    long: bool = False          # the active fault outlasts the timeouts
    failed: bool = False        # killed or failed long: failed on every device until it is back
    in_file: bool = False
    leaving: bool = False       # its line left the donors file: gone once settled


@dataclass
class DeviceM:
    name: str
    members: dict[str, str] = field(default_factory=dict)  # donor -> how it joined
    static: bool = False        # its set never changes (device C)
    # Members by the donors file or discovery, not yet surely in the set.
    joining: set[str] = field(default_factory=set)
    # Members undrained since the last settle: in the set, but unlabelled
    # until the device's next epoch, so a second name may win (see undrain).
    unlabelled: set[str] = field(default_factory=set)
    restartable: bool = False


@dataclass(frozen=True)
class Setup:
    """What the world is made of, drawn from the seed before any op."""
    mode: str
    members: int                # donors device A is attached with (d1..dN)
    spares: int                 # more donors running, not members (s1..sN)
    tls: bool                   # a lab key: TLS to every donor, signed status, discovery
    restartable: bool           # device A attached --restartable
    swap: bool                  # device C: swap under memhog on A's first donors
    swap_restartable: bool
    parity_log: bool            # striped modes: the parity log on (else --parity-log 0)
    grace: bool                 # the client has --grace: mode none may take short faults
    # Both devices move members toward their donors' shares while the
    # ops run (--rebalance-rate); absent from schedules written before it.
    rebalance: bool = False

    def text(self) -> str:
        return (f"mode={self.mode} members={self.members} spares={self.spares} tls={int(self.tls)} "
                f"restartable={int(self.restartable)} swap={int(self.swap)} "
                f"swap_restartable={int(self.swap_restartable)} parity_log={int(self.parity_log)} "
                f"grace={int(self.grace)} rebalance={int(self.rebalance)}")

    @staticmethod
    def parse(text: str) -> "Setup":
        kv = dict(p.split("=", 1) for p in text.split())
        ints = {k: int(v) for k, v in kv.items() if k != "mode"}
        return Setup(kv["mode"], ints["members"], ints["spares"], bool(ints["tls"]),
                     bool(ints["restartable"]), bool(ints["swap"]), bool(ints["swap_restartable"]),
                     bool(ints["parity_log"]), bool(ints["grace"]), bool(ints.get("rebalance", 0)))

    def pool(self) -> list[str]:
        return [f"d{i + 1}" for i in range(self.members)] + [f"s{i + 1}" for i in range(self.spares)]

    def hosts(self) -> list[str]:
        """Every lab host the world needs."""
        return self.pool() + [WRONG_KEY] + ([ANNOUNCER, STRANGER] if self.tls else [])

    def swap_members(self) -> list[str]:
        return [f"d{i + 1}" for i in range(self.members)]


class Illegal(ValueError):
    """An operation the model does not allow now (a shrunk schedule that
    dropped what it needed, or a hand-written one that is wrong)."""


class Model:
    """The world as the operations so far must have left it."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.spec = MODES[setup.mode]
        self.donors = {n: DonorM(n) for n in setup.hosts()}
        for n in (ANNOUNCER, STRANGER):
            if n in self.donors:
                self.donors[n].running = False
        self.a = DeviceM("A", {n: "attach" for n in setup.pool()[:setup.members]},
                         restartable=setup.restartable)
        self.c = (DeviceM("C", {n: "attach" for n in setup.swap_members()}, static=True,
                          restartable=setup.swap_restartable) if setup.swap else None)
        self.compromised: set[str] = set()  # donors hit since the last settle
        self.file_bad = False
        self.stranger = False               # the stranger announces
        self.announcer_removed = False      # discovery must not bring it back
        self.settled = True

    # --- what the world looks like -----------------------------------------

    def devices(self) -> list[DeviceM]:
        return [d for d in (self.a, self.c) if d is not None]

    def holders(self, name: str) -> list[DeviceM]:
        return [d for d in self.devices() if name in d.members]

    def healthy(self, name: str) -> bool:
        d = self.donors[name]
        return d.running and not d.failed and not d.fault and name not in self.compromised

    def usable_others(self, dev: DeviceM, name: str) -> int:
        """Healthy, non-draining members of `dev` besides `name` that have
        surely joined: where its units can be placed and rebuilt."""
        return sum(1 for n in dev.members if n != name and self.healthy(n)
                   and not self.donors[n].draining and n not in dev.joining)

    def client_healthy_others(self, dev: DeviceM, name: str) -> int:
        """What `donor-remove` counts: members besides `name` the client has
        not failed (draining ones included). Certain only when settled."""
        return sum(1 for n in dev.members if n != name and not self.donors[n].failed)

    def spares_for_a(self) -> list[str]:
        """Pool donors that run, unhurt, outside device A."""
        return [n for n in self.setup.pool()
                if n not in self.a.members and self.healthy(n) and not self.donors[n].in_file
                and not self.donors[n].draining and not self.donors[n].leaving]

    def fault_budget_left(self) -> int:
        return self.spec.tolerates - len(self.compromised)

    def may_hurt(self, name: str, permanent: bool) -> bool:
        """Whether a donor-failing fault on `name` stays within every promise."""
        if name in self.a.joining:
            # It joins at the device's next epoch: hurt before that, the
            # model could not say whether it is a member (slice seed
            # 3111124785: "announce; kill an" and it never joined).
            return False
        if self.donors[name].leaving:
            # Out of the donors file, it still holds pages until its drain
            # is over (the next settle): "file-remove s2; kill s2" lost
            # them in mode none (hunt, seed 1558365144).
            return False
        holders = self.holders(name)
        if not holders:
            return self.donors[name].running and not self.donors[name].fault
        if not self.healthy(name) or self.fault_budget_left() <= 0 and self.spec.tolerates:
            return False
        if not all(self.usable_others(d, name) >= self.spec.members for d in holders):
            return False
        if self.spec.tolerates == 0:
            return self.setup.grace and not permanent and not self.compromised
        return True

    # --- legality and effects ------------------------------------------------

    def candidates(self, exclude=frozenset()) -> list[Op]:
        """Every operation legal now (a generator draws among them)."""
        s, ops = self, []
        pool = self.setup.pool()
        a_members = sorted(s.a.members)
        for n in s.spares_for_a():
            ops.append(Op("add", n))
        for n in pool:
            if n not in s.a.members and s.donors[n].killed:
                ops.append(Op("add", n))  # must be refused: it cannot be reached
        if s.setup.tls and s.announcer_removed and s.healthy(ANNOUNCER):
            ops.append(Op("add", ANNOUNCER))
        for n in a_members:
            # Not one still joining (announced, or added to the donors
            # file, and not yet taken at an epoch): whichever of its two
            # names the device meets first is the member and the other is
            # refused, both right (hunt, ec seeds 3141592612, 3141592614:
            # "announce; add-alias an" took the alias, refused the
            # announcement).
            if s.healthy(n) and n not in s.a.joining | s.a.unlabelled:
                ops.append(Op("add-alias", n))
        ops += [Op("add-wrongkey"), Op("add-unreachable"), Op("remove-unknown")]
        if s.settled:
            for n in a_members:
                how = s.a.members[n]
                if how == "file":
                    continue
                d = s.donors[n]
                if d.failed or s.usable_others(s.a, n) >= s.spec.members:
                    if not d.draining or d.failed:
                        ops.append(Op("remove", n))
                elif not d.failed and s.client_healthy_others(s.a, n) < s.spec.members:
                    ops.append(Op("remove-refused", n))
            if not s.file_bad:
                for n in s.spares_for_a():
                    ops.append(Op("file-add", n))
                for n in a_members:
                    if s.a.members[n] == "file" and s.usable_others(s.a, n) >= s.spec.members \
                            and not s.donors[n].draining:
                        ops.append(Op("file-remove", n))
                ops.append(Op("file-bad", "", "spaces"))
                ops.append(Op("file-bad", "", "syntax"))
                ops.append(Op("file-bad", "", "dupname"))
        if s.file_bad:
            ops.append(Op("file-fix"))
        if s.setup.tls:
            an = s.donors[ANNOUNCER]
            if not an.running and not an.killed and ANNOUNCER not in s.a.members:
                ops.append(Op("announce"))
            if an.running and ANNOUNCER not in s.a.members and s.settled:
                ops.append(Op("unannounce"))
            if not s.stranger:
                ops.append(Op("announce-stranger"))
            else:
                ops.append(Op("unannounce", STRANGER))
        for n in sorted(s.donors):
            d = s.donors[n]
            holders = s.holders(n)
            if not holders or n in (WRONG_KEY, STRANGER):
                continue
            if not d.draining and s.healthy(n) and all(
                    s.usable_others(dev, n) >= s.spec.members for dev in holders):
                ops += [Op("drain", n, "meminfo"), Op("drain", n, "admin")]
            # Undone by pagerctl, it needs the donor's status endpoint to
            # answer: not while a fault holds it (the hunt, ec, seed
            # 28889086, took the refusal for a finding).
            if d.draining and d.running and not (d.draining == "admin" and d.fault):
                ops.append(Op("undrain", n))
        for dev in s.devices():
            if dev.restartable:
                ops.append(Op("restart", dev.name))
                # A kill -9 of the serving process may make Debian's nbdkit
                # 1.32 abort a donor that was answering it: a fault on
                # every donor at once, which only a settled protected mode
                # can take.
                if s.spec.tolerates and s.settled and not s.compromised:
                    ops.append(Op("kill-serve", dev.name))
        if s.settled:
            ops.append(Op("reattach"))
            ops += [Op("second", "", "own"), Op("second", "", "same")]
        for n in pool + ([ANNOUNCER] if ANNOUNCER in s.donors else []):
            d = s.donors[n]
            if d.killed:
                ops.append(Op("start", n))
                continue
            if not d.running:
                continue
            if d.fault:
                if d.long:
                    ops.append(Op("heal", n))
                continue
            if s.may_hurt(n, permanent=True):
                ops.append(Op("kill", n))
            if s.may_hurt(n, permanent=False):
                for f in ("stop", "partition", "slow"):
                    ops.append(Op(f, n, "short"))
                    if s.spec.tolerates or not s.holders(n):
                        ops.append(Op(f, n, "long"))
        if not any(d.fault and d.long for d in s.donors.values()):
            ops.append(Op("settle"))
        ops += [Op("pause", "", "2"), Op("pause", "", "5")]
        return [o for o in ops if o.kind not in exclude and op_key(o) not in exclude]

    def check(self, op: Op) -> None:
        """Raises Illegal unless `op` is among the candidates now."""
        if op.kind == "pause":
            return
        if op not in self.candidates():
            raise Illegal(f"{op.text()} is not allowed here ({self.describe()})")

    def apply(self, op: Op) -> dict:
        """Applies `op` (after `check`); returns what it must produce."""
        self.check(op)
        s, k, n = self, op.kind, op.target
        d = s.donors.get(n)
        if k == "add":
            if d.running:
                s.a.members[n] = "added"
                if n == ANNOUNCER:
                    s.announcer_removed = False
                return {"accepted": True}
            return {"accepted": False, "why": "cannot be reached"}
        if k in ("add-alias", "add-wrongkey", "add-unreachable", "remove-unknown", "remove-refused"):
            return {"accepted": False}
        if k == "remove":
            del s.a.members[n]
            if n == ANNOUNCER:
                s.announcer_removed = True
            return {"accepted": True}
        if k == "file-add":
            # Joins at the next epoch: a removal drawn before a settle could
            # count it or not.
            d.in_file = True
            s.a.members[n] = "file"
            s.a.joining.add(n)
            s.settled = False
            return {}
        if k == "file-remove":
            d.in_file, d.leaving = False, True
            del s.a.members[n]
            s.settled = False
            return {}
        if k == "file-bad":
            s.file_bad = True
            return {}
        if k in ("file-fix", "reattach"):
            # A re-attach fixes the file first: attach refuses a bad line.
            s.file_bad = False
            return {}
        if k == "announce":
            d = s.donors[ANNOUNCER]
            d.running, d.failed = True, False
            if not s.announcer_removed:
                s.a.members[ANNOUNCER] = "discovered"
                s.a.joining.add(ANNOUNCER)
                s.settled = False
            return {}
        if k == "announce-stranger":
            s.stranger = True
            return {}
        if k == "unannounce":
            if n == STRANGER:
                s.stranger = False
            else:
                s.donors[ANNOUNCER].running = False
            return {}
        if k == "drain":
            d.draining = op.arg
            return {}
        if k == "undrain":
            how = d.draining
            d.draining = ""
            if n in s.a.members:
                # A member drained empty dropped its label, and one that
                # was draining when device A opened took none: it labels
                # itself at the next epoch, and a second name drawn before
                # that wins instead (hunt, ec seed 3141592625: "restart A;
                # undrain d4; add-alias d4" took the alias, refused d4).
                # Only the second name waits: it may drain again at once.
                s.a.unlabelled.add(n)
            return {"how": how}
        if k == "kill-serve":
            s.compromised |= {x for x in s.donors if s.holders(x)}
            s.settled = False
            return {}
        if k == "kill":
            d.running, d.killed = False, True
            if d.draining == "admin":
                d.draining = ""  # asked of the process: the next one has forgotten
            d.failed = bool(s.holders(n))
            if d.failed:
                s.compromised.add(n)
                s.settled = False
            return {}
        if k == "start":
            d.running, d.killed = True, False
            s.settled = False
            if s.holders(n):
                s.compromised.add(n)
            return {}
        if k in ("stop", "partition", "slow"):
            long = op.arg == "long"
            if long:
                d.fault, d.long = k, True
            if s.holders(n):
                s.compromised.add(n)
                s.settled = False
            return {"seconds": LONG_FAULT if long else SHORT_FAULT}
        if k == "heal":
            d.fault, d.long = "", False
            return {}
        if k == "settle":
            s.a.joining.clear()
            s.a.unlabelled.clear()
            for x in s.donors.values():
                x.leaving = False
                if x.running and not x.fault:
                    x.failed = False
            s.compromised = {x for x, dm in s.donors.items() if dm.fault}
            s.settled = not s.compromised
            return self.view()
        return {}

    def view(self) -> dict:
        """What a settle must find: per device, its donors and whether each
        is failed, which must hold nothing (draining), the donors file's
        error, the stranger refused."""
        out = {}
        for dev in self.devices():
            out[dev.name] = {
                "members": dict(dev.members),
                "failed": sorted(n for n in dev.members if self.donors[n].failed),
                "empty": sorted(n for n in dev.members if self.donors[n].draining
                                or self.donors[n].failed),
            }
        out["A"]["file_bad"] = self.file_bad
        # Announced and not used: the stranger, and the announcer once removed.
        out["A"]["not_admitted"] = sorted(
            ([STRANGER] if self.stranger else [])
            + ([ANNOUNCER] if self.announcer_removed and self.donors[ANNOUNCER].running else []))
        return out

    def closing(self) -> list[Op]:
        """What ends every schedule: active faults healed, then a settle."""
        return [Op("heal", n) for n, d in sorted(self.donors.items()) if d.fault and d.long] + [Op("settle")]

    def describe(self) -> str:
        return (f"A={sorted(self.a.members)} compromised={sorted(self.compromised)} "
                f"settled={self.settled} faults="
                f"{[(n, d.fault) for n, d in self.donors.items() if d.fault]} "
                f"dead={[n for n, d in self.donors.items() if not d.running]}")


def op_key(op: Op) -> str:
    """The name an operation goes by in KNOWN_BUGS and --exclude: its kind,
    or KIND-ARG for `second` and the faults (`partition-long`)."""
    return f"{op.kind}-{op.arg}" if op.kind == "second" or op.kind in FAULTS and op.arg else op.kind


def validate(setup: Setup, ops: list[Op]) -> list[dict]:
    """Every op's expectation, raising Illegal at the first one the model
    refuses."""
    m = Model(setup)
    out = []
    for i, op in enumerate(ops):
        try:
            out.append(m.apply(op))
        except Illegal as e:
            raise Illegal(f"op {i}: {e}") from None
    return out
