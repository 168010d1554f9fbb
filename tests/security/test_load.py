"""Load: many clients on many donors at once, and connections opened and
closed over and over, without wrong data or unbounded memory.

The short version runs in `make test`; `make soak` (scripts/soak.sh) runs
the same tests longer through the environment:

    NETPAGER_SOAK_OPS     random operations per load client (default 4000)
    NETPAGER_SOAK_CYCLES  connect/disconnect cycles measured (default 200)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from netpager_testkit.nbdio import PAGE, pattern
from netpager_testkit.nbdio import connect

MIB = 1 << 20
CLIENTS = 8
DONORS = 4
BLOCK = 64 * 1024
EXPORT = 8 * MIB
OPS = int(os.environ.get("NETPAGER_SOAK_OPS", "4000"))
CYCLES = int(os.environ.get("NETPAGER_SOAK_CYCLES", "200"))
WARMUP_CYCLES = 100
# What a donor process may use beyond the pages it holds: nbdkit and its
# libraries, the plugin, per-connection threads and request buffers, page
# tables. Measured: about 16 MiB above the pages held (VmHWM 79.5 MiB
# with 64 MiB of pages), and 5.5 MiB for an idle donor.
OVERHEAD = 32 * MIB
# RSS a donor may gain over the measured cycles after the warm-up (malloc
# arenas and thread caches have settled by then); a leak of even one page
# per connection would exceed it over 1000 cycles of `make soak`, and a
# leak of 16 KiB per connection in the 200 cycles of the short run.
CYCLE_GROWTH = 3 * MIB
WORKER = Path(__file__).with_name("io_worker.py")


def proc_status_bytes(pid: int, field: str) -> int:
    """VmRSS, VmHWM, ... of /proc/PID/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in /proc/{pid}/status")


def test_8_clients_on_4_donors_verify_and_stay_bounded(start_donors, tmp_path):
    """Expected: 8 client processes, each with its own 8 MiB export on every
    one of 4 donors, doing random 64 KiB writes and read-verifies at once,
    read back exactly what they wrote (no torn, stale or foreign block), no
    donor's peak RSS (VmHWM) exceeds the pages it can hold for them
    (8 x 8 MiB) plus OVERHEAD, and the pages sit in locked memory
    (mlock=true: VmLck covers them, so they never reach the donor's swap)."""
    donors = start_donors(DONORS)
    procs = []
    for c in range(CLIENTS):
        uris = [d.uri(f"load{c}@{EXPORT}") for d in donors]
        log = open(tmp_path / f"worker{c}.log", "w")
        procs.append((c, log, subprocess.Popen(
            ["/usr/bin/python3", str(WORKER), str(c + 1), str(OPS), str(BLOCK), str(EXPORT), *uris],
            stdout=log, stderr=subprocess.STDOUT)))
    failures, totals = [], {"writes": 0, "reads": 0, "verified_bytes": 0}
    try:
        for c, log, p in procs:
            rc = p.wait(timeout=1800)
            log.close()
            out = (tmp_path / f"worker{c}.log").read_text()
            if rc != 0:
                failures.append(f"client {c} exited {rc}: {out[-2000:]}")
            else:
                for k, v in json.loads(out.strip().splitlines()[-1]).items():
                    totals[k] += v
    finally:
        for _, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    assert not failures, "\n".join(failures)
    assert totals["writes"] > 0 and totals["reads"] > 0, totals
    report = []
    for d in donors:
        hwm = proc_status_bytes(d.pid, "VmHWM")
        used = d.status().used_bytes
        report.append(f"{d.name}: VmHWM {hwm / MIB:.1f} MiB, pages held {used / MIB:.1f} MiB")
        assert used <= CLIENTS * EXPORT
        assert proc_status_bytes(d.pid, "VmLck") >= used, f"{d.name}: pages not locked"
        assert hwm < CLIENTS * EXPORT + OVERHEAD, "; ".join(report)
    print(f"load: {totals}; " + "; ".join(report))


def cycles(uri: str, n: int) -> None:
    """n times: connect, read and check one page, disconnect."""
    for i in range(n):
        with connect(uri) as h:
            got = h.pread(PAGE, 0)
            assert got == pattern("cycles", 0, PAGE), f"cycle {i}: wrong data"


def run_cycles(donor, uri: str) -> tuple[int, int]:
    with connect(uri) as h:
        h.pwrite(pattern("cycles", 0, PAGE), 0)
    cycles(uri, WARMUP_CYCLES)
    before = proc_status_bytes(donor.pid, "VmRSS")
    cycles(uri, CYCLES)
    after = proc_status_bytes(donor.pid, "VmRSS")
    assert donor.alive()
    return before, after


def test_connect_disconnect_cycles_do_not_grow_memory(start_donors, keys):
    """Expected: after 100 warm-up cycles, CYCLES more connect + read-check
    + disconnect cycles, in plain text and over TLS-PSK, each read the right
    page and grow the donor's RSS by less than CYCLE_GROWTH."""
    (plain,) = start_donors(1)
    (tls,) = start_donors(1, tls_psk=keys.lab_psk, psk=keys.lab_psk)
    report = []
    for donor in (plain, tls):
        before, after = run_cycles(donor, donor.uri("cycles@1M"))
        report.append(f"{'tls' if donor.tls_psk else 'plain'}: RSS {before / MIB:.1f} -> "
                      f"{after / MIB:.1f} MiB over {CYCLES} cycles")
        assert after - before < CYCLE_GROWTH, "; ".join(report)
    print("; ".join(report), file=sys.stderr)
