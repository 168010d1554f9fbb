"""A job that parks pages in swap and checks them later (not a test itself).

    hold_pages.py SIZE_MIB READY_FILE [--churn PROGRESS_FILE]

Fills SIZE_MIB of memory page by page with a pattern derived from the page
number and the page's generation (a counter per page, 0 at first), writes
READY_FILE, then waits. On SIGUSR1 it reads every page back: exit 0 when
all are intact, 1 naming the first damaged page. Run in a memory cgroup
smaller than SIZE_MIB, most of its pages sit in swap while it waits, so a
test can change the swap device's backing (a rolling update of the donors)
in between and then prove that no page was lost.

With --churn it does not sit idle until SIGUSR1: it goes round its pages,
checking each against its generation and writing the next generation, so
pages keep moving in and out of swap while the backing changes; after every
256 pages it writes how many pages it has rewritten to PROGRESS_FILE. A
damaged page ends it at once (exit 1).
"""

import signal
import sys
from array import array
from pathlib import Path

PAGE = 4096
MASK = 2**64 - 1


def pattern(i: int, gen: int) -> bytes:
    return ((i * 0x9E3779B97F4A7C15 + gen * 0xC2B2AE3D27D4EB4F + 0x5BD1E995) & MASK).to_bytes(
        8, "little") * (PAGE // 8)


def damaged(mem: bytearray, gens: array, i: int) -> bool:
    return mem[i * PAGE:(i + 1) * PAGE] != pattern(i, gens[i])


def churn(mem: bytearray, gens: array, progress: Path) -> int:
    """Rewrites pages round and round until SIGUSR1 is pending; the page
    that came back damaged, or -1."""
    pages, done, i = len(gens), 0, 0
    while signal.SIGUSR1 not in signal.sigpending():
        for _ in range(256):
            if damaged(mem, gens, i):
                return i
            gens[i] += 1
            mem[i * PAGE:(i + 1) * PAGE] = pattern(i, gens[i])
            i = (i + 1) % pages
        done += 256
        # Renamed into place: a reader never sees the file truncated.
        staged = progress.with_name(progress.name + ".new")
        staged.write_text(f"{done}\n")
        staged.replace(progress)
    return -1


def main() -> int:
    size_mib, ready = int(sys.argv[1]), Path(sys.argv[2])
    progress = Path(sys.argv[4]) if sys.argv[3:4] == ["--churn"] else None
    pages = size_mib * 1024 * 1024 // PAGE
    gens = array("Q", [0]) * pages
    mem = bytearray(pages * PAGE)
    for i in range(pages):
        mem[i * PAGE:(i + 1) * PAGE] = pattern(i, 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    ready.write_text(f"{pages}\n")
    if progress is not None:
        bad = churn(mem, gens, progress)
        if bad >= 0:
            print(f"hold_pages: page {bad} of {pages} is damaged (generation {gens[bad]}) "
                  "while the job was rewriting its pages", flush=True)
            return 1
    signal.sigwait({signal.SIGUSR1})
    for i in range(pages):
        if damaged(mem, gens, i):
            print(f"hold_pages: page {i} of {pages} is damaged (generation {gens[i]})", flush=True)
            return 1
    print(f"hold_pages: all {pages} pages intact, {sum(gens)} rewrites", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
