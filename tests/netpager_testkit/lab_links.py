"""Donors on the lab's hosts behind links of a lab's speed, for `make
bench-apps REGIME=lab`: the hosts are network namespaces on one bridge
(tests/lab/netlab.py), each donor's link a token-bucket filter on both of
its ends at LINKS[link] bits a second, so that a swap-in crosses a veth
pair, a bridge and a rate limit as it would cross a lab's switch. One lab
for the whole run (it holds the lab's lock), created at first use; the
donors and their filters are each set-up's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cleanup import Teardown
from .donor import Donor
from .paths import server_plugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
import netlab  # noqa: E402

LINKS = {"10g": 10_000_000_000, "1g": 1_000_000_000}
# The kernel's tick is at most 4 ms (HZ 250): a bucket must hold a tick's
# bytes or tbf cannot reach its rate.
TICK_S = 0.004
HOSTS = ["d1", "d2", "d3"]


class LabLinks:
    """The lab (under `td`, for the whole run) and donors on its hosts."""

    def __init__(self, td: Teardown, workdir: Path):
        self.td, self.workdir = td, workdir
        self.lab: netlab.Lab | None = None

    def donors(self, td: Teardown, n: int, link: str, tag: str, compress: str | None = None) -> list[Donor]:
        """n donors on lab hosts, each behind a `link` (LINKS) link, with
        compress=`compress` (None: the plugin's default); they and the
        links' filters are undone by `td`."""
        if link not in LINKS or n > len(HOSTS):
            raise ValueError(f"{n} donors behind {link}: at most {len(HOSTS)}, links {', '.join(LINKS)}")
        if self.lab is None:
            self.lab = netlab.Lab(self.td, self.workdir / "lab", HOSTS, ssh=False)
        rate = LINKS[link]
        burst = max(int(rate / 8 * TICK_S), 64 << 10)
        out = []
        for name in list(self.lab.hosts)[:n]:
            netlab.SlowLink(td, self.lab, name, rate=str(rate), burst=str(burst), latency="50ms")
            d = netlab.LabDonor(self.lab[name], td, self.workdir / tag, server_plugin(),
                                # The lab's subnet reaches nothing else: no key.
                                {"size": "2G", "budget": "2G", "insecure": "true", "compress": compress})
            out.append(d.start())
        return out
