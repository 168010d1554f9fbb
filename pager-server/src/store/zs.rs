//! Compressed pages in size classes carved from the donor's slabs, in the
//! manner of the kernel's zsmalloc (Documentation/mm/zsmalloc.rst):
//!
//! - **Size classes** every 16 bytes from 32 bytes to a page; an object
//!   goes to the smallest class that holds it. Each class keeps its
//!   objects in **zspages**: 1 to [`MAX_CHAIN`] slab pages (4 KiB each,
//!   from [`Slabs`], counted in the [`Budget`]) chained into one byte
//!   space, the chain length chosen per class to waste the fewest bytes
//!   (zsmalloc's `calculate_zspage_chain_size`). An object may straddle
//!   two pages of its chain, so a 1568-byte class wastes 96 bytes in 5
//!   pages instead of 960 in one. Neighbouring classes with the same chain
//!   and objects per zspage are merged into the larger one, as zsmalloc
//!   does. From the smallest size whose best chain is one page holding one
//!   object (zsmalloc's "huge" class, 3648 bytes) up, a page is kept raw
//!   instead, as zram does ([`ZsPool::max_packed`]).
//! - **Handles**: the page table holds a [`Handle`] (class, slot), never
//!   a location, so compaction can move an object by rewriting its slot
//!   under the class's lock without touching any export's page table.
//! - **Allocation** fills the fullest zspage that has room (zsmalloc's
//!   almost-full first), so sparse zspages drain; a zspage whose last
//!   object is freed goes back to the slabs and the budget at once.
//! - **Compaction** ([`ZsPool::compact`]) moves the objects of a class's
//!   emptiest zspage into its fullest ones whenever the others' free
//!   slots can take them all, and frees it: zsmalloc's migrate from
//!   almost-empty to almost-full. It never moves an object to gain
//!   nothing. The donor's watch thread runs it every poll, and a write
//!   short of budget runs it once before refusing.
//!
//! Locks: one `RwLock` per class; readers share it (decompressing under
//! it), allocation, freeing and compaction take it alone. A class lock is
//! taken after the export's shard locks and before the slabs' lock, and
//! never two at once.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use netpager_util::RwLockExt;

use super::budget::{Budget, Refusal};
use crate::config::PAGE_SIZE;
use crate::slab::Slabs;
use crate::sys::Page;

/// Bytes between size classes (zsmalloc's `ZS_SIZE_CLASS_DELTA`).
pub const CLASS_DELTA: usize = 16;
/// The smallest class.
const MIN_SIZE: usize = 32;
/// Most slab pages chained into one zspage (zsmalloc's default
/// `CONFIG_ZSMALLOC_CHAIN_SIZE`).
pub const MAX_CHAIN: usize = 8;
/// An object slot or owner entry that is free.
const FREE: u32 = u32::MAX;

/// Where the page table finds an object: its class and slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    class: u16,
    slot: u32,
}

/// Why an object could not be stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// The budget had no room for a new zspage of `pages` pages.
    Refused { why: Refusal, pages: u64 },
    /// No slab could be mapped.
    NoMemory,
}

/// A slot: where its object lies, and its length in bytes.
#[derive(Clone, Copy)]
struct Slot {
    zspage: u32,
    idx: u16,
    len: u16,
}

struct ZsPage {
    pages: Vec<Page>,
    /// Slot of each object, or [`FREE`].
    owners: Box<[u32]>,
    free: Vec<u16>,
    inuse: u16,
}

/// One size class and its zspages.
struct Class {
    size: usize,
    chain: usize,
    objs: usize,
    zspages: Vec<Option<ZsPage>>,
    vacant: Vec<u32>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Zspages with a free object, by objects in use then id.
    partial: BTreeSet<(u16, u32)>,
    /// Free objects over all zspages.
    free_objs: usize,
}

/// The chain length of least waste for objects of `size` bytes, and the
/// objects one zspage then holds.
fn chain_for(size: usize) -> (usize, usize) {
    let chain = (1..=MAX_CHAIN)
        .min_by_key(|k| (k * PAGE_SIZE) % size)
        .expect("MAX_CHAIN >= 1");
    (chain, chain * PAGE_SIZE / size)
}

/// Copies the object at byte `off` of a zspage into `dst`.
fn copy_out(pages: &[Page], off: usize, dst: &mut [u8]) {
    let mut done = 0;
    while done < dst.len() {
        let (p, o) = ((off + done) / PAGE_SIZE, (off + done) % PAGE_SIZE);
        let n = (PAGE_SIZE - o).min(dst.len() - done);
        dst[done..done + n].copy_from_slice(&pages[p][o..o + n]);
        done += n;
    }
}

/// Copies `src` into a zspage at byte `off`.
fn copy_in(pages: &mut [Page], off: usize, src: &[u8]) {
    let mut done = 0;
    while done < src.len() {
        let (p, o) = ((off + done) / PAGE_SIZE, (off + done) % PAGE_SIZE);
        let n = (PAGE_SIZE - o).min(src.len() - done);
        pages[p][o..o + n].copy_from_slice(&src[done..done + n]);
        done += n;
    }
}

impl Class {
    fn new(size: usize, chain: usize, objs: usize) -> Self {
        Class {
            size,
            chain,
            objs,
            zspages: Vec::new(),
            vacant: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            partial: BTreeSet::new(),
            free_objs: 0,
        }
    }

    fn zspage(&mut self, id: u32) -> &mut ZsPage {
        self.zspages[id as usize]
            .as_mut()
            .expect("slots and partial name live zspages")
    }

    /// Maps a new empty zspage: `chain` pages from the budget and slabs.
    fn grow(&mut self, budget: &Budget, slabs: &Slabs) -> Result<u32, AllocError> {
        let n = self.chain as u64;
        budget
            .take(n)
            .map_err(|why| AllocError::Refused { why, pages: n })?;
        let mut alloc = slabs.lock();
        let mut pages = Vec::with_capacity(self.chain);
        while pages.len() < self.chain {
            match alloc.take() {
                Ok((p, _)) => pages.push(p),
                Err(_) => {
                    pages.into_iter().for_each(|p| alloc.give(p));
                    budget.give_back(n);
                    return Err(AllocError::NoMemory);
                }
            }
        }
        drop(alloc);
        let z = ZsPage {
            pages,
            owners: vec![FREE; self.objs].into_boxed_slice(),
            free: (0..self.objs as u16).rev().collect(),
            inuse: 0,
        };
        let id = match self.vacant.pop() {
            Some(id) => {
                self.zspages[id as usize] = Some(z);
                id
            }
            None => {
                self.zspages.push(Some(z));
                (self.zspages.len() - 1) as u32
            }
        };
        self.partial.insert((0, id));
        self.free_objs += self.objs;
        Ok(id)
    }

    /// Takes a free object of zspage `id` for slot `slot`; its index.
    fn place(&mut self, id: u32, slot: u32) -> u16 {
        let z = self.zspages[id as usize].as_mut().expect("a live zspage");
        let was = z.inuse;
        let idx = z.free.pop().expect("a partial zspage has a free object");
        z.owners[usize::from(idx)] = slot;
        z.inuse += 1;
        let full = z.free.is_empty();
        let now = z.inuse;
        self.partial.remove(&(was, id));
        if !full {
            self.partial.insert((now, id));
        }
        self.free_objs -= 1;
        idx
    }

    /// Gives object `idx` of zspage `id` back; returns the zspage's pages
    /// when that was its last object.
    fn unplace(&mut self, id: u32, idx: u16) -> Option<Vec<Page>> {
        let z = self.zspages[id as usize].as_mut().expect("a live zspage");
        let was = z.inuse;
        z.owners[usize::from(idx)] = FREE;
        z.free.push(idx);
        z.inuse -= 1;
        let now = z.inuse;
        self.partial.remove(&(was, id));
        self.free_objs += 1;
        if now > 0 {
            self.partial.insert((now, id));
            return None;
        }
        self.free_objs -= self.objs;
        self.vacant.push(id);
        self.zspages[id as usize].take().map(|z| z.pages)
    }

    fn alloc(&mut self, data: &[u8], budget: &Budget, slabs: &Slabs) -> Result<u32, AllocError> {
        let id = match self.partial.last() {
            Some(&(_, id)) => id,
            None => self.grow(budget, slabs)?,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot {
                    zspage: 0,
                    idx: 0,
                    len: 0,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let idx = self.place(id, slot);
        let off = usize::from(idx) * self.size;
        copy_in(&mut self.zspage(id).pages, off, data);
        self.slots[slot as usize] = Slot {
            zspage: id,
            idx,
            len: data.len() as u16,
        };
        Ok(slot)
    }

    /// Frees a slot's object; the pages of a zspage left empty.
    fn free(&mut self, slot: u32) -> Option<Vec<Page>> {
        let s = self.slots[slot as usize];
        self.free_slots.push(slot);
        self.unplace(s.zspage, s.idx)
    }

    /// Empties the emptiest zspage into the others when they have room
    /// for all its objects; returns its pages.
    fn compact_one(&mut self) -> Option<Vec<Page>> {
        let &(inuse, src) = self.partial.first()?;
        let inuse = usize::from(inuse);
        if self.free_objs - (self.objs - inuse) < inuse {
            return None;
        }
        // Out of the partial set while it empties, so it is never a target.
        self.partial.remove(&(inuse as u16, src));
        let mut buf = [0u8; PAGE_SIZE];
        let owners: Vec<(u16, u32)> = self
            .zspage(src)
            .owners
            .iter()
            .enumerate()
            .filter(|(_, o)| **o != FREE)
            .map(|(i, o)| (i as u16, *o))
            .collect();
        let size = self.size;
        for (idx, slot) in owners {
            let s = self.slots[slot as usize];
            let obj = &mut buf[..usize::from(s.len)];
            copy_out(&self.zspage(src).pages, usize::from(idx) * size, obj);
            let &(_, dst) = self.partial.last().expect("room was counted");
            let to = self.place(dst, slot);
            copy_in(&mut self.zspage(dst).pages, usize::from(to) * size, obj);
            self.slots[slot as usize] = Slot {
                zspage: dst,
                idx: to,
                ..s
            };
            let z = self.zspage(src);
            z.owners[usize::from(idx)] = FREE;
            z.free.push(idx);
            z.inuse -= 1;
            self.free_objs += 1;
        }
        self.free_objs -= self.objs;
        self.vacant.push(src);
        self.zspages[src as usize].take().map(|z| z.pages)
    }
}

/// The compressed objects of one donor, in size classes.
pub struct ZsPool {
    classes: Box<[RwLock<Class>]>,
    /// Each class's object size (fixed: read without its lock).
    sizes: Box<[u16]>,
    /// Class of each size, by `ceil(size / CLASS_DELTA)`.
    index: Box<[u16]>,
    max_packed: usize,
    slabs: Arc<Slabs>,
    budget: Arc<Budget>,
    /// Slab pages held in zspages.
    pages: AtomicU64,
}

impl ZsPool {
    pub fn new(slabs: Arc<Slabs>, budget: Arc<Budget>) -> Self {
        // Sizes from the smallest "huge" one up are kept raw (zram's
        // huge_class_size): its best chain is one page for one object.
        let huge = (MIN_SIZE..=PAGE_SIZE)
            .step_by(CLASS_DELTA)
            .find(|s| chain_for(*s) == (1, 1))
            .expect("a page-sized object is huge");
        let max_packed = huge - CLASS_DELTA;
        // From the largest size down, so that merged sizes use the larger
        // class (whose objects hold them).
        let mut classes: Vec<Class> = Vec::new();
        let mut index = vec![0u16; PAGE_SIZE / CLASS_DELTA + 1];
        for size in (MIN_SIZE..=max_packed).rev().step_by(CLASS_DELTA) {
            let (chain, objs) = chain_for(size);
            let merge = classes
                .last()
                .is_some_and(|c| c.chain == chain && c.objs == objs);
            if !merge {
                classes.push(Class::new(size, chain, objs));
            }
            let id = (classes.len() - 1) as u16;
            let hi = size / CLASS_DELTA;
            let lo = if size == MIN_SIZE { 0 } else { hi };
            index[lo..=hi].fill(id);
        }
        ZsPool {
            sizes: classes.iter().map(|c| c.size as u16).collect(),
            classes: classes.into_iter().map(RwLock::new).collect(),
            index: index.into_boxed_slice(),
            max_packed,
            slabs,
            budget,
            pages: AtomicU64::new(0),
        }
    }

    /// The largest object kept packed; a page that does not compress to
    /// this is kept raw.
    pub fn max_packed(&self) -> usize {
        self.max_packed
    }

    fn class_id(&self, len: usize) -> u16 {
        debug_assert!(len > 0 && len <= self.max_packed);
        self.index[len.div_ceil(CLASS_DELTA)]
    }

    /// Whether an object of `len` bytes belongs to `h`'s class.
    pub fn same_class(&self, h: Handle, len: usize) -> bool {
        self.class_id(len) == h.class
    }

    /// Bytes an object of `h` takes: its class's size.
    pub fn class_size(&self, h: Handle) -> usize {
        usize::from(self.sizes[usize::from(h.class)])
    }

    /// Slab pages held in zspages.
    pub fn pages(&self) -> u64 {
        self.pages.load(Relaxed)
    }

    /// Stores an object (1 to [`Self::max_packed`] bytes).
    pub fn alloc(&self, data: &[u8]) -> Result<Handle, AllocError> {
        let class = self.class_id(data.len());
        let mut c = self.classes[usize::from(class)].write_or_recover();
        let chain = c.chain as u64;
        let had = c.zspages.len() - c.vacant.len();
        let slot = c.alloc(data, &self.budget, &self.slabs)?;
        if c.zspages.len() - c.vacant.len() > had {
            self.pages.fetch_add(chain, Relaxed);
        }
        Ok(Handle { class, slot })
    }

    /// Replaces `h`'s object with `data`, which must fit its class.
    pub fn rewrite(&self, h: Handle, data: &[u8]) {
        let mut c = self.classes[usize::from(h.class)].write_or_recover();
        assert!(data.len() <= c.size, "object larger than its class");
        let s = c.slots[h.slot as usize];
        let off = usize::from(s.idx) * c.size;
        copy_in(&mut c.zspage(s.zspage).pages, off, data);
        c.slots[h.slot as usize].len = data.len() as u16;
    }

    /// Frees `h`'s object (and its zspage when that empties it).
    pub fn free(&self, h: Handle) {
        let mut c = self.classes[usize::from(h.class)].write_or_recover();
        if let Some(pages) = c.free(h.slot) {
            drop(c);
            self.release(pages);
        }
    }

    fn release(&self, pages: Vec<Page>) {
        let n = pages.len() as u64;
        let mut alloc = self.slabs.lock();
        pages.into_iter().for_each(|p| alloc.give(p));
        drop(alloc);
        self.pages.fetch_sub(n, Relaxed);
        self.budget.give_back(n);
    }

    /// Runs `f` on `h`'s object bytes, under its class's read lock.
    pub fn read<R>(&self, h: Handle, f: impl FnOnce(&[u8]) -> R) -> R {
        let c = self.classes[usize::from(h.class)].read_or_recover();
        let s = c.slots[h.slot as usize];
        let z = c.zspages[s.zspage as usize]
            .as_ref()
            .expect("a slot names a live zspage");
        let (off, len) = (usize::from(s.idx) * c.size, usize::from(s.len));
        let (p, o) = (off / PAGE_SIZE, off % PAGE_SIZE);
        if o + len <= PAGE_SIZE {
            return f(&z.pages[p][o..o + len]);
        }
        let mut buf = [0u8; PAGE_SIZE];
        copy_out(&z.pages, off, &mut buf[..len]);
        f(&buf[..len])
    }

    /// Frees every zspage whose objects fit in its class's other zspages,
    /// one zspage per lock hold; returns the slab pages given back.
    pub fn compact(&self) -> u64 {
        let mut freed = 0;
        for class in self.classes.iter() {
            loop {
                let pages = class.write_or_recover().compact_one();
                match pages {
                    Some(p) => {
                        freed += p.len() as u64;
                        self.release(p);
                    }
                    None => break,
                }
            }
        }
        freed
    }

    /// Moves the zspages' pages that lie in slab `slab` into free pages of
    /// lower slabs ([`crate::slab::Alloc::move_below`]), under each class's
    /// lock in turn (a reader of the class waits for one page's copy);
    /// returns the pages moved, at most `limit`. Objects keep their
    /// offsets in their chain, so no slot changes. A class with no page
    /// there is only read.
    pub fn evacuate(&self, slab: u32, limit: u64) -> u64 {
        let mut moved = 0;
        for class in self.classes.iter() {
            let there = |z: &ZsPage| z.pages.iter().any(|p| p.slab() == slab);
            if !class.read_or_recover().zspages.iter().flatten().any(there) {
                continue;
            }
            let mut c = class.write_or_recover();
            for z in c.zspages.iter_mut().flatten() {
                for page in z.pages.iter_mut().filter(|p| p.slab() == slab) {
                    if moved == limit {
                        return moved;
                    }
                    if !self.slabs.lock().move_below(page, slab) {
                        return moved;
                    }
                    moved += 1;
                }
            }
        }
        moved
    }

    /// Pages compaction would free now, without moving anything.
    pub fn compactable_pages(&self) -> u64 {
        self.classes
            .iter()
            .map(|c| {
                let c = c.read_or_recover();
                (c.free_objs / c.objs.max(1) * c.chain) as u64
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(limit: u64) -> ZsPool {
        ZsPool::new(
            Arc::new(Slabs::with_slab_pages(8)),
            Arc::new(Budget::new(limit)),
        )
    }

    #[test]
    fn classes_waste_little_and_merge_like_zsmalloc() {
        let z = pool(1);
        // zsmalloc.rst's example: 1568-byte objects, 13 in a chain of 5.
        assert_eq!(chain_for(1568), (5, 13));
        assert_eq!(chain_for(4096), (1, 1));
        for len in 1..=z.max_packed() {
            let c = z.classes[usize::from(z.class_id(len))].read_or_recover();
            assert!(c.size >= len, "{len} in class {}", c.size);
            assert!(
                (c.chain * PAGE_SIZE) / c.objs - len < PAGE_SIZE / 8,
                "{len}: a class of {} with {} objects in {} pages",
                c.size,
                c.objs,
                c.chain
            );
        }
        assert!(z.max_packed() > 3500 && z.max_packed() < PAGE_SIZE);
        assert!(z.classes.len() < 255, "some classes merged");
    }

    #[test]
    fn objects_straddle_pages_and_survive_compaction() {
        let z = pool(1000);
        // 1568 bytes: objects cross the pages of a 5-page chain.
        let objs: Vec<(Handle, Vec<u8>)> = (0..40u8)
            .map(|i| {
                let data: Vec<u8> = (0..1568).map(|j| i ^ (j % 251) as u8).collect();
                (z.alloc(&data).unwrap(), data)
            })
            .collect();
        assert_eq!(z.pages(), 4 * 5, "40 objects in 4 zspages of 13");
        assert_eq!(z.budget.used_pages(), 20);
        for (h, d) in &objs {
            assert_eq!(z.read(*h, |o| o.to_vec()), *d);
        }
        // Free all but every fourth: 10 left over 4 zspages, which fit in 1.
        let kept: Vec<_> = objs
            .into_iter()
            .enumerate()
            .filter_map(|(i, o)| {
                if i % 4 == 0 {
                    Some(o)
                } else {
                    z.free(o.0);
                    None
                }
            })
            .collect();
        // Allocation fills the fullest zspage first: the fourth held only
        // object 39 and went back at once; the others hold 4, 3 and 3.
        assert_eq!(z.pages(), 15, "an emptied zspage goes back by itself");
        assert_eq!(z.compactable_pages(), 10);
        assert_eq!(z.compact(), 10);
        assert_eq!((z.pages(), z.budget.used_pages()), (5, 5));
        for (h, d) in &kept {
            assert_eq!(z.read(*h, |o| o.to_vec()), *d);
        }
        assert_eq!(z.compact(), 0, "nothing more to gain");
        for (h, _) in kept {
            z.free(h);
        }
        assert_eq!((z.pages(), z.budget.used_pages()), (0, 0));
        assert_eq!(
            z.slabs.mapped_bytes(),
            8 * PAGE_SIZE as u64,
            "the spare slab only"
        );
    }

    #[test]
    fn a_new_zspage_needs_budget() {
        let chain = |len: usize| chain_for(len.div_ceil(CLASS_DELTA) * CLASS_DELTA).0 as u64;
        let (small, big) = (chain(100), chain(3000));
        let z = pool(small + big - 1);
        let h = z.alloc(&[7u8; 100]).unwrap();
        assert!(matches!(
            z.alloc(&[1u8; 3000]),
            Err(AllocError::Refused { why: Refusal::Full { free }, pages }) if pages == big && free == big - 1
        ));
        z.rewrite(h, &[9u8; 90]);
        assert_eq!(z.read(h, |o| o.to_vec()), vec![9u8; 90]);
        z.free(h);
        assert_eq!(z.budget.used_pages(), 0);
        z.alloc(&[1u8; 3000]).unwrap();
        assert_eq!(z.budget.used_pages(), big);
    }
}
