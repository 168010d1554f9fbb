//! Swap-ins that hide the round trip: Leap's stride detector [Leap 2020]
//! on the device's read offsets, and the bounded, locked cache of pages
//! prefetched ahead of the reads it predicts.
//!
//! [`StrideDetector`] is pure policy: it keeps the last [`HISTORY`] deltas
//! between the first pages of successive reads and finds the majority
//! trend, looking at the most recent 4, 8, 16, then all 32 deltas, so a new
//! trend is seen after a few reads and an old one is not forgotten at the
//! first stray read. [`PrefetchCache`] holds the prefetched pages: a page
//! leaves it when it is read (a hit), written (a write replaces it), or
//! pushed out by a newer prefetch when the cache is full (wasted). A read
//! of a page whose prefetch is already on its way waits for it (asking
//! again would be slower); one whose prefetch is still queued does not.
//! Its buffers are allocated once, up front, so the swap path never
//! allocates.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use netpager_util::{CondvarExt, LockExt};

use crate::page_table::PAGE;

/// Deltas the detector remembers (Leap's history window).
pub const HISTORY: usize = 32;
/// The most `prefetch_pages` may ask for (4 MiB ahead, a 32 MiB cache).
pub const MAX_PREFETCH_PAGES: u32 = 1024;
/// The cache holds this many times `prefetch_pages`: room for the pages
/// ahead of several streams, and for a stream's next batch while the kernel
/// still reads the last.
pub const CACHE_PER_PREFETCH: usize = 8;

/// Leap's majority trend over the last reads' first pages.
#[derive(Debug, Clone, Default)]
pub struct StrideDetector {
    last: Option<u64>,
    /// Ring of the last deltas, in pages; `next` is where the next goes.
    deltas: [i64; HISTORY],
    len: usize,
    next: usize,
}

impl StrideDetector {
    pub fn new() -> StrideDetector {
        StrideDetector::default()
    }

    /// Records a read starting at `page`; returns the trend's stride in
    /// pages, if the recent deltas have one (never 0: a re-read is no trend).
    pub fn record(&mut self, page: u64) -> Option<i64> {
        if let Some(last) = self.last.replace(page) {
            self.deltas[self.next] = page.wrapping_sub(last) as i64;
            self.next = (self.next + 1) % HISTORY;
            self.len = (self.len + 1).min(HISTORY);
        }
        self.trend()
    }

    /// The majority of the newest 4, 8, 16 or 32 deltas, smallest window first.
    pub fn trend(&self) -> Option<i64> {
        let mut w = 4;
        while w <= HISTORY {
            if self.len >= w {
                if let Some(d) = self.majority(w) {
                    return (d != 0).then_some(d);
                }
            }
            w *= 2;
        }
        None
    }

    /// Boyer-Moore vote over the newest `w` deltas, confirmed by a count:
    /// the delta that more than half of them share.
    fn majority(&self, w: usize) -> Option<i64> {
        let newest = (0..w).map(|i| self.deltas[(self.next + HISTORY - 1 - i) % HISTORY]);
        let (mut cand, mut votes) = (0i64, 0usize);
        for d in newest.clone() {
            if votes == 0 {
                cand = d;
            }
            votes = if d == cand { votes + 1 } else { votes - 1 };
        }
        (newest.filter(|&d| d == cand).count() * 2 > w).then_some(cand)
    }
}

/// Leap's prefetch window: how many pages to read ahead on a trend. It
/// doubles with each read the cache serves and halves with each read it
/// does not, so a trend that stops paying (stray reads after a stream)
/// soon costs only a page or two per read.
#[derive(Debug, Clone)]
pub struct Window {
    pages: u64,
    max: u64,
}

impl Window {
    /// A window of at most `max` pages, starting at one.
    pub fn new(max: u64) -> Window {
        Window {
            pages: 1.min(max),
            max,
        }
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// A read the cache served.
    pub fn hit(&mut self) {
        self.pages = (self.pages * 2).min(self.max);
    }

    /// A read that went to the donors; `least` is at least what the window
    /// keeps (a read's own length: the next read of the trend).
    pub fn miss(&mut self, least: u64) {
        self.pages = (self.pages / 2).max(least).min(self.max);
    }
}

/// What a prefetch holds the cache slot of a page with.
pub type Ticket = u64;

/// Where a prefetched page is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Queued for the prefetch thread.
    Queued,
    /// Sent to the donors.
    InFlight,
    /// Read ahead, in this buffer.
    Ready(usize),
}

/// A page's place in the cache: the prefetch that took it, and where it is.
struct Slot {
    ticket: Ticket,
    state: State,
}

struct Cache {
    slots: HashMap<u64, Slot>,
    /// Pages in the order their slots were taken, oldest first (entries
    /// of pages since gone are skipped when met).
    order: VecDeque<(u64, Ticket)>,
    buffers: Vec<Box<[u8]>>,
    free: Vec<usize>,
    /// Pages a large write drops, gathered without allocating.
    scratch: Vec<u64>,
    next_ticket: Ticket,
    counters: PrefetchCounters,
}

/// What the cache has done since the device opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchCounters {
    /// Pages read from the donors ahead of a read.
    pub issued: u64,
    /// Pages reads were served from the cache.
    pub hits: u64,
    /// Pages read ahead that left unread: pushed out, replaced by a write,
    /// read from the donors by a read that could not wait, or failed.
    pub wasted: u64,
}

/// How the cache answered a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Served from the cache.
    Hit,
    /// Every page was predicted but not all had come: the trend was right
    /// and the window too short.
    Late,
    /// Not predicted.
    Miss,
}

/// The bounded, locked cache of prefetched pages.
pub struct PrefetchCache {
    inner: Mutex<Cache>,
    /// Signalled when a page in flight arrives or fails.
    arrived: Condvar,
    capacity: usize,
}

impl PrefetchCache {
    /// A cache of `capacity` pages, every buffer allocated now.
    pub fn new(capacity: usize) -> PrefetchCache {
        PrefetchCache {
            inner: Mutex::new(Cache {
                slots: HashMap::with_capacity(capacity * 2),
                order: VecDeque::with_capacity(capacity * 2 + 1),
                buffers: (0..capacity)
                    .map(|_| vec![0u8; PAGE as usize].into_boxed_slice())
                    .collect(),
                free: (0..capacity).rev().collect(),
                scratch: Vec::with_capacity(capacity),
                next_ticket: 1,
                counters: PrefetchCounters::default(),
            }),
            arrived: Condvar::new(),
            capacity,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Takes a slot for `page` unless it has one; when the cache is full
    /// the oldest slot makes room (a page pushed out unread is wasted).
    pub fn reserve(&self, page: u64) -> Option<Ticket> {
        let mut c = self.inner.lock_or_recover();
        if c.slots.contains_key(&page) || self.capacity == 0 {
            return None;
        }
        while c.slots.len() >= self.capacity {
            let (old, t) = c.order.pop_front()?;
            if c.live(old, t) {
                c.drop_range([old]);
            }
        }
        let t = c.next_ticket;
        c.next_ticket += 1;
        c.slots.insert(
            page,
            Slot {
                ticket: t,
                state: State::Queued,
            },
        );
        c.order.push_back((page, t));
        Some(t)
    }

    /// The prefetch thread is about to read `page` for `ticket`: false if
    /// the slot has gone since (a read or write came first), so the thread
    /// skips it.
    pub fn start(&self, page: u64, ticket: Ticket) -> bool {
        let mut c = self.inner.lock_or_recover();
        match c.slots.get_mut(&page) {
            Some(s) if s.ticket == ticket && s.state == State::Queued => {
                s.state = State::InFlight;
                c.counters.issued += 1;
                true
            }
            _ => false,
        }
    }

    /// The prefetch of `ticket` read `data` (one page): kept only if the
    /// slot is still this prefetch's, so a write or read since wins (the
    /// slot was counted as wasted when it went).
    pub fn fill(&self, page: u64, ticket: Ticket, data: &[u8]) {
        let mut c = self.inner.lock_or_recover();
        if c.waiting(page, ticket) {
            // A slot per buffer: a slot not yet ready always has one free.
            let b = c
                .free
                .pop()
                .expect("a free buffer for every slot not ready");
            c.buffers[b].copy_from_slice(data);
            if let Some(s) = c.slots.get_mut(&page) {
                s.state = State::Ready(b);
            }
        }
        drop(c);
        self.arrived.notify_all();
    }

    /// The prefetch of `ticket` failed: its slot goes.
    pub fn cancel(&self, page: u64, ticket: Ticket) {
        let mut c = self.inner.lock_or_recover();
        if c.waiting(page, ticket) {
            c.drop_range([page]);
        }
        drop(c);
        self.arrived.notify_all();
    }

    /// Serves `out` (whole pages from `first`) if every page is ready, or
    /// ready once the pages of it already sent to the donors arrive (at
    /// most `wait`: they would come no sooner if asked again); the pages
    /// leave the cache. Pages still queued are never waited for: then the
    /// caller reads the donors and every slot of the range goes (a
    /// prefetch of it would only bring back what the caller read), and the
    /// answer says whether the read had been predicted.
    pub fn take(&self, first: u64, out: &mut [u8], wait: Duration) -> Take {
        let pages = out.len() as u64 / PAGE;
        let range = first..first + pages;
        let deadline = Instant::now() + wait;
        let mut c = self.inner.lock_or_recover();
        if pages == 0 || !range.clone().all(|p| c.slots.contains_key(&p)) {
            c.drop_range(range);
            return Take::Miss;
        }
        loop {
            let states = range.clone().map(|p| c.slots.get(&p).map(|s| s.state));
            let (mut ready, mut flying) = (true, false);
            for st in states {
                match st {
                    Some(State::Ready(_)) => {}
                    Some(State::InFlight) => (ready, flying) = (false, true),
                    _ => (ready, flying) = (false, false),
                }
                if !ready && !flying {
                    break;
                }
            }
            let now = Instant::now();
            if ready || !flying || now >= deadline {
                if !ready {
                    // Slots gone while waiting make this a miss after all.
                    let all = range.clone().all(|p| c.slots.contains_key(&p));
                    c.drop_range(range);
                    return if all { Take::Late } else { Take::Miss };
                }
                break;
            }
            c = self.arrived.wait_timeout_or_recover(c, deadline - now).0;
        }
        for (i, p) in range.enumerate() {
            if let Some(Slot {
                state: State::Ready(b),
                ..
            }) = c.slots.get(&p)
            {
                let b = *b;
                out[i * PAGE as usize..(i + 1) * PAGE as usize].copy_from_slice(&c.buffers[b]);
            }
            c.remove(p);
            c.counters.hits += 1;
        }
        Take::Hit
    }

    /// A write (zero, trim) to `pages` pages from `first`: their slots go,
    /// wherever they are, so the next read goes to the donors.
    pub fn invalidate(&self, first: u64, pages: u64) {
        let mut c = self.inner.lock_or_recover();
        if c.slots.is_empty() {
            return;
        }
        if pages as usize > c.slots.len() {
            let mut hit = std::mem::take(&mut c.scratch);
            hit.extend(
                c.slots
                    .keys()
                    .copied()
                    .filter(|p| (first..first + pages).contains(p)),
            );
            c.drop_range(hit.drain(..));
            c.scratch = hit;
        } else {
            c.drop_range(first..first + pages);
        }
    }

    pub fn counters(&self) -> PrefetchCounters {
        self.inner.lock_or_recover().counters
    }

    /// Bytes of prefetched pages waiting to be read.
    pub fn ready_bytes(&self) -> u64 {
        let c = self.inner.lock_or_recover();
        (self.capacity - c.free.len()) as u64 * PAGE
    }

    /// Slots taken, queued, in flight or ready.
    pub fn slots(&self) -> usize {
        self.inner.lock_or_recover().slots.len()
    }

    /// Pages predicted and not in the cache yet: queued or being read.
    pub fn pending(&self) -> usize {
        let c = self.inner.lock_or_recover();
        c.slots.len() - (self.capacity - c.free.len())
    }
}

impl Cache {
    /// `page`'s slot is still the one `ticket` took.
    fn live(&self, page: u64, ticket: Ticket) -> bool {
        self.slots.get(&page).is_some_and(|s| s.ticket == ticket)
    }

    /// `page`'s slot is `ticket`'s and its page has not come yet.
    fn waiting(&self, page: u64, ticket: Ticket) -> bool {
        self.slots
            .get(&page)
            .is_some_and(|s| s.ticket == ticket && !matches!(s.state, State::Ready(_)))
    }

    /// The slots of these pages go unread (wasted if they were read).
    fn drop_range(&mut self, pages: impl IntoIterator<Item = u64>) {
        for p in pages {
            if let Some(s) = self.slots.get(&p) {
                if s.state != State::Queued {
                    self.counters.wasted += 1;
                }
                self.remove(p);
            }
        }
    }

    fn remove(&mut self, page: u64) {
        if let Some(Slot {
            state: State::Ready(b),
            ..
        }) = self.slots.remove(&page)
        {
            self.free.push(b);
        }
        // Pages that left by a read or a write leave their entry in the
        // order queue; drop those before it outgrows twice the cache.
        if self.order.len() > 2 * self.buffers.len() {
            let slots = &self.slots;
            self.order
                .retain(|(p, t)| slots.get(p).is_some_and(|s| s.ticket == *t));
        }
    }
}

#[cfg(test)]
mod tests;
