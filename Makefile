# netpager: `make demo` and `make test` are the two commands a newcomer needs.
# Every entry point installs what is missing first (make deps).

SHELL := /bin/bash
CARGO ?= cargo
# A hung test fails alone, named, instead of eating CI's whole time: each
# end-to-end test has TEST_TIMEOUT seconds (pytest-timeout; SIGALRM, so its
# teardown still runs), each `cargo test` CARGO_TEST_TIMEOUT (cargo names a
# test that runs over 60 s).
TEST_TIMEOUT ?= 600
CARGO_TEST_TIMEOUT ?= 1200
# Every test's time goes to target/pytest.xml (junit), the slowest 30 to the log:
# the suite must stay under 30 minutes, and that says where it goes.
PYTEST := /usr/bin/python3 -m pytest -ra --durations=30 --junitxml=$(CURDIR)/target/pytest.xml -p timeout --timeout=$(TEST_TIMEOUT) --timeout-method=signal
CARGO_TEST := timeout --kill-after=30 $(CARGO_TEST_TIMEOUT) $(CARGO) test
# Benchmarks are modules of the test harness (tests/netpager_testkit).
BENCH_PY := PYTHONPATH=$(CURDIR)/tests /usr/bin/python3 -m netpager_testkit
# Which client benchmarks `make bench-client` runs (donors modes swap latency depth: all).
WHICH ?=
# Seconds per fuzz target in `make fuzz` (nightly; `cargo test` replays the
# kept inputs, fuzz/regressions/, without it).
FUZZ_SECONDS ?= 300
# Debian's python3 binds python3-libnbd; a newer python3 may come first on PATH.
export PATH := /usr/sbin:/usr/bin:/sbin:/bin:$(PATH)
export NETPAGER_ROOT := $(CURDIR)
# Every target builds first: a Rust test that finds no libpager_server.so
# fails instead of skipping (test-support, pager_server_so).
export NETPAGER_REQUIRE_SERVER := 1
# What every command's --version prints and the packages' version
# (netpager_util::version!, scripts/version.sh).
export NETPAGER_VERSION := $(shell bash scripts/version.sh)
export NETPAGER_COMMIT := $(shell git rev-parse HEAD 2>/dev/null)
# When this make began: `NETPAGER_TEST_VM=1 make test` leaves out its VM
# slice when the suite has no time left for it (tests/vm/test_vm.py, NETPAGER_TEST_BUDGET).
export NETPAGER_TEST_STARTED ?= $(shell date +%s)
# What `make test-vm` runs in the test VM (Debian's kernel under qemu:
# kernel nbd, cgroup v2, netem, CAP_SYS_RESOURCE; netpager_testkit.vm), and
# for how long at most.
VM_TESTS ?= tests/client/test_client_nbd_restart.py tests/faults/test_machine_oom.py \
            tests/faults/test_link_latency.py tests/client/test_client_swap.py
VM_TIMEOUT ?= 3600

.PHONY: all deps build demo lab-demo test test-unit test-server test-client test-prefetch \
        test-ansible test-security test-monitoring test-bench test-stress bench bench-server bench-client \
        bench-prefetch bench-apps bench-compress bench-ab fuzz soak faults nemesis clean lint deb test-deb test-vm

all: build

deps:
	@bash scripts/deps.sh

build: deps
	$(CARGO) build --release --workspace --all-targets
	$(MAKE) -C tests/jobs

# Release profile: clippy then shares the dependency builds of `make build`.
# A source file over 800 lines is split by what it does (HACKING).
lint: deps
	@git ls-files '*.rs' '*.py' | xargs wc -l | awk '$$2 != "total" && $$1 > 800 { print "lint: " $$2 " has " $$1 " lines (at most 800: split it by what it does)"; bad = 1 } END { exit bad }'
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	cd ansible && ansible-lint

demo: build
	bash scripts/demo.sh

# The demo on a lab of hosts in network namespaces on two subnets, rolled
# out by Ansible over SSH, the client finding the far donor through the
# lab's DNS (tests/lab).
lab-demo: build
	bash scripts/demo.sh --lab

test: build
	$(CARGO_TEST) --release --workspace
	$(PYTEST) tests

test-unit: build
	$(CARGO_TEST) --release --workspace

test-server: build
	$(CARGO_TEST) --release -p netpager-proto -p pager-server
	$(PYTEST) tests/server

test-client: build
	$(CARGO_TEST) --release -p netpager-nbd -p pager-client -p pagerctl
	$(PYTEST) tests/client

test-prefetch: build
	$(CARGO_TEST) --release -p hints -p prefetchd
	$(PYTEST) tests/prefetch

test-ansible: build
	$(PYTEST) tests/ansible

test-security: build
	$(CARGO_TEST) --release -p hints -p netpager-proto -p netpager-membership --test fuzz_regressions
	$(PYTEST) tests/security

test-monitoring: build
	$(CARGO_TEST) --release -p netpager-metrics
	$(PYTEST) tests/monitoring

# Every benchmark of bench-client, bench-server and bench-prefetch in its
# shortest configuration.
test-bench: build
	$(PYTEST) tests/bench

# The flake hunt: the end-to-end tests (and, with --rust, cargo test)
# NETPAGER_TEST_REPEAT times (default 3) on a quiet machine, then as many
# times with stress-ng --cpu 2 --io 1 beside them at nice 19; every test
# that failed at least once, with its failure, in
# bench-results/stress/summary.txt (docs/HACKING.md, "Tests that cannot
# flake"). STRESS_ARGS picks what runs: e.g. "--phases stress tests/client".
STRESS_ARGS ?= --rust tests
test-stress: build
	$(BENCH_PY).stress $(STRESS_ARGS)

# Debian packages netpager-donor, netpager-client and netpager-prefetchd
# into dist/, lintian-checked (scripts/deb.sh; docs/HACKING.md, "Packages").
deb: build
	bash scripts/deb.sh dist

# The packages (built by the test) installed, used, removed and purged in a
# fresh Debian 12 root (mmdebstrap, cached in /var/cache/netpager-test/);
# also part of `make test`.
test-deb: build
	$(PYTEST) tests/deb

# VM_TESTS in the test VM, booted once (docs/HACKING.md, "The test VM");
# its kernel, initramfs and runs are cached in target/vm/.
# `NETPAGER_TEST_VM=1 make test` adds a short slice of it (tests/vm/test_vm.py).
test-vm: build
	NETPAGER_FAULTS=full VM_TIMEOUT=$(VM_TIMEOUT) $(BENCH_PY).vm $(VM_TESTS)

fuzz: deps
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

soak: build
	bash scripts/soak.sh

# The whole fault matrix (tests/faults, every fault in every mode, the link
# faults on the lab) and the lab's rolling update (tests/lab); the table is
# printed and written to bench-results/faults.json. `make test` runs one
# cell per fault kind (mode parity) and one rollout on the lab.
faults: build
	rm -f bench-results/faults-rows.jsonl
	NETPAGER_FAULTS=full $(PYTEST) tests/faults tests/lab; rc=$$?; \
	/usr/bin/python3 scripts/faults_table.py; exit $$rc

# The nemesis (issue 34, tests/nemesis): random schedules of operations and
# faults against a device in each mode while verifying workloads run on it,
# for DURATION seconds in all (default 600) over MODES (default "none mirror
# parity ec"); SEED (the first schedule's), OPS (per schedule, default 40),
# KNOWN=1 (also the ops of bugs still open), EXCLUDE=kind,..., NO_SHRINK=1;
# SCHEDULE='SETUP | OP; ...' replays one schedule. Each run prints its seed
# and replay command, a failing one is shrunk; the table goes to
# bench-results/nemesis/. `make test` runs a slice: one mode, about a minute and a half.
nemesis: build
	$(BENCH_PY).nemesis

bench: bench-server bench-client bench-prefetch
	$(CARGO) bench --workspace

# Tables and numbers go to bench-results/server/, bench-results/client/ and
# bench-results/prefetch/; knobs are environment variables (see
# docs/HACKING.md, "Benchmarks").
bench-server: build
	$(BENCH_PY).bench_server

bench-client: build
	$(BENCH_PY).bench_client $(WHICH)

bench-prefetch: build
	$(BENCH_PY).bench_prefetch

# The client's request path, A/B: the swap job and its CPU, QD1 4 KiB latency and QD16
# 4 KiB throughput through BASE's build (a commit, built once into
# target/ab/COMMIT/: a git worktree and its own CARGO_TARGET_DIR) and this
# tree's, alternating A B for ROUNDS rounds (default 3), mode none on
# loopback donors; each side's numbers, medians and B/A ratios in
# bench-results/ab/ab.txt and ab.json (netpager_testkit.bench_ab).
BASE ?=
ifneq ($(filter bench-ab,$(MAKECMDGOALS)),)
ifeq ($(BASE),)
$(error make bench-ab: say which build to compare with, BASE=REV)
endif
endif
bench-ab: build
	$(BENCH_PY).bench_ab --base '$(BASE)'

# Real programs (redis, PageRank, a sort) at 75% and 50% of their memory
# through netpager, a swap file, zram and zswap: bench-results/apps/.
bench-apps: build
	$(BENCH_PY).bench_apps

# The donor's compression on the pages real programs swap: bench-apps'
# programs at FRACTION (50) % of their peak swapping to zram, stopped near
# their peak, zram's mm_stat and the swapped pages recorded, the pages
# replayed through pager-server's store (examples/compress-replay) with
# compress=off, lz4 and zstd: bench-results/compress/ (KEEP=1 keeps the dumps).
bench-compress: build
	$(BENCH_PY).bench_compress

# The A/B benchmark's base builds go first: their worktrees are registered in git.
clean:
	$(BENCH_PY).bench_ab --clean
	$(CARGO) clean
	rm -rf dist
	$(MAKE) -C tests/jobs clean
