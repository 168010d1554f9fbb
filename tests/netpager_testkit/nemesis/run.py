"""Running a schedule against the world, and shrinking one that fails.

`run_schedule` sets the world up, runs the ops in order (each checked
against the model's expectation, the workloads' troubles and the
processes after it), then the closing ops (faults healed, a settle) and
the end checks (every byte read, invariants, detach and re-attach, every
byte read again), and undoes everything. A schedule's text form,
`SETUP | OP; OP; ...`, is what replays it exactly
(`make nemesis SCHEDULE='...'`) and what the regression tests hold.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..cleanup import Teardown
from .generator import shrink
from .model import FAULTS, Illegal, Model, Op, Setup
from .world import Failure, World


@dataclass
class RunResult:
    seed: int
    setup: Setup
    ops: list[Op]                      # the ops run (a deadline may cut the schedule)
    faults: int = 0
    verified_bytes: int = 0
    seconds: float = 0.0
    failure: Failure | None = None     # the first finding
    failed_at: int | None = None       # the op it was at; len(ops) for the end checks
    findings: list[tuple[int, Failure]] = field(default_factory=list)
    error: str | None = None           # the run itself broke (not a finding)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.error is None

    def explain(self) -> str:
        """The run as a failed test says it: its findings, error, notes and
        the command that replays it."""
        text = schedule_text(self.setup, self.ops)
        out = [f"seed {self.seed}: {text}"]
        out += [f"  at op {i}: {f}" for i, f in self.findings]
        if self.error:
            out.append(f"  run error: {self.error}")
        out += [f"  note: {n}" for n in self.notes]
        out.append(f"  replay: make nemesis SCHEDULE='{text}'")
        return "\n".join(out)


def schedule_text(setup: Setup, ops: list[Op]) -> str:
    return f"{setup.text()} | " + "; ".join(o.text() for o in ops)


def parse_schedule(text: str) -> tuple[Setup, list[Op]]:
    """`SETUP | OP; OP; ...` back into a setup and its ops (checked legal)."""
    head, _, tail = text.partition("|")
    setup = Setup.parse(head.strip())
    ops = [Op.parse(t.strip()) for t in tail.split(";") if t.strip()]
    Model(setup)  # the setup alone must make a world
    from .model import validate

    validate(setup, ops)
    return setup, ops


def run_schedule(setup: Setup, ops: list[Op], seed: int, memhog: Path, log=print,
                 deadline: float | None = None, workdir: Path | None = None,
                 keep: Path | None = None, op_seconds: float | None = None) -> RunResult:
    """Runs `ops` (stopping early at `deadline`, a time.monotonic(), or
    `op_seconds` after the world is up, however long setting it up took;
    the first op always runs) and the end checks; everything set up is
    undone before it returns. A run that fails leaves its logs in `keep`,
    if given."""
    res = RunResult(seed, setup, [])
    t0 = time.monotonic()
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="netpager-nemesis-"))
    td = Teardown(f"nemesis {setup.mode} seed {seed}")
    if not workdir:
        # Registered first, so undone last: after every process that
        # writes there is gone (a failing run's logs are kept before).
        td.add(f"directory {base}", lambda: shutil.rmtree(base))
    closing = False
    model = Model(setup)
    world = None
    try:
        world = World(td, base / f"{setup.mode}-{seed}", setup, seed, memhog, log)
        world.start()
        world.check(model)
        t_ops = time.monotonic()
        for i, op in enumerate(ops):
            now = time.monotonic()
            if i > 0 and (deadline is not None and now > deadline
                          or op_seconds is not None and now - t_ops > op_seconds):
                break
            expect = model.apply(op)
            log(f"  [{i:3d}] {op.text()}")
            res.ops.append(op)
            res.faults += op.kind in FAULTS or op.kind == "kill-serve"
            try:
                world.do(op, expect, model)
            except Failure as f:
                if f.kind != "expect":
                    raise
                # The op did not do what it must; the run goes on, to see
                # what that costs (a duplicate member corrupting data, say).
                log(f"  FINDING at op {i}: {f}")
                res.findings.append((i, f))
                world.diverged = True
            world.check(model)
        closing = True
        t_end = time.monotonic()
        res.notes.append(f"setup {t_ops - t0:.0f}s, ops {t_end - t_ops:.0f}s")
        for op in model.closing():
            log(f"  [end] {op.text()}")
            world.do(op, model.apply(op), model)
            world.check(model)
        world.finish(model)
    except Failure as f:
        res.findings.append((len(res.ops) if closing else len(res.ops) - 1, f))
        if world is not None:
            res.notes.append(f"status at the failure: {world.describe_status()}")
    except Illegal as e:
        res.error = f"the schedule is not legal: {e}"
    except Exception as e:  # noqa: BLE001 - the run broke; said as such, never a finding
        res.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    finally:
        if res.findings:
            res.failed_at, res.failure = res.findings[0]
        if world is not None:
            res.verified_bytes = world.verified_bytes()
            res.notes += world.notes + (world.swapjob.notes if world.swapjob else [])
            if keep is not None and not res.ok:
                try:
                    world.keep_logs(keep)
                    res.notes.append(f"logs kept in {keep}")
                except OSError as e:
                    res.notes.append(f"keeping the logs in {keep}: {e}")
        errors = td.close()
        if errors:
            res.error = (res.error + "; " if res.error else "") + "cleanup: " + "; ".join(errors)
        res.seconds = time.monotonic() - t0
    return res


def shrink_failure(res: RunResult, memhog: Path, log=print, budget: int = 6,
                   keep: Path | None = None) -> tuple[list[Op], int]:
    """Replays shorter schedules of a failed run (generator.shrink): the
    shortest that still fails with the same kind of failure."""
    kind = res.failure.kind

    def fails(ops: list[Op]):
        log(f"  shrink: replaying {len(ops)} ops: {'; '.join(o.text() for o in ops)}")
        r = run_schedule(res.setup, ops, res.seed, memhog, log=lambda _m: None,
                         keep=keep / f"shrink-{len(ops)}" if keep else None)
        same = r.failure is not None and r.failure.kind == kind
        log(f"  shrink: {'fails (' + str(r.failure)[:300] + ')' if r.failure else 'passes'}"
            f"{'' if r.error is None else ' (run error: ' + r.error.splitlines()[0] + ')'}")
        return min(r.failed_at, len(ops) - 1) if same else None

    return shrink(res.setup, res.ops, min(res.failed_at, len(res.ops) - 1), fails, budget)
