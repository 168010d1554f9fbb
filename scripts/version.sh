#!/usr/bin/env bash
# Prints netpager's version: the workspace's, then +git, the commit's time
# (UTC) and its short hash, so versions of successive commits sort in order
# (dpkg, apt) and each build says where it came from. Uncommitted changes
# do not show: marking them would change the version, and so rebuild the
# binaries, at every edit of any file. Outside a git checkout, the
# workspace's version alone.
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
if ! git rev-parse --verify -q HEAD >/dev/null 2>&1; then
  echo "$base"
  exit 0
fi
when=$(TZ=UTC git log -1 --format=%cd --date=format-local:%Y%m%d%H%M%S)
echo "$base+git$when.$(git rev-parse --short=12 HEAD)"
