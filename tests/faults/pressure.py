"""Memory pressure on the whole machine: locks all but KEEP bytes of its
available memory, holds them for at most SECONDS, then exits.

    python3 pressure.py KEEP SECONDS

It is its own watchdog: the pressure ends by the deadline even if the test
that started it can no longer run. It is first in line for the OOM killer
(oom_score_adj 1000), so a machine that truly runs out ends the pressure
rather than the job, and the test sees it die early. Prints `locked N` once
it holds N bytes.
"""

import ctypes
import mmap
import sys
import time

MCL_CURRENT, MCL_FUTURE = 1, 2
CHUNK = 64 << 20


def available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("pressure: no MemAvailable in /proc/meminfo")


def main() -> None:
    keep, seconds = int(sys.argv[1]), float(sys.argv[2])
    deadline = time.monotonic() + seconds
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    libc = ctypes.CDLL(None, use_errno=True)
    # Every mapping from now on is locked and populated at once.
    if libc.mlockall(MCL_CURRENT | MCL_FUTURE) != 0:
        raise SystemExit(f"pressure: mlockall: errno {ctypes.get_errno()}")
    held = []
    while available() - CHUNK > keep and time.monotonic() < deadline:
        held.append(mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    print(f"locked {len(held) * CHUNK}", flush=True)
    while time.monotonic() < deadline:
        time.sleep(0.5)
    print("deadline reached: pressure released", flush=True)


if __name__ == "__main__":
    main()
