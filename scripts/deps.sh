#!/usr/bin/env bash
# Installs what netpager needs to build, test and demo, and nothing twice:
# Debian packages, then Python packages missing from Debian. Idempotent.
set -euo pipefail

debs=(
  build-essential pkg-config clang libclang-dev
  nbdkit nbdkit-plugin-dev libnbd-dev libnbd-bin python3-libnbd
  nbd-client nbd-server fio liburing-dev protobuf-compiler
  fuse3 libfuse3-dev e2fsprogs util-linux procps kmod
  python3 python3-pytest python3-pytest-timeout python3-matplotlib python3-protobuf stress-ng sqlite3 iptables systemd
  ansible ansible-lint prometheus tmux openssh-server bind9 bind9-dnsutils
  pandoc help2man lintian dpkg-dev mmdebstrap
  redis-server redis-tools python3-igraph python3-numpy bpftrace
  qemu-system-x86 busybox-static
)

missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" != 0 ]; then echo "deps: must run as root to install packages" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Rust: rustup's toolchain when present (CI images have it), else Debian's.
if ! command -v cargo >/dev/null 2>&1; then
  echo "deps: no cargo on PATH; installing Debian's cargo"
  apt-get install -y -qq cargo rustc
fi
# The workspace's rust-version (Cargo.toml): an older toolchain would fail
# later with less helpful errors.
need=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' "$(dirname "$0")/../Cargo.toml")
have=$(rustc --version | awk '{print $2}')
if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n1)" != "$need" ]; then
  echo "deps: $(cargo --version) with rustc $have is older than Rust $need, the workspace's rust-version (Cargo.toml); install Rust $need or newer (rustup update stable)" >&2
  exit 1
fi
# cargo-deb (crates.io) for `make deb`.
if ! cargo deb --version >/dev/null 2>&1; then
  echo "deps: installing cargo-deb"
  cargo install --locked cargo-deb
fi
echo "deps: all present ($(cargo --version))"
