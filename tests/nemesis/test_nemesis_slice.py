"""The nemesis's bounded slice in `make test` (issue 34): in one of the
four modes, chosen by the seed (NEMESIS_MODES=all, or a list such as
"none,ec", runs others), one schedule drawn from a seed derived from the
commit under test (so each commit tries another schedule and, likely,
another mode; NEMESIS_SEED overrides), its operations cut
NEMESIS_SLICE_SECONDS (default 30) after its world is up and then the
end checks: every byte read back, the invariants, a detach and re-attach,
every byte again. The ops of bugs still open (model.KNOWN_BUGS) are not
drawn here; test_known_bugs.py holds their regressions. A failure names
its seed and the command that replays it (`make nemesis ...`), and shrinks
nothing: `make nemesis` does."""

from __future__ import annotations

import itertools
import os
import subprocess

import pytest

from netpager_testkit.nemesis.__main__ import client_has_grace, replay_command
from netpager_testkit.nemesis.generator import Features, default_exclude, generate, seed_from
from netpager_testkit.nemesis.model import MODES
from netpager_testkit.paths import repo_root

SLICE_SECONDS = float(os.environ.get("NEMESIS_SLICE_SECONDS") or 30)


# One mode a commit: two were 4 minutes of a suite that must stay under 30;
# the seed picks the mode, and `make nemesis` runs them all.
SLICE_MODES = 1


def slice_modes(seed: int) -> list[str]:
    """The modes this commit's slice runs: NEMESIS_MODES, or SLICE_MODES
    of them picked by the seed."""
    want = os.environ.get("NEMESIS_MODES", "")
    if want == "all":
        return list(MODES)
    if want:
        return [m.strip() for m in want.split(",") if m.strip()]
    choices = list(itertools.combinations(MODES, SLICE_MODES))
    return list(choices[seed % len(choices)])


def slice_seed() -> int:
    if os.environ.get("NEMESIS_SEED"):
        return int(os.environ["NEMESIS_SEED"])
    p = subprocess.run(["git", "-C", str(repo_root()), "rev-parse", "HEAD"], capture_output=True,
                       text=True)
    return seed_from(p.stdout.strip() or "no commit")


@pytest.mark.parametrize("mode", MODES)
def test_a_schedule_in_each_mode(mode, nemesis):
    seed = slice_seed()
    if mode not in slice_modes(seed):
        pytest.skip(f"seed {seed}'s slice runs modes {', '.join(slice_modes(seed))} "
                    "(NEMESIS_MODES=all runs every mode)")
    sched = generate(seed, mode, 200, Features(grace=client_has_grace(),
                                               exclude=default_exclude(known=False)))
    # The ops' time counts from when the world is up: a slow setup (62 s
    # for ec under load) must not leave no time for any op.
    res = nemesis(sched.setup, sched.ops, seed=seed, op_seconds=SLICE_SECONDS)
    replay = replay_command(mode, seed, len(res.ops), known=False, exclude=())
    print(f"seed {seed}: {len(res.ops)} ops, {res.faults} faults, {res.verified_bytes >> 20} MiB "
          f"verified in {res.seconds:.0f}s; replay: {replay}")
    assert res.error is None, f"the run broke (not a finding): {res.error}\nreplay: {replay}"
    assert res.ok, f"{res.explain()}\nreplay from the seed: {replay}"
    assert res.ops and res.verified_bytes > 0
