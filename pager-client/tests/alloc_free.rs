//! Issue 12: once extents are placed and connections are open, a 4 KiB
//! read or write through the device makes no heap allocation, in mode none
//! and in modes parity and ec 4+2 with and without their parity log; issue
//! 24: nor with 16 requests in flight at once on one donor connection. A
//! counting global allocator counts this thread's allocations only (the
//! device's epoch and maintenance threads allocate as they please); real
//! nbdkit donors.

// A counting global allocator is an `unsafe impl`.
#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::{config, Nbdkit};
use pager_client::config::{ByteSize, Mode};
use pager_client::device::Device;

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn bump() {
    // `try_with`: the allocator also runs while thread-locals are torn down.
    let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counter is a const-initialised thread-local that never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        bump();
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        bump();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        bump();
        // SAFETY: as above.
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// This thread's allocations while `f` runs.
fn allocations(f: impl FnOnce()) -> u64 {
    let before = ALLOCS.with(Cell::get);
    f();
    ALLOCS.with(Cell::get) - before
}

const PAGE: usize = 4096;
/// Large extents: a parity log unit then has 256 rows, so the measured
/// writes all fit in the log unit the warm-up opened (placing a new one is
/// a placement, like a first write, not the steady state).
const EXTENT: u64 = 1 << 20;
const SIZE: u64 = 16 << 20;
/// Aligned pages in several extents and parity groups, one unaligned page
/// and one that straddles two extents.
const OFFSETS: [u64; 5] = [
    0,
    3 * EXTENT + 8 * PAGE as u64,
    6 * EXTENT + 1000,
    9 * EXTENT - 2048,
    SIZE - PAGE as u64,
];
/// A whole parity group (two extents) written once in the warm-up; its
/// pages are read from home (not the parity log) at these offsets.
const STRIPE_AT: u64 = 2 * EXTENT;
const STRIPE_LEN: u64 = 2 * EXTENT;
const HOME_READS: [u64; 2] = [STRIPE_AT + 5 * PAGE as u64, STRIPE_AT + EXTENT + 100];
const ROUNDS: u8 = 10;

fn donor() -> Nbdkit {
    netpager_test_support::pager_server(&["size=64M", "budget=256M"])
        .unwrap_or_else(|| Nbdkit::memory("64M"))
}

fn pattern(round: u8, at: usize) -> [u8; PAGE] {
    let mut b = [0u8; PAGE];
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31) ^ round ^ (at as u8).wrapping_mul(97);
    }
    b
}

fn donor_io(dev: &Device) -> u64 {
    dev.status().donors.iter().map(|d| d.reads + d.writes).sum()
}

fn steady_state_io_allocates_nothing(mode: Mode, donors: usize, log: Option<u64>) {
    let ds: Vec<Nbdkit> = (0..donors).map(|_| donor()).collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(mode.clone(), SIZE, EXTENT, &refs);
    cfg.parity_log = log.map(ByteSize);
    // One connection per donor: the warm-up opens it, and a heartbeat that
    // holds it makes this thread wait instead of opening another.
    cfg.connections_per_donor = 1;
    cfg.policy.epoch_ms = 60_000;
    // A loaded machine must not fail a donor mid-test.
    cfg.timeouts.request_ms = 10_000;
    let dev = Device::open(cfg, state.path()).unwrap();

    // Warm-up: first writes place the extents (and a parity log unit) and
    // open the connections.
    let stripe: Vec<u8> = (0..STRIPE_LEN).map(|i| (i / 7) as u8).collect();
    dev.write(&stripe, STRIPE_AT).unwrap();
    for round in 0..3 {
        for (k, &off) in OFFSETS.iter().enumerate() {
            dev.write(&pattern(round, k), off).unwrap();
            let mut b = [0u8; PAGE];
            dev.read(&mut b, off).unwrap();
            assert!(b == pattern(round, k), "{mode:?}: warm-up read at {off}");
        }
    }

    let io_before = donor_io(&dev);
    let mut bad: Option<(u8, u64)> = None;
    let mut read = [0u8; PAGE];
    let (mut writes, mut reads) = (0, 0);
    for round in 3..3 + ROUNDS {
        for (k, &off) in OFFSETS.iter().enumerate() {
            let data = pattern(round, k);
            writes += allocations(|| dev.write(&data, off).unwrap());
            reads += allocations(|| dev.read(&mut read, off).unwrap());
            if read != data && bad.is_none() {
                bad = Some((round, off));
            }
        }
        for &off in &HOME_READS {
            reads += allocations(|| dev.read(&mut read, off).unwrap());
            let at = (off - STRIPE_AT) as usize;
            if read[..] != stripe[at..at + PAGE] && bad.is_none() {
                bad = Some((round, off));
            }
        }
    }
    let n_writes = ROUNDS as u64 * OFFSETS.len() as u64;
    let n_reads = ROUNDS as u64 * (OFFSETS.len() + HOME_READS.len()) as u64;
    assert_eq!(bad, None, "{mode:?} log {log:?}: read back differs");
    // Not vacuous: every request reached the donors.
    let io = donor_io(&dev) - io_before;
    assert!(
        io >= n_writes + n_reads,
        "{mode:?}: only {io} donor requests for {} operations",
        n_writes + n_reads
    );
    eprintln!(
        "{mode:?} log {log:?}: {writes} allocations in {n_writes} writes, {reads} in {n_reads} reads"
    );
    assert_eq!(
        (writes, reads),
        (0, 0),
        "{mode:?} log {log:?}: allocations in {n_writes} steady-state 4 KiB writes and in {n_reads} reads"
    );
    // The data is where the device says it is.
    for (k, &off) in OFFSETS.iter().enumerate() {
        let mut b = [0u8; PAGE];
        dev.read(&mut b, off).unwrap();
        assert!(b == pattern(2 + ROUNDS, k), "{mode:?}: final read at {off}");
    }
}

#[test]
fn mode_none() {
    steady_state_io_allocates_nothing(Mode::None, 2, None);
}

#[test]
fn mode_parity_without_log() {
    steady_state_io_allocates_nothing(Mode::Parity { width: 3 }, 3, Some(0));
}

#[test]
fn mode_parity_with_log() {
    steady_state_io_allocates_nothing(Mode::Parity { width: 3 }, 3, None);
}

#[test]
fn mode_ec_without_log() {
    steady_state_io_allocates_nothing(Mode::Ec { data: 4, parity: 2 }, 6, Some(0));
}

#[test]
fn mode_ec_with_log() {
    steady_state_io_allocates_nothing(Mode::Ec { data: 4, parity: 2 }, 6, None);
}

/// Requests in flight at once in the depth test.
const DEPTH: usize = 16;

/// `DEPTH` threads each write and read their own pages at once, sharing
/// one connection per donor (replies routed to their waiters by cookie):
/// no thread allocates once warmed up, and every byte reads back.
fn io_at_depth_allocates_nothing(mode: Mode, donors: usize) {
    let ds: Vec<Nbdkit> = (0..donors).map(|_| donor()).collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(mode.clone(), SIZE, EXTENT, &refs);
    if mode != Mode::None {
        cfg.parity_log = Some(ByteSize(0));
    }
    // One shared connection per donor carries every request.
    cfg.connections_per_donor = 1;
    cfg.policy.epoch_ms = 60_000;
    cfg.timeouts.request_ms = 10_000;
    let dev = Device::open(cfg, state.path()).unwrap();
    // Every extent placed first (placement allocates).
    let fill = vec![0u8; SIZE as usize];
    dev.write(&fill, 0).unwrap();
    let start = std::sync::Barrier::new(DEPTH);
    let counts: Vec<(u64, u64, Option<u64>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..DEPTH)
            .map(|t| {
                let (dev, start) = (&dev, &start);
                s.spawn(move || {
                    // Thread t's pages: every DEPTH-th page, across extents.
                    let offs: Vec<u64> = (0..8)
                        .map(|k| ((k * DEPTH + t) as u64 * 37 % (SIZE / PAGE as u64)) * PAGE as u64)
                        .collect();
                    let mut read = [0u8; PAGE];
                    // Warm-up on this thread (its first requests).
                    for &off in &offs {
                        dev.write(&pattern(0, t), off).unwrap();
                        dev.read(&mut read, off).unwrap();
                    }
                    start.wait();
                    let (mut writes, mut reads, mut bad) = (0, 0, None);
                    for round in 1..=ROUNDS {
                        for &off in &offs {
                            let data = pattern(round, t);
                            writes += allocations(|| dev.write(&data, off).unwrap());
                            reads += allocations(|| dev.read(&mut read, off).unwrap());
                            if read != data && bad.is_none() {
                                bad = Some(off);
                            }
                        }
                    }
                    (writes, reads, bad)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    for (t, (writes, reads, bad)) in counts.iter().enumerate() {
        assert_eq!(*bad, None, "{mode:?}: thread {t} read back other bytes");
        assert_eq!(
            (*writes, *reads),
            (0, 0),
            "{mode:?}: thread {t} allocated at depth {DEPTH}"
        );
    }
    assert_eq!(
        dev.status().donors.iter().filter(|d| d.failed).count(),
        0,
        "{mode:?}: a donor failed"
    );
}

#[test]
fn mode_none_at_depth_16() {
    io_at_depth_allocates_nothing(Mode::None, 2);
}

#[test]
fn mode_parity_at_depth_16() {
    io_at_depth_allocates_nothing(Mode::Parity { width: 3 }, 3);
}
