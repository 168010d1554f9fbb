"""The nemesis (issue 34): Jepsen's approach for a block device.

A seeded generator (`generator`) draws a schedule, operations and faults
one after another among those the model of the world (`model`) allows
within what the mode promises, against a world (`world`) of donors on lab
hosts and devices driven through `pagerctl`, while verifying workloads
(`workloads`: fio with verify=crc32c, the history writer, memhog through
swap) run on them. The checker (`checker`, and each op's expectation)
asks, over the whole history: every byte read is the last written, no
I/O error where the mode promises none, each op did what it must, and at
settles, at the end and after a re-attach, the invariants hold (each
donor once by identity, every placement on a live member, the bytes a
donor keeps match the placements, `pagerctl status --json` well formed).
A failing schedule is replayed from its seed and shortened (`run`).

    PYTHONPATH=tests /usr/bin/python3 -m netpager_testkit.nemesis --help

is `make nemesis`; tests/nemesis runs a bounded slice in `make test`.
"""
