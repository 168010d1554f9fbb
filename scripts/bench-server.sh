#!/usr/bin/env bash
# Side-by-side benchmark of the donor plugin against `nbdkit memory`:
# fio 4 KiB random I/O at iodepth 32 through fio's nbd engine, alternating
# the servers (A B C A B C ...) so that drift on the machine hits all
# alike. Each round starts a fresh server and runs, for RUNTIME seconds:
#   randwrite-new  random writes into an empty export (pages get allocated)
#   randread       random reads after a sequential fill of the export
#   randwrite      random rewrites of existing pages
# nbdkit's null plugin (stores nothing) runs alongside as the ceiling: what
# nbdkit, fio and the kernel allow on this machine with no storage at all.
# Prints IOPS per round, then per test the mean IOPS of each server and the
# median of the per-round ratios pager-server / nbdkit-memory.
#
#   scripts/bench-server.sh            # 3 rounds of 10 s per test, 2G export
#   ROUNDS=5 RUNTIME=20 SIZE=4G scripts/bench-server.sh
#
# Binaries: $NETPAGER_TARGET_DIR/libpager_server.so (default target/release).
# Loopback only; every nbdkit started here is stopped by pid on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${NETPAGER_TARGET_DIR:-$ROOT/target/release}"
SO="$TARGET_DIR/libpager_server.so"
ROUNDS="${ROUNDS:-3}"
RUNTIME="${RUNTIME:-10}"
SIZE="${SIZE:-2G}"
PY=/usr/bin/python3
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

[ -f "$SO" ] || { echo "bench-server: $SO not found (cargo build --release -p pager-server)" >&2; exit 1; }
for tool in nbdkit fio nbdinfo; do
  command -v "$tool" >/dev/null || { echo "bench-server: $tool not installed (make deps)" >&2; exit 1; }
done

WORK="$(mktemp -d)"
cd "$WORK" # fio may leave state files in its working directory
SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
cleanup() {
  stop_server
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_server pager|memory|null: nbdkit in the foreground of a background job.
start_server() {
  local port
  port="$(free_port)"
  case "$1" in
    pager) nbdkit -f --exit-with-parent -p "$port" -i 127.0.0.1 "$SO" size="$SIZE" budget=100% \
             >"$WORK/$1.log" 2>&1 & ;;
    memory|null) nbdkit -f --exit-with-parent -p "$port" -i 127.0.0.1 "$1" size="$SIZE" \
             >"$WORK/$1.log" 2>&1 & ;;
  esac
  SERVER_PID=$!
  URI="nbd://127.0.0.1:$port/"
  for _ in $(seq 100); do
    nbdinfo --size "$URI" >/dev/null 2>&1 && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "bench-server: $1 did not start; its log:" >&2
  cat "$WORK/$1.log" >&2
  exit 1
}

# run_fio RW [fio args...]: prints the job's IOPS.
run_fio() {
  local rw="$1"; shift
  fio --name="$rw" --ioengine=nbd --uri="$URI" --rw="$rw" --bs=4k --iodepth=32 \
      --numjobs=1 --size="$SIZE" --output-format=json --output="$WORK/fio.json" "$@" >/dev/null
  "$PY" -c '
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
print(round(job["read"]["iops"] + job["write"]["iops"]))' "$WORK/fio.json"
}

RESULTS="$WORK/results"
printf '%-6s %-8s %14s %12s %12s\n' round server randwrite-new randread randwrite
for round in $(seq "$ROUNDS"); do
  for server in pager memory null; do
    start_server "$server"
    new="$(run_fio randwrite --time_based --runtime="$RUNTIME")"
    # Fill every page so both servers read and rewrite real data.
    run_fio write --bs=1M --iodepth=4 >/dev/null
    rr="$(run_fio randread --time_based --runtime="$RUNTIME")"
    rw="$(run_fio randwrite --time_based --runtime="$RUNTIME")"
    stop_server
    printf '%-6s %-8s %14d %12d %12d\n' "$round" "$server" "$new" "$rr" "$rw"
    printf '%s %s randwrite-new %s\n%s %s randread %s\n%s %s randwrite %s\n' \
      "$round" "$server" "$new" "$round" "$server" "$rr" "$round" "$server" "$rw" >>"$RESULTS"
  done
done

echo
echo "$ROUNDS rounds of ${RUNTIME}s per test, 4 KiB, iodepth 32, export $SIZE, $(nproc) CPUs:"
"$PY" - "$RESULTS" <<'EOF'
import statistics, sys
iops = {}
for line in open(sys.argv[1]):
    rnd, server, test, n = line.split()
    iops.setdefault(test, {}).setdefault(server, {})[rnd] = int(n)
for test in ("randwrite-new", "randread", "randwrite"):
    p, m, n = iops[test]["pager"], iops[test]["memory"], iops[test]["null"]
    ratio = statistics.median(p[r] / m[r] for r in p)
    print(f"{test:14} pager-server {statistics.mean(p.values()):7.0f}  nbdkit-memory {statistics.mean(m.values()):7.0f}"
          f"  (null ceiling {statistics.mean(n.values()):7.0f})  median ratio pager/memory {ratio:.2f}x")
EOF
