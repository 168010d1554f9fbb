//! The write-back buffer: swap-outs off the critical path (Hermit, NSDI'23;
//! "Scalable Far Memory", SOSP'25: eviction must not wait for the
//! network). A write of whole pages is copied into a bounded buffer of
//! page slots, allocated and touched when it is made (the serving process
//! locks its memory, so the buffer is locked too), and acknowledged; a few
//! drainer threads send the buffered pages to the device in the
//! background, oldest first, each batch a run of consecutive pages (the
//! kernel's swap allocator hands out consecutive slots, so one request
//! carries many pages). A read of a buffered page is served from the
//! buffer; a full buffer makes writers wait for a slot (back-pressure)
//! instead of growing; a flush waits until every page written before it
//! has reached the device, and so does a trim or zero of a buffered page.
//!
//! Every buffered write is acknowledged early: its pages are owed to the
//! device, and a failed drain keeps them and retries them. A device that
//! must acknowledge only what is on the donors (a block device, or a
//! restartable one whose kernel resends what was never answered) has no
//! buffer: handing each write to a drainer and waiting for it cost a
//! block device's 4 KiB random writes 1.5x their latency at one in flight
//! and 30% of their rate at sixteen, for batches it did not need.
//!
//! Swap-ins first: while a read is in flight, drainers hold new batches
//! back unless the buffer is half full, so a swap-in's request never
//! queues behind a batch sent after it on the donors' connections.
//!
//! Consistency without holding a lock across a copy: each slot has its
//! own data lock and a generation that a write bumps once its copy is
//! done. A drainer notes the generation before its copy and frees the
//! slot after the device write only if no write came since (and no reader
//! holds it); otherwise the slot goes back into the queue with its newer
//! bytes. So a page is never sent by two drainers at once, bytes the
//! device has are never older than what it is sent next, and a slot is
//! reused only once nobody can still read it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use netpager_util::trace::{self, Mark};
use netpager_util::{CondvarExt, LockExt};
use serde::{Deserialize, Serialize};

use crate::stages::{StageOp, StageStats};

/// Bytes of a slot: a page.
pub const PAGE: usize = 4096;

/// Most pages one drained batch carries (a request of 128 KiB): longer
/// runs would hold a swap-in that follows them on a donor's connection
/// for longer, for little gain (the request's fixed costs are paid by 32
/// pages already).
pub const MAX_BATCH: usize = 32;

/// Most pages of one read served from the buffer (a FUSE request's most,
/// 1 MiB); a larger read waits for its buffered pages to drain first.
const MAX_READ: usize = 256;

/// Drainer threads: batches in flight at once. Device calls are
/// synchronous, so this many requests are in flight to donors when the
/// runs are short (random write patterns).
pub const DRAINERS: usize = 4;

/// What the buffer drains to and reads through to.
pub trait Sink: Send + Sync {
    fn write(&self, data: &[u8], offset: u64) -> Result<(), SinkError>;
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), SinkError>;
    /// Where a drained batch's stages are counted.
    fn stages(&self) -> Option<&StageStats> {
        None
    }
}

/// A sink's failure: the errno the kernel gets, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SinkError {
    pub errno: i32,
    pub message: String,
}

/// Why a buffered operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteBackError {
    #[error(transparent)]
    Sink(SinkError),
    #[error("a drain of buffered pages failed: {0} (the pages stay buffered and are retried)")]
    Drain(SinkError),
}

impl WriteBackError {
    pub fn errno(&self) -> i32 {
        match self {
            // The drain's own errno: a write that waited for its drain
            // (acknowledged late) learns ENOSPC as ENOSPC, not as EIO.
            WriteBackError::Sink(e) | WriteBackError::Drain(e) => e.errno,
        }
    }
}

impl Sink for std::sync::Arc<crate::device::Device> {
    fn write(&self, data: &[u8], offset: u64) -> Result<(), SinkError> {
        crate::device::Device::write(self, data, offset).map_err(SinkError::from)
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), SinkError> {
        crate::device::Device::read(self, buf, offset).map_err(SinkError::from)
    }
    fn stages(&self) -> Option<&StageStats> {
        Some(&self.stats().stages)
    }
}

impl From<crate::device::DeviceError> for SinkError {
    fn from(e: crate::device::DeviceError) -> Self {
        SinkError {
            errno: e.errno(),
            message: e.to_string(),
        }
    }
}

/// A slot's life: free, holding a page not yet on the device (queued to
/// drain), or being drained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Free,
    Dirty,
    Draining,
}

#[derive(Clone, Copy, Debug)]
struct Meta {
    phase: Phase,
    page: u64,
    /// Bumped by each write once its bytes are in the slot.
    generation: u64,
    /// The sequence number of the last write whose bytes are in the slot.
    seq: u64,
    /// The sequence number from which a write to this page may not be on
    /// the device yet: a flush that began after it must wait for the slot.
    dirty_since: u64,
    /// Readers and writers copying its bytes now: it is not reused.
    pins: u32,
    /// In the drain queue.
    queued: bool,
}

impl Default for Meta {
    fn default() -> Self {
        Meta {
            phase: Phase::Free,
            page: 0,
            generation: 0,
            seq: 0,
            dirty_since: 0,
            pins: 0,
            queued: false,
        }
    }
}

struct State {
    /// Page -> its slot (one slot per page at most).
    index: HashMap<u64, u32>,
    meta: Vec<Meta>,
    free: Vec<u32>,
    /// Slots to drain, oldest first (entries of slots that left the Dirty
    /// phase meanwhile are skipped).
    queue: VecDeque<u32>,
    next_seq: u64,
    /// Demand reads in flight (drainers hold back while there are some).
    reads: usize,
    /// Drains that failed so far, and the last one's reason.
    failures: u64,
    last_failure: Option<SinkError>,
    stopping: bool,
}

impl State {
    /// The error a flush or settle that saw a drain fail returns.
    fn failure(&self) -> WriteBackError {
        WriteBackError::Drain(self.last_failure.clone().unwrap_or(SinkError {
            errno: libc::EIO,
            message: "a drain failed".into(),
        }))
    }
}

/// Counters of a buffer's work, for status and `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    pub capacity_bytes: AtomicU64,
    pub used_bytes: AtomicU64,
    /// Pages written into the buffer (acknowledged there).
    pub pages_in: AtomicU64,
    /// Pages sent to the device, and in how many requests.
    pub pages_drained: AtomicU64,
    pub batches: AtomicU64,
    /// Pages of reads served from the buffer.
    pub read_hits: AtomicU64,
    /// Writes that waited for a free slot.
    pub full_waits: AtomicU64,
    pub drain_failures: AtomicU64,
}

impl Counters {
    pub fn report(&self) -> WriteBackReport {
        WriteBackReport {
            capacity_bytes: self.capacity_bytes.load(Relaxed),
            used_bytes: self.used_bytes.load(Relaxed),
            pages_in: self.pages_in.load(Relaxed),
            pages_drained: self.pages_drained.load(Relaxed),
            batches: self.batches.load(Relaxed),
            read_hits: self.read_hits.load(Relaxed),
            full_waits: self.full_waits.load(Relaxed),
            drain_failures: self.drain_failures.load(Relaxed),
        }
    }
}

/// The buffer in `status.json` (absent when off).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WriteBackReport {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub pages_in: u64,
    pub pages_drained: u64,
    pub batches: u64,
    pub read_hits: u64,
    pub full_waits: u64,
    pub drain_failures: u64,
}

/// A write-back buffer of `slots` pages in front of a [`Sink`].
pub struct WriteBack<S> {
    sink: S,
    data: Vec<Mutex<Box<[u8]>>>,
    st: Mutex<State>,
    /// Writers waiting for a free slot; flushes and settles waiting for
    /// drains.
    drained: Condvar,
    /// Drainers waiting for work.
    work: Condvar,
    counters: Option<std::sync::Arc<Counters>>,
}

impl<S: Sink> WriteBack<S> {
    /// A buffer of `bytes` (whole pages, at least [`MAX_BATCH`]) in front
    /// of `sink`; its pages are written now, so they are really there
    /// (and locked under mlockall). Start its drainers with
    /// [`WriteBack::drain_loop`] on [`DRAINERS`] threads.
    pub fn new(sink: S, bytes: u64, counters: Option<std::sync::Arc<Counters>>) -> WriteBack<S> {
        let slots = (bytes as usize / PAGE).max(MAX_BATCH);
        if let Some(c) = &counters {
            c.capacity_bytes.store((slots * PAGE) as u64, Relaxed);
        }
        WriteBack {
            sink,
            data: (0..slots)
                .map(|_| Mutex::new(vec![0xa5u8; PAGE].into_boxed_slice()))
                .collect(),
            st: Mutex::new(State {
                // Twice the entries: deletions leave tombstones, and a
                // table at most half full rehashes in place, never
                // allocating on the I/O path.
                index: HashMap::with_capacity(2 * slots),
                meta: vec![Meta::default(); slots],
                free: (0..slots as u32).rev().collect(),
                queue: VecDeque::with_capacity(slots),
                next_seq: 1,
                reads: 0,
                failures: 0,
                last_failure: None,
                stopping: false,
            }),
            drained: Condvar::new(),
            work: Condvar::new(),
            counters,
        }
    }

    pub fn sink(&self) -> &S {
        &self.sink
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock_or_recover()
    }

    fn slots(&self) -> usize {
        self.data.len()
    }

    fn count(&self, f: impl FnOnce(&Counters)) {
        if let Some(c) = &self.counters {
            f(c);
        }
    }

    fn set_used(&self, st: &State) {
        self.count(|c| {
            c.used_bytes
                .store(((self.slots() - st.free.len()) * PAGE) as u64, Relaxed)
        });
    }

    /// Whether a write goes through the buffer: whole pages, at most half
    /// of it (and at most a FUSE request's largest).
    fn bufferable(&self, data: &[u8], offset: u64) -> bool {
        offset.is_multiple_of(PAGE as u64)
            && data.len().is_multiple_of(PAGE)
            && data.len() / PAGE <= MAX_READ.min(self.slots() / 2)
    }

    /// A write past the buffer, once no older buffered page of its range
    /// is left to overtake it.
    fn write_through(&self, data: &[u8], offset: u64) -> Result<(), WriteBackError> {
        self.settle(offset, data.len() as u64)?;
        self.sink.write(data, offset).map_err(WriteBackError::Sink)
    }

    /// Writes `data` at `offset`: whole pages that fit are buffered and
    /// acknowledged at once; anything else (a partial page, a write larger
    /// than half the buffer) goes to the sink once the buffered pages it
    /// covers have drained.
    pub fn write(&self, data: &[u8], offset: u64) -> Result<(), WriteBackError> {
        if !self.bufferable(data, offset) {
            return self.write_through(data, offset);
        }
        let first = offset / PAGE as u64;
        for (k, page) in data.chunks(PAGE).enumerate() {
            self.put(first + k as u64, page)?;
        }
        Ok(())
    }

    /// Buffers one page: into its slot if it has one, else into a free
    /// one (waiting for one while the buffer is full).
    ///
    /// A writer waiting for a slot gives up with the drain's error once a
    /// drain fails meanwhile: a device that refuses every page (its donors
    /// gone) would otherwise keep the buffer full and the kernel's write
    /// waiting forever, and with it every request queued behind it.
    fn put(&self, page: u64, bytes: &[u8]) -> Result<(), WriteBackError> {
        let mut st = self.lock();
        let failures = st.failures;
        let slot = loop {
            if let Some(&s) = st.index.get(&page) {
                break s;
            }
            if let Some(s) = st.free.pop() {
                let since = st.next_seq;
                let m = &mut st.meta[s as usize];
                *m = Meta {
                    phase: Phase::Dirty,
                    page,
                    generation: m.generation,
                    dirty_since: since,
                    ..Meta::default()
                };
                st.index.insert(page, s);
                self.set_used(&st);
                break s;
            }
            if st.failures != failures {
                return Err(st.failure());
            }
            self.count(|c| {
                c.full_waits.fetch_add(1, Relaxed);
            });
            self.work.notify_all();
            st = self.drained.wait_or_recover(st);
        };
        st.meta[slot as usize].pins += 1;
        drop(st);
        self.data[slot as usize]
            .lock_or_recover()
            .copy_from_slice(bytes);
        let mut st = self.lock();
        let seq = st.next_seq;
        st.next_seq += 1;
        let m = &mut st.meta[slot as usize];
        m.pins -= 1;
        m.generation += 1;
        m.seq = seq;
        if m.phase == Phase::Dirty && !m.queued {
            m.queued = true;
            st.queue.push_back(slot);
            self.work.notify_one();
        }
        drop(st);
        self.count(|c| {
            c.pages_in.fetch_add(1, Relaxed);
        });
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`: buffered pages from the
    /// buffer, the rest through the sink.
    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), WriteBackError> {
        let first = offset / PAGE as u64;
        let end = offset + buf.len() as u64;
        let last = end.div_ceil(PAGE as u64);
        if last - first > MAX_READ as u64 {
            self.settle(offset, buf.len() as u64)?;
            return self.sink.read(buf, offset).map_err(WriteBackError::Sink);
        }
        // The buffered pages of the range, pinned: they cannot be reused
        // while we copy them (a newer write may still land in them: the
        // read and that write are concurrent, either answer is right).
        let mut held: [Option<(u64, u32)>; MAX_READ] = [None; MAX_READ];
        let mut n = 0;
        let mut all = true;
        {
            let mut st = self.lock();
            st.reads += 1;
            for page in first..last {
                match st.index.get(&page).copied() {
                    Some(s) => {
                        st.meta[s as usize].pins += 1;
                        held[n] = Some((page, s));
                        n += 1;
                    }
                    _ => all = false,
                }
            }
        }
        let r = if all && n > 0 {
            Ok(())
        } else {
            self.sink.read(buf, offset).map_err(WriteBackError::Sink)
        };
        for &(page, s) in held[..n].iter().flatten() {
            let p0 = page * PAGE as u64;
            let (from, to) = (p0.max(offset), (p0 + PAGE as u64).min(end));
            let d = self.data[s as usize].lock_or_recover();
            buf[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&d[(from - p0) as usize..(to - p0) as usize]);
        }
        let mut st = self.lock();
        st.reads -= 1;
        for &(_, s) in held[..n].iter().flatten() {
            st.meta[s as usize].pins -= 1;
        }
        if st.reads == 0 && !st.queue.is_empty() {
            self.work.notify_one();
        }
        drop(st);
        if n > 0 {
            self.count(|c| {
                c.read_hits.fetch_add(n as u64, Relaxed);
            });
        }
        r
    }

    /// Waits until no page of `[offset, offset+len)` is buffered (a trim,
    /// zero or unbuffered write must not be overtaken by an older buffered
    /// page).
    pub fn settle(&self, offset: u64, len: u64) -> Result<(), WriteBackError> {
        let first = offset / PAGE as u64;
        let last = (offset + len).div_ceil(PAGE as u64);
        let mut st = self.lock();
        let failures = st.failures;
        loop {
            let busy = if last - first <= st.index.len() as u64 {
                (first..last).any(|p| st.index.contains_key(&p))
            } else {
                st.index.keys().any(|p| (first..last).contains(p))
            };
            if !busy {
                return Ok(());
            }
            if st.failures != failures {
                return Err(st.failure());
            }
            self.work.notify_all();
            st = self.drained.wait_or_recover(st);
        }
    }

    /// Waits until every page written before this call is on the device
    /// (then the caller flushes the device). Fails if a drain it waits for
    /// fails (the pages stay buffered and are retried).
    pub fn flush(&self) -> Result<(), WriteBackError> {
        let mut st = self.lock();
        let upto = st.next_seq;
        let failures = st.failures;
        loop {
            let waiting = st
                .meta
                .iter()
                .any(|m| m.phase != Phase::Free && m.dirty_since < upto);
            if !waiting {
                return Ok(());
            }
            if st.failures != failures {
                return Err(st.failure());
            }
            self.work.notify_all();
            st = self.drained.wait_or_recover(st);
        }
    }

    /// Pages buffered now.
    pub fn buffered(&self) -> usize {
        self.lock().index.len()
    }

    /// Stops the drainers once the buffer is empty (a detach: the caller
    /// flushes first).
    pub fn stop(&self) {
        self.lock().stopping = true;
        self.work.notify_all();
    }

    /// A drainer: sends batches until [`WriteBack::stop`] and the buffer is
    /// empty. Holds a staging buffer of [`MAX_BATCH`] pages.
    pub fn drain_loop(&self) {
        let mut staging = vec![0xa5u8; MAX_BATCH * PAGE].into_boxed_slice();
        let mut batch: [(u32, u64, u64); MAX_BATCH] = [(0, 0, 0); MAX_BATCH];
        loop {
            let (first, n) = {
                let mut st = self.lock();
                loop {
                    let full = self.slots() - st.free.len() >= self.slots() / 2;
                    if !st.queue.is_empty() && (st.reads == 0 || full) {
                        if let Some(b) = self.take_batch(&mut st, &mut batch) {
                            break b;
                        }
                        continue;
                    }
                    if st.stopping && st.index.is_empty() {
                        return;
                    }
                    st = self.work.wait_or_recover(st);
                }
            };
            trace::start(Instant::now());
            for (k, &(slot, _, _)) in batch[..n].iter().enumerate() {
                staging[k * PAGE..(k + 1) * PAGE]
                    .copy_from_slice(&self.data[slot as usize].lock_or_recover());
            }
            trace::mark(Mark::Device);
            let r = self.sink.write(&staging[..n * PAGE], first * PAGE as u64);
            trace::mark(Mark::Done);
            self.finish_batch(&batch[..n], r);
            trace::mark(Mark::Committed);
            if let (Some(marks), Some(stages)) = (trace::finish(), self.sink.stages()) {
                stages.record(StageOp::Drain, &marks);
            }
        }
    }

    /// Takes the oldest queued page and the run of buffered pages around
    /// it (up to [`MAX_BATCH`]) for a drain: their (slot, generation, seq)
    /// go to `batch`; returns (first page, count), or `None` when the
    /// queue's head was stale.
    fn take_batch(
        &self,
        st: &mut State,
        batch: &mut [(u32, u64, u64); MAX_BATCH],
    ) -> Option<(u64, usize)> {
        let head = st.queue.pop_front()?;
        st.meta[head as usize].queued = false;
        if st.meta[head as usize].phase != Phase::Dirty {
            return None;
        }
        let page = st.meta[head as usize].page;
        let dirty = |st: &State, p: u64| -> Option<u32> {
            let s = *st.index.get(&p)?;
            (st.meta[s as usize].phase == Phase::Dirty).then_some(s)
        };
        let mut first = page;
        while page - first < MAX_BATCH as u64 / 2 && first > 0 && dirty(st, first - 1).is_some() {
            first -= 1;
        }
        let mut n = 0;
        while n < MAX_BATCH {
            let Some(s) = dirty(st, first + n as u64) else {
                break;
            };
            let m = &mut st.meta[s as usize];
            m.phase = Phase::Draining;
            batch[n] = (s, m.generation, m.seq);
            n += 1;
        }
        Some((first, n))
    }

    /// After a batch's device write: slots nobody wrote or holds since are
    /// freed; the others go back to the queue (with their newer bytes, or
    /// all of them when the write failed).
    fn finish_batch(&self, batch: &[(u32, u64, u64)], r: Result<(), SinkError>) {
        let mut st = self.lock();
        let ok = r.is_ok();
        if let Err(e) = r {
            st.failures += 1;
            st.last_failure = Some(e);
            self.count(|c| {
                c.drain_failures.fetch_add(1, Relaxed);
            });
        }
        for &(slot, generation, seq) in batch {
            let m = st.meta[slot as usize];
            if ok && m.pins == 0 && m.generation == generation {
                st.index.remove(&m.page);
                st.meta[slot as usize].phase = Phase::Free;
                st.free.push(slot);
                continue;
            }
            let m = &mut st.meta[slot as usize];
            m.phase = Phase::Dirty;
            if ok {
                // Everything up to `seq` is on the device now.
                m.dirty_since = seq + 1;
            }
            if !m.queued {
                m.queued = true;
                st.queue.push_back(slot);
            }
        }
        self.set_used(&st);
        let failed_pause = !ok;
        drop(st);
        if ok {
            self.count(|c| {
                c.pages_drained.fetch_add(batch.len() as u64, Relaxed);
                c.batches.fetch_add(1, Relaxed);
            });
        }
        self.drained.notify_all();
        if failed_pause {
            // The device refuses now (a donor down, no room): try again
            // shortly rather than spin on it.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(test)]
mod tests;
