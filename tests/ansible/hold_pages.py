"""A job that parks pages in swap and checks them later (not a test itself).

    hold_pages.py SIZE_MIB READY_FILE

Fills SIZE_MIB of memory page by page with a pattern derived from the page
number, writes READY_FILE, then waits. On SIGUSR1 it reads every page back:
exit 0 when all are intact, 1 naming the first damaged page. Run in a memory
cgroup smaller than SIZE_MIB, most of its pages sit in swap while it waits,
so a test can change the swap device's backing (a rolling update of the
donors) in between and then prove that no page was lost.
"""

import signal
import sys
from pathlib import Path

PAGE = 4096


def pattern(i: int) -> bytes:
    return ((i * 0x9E3779B97F4A7C15 + 0x5BD1E995) & (2**64 - 1)).to_bytes(8, "little") * (PAGE // 8)


def main() -> int:
    size_mib, ready = int(sys.argv[1]), Path(sys.argv[2])
    pages = size_mib * 1024 * 1024 // PAGE
    mem = bytearray(pages * PAGE)
    for i in range(pages):
        mem[i * PAGE:(i + 1) * PAGE] = pattern(i)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    ready.write_text(f"{pages}\n")
    signal.sigwait({signal.SIGUSR1})
    for i in range(pages):
        if mem[i * PAGE:(i + 1) * PAGE] != pattern(i):
            print(f"hold_pages: page {i} of {pages} is damaged", flush=True)
            return 1
    print(f"hold_pages: all {pages} pages intact", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
