//! One export's pages: reads, writes and discards against its sharded
//! page table, each page kept as the donor's codec says ([`Entry`]).
//!
//! A write (or a discard that zeroes part of a page) runs in three
//! phases under the write locks of every shard it touches: it *plans*
//! each page's new form (the whole page, read back and patched when the
//! request covers only part of it; then nothing, a repeated word, a
//! compressed object or the raw page), *allocates* what the plan needs
//! that the page does not have yet (budget first, raw pages counted at
//! once, then objects one by one; on any refusal everything taken is
//! given back and nothing has changed), then *commits*: new entries
//! replace old ones, which are freed. A page whose new form fits where
//! it already is (raw over raw, an object of the same class and codec) is
//! rewritten in place, so an overwrite needs no memory beyond what it frees.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use netpager_util::{panic_message, RwLockExt};

use super::budget::Refusal;
use super::codec::{self, Compress};
use super::table::{mix, Entry, PageMap, GROUP_PAGES};
use super::zs::AllocError;
use super::{Backing, StoreError, PAGE, SHARDS};
use crate::config::PAGE_SIZE;

mod evacuate;
mod recompress;

pub use recompress::Recompressed;

fn shard_of(page: u64) -> usize {
    (mix(page / GROUP_PAGES) as usize) & (SHARDS - 1)
}

/// The part of page `p` that a request `[offset, offset+len)` covers:
/// (range within the page, range within the request buffer).
fn piece(p: u64, offset: u64, len: u64) -> (Range<usize>, Range<usize>) {
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

/// Bytes a page's new form comes from.
#[derive(Clone)]
enum Bytes {
    /// The request's buffer (a page it covers whole).
    Buf(Range<usize>),
    /// The plan's scratch space (a patched page, an object).
    Scratch(Range<usize>),
}

/// What [`Export::encode`] made of a page.
enum Form {
    Hole,
    Same(u64),
    Packed(usize),
    Raw,
}

/// A page's form after the request.
enum Target {
    Hole,
    Same(u64),
    Packed(Range<usize>),
    Raw(Bytes),
}

struct Step {
    page: u64,
    target: Target,
    /// Rewritten where it is, without a new allocation.
    in_place: bool,
    /// What phase 2 allocated for it (taken by the commit).
    fresh: Option<Entry>,
}

/// Entries to free, giving raw pages back under one slabs lock.
struct Freer<'a> {
    back: &'a Backing,
    alloc: Option<crate::slab::Alloc<'a>>,
    raw: u64,
}

impl<'a> Freer<'a> {
    fn new(back: &'a Backing) -> Self {
        Freer {
            back,
            alloc: None,
            raw: 0,
        }
    }

    fn free(&mut self, e: Entry) {
        match e {
            Entry::Raw(p) => {
                self.alloc
                    .get_or_insert_with(|| self.back.slabs.lock())
                    .give(p);
                self.raw += 1;
            }
            Entry::Packed(h) | Entry::Cold(h) => {
                // A class lock comes before the slabs' lock.
                self.alloc = None;
                self.back.zs.free(h);
            }
            Entry::Same(_) => {}
        }
    }
}

impl Drop for Freer<'_> {
    fn drop(&mut self) {
        self.alloc = None;
        self.back.budget.give_back(self.raw);
    }
}

/// One export: a sparse array of pages, shared by every connection that
/// opens its name.
pub struct Export {
    pub(super) name: String,
    pub(super) size: u64,
    /// Pages held (every entry: raw, packed or repeated word).
    logical: AtomicU64,
    /// Bytes those entries take: a page raw, a class's size packed.
    stored: AtomicU64,
    shards: Box<[RwLock<PageMap>]>,
    back: Arc<Backing>,
    /// Set when a request panicked in this export (see [`Export::guarded`]).
    broken: OnceLock<String>,
}

impl Export {
    pub(super) fn new(name: String, size: u64, back: Arc<Backing>) -> Self {
        let shards = (0..SHARDS)
            .map(|_| RwLock::new(PageMap::default()))
            .collect();
        Export {
            name,
            size,
            logical: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            shards,
            back,
            broken: OnceLock::new(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Runs one request on this export. A panic in it (a bug) shuts this
    /// export instead of aborting nbdkit: the request may have left its
    /// pages half-changed, so from then on every request gets
    /// [`StoreError::Broken`] (EIO; the client fails the member and
    /// rebuilds it from the other copies), while the donor's other
    /// exports, other devices' pages, go on being served. Unwinding out of
    /// an nbdkit callback would abort the process and lose them all.
    pub fn guarded<R>(
        &self,
        f: impl FnOnce(&Export) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        if let Some(why) = self.broken.get() {
            return Err(self.shut(why));
        }
        match catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(r) => r,
            Err(p) => {
                let why = self.broken.get_or_init(|| match panic_message(&*p) {
                    "" => "a panic without a message".to_string(),
                    m => m.to_string(),
                });
                Err(self.shut(why))
            }
        }
    }

    fn shut(&self, why: &str) -> StoreError {
        StoreError::Broken {
            export: self.name.clone(),
            why: why.to_string(),
        }
    }

    /// Why this export is shut, if a request panicked in it.
    pub fn broken(&self) -> Option<&str> {
        self.broken.get().map(String::as_str)
    }

    /// Pages holding data (a page of zeros is none).
    pub fn logical_pages(&self) -> u64 {
        self.logical.load(Relaxed)
    }

    /// Bytes this export's pages take in the store (its share; the
    /// donor's `used` adds what its zspages leave free).
    pub fn stored_bytes(&self) -> u64 {
        self.stored.load(Relaxed)
    }

    fn weight(&self, e: &Entry) -> u64 {
        match e {
            Entry::Raw(_) => PAGE,
            Entry::Packed(h) | Entry::Cold(h) => self.back.zs.class_size(*h) as u64,
            Entry::Same(_) => 0,
        }
    }

    fn read_shard(&self, page: u64) -> RwLockReadGuard<'_, PageMap> {
        // A shard poisoned by a panic is never read again: the panic shut
        // the export (see `guarded`) before any other request could.
        self.shards[shard_of(page)].read_or_recover()
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
            return f(&mut OneShard(
                self.shards[shard_of(first)].write_or_recover(),
            ));
        }
        let mut ids: Vec<usize> = if g1 - g0 >= SHARDS as u64 {
            (0..SHARDS).collect()
        } else {
            (g0..=g1).map(|g| shard_of(g * GROUP_PAGES)).collect()
        };
        ids.sort_unstable();
        ids.dedup();
        let guards = ids
            .iter()
            .map(|&s| self.shards[s].write_or_recover())
            .collect();
        f(&mut ManyShards { ids, guards })
    }

    fn corrupt(&self, page: u64, e: codec::CorruptObject) -> StoreError {
        StoreError::Corrupt {
            export: self.name.clone(),
            offset: page * PAGE,
            why: e.to_string(),
        }
    }

    /// The whole page an entry holds, into `out`.
    fn load(&self, e: Option<&Entry>, page: u64, out: &mut [u8]) -> Result<(), StoreError> {
        match e {
            None => out.fill(0),
            Some(Entry::Raw(p)) => out.copy_from_slice(&p[..]),
            Some(Entry::Same(w)) => codec::fill_same(out, *w, 0),
            Some(Entry::Packed(h)) => self
                .back
                .zs
                .read(*h, |o| codec::decompress(self.back.codec, o, out))
                .map_err(|e| self.corrupt(page, e))?,
            Some(Entry::Cold(h)) => self
                .back
                .zs
                .read(*h, |o| codec::decompress(Compress::Zstd, o, out))
                .map_err(|e| self.corrupt(page, e))?,
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`; holes read as zeros. A page
    /// read whole decompresses straight into `buf`.
    pub fn read(&self, buf: &mut [u8], offset: u64, now: u32) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, last) = Self::pages(offset, len);
        let mut tmp = [0u8; PAGE_SIZE];
        let mut p = first;
        while p <= last {
            let group_end = (p / GROUP_PAGES + 1) * GROUP_PAGES - 1;
            let map = self.read_shard(p);
            for q in p..=group_end.min(last) {
                let (in_page, in_buf) = piece(q, offset, len);
                let Some((e, stamp)) = map.get(q) else {
                    buf[in_buf].fill(0);
                    continue;
                };
                match e {
                    Entry::Raw(data) => buf[in_buf].copy_from_slice(&data[in_page]),
                    Entry::Same(w) => codec::fill_same(&mut buf[in_buf], *w, in_page.start),
                    Entry::Packed(_) | Entry::Cold(_) if in_page.len() == PAGE_SIZE => {
                        self.load(Some(e), q, &mut buf[in_buf])?
                    }
                    Entry::Packed(_) | Entry::Cold(_) => {
                        self.load(Some(e), q, &mut tmp)?;
                        buf[in_buf].copy_from_slice(&tmp[in_page]);
                    }
                }
                if stamp.load(Relaxed) != now {
                    stamp.store(now, Relaxed);
                }
            }
            p = group_end + 1;
        }
        Ok(())
    }

    /// The form `content` takes; an object's bytes go to `out`.
    fn encode(&self, content: &[u8], out: &mut [u8; codec::BOUND]) -> Form {
        let codec = self.back.codec;
        match codec::same_filled(content) {
            Some(0) => return Form::Hole,
            Some(w) if codec != Compress::Off => return Form::Same(w),
            _ => {}
        }
        match codec::compress(codec, content, out, self.back.zs.max_packed()) {
            Some(n) => Form::Packed(n),
            None => Form::Raw,
        }
    }

    /// Phase 1: each page's target. `patch` gives the bytes of a page the
    /// request covers in part (the old page patched), `whole` the range
    /// of `buf` for a page it covers whole.
    fn plan(
        &self,
        maps: &mut dyn Maps,
        pages: impl Iterator<Item = (u64, Range<usize>, Range<usize>)>,
        buf: &[u8],
        discard: bool,
        scratch: &mut Vec<u8>,
    ) -> Result<Vec<Step>, StoreError> {
        let mut steps = Vec::new();
        let mut out = [0u8; codec::BOUND];
        for (q, in_page, in_buf) in pages {
            let old = maps.map(q).get(q).map(|(e, _)| e);
            let src = if in_page.len() == PAGE_SIZE && !discard {
                Bytes::Buf(in_buf)
            } else {
                let at = scratch.len();
                scratch.resize(at + PAGE_SIZE, 0);
                self.load(old, q, &mut scratch[at..])?;
                let patch = &mut scratch[at + in_page.start..at + in_page.end];
                if discard {
                    patch.fill(0);
                } else {
                    patch.copy_from_slice(&buf[in_buf]);
                }
                Bytes::Scratch(at..at + PAGE_SIZE)
            };
            let content = match &src {
                Bytes::Buf(r) => &buf[r.clone()],
                Bytes::Scratch(r) => &scratch[r.clone()],
            };
            let mut target = match self.encode(content, &mut out) {
                Form::Hole => Target::Hole,
                Form::Same(w) => Target::Same(w),
                Form::Raw => Target::Raw(src.clone()),
                Form::Packed(n) => {
                    let at = scratch.len();
                    scratch.extend_from_slice(&out[..n]);
                    Target::Packed(at..at + n)
                }
            };
            let in_place = match (old, &mut target) {
                (None, _) => false,
                (Some(Entry::Raw(_)), Target::Raw(_)) => true,
                // A discard never needs memory for a raw page: it stays raw.
                (Some(Entry::Raw(_)), t @ Target::Packed(_)) if discard => {
                    *t = Target::Raw(src);
                    true
                }
                (Some(Entry::Packed(h)), Target::Packed(r)) => {
                    self.back.zs.same_class(*h, r.len())
                        || (discard && r.len() <= self.back.zs.class_size(*h))
                }
                _ => false,
            };
            steps.push(Step {
                page: q,
                target,
                in_place,
                fresh: None,
            });
        }
        Ok(steps)
    }

    fn refused(&self, why: Refusal, offset: u64, needed: u64) -> StoreError {
        match why {
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
                limit: self.back.budget.limit_pages(),
            },
        }
    }

    /// Runs `f`, and once more after compacting if the budget was full.
    fn retry_compacted<T>(
        &self,
        mut f: impl FnMut() -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        match f() {
            Err(AllocError::Refused {
                why: Refusal::Full { .. },
                ..
            }) if self.back.zs.compact() > 0 => f(),
            r => r,
        }
    }

    /// Phase 2: takes the memory the plan needs. On failure gives back
    /// everything it took and returns why.
    fn allocate(
        &self,
        maps: &mut dyn Maps,
        steps: &mut [Step],
        buf: &[u8],
        scratch: &[u8],
        offset: u64,
    ) -> Result<(), StoreError> {
        let bytes = |b: &Bytes| match b {
            Bytes::Buf(r) => &buf[r.clone()],
            Bytes::Scratch(r) => &scratch[r.clone()],
        };
        let raw = steps
            .iter()
            .filter(|s| !s.in_place && matches!(s.target, Target::Raw(_)))
            .count() as u64;
        let budget = &self.back.budget;
        self.retry_compacted(|| {
            budget
                .take(raw)
                .map_err(|why| AllocError::Refused { why, pages: raw })
        })
        .map_err(|e| match e {
            AllocError::Refused { why, .. } => self.refused(why, offset, raw),
            AllocError::NoMemory => unreachable!("the budget maps nothing"),
        })?;
        let mut failed = None;
        for s in steps.iter_mut().filter(|s| !s.in_place) {
            let at = s.page * PAGE;
            let made = match &s.target {
                Target::Hole => continue,
                Target::Same(w) => Ok(Entry::Same(*w)),
                Target::Raw(b) => match self.back.slabs.lock().take() {
                    Ok((mut p, _)) => {
                        p.copy_from_slice(bytes(b));
                        Ok(Entry::Raw(p))
                    }
                    Err(_) => Err(AllocError::NoMemory),
                },
                Target::Packed(r) => self
                    .retry_compacted(|| self.back.zs.alloc(&scratch[r.clone()]))
                    .map(Entry::Packed),
            };
            let map = maps.map(s.page);
            let room = map.contains(s.page) || map.reserve(s.page);
            match made {
                Ok(e) if room => s.fresh = Some(e),
                Ok(e) => {
                    s.fresh = Some(e);
                    failed = Some((at, AllocError::NoMemory));
                    break;
                }
                Err(e) => {
                    failed = Some((at, e));
                    break;
                }
            }
        }
        let Some((at, why)) = failed else {
            return Ok(());
        };
        {
            let mut freer = Freer::new(&self.back);
            for s in steps.iter_mut() {
                if let Some(e) = s.fresh.take() {
                    freer.free(e);
                }
                maps.map(s.page).prune(s.page);
            }
            // The raw pages' budget goes back whole below, taken or not.
            freer.raw = 0;
        }
        budget.give_back(raw);
        Err(match why {
            AllocError::Refused { why, pages } => self.refused(why, at, pages),
            AllocError::NoMemory => StoreError::NoMemory {
                export: self.name.clone(),
                offset: at,
            },
        })
    }

    /// Phase 3: links what was allocated, rewrites in place, frees what
    /// was replaced. `now` stamps the pages of a write.
    /// Returns the change in pages held.
    fn commit(
        &self,
        maps: &mut dyn Maps,
        steps: Vec<Step>,
        buf: &[u8],
        scratch: &[u8],
        now: Option<u32>,
    ) -> i64 {
        let mut freer = Freer::new(&self.back);
        let (mut logical, mut stored) = (0i64, 0i64);
        let (mut written_pages, mut written_bytes) = (0u64, 0u64);
        let mut emptied = Vec::new();
        for s in steps {
            let map = maps.map(s.page);
            let old_weight = map.get(s.page).map(|(e, _)| self.weight(e));
            if s.in_place {
                let (e, stamp) = map.get_mut(s.page).expect("rewritten in place");
                match (&s.target, e) {
                    (Target::Raw(Bytes::Buf(r)), Entry::Raw(p)) => {
                        p.copy_from_slice(&buf[r.clone()])
                    }
                    (Target::Raw(Bytes::Scratch(r)), Entry::Raw(p)) => {
                        p.copy_from_slice(&scratch[r.clone()])
                    }
                    (Target::Packed(r), Entry::Packed(h)) => {
                        self.back.zs.rewrite(*h, &scratch[r.clone()])
                    }
                    _ => unreachable!("in place keeps the entry's kind"),
                }
                if let Some(t) = now {
                    *stamp = t;
                }
                written_pages += 1;
                written_bytes += old_weight.unwrap_or(0);
                continue;
            }
            let new_weight = s.fresh.as_ref().map(|e| self.weight(e));
            match s.fresh {
                None => {
                    // Its group stays: a later page of this write may have
                    // reserved it (dropped, putting that page aborted the
                    // donor). Pruned once every page is in.
                    if let Some(old) = map.take(s.page) {
                        freer.free(old);
                        emptied.push(s.page);
                    }
                }
                Some(e) => match map.get_mut(s.page) {
                    Some((slot, stamp)) => {
                        let old = std::mem::replace(slot, e);
                        if let Some(t) = now {
                            *stamp = t;
                        }
                        freer.free(old);
                    }
                    None => map.put(s.page, e, now.unwrap_or(0)),
                },
            }
            logical += i64::from(new_weight.is_some()) - i64::from(old_weight.is_some());
            stored += new_weight.unwrap_or(0) as i64 - old_weight.unwrap_or(0) as i64;
            written_pages += u64::from(new_weight.is_some());
            written_bytes += new_weight.unwrap_or(0);
        }
        for page in emptied {
            maps.map(page).prune(page);
        }
        self.logical.fetch_add(logical as u64, Relaxed);
        self.stored.fetch_add(stored as u64, Relaxed);
        if now.is_some() {
            self.back.wrote(written_pages, written_bytes);
        }
        logical
    }

    /// Writes `buf` at `offset`. Fails with nothing changed when a page it
    /// needs cannot be had (budget, draining, memory). Zeros need no page.
    pub fn write(&self, buf: &[u8], offset: u64, now: u32) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, last) = Self::pages(offset, len);
        self.with_shards(first, last, |maps| {
            let mut scratch = Vec::new();
            let pages = (first..=last).map(|q| {
                let (a, b) = piece(q, offset, len);
                (q, a, b)
            });
            let mut steps = self.plan(maps, pages, buf, false, &mut scratch)?;
            self.allocate(maps, &mut steps, buf, &scratch, offset)?;
            self.commit(maps, steps, buf, &scratch, Some(now));
            Ok(())
        })
    }

    /// Trim and zero: frees the whole pages of the range and zeros the
    /// covered part of partial pages (freeing those that end up all zero).
    /// Returns the pages freed. Partial pages go first: re-packing one
    /// may need memory, and when it cannot have it nothing has changed.
    pub fn discard(&self, offset: u64, len: u64) -> Result<u64, StoreError> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(0);
        }
        let (first, last) = Self::pages(offset, len);
        self.with_shards(first, last, |maps| {
            let partial: Vec<(u64, Range<usize>, Range<usize>)> = [first, last]
                .into_iter()
                .take(if first == last { 1 } else { 2 })
                .map(|q| {
                    let (a, b) = piece(q, offset, len);
                    (q, a, b)
                })
                .filter(|(q, a, _)| a.len() < PAGE_SIZE && maps.map(*q).contains(*q))
                .collect();
            let mut scratch = Vec::new();
            let mut steps = self.plan(maps, partial.into_iter(), &[], true, &mut scratch)?;
            self.allocate(maps, &mut steps, &[], &scratch, offset)?;
            let emptied = -self.commit(maps, steps, &[], &scratch, None);
            let mut freer = Freer::new(&self.back);
            let (mut pages, mut bytes) = (0, 0);
            for q in first..=last {
                if piece(q, offset, len).0.len() < PAGE_SIZE {
                    continue;
                }
                if let Some(e) = maps.map(q).remove(q) {
                    pages += 1;
                    bytes += self.weight(&e);
                    freer.free(e);
                }
            }
            self.logical.fetch_sub(pages, Relaxed);
            self.stored.fetch_sub(bytes, Relaxed);
            Ok(pages + emptied.max(0) as u64)
        })
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
        if self.logical_pages() == 0 {
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

    /// Every page's (stamp, bytes held), for the age of the x-th oldest.
    pub(super) fn for_each_stamp(&self, mut f: impl FnMut(u32, u64)) {
        for shard in self.shards.iter() {
            let map = shard.read_or_recover();
            for (e, s) in map.entries() {
                f(s, self.weight(e));
            }
        }
    }

    #[cfg(test)]
    pub(super) fn shards_for_tests(&self) -> &[RwLock<PageMap>] {
        &self.shards
    }

    /// The bytes `page` takes as it is kept (`None`: not held).
    #[cfg(test)]
    pub(super) fn page_weight_for_tests(&self, page: u64) -> Option<u64> {
        let map = self.read_shard(page);
        map.get(page).map(|(e, _)| self.weight(e))
    }

    #[cfg(test)]
    pub(super) fn weight_for_tests(&self, e: &Entry) -> u64 {
        self.weight(e)
    }
}
