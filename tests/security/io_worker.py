"""One load client: random writes and read-verifies on its export on every
donor, run as its own process (Debian's python3, python3-libnbd).

    python3 io_worker.py SEED OPS BLOCK EXPORT_SIZE URI...

Every block written carries (seed, donor, offset, generation), so a read
that returns another client's, another donor's, another place's or a stale
write's bytes is caught. Prints one JSON line of counts; exits 1 on the
first mismatch, naming it.
"""

from __future__ import annotations

import json
import random
import struct
import sys

import nbd


def block(seed: int, donor: int, offset: int, gen: int, size: int) -> bytes:
    head = struct.pack("<QQQQ", seed, donor, offset, gen)
    return (head * (size // len(head) + 1))[:size]


def main() -> int:
    seed, ops, size, export_size = (int(a) for a in sys.argv[1:5])
    uris = sys.argv[5:]
    rng = random.Random(seed)
    handles = []
    for uri in uris:
        h = nbd.NBD()
        h.set_uri_allow_local_file(True)
        h.connect_uri(uri)
        handles.append(h)
    slots = export_size // size
    written: list[dict[int, int]] = [{} for _ in uris]
    counts = {"writes": 0, "reads": 0, "verified_bytes": 0}
    for i in range(ops):
        d = rng.randrange(len(uris))
        slot = rng.randrange(slots)
        off = slot * size
        if rng.random() < 0.5 or not written[d]:
            gen = i + 1
            handles[d].pwrite(block(seed, d, off, gen, size), off)
            written[d][off] = gen
            counts["writes"] += 1
        else:
            off = rng.choice(list(written[d]))
            got = handles[d].pread(size, off)
            want = block(seed, d, off, written[d][off], size)
            if got != want:
                print(f"MISMATCH seed {seed} donor {d} ({uris[d]}) offset {off}: expected "
                      f"generation {written[d][off]}, got header {got[:32].hex()}", flush=True)
                return 1
            counts["reads"] += 1
    # Every block once more at the end: nothing written was lost.
    for d, blocks in enumerate(written):
        for off, gen in blocks.items():
            if handles[d].pread(size, off) != block(seed, d, off, gen, size):
                print(f"MISMATCH (final pass) seed {seed} donor {d} offset {off}", flush=True)
                return 1
            counts["verified_bytes"] += size
    for h in handles:
        h.shutdown()
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
