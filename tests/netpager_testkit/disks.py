"""Disks a lab actually has, emulated for `make bench-apps REGIME=...`: a
file on this machine's disk served by nbdkit's file plugin (the page cache
kept out of the way, cache=none), behind its rate filter (bandwidth) and,
for the HDD class, its delay filter (a seek per request), reached the way netpager's
own swap is: `pagerctl attach` with that nbdkit as its one donor (mode
none, no write-back buffer), a loop device over the FUSE file. Against
netpager on the same path the emulation is the only difference.

  disk-path  no filter: what the path costs over this machine's disk
  ssd        rate 4 Gbit/s (500 MB/s, bursts of 0.1 s, not nbdkit's 2 s:
             a disk does not answer a second's worth of swap at once
             after a pause); its latency is the path's: Debian
             12's nbdkit delays whole milliseconds only, so the SSD's
             ~100 us per 4 KiB read cannot be added, and the path over
             this disk already takes about that
  hdd        delay 8 ms per read and write (a seek), rate 1.2 Gbit/s
             (150 MB/s). Requests are not serialized (noparallel): the
             delay filter would then charge a seek to every request of a
             sequential stream too, and 1 MiB reads would run at half the
             bandwidth; swap's writes are mostly sequential runs, its
             reads one at a time, which this gets right.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .attach import run
from .bench import nbdkit
from .cleanup import Teardown
from .client import PagerClient
from .donor import free_ports

ADDR = "127.0.0.30"

# name: (nbdkit filters and their parameters, the setting: QD1 4 KiB read
# latency in us (None: the path's own), bandwidth in MB/s).
DISKS = {
    "disk-path": ([], None, None),
    "ssd": (["--filter=rate", "rate=4000000000", "burstiness=0.1"], None, 500),
    "hdd": (["--filter=delay", "--filter=rate", "delay-read=8ms", "delay-write=8ms", "rate=1200000000",
             "burstiness=0.1"], 8000, 150),
}


@dataclass
class _Donor:
    """What `pagerctl attach --donor` needs of a donor (client.donor_spec)."""
    addr: str
    port: int
    name: str
    status_addr: None = None


def emulated_disk(td: Teardown, work: Path, kind: str, size: str = "1G") -> str:
    """The block device of emulated disk `kind` (DISKS), undone by `td`."""
    filters, _, _ = DISKS[kind]
    img = work / f"{kind}.img"
    run(["fallocate", "-l", size, img])
    td.add(f"file {img}", lambda: img.unlink(missing_ok=True))
    port = free_ports(ADDR, 1)[0]
    args = ["-i", ADDR, "-p", str(port), *[f for f in filters if f.startswith("--")], "file",
            f"file={img}", "cache=none", *[f for f in filters if not f.startswith("--")]]
    nbdkit(td, work, f"disk-{kind}", args)
    state = work / f"disk-{kind}-client"
    shutil.rmtree(state, ignore_errors=True)
    client = PagerClient(td, state, client_id=f"disk-{kind}")
    client.attach([_Donor(ADDR, port, kind)], mode="none", size=size, frontend="fuse-uring",
                  extra=["--writeback-buffer", "0", "--request-timeout", "120"])
    return client.device
