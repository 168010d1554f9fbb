#!/usr/bin/env python3
"""Prints the fault matrix from the rows the cells of tests/faults appended
(bench-results/faults-rows.jsonl, or $NETPAGER_FAULTS_ROWS) and writes it
to bench-results/faults.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

root = Path(os.environ.get("NETPAGER_ROOT", Path(__file__).resolve().parents[1]))
rows_path = Path(os.environ.get("NETPAGER_FAULTS_ROWS", root / "bench-results" / "faults-rows.jsonl"))
out_path = root / "bench-results" / "faults.json"

if not rows_path.exists():
    sys.exit(f"faults_table: no rows at {rows_path} (run the cells first: make faults)")
rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
MODES = ["none", "mirror", "parity", "disk"]
rows.sort(key=lambda r: (r["fault"], r.get("workload", ""), MODES.index(r["mode"]) if r["mode"] in MODES else 9))
out_path.parent.mkdir(parents=True, exist_ok=True)
out_path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


def fmt_s(v):
    return "-" if v is None else f"{v:.1f}"


def lost_ext(r):
    e = r.get("lost_extents") or []
    if not e:
        return "0"
    text = ",".join(map(str, e[:12]))
    return f"{len(e)}: {text}{',...' if len(e) > 12 else ''}"


header = ["fault", "mode", "load", "verified", "lost pages", "lost extents", "detect s", "rebuild s", "outcome"]
table = [header]
for r in rows:
    table.append([r["fault"], r["mode"], r.get("workload", "-"),
                  f"{r['verified_bytes'] / (1 << 20):.0f} MiB", str(r["lost_pages"]), lost_ext(r),
                  fmt_s(r.get("detect_s")), fmt_s(r.get("rebuild_s")), r.get("outcome", "pass")[:60]])
widths = [max(len(row[i]) for row in table) for i in range(len(header))]
for i, row in enumerate(table):
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if i == 0:
        print("  ".join("-" * w for w in widths))
notes = [r for r in rows if r.get("notes")]
if notes:
    print("\nnotes:")
    for r in notes:
        print(f"  {r['fault']} / {r['mode']}: {r['notes']}")
print(f"\n{len(rows)} cells; written to {out_path}")
