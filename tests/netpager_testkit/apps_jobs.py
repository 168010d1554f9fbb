"""The programs `make bench-apps` runs in a memory cgroup, one per command.
Run by path with Debian's python3 (no harness imports: what the job loads
is charged to its cgroup, so it loads only what it needs). Each writes a
JSON result file that `bench_apps` reads and the tests check.

  apps_jobs.py graph VERTICES OUT     PageRank (python3-igraph) on a generated graph
  apps_jobs.py sort MIB OUT [INPUT]   numpy sorts MIB of float64 in place (read from INPUT if given)
  apps_jobs.py sort-input MIB INPUT   writes the sort's array to INPUT (run once, outside the cgroup)
  apps_jobs.py redis KEYS VALUE GETS OUT   redis-server loaded past its limit, random GETs

Each one checks its own answer (ranks sum to 1, the array is sorted and
holds what was generated, every GET answered) and exits non-zero if not.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time


def write(out: str, doc: dict) -> None:
    with open(out, "w") as f:
        json.dump(doc, f)
        f.write("\n")


def graph(vertices: int, out: str) -> None:
    """Barabasi-Albert graph with 8 edges per new vertex, then PageRank
    (PRPACK) twice: the solver walks the edge lists in order and the rank
    vector at random."""
    import igraph

    t0 = time.monotonic()
    g = igraph.Graph.Barabasi(vertices, 8, directed=True)
    t1 = time.monotonic()
    ranks = g.pagerank()
    ranks = g.pagerank()
    t2 = time.monotonic()
    total = sum(ranks)
    if abs(total - 1.0) > 1e-6:
        raise SystemExit(f"graph: ranks sum to {total}, not 1")
    top = sorted(range(len(ranks)), key=ranks.__getitem__, reverse=True)[:5]
    write(out, {"program": "graph", "vertices": vertices, "edges": g.ecount(),
                "generate_s": round(t1 - t0, 3), "pagerank_s": round(t2 - t1, 3),
                "rank_sum": total, "top": top})


def sort_input(mib: int):
    """The sort's array: float64 from a seeded generator."""
    import numpy as np

    return np.random.default_rng(27).random(mib * (1 << 20) // 8)


def sort(mib: int, out: str, path: str | None = None) -> None:
    """float64 from a seeded generator, or read from `path` (written by
    sort-input), sorted in place (numpy's introsort: partitions sweep the
    array from both ends), then checked in chunks so the check itself
    allocates little."""
    import numpy as np

    n = mib * (1 << 20) // 8
    t0 = time.monotonic()
    a = np.fromfile(path, dtype=np.float64, count=n) if path else sort_input(mib)
    if len(a) != n:
        raise SystemExit(f"sort: {path} holds {len(a)} values, not {n}")
    before = float(a.sum())
    t1 = time.monotonic()
    a.sort()
    t2 = time.monotonic()
    chunk = 1 << 20
    for i in range(0, n - 1, chunk):
        part = a[i:i + chunk + 1]
        if not bool(np.all(part[1:] >= part[:-1])):
            raise SystemExit(f"sort: not sorted in [{i}, {i + chunk}]")
    after = float(a.sum())
    if abs(after - before) > 1e-6 * abs(before):
        raise SystemExit(f"sort: sum {after} after sorting, {before} before")
    write(out, {"program": "sort", "elements": n, "input": path, "generate_s": round(t1 - t0, 3),
                "sort_s": round(t2 - t1, 3), "sum": after})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_cli(port: int, *args: str, timeout: float = 600) -> str:
    p = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or p.stdout.startswith("ERR"):
        raise SystemExit(f"redis-cli {' '.join(args)[:80]}: {p.stdout.strip()} {p.stderr.strip()}")
    return p.stdout.strip()


# Values: a random half and a repeated half, so compressing swap (zram,
# zswap) sees data about as compressible as a cache's, not all zeros.
LOAD = """
local keys, size = tonumber(ARGV[1]), tonumber(ARGV[2])
math.randomseed(27)
local pool = {}
for i = 1, 4096 do pool[i] = string.char(math.random(0, 255)) end
local noise = table.concat(pool)
for i = 0, keys - 1 do
  local off = math.random(1, 4096 - size / 2)
  redis.call('SET', string.format('key:%012d', i),
             string.sub(noise, off, off + size / 2 - 1) .. string.rep('v', size - size / 2))
end
return keys
"""


def redis(keys: int, value: int, gets: int, out: str) -> None:
    """redis-server in this cgroup, loaded with KEYS values of VALUE bytes
    (named as redis-benchmark names them), then GETS random GETs from
    redis-benchmark (8 clients)."""
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            p = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
            if p.stdout.strip() == "PONG":
                break
            time.sleep(0.05)
        else:
            raise SystemExit(f"redis-server on port {port} did not answer")
        t0 = time.monotonic()
        loaded = redis_cli(port, "eval", LOAD, "0", str(keys), str(value))
        t1 = time.monotonic()
        if int(loaded) != keys or int(redis_cli(port, "dbsize")) != keys:
            raise SystemExit(f"redis: loaded {loaded} keys, wanted {keys}")
        p = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "get",
                            "-n", str(gets), "-r", str(keys), "-c", "8", "--csv"],
                           capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"redis-benchmark: {p.stderr.strip()}")
        lines = [line for line in p.stdout.splitlines() if line.startswith('"GET"')]
        if not lines:
            raise SystemExit(f"redis-benchmark printed no GET line: {p.stdout!r}")
        cells = [c.strip('"') for c in lines[-1].split(",")]
        head = [c.strip('"') for c in p.stdout.splitlines()[0].split(",")]
        row = dict(zip(head, cells))
        t2 = time.monotonic()
        info = redis_cli(port, "info", "memory")
        used = next(int(x.split(":")[1]) for x in info.splitlines() if x.startswith("used_memory:"))
        write(out, {"program": "redis", "keys": keys, "value_bytes": value, "gets": gets,
                    "load_s": round(t1 - t0, 3), "get_s": round(t2 - t1, 3),
                    "ops": float(row["rps"]), "p50_ms": float(row["p50_latency_ms"]),
                    "p99_ms": float(row["p99_latency_ms"]), "used_memory": used})
        redis_cli(port, "shutdown", "nosave")
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main(argv: list[str]) -> None:
    what, args = argv[0], argv[1:]
    if what == "graph":
        graph(int(args[0]), args[1])
    elif what == "sort":
        sort(int(args[0]), args[1], args[2] if len(args) > 2 else None)
    elif what == "sort-input":
        sort_input(int(args[0])).tofile(args[1])
    elif what == "redis":
        redis(int(args[0]), int(args[1]), int(args[2]), args[3])
    else:
        raise SystemExit(f"apps_jobs: unknown program {what} (graph, sort, sort-input, redis)")



if __name__ == "__main__":
    main(sys.argv[1:])
