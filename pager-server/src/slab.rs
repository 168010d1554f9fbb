//! Where donated pages live: 2 MiB slabs mapped by the plugin itself
//! ([`crate::sys::Slab`]) and carved into 4 KiB pages, shared by all
//! exports of a donor.
//!
//! Why not the heap: memory malloc got back from `free` stays in the
//! process (and under mlockall it cannot even be advised away), so a donor
//! whose clients trimmed everything kept its peak RSS. Here a slab whose
//! last page is freed is unmapped, which hands its memory back to the node.
//! One wholly free slab is kept mapped as a spare, so that a client that
//! writes and trims around a slab boundary does not map and unmap a slab
//! per request.
//!
//! New pages come from the slab with the lowest id that has a free page,
//! then the spare, then a new slab: live pages crowd into the oldest slabs
//! and the youngest ones drain, so trims free whole slabs sooner. A slab is
//! mapped only when every page of every mapped slab is in use. Pages freed
//! here and there (trims, compaction, pages repacked smaller) still leave
//! slabs part used: the donor's watch thread then empties the highest slab
//! whose pages fit in the free pages below it, moving them there
//! ([`Alloc::evacuee`], [`Alloc::take_below`]), and it is unmapped. So the
//! mapped slabs come back to the pages in use rounded up to a slab, plus
//! the spare.

use std::collections::BTreeSet;
use std::io;
use std::sync::{Mutex, MutexGuard};

use netpager_util::LockExt;

use crate::config::PAGE_SIZE;
use crate::sys::{Page, Slab};

/// Pages of one slab: 2 MiB, one transparent huge page.
pub const SLAB_PAGES: u16 = 512;
/// Bytes of one slab.
pub const SLAB_BYTES: u64 = SLAB_PAGES as u64 * PAGE_SIZE as u64;

/// The slabs of one donor.
pub struct Slabs {
    inner: Mutex<Inner>,
    slab_pages: u16,
}

#[derive(Default)]
struct Inner {
    /// Mapped slabs by id; `None` marks a returned slab's id for reuse.
    slabs: Vec<Option<Slab>>,
    vacant: Vec<u32>,
    /// Slabs with pages in use and free pages left: allocated from first.
    partial: BTreeSet<u32>,
    /// A mapped slab without pages in use.
    spare: Option<u32>,
    mapped: usize,
}

impl Slabs {
    pub fn new() -> Self {
        Self::with_slab_pages(SLAB_PAGES)
    }

    /// Slabs of `slab_pages` pages (small ones for unit tests).
    pub fn with_slab_pages(slab_pages: u16) -> Self {
        assert!(slab_pages > 0, "a slab holds at least one page");
        Slabs {
            inner: Mutex::new(Inner::default()),
            slab_pages,
        }
    }

    /// Exclusive use of the allocator, for the pages of one request.
    pub fn lock(&self) -> Alloc<'_> {
        Alloc {
            // A panic inside the allocator leaves at worst a leaked page.
            inner: self.inner.lock_or_recover(),
            slab_pages: self.slab_pages,
        }
    }

    /// Bytes of the slabs mapped now: an upper bound of the memory that
    /// pages hold, spare included.
    pub fn mapped_bytes(&self) -> u64 {
        let n = self.inner.lock_or_recover().mapped;
        n as u64 * u64::from(self.slab_pages) * PAGE_SIZE as u64
    }
}

impl Default for Slabs {
    fn default() -> Self {
        Self::new()
    }
}

/// The locked allocator.
pub struct Alloc<'a> {
    inner: MutexGuard<'a, Inner>,
    slab_pages: u16,
}

impl Alloc<'_> {
    /// A page and whether it is still all zeros (never used since its slab
    /// was mapped); `Err` when no slab can be mapped.
    pub fn take(&mut self) -> io::Result<(Page, bool)> {
        let inner = &mut *self.inner;
        let id = match inner.partial.first() {
            Some(&id) => id,
            None => match inner.spare.take() {
                Some(id) => id,
                None => {
                    let id = inner.vacant.pop().unwrap_or(inner.slabs.len() as u32);
                    let slab = Slab::map(self.slab_pages, id)?;
                    match inner.slabs.get_mut(id as usize) {
                        Some(slot) => *slot = Some(slab),
                        None => inner.slabs.push(Some(slab)),
                    }
                    inner.mapped += 1;
                    id
                }
            },
        };
        let slab = inner.slabs[id as usize]
            .as_mut()
            .expect("partial and spare ids name mapped slabs");
        let page = slab
            .take()
            .expect("partial and spare slabs have a free page");
        if slab.is_full() {
            inner.partial.remove(&id);
        } else {
            inner.partial.insert(id);
        }
        Ok(page)
    }

    /// The slab worth emptying, if any: the highest mapped one (not the
    /// spare) whose pages in use all fit in the free pages of the slabs
    /// below it, so that moving them there ([`Self::take_below`]) unmaps
    /// it. Pages freed here and there (a trim, a compaction, pages packed
    /// smaller) leave slabs part used; this gives their memory back.
    pub fn evacuee(&self) -> Option<u32> {
        let inner = &*self.inner;
        let used = |id: u32| inner.slabs[id as usize].as_ref().map_or(0, |s| s.in_use());
        let top = (0..inner.slabs.len() as u32)
            .rev()
            .find(|&id| inner.slabs[id as usize].is_some() && Some(id) != inner.spare)?;
        let free_below: usize = inner
            .partial
            .range(..top)
            .map(|&id| usize::from(self.slab_pages) - used(id))
            .sum();
        (used(top) > 0 && used(top) <= free_below).then_some(top)
    }

    /// A free page of the lowest part-used slab below `id`, to move a page
    /// of slab `id` into; `None` when those are full. Never maps a slab nor
    /// takes the spare.
    pub fn take_below(&mut self, id: u32) -> Option<Page> {
        let inner = &mut *self.inner;
        let low = *inner.partial.range(..id).next()?;
        let slab = inner.slabs[low as usize]
            .as_mut()
            .expect("partial ids name mapped slabs");
        let (page, _) = slab.take().expect("a partial slab has a free page");
        if slab.is_full() {
            inner.partial.remove(&low);
        }
        Some(page)
    }

    /// Moves `page` (of slab `slab`) to a free page of a lower slab
    /// ([`Self::take_below`]): copies its bytes, gives the old page back
    /// and leaves the new one in its place; false when there is none.
    pub fn move_below(&mut self, page: &mut Page, slab: u32) -> bool {
        let Some(mut to) = self.take_below(slab) else {
            return false;
        };
        to.copy_from_slice(&page[..]);
        self.give(std::mem::replace(page, to));
        true
    }

    /// Takes back a page; unmaps its slab when that was its last page in
    /// use and a spare is already kept.
    pub fn give(&mut self, page: Page) {
        let inner = &mut *self.inner;
        let id = page.slab();
        let slab = inner.slabs[id as usize]
            .as_mut()
            .expect("a page out keeps its slab mapped");
        slab.give(page);
        if slab.in_use() > 0 {
            inner.partial.insert(id);
            return;
        }
        inner.partial.remove(&id);
        if inner.spare.is_none() {
            inner.spare = Some(id);
        } else {
            inner.slabs[id as usize] = None;
            inner.vacant.push(id);
            inner.mapped -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(s: &Slabs) -> u64 {
        s.mapped_bytes() / (4 * PAGE_SIZE as u64)
    }

    #[test]
    fn pages_are_fresh_zeros_then_reused_and_distinct() {
        let s = Slabs::with_slab_pages(4);
        let mut a = s.lock();
        let mut pages: Vec<Page> = (0..4)
            .map(|_| {
                let (p, fresh) = a.take().unwrap();
                assert!(fresh && p.iter().all(|b| *b == 0));
                p
            })
            .collect();
        for (i, p) in pages.iter_mut().enumerate() {
            p.fill(i as u8 + 1);
        }
        for (i, p) in pages.iter().enumerate() {
            assert!(p.iter().all(|b| *b == i as u8 + 1), "pages do not overlap");
        }
        let last = pages.pop().unwrap();
        let addr = last.as_ptr();
        a.give(last);
        let (again, fresh) = a.take().unwrap();
        assert!(!fresh, "a returned page is not fresh: the caller zeroes it");
        assert_eq!(again.as_ptr(), addr, "the last page freed is reused first");
        assert!(again.iter().all(|b| *b == 4));
        pages.push(again);
        drop(a);
        assert_eq!(mapped(&s), 1);
        let mut a = s.lock();
        for p in pages {
            a.give(p);
        }
    }

    #[test]
    fn a_new_slab_only_when_all_are_full_and_the_lowest_is_used_first() {
        let s = Slabs::with_slab_pages(4);
        let mut a = s.lock();
        let mut pages: Vec<Page> = (0..12).map(|_| a.take().unwrap().0).collect();
        drop(a);
        assert_eq!(mapped(&s), 3);
        let mut a = s.lock();
        // Free one page in slab 2 and one in slab 0: the next page comes
        // from slab 0, the one after from slab 2, then a new slab.
        let p2 = pages.remove(9);
        let p0 = pages.remove(1);
        a.give(p2);
        a.give(p0);
        let ids: Vec<u32> = (0..3)
            .map(|_| {
                let p = a.take().unwrap().0;
                let id = p.slab();
                pages.push(p);
                id
            })
            .collect();
        assert_eq!(ids, [0, 2, 3]);
        for p in pages {
            a.give(p);
        }
    }

    #[test]
    fn the_top_slab_is_emptied_into_the_free_pages_below() {
        let s = Slabs::with_slab_pages(4);
        let mut a = s.lock();
        let mut pages: Vec<Page> = (0..12).map(|_| a.take().unwrap().0).collect();
        assert_eq!(a.evacuee(), None, "every slab full: nowhere to move");
        // Slab 2 keeps 3 pages; slabs 0 and 1 free 2 and 1: they fit.
        a.give(pages.remove(8));
        assert_eq!(a.evacuee(), None, "3 pages in use above 0 free pages below");
        a.give(pages.remove(5));
        a.give(pages.remove(1));
        a.give(pages.remove(0));
        assert_eq!(a.evacuee(), Some(2));
        for (i, p) in pages.iter_mut().enumerate() {
            p.fill(i as u8 + 1);
        }
        // Moving slab 2's pages takes slab 0's free pages first, then 1's.
        let mut below = Vec::new();
        for page in pages.iter_mut().filter(|p| p.slab() == 2) {
            let mut p = a.take_below(2).expect("room below");
            below.push(p.slab());
            p.copy_from_slice(&page[..]);
            a.give(std::mem::replace(page, p));
        }
        assert_eq!(below, [0, 0, 1]);
        assert!(a.take_below(2).is_none(), "slabs 0 and 1 are full again");
        assert_eq!(a.evacuee(), None);
        for (i, p) in pages.iter().enumerate() {
            assert!(p.iter().all(|b| *b == i as u8 + 1), "page {i} moved whole");
        }
        drop(a);
        assert_eq!(mapped(&s), 3, "slab 2 is empty: the spare");
        let mut a = s.lock();
        for p in pages {
            a.give(p);
        }
    }

    #[test]
    fn wholly_free_slabs_are_unmapped_but_one_spare() {
        let s = Slabs::with_slab_pages(4);
        let mut pages: Vec<Page> = {
            let mut a = s.lock();
            (0..16).map(|_| a.take().unwrap().0).collect()
        };
        assert_eq!(mapped(&s), 4);
        // Every other page freed: no slab is wholly free, none is returned.
        let mut kept = Vec::new();
        {
            let mut a = s.lock();
            for (i, p) in pages.drain(..).enumerate() {
                if i % 2 == 0 {
                    a.give(p);
                } else {
                    kept.push(p);
                }
            }
        }
        assert_eq!(mapped(&s), 4);
        {
            let mut a = s.lock();
            for p in kept.drain(..) {
                a.give(p);
            }
        }
        assert_eq!(mapped(&s), 1, "all free: only the spare stays mapped");
        // The spare serves the next page; the ids of unmapped slabs are
        // reused for new ones.
        let mut a = s.lock();
        let pages: Vec<Page> = (0..8).map(|_| a.take().unwrap().0).collect();
        let mut ids: Vec<u32> = pages.iter().map(Page::slab).collect();
        ids.dedup();
        assert_eq!(ids.len(), 2);
        assert!(ids.iter().all(|id| *id < 4), "{ids:?}");
        drop(a);
        assert_eq!(mapped(&s), 2);
        let mut a = s.lock();
        for p in pages {
            a.give(p);
        }
        drop(a);
        assert_eq!(mapped(&s), 1);
    }
}
