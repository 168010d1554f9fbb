#!/usr/bin/env bash
# Renders the man pages to roff into OUTDIR, gzipped as Debian installs
# them (make deb packages them):
# pandoc from the Markdown pages the tree keeps (NAME.SECTION.md, in pandoc's
# "% TITLE(S)" style or ronn's "# name(S) -- what" style), help2man from
# --help for the small tools that have no page of their own.
#
#   scripts/man.sh OUTDIR BINDIR
set -euo pipefail
out=$1 bin=$2
root=$(cd "$(dirname "$0")/.." && pwd)
version=$(bash "$root/scripts/version.sh")
mkdir -p "$out"

pages=(
  pagerctl/pagerctl.1.md
  client-plugin/pager-client-plugin.1.md
  pager-server/pager-server.1.md
  prefetchd/prefetchd.8.md
)
# Pandoc's Markdown without its typographic and TeX extensions: quotes and
# "--" stay ASCII (a copied `--state-dir` must not become an en dash), and
# `$VAR` or `a~b~` are text, not math or subscripts.
reader=markdown-smart-tex_math_dollars-subscript-superscript

# After .TH: no hyphenation, no justification and no line break after a
# hyphen, so that an option or a path copies as it was written (man-db's
# --nh --nj empty the macros an.tmac calls to turn them back on; .cflags 0
# takes the hyphens' break-after flag away).
unhyphenate() {
  sed -e '0,/^\.TH /{/^\.TH /a\
.nh\
.de hy\
..\
.ad l\
.de ad\
..\
.cflags 0 - \\- \\[hy]
}'
}

for page in "${pages[@]}"; do
  src=$root/$page
  base=$(basename "$page" .md)      # pagerctl.1
  name=${base%.*} section=${base##*.}
  first=$(head -n1 "$src")
  if [[ $first == %* ]]; then
    pandoc -s -f "$reader" -t man --metadata footer="netpager $version" "$src" | unhyphenate >"$out/$base"
  elif [[ $first =~ ^#\ ([^ ]+)\(([0-9])\)\ --\ (.*)$ ]]; then
    # ronn style: the first line becomes pandoc's title and a NAME section,
    # and every heading moves up a level (## SYNOPSIS is a section).
    { printf '%% %s(%s) netpager | netpager manual\n\n# NAME\n\n%s - %s\n\n' \
        "${name^^}" "$section" "$name" "${BASH_REMATCH[3]}"
      tail -n +2 "$src" | sed -e 's/^#\(#\+\) /\1 /'
    } | pandoc -s -f "$reader" -t man --metadata footer="netpager $version" | unhyphenate >"$out/$base"
  else
    echo "man.sh: $page: first line is neither '% TITLE(S) ...' nor '# name(S) -- what'" >&2
    exit 1
  fi
done

# Tools documented by their --help.
help2man_page() {
  local name=$1 what=$2
  help2man --no-info --no-discard-stderr --section 1 --name "$what" \
    --version-string "$version" "$bin/$name" | unhyphenate >"$out/$name.1"
}
help2man_page netpager-token "derive a client's export token or the /metrics bearer token"
help2man_page netpager-drain "drain netpager donors and wait until they hold nothing"
help2man_page pager-hints "netpager hint files: validate, convert, stats, check, merge, generate"
help2man_page prefetch-job "replay a hint file's reads, verifying bytes (prefetchd's test job)"

gzip -9nf "$out"/*.[18]
