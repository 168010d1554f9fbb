#!/usr/bin/env bash
# Builds netpager's Debian packages from the release build into OUTDIR
# (`make deb`, after `make build`): netpager-donor, netpager-client and
# netpager-prefetchd, with cargo-deb from each crate's [package.metadata.deb],
# man pages rendered by scripts/man.sh, then lintian on each package.
#
#   scripts/deb.sh OUTDIR
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$root"
target=${CARGO_TARGET_DIR:-$root/target}
bin=$target/release
version=${NETPAGER_VERSION:-$(bash scripts/version.sh)}
commit=${NETPAGER_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

# The plugin goes where Debian's nbdkit looks for plugins by name; the
# packages' metadata names the amd64 directory.
plugindir=$(nbdkit --dump-config | sed -n 's/^plugindir=//p')
if [[ $plugindir != /usr/lib/x86_64-linux-gnu/nbdkit/plugins ]]; then
  echo "deb: nbdkit's plugin directory here is $plugindir; the packages install into /usr/lib/x86_64-linux-gnu/nbdkit/plugins (amd64 only: add this architecture's path to pager-server/Cargo.toml)" >&2
  exit 1
fi

# A package must hold what its version says: refuse binaries built from
# another tree state (make build sets NETPAGER_VERSION for cargo).
for b in pagerctl prefetchd prefetch-job pager-hints netpager-token netpager-drain; do
  got=$("$bin/$b" --version)
  if [[ $got != "$b $version (commit $commit)" ]]; then
    echo "deb: $bin/$b --version says '$got', expected '$b $version (commit $commit)'; run make build first" >&2
    exit 1
  fi
done

bash scripts/man.sh "$bin/man" "$bin"

# Debian wants a changelog in every package; ours names the build's commit.
# (cargo-deb compresses only files it does not take from target/: this and
# the man pages are compressed here.)
mkdir -p "$bin/deb"
{
  echo "netpager ($version) unstable; urgency=medium"
  echo
  echo "  * Built from commit $commit."
  echo
  echo " -- netpager maintainers <netpager@example.org>  $(TZ=UTC git log -1 --format=%cD 2>/dev/null || date -R -u)"
} | gzip -9n >"$bin/deb/changelog.gz"

# One package of each name in OUTDIR: Ansible insists on that.
rm -f "$out"/netpager-{donor,client,prefetchd}_*.deb
rm -rf "$out/.controller"
debs=()
for crate in pager-server pagerctl prefetchd; do
  debs+=("$(cargo deb --no-build --strip --quiet -p "$crate" --deb-version "$version" --output "$out")")
done

# lintian: errors fail the build; the warnings we keep are explained in
# docs/HACKING.md ("Packages") and suppressed by name here.
suppress=(
  # groff's "cannot adjust line" in the man pages' tables: pandoc sets
  # their columns for the page width, and a few cells hold a long word
  # (an option, a path) that does not fit a narrow terminal's column.
  groff-message
)
lintian --fail-on error,warning --suppress-tags "$(IFS=,; echo "${suppress[*]}")" "${debs[@]}"
printf '%s\n' "${debs[@]}"
