"""The flake hunt (`make test-stress`): the end-to-end tests run again and
again, on a quiet machine and with `stress-ng --cpu 2 --io 1` beside them
at the lowest priority, and every test that failed at least once is
reported with its failure.

    PYTHONPATH=tests /usr/bin/python3 -m netpager_testkit.stress [--count N]
        [--phases quiet,stress] [--rust | --rust-only] [--out DIR] [-- PYTEST ARGUMENTS...]

Each phase runs the suite N times (`--count`, or NETPAGER_TEST_REPEAT,
default 3): pytest with the arguments given (default: the whole of
tests/), each run writing JUnit XML; with `--rust` also `cargo test
--release --workspace --no-fail-fast` (STRESS_CARGO replaces its
arguments). In the stress phase stress-ng runs at nice 19 and the idle
I/O class, in a private mount namespace (its io stressor would otherwise
hold every test's FUSE mount busy), started by pid in a session of its own
and stopped with its workers on every exit path (end, failure, Ctrl-C,
SIGTERM).

DIR (default bench-results/stress) gets each run's log and XML, the
pytest run's temporary directory (`--basetemp`, with every test's logs)
when a test failed in it, `summary.txt`: every test that failed at least once, how often in each
phase, and each distinct failure (its first lines), and `summary.json`
with the same. Exit status 1 when any test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .cleanup import Teardown, install_handlers
from .paths import repo_root
from .procs import OwnedProcess

PROG = "test-stress"
PHASES = ("quiet", "stress")
STRESS_NG = ["stress-ng", "--cpu", "2", "--io", "1", "--timeout", "0", "--quiet"]
# What a failure keeps in the summary: its first lines.
FAILURE_LINES = 12


def start_stress(td: Teardown, log: Path) -> OwnedProcess:
    """stress-ng at nice 19 and the idle I/O class; its workers go with it
    (they share its session) on every exit path.

    It runs in a mount namespace of its own, made private before the tests
    mount anything: its io stressor opens every mounted file system to
    syncfs it and keeps the descriptors, which would hold the tests' FUSE
    mounts busy, so that no unmount of theirs could succeed while it runs
    (seen in the hunt: detaches failing with EBUSY). It still syncs the
    machine's own file systems, which is the load asked for."""
    if shutil.which("stress-ng") is None:
        raise SystemExit(f"{PROG}: stress-ng is not installed (make deps)")
    argv = ["unshare", "--mount", "--propagation", "private",
            "nice", "-n", "19", "ionice", "-c", "3", *STRESS_NG]
    proc = OwnedProcess(argv, log, td, "stress-ng")
    td.add(f"stress-ng's workers (session {proc.pid})", proc.stop_session)
    return proc


def junit_failures(xml: Path) -> dict[str, str]:
    """{test id: failure text} of a pytest JUnit XML file (errors count too)."""
    out: dict[str, str] = {}
    try:
        root = ET.parse(xml).getroot()
    except (ET.ParseError, FileNotFoundError) as e:
        return {f"(pytest run: no usable {xml.name})": str(e)}
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is None:
                continue
            # classname is the module's path from tests/ (pytest's rootdir).
            path = case.get("classname", "").replace(".", "/")
            name = f"tests/{path}.py::{case.get('name')}" if path else case.get("name", "?")
            message = el.get("message") or ""
            out[name] = (f"{kind}: {message}\n{el.text or ''}").strip()
    return out


CARGO_FAILED = re.compile(r"^test (\S+) \.\.\. FAILED$")
# "     Running tests/epochs.rs (target/release/deps/epochs-0123abcd)"
CARGO_BINARY = re.compile(r"^\s+Running .*\((.+)\)$")


def cargo_failures(log: Path) -> dict[str, str]:
    """{binary::test: its captured output} of a `cargo test` log."""
    out: dict[str, str] = {}
    binary = "?"
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in log.read_text(errors="replace").splitlines():
        m = CARGO_BINARY.match(line)
        if m:
            binary = Path(m.group(1)).name.rsplit("-", 1)[0]
            current = None
            continue
        m = CARGO_FAILED.match(line)
        if m:
            out[f"{binary}::{m.group(1)}"] = ""
            continue
        m = re.match(r"^---- (\S+) stdout ----$", line)
        if m:
            current = sections.setdefault(f"{binary}::{m.group(1)}", [])
            continue
        if line.startswith("failures:") or line.startswith("test result:"):
            current = None
        elif current is not None:
            current.append(line)
    for name in out:
        out[name] = "\n".join(sections.get(name, [])).strip() or "(no output captured)"
    return out


def run_logged(td: Teardown, argv: list, log: Path, name: str, env: dict, timeout: float) -> int | str:
    """Runs `argv` as a process of ours (stopped on every exit path, with
    time to undo what it set up); returns its exit status, or "timeout"
    when it ran past `timeout` seconds and was stopped."""
    proc = OwnedProcess(argv, log, td, name, env=env, stop_timeout=600)
    rc = proc.wait(timeout)
    if rc is None:
        proc.stop()
        return "timeout"
    return rc


def drop_basetemp(path: Path) -> bool:
    """Removes a passing run's temporary directory, unless something is
    still mounted in it (a leak, left for the reader); True if removed."""
    with open("/proc/mounts") as f:
        if any(line.split()[1].startswith(f"{path}/") for line in f):
            return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def first_lines(text: str, n: int = FAILURE_LINES) -> str:
    lines = text.splitlines()
    return "\n".join(lines[:n] + ([f"... ({len(lines) - n} more lines)"] if len(lines) > n else []))


def write_summary(out: Path, runs: list[dict], failures: dict[str, list[dict]]) -> str:
    lines = [f"{len(runs)} runs: " + ", ".join(
        f"{r['phase']} {r['run']} {r['what']} {'passed' if r['rc'] == 0 else 'FAILED'} "
        f"({r['seconds']:.0f} s)" for r in runs)]
    if not failures:
        lines.append("no test failed")
    for name, seen in sorted(failures.items()):
        by_phase = {p: sum(1 for f in seen if f["phase"] == p) for p in PHASES}
        of = {p: len({r["run"] for r in runs if r["phase"] == p}) for p in PHASES}
        lines.append("")
        lines.append(f"{name}: failed " + ", ".join(
            f"{n} of {of[p]} {p}" for p, n in by_phase.items() if n))
        distinct: dict[str, list[str]] = {}
        for f in seen:
            distinct.setdefault(first_lines(f["failure"]), []).append(f"{f['phase']} {f['run']}")
        for text, where in distinct.items():
            lines.append(f"  in {', '.join(where)}:")
            lines += [f"    {line}" for line in text.splitlines()]
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    (out / "summary.json").write_text(json.dumps({"runs": runs, "failed": failures}, indent=1) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=int(os.environ.get("NETPAGER_TEST_REPEAT", "3")),
                    help="runs per phase (NETPAGER_TEST_REPEAT, default 3)")
    ap.add_argument("--phases", default="quiet,stress",
                    help="comma-separated, of: quiet, stress (default both, in that order)")
    ap.add_argument("--rust", action="store_true", help="cargo test in each run too")
    ap.add_argument("--rust-only", action="store_true", help="cargo test alone, no pytest")
    ap.add_argument("--timeout", type=float, default=3 * 3600,
                    help="seconds one pytest or cargo run may take (default 3 h)")
    ap.add_argument("--out", type=Path, default=repo_root() / "bench-results" / "stress")
    ap.add_argument("pytest_args", nargs="*",
                    help="what pytest runs, from the repository's root (default: tests)")
    args = ap.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if args.count < 1 or not phases or any(p not in PHASES for p in phases):
        ap.error(f"--count must be at least 1, --phases of {', '.join(PHASES)}")
    install_handlers()
    root = repo_root()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(root)
    env = dict(os.environ, NETPAGER_ROOT=str(root),
               PATH="/usr/sbin:/usr/bin:/sbin:/bin:" + os.environ.get("PATH", ""))
    pytest_args = args.pytest_args or ["tests"]
    cargo_args = os.environ.get("STRESS_CARGO", "--release --workspace").split()
    runs: list[dict] = []
    failures: dict[str, list[dict]] = {}
    for phase in phases:
        with Teardown(f"{PROG} {phase}") as td:
            if phase == "stress":
                start_stress(td, out / "stress-ng.log")
            for n in range(1, args.count + 1):
                tag = f"{phase}-{n}"
                # A temporary directory of its own: concurrent pytest runs
                # clean up each other's in /tmp/pytest-of-USER.
                basetemp = out / f"{tag}-tmp"
                suites = [] if args.rust_only else [
                    ("pytest", [sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider",
                                f"--junitxml={out / f'{tag}.xml'}", f"--basetemp={basetemp}",
                                *pytest_args])]
                if args.rust or args.rust_only:
                    suites.append(("cargo", ["cargo", "test", *cargo_args, "--no-fail-fast"]))
                for what, cmd in suites:
                    log = out / f"{tag}-{what}.log"
                    log.unlink(missing_ok=True)
                    t0 = time.monotonic()
                    print(f"{PROG}: {tag}: {' '.join(map(str, cmd))} (log {log})", flush=True)
                    rc = run_logged(td, cmd, log, f"{what} {tag}", env, args.timeout)
                    found = junit_failures(out / f"{tag}.xml") if what == "pytest" else cargo_failures(log)
                    if rc != 0 and not found:
                        found = {f"({what} run {tag})": f"exit status {rc}; log {log}"}
                    if what == "pytest" and not found and basetemp.exists():
                        drop_basetemp(basetemp)
                    runs.append({"phase": phase, "run": n, "what": what, "rc": rc,
                                 "seconds": round(time.monotonic() - t0, 1), "failed": sorted(found)})
                    for name, text in found.items():
                        failures.setdefault(name, []).append({"phase": phase, "run": n, "failure": text})
                    print(f"{PROG}: {tag} {what}: exit {rc}, {len(found)} failed", flush=True)
                    write_summary(out, runs, failures)
    print(write_summary(out, runs, failures), end="")
    print(f"{PROG}: summary in {out / 'summary.txt'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
