"""The fault matrix (issue 13): one fault in one mode per cell, injected
while a verifying workload has I/O in flight on the client's device, never
after a flush or between jobs.

Workloads: `block` is BlockWorkload (netpager_testkit.blockio): two threads writing
and read-verifying generations of a pattern with O_DIRECT on the device
(the loop device over `pagerctl serve`'s FUSE file); `swap` is
tests/jobs/memhog swapping through the device (it verifies every page);
`fs` is a filesystem with a checksum tree (the client crash). The link
faults (a host's link down, a slow link) put their donors on the lab's
hosts (tests/lab: network namespaces on one bridge) and the client on the
machine.

Every cell reads every byte back after the fault and again after recovery
(rebuild finished, drain done, donor back), fails on any corrupt byte, and
in protected modes on any lost byte (except where two failures hit one
unit: then exactly the extents the status names as lost must be the ones
that fail to read); in mode none the blocks that fail must be exactly the
extents `status.totals.lost_extents` names. It appends one row to the
results file (fault_helpers.results_path); `make faults` prints the table
(scripts/faults_table.py). Times are reported, never asserted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from netpager_testkit.client import MIB, Job, busiest, donor_report, run_pagerctl
from fault_helpers import (MemoryHog, Partition, StatusFlood, append_row, extent_size,
                           mem_available)
from netlab import LinkDown, SlowLink
from netpager_testkit import state_word, wait_for
from netpager_testkit.attach import Mount, file_checksums
from netpager_testkit.blockio import BLOCK, PAGE, start_block_workload
from netpager_testkit.paths import pagerctl

MODES = ("none", "mirror", "parity", "disk")
GIB = 1 << 30
SIZE = 64 * MIB
TIMEOUTS = ["--request-timeout", "2", "--connect-timeout", "2"]


def modes(only=MODES):
    """Every mode as a parameter; all but parity belong to the full matrix."""
    return [pytest.param(m, marks=() if m == "parity" else pytest.mark.faults_full, id=m)
            for m in only]


def recovered(s: dict) -> bool:
    t = s["totals"]
    return t["degraded"] == 0 and not t["rebuild"]["active"] and not t["drain"]["active"]


_open_cells: list["Cell"] = []


@pytest.fixture(autouse=True)
def _rows_of_failed_cells(request):
    """A cell that fails (or xfails) before its row still gets one, saying so."""
    _open_cells.clear()
    yield
    rep = getattr(request.node, "rep_call", None)
    for cell in _open_cells:
        if not cell.appended:
            if rep is not None and hasattr(rep, "wasxfail"):
                cell.outcome = f"xfail: {rep.wasxfail}"
            elif rep is not None and rep.failed:
                cell.outcome = "FAIL: " + str(rep.longrepr.reprcrash.message if hasattr(
                    rep.longrepr, "reprcrash") else rep.longrepr).splitlines()[0][:200]
            else:
                cell.outcome = "incomplete"
            cell.row()
    _open_cells.clear()


class Cell:
    """One cell: the client, its workload and the times; `row()` at the end."""

    def __init__(self, fault: str, mode: str, client, workload="block"):
        self.appended = False
        self.outcome = "pass"
        _open_cells.append(self)
        self.fault, self.mode, self.client, self.workload_kind = fault, mode, client, workload
        self.t_inject = self.detect_s = self.rebuild_s = None
        self.verified_bytes = 0
        self.lost_pages = 0
        self.lost_extents: list[int] = []
        self.notes: list[str] = []
        self.w = None

    def attach_block(self, teardown, donors, size=SIZE, extra=()):
        dev = self.client.attach(donors, mode=self.mode, size=f"{size // MIB}M",
                                 extra=TIMEOUTS + list(extra))
        self.ext = extent_size(self.client.state_dir)
        self.w = start_block_workload(teardown, dev, size)
        self.w.fill()
        self.w.start()
        self.w.wait_ops(32)
        return dev

    def inject(self):
        self.t_inject = time.monotonic()

    def inject_on_busiest(self, donors):
        """Marks the fault's start; returns the donor holding most extents, to hit."""
        victim = busiest(self.client, donors)
        self.inject()
        return victim

    def begin(self, teardown, donors, **attach):
        """attach_block, then inject_on_busiest: the block workload runs and
        the donor to hit is returned."""
        self.attach_block(teardown, donors, **attach)
        return self.inject_on_busiest(donors)

    def detected(self, predicate, what: str, timeout: float = 120) -> dict:
        st = self.client.wait_status(predicate, timeout, what)
        self.detect_s = time.monotonic() - self.t_inject
        return st

    def detected_failed(self, donor, timeout: float = 120) -> dict:
        """Waits until the client's status marks `donor` failed."""
        return self.detected(lambda s: donor_report(s, donor.name)["failed"],
                             f"{donor.name} marked failed", timeout)

    def wait_recovered(self, timeout: float = 240) -> dict:
        st = self.client.wait_status(recovered, timeout, "rebuild and drain to finish")
        self.rebuild_s = time.monotonic() - self.t_inject
        return st

    def check(self, when: str, allow_lost: bool) -> dict:
        """Reads every block; asserts nothing corrupt, and lost blocks exactly
        the extents the status names (none unless `allow_lost`)."""
        res = self.w.verify_all()
        st = self.client.status()["status"]["totals"]
        lost_ext = sorted({b * BLOCK // self.ext for b in res["lost"]})
        self.verified_bytes += res["ok"] * BLOCK
        self.lost_pages = len(res["lost"]) * BLOCK // PAGE
        self.lost_extents = st["lost_extents"]
        assert res["corrupt"] == [], (f"{when}: blocks came back with wrong data (not an error): "
                                      f"{[self.w.diagnose(b) for b in res['corrupt'][:5]]}; "
                                      f"in flight: {self.w.corrupt[:10]}")
        assert not self.w.corrupt, f"{when}: reads in flight returned wrong data: {self.w.corrupt[:10]}"
        if not allow_lost:
            assert res["lost"] == [] and st["lost"] == 0, (
                f"{when}: lost blocks {res['lost'][:20]}, status lost extents {st['lost_extents']}")
        else:
            # Every block that fails belongs to an extent the status names as
            # lost, or as holding unfound pages (lost, then placed again by a
            # write: its unwritten pages stay lost), and every extent named
            # lost fails to read.
            named = set(st["lost_extents"]) | set(st.get("unfound_extents", []))
            assert set(lost_ext) <= named and set(st["lost_extents"]) <= set(lost_ext), (
                f"{when}: extents that fail to read {lost_ext}; status lost_extents "
                f"{st['lost_extents']}, unfound_extents {st.get('unfound_extents')}")
        return res

    def row(self, **extra) -> dict:
        w = self.w
        row = {"fault": self.fault, "mode": self.mode, "workload": self.workload_kind,
               "verified_bytes": self.verified_bytes,
               "verified_pages": self.verified_bytes // PAGE,
               "lost_pages": self.lost_pages, "lost_extents": self.lost_extents,
               "detect_s": None if self.detect_s is None else round(self.detect_s, 2),
               "rebuild_s": None if self.rebuild_s is None else round(self.rebuild_s, 2),
               "notes": "; ".join(self.notes), "outcome": self.outcome}
        if w is not None:
            row.update(writes=w.writes, reads=w.reads, write_errors=w.write_errors,
                       read_errors=w.read_errors)
        row.update(extra)
        append_row(row)
        self.appended = True
        return row

    def finish(self, allow_lost_after_fault: bool, allow_lost_after_recovery: bool | None = None,
               recover_timeout: float = 240):
        """Stops the workload, verifies, waits for recovery, verifies again, detaches."""
        self.w.stop()
        self.check("after the fault", allow_lost_after_fault)
        self.wait_recovered(recover_timeout)
        self.check("after recovery", allow_lost_after_fault if allow_lost_after_recovery is None
                   else allow_lost_after_recovery)
        self.w.close()
        row = self.row()
        self.client.detach()
        assert self.client.leftovers() == []
        return row


# --- donor killed (-9), stopped past the request timeout, restarted --------

@pytest.mark.parametrize("mode", modes())
def test_donor_kill9(mode, teardown, donors, client):
    ds = donors(4)
    cell = Cell("donor kill -9", mode, client)
    victim = cell.begin(teardown, ds)
    victim.kill9()
    cell.detected_failed(victim)
    cell.w.wait_ops(32)
    cell.finish(allow_lost_after_fault=(mode == "none"))


@pytest.mark.parametrize("mode", modes(("mirror", "parity", "disk")))
@pytest.mark.faults_full
def test_donor_kill9_while_swapping(mode, teardown, donors, client, memhog, tmp_path):
    """The same fault under tests/jobs/memhog swapping through the device."""
    ds = donors(4)
    cell = Cell("donor kill -9", mode, client, workload="swap")
    job = start_swapping(cell, teardown, ds, memhog, tmp_path, 64 * MIB)
    victim = cell.inject_on_busiest(ds)
    victim.kill9()
    cell.detected_failed(victim)
    finish_swapping(cell, job_after_fault(job))


def start_swapping(cell, teardown, ds, memhog, tmp_path, limit: int, extra=()):
    """Attaches the cell's client as swap and starts memhog touching 3x
    `limit` in a cgroup of `limit`, verifying round after round until
    `job_after_fault` stops it; returns the job once half its limit is out
    in the device."""
    device = cell.client.attach(ds, mode=cell.mode, size="256M", swap=True, extra=TIMEOUTS + list(extra))
    job = Job(teardown, [memhog, str(3 * limit), "--passes", "1"], limit, tmp_path / "memhog.log", device,
              until=True)
    wait_for(lambda: job.swapped() >= limit // 2 or not job.alive(), 300, f"{limit // 2 >> 20} MiB swapped out")
    assert job.alive(), f"the job ended before it swapped enough: {job.proc.log_tail()}"
    return job


def job_after_fault(job) -> str:
    """Once the fault is in: the job verifies every page in one more round
    (through the device as the fault left it), then its final round, and
    ends; returns its output."""
    rounds = job.rounds()
    wait_for(lambda: job.rounds() > rounds or not job.alive(), 600, "a verify round after the fault")
    job.stop()
    return job.finish()


def finish_swapping(cell, out: str) -> None:
    """After the job (its output `out`) passed: waits for recovery, nothing
    lost, the row, detach."""
    summary = next((line for line in reversed(out.splitlines()) if "memhog: OK" in line), "")
    fields = dict(f.split("=", 1) for f in summary.split() if "=" in f)
    pages = int(fields.get("pages", 0))
    cell.verified_bytes = pages * PAGE * int(fields.get("verified", 0))
    st = cell.wait_recovered()
    assert st["totals"]["lost"] == 0, st["totals"]
    cell.lost_extents = st["totals"]["lost_extents"]
    cell.row(verified_pages=pages)
    cell.client.detach()
    assert cell.client.leftovers() == []


@pytest.mark.parametrize("mode", modes())
def test_donor_sigstop_past_request_timeout(mode, teardown, donors, client):
    """SIGSTOP until the client gives the donor up, then SIGCONT: whatever the
    stale donor answers late must not reach the device."""
    ds = donors(4)
    cell = Cell("donor SIGSTOP>timeout, SIGCONT", mode, client)
    victim = cell.begin(teardown, ds)
    victim.sigstop()
    try:
        cell.detected_failed(victim)
        # Still stopped while the workload goes on without it, so that its
        # late answers come after the client gave up on them.
        cell.w.wait_ops(64)
    finally:
        victim.sigcont()
    # The donor answers its old requests now; the workload goes on.
    cell.w.wait_ops(64)
    st = client.status()["status"]
    cell.notes.append(f"after SIGCONT: {victim.name} failed={donor_report(st, victim.name)['failed']}")
    cell.finish(allow_lost_after_fault=(mode == "none"))


@pytest.mark.parametrize("mode", modes())
def test_donor_restart_rejoins(mode, teardown, donors, client):
    ds = donors(4)
    cell = Cell("donor restart + rejoin", mode, client)
    victim = cell.begin(teardown, ds)
    victim.kill9()
    cell.detected_failed(victim)
    victim.start()
    t_back = time.monotonic()
    st = client.wait_status(lambda s: not donor_report(s, victim.name)["failed"], 120,
                            f"{victim.name} re-admitted after its restart")
    cell.notes.append(f"re-admitted {time.monotonic() - t_back:.1f}s after restart")
    cell.w.wait_ops(128)
    cell.w.stop()
    cell.check("after the fault", mode == "none")
    st = cell.wait_recovered()
    held = donor_report(st, victim.name)["extents_held"]
    cell.notes.append(f"extents placed on it afterwards: {held}")
    cell.check("after recovery", mode == "none")
    cell.w.close()
    cell.row(rejoined_extents=held)
    client.detach()
    assert client.leftovers() == []


# --- network partition without RST ---------------------------------------

@pytest.mark.parametrize("mode", modes())
def test_network_partition_drop(mode, teardown, donors, client):
    ds = donors(4)
    cell = Cell("partition (iptables DROP)", mode, client)
    victim = cell.begin(teardown, ds)
    part = Partition(teardown, victim.addr, [victim.port, victim.status_addr[1]])
    try:
        cell.detected_failed(victim)
        cell.w.wait_ops(32)
    finally:
        part.heal()
    # Healed: the donor holds its old pages; it must only come back as new.
    cell.w.wait_ops(32)
    row = cell.finish(allow_lost_after_fault=(mode == "none"))
    assert row


# --- link faults on the lab (tests/lab): donors on hosts in namespaces ----

@pytest.mark.parametrize("mode", modes(("mirror", "parity")))
def test_link_down_while_swapping(mode, teardown, lab_donors, client, memhog, tmp_path):
    """A donor host's link taken down (ip link set ... down) while a job
    swaps: packets vanish, nobody sends a RST; the request timeout finds it."""
    ds = lab_donors(4)
    cell = Cell("link down (lab)", mode, client, workload="swap")
    job = start_swapping(cell, teardown, ds, memhog, tmp_path, 32 * MIB, extra=["--psk", lab_donors.psk])
    victim = cell.inject_on_busiest(ds)
    link = LinkDown(teardown, lab_donors.lab, victim.name)
    cell.detected_failed(victim)
    out = job_after_fault(job)
    link.heal()
    finish_swapping(cell, out)


@pytest.mark.parametrize("mode", modes(("mirror", "parity")))
@pytest.mark.faults_full
def test_slow_link(mode, teardown, lab_donors, client):
    """A donor host's link slowed by a token-bucket filter (4 Mbit/s each way)
    while block I/O runs: requests that outlast the timeout fail the donor
    over; nothing is lost either way."""
    ds = lab_donors(4)
    cell = Cell("slow link (lab, tbf)", mode, client)
    victim = cell.begin(teardown, ds, extra=["--psk", lab_donors.psk])
    slow = SlowLink(teardown, lab_donors.lab, victim.name)
    cell.w.wait_ops(64)
    slow.heal()
    failed = donor_report(client.status()["status"], victim.name)["failed"]
    cell.notes.append(f"{victim.name} {'failed over' if failed else 'kept'} under the slow link")
    cell.finish(allow_lost_after_fault=False)



@pytest.mark.parametrize("mode", modes())
def test_second_failure_during_rebuild(mode, teardown, donors, client):
    ds = donors(5)
    cell = Cell("2nd donor kill during rebuild", mode, client)
    # A larger device, so that the rebuild takes a while.
    cell.attach_block(teardown, ds, size=3 * SIZE)
    first = busiest(client, ds)
    second = busiest(client, ds, exclude=(first.name,))
    cell.inject()
    first.kill9()
    cell.detected_failed(first)
    second.kill9()
    st = client.status()["status"]
    during = st["totals"]["rebuild"]["active"] or st["totals"]["degraded"] > 0
    cell.notes.append(f"second kill {'during' if during else 'after'} the rebuild "
                      f"(rebuild {st['totals']['rebuild']}, degraded {st['totals']['degraded']})")
    client.wait_status(lambda s: donor_report(s, second.name)["failed"], 120, f"{second.name} marked failed")
    cell.w.wait_ops(32)
    # Two failures may take both copies of a unit (mode disk: never): then
    # exactly the extents named lost fail, none else.
    cell.finish(allow_lost_after_fault=(mode != "disk"))


# --- the drain target dies mid-drain -------------------------------------

@pytest.mark.parametrize("mode", modes())
def test_drain_target_dies_mid_drain(mode, teardown, donors, client):
    ds = donors(4)
    cell = Cell("drain target killed mid-drain", mode, client)
    cell.attach_block(teardown, ds, extra=["--epoch", "1"])
    victim = busiest(client, ds)
    host, port = victim.status_addr
    held0 = donor_report(client.status()["status"], victim.name)["extents_held"]
    used0 = victim.status().used_bytes
    run_pagerctl(["donor-drain", f"{host}:{port}"])
    cell.inject()
    # The donor's own count, polled directly: the client's status file is
    # rewritten once a second, too late for a drain of this size.
    wait_for(lambda: victim.status().used_bytes < used0, 120, f"{victim.name} to start draining",
             interval=0.01)
    cell.detect_s = time.monotonic() - cell.t_inject
    left = victim.status().used_bytes
    victim.kill9()
    cell.notes.append(f"killed holding {left >> 10} of {used0 >> 10} KiB")
    client.wait_status(lambda s: donor_report(s, victim.name)["failed"], 120, f"{victim.name} marked failed")
    cell.w.wait_ops(32)
    cell.finish(allow_lost_after_fault=(mode == "none"))


# --- the client dies with writes in flight -------------------------------


@pytest.mark.parametrize("mode", modes())
def test_client_kill9_with_writes_in_flight(mode, teardown, donors, client, tmp_path):
    ds = donors(4)
    cell = Cell("client kill -9 (serve), re-attach", mode, client, workload="fs")
    dev = client.attach(ds, mode=mode, size="128M", extra=TIMEOUTS)
    subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True, capture_output=True)
    mnt = Mount(teardown, dev, tmp_path / "mnt", lazy=True)
    for i in range(24):
        (mnt.where / f"s{i}").write_bytes(os.urandom(1024 * 1024 + i * 4096))
    want = file_checksums(mnt.where, "s*")
    synced = sum((mnt.where / n).stat().st_size for n in want)
    subprocess.run(["sync", "-f", str(mnt.where)], check=True)

    stop, written = threading.Event(), [0]

    def writer():
        i = 0
        while not stop.is_set() and i < 10_000:
            try:
                with open(mnt.where / f"inflight{i % 16}", "wb") as f:
                    f.write(os.urandom(512 * 1024))
                    os.fsync(f.fileno())
                written[0] += 1
            except OSError:
                return
            i += 1

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    wait_for(lambda: written[0] >= 4 or not th.is_alive(), 60, "writes in flight")
    cell.inject()
    client.kill_server()
    stop.set()
    th.join(120)
    assert not th.is_alive(), "a writer hangs after the client died"
    mnt.umount()
    client.detach()
    assert client.leftovers() == []
    dev = client.attach(ds, new_device=False)
    cell.rebuild_s = time.monotonic() - cell.t_inject
    mnt = Mount(teardown, dev, tmp_path / "mnt", lazy=True)
    got = file_checksums(mnt.where, "s*")
    bad = sorted(n for n in want if got.get(n) != want[n])
    cell.verified_bytes = synced - sum((mnt.where / n).stat().st_size for n in bad if (mnt.where / n).exists())
    cell.lost_pages = sum(-(-len(n) // PAGE) for n in bad)
    st = client.device_status()["totals"]
    cell.lost_extents = st["lost_extents"]
    cell.notes.append(f"{written[0]} fsynced writes before the kill")
    cell.row()
    assert bad == [], f"files synced before the kill came back wrong: {bad}"
    assert st["lost"] == 0, st
    mnt.umount()
    client.detach()
    assert client.leftovers() == []


MODE_EXTRA = {"ec": ["--data", "2", "--parity", "2"]}


@pytest.mark.parametrize("mode", modes(("parity", "ec")))
def test_client_kill9_then_donor_kill9(mode, teardown, donors, client):
    """The write hole: the client killed with block writes in flight at home
    (no parity log, so every write updates its group's data and parity
    members by separate requests) may leave stripes whose parity does not
    match their data. The re-attach resyncs the groups the journal says were
    open; then a donor dies and every acknowledged write must still read
    back, the dead donor's extents decoded from the resynced parity. A kill
    seldom lands between a group's data and parity requests (they leave in
    one batch), so this cell shows the crash path end to end (groups open
    at the kill are resynced, nothing is lost); the tear itself is made
    deterministically in pager-client/tests/write_hole.rs."""
    # ec 2+2 needs a fifth donor to rebuild onto.
    ds = donors(5 if mode == "ec" else 4)
    cell = Cell("client kill -9, re-attach, donor kill -9", mode, client)
    cell.attach_block(teardown, ds, extra=["--parity-log", "0"] + MODE_EXTRA.get(mode, []))
    cell.inject()
    client.kill_server()
    cell.w.stop()
    cell.w.close()
    client.detach()
    assert client.leftovers() == []
    dev = client.attach(ds, new_device=False)
    cell.w.reopen(dev)
    totals = client.device_status()["totals"]
    cell.notes.append(f"{totals['groups_resynced']} groups resynced at re-attach; "
                      f"{cell.w.writes} writes acknowledged, {sum(cell.w.write_errors.values())} "
                      "failed by the kill")
    assert totals["groups_resynced"] > 0, (
        f"the client was killed while writing, yet no group was open at re-attach: {totals}")
    cell.check("after the client kill and re-attach", allow_lost=False)
    victim = busiest(client, ds)
    cell.t_inject = time.monotonic()
    victim.kill9()
    # The first read that reaches the dead donor marks it failed.
    res = cell.check("after the donor kill", allow_lost=False)
    cell.detected(lambda s: donor_report(s, victim.name)["failed"], f"{victim.name} marked failed")
    cell.w.start()
    cell.w.wait_ops(32)
    cell.finish(allow_lost_after_fault=False)
    assert res["ok"] == cell.w.nblocks


# --- the serving process of a restartable device dies or is replaced ------

def restartable_swapping(cell, teardown, donors, memhog, tmp_path):
    """A restartable device (attach --restartable, pagerctl(1) RESTARTS) as
    swap under memhog: parity 3 on 4 donors, ec 4+2 on 7. The spare is a
    rebuild target: Debian's nbdkit 1.32 may abort (connections.c,
    raw_send_socket: `sock >= 0`) when the serving process dies with
    requests in flight, and the device must then rebuild, not lose."""
    ds = donors(7 if cell.mode == "ec" else 4)
    return start_swapping(cell, teardown, ds, memhog, tmp_path, 32 * MIB, extra=["--restartable"])


def loop_inflight(device: str) -> int:
    reads, writes = Path(f"/sys/block/{Path(device).name}/inflight").read_text().split()
    return int(reads) + int(writes)


def new_process_serves(cell, old: int) -> None:
    """Waits for the holder's next serving process; notes what it took."""
    wait_for(lambda: cell.client.holder().get("ready_pid") not in (None, old), 60,
             "the next serving process")
    cell.detect_s = time.monotonic() - cell.t_inject


def note_holder(cell) -> None:
    h = cell.client.holder()
    cell.notes.append(f"restarts {h['restarts']} (crashes {h['crashes']}), requests held "
                      f"{h['last_held_ms']} ms, {h['resent_total']} resent")


@pytest.mark.parametrize("mode", modes(("parity", "ec")))
def test_serving_process_kill9_while_swapping(mode, teardown, donors, client, memhog, tmp_path):
    cell = Cell("serving process kill -9 (swap)", mode, client, workload="swap")
    job = restartable_swapping(cell, teardown, donors, memhog, tmp_path)
    old = client.serving_pid()
    wait_for(lambda: loop_inflight(client.device) > 0, 60, "requests in flight", interval=0.001)
    cell.inject()
    client.kill_serving_process()
    new_process_serves(cell, old)
    out = job_after_fault(job)
    note_holder(cell)
    assert client.holder()["crashes"] == 1
    finish_swapping(cell, out)


@pytest.mark.parametrize("mode", modes(("parity", "ec")))
def test_upgrade_under_load(mode, teardown, donors, client, memhog, tmp_path):
    """`pagerctl restart --binary` onto another copy of pagerctl while the
    job swaps: the hand-over, not a crash."""
    cell = Cell("upgrade under load", mode, client, workload="swap")
    job = restartable_swapping(cell, teardown, donors, memhog, tmp_path)
    second = tmp_path / "upgrade" / "pagerctl"
    second.parent.mkdir()
    shutil.copy2(pagerctl(), second)
    old = client.serving_pid()
    cell.inject()
    run_pagerctl(["restart", "--state-dir", client.state_dir, "--binary", second])
    new_process_serves(cell, old)
    assert Path(f"/proc/{client.serving_pid()}/exe").resolve() == second.resolve()
    out = job_after_fault(job)
    note_holder(cell)
    assert client.holder()["crashes"] == 0
    finish_swapping(cell, out)


# --- real memory pressure on a donor's node ------------------------------

@pytest.mark.parametrize("mode", modes())
def test_donor_memory_pressure_drains(mode, teardown, donors, client, tmp_path):
    """Memory hogs (stress-ng, each in a cgroup of its own) take real memory
    until MemAvailable drops below one donor's reserve: it turns draining,
    and the client moves its extents away while the workload runs. The
    hogs grow until the donor says it drains, not by a guess: other
    processes on the machine take and free memory meanwhile."""
    step = 256 * MIB
    avail = mem_available()
    if avail < 3 * GIB:
        pytest.fail(f"MemAvailable {avail >> 20} MiB: too little to take 1 GiB and more away")
    # d1 drains once about 1 GiB more of the machine's memory is taken; the
    # others' reserves are far below.
    reserve = avail - GIB
    ds = donors(4, reserve=[reserve, "64M", "64M", "64M"])
    victim = ds[0]
    cell = Cell("donor memory pressure (real)", mode, client)
    cell.attach_block(teardown, ds, extra=["--epoch", "1"])
    st = client.wait_status(lambda s: donor_report(s, victim.name)["extents_held"] > 0, 30,
                            f"extents on {victim.name}")
    held0 = donor_report(st, victim.name)["extents_held"]
    cell.inject()
    hogs: list[MemoryHog] = []

    def taken_enough() -> bool:
        """The donor drains, or more is taken: while the machine's
        MemAvailable is not well below its reserve (other processes free
        memory too), one more hog, up to half a GiB left to the machine."""
        if state_word(victim.status()) == "draining":
            return True
        if mem_available() > reserve - step // 2:
            assert mem_available() > step + 512 * MIB, (
                f"{len(hogs) * step >> 20} MiB taken and {victim.name} does not drain: "
                f"MemAvailable {mem_available() >> 20} MiB, reserve {reserve >> 20} MiB")
            hogs.append(MemoryHog(teardown, step, tmp_path / f"hog{len(hogs)}.log"))
            wait_for(hogs[-1].holding, 120, f"memory hog {len(hogs)} to hold {step >> 20} MiB")
        return False

    try:
        wait_for(taken_enough, 600, f"{victim.name} to drain as memory is taken")
        cell.detected(lambda s: donor_report(s, victim.name)["state"] == "draining",
                      f"{victim.name} draining under memory pressure")
        st = client.wait_status(lambda s: donor_report(s, victim.name)["extents_held"] == 0, 240,
                                f"extents moved off {victim.name}")
        cell.rebuild_s = time.monotonic() - cell.t_inject
        cell.notes.append(f"{held0} extents moved off while the job ran; {len(hogs) * step >> 20} MiB "
                          f"taken, MemAvailable {mem_available() >> 20} MiB under the hogs, "
                          f"reserve {reserve >> 20} MiB")
    finally:
        for hog in hogs:
            hog.stop()
    cell.w.stop()
    cell.check("after the drain", False)
    assert donor_report(st, victim.name)["extents_held"] == 0
    cell.check("after recovery", False)
    cell.w.close()
    cell.row()
    client.detach()
    assert client.leftovers() == []


# --- two clients contending for the same donors --------------------------

@pytest.mark.parametrize("mode", modes())
def test_two_clients_fill_the_same_donors(mode, teardown, donors, client, second_client, tmp_path):
    """Two clients write at once on three donors too small for both: the one
    with a fallback file spills into it, the one without gets ENOSPC on the
    writes that found no room, and nothing accepted is lost."""
    ds = donors(3, budget="40M")
    cell = Cell("2 clients fill donors (ENOSPC/fallback)", mode, client)
    # Client 2 first: attach refuses donors that are full already (in
    # mirror client 1's fill alone takes them all).
    dev2 = second_client.attach(ds, mode=mode, size="64M", extra=TIMEOUTS)
    # The fallback holds the whole device with its redundancy.
    cell.attach_block(teardown, ds, extra=["--fallback", tmp_path / "fallback.img",
                                           "--fallback-size", "192M"])
    cell.inject()
    w2 = start_block_workload(teardown, dev2, SIZE)
    w2.fill()
    w2.start()
    w2.wait_ops(32)
    cell.w.wait_ops(32)
    w2.stop()
    st1 = client.status()["status"]["totals"]
    cell.w.stop()
    cell.check("client 1 (fallback)", False)
    assert cell.w.write_errors == {}, f"client 1 has a fallback, yet writes failed: {cell.w.write_errors}"
    res2 = w2.verify_all()
    assert res2["corrupt"] == [] and not w2.corrupt, (
        f"client 2: wrong data: {[w2.diagnose(b) for b in res2['corrupt'][:5]]}; "
        f"in flight: {w2.corrupt[:10]}")
    assert res2["lost"] == [], f"client 2: blocks lost: {res2['lost'][:20]}"
    cell.verified_bytes += res2["ok"] * BLOCK
    st2 = second_client.status()["status"]["totals"]
    assert st2["lost"] == 0, st2
    cell.notes.append(f"client 1 on fallback {st1['on_fallback']} members; client 2 write errors "
                      f"{w2.write_errors}")
    w2.close()
    cell.wait_recovered()
    cell.check("after recovery", False)
    cell.w.close()
    cell.row(client2_write_errors=w2.write_errors)
    second_client.detach()
    client.detach()
    assert client.leftovers() == [] and second_client.leftovers() == []


# --- the status endpoints flooded ----------------------------------------

@pytest.mark.parametrize("mode", modes())
def test_status_flood_while_io_runs(mode, teardown, donors, client):
    ds = donors(4)
    cell = Cell("status endpoint flood", mode, client)
    cell.attach_block(teardown, ds)
    flood = StatusFlood([d.status_addr for d in ds])
    teardown.add("status flood", flood.stop)
    cell.inject()
    flood.start()
    answered = asked = 0
    worst = 0.0
    try:
        for _ in range(20):
            for d in ds:
                asked += 1
                t = time.monotonic()
                for _try in range(3):
                    try:
                        d.status_client(timeout=5).query()
                        answered += 1
                        break
                    except (OSError, Exception):  # noqa: BLE001 - counted below
                        continue
                worst = max(worst, time.monotonic() - t)
        cell.w.wait_ops(32)
    finally:
        flood.stop()
    st = client.status()["status"]
    failed = [d["name"] for d in st["donors"] if d["failed"]]
    cell.notes.append(f"{sum(flood.sent)} flood connections; {answered}/{asked} status queries "
                      f"answered (worst {worst:.2f}s); donors marked failed: {failed or 'none'}")
    assert answered == asked, f"the status endpoint stopped answering: {answered}/{asked}"
    assert failed == [], f"the flood made the client give up donors: {failed}"
    cell.finish(allow_lost_after_fault=False)
