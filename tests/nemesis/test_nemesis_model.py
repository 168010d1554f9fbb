"""The nemesis's pure parts (netpager_testkit.nemesis: model, generator,
shrink, checker), without a world: schedules are a function of their seed
and their prefixes are stable, every drawn schedule is legal and stays
within its mode's promise, the known bugs' ops are drawn only when asked,
a schedule's text replays it, shrinking finds the shortest failing
schedule, and the checker sees each invariant broken."""

from __future__ import annotations

import copy

import pytest

from netpager_testkit.nemesis.checker import (export_key, invariant_problems, settle_problems,
                                              status_problems)
from netpager_testkit.nemesis.generator import (Features, default_exclude, generate, legal, seed_from,
                                                shrink)
from netpager_testkit.nemesis.model import (FAULTS, KNOWN_BUGS, MODES, Illegal, Model, Op, Setup,
                                            op_key, validate)
from netpager_testkit.nemesis.run import parse_schedule, schedule_text

SEEDS = range(40)


@pytest.mark.parametrize("mode", MODES)
def test_a_schedule_is_its_seed_and_its_prefixes_are_stable(mode):
    long = generate(5, mode, 60)
    assert generate(5, mode, 60).texts() == long.texts()
    assert generate(5, mode, 25).texts() == long.texts()[:25]
    assert generate(6, mode, 60).texts() != long.texts()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grace", [False, True])
def test_every_drawn_schedule_is_legal_and_within_the_promise(mode, grace):
    spec = MODES[mode]
    kinds = set()
    for seed in SEEDS:
        s = generate(seed, mode, 50, Features(grace=grace, exclude=default_exclude(known=True)))
        m = Model(s.setup)
        for op in s.ops:
            holders = m.holders(op.target) if op.target in m.donors else []
            if op.kind in FAULTS and holders:
                if spec.tolerates == 0:
                    assert grace and op.kind != "kill" and op.arg == "short", (seed, op.text())
                else:
                    assert len(m.compromised) < spec.tolerates, (seed, op.text(), m.describe())
                for dev in holders:
                    assert m.usable_others(dev, op.target) >= spec.members, (seed, op.text())
            if op.kind == "kill-serve":
                assert spec.tolerates and not m.compromised, (seed, m.describe())
            if op.kind in FAULTS and op.target in m.donors:
                assert not m.donors[op.target].leaving, (seed, op.text(), m.describe())
            if op.kind == "undrain" and m.donors[op.target].draining == "admin":
                assert not m.donors[op.target].fault, (seed, op.text(), m.describe())
            m.apply(op)
            kinds.add(op.kind)
            assert len(m.compromised - {n for n, d in m.donors.items() if d.fault}) <= \
                max(spec.tolerates, len(m.donors)), m.describe()
    # The generator reaches every kind over these seeds (kill only where a
    # member may die; remove-refused needs a small set).
    expected = {"add", "add-alias", "add-wrongkey", "add-unreachable", "remove", "remove-unknown",
                "file-add", "file-bad", "file-fix", "announce", "announce-stranger", "drain",
                "undrain", "restart", "reattach", "second", "stop", "partition", "slow", "heal",
                "settle", "pause", "start", "kill"}
    assert expected <= kinds, expected - kinds


def test_excluded_and_known_bugs_ops_are_drawn_only_when_asked():
    overlapping = 0
    for mode in MODES:
        for seed in SEEDS:
            s = generate(seed, mode, 40, Features(exclude=default_exclude(False, {"add-alias"})))
            keys = {op_key(o) for o in s.ops}
            assert not keys & (set(KNOWN_BUGS) | {"add-alias"}), (mode, seed)
            m = Model(s.setup)
            for op in s.ops:
                # Drains may overlap (fixed: drains-overlapping).
                if op.kind == "drain" and any(d.draining for d in m.donors.values()):
                    overlapping += 1
                m.apply(op)
    assert overlapping > 0
    drawn = {op_key(o) for seed in SEEDS for o in
             generate(seed, "mirror", 40, Features(exclude=default_exclude(known=True))).ops}
    assert set(KNOWN_BUGS) <= drawn and "add-alias" in drawn


def test_a_schedule_text_replays_it():
    s = generate(9, "ec", 30, Features(exclude=default_exclude(known=True)))
    setup, ops = parse_schedule(schedule_text(s.setup, s.ops))
    assert (setup, ops) == (s.setup, s.ops)
    with pytest.raises(ValueError, match="unknown kind 'explode'"):
        Op.parse("explode d1")
    # A hand-written schedule the model refuses is named as such.
    setup = Setup.parse("mode=mirror members=3 spares=2 tls=0 restartable=0 swap=0 "
                        "swap_restartable=0 parity_log=0 grace=0")
    with pytest.raises(Illegal, match="heal d1 is not allowed"):
        validate(setup, [Op.parse("heal d1")])


def test_removals_the_mode_cannot_spare_are_expected_refused():
    setup = Setup("parity", 3, 2, False, False, False, False, True, False)
    m = Model(setup)
    assert Op("remove-refused", "d1") in m.candidates()
    assert Op("remove", "d1") not in m.candidates()
    assert m.apply(Op("add", "s1")) == {"accepted": True}
    assert Op("remove", "d1") in m.candidates()
    m.apply(Op("kill", "s2"))  # a bystander: nothing is compromised
    assert m.compromised == set() and m.settled
    assert m.apply(Op("add", "s2")) == {"accepted": False, "why": "cannot be reached"}


def test_shrink_finds_the_shortest_failing_schedule():
    sched = generate(3, "mirror", 30, Features(exclude=default_exclude(known=True)))
    setup, ops = sched.setup, sched.ops
    culprit = next(i for i, o in enumerate(ops) if o.kind == "add-alias")
    replays = []

    def fails(cand):
        replays.append(len(cand))
        return next((i for i, o in enumerate(cand) if o.kind == "add-alias"), None)

    short, spent = shrink(setup, ops, len(ops) - 1, fails, budget=100)
    assert [o.kind for o in short] == ["add-alias"] or (
        short[-1].kind == "add-alias" and all(not legal(setup, short[:i] + short[i + 1:])
                                               for i in range(len(short) - 1))), short
    assert spent == len(replays) and short[-1] == ops[culprit]
    # A budget bounds the replays.
    replays.clear()
    shrink(setup, ops, len(ops) - 1, fails, budget=3)
    assert len(replays) == 3


def test_seed_from_a_commit_is_stable():
    assert seed_from("e045d73") == seed_from("e045d73") != seed_from("bd575a7")


# --- the checker on statuses made by hand ---------------------------------

def donor(name, addr, held, failed=False, joined="attach"):
    return {"name": name, "address": addr, "export": "h@1", "failed": failed, "extents_held": held,
            "slots_free": 10, "used_bytes": held << 20, "joined": joined, "leaving": False,
            "state": "idle"}


def status(donors, placed, code="1+1"):
    return {"client_id": "h", "mode": "mirror", "code": code, "donors": donors,
            "extent_bytes": 1 << 20, "size_bytes": 64 << 20, "left": [], "updated_unix_ms": 1,
            "totals": {"units": 64, "units_placed": placed, "lost": 0, "lost_extents": [],
                       "degraded": 0, "rebuild": {"active": False}, "drain": {"active": False},
                       "off_fallback": {"active": False}, "parity_log_used_bytes": 0,
                       "fallback_used_bytes": 0}}


HOSTS = {"10.0.0.1:1": "d1", "10.0.0.2:1": "d2", "10.0.0.3:1": "d3", "10.0.0.101:1": "d1"}


def test_the_checker_sees_each_invariant_broken():
    good = status([donor("d1", "10.0.0.1:1", 4), donor("d2", "10.0.0.2:1", 4),
                   donor("d3", "10.0.0.3:1", 2)], placed=5)
    used = {"d1": (4 << 20) + 4096, "d2": 4 << 20, "d3": 0}
    assert invariant_problems(good, HOSTS, used) == []
    assert status_problems({"attached": True, "state_dir": "/s", "status": good}) == []

    dup = copy.deepcopy(good)
    dup["donors"].append(donor("d1-alias", "10.0.0.101:1", 0))
    assert any("member 2 times" in p for p in invariant_problems(dup, HOSTS, used))

    lost_slot = copy.deepcopy(good)
    lost_slot["totals"]["units_placed"] = 6
    assert any("add up to 10" in p for p in invariant_problems(lost_slot, HOSTS, used))

    leak = dict(used, d2=(5 << 20))
    assert any("keeps 5242880 bytes" in p for p in invariant_problems(good, HOSTS, leak))
    stranger = dict(used, d4=4096)
    assert any("donor d4" in p for p in invariant_problems(good, dict(HOSTS, **{"10.0.0.4:1": "d4"}),
                                                         stranger))

    bad = copy.deepcopy(good)
    bad["donors"][0]["extents_held"] = "4"
    del bad["totals"]["lost"]
    problems = status_problems({"attached": True, "state_dir": "/s", "status": bad})
    assert "status.status.donors[0].extents_held: '4' is not int" in problems
    assert "status.status.totals: no field 'lost'" in problems


def test_settle_problems_name_what_differs():
    st = status([donor("d1", "a", 4), donor("d2", "b", 0, failed=True),
                 donor("s1", "c", 3, joined="file")], placed=3)
    want = {"members": {"d1": "attach", "d2": "attach", "s1": "file"}, "failed": ["d2"],
            "empty": ["d2"], "file_bad": False, "not_admitted": []}
    assert settle_problems(st, want) == []
    want2 = dict(want, members={"d1": "attach", "d2": "attach", "s1": "added"}, failed=[],
                 file_bad=True, not_admitted=["aw"])
    got = settle_problems(st, want2)
    assert "s1 joined file, the model says added" in got
    assert any(p.startswith("d2 is failed") for p in got)
    assert any("bad line" in p for p in got)
    assert any("announced and not used" in p for p in got)


def test_export_keys_drop_size_token_and_generation():
    assert export_key("vm@68157440") == "vm"
    assert export_key("vm~ab12/dev1:7@68157440") == "vm/dev1"
    assert export_key("vm/dev1") == export_key("vm~t/dev1:3") != export_key("vm/dev2")


def test_the_rebalancer_is_in_half_the_schedules_and_old_replays_keep_it_off():
    drawn = [generate(seed, "ec", 5).setup for seed in range(40)]
    on = sum(s.rebalance for s in drawn)
    assert 10 <= on <= 30, f"rebalance=1 in {on} of 40 schedules"
    for s in drawn:
        assert Setup.parse(s.text()) == s
    # A replay command printed before the rebalancer joined the hunt.
    old = Setup.parse("mode=none members=2 spares=2 tls=0 restartable=0 swap=1 "
                      "swap_restartable=0 parity_log=0 grace=1")
    assert not old.rebalance and "rebalance=0" in old.text()


def test_no_second_name_of_a_donor_still_joining():
    m = Model(Setup("ec", 5, 2, True, False, False, False, True, True))
    m.apply(Op("announce"))
    assert Op("add-alias", "an") not in m.candidates()
    m.apply(Op("settle"))
    assert Op("add-alias", "an") in m.candidates()
    m.apply(Op("file-add", "s1"))
    assert Op("add-alias", "s1") not in m.candidates()
    m.apply(Op("settle"))
    assert Op("add-alias", "s1") in m.candidates()
    m.apply(Op("drain", "d4", "admin"))
    m.apply(Op("undrain", "d4"))
    assert Op("add-alias", "d4") not in m.candidates()
    # Only its second name waits: it may drain again before the settle
    # (the known-bug schedule drains-overlapping does).
    assert Op("drain", "d4", "admin") in m.candidates()
    m.apply(Op("settle"))
    assert Op("add-alias", "d4") in m.candidates()
