//! Shared harness of the pager-client integration tests: real nbdkit donors
//! (from netpager-test-support, which the netpager-nbd tests use too);
//! device configurations; a deterministic random source; and an in-memory
//! model of the device's contents.
#![allow(dead_code)] // each test binary uses its own part of the harness

pub use netpager_test_support::Nbdkit;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pager_client::config::{ByteSize, DeviceConfig, DonorConfig, Mode};
use pager_client::device::Device;
use pager_client::status::{render_table, ClientStatus};

/// A device configuration for tests: short timeouts and epochs, no mlock.
pub fn config(mode: Mode, size: u64, extent: u64, donors: &[&Nbdkit]) -> DeviceConfig {
    let mut c = DeviceConfig::new("t1", size, mode);
    c.extent_size = ByteSize(extent);
    c.mlock = false;
    c.io_buffers = 4;
    c.connections_per_donor = 2;
    c.timeouts.connect_ms = 1000;
    c.timeouts.request_ms = 1000;
    c.policy.epoch_ms = 200;
    // A silent donor's copies wait this long for it before they are
    // rebuilt (or, in mode none, lost).
    c.grace_ms = 2000;
    for (i, d) in donors.iter().enumerate() {
        let mut dc = DonorConfig::new(format!("d{i}"), d.addr.clone());
        dc.status = d.status.clone();
        c.donors.push(dc);
    }
    c
}

/// Waits (up to a minute) for the device's status to satisfy `pred`.
pub fn wait_status(dev: &Device, what: &str, pred: impl Fn(&ClientStatus) -> bool) -> ClientStatus {
    wait_status_every(dev, what, Duration::from_millis(50), pred)
}

/// [`wait_status`], looking every `every`: for a state that lasts only
/// moments (a drain under way).
pub fn wait_status_every(
    dev: &Device,
    what: &str,
    every: Duration,
    pred: impl Fn(&ClientStatus) -> bool,
) -> ClientStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = dev.status();
        if pred(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; status:\n{}",
            pager_client::status::render_table(&s)
        );
        std::thread::sleep(every);
    }
}

/// Asks the device for an epoch now and waits until one has ended since:
/// for tests that count epochs instead of waiting for time to pass.
pub fn run_epoch(dev: &Device) {
    let last = dev.status().epochs.last().copied();
    dev.poll_donors_now();
    wait_status(dev, "an epoch", |s| s.epochs.last().copied() != last);
}

/// xorshift64*: reproducible test data without extra crates.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let x = self.next().to_le_bytes();
            c.copy_from_slice(&x[..c.len()]);
        }
    }
}

/// What the device should contain; random operations stay within
/// `[lo, hi)` so that several threads can each own a region.
#[derive(Clone)]
pub struct Model {
    pub data: Vec<u8>,
    pub lo: u64,
    pub hi: u64,
}

impl Model {
    pub fn new(size: u64) -> Model {
        Model {
            data: vec![0; size as usize],
            lo: 0,
            hi: size,
        }
    }

    /// A copy whose random operations stay within `[lo, hi)`.
    pub fn region(&self, lo: u64, hi: u64) -> Model {
        Model {
            data: self.data.clone(),
            lo,
            hi,
        }
    }

    /// Writes random bytes over the whole device, `chunk` bytes a write,
    /// and into the model.
    pub fn fill(&mut self, dev: &Device, rng: &mut Rng, chunk: u64) {
        let size = self.data.len() as u64;
        for off in (0..size).step_by(chunk as usize) {
            self.write_random(dev, rng, off, chunk.min(size - off));
        }
    }

    /// Writes `len` random bytes at `off` to both the device and the model.
    pub fn write_random(&mut self, dev: &Device, rng: &mut Rng, off: u64, len: u64) {
        let mut b = vec![0u8; len as usize];
        rng.fill(&mut b);
        dev.write(&b, off).unwrap_or_else(|e| {
            panic!(
                "write of {len} at {off}: {e}\n{}",
                render_table(&dev.status())
            )
        });
        self.data[off as usize..(off + len) as usize].copy_from_slice(&b);
    }

    /// Takes over this model's region from `other`.
    pub fn merge(&mut self, other: &Model) {
        let r = other.lo as usize..other.hi as usize;
        self.data[r.clone()].copy_from_slice(&other.data[r]);
    }

    fn pick(&self, rng: &mut Rng, max_len: u64) -> (u64, u64) {
        let span = self.hi - self.lo;
        let len = 1 + rng.below(max_len.min(span));
        (self.lo + rng.below(span - len + 1), len)
    }

    /// A random write (any alignment, often across extent boundaries) to
    /// both the device and the model.
    pub fn random_write(&mut self, dev: &Device, rng: &mut Rng, max_len: u64) {
        let (off, len) = self.pick(rng, max_len);
        let mut b = vec![0u8; len as usize];
        rng.fill(&mut b);
        dev.write(&b, off)
            .unwrap_or_else(|e| panic!("write of {len} at {off}: {e}"));
        self.data[off as usize..(off + len) as usize].copy_from_slice(&b);
    }

    /// A write of `len` bytes at a random multiple of `align` (parity
    /// full-stripe writes when `align` is the group's data size).
    pub fn aligned_write(&mut self, dev: &Device, rng: &mut Rng, align: u64, len: u64) {
        let slots = (self.hi - self.lo - len) / align + 1;
        let off = self.lo.next_multiple_of(align) + rng.below(slots.max(1)) * align;
        if off + len > self.hi {
            return self.random_write(dev, rng, len);
        }
        let mut b = vec![0u8; len as usize];
        rng.fill(&mut b);
        dev.write(&b, off)
            .unwrap_or_else(|e| panic!("write of {len} at {off}: {e}"));
        self.data[off as usize..(off + len) as usize].copy_from_slice(&b);
    }

    pub fn random_zero(&mut self, dev: &Device, rng: &mut Rng, max_len: u64) {
        let (off, len) = self.pick(rng, max_len);
        dev.zero(len, off)
            .unwrap_or_else(|e| panic!("zero of {len} at {off}: {e}"));
        self.data[off as usize..(off + len) as usize].fill(0);
    }

    /// A random read checked against the model.
    pub fn random_check(&self, dev: &Device, rng: &mut Rng, max_len: u64) {
        let (off, len) = self.pick(rng, max_len);
        self.check(dev, off, len);
    }

    pub fn check(&self, dev: &Device, off: u64, len: u64) {
        let mut b = vec![0u8; len as usize];
        dev.read(&mut b, off)
            .unwrap_or_else(|e| panic!("read of {len} at {off}: {e}"));
        let want = &self.data[off as usize..(off + len) as usize];
        if b != want {
            let first = b.iter().zip(want).position(|(a, w)| a != w).unwrap_or(0) as u64;
            panic!(
                "device differs from the model at byte {} (read of {len} at {off})",
                off + first
            );
        }
    }

    /// Reads the device extent by extent (`extent` bytes each): each
    /// reads as the model has it, or fails with EIO; the extents that
    /// failed, with their errors' text.
    pub fn failing_extents(&self, dev: &Device, extent: u64) -> Vec<(u64, String)> {
        let mut failed = Vec::new();
        for e in 0..self.data.len() as u64 / extent {
            let mut b = vec![0u8; extent as usize];
            match dev.read(&mut b, e * extent) {
                Ok(()) => assert!(
                    b == self.data[(e * extent) as usize..((e + 1) * extent) as usize],
                    "extent {e} reads back wrong"
                ),
                Err(err) => {
                    assert_eq!(err.errno(), libc::EIO, "{err}");
                    failed.push((e, err.to_string()));
                }
            }
        }
        failed
    }

    /// Reads the whole device in `chunk`-sized pieces and compares.
    pub fn check_all(&self, dev: &Device, chunk: u64) {
        let size = self.data.len() as u64;
        let mut off = 0;
        while off < size {
            let n = chunk.min(size - off);
            self.check(dev, off, n);
            off += n;
        }
    }
}

/// How a test fails a donor: SIGKILL, or SIGSTOP (a hung donor).
#[derive(Clone, Copy, PartialEq)]
pub enum Fault {
    Kill,
    Hang,
}

impl Fault {
    pub fn apply(self, donor: &mut Nbdkit) {
        match self {
            Fault::Kill => donor.kill9(),
            Fault::Hang => donor.stop(),
        }
    }
}

/// Two threads of random I/O, each on its half of the device: random
/// writes and checks of up to `max_len` bytes, and `group`-aligned writes of
/// one whole `group` (parity groups, stripes), 300 operations each.
pub struct Workers(Vec<JoinHandle<Model>>);

impl Workers {
    /// Starts the threads; returns once 100 operations are done, so that a
    /// fault injected next lands with I/O in flight.
    pub fn start(dev: &Arc<Device>, model: &Model, group: u64, max_len: u64, seed: u64) -> Workers {
        let size = model.data.len() as u64;
        let ops = Arc::new(AtomicU64::new(0));
        let handles = (0..2u64)
            .map(|t| {
                let (dev, ops) = (dev.clone(), ops.clone());
                let mut m = model.region(t * size / 2, (t + 1) * size / 2);
                std::thread::spawn(move || {
                    let mut rng = Rng::new(seed * 100 + t);
                    for _ in 0..300 {
                        match rng.below(5) {
                            0 | 1 => m.random_write(&dev, &mut rng, max_len),
                            2 => m.aligned_write(&dev, &mut rng, group, group),
                            _ => m.random_check(&dev, &mut rng, max_len),
                        }
                        ops.fetch_add(1, Ordering::Relaxed);
                    }
                    m
                })
            })
            .collect();
        while ops.load(Ordering::Relaxed) < 100 {
            std::thread::yield_now();
        }
        Workers(handles)
    }

    /// Waits for both threads and takes their halves into `model`.
    pub fn join(self, model: &mut Model) {
        for w in self.0 {
            model.merge(&w.join().expect("no I/O error reaches the caller"));
        }
    }
}
