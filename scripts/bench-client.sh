#!/usr/bin/env bash
# Benchmarks of the netpager client, each printing a table and its ratios:
#
#   1. donors: fio 4 KiB random and 1 MiB sequential I/O through the client
#      (fio's nbd engine on the client's unix socket) with 1, 2 and 4 donors,
#      each behind nbdkit's rate filter emulating a 1 Gbit/s link
#      (rate=1G: the filter counts bits per second). Target: 4 donors >= 3.5x
#      one donor.
#   2. modes: none / mirror / parity / parity without its log / disk / ec
#      4+2 side by side on 4 such donors (ec on 6, the fewest it takes,
#      compared with none on 6 as well), as ratios to none, with the donor
#      memory held per byte fio wrote. Targets: parity reads >= 0.95x,
#      writes >= 0.6x; ec reads >= 0.95x, writes >= 0.5x, memory 1.5x.
#   3. swap: a job touching 3x its memory cgroup limit swapping through the
#      client (3 donors, parity; SWAP_MODES="parity ec" adds ec 4+2 on 6
#      donors, with its ratio to parity, target <= 1.1x) on each front end (FRONTENDS: fuse-uring,
#      fuse, nbd), through one `nbdkit memory` over TCP (a remote memory
#      server, as a donor is) attached through nbdfuse + a loop device,
#      through the same FUSE front end answering from memory (the floor of
#      the client's path), through zram and through a swap file on local disk,
#      alternating A B C D A B C D ... Completion times and ratios to nbdkit
#      memory. The same nbdkit memory is also reached through a local
#      nbdkit proxy on a unix socket (its nbd plugin), the path the client
#      takes to a donor: that prices the extra hop apart from the client.
#      Two settings (SWAP_SETTINGS): "links" puts each donor and the one
#      nbdkit memory behind its own emulated $LINK_RATE link, as remote
#      memory is in a lab; "loopback" runs all of them at loopback speed,
#      which shows whether bandwidth binds at all. Targets: client on
#      fuse-uring <= 1.0x nbdkit memory and <= 1.0x the swap file.
#   4. latency: QD1 4 KiB random reads and writes (fio, psync, direct=1)
#      through the client's loop device (mode none, one donor, each front
#      end) against fio's nbd engine straight to that donor over TCP,
#      alternating. Target: fuse-uring <= 1.2x direct.
#
#   scripts/bench-client.sh                 # all four
#   scripts/bench-client.sh donors modes    # some of them
#   RUNTIME=10 ROUNDS=3 LIMIT=128M scripts/bench-client.sh swap
#   SWAP_MODE=none scripts/bench-client.sh swap   # the client in another mode
#   SWAP_MODES="parity ec" scripts/bench-client.sh swap  # modes side by side
#   SWAP_SETTINGS=links scripts/bench-client.sh swap
#   FRONTENDS="fuse-uring@0 fuse-uring@50" scripts/bench-client.sh latency  # spin or not
#   MODES=parity scripts/bench-client.sh modes   # none and parity only
#   FIO_ROUNDS=3 scripts/bench-client.sh modes   # best of 3 fio runs each
#
# Run as root (swapon, losetup, FUSE, cgroups). Binaries come from
# $NETPAGER_TARGET_DIR (default target/release). Loopback only. Each
# benchmark runs in its own subshell with its own undo stack and traps:
# every process it started is stopped by pid, every attach detached, every
# swap area, loop device, zram device and cgroup undone, on every exit.
set -euo pipefail
shopt -s inherit_errexit

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${NETPAGER_TARGET_DIR:-$ROOT/target/release}"
PAGERCTL="$TARGET_DIR/pagerctl"
SERVER_SO="$TARGET_DIR/libpager_server.so"
CLIENT_SO="$TARGET_DIR/libpager_client_plugin.so"
FUSE_MEMORY="$TARGET_DIR/examples/fuse-memory"
MEMHOG="$ROOT/tests/jobs/memhog"
RUNTIME="${RUNTIME:-8}"      # seconds per fio run
FIO_ROUNDS="${FIO_ROUNDS:-2}" # fio runs per measurement, the best kept
ROUNDS="${ROUNDS:-2}"        # rounds of the swap benchmark
LIMIT="${LIMIT:-128M}"       # the swap job's memory limit (it touches 3x)
LINK_RATE="${LINK_RATE:-1G}" # emulated link per donor, bits per second
FIO_SIZE="${FIO_SIZE:-512M}" # region fio works on
SWAP_MODE="${SWAP_MODE:-parity}" # the client's mode in the swap benchmark
SWAP_MODES="${SWAP_MODES:-$SWAP_MODE}" # or several, side by side (ec on 6 donors)
SWAP_SETTINGS="${SWAP_SETTINGS:-links loopback}" # see 3. above
MODES="${MODES:-mirror parity parity-nolog disk ec}" # modes compared with none in 2.
FRONTENDS="${FRONTENDS:-fuse-uring fuse nbd}" # the client's front ends in 3. and 4. (F@US: with --spin-us US)
PY=/usr/bin/python3
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

die() { echo "bench-client: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (swapon, losetup, FUSE, cgroups)"
for f in "$PAGERCTL" "$SERVER_SO" "$CLIENT_SO" "$FUSE_MEMORY"; do
  [ -e "$f" ] || die "$f not found (make build, or set NETPAGER_TARGET_DIR)"
done
[ -x "$MEMHOG" ] || make -s -C "$ROOT/tests/jobs" memhog
for tool in nbdkit nbdfuse fio losetup mkswap swapon zramctl; do
  command -v "$tool" >/dev/null || die "$tool not installed (make deps)"
done

WORK="$(mktemp -d /tmp/np-bench.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK" # fio may leave state files in its working directory

# ---------------------------------------------------------------- undo stack
# Inside a benchmark's subshell: push_undo CMD registers CMD; undo_all runs
# them newest first, carrying on past failures (and reporting them).
UNDO=()
push_undo() { UNDO+=("$1"); }
undo_all() {
  local i
  for ((i = ${#UNDO[@]} - 1; i >= 0; i--)); do
    eval "${UNDO[i]}" || echo "bench-client: undo failed: ${UNDO[i]}" >&2
  done
  UNDO=()
}
# Runs one benchmark function in a subshell with its own traps.
bench() {
  (
    trap undo_all EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    "$@"
  )
}

stop_pid() { # stop_pid PID: a background job of this shell
  kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# fuse_stop MOUNTPOINT PID: unmounts nbdfuse (retrying while the kernel
# still holds the file), then reaps it; SIGTERM only if it never exits.
fuse_stop() {
  local i
  for i in $(seq 100); do
    grep -q " $1 fuse" /proc/mounts || break
    fusermount3 -u "$1" 2>/dev/null && break
    sleep 0.1
  done
  for i in $(seq 100); do
    kill -0 "$2" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$2" 2>/dev/null; then
    kill -TERM "$2"
    fusermount3 -u "$1" 2>/dev/null || true
  fi
  wait "$2" 2>/dev/null || true
}

free_port() {
  "$PY" -c 'import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' "$1"
}

wait_file() { # wait_file PATH PID WHAT: until PATH exists, while PID lives
  for _ in $(seq 300); do
    [ -e "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || break
    sleep 0.1
  done
  die "$3 did not start (waiting for $1)"
}

# ------------------------------------------------------------------- donors
# start_donors N RATE: N pager-server donors on 127.0.0.2.., RATE bits/s
# each ("" for none). Sets DONORS (pagerctl --donor arguments).
start_donors() {
  local n="$1" rate="$2" i addr port sport pid filter
  DONORS=()
  for ((i = 1; i <= n; i++)); do
    addr="127.0.0.$((i + 1))"
    port="$(free_port "$addr")"
    sport="$(free_port "$addr")"
    filter=()
    [ -n "$rate" ] && filter=(--filter=rate)
    nbdkit -f -p "$port" -i "$addr" --pidfile "$WORK/d$i.pid" "${filter[@]}" "$SERVER_SO" \
      size=2G budget=2G reserve=0 busy-load=1000 node-id="d$i" status="$addr:$sport" \
      ${rate:+rate="$rate"} >"$WORK/d$i.log" 2>&1 &
    pid=$!
    push_undo "stop_pid $pid; rm -f $WORK/d$i.pid"
    wait_file "$WORK/d$i.pid" "$pid" "donor d$i (log $WORK/d$i.log)"
    DONORS+=(--donor "$addr:$port,status=$addr:$sport,name=d$i")
  done
}

# attach_client STATE MODE SIZE [pagerctl options...]: sets DEVICE.
attach_client() {
  local state="$1" mode="$2" size="$3"
  shift 3
  rm -rf "$state"
  push_undo "[ ! -e $state/attach.json ] || '$PAGERCTL' detach --state-dir $state >/dev/null 2>>$WORK/pagerctl.log"
  "$PAGERCTL" attach --state-dir "$state" --client-id bench --mode "$mode" --size "$size" \
    "${DONORS[@]}" "$@" >"$WORK/attach.out" 2>>"$WORK/pagerctl.log" ||
    die "pagerctl attach failed: $(tail -5 "$WORK/pagerctl.log")"
  DEVICE="$(tail -1 "$WORK/attach.out")"
}

# mode_args MODE [WIDTH]: the attach mode (sets MODE_WORD) and what attach
# needs besides (sets MODE_ARGS). MODE parity-nolog is parity with its log
# off.
mode_args() {
  MODE_WORD="${1%-nolog}"
  MODE_ARGS=()
  case "$1" in
    disk) MODE_ARGS=(--disk-file "$WORK/writethrough.img") ;;
    parity-nolog) MODE_ARGS=(--parity-log 0) ;;
    ec) MODE_ARGS=(--data 4 --parity 2) ;;
  esac
  case "$1" in
    parity*) [ -z "${2:-}" ] || MODE_ARGS+=(--parity-width "$2") ;;
  esac
}

# ---------------------------------------------------------------------- fio
# fio_run URI RW BS IODEPTH [extra...]: prints "IOPS MB/s".
fio_run() {
  local uri="$1" rw="$2" bs="$3" depth="$4"
  shift 4
  fio --name="$rw" --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth="$depth" \
    --numjobs=1 --size="$FIO_SIZE" --output-format=json --output="$WORK/fio.json" "$@" >/dev/null
  "$PY" -c '
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]
bw = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
print(f"{iops:.0f} {bw:.1f}")' "$WORK/fio.json"
}

# fio_best URI RW BS IODEPTH [extra...]: fio_run FIO_ROUNDS times in a
# row, prints the best. Noise on a shared machine only ever slows a run
# down, and the first pass over a fresh device pays one-time costs (donor
# memory touched for the first time, the parity log's units placed) that a
# long-lived swap device does not.
fio_best() {
  local r out best=""
  for ((r = 1; r <= FIO_ROUNDS; r++)); do
    out="$(fio_run "$@")"
    if [ -z "$best" ] || ((${out% *} > ${best% *})); then
      best="$out"
    fi
  done
  echo "$best"
}

# fio_suite URI: fills the region, then prints
# "rr_iops rw_iops seqr_MBps seqw_MBps". Every measured run starts with a
# 3 s ramp that fio leaves out: the rate filter lets 2 s worth of traffic
# through at once after idling (burstiness=2), which would inflate short
# runs.
fio_suite() {
  local uri="$1" rr rw sr sw timed=(--time_based --runtime="$RUNTIME" --ramp_time=3)
  # Fill first, unmeasured, so that reads hit placed extents.
  fio_run "$uri" write 1M 8 >/dev/null
  sw="$(fio_best "$uri" write 1M 8 "${timed[@]}")"
  sr="$(fio_best "$uri" read 1M 8 "${timed[@]}")"
  rr="$(fio_best "$uri" randread 4k 32 "${timed[@]}")"
  rw="$(fio_best "$uri" randwrite 4k 32 "${timed[@]}")"
  echo "${rr% *} ${rw% *} ${sr#* } ${sw#* }"
}

client_uri() { echo "nbd+unix:///bench?socket=$1/nbd.sock"; }

ratio() { "$PY" -c 'import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); print(f"{a / b:.2f}x" if b else "-")' "$1" "$2"; }

# ------------------------------------------------------------ 1. donors
bench_donors() {
  echo "== 1. Scaling with donors: fio through the client, mode none, each donor at $LINK_RATE bit/s"
  declare -A R
  local n
  for n in 1 2 4; do
    start_donors "$n" "$LINK_RATE"
    # fio's nbd engine needs the client's NBD socket: the nbd front end.
    attach_client "$WORK/c-donors$n" none 1G --frontend nbd
    R[$n]="$(fio_suite "$(client_uri "$WORK/c-donors$n")")"
    undo_all
  done
  printf '%-8s %14s %14s %14s %14s\n' donors "4K randread" "4K randwrite" "1M read" "1M write"
  printf '%-8s %14s %14s %14s %14s\n' "" IOPS IOPS MB/s MB/s
  for n in 1 2 4; do
    read -r a b c d <<<"${R[$n]}"
    printf '%-8s %14s %14s %14s %14s\n' "$n" "$a" "$b" "$c" "$d"
  done
  local one=(${R[1]}) two=(${R[2]}) four=(${R[4]}) k
  printf '%-8s' "2 vs 1"; for k in 0 1 2 3; do printf ' %14s' "$(ratio "${two[k]}" "${one[k]}")"; done; echo
  printf '%-8s' "4 vs 1"; for k in 0 1 2 3; do printf ' %14s' "$(ratio "${four[k]}" "${one[k]}")"; done; echo
  echo "(target: 4 donors >= 3.5x one donor)"
  echo
}

# ------------------------------------------------------------- 2. modes
bench_modes() {
  echo "== 2. Modes side by side: 4 donors at $LINK_RATE bit/s each, fio through the client"
  declare -A R MEM
  local mode n modes=(none $MODES)
  # ec 4+2 needs 6 donors; none on 6 is its baseline (more links, more
  # bandwidth: comparing with none on 4 would flatter it).
  [[ " $MODES " != *" ec "* ]] || modes=(none none@6 $MODES)
  for mode in "${modes[@]}"; do
    n="$(mode_donors "$mode")"
    start_donors "$n" "$LINK_RATE"
    mode_args "${mode%@*}"
    attach_client "$WORK/c-$mode" "$MODE_WORD" 1G "${MODE_ARGS[@]}" --frontend nbd
    R[$mode]="$(fio_suite "$(client_uri "$WORK/c-$mode")")"
    MEM[$mode]="$(memory_per_byte "$WORK/c-$mode")"
    undo_all
    rm -f "$WORK/writethrough.img"
  done
  printf '%-17s %7s %14s %14s %14s %14s %9s\n' mode donors "4K randread" "4K randwrite" "1M read" "1M write" memory
  printf '%-17s %7s %14s %14s %14s %14s %9s\n' "" "" IOPS IOPS MB/s MB/s "all/home"
  for mode in "${modes[@]}"; do
    read -r a b c d <<<"${R[$mode]}"
    printf '%-17s %7s %14s %14s %14s %14s %9s\n' "$mode" "$(mode_donors "$mode")" "$a" "$b" "$c" "$d" "${MEM[$mode]}"
  done
  local base m k
  for mode in "${modes[@]:1}"; do
    [ "$mode" != none@6 ] || continue
    base=none
    [ "$(mode_donors "$mode")" != 6 ] || base=none@6
    base=(${R[$base]})
    m=(${R[$mode]})
    printf '%-17s' "$mode/none"; for k in 0 1 2 3; do printf ' %14s' "$(ratio "${m[k]}" "${base[k]}")"; done; echo
  done
  echo "(targets: parity reads >= 0.95x none, parity writes >= 0.6x none;"
  echo " ec reads >= 0.95x none@6, ec writes >= 0.5x none@6, ec memory 1.5x per byte at home;"
  echo " memory: donor bytes held per byte written, all / without the parity log)"
  echo
}

# mode_donors MODE: donors MODE runs on in 2.
mode_donors() {
  case "$1" in
    ec | none@6) echo 6 ;;
    *) echo 4 ;;
  esac
}

# memory_per_byte STATE: donor memory the device holds (extent slots on
# donors) per byte fio wrote ($FIO_SIZE): all of it, and without the parity
# log's units (which random writes fill up to --parity-log, the device's
# size by default), as "ALL/HOME".
memory_per_byte() {
  "$PAGERCTL" status --state-dir "$1" --json | "$PY" -c '
import json, sys
s = json.load(sys.stdin)["status"]
held = sum(d["extents_held"] for d in s["donors"]) * s["extent_bytes"]
log = s["totals"]["parity_log_used_bytes"] * s["memory_overhead"]
units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
size = sys.argv[1]
wrote = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
print(f"{held / wrote:.2f}/{(held - log) / wrote:.2f}")' "$FIO_SIZE"
}

# -------------------------------------------------------------- 3. swap
CG=""
cgroup_make() { # cgroup_make LIMIT: sets CG to a fresh memory cgroup
  local name="netpager-bench-$$-$RANDOM"
  if [ -e /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
    CG="/sys/fs/cgroup/memory/$name"
    mkdir "$CG"
    echo "$1" >"$CG/memory.limit_in_bytes"
  else
    grep -qw memory /sys/fs/cgroup/cgroup.subtree_control ||
      echo +memory >/sys/fs/cgroup/cgroup.subtree_control
    CG="/sys/fs/cgroup/$name"
    mkdir "$CG"
    echo "$1" >"$CG/memory.max"
  fi
  push_undo "cgroup_remove $CG"
}
cgroup_remove() {
  local pid
  [ -d "$1" ] || return 0
  for pid in $(cat "$1/cgroup.procs"); do kill -KILL "$pid" 2>/dev/null || true; done
  for _ in $(seq 100); do rmdir "$1" 2>/dev/null && return 0; sleep 0.1; done
  rmdir "$1"
}

# swap_on DEVICE: mkswap + swapon at the top priority, undone by swapoff.
swap_on() {
  mkswap "$1" >/dev/null
  swapon --priority 32767 "$1"
  push_undo "swapoff $1"
}

# frontend_args F: pagerctl's options for a FRONTENDS entry, FRONTEND or
# FRONTEND@US (US: --spin-us, the client's spin before sleeping on a reply).
frontend_args() {
  case "$1" in
    *@*) echo "--frontend ${1%@*} --spin-us ${1#*@}" ;;
    *) echo "--frontend $1" ;;
  esac
}

# Targets: each sets SWAPDEV, pushing its own undo. The remote ones put
# each server behind a link of SWAP_RATE bits/s ("" for loopback speed).
SWAP_RATE=""
FRONTEND=fuse-uring
CLIENT_MODE=parity
# swap_donors MODE: donors the swap job's client uses (ec 4+2 needs 6).
swap_donors() { if [ "$1" = ec ]; then echo 6; else echo 3; fi; }
target_client() {
  start_donors "$(swap_donors "$CLIENT_MODE")" "$SWAP_RATE"
  mode_args "$CLIENT_MODE" 3
  attach_client "$WORK/c-swap" "$MODE_WORD" 1G "${MODE_ARGS[@]}" $(frontend_args "$FRONTEND") \
    --swap --priority 32767
  SWAPDEV="$DEVICE"
}
# memory_server: one `nbdkit memory` over TCP on a loopback address of its
# own, as a remote memory server would be; sets MEM_HOST and MEM_PORT.
memory_server() {
  local pid filter=()
  MEM_HOST=127.0.0.9
  MEM_PORT="$(free_port "$MEM_HOST")"
  [ -n "$SWAP_RATE" ] && filter=(--filter=rate)
  nbdkit -f -i "$MEM_HOST" -p "$MEM_PORT" --pidfile "$WORK/mem.pid" "${filter[@]}" memory size=1G \
    ${SWAP_RATE:+rate="$SWAP_RATE"} >"$WORK/mem.log" 2>&1 &
  pid=$!
  push_undo "stop_pid $pid; rm -f $WORK/mem.pid"
  wait_file "$WORK/mem.pid" "$pid" "nbdkit memory"
}

# fuse_swap URI: the steps pagerctl takes, for a server that is not the
# client: nbdfuse file, loop device with direct I/O and the same queue
# depth, swap on it.
fuse_swap() {
  local pid
  mkdir -p "$WORK/memfuse"
  rm -f "$WORK/memfuse.pid"
  nbdfuse --pidfile "$WORK/memfuse.pid" "$WORK/memfuse/device" "$1" >"$WORK/memfuse.log" 2>&1 &
  pid=$!
  push_undo "fuse_stop $WORK/memfuse $pid; rm -f $WORK/memfuse.pid"
  wait_file "$WORK/memfuse.pid" "$pid" "nbdfuse"
  wait_file "$WORK/memfuse/device" "$pid" "nbdfuse's file"
  loop_swap "$WORK/memfuse/device"
}

# loop_swap FILE: what pagerctl does over its FUSE file: a loop device with
# direct I/O and the same queue depth, swap on it. Sets SWAPDEV.
loop_swap() {
  local lo
  lo="$(losetup --find --show --direct-io=on "$1")"
  push_undo "losetup --detach $lo; while [ -e /sys/block/${lo#/dev/}/loop/backing_file ]; do sleep 0.1; done"
  local q="/sys/block/${lo#/dev/}/queue/nr_requests" depth
  depth="$(cat "$q")"
  echo 16 >"$q"
  push_undo "echo $depth > $q"
  swap_on "$lo"
  SWAPDEV="$lo"
}

target_memory() {
  memory_server
  fuse_swap "nbd://$MEM_HOST:$MEM_PORT"
}

# The same nbdkit memory reached the way the client reaches its donors:
# through a local nbdkit on a unix socket (its nbd plugin) that relays each
# request over TCP. Against target_memory, this prices the extra hop alone;
# against the client, what the client does besides.
target_proxy() {
  local pid sock="$WORK/proxy.sock"
  memory_server
  rm -f "$sock"
  nbdkit -f -U "$sock" --pidfile "$WORK/proxy.pid" nbd hostname="$MEM_HOST" port="$MEM_PORT" \
    >"$WORK/proxy.log" 2>&1 &
  pid=$!
  push_undo "stop_pid $pid; rm -f $WORK/proxy.pid $sock"
  wait_file "$WORK/proxy.pid" "$pid" "nbdkit nbd (log $WORK/proxy.log)"
  fuse_swap "nbd+unix:///?socket=$sock"
}
# The floor of the client's path: the same FUSE front end, loop device and
# queue depth, answering from its own memory with no donor behind it
# (examples/fuse-memory.rs). A loop device over a tmpfs file is no floor
# to swap on: loop charges the file's pages to the swapping job's cgroup,
# which then swaps them to the same loop device, and swap-in deadlocks.
target_floor() {
  local pid uring=/sys/module/fuse/parameters/enable_uring
  # On, as pagerctl attach turns it on for the client (and detach back).
  if [ -e "$uring" ]; then
    push_undo "echo $(cat "$uring") > $uring"
    echo Y >"$uring"
  fi
  mkdir -p "$WORK/floor"
  "$FUSE_MEMORY" "$WORK/floor" 1024 fuse-uring >"$WORK/floor.log" 2>&1 &
  pid=$!
  push_undo "umount $WORK/floor; wait $pid"
  wait_file "$WORK/floor/device" "$pid" "fuse-memory (log $WORK/floor.log)"
  loop_swap "$WORK/floor/device"
}
target_zram() {
  local z
  z="$(zramctl --find --size 1G)"
  push_undo "zramctl --reset $z"
  swap_on "$z"
  SWAPDEV="$z"
}
target_file() {
  local f="$WORK/swapfile"
  fallocate -l 1G "$f"
  chmod 600 "$f"
  push_undo "rm -f $f"
  swap_on "$f"
  SWAPDEV="$f"
}

# swap_run TARGET: sets up TARGET, times the job, undoes TARGET; sets SECS.
swap_run() {
  local t0 t1 rc
  UNDO=()
  "target_$1"
  cgroup_make "$LIMIT"
  t0="$(date +%s.%N)"
  rc=0
  sh -c 'echo $$ > "$0" && exec "$@"' "$CG/cgroup.procs" "$MEMHOG" "$TOUCH" --passes 1 \
    >"$WORK/memhog-$1.log" 2>&1 || rc=$?
  t1="$(date +%s.%N)"
  undo_all
  [ "$rc" = 0 ] || die "memhog through $1 failed ($rc): $(tail -3 "$WORK/memhog-$1.log")"
  SECS="$("$PY" -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.1f}")' "$t0" "$t1")"
}

bench_swap() {
  local limit_bytes
  limit_bytes="$("$PY" -c 'import sys; u = {"K": 10, "M": 20, "G": 30}; s = sys.argv[1].upper().rstrip("IB"); print(int(s[:-1]) << u[s[-1]] if s[-1] in u else int(s))' "$LIMIT")"
  TOUCH=$((3 * limit_bytes))
  echo "== 3. Swap: memhog touching $((TOUCH >> 20)) MiB in a $LIMIT memory cgroup (1 verify pass), $ROUNDS rounds"
  declare -A T
  local round t setting runs=()
  for setting in $SWAP_SETTINGS; do
    case "$setting" in
      links | loopback)
        for m in $SWAP_MODES; do
          for f in $FRONTENDS; do runs+=("client:$f+$m/$setting"); done
        done
        runs+=("proxy/$setting" "memory/$setting")
        ;;
      *) die "unknown swap setting $setting (links, loopback)" ;;
    esac
  done
  runs+=(floor zram file)
  for round in $(seq "$ROUNDS"); do
    for t in "${runs[@]}"; do
      SWAP_RATE=""
      [ "${t#*/}" = links ] && SWAP_RATE="$LINK_RATE"
      local target="${t%/*}"
      FRONTEND="${target#client:}"
      CLIENT_MODE="${FRONTEND#*+}"
      FRONTEND="${FRONTEND%+*}"
      swap_run "${target%%:*}"
      T[$t]="${T[$t]:-} $SECS"
      echo "round $round: $t ${SECS}s" >&2
    done
  done
  local label mean base setting
  mean_of() { "$PY" -c 'import sys; v = [float(x) for x in sys.argv[1:]]; print(f"{sum(v) / len(v):.1f}")' "$@"; }
  printf '%-52s %-24s %10s %16s\n' target "seconds per round" mean "vs nbdkit memory"
  for t in "${runs[@]}"; do
    setting="${t#*/}"
    [ "$setting" = "$t" ] && setting=loopback
    case "$t" in
      client:*)
        label="${t%%/*}"
        label="${label#client:}"
        label="client, ${label#*+}, $(swap_donors "${label#*+}") donors, ${label%+*}"
        ;;
      proxy/*) label="one nbdkit memory via a local proxy" ;;
      memory/*) label="one nbdkit memory" ;;
      floor) label="FUSE from memory + loop (the floor)" ;;
      zram) label="zram" ;;
      file) label="swap file on local disk" ;;
    esac
    case "$setting" in
      links) label="$label, $LINK_RATE links" ;;
      loopback) case "$t" in */*) label="$label, loopback" ;; esac ;;
    esac
    mean="$(mean_of ${T[$t]})"
    # Local targets compare with the loopback nbdkit memory if it ran.
    base="${T[memory/$setting]:-${T[memory/${SWAP_SETTINGS##* }]}}"
    printf '%-52s %-24s %10s %16s\n' "$label" "${T[$t]# }" "$mean" "$(ratio "$mean" "$(mean_of $base)")"
  done
  for setting in $SWAP_SETTINGS; do
    for m in $SWAP_MODES; do
      for f in $FRONTENDS; do
        echo "client ($m) on $f vs the swap file, $setting: $(ratio "$(mean_of ${T[client:$f+$m/$setting]})" "$(mean_of ${T[file]})")"
        if [ "$m" = ec ] && [ -n "${T[client:$f+parity/$setting]:-}" ]; then
          echo "client on $f, ec 4+2 vs parity, $setting: $(ratio "$(mean_of ${T[client:$f+ec/$setting]})" "$(mean_of ${T[client:$f+parity/$setting]})") (target <= 1.1x)"
        fi
      done
    done
  done
  echo "(targets: client on fuse-uring <= 1.0x one nbdkit memory and <= 1.0x the swap file)"
  echo
}

# ---------------------------------------------------------- 4. latency
# fio_lat TARGET RW [extra...]: prints the mean completion latency in us of
# QD1 4 KiB random I/O over the first 64 MiB. (fio's nbd engine prints a
# line of its own before the JSON.)
fio_lat() {
  local target="$1" rw="$2"
  shift 2
  fio --name=lat "$@" "$target" --rw="$rw" --bs=4k --iodepth=1 --size=64M --runtime="$RUNTIME" \
    --time_based --ramp_time=2 --randrepeat=0 --output-format=json 2>"$WORK/fio-lat.err" |
    "$PY" -c 'import json, sys; t = sys.stdin.read(); j = json.loads(t[t.index("{"):])["jobs"][0]; d = j["read"] if j["read"]["io_bytes"] else j["write"]; m = d["clat_ns"]["mean"] / 1000; print(f"{m:.1f}")' ||
    die "fio failed: $(tail -3 "$WORK/fio-lat.err")"
}

bench_latency() {
  echo "== 4. Latency: QD1 4 KiB random I/O, mean completion time (us), $ROUNDS rounds"
  declare -A L
  local round f rw
  start_donors 1 ""
  local donor="${DONORS[1]%%,*}"
  for round in $(seq "$ROUNDS"); do
    for f in $FRONTENDS; do
      attach_client "$WORK/c-lat-$f" none 256M $(frontend_args "$f")
      # The device is new: written once first, so reads find data on the
      # donor and writes find their extents placed.
      fio --name=fill --filename="$DEVICE" --rw=write --bs=1M --size=64M --direct=1 >/dev/null 2>&1
      for rw in randread randwrite; do
        L[$f/$rw]="${L[$f/$rw]:-} $(fio_lat "--filename=$DEVICE" "$rw" --ioengine=psync --direct=1)"
      done
      "$PAGERCTL" detach --state-dir "$WORK/c-lat-$f" >/dev/null 2>>"$WORK/pagerctl.log"
    done
    for rw in randread randwrite; do
      L[direct/$rw]="${L[direct/$rw]:-} $(fio_lat "--uri=nbd://$donor/direct@256M" "$rw" --ioengine=nbd)"
    done
  done
  mean_of() { "$PY" -c 'import sys; v = [float(x) for x in sys.argv[1:]]; print(f"{sum(v) / len(v):.1f}")' "$@"; }
  printf '%-44s %12s %12s %12s %12s
' path "read us" "vs direct" "write us" "vs direct"
  local r w rd wd
  rd="$(mean_of ${L[direct/randread]})"
  wd="$(mean_of ${L[direct/randwrite]})"
  for f in $FRONTENDS direct; do
    r="$(mean_of ${L[$f/randread]})"
    w="$(mean_of ${L[$f/randwrite]})"
    printf '%-44s %12s %12s %12s %12s
' "$( [ "$f" = direct ] && echo "fio nbd engine to the donor" || echo "client, none, 1 donor, $f")" \
      "$r" "$(ratio "$r" "$rd")" "$w" "$(ratio "$w" "$wd")"
  done
  echo "(target: fuse-uring <= 1.2x direct)"
  echo
}

WHICH=("$@")
[ ${#WHICH[@]} -gt 0 ] || WHICH=(donors modes swap latency)
for b in "${WHICH[@]}"; do
  case "$b" in
    donors | modes | swap | latency) bench "bench_$b" ;;
    *) die "unknown benchmark $b (donors, modes, swap, latency)" ;;
  esac
done
