#!/usr/bin/env bash
# Fuzzes the hint parsers, the status decoder and the DNS message decoder
# with cargo fuzz (nightly).
# usage: scripts/fuzz.sh SECONDS_PER_TARGET
# First replays every kept regression input (fuzz/regressions/TARGET/), then
# explores for SECONDS_PER_TARGET. A crash fails the run; keep its input in
# fuzz/regressions/TARGET/ once fixed, so it is replayed forever after (here
# and by `cargo test`: fuzz/checks/replay.rs).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
# cargo fuzz (crates.io) needs the nightly toolchain, which rustup installs
# beside stable on our machines; only `make fuzz` needs either.
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi
secs=${1:-30}
targets=(hints_text hints_binary status_decode dns_message)
export CARGO_TARGET_DIR=${FUZZ_TARGET_DIR:-$PWD/target}
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "regressions/$t"
  echo "== fuzz $t: replaying regressions"
  cargo +nightly fuzz run -O "$t" "regressions/$t" -- -runs=0
  echo "== fuzz $t: ${secs}s"
  cargo +nightly fuzz run -O "$t" "corpus/$t" "regressions/$t" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536
done
echo "fuzz: ${#targets[@]} targets, no crash"
