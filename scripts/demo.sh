#!/usr/bin/env bash
# netpager demo: donors on loopback -> the client's own FUSE file -> loop ->
# swapon -> a job in a memory cgroup touching 3x its limit and verifying every
# page -> the donors' status -> teardown. Run as root after `make build` (`make demo` does both).
# Options go to the demo module: --donors N --size 1G --limit 128M --factor 3.
# `demo.sh --lab [--limit 24M --factor 3]` (`make lab-demo`) runs the same on
# the lab: hosts in network namespaces on two subnets joined by a router,
# Ansible rolling out over SSH, donors found through the lab's DNS
# (tests/lab/lab_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "demo: must run as root (swapon, losetup, FUSE mounts, cgroups)" >&2
  exit 1
fi

# Debian's python3: python3-libnbd and python3-protobuf bind to it.
export PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"

# The demo (tests/netpager_testkit/demo.py, tests/lab/lab_demo.py) undoes its own setup on exit and
# on INT/TERM. These traps pass a signal on to it and keep this script
# waiting until its teardown is done; the pid is only signalled while it is
# still our running job, so a reused pid is never hit.
demo=""
pending=""
forward() {
  if [ -n "$demo" ] && jobs -pr | grep -qx "$demo"; then
    kill -s "$1" "$demo" 2>/dev/null || true
  fi
}
trap 'pending=INT' INT
trap 'pending=TERM' TERM
trap 'forward TERM; wait 2>/dev/null || true' EXIT

if [ "${1:-}" = --lab ]; then
  shift
  set -- tests/lab/lab_demo.py "$@"
else
  set -- -m netpager_testkit.demo "$@"
fi
/usr/bin/python3 "$@" &
demo=$!
while :; do
  rc=0
  wait "$demo" || rc=$?
  if [ -z "$pending" ]; then
    break
  fi
  # wait was cut short by a signal: hand it on and wait for the teardown.
  forward "$pending"
  pending=""
done
demo=""
exit "$rc"
