//! The donor's page store: one sparse, sharded page table per export, a
//! budget shared by all exports, and a coarse last-touched stamp per page.
//!
//! Pages are 4 KiB from the donor's slabs ([`crate::slab`]), allocated on
//! the first write that needs them and initialised right then: zeroed
//! (unless fresh from a new slab, hence zeros already), or filled with the
//! write's data when it covers the whole page. So unwritten ranges read as
//! zeros and a page handed to one export can never show bytes another
//! export freed (initialise on allocation: freeing is then just giving the
//! page back, and a slab returned to the kernel is not touched twice). Trim
//! and zero free whole pages and zero the covered part of a partial page
//! (freeing it too once it is all zeros).
//!
//! Layout and concurrency: pages are kept in groups of 16 (64 KiB), and an
//! export's groups are spread over [`SHARDS`] read-write locks by a hash of
//! the group index, so parallel requests rarely meet on a lock and a
//! request within one group takes one lock and one hash lookup. A write or
//! discard that spans several shards locks them all in ascending order
//! (no deadlock) so that it is atomic: a write first counts the pages it
//! must add, takes them from the budget, allocates them, and only then
//! copies data, so a refused or failed write changes nothing.

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use netpager_util::RwLockExt;

use crate::config::{ExportSpec, PAGE_SIZE};
use crate::slab::Slabs;
use crate::sys::Page;

const PAGE: u64 = PAGE_SIZE as u64;
/// Pages of one group: a group lives in one shard.
const GROUP_PAGES: u64 = 16;
/// Shards per export (a power of two).
pub const SHARDS: usize = 256;
/// Length of one age tick: page stamps count ticks since the donor started.
pub const TICK_MS: u64 = 100;
/// Groups a shard's table keeps room for without shrinking.
const MIN_TABLE: usize = 64;
/// Stamp of a page allocated by a write that has not finished yet.
const NEW_PAGE: u32 = u32::MAX;

/// Folded multiply: a cheap hash whose high and low bits both mix.
fn mix(x: u64) -> u64 {
    let m = u128::from(x) * 0x9E37_79B9_7F4A_7C15_u128;
    (m as u64) ^ ((m >> 64) as u64)
}

/// Hasher for group indices (SipHash would cost more than the page copy).
#[derive(Default)]
struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = mix(self.0 ^ u64::from(*b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = mix(x ^ 0x5851_F42D_4C95_7F2D);
    }
}

/// Up to [`GROUP_PAGES`] consecutive pages and their stamps.
struct Group {
    data: [Option<Page>; GROUP_PAGES as usize],
    /// Tick of each page's last read or write (relaxed: a coarse hint).
    stamps: [AtomicU32; GROUP_PAGES as usize],
    live: u32,
}

/// The pages of one shard, by group: one hash lookup finds a page's group
/// and an index its slot, so a lookup costs about one cache miss besides
/// the data, and the tables stay small enough to mostly stay cached.
#[derive(Default)]
struct PageMap(HashMap<u64, Group, BuildHasherDefault<PageHasher>>);

fn slot(page: u64) -> usize {
    (page % GROUP_PAGES) as usize
}

impl PageMap {
    fn get(&self, page: u64) -> Option<(&[u8; PAGE_SIZE], &AtomicU32)> {
        let g = self.0.get(&(page / GROUP_PAGES))?;
        let i = slot(page);
        g.data[i].as_deref().map(|d| (d, &g.stamps[i]))
    }

    fn get_mut(&mut self, page: u64) -> Option<(&mut [u8; PAGE_SIZE], &mut u32)> {
        let g = self.0.get_mut(&(page / GROUP_PAGES))?;
        let i = slot(page);
        g.data[i].as_deref_mut().map(|d| (d, g.stamps[i].get_mut()))
    }

    fn contains(&self, page: u64) -> bool {
        self.get(page).is_some()
    }

    /// Stores a new page at an empty slot; gives the page back when the
    /// table cannot grow (out of memory).
    fn try_insert(&mut self, page: u64, data: Page, stamp: u32) -> Result<(), Page> {
        let key = page / GROUP_PAGES;
        if !self.0.contains_key(&key) && self.0.try_reserve(1).is_err() {
            return Err(data);
        }
        let g = self.0.entry(key).or_insert_with(|| Group {
            data: [const { None }; GROUP_PAGES as usize],
            stamps: [const { AtomicU32::new(0) }; GROUP_PAGES as usize],
            live: 0,
        });
        let i = slot(page);
        debug_assert!(g.data[i].is_none(), "page {page} is stored already");
        g.data[i] = Some(data);
        g.live += 1;
        *g.stamps[i].get_mut() = stamp;
        Ok(())
    }

    /// Takes a page out of the table, for the caller to give back.
    fn remove(&mut self, page: u64) -> Option<Page> {
        let key = page / GROUP_PAGES;
        let g = self.0.get_mut(&key)?;
        let data = g.data[slot(page)].take()?;
        g.live -= 1;
        if g.live == 0 {
            self.0.remove(&key);
            // A table does not shrink by itself: trimmed exports would keep
            // their peak's tables. Shrinking at a quarter full to half full
            // keeps the rehashing amortised.
            let cap = self.0.capacity();
            if cap > MIN_TABLE && self.0.len() < cap / 4 {
                self.0.shrink_to(self.0.len() * 2);
            }
        }
        Some(data)
    }

    /// Stamps of all pages held.
    fn stamps(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.values().flat_map(|g| {
            g.data
                .iter()
                .zip(&g.stamps)
                .filter(|(d, _)| d.is_some())
                .map(|(_, s)| s.load(Relaxed))
        })
    }
}

fn shard_of(page: u64) -> usize {
    (mix(page / GROUP_PAGES) as usize) & (SHARDS - 1)
}

/// A page from `slabs` holding `full` (a whole page of data), or zeros;
/// `None` when memory is exhausted.
fn new_page(slabs: &Slabs, full: Option<&[u8]>) -> Option<Page> {
    // Filled after the allocator is unlocked: the first touch of a fresh
    // slab faults in (and zeroes) up to 2 MiB, which must not stall the
    // other writers.
    let (mut page, fresh) = slabs.lock().take().ok()?;
    match full {
        Some(data) => page.copy_from_slice(data),
        None if !fresh => page.fill(0),
        None => {}
    }
    Some(page)
}

/// Why a request failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("export {export}: {len} bytes at offset {offset} run past its end ({size} bytes)")]
    OutOfRange {
        export: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("export {export}: write at offset {offset} needs {needed} new page(s) but the donor is draining")]
    Draining {
        export: String,
        offset: u64,
        needed: u64,
    },
    #[error("export {export}: write at offset {offset} needs {needed} new page(s), {free} of the budget's {limit} pages are free")]
    NoSpace {
        export: String,
        offset: u64,
        needed: u64,
        free: u64,
        limit: u64,
    },
    #[error("export {export}: out of memory allocating a page for offset {offset}")]
    NoMemory { export: String, offset: u64 },
}

impl StoreError {
    /// The errno nbdkit sends to the client.
    pub fn errno(&self) -> i32 {
        match self {
            StoreError::OutOfRange { .. } => libc::EINVAL,
            StoreError::Draining { .. } | StoreError::NoSpace { .. } => libc::ENOSPC,
            StoreError::NoMemory { .. } => libc::ENOMEM,
        }
    }
}

/// Why an export could not be opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OpenError {
    #[error("export {name} exists with size {existing} bytes; cannot open it with size {asked}")]
    SizeMismatch {
        name: String,
        existing: u64,
        asked: u64,
    },
    #[error("cannot create export {name}: this donor already serves the maximum of {max} exports")]
    TooMany { name: String, max: usize },
}

enum Refusal {
    Draining,
    Full { free: u64 },
}

/// Page budget shared by all exports of a donor.
pub struct Budget {
    limit: u64,
    used: AtomicU64,
    refusing: AtomicBool,
}

impl Budget {
    pub fn new(limit_pages: u64) -> Self {
        Budget {
            limit: limit_pages,
            used: AtomicU64::new(0),
            refusing: AtomicBool::new(false),
        }
    }

    pub fn limit_pages(&self) -> u64 {
        self.limit
    }

    pub fn used_pages(&self) -> u64 {
        self.used.load(Relaxed)
    }

    /// While refusing (draining), no new page is handed out.
    pub fn set_refusing(&self, refusing: bool) {
        self.refusing.store(refusing, Relaxed);
    }

    pub fn refusing(&self) -> bool {
        self.refusing.load(Relaxed)
    }

    fn take(&self, n: u64) -> Result<(), Refusal> {
        if n == 0 {
            return Ok(());
        }
        if self.refusing() {
            return Err(Refusal::Draining);
        }
        self.used
            .fetch_update(Relaxed, Relaxed, |u| {
                u.checked_add(n).filter(|t| *t <= self.limit)
            })
            .map(|_| ())
            .map_err(|u| Refusal::Full {
                free: self.limit.saturating_sub(u),
            })
    }

    fn give_back(&self, n: u64) {
        if n > 0 {
            self.used.fetch_sub(n, Relaxed);
        }
    }
}

/// The part of page `p` that a request `[offset, offset+len)` covers:
/// (range within the page, range within the request buffer).
fn piece(p: u64, offset: u64, len: u64) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let start = p * PAGE;
    let lo = offset.max(start);
    let hi = (offset + len).min(start + PAGE);
    (
        ((lo - start) as usize)..((hi - start) as usize),
        ((lo - offset) as usize)..((hi - offset) as usize),
    )
}

/// Write access to the shards a request needs.
trait Maps {
    fn map(&mut self, page: u64) -> &mut PageMap;
}

struct OneShard<'a>(RwLockWriteGuard<'a, PageMap>);

impl Maps for OneShard<'_> {
    fn map(&mut self, _page: u64) -> &mut PageMap {
        &mut self.0
    }
}

struct ManyShards<'a> {
    ids: Vec<usize>,
    guards: Vec<RwLockWriteGuard<'a, PageMap>>,
}

impl Maps for ManyShards<'_> {
    fn map(&mut self, page: u64) -> &mut PageMap {
        let i = self
            .ids
            .binary_search(&shard_of(page))
            .expect("shard of a page in range is locked");
        &mut self.guards[i]
    }
}

/// One export: a sparse array of pages, shared by every connection that
/// opens its name.
pub struct Export {
    name: String,
    size: u64,
    used: AtomicU64,
    shards: Box<[RwLock<PageMap>]>,
    budget: Arc<Budget>,
    slabs: Arc<Slabs>,
}

impl Export {
    fn new(name: String, size: u64, budget: Arc<Budget>, slabs: Arc<Slabs>) -> Self {
        let shards = (0..SHARDS)
            .map(|_| RwLock::new(PageMap::default()))
            .collect();
        Export {
            name,
            size,
            used: AtomicU64::new(0),
            shards,
            budget,
            slabs,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn used_pages(&self) -> u64 {
        self.used.load(Relaxed)
    }

    fn read_shard(&self, page: u64) -> RwLockReadGuard<'_, PageMap> {
        // A panic while holding a shard cannot leave a page half-linked:
        // the map is only changed by complete insert/remove calls.
        self.shards[shard_of(page)].read_or_recover()
    }

    fn write_shard(&self, shard: usize) -> RwLockWriteGuard<'_, PageMap> {
        self.shards[shard].write_or_recover()
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), StoreError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(StoreError::OutOfRange {
                export: self.name.clone(),
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Pages `first..=last` of a non-empty request.
    fn pages(offset: u64, len: u64) -> (u64, u64) {
        (offset / PAGE, (offset + len - 1) / PAGE)
    }

    /// Runs `f` with write locks on every shard holding pages
    /// `first..=last`, taken in ascending shard order.
    fn with_shards<R>(&self, first: u64, last: u64, f: impl FnOnce(&mut dyn Maps) -> R) -> R {
        let (g0, g1) = (first / GROUP_PAGES, last / GROUP_PAGES);
        if g0 == g1 {
            return f(&mut OneShard(self.write_shard(shard_of(first))));
        }
        let mut ids: Vec<usize> = if g1 - g0 >= SHARDS as u64 {
            (0..SHARDS).collect()
        } else {
            (g0..=g1).map(|g| shard_of(g * GROUP_PAGES)).collect()
        };
        ids.sort_unstable();
        ids.dedup();
        let guards = ids.iter().map(|&s| self.write_shard(s)).collect();
        f(&mut ManyShards { ids, guards })
    }

    /// Reads `buf.len()` bytes at `offset`; holes read as zeros.
    pub fn read(&self, buf: &mut [u8], offset: u64, now: u32) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, last) = Self::pages(offset, len);
        let mut p = first;
        while p <= last {
            let group_end = (p / GROUP_PAGES + 1) * GROUP_PAGES - 1;
            let map = self.read_shard(p);
            for q in p..=group_end.min(last) {
                let (in_page, in_buf) = piece(q, offset, len);
                match map.get(q) {
                    Some((data, stamp)) => {
                        buf[in_buf].copy_from_slice(&data[in_page]);
                        if stamp.load(Relaxed) != now {
                            stamp.store(now, Relaxed);
                        }
                    }
                    None => buf[in_buf].fill(0),
                }
            }
            p = group_end + 1;
        }
        Ok(())
    }

    /// Writes `buf` at `offset`. Fails with nothing changed when a page it
    /// needs cannot be had (budget, draining, memory). Zeros written into
    /// a hole need no page.
    pub fn write(&self, buf: &[u8], offset: u64, now: u32) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, last) = Self::pages(offset, len);
        self.with_shards(first, last, |maps| {
            let needs_page = |maps: &mut dyn Maps, q: u64| {
                let (_, in_buf) = piece(q, offset, len);
                !maps.map(q).contains(q) && buf[in_buf].iter().any(|b| *b != 0)
            };
            let needed = (first..=last).filter(|&q| needs_page(maps, q)).count() as u64;
            self.budget.take(needed).map_err(|r| match r {
                Refusal::Draining => StoreError::Draining {
                    export: self.name.clone(),
                    offset,
                    needed,
                },
                Refusal::Full { free } => StoreError::NoSpace {
                    export: self.name.clone(),
                    offset,
                    needed,
                    free,
                    limit: self.budget.limit,
                },
            })?;
            if needed > 0 {
                self.allocate(maps, buf, offset, (first, last), needed, &needs_page)?;
            }
            for q in first..=last {
                let (in_page, in_buf) = piece(q, offset, len);
                if let Some((data, stamp)) = maps.map(q).get_mut(q) {
                    // A new page the write covers whole already has its data.
                    if *stamp != NEW_PAGE || in_page.len() != PAGE_SIZE {
                        data[in_page].copy_from_slice(&buf[in_buf]);
                    }
                    *stamp = now;
                }
            }
            Ok(())
        })
    }

    /// Inserts the `needed` pages a write of `buf` at `offset` reserved in
    /// `pages`, marked [`NEW_PAGE`]: filled with the data when the write
    /// covers them whole (no zeroing to overwrite), else zeroed. On
    /// allocation failure removes them again and returns the budget.
    fn allocate(
        &self,
        maps: &mut dyn Maps,
        buf: &[u8],
        offset: u64,
        (first, last): (u64, u64),
        needed: u64,
        needs_page: &dyn Fn(&mut dyn Maps, u64) -> bool,
    ) -> Result<(), StoreError> {
        for q in first..=last {
            if !needs_page(maps, q) {
                continue;
            }
            let (in_page, in_buf) = piece(q, offset, buf.len() as u64);
            let full = (in_page.len() == PAGE_SIZE).then(|| &buf[in_buf]);
            let stored = match new_page(&self.slabs, full) {
                Some(data) => maps.map(q).try_insert(q, data, NEW_PAGE).map_err(Some),
                None => Err(None),
            };
            if let Err(unstored) = stored {
                let mut alloc = self.slabs.lock();
                if let Some(p) = unstored {
                    alloc.give(p);
                }
                for r in first..q {
                    let m = maps.map(r);
                    if m.get(r).is_some_and(|(_, s)| s.load(Relaxed) == NEW_PAGE) {
                        alloc.give(m.remove(r).expect("the page was just seen"));
                    }
                }
                self.budget.give_back(needed);
                return Err(StoreError::NoMemory {
                    export: self.name.clone(),
                    offset: q * PAGE,
                });
            }
        }
        self.used.fetch_add(needed, Relaxed);
        Ok(())
    }

    /// Trim and zero: frees the whole pages of the range and zeros the
    /// covered part of partial pages (freeing those that end up all zero).
    /// Returns the pages freed. Never needs a new page.
    pub fn discard(&self, offset: u64, len: u64) -> Result<u64, StoreError> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(0);
        }
        let (first, last) = Self::pages(offset, len);
        let freed = self.with_shards(first, last, |maps| {
            let mut freed = 0;
            // Locked at the first page freed: most discards of a swapping
            // client land on holes or whole pages, and many on holes only.
            let mut alloc = None;
            for q in first..=last {
                let (in_page, _) = piece(q, offset, len);
                let map = maps.map(q);
                let now_zero = match map.get_mut(q) {
                    None => continue,
                    Some(_) if in_page.len() == PAGE_SIZE => true,
                    Some((data, _)) => {
                        data[in_page].fill(0);
                        data.iter().all(|b| *b == 0)
                    }
                };
                if now_zero {
                    let page = map.remove(q).expect("the page was just seen");
                    alloc.get_or_insert_with(|| self.slabs.lock()).give(page);
                    freed += 1;
                }
            }
            freed
        });
        self.used.fetch_sub(freed, Relaxed);
        self.budget.give_back(freed);
        Ok(freed)
    }

    /// Reports the range as runs of (offset, length, allocated), looking at
    /// no more than `max_pages` pages (the runs then cover a prefix of the
    /// range, which nbdkit accepts). Stops early when `emit` returns false.
    pub fn extents(
        &self,
        offset: u64,
        len: u64,
        max_pages: u64,
        mut emit: impl FnMut(u64, u64, bool) -> bool,
    ) {
        let end = (offset.saturating_add(len)).min(self.size);
        if offset >= end {
            return;
        }
        if self.used_pages() == 0 {
            emit(offset, end - offset, false);
            return;
        }
        let first = offset / PAGE;
        let last = ((end - 1) / PAGE).min(first.saturating_add(max_pages.max(1) - 1));
        let stop = ((last + 1) * PAGE).min(end);
        let mut run: Option<(u64, bool)> = None;
        let mut p = first;
        while p <= last {
            let group_end = ((p / GROUP_PAGES + 1) * GROUP_PAGES - 1).min(last);
            let map = self.read_shard(p);
            for q in p..=group_end {
                let alloc = map.contains(q);
                match run {
                    Some((_, a)) if a == alloc => {}
                    Some((start, a)) => {
                        let at = q * PAGE;
                        if !emit(start, at - start, a) {
                            return;
                        }
                        run = Some((at, alloc));
                    }
                    None => run = Some((offset, alloc)),
                }
            }
            drop(map);
            p = group_end + 1;
        }
        if let Some((start, a)) = run {
            emit(start, stop - start, a);
        }
    }

    /// Pushes this export's page stamps into `heap`, keeping the `x` smallest.
    fn oldest_stamps(&self, heap: &mut BinaryHeap<u32>, x: usize) {
        for shard in self.shards.iter() {
            let map = shard.read_or_recover();
            for s in map.stamps() {
                if heap.len() < x {
                    heap.push(s);
                } else if heap.peek().is_some_and(|top| s < *top) {
                    heap.pop();
                    heap.push(s);
                }
            }
        }
    }
}

/// Size, name and use of one export, for status replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub name: String,
    pub size: u64,
    pub used_pages: u64,
}

/// All exports of a donor and their common budget.
pub struct Pool {
    budget: Arc<Budget>,
    slabs: Arc<Slabs>,
    exports: RwLock<BTreeMap<String, Arc<Export>>>,
    max_exports: usize,
}

impl Pool {
    pub fn new(limit_pages: u64, max_exports: usize) -> Self {
        Self::with_slabs(limit_pages, max_exports, Slabs::new())
    }

    /// A pool whose pages come from `slabs` (small slabs for unit tests).
    pub fn with_slabs(limit_pages: u64, max_exports: usize, slabs: Slabs) -> Self {
        Pool {
            budget: Arc::new(Budget::new(limit_pages)),
            slabs: Arc::new(slabs),
            exports: RwLock::new(BTreeMap::new()),
            max_exports,
        }
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Bytes of the slabs mapped for pages (see [`Slabs::mapped_bytes`]).
    pub fn mapped_bytes(&self) -> u64 {
        self.slabs.mapped_bytes()
    }

    /// The store of `spec.name`, created on first use with `spec.size` or
    /// `default_size`. Later opens share it; an explicit different size is
    /// refused.
    pub fn open(&self, spec: &ExportSpec, default_size: u64) -> Result<Arc<Export>, OpenError> {
        let check = |e: &Arc<Export>| match spec.size {
            Some(asked) if asked != e.size => Err(OpenError::SizeMismatch {
                name: spec.name.clone(),
                existing: e.size,
                asked,
            }),
            _ => Ok(Arc::clone(e)),
        };
        if let Some(e) = self.exports.read_or_recover().get(&spec.name) {
            return check(e);
        }
        let mut all = self.exports.write_or_recover();
        if let Some(e) = all.get(&spec.name) {
            return check(e);
        }
        if all.len() >= self.max_exports {
            return Err(OpenError::TooMany {
                name: spec.name.clone(),
                max: self.max_exports,
            });
        }
        let e = Arc::new(Export::new(
            spec.name.clone(),
            spec.size.unwrap_or(default_size),
            Arc::clone(&self.budget),
            Arc::clone(&self.slabs),
        ));
        all.insert(spec.name.clone(), Arc::clone(&e));
        Ok(e)
    }

    pub fn usage(&self) -> Vec<Usage> {
        let all = self.exports.read_or_recover();
        all.values()
            .map(|e| Usage {
                name: e.name.clone(),
                size: e.size,
                used_pages: e.used_pages(),
            })
            .collect()
    }

    /// Stamp of the `x`-th oldest page over all exports; with fewer than
    /// `x` pages, of the youngest one; `None` without pages. A scan under
    /// each shard's read lock, for the status thread (never the I/O path).
    pub fn xth_oldest_stamp(&self, x: u64) -> Option<u32> {
        let x = usize::try_from(x).unwrap_or(usize::MAX).max(1);
        let mut heap = BinaryHeap::new();
        let exports: Vec<Arc<Export>> = self.exports.read_or_recover().values().cloned().collect();
        for e in exports {
            e.oldest_stamps(&mut heap, x);
        }
        heap.peek().copied()
    }
}

#[cfg(test)]
mod tests;
