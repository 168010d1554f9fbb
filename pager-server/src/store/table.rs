//! One shard of an export's page table: pages by group of [`GROUP_PAGES`],
//! each page an [`Entry`] and a coarse last-touched stamp.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use super::zs::Handle;
use crate::sys::Page;

/// Pages of one group: a group lives in one shard.
pub const GROUP_PAGES: u64 = 16;
/// Groups a shard's table keeps room for without shrinking.
const MIN_TABLE: usize = 64;

/// Folded multiply: a cheap hash whose high and low bits both mix.
pub fn mix(x: u64) -> u64 {
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

/// How one stored page is kept.
pub enum Entry {
    /// The page as written, in a slab page of its own.
    Raw(Page),
    /// Compressed by the donor's codec, in a size class.
    Packed(Handle),
    /// Compressed again by zstd once cold (`recompress=`), in a size class.
    Cold(Handle),
    /// One 8-byte word repeated over the page (never zero: a zero page is
    /// no entry at all).
    Same(u64),
}

/// Up to [`GROUP_PAGES`] consecutive pages and their stamps.
struct Group {
    data: [Option<Entry>; GROUP_PAGES as usize],
    /// Tick of each page's last read or write (relaxed: a coarse hint).
    stamps: [AtomicU32; GROUP_PAGES as usize],
    live: u32,
    /// A bit per page the recompressor tried and could not shrink, as it
    /// is now: any change of the page clears it, so it is tried again.
    kept: u16,
}

/// The pages of one shard, by group: one hash lookup finds a page's group
/// and an index its slot, so a lookup costs about one cache miss besides
/// the data, and the tables stay small enough to mostly stay cached.
#[derive(Default)]
pub struct PageMap(HashMap<u64, Group, BuildHasherDefault<PageHasher>>);

fn slot(page: u64) -> usize {
    (page % GROUP_PAGES) as usize
}

impl PageMap {
    pub fn get(&self, page: u64) -> Option<(&Entry, &AtomicU32)> {
        let g = self.0.get(&(page / GROUP_PAGES))?;
        let i = slot(page);
        g.data[i].as_ref().map(|d| (d, &g.stamps[i]))
    }

    /// The entry to change (which clears its [`Self::keep_as_is`]).
    pub fn get_mut(&mut self, page: u64) -> Option<(&mut Entry, &mut u32)> {
        let g = self.0.get_mut(&(page / GROUP_PAGES))?;
        let i = slot(page);
        g.kept &= !(1 << i);
        g.data[i].as_mut().map(|d| (d, g.stamps[i].get_mut()))
    }

    /// Marks `page` as tried by the recompressor, which then leaves it be
    /// until it changes.
    pub fn keep_as_is(&mut self, page: u64) {
        if let Some(g) = self.0.get_mut(&(page / GROUP_PAGES)) {
            g.kept |= 1 << slot(page);
        }
    }

    pub fn contains(&self, page: u64) -> bool {
        self.get(page).is_some()
    }

    /// Makes sure `page`'s group exists, so that [`Self::put`] cannot
    /// fail; false when the table cannot grow (out of memory).
    pub fn reserve(&mut self, page: u64) -> bool {
        let key = page / GROUP_PAGES;
        if self.0.contains_key(&key) {
            return true;
        }
        if self.0.try_reserve(1).is_err() {
            return false;
        }
        self.0.insert(
            key,
            Group {
                data: [const { None }; GROUP_PAGES as usize],
                stamps: [const { AtomicU32::new(0) }; GROUP_PAGES as usize],
                live: 0,
                kept: 0,
            },
        );
        true
    }

    /// Drops `page`'s group if it holds nothing: [`Self::reserve`] made it
    /// and nothing was put in it, or [`Self::take`] emptied it.
    pub fn prune(&mut self, page: u64) {
        let key = page / GROUP_PAGES;
        if self.0.get(&key).is_some_and(|g| g.live == 0) {
            self.drop_group(key);
        }
    }

    fn drop_group(&mut self, key: u64) {
        self.0.remove(&key);
        // A table does not shrink by itself: trimmed exports would keep
        // their peak's tables. Shrinking at a quarter full to half full
        // keeps the rehashing amortised.
        let cap = self.0.capacity();
        if cap > MIN_TABLE && self.0.len() < cap / 4 {
            self.0.shrink_to(self.0.len() * 2);
        }
    }

    /// Stores an entry at an empty slot of a reserved group.
    pub fn put(&mut self, page: u64, e: Entry, stamp: u32) {
        let g = self
            .0
            .get_mut(&(page / GROUP_PAGES))
            .expect("the group was reserved");
        let i = slot(page);
        debug_assert!(g.data[i].is_none(), "page {page} is stored already");
        g.kept &= !(1 << i);
        g.data[i] = Some(e);
        g.live += 1;
        *g.stamps[i].get_mut() = stamp;
    }

    /// Takes an entry out of the table, for the caller to free; an
    /// emptied group goes too.
    pub fn remove(&mut self, page: u64) -> Option<Entry> {
        let data = self.take(page)?;
        self.prune(page);
        Some(data)
    }

    /// [`Self::remove`], but an emptied group stays (for a page of the
    /// same write still to be put there) until [`Self::prune`].
    pub fn take(&mut self, page: u64) -> Option<Entry> {
        let g = self.0.get_mut(&(page / GROUP_PAGES))?;
        let data = g.data[slot(page)].take()?;
        g.kept &= !(1 << slot(page));
        g.live -= 1;
        Some(data)
    }

    /// Pages whose entry `want` picks, whose stamp is before `before` and
    /// that the recompressor has not kept as they are, in no particular
    /// order.
    pub fn pages_before(&self, before: u32, want: impl Fn(&Entry) -> bool) -> Vec<u64> {
        let mut out = Vec::new();
        for (key, g) in &self.0 {
            for (i, (d, s)) in g.data.iter().zip(&g.stamps).enumerate() {
                let kept = g.kept & (1 << i) != 0;
                if !kept && d.as_ref().is_some_and(&want) && s.load(Relaxed) < before {
                    out.push(key * GROUP_PAGES + i as u64);
                }
            }
        }
        out
    }

    /// Every raw page held, to move its bytes to another slab page (what
    /// the page holds, its stamp and its kept mark stay as they are).
    pub fn raw_pages_mut(&mut self) -> impl Iterator<Item = &mut Page> + '_ {
        self.0
            .values_mut()
            .flat_map(|g| g.data.iter_mut())
            .filter_map(|d| match d {
                Some(Entry::Raw(p)) => Some(p),
                _ => None,
            })
    }

    /// Whether a raw page held lies in slab `slab`: evacuation looks under
    /// the shard's read lock before it takes the write lock.
    pub fn has_raw_in(&self, slab: u32) -> bool {
        self.entries()
            .any(|(e, _)| matches!(e, Entry::Raw(p) if p.slab() == slab))
    }

    /// Every entry held, with its stamp.
    pub fn entries(&self) -> impl Iterator<Item = (&Entry, u32)> + '_ {
        self.0.values().flat_map(|g| {
            g.data
                .iter()
                .zip(&g.stamps)
                .filter_map(|(d, s)| d.as_ref().map(|d| (d, s.load(Relaxed))))
        })
    }
}
