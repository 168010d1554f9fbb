#!/usr/bin/env bash
# make soak: the load tests of tests/security at full length (a few
# minutes): 8 clients x 4 donors doing NETPAGER_SOAK_OPS random operations
# each with read-verify, and NETPAGER_SOAK_CYCLES connect/disconnect cycles
# in plain text and over TLS-PSK, under the same memory bounds as the short
# run in `make test` (tests/security/test_load.py states them).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's python3 binds python3-libnbd; a newer python3 may come first on PATH.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
export NETPAGER_SOAK_OPS=${NETPAGER_SOAK_OPS:-150000}
export NETPAGER_SOAK_CYCLES=${NETPAGER_SOAK_CYCLES:-1000}
echo "soak: $NETPAGER_SOAK_OPS operations per load client, $NETPAGER_SOAK_CYCLES connect cycles"
exec /usr/bin/python3 -m pytest -ra -s tests/security/test_load.py
