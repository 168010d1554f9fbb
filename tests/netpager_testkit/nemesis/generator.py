"""Seeded schedules (pure code): the world's setup and then operations,
drawn one at a time among those the model allows, so that a schedule is
a function of (seed, mode, features) alone and its first N operations are
the same whatever length is asked for: a failing run is replayed from its
seed, and shortened by asking for fewer operations (`shrink`)."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass

from .model import FAULTS, KNOWN_BUGS, MODES, WEIGHTS, Illegal, Model, Op, Setup, validate


@dataclass(frozen=True)
class Features:
    """What the binaries under test can do (asked of them before drawing)
    and what the caller leaves out."""
    grace: bool = False           # `pagerctl attach --grace`
    exclude: frozenset = frozenset()  # op kinds (or KIND-ARG) never drawn


def rng_for(seed: int, mode: str) -> random.Random:
    return random.Random(f"nemesis:{seed}:{mode}")


def draw_setup(rng: random.Random, mode: str, features: Features) -> Setup:
    spec = MODES[mode]
    striped = mode in ("parity", "ec")
    # A member more than a unit needs, so a rebuild has a target; sometimes two.
    members = spec.members + 1 + rng.randrange(2)
    spares = 2 + rng.randrange(2)
    restartable = rng.random() < 0.4
    swap = rng.random() < 0.5
    return Setup(mode=mode, members=members, spares=spares, tls=rng.random() < 0.5,
                 restartable=restartable, swap=swap,
                 swap_restartable=swap and rng.random() < 0.3,
                 parity_log=striped and rng.random() < 0.6,
                 grace=features.grace)


@dataclass
class Schedule:
    seed: int
    setup: Setup
    ops: list[Op]

    def texts(self) -> list[str]:
        return [o.text() for o in self.ops]


def generate(seed: int, mode: str, n_ops: int, features: Features = Features()) -> Schedule:
    """The first `n_ops` operations of seed `seed`'s schedule in `mode`."""
    rng = rng_for(seed, mode)
    setup = draw_setup(rng, mode, features)
    # Drawn from a generator of its own, so that the rest of every seed's
    # schedule is what it was before the rebalancer was part of the hunt.
    rebalance = random.Random(f"nemesis:{seed}:{mode}:rebalance").random() < 0.5
    setup = dataclasses.replace(setup, rebalance=rebalance)
    model = Model(setup)
    ops: list[Op] = []
    while len(ops) < n_ops:
        op = draw(rng, model, features.exclude)
        model.apply(op)
        ops.append(op)
    return Schedule(seed, setup, ops)


def draw(rng: random.Random, model: Model, exclude) -> Op:
    """A kind by its weight among those with a legal op, then one of its
    ops; a fault on a device's member three times as likely as on a
    bystander (which only shows that nobody notices)."""
    by_kind: dict[str, list[Op]] = {}
    for o in model.candidates(exclude):
        by_kind.setdefault(o.kind, []).append(o)
    kinds = sorted(by_kind)
    kind = rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
    ops = by_kind[kind]
    weights = [3 if kind in FAULTS and model.holders(o.target) else 1 for o in ops]
    return rng.choices(ops, weights)[0]


def default_exclude(known: bool, extra=()) -> frozenset:
    """Op keys to leave out: the known bugs unless `known`, and `extra`."""
    return frozenset(extra) | (frozenset() if known else frozenset(KNOWN_BUGS))


def seed_from(text: str) -> int:
    """A seed from any text (a commit hash): 32 bits of its SHA-256."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def legal(setup: Setup, ops: list[Op]) -> bool:
    try:
        validate(setup, ops)
        return True
    except Illegal:
        return False


def shrink(setup: Setup, ops: list[Op], failed_at: int, fails, budget: int) -> tuple[list[Op], int]:
    """Shortens a failing schedule. `fails(ops)` replays a candidate and
    returns the index of the op it failed at (len(ops) when only the
    closing checks failed), or None. First the prefix, bisected: the
    shortest prefix that still fails; then single ops dropped from it,
    newest first, where what is left is still legal. At most `budget`
    replays. Returns the shortest failing schedule found and the replays
    spent."""
    best, spent = ops[:failed_at + 1], 0
    lo, hi = -1, len(best)         # a prefix of hi ops fails; of lo or fewer, none tried fails
    while hi - lo > 1 and spent < budget:
        mid = (lo + hi) // 2
        spent += 1
        if fails(best[:mid]) is not None:
            hi = mid
        else:
            lo = mid
    best = best[:hi]
    i = len(best) - 2
    while i >= 0 and spent < budget:
        cand = best[:i] + best[i + 1:]
        if legal(setup, cand):
            spent += 1
            got = fails(cand)
            if got is not None:
                best = cand[:got + 1]
        i = min(i - 1, len(best) - 2)
    return best, spent
