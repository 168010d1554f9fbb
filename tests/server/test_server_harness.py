"""The harness itself: the job's verifier, cgroup limits, donor control and
cleanup on signals. Donors here run nbdkit's memory plugin, so these tests
do not depend on pager-server being built."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netpager_testkit import (oom_killed, repo_root, run_job_in_cgroup, swaps,
                              wait_for)
from netpager_testkit.attach import mounted, run
from netpager_testkit.donor import nbd_handshake
from netpager_testkit.machine import SWAP, loopback, loopback_block
from netpager_testkit.procs import proc_start_time

MIB = 1 << 20


def test_memhog_verifies_and_catches_a_flipped_bit(memhog):
    ok = subprocess.run([memhog, "8M", "--passes", "3"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "memhog: OK pages=2048 " in ok.stdout
    bad = subprocess.run([memhog, "8M", "--flip", "1234"], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "bad page 1234 (offset 0x4d2060) word 12:" in bad.stderr, bad.stderr


def test_memhog_compressible_pages_verify(memhog):
    """--compressible PCT: the last PCT% of every page zero, checked too."""
    ok = subprocess.run([memhog, "8M", "--passes", "1", "--compressible", "75"], capture_output=True, text=True)
    assert ok.returncode == 0 and "memhog: OK pages=2048 " in ok.stdout, ok.stderr
    bad = subprocess.run([memhog, "8M", "--compressible", "75", "--flip", "1234"], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "bad page 1234 (offset 0x4d2060) word 12:" in bad.stderr, bad.stderr
    assert subprocess.run([memhog, "8M", "--compressible", "91"], capture_output=True).returncode == 2


def test_blkhog_verifies_and_catches_a_flipped_bit(blkhog, tmp_path):
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"\0" * (4 * MIB))
    ok = subprocess.run([blkhog, disk, "4M", "--threads", "8"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "blkhog: OK blocks=1024 threads=8 " in ok.stdout, ok.stdout
    bad = subprocess.run([blkhog, disk, "4M", "--threads", "8", "--flip", "777"],
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert "bad block 777 (offset 0x309060) word 12:" in bad.stderr, bad.stderr
    # --until: random rewrites and checks until the file appears, then all.
    stop = tmp_path / "stop"
    job = subprocess.Popen([blkhog, disk, "4M", "--threads", "8", "--until", stop],
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "blkhog: filled"
    stop.touch()
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0 and "blkhog: OK blocks=1024 " in out, out


def test_memhog_runs_until_told_to_stop(memhog, tmp_path):
    stop = tmp_path / "stop"
    job = subprocess.Popen([memhog, "4M", "--passes", "1", "--until", stop],
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "memhog: round 1 verified"
    assert job.stdout.readline().strip() == "memhog: round 2 verified"
    stop.touch()
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0 and "memhog: OK pages=1024 " in out, out


def test_cgroup_limit_is_enforced(root, teardown, tmp_path, memhog):
    # No swap allowed: a job touching 4x its limit must be OOM-killed, which
    # shows the limit applies to the job (and so forces swap when allowed).
    r = run_job_in_cgroup(teardown, [memhog, "64M"], 16 * MIB, tmp_path / "job.log",
                          timeout=120, swap_limit_bytes=0)
    assert oom_killed(r), r.describe()
    assert r.peak_memory_bytes <= 16 * MIB, r.describe()
    assert not r.cgroup.exists(), f"{r.cgroup} left behind"


def test_loopback_blocks_and_machine_locks_are_each_process_own(teardown):
    """Concurrent test runs never share an address or a machine-wide lock:
    another process gets another loopback block, and waits for a lock this
    one holds (naming the holder)."""
    mine = loopback_block()
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from netpager_testkit import machine; "
             "print(machine.loopback_block()); "
             "machine.SWAP.acquire(timeout=0.5)")
    SWAP.hold(teardown)
    p = subprocess.run([sys.executable, "-c", probe, str(repo_root() / "tests")],
                       capture_output=True, text=True, timeout=60)
    other = int(p.stdout.split()[0])
    assert other != mine and 1 <= other <= 254, (mine, p.stdout)
    assert p.returncode != 0 and f"held by pid {os.getpid()}" in p.stderr, p.stderr
    SWAP.release()
    p = subprocess.run([sys.executable, "-c", probe, str(repo_root() / "tests")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_donor_control(memory_cluster, teardown):
    d1, d2 = memory_cluster.start_donors(2, size="64M")
    assert (d1.addr, d2.addr) == (loopback(2), loopback(3))
    port = d1.port
    d1.kill9()
    assert not d1.alive() and not nbd_handshake(d1.uri())
    d1.restart()
    assert d1.port == port and nbd_handshake(d1.uri())

    def state(d):
        return Path(f"/proc/{d.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    d2.sigstop()
    wait_for(lambda: state(d2) == "T", 10, "donor d2 to stop")
    d2.sigcont()
    wait_for(lambda: state(d2) != "T", 10, "donor d2 to continue")
    assert nbd_handshake(d2.uri())
    pids = [d1.pid, d2.pid]
    d2.sigstop()  # teardown must also end a stopped donor
    teardown.close_or_raise()
    assert all(proc_start_time(p) is None for p in pids)


def _leftovers(info: dict) -> list[str]:
    left = []
    for name, (pid, start) in info["pids"].items():
        if proc_start_time(pid) == start:
            left.append(f"{name} pid {pid}")
    if mounted(info["mountdir"]):
        left.append(f"mount {info['mountdir']}")
    if info["loop"] in swaps():
        left.append(f"swap {info['loop']}")
    backing = Path("/sys/block") / Path(info["loop"]).name / "loop" / "backing_file"
    if backing.exists() and backing.read_text().strip() == info["fuse_file"]:
        left.append(f"loop {info['loop']}")
    if Path(info["cgroup"]).exists():
        left.append(f"cgroup {info['cgroup']}")
    if Path(info["workdir"]).exists():
        left.append(f"directory {info['workdir']}")
    return left


def _salvage(info: dict) -> None:
    """Undoes what a failed child left (its pids are our grandchildren)."""
    if info["loop"] in swaps():
        run(["swapoff", info["loop"]])
    backing = Path("/sys/block") / Path(info["loop"]).name / "loop" / "backing_file"
    if backing.exists() and backing.read_text().strip() == info["fuse_file"]:
        run(["losetup", "-d", info["loop"]])
    if mounted(info["mountdir"]):
        run(["fusermount3", "-u", info["mountdir"]])
    for pid, start in info["pids"].values():
        if proc_start_time(pid) == start:
            os.kill(pid, signal.SIGKILL)
    if Path(info["cgroup"]).exists():
        wait_for(lambda: not Path(info["cgroup"], "cgroup.procs").read_text().strip(), 10,
                 "salvaged cgroup to empty")
        Path(info["cgroup"]).rmdir()
    subprocess.run(["rm", "-rf", "--one-file-system", info["workdir"]])


def _cleanup_child(teardown, tmp_path):
    """Starts cleanup_child.py and waits until it has set everything up:
    the child, what it made (its JSON line) and its log; what it leaves is
    salvaged at teardown."""
    env = dict(os.environ, PYTHONPATH=str(repo_root() / "tests"))
    log = tmp_path / "child.log"
    teardown.add_log(log)
    with open(log, "w") as err:
        child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cleanup_child.py"))],
                                 stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    teardown.add("cleanup child", lambda: (child.poll() is None and child.kill(), child.wait()))
    line = child.stdout.readline()
    assert line, f"child died before setting up; log {log}:\n{log.read_text()}"
    info = json.loads(line)
    teardown.add("salvage what the child left", lambda: _salvage(info))
    return child, info, log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_midway_leaves_nothing_behind(root, teardown, tmp_path, sig):
    child, info, log = _cleanup_child(teardown, tmp_path)
    assert _leftovers(info) == [f"{n} pid {p}" for n, (p, _) in info["pids"].items()] \
        + [f"mount {info['mountdir']}", f"swap {info['loop']}", f"loop {info['loop']}",
           f"cgroup {info['cgroup']}", f"directory {info['workdir']}"]
    child.send_signal(sig)
    rc = child.wait(timeout=120)
    assert rc == -sig, f"child exited {rc}; log {log}:\n{log.read_text()}"
    assert _leftovers(info) == [], log.read_text()
    assert f"{signal.Signals(sig).name}: undoing everything" in log.read_text()


def test_swap_a_killed_run_left_on_a_dead_server_is_swept_by_the_next(root, teardown, tmp_path):
    """SIGKILL runs no teardown: the child's swap area stays on, at the top
    priority, and once its FUSE server is gone too it fails every write the
    next job's pages get. The next run to take the swap lock switches it off,
    detaches its loop device and unmounts the dead mount; while the server
    lives, the area is left alone."""
    from netpager_testkit.machine import sweep_dead_swap
    child, info, _ = _cleanup_child(teardown, tmp_path)
    child.kill()
    child.wait()
    with SWAP.held():
        assert sweep_dead_swap() == []
    assert info["loop"] in swaps(), "a swap area whose server lives was swept"
    nbdfuse, start = info["pids"]["nbdfuse"]
    if proc_start_time(nbdfuse) == start:
        os.kill(nbdfuse, signal.SIGKILL)
    wait_for(lambda: proc_start_time(nbdfuse) != start, 10, "nbdfuse to die")
    assert info["loop"] in swaps() and mounted(info["mountdir"])
    with SWAP.held():
        pass
    assert [x for x in _leftovers(info) if x.split()[0] in ("mount", "swap", "loop")] == []


def test_missing_requirements_fail_under_ci(monkeypatch):
    """A test skipped for want of root or a tool fails when CI=true."""
    from netpager_testkit.ci import skip_or_fail

    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail("needs root")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        skip_or_fail("needs root")


KILLED_CHILD = """
import sys, time
from netpager_testkit import MemoryCgroup, OwnedProcess, Teardown
td = Teardown("killed-child")
cg = MemoryCgroup(td, 64 << 20)
job = OwnedProcess(["sh", "-c", 'echo $$ > "$0" && exec sleep 600', cg.procs_file], sys.argv[1], td, "sleeper")
while str(job.pid) not in cg.procs_file.read_text().split():
    time.sleep(0.05)
print(cg.path, job.pid, flush=True)
time.sleep(600)
"""


def test_a_cgroup_of_a_killed_test_is_swept_by_the_next(root, teardown, tmp_path):
    """SIGKILL runs no teardown: the memory cgroup and its job stay. The next
    cgroup the harness makes sweeps them (its owner, named in the cgroup's
    name, is gone), and leaves a live owner's alone."""
    from netpager_testkit.cgroup import MemoryCgroup, _empty_and_remove
    env = dict(os.environ, PYTHONPATH=str(repo_root() / "tests"))
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(tmp_path / "sleeper.log")],
                             stdout=subprocess.PIPE, text=True, env=env)
    teardown.add("killed child", lambda: (child.poll() is None and child.kill(), child.wait()))
    line = child.stdout.readline()
    assert line, "the child died before making its cgroup"
    path, job = Path(line.split()[0]), int(line.split()[1])
    teardown.add(f"cgroup {path}", lambda: _empty_and_remove(path, 30))
    mine = MemoryCgroup(teardown, 64 << 20)
    assert path.exists(), "a live owner's cgroup was swept"
    child.kill()
    child.wait()
    assert path.exists() and job in [int(p) for p in (path / "cgroup.procs").read_text().split()]
    again = MemoryCgroup(teardown, 64 << 20)
    assert not path.exists(), f"{path} of a killed test stayed"
    assert not Path(f"/proc/{job}").exists() or "Z" in Path(f"/proc/{job}/stat").read_text().split(")")[1][:3]
    assert mine.path.exists() and again.path.exists()
