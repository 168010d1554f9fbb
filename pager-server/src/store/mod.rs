//! The donor's page store: one sparse, sharded page table per export
//! ([`export`], [`table`]), a budget shared by all exports ([`budget`]),
//! a coarse last-touched stamp per page, and the donor's codec
//! (`compress=`, [`codec`]) with its size classes ([`zs`]).
//!
//! Each written page is kept in the cheapest form that holds it: a page
//! of zeros as nothing, a page of one repeated word as that word, a page
//! that compresses below [`zs::ZsPool::max_packed`] as an object in a
//! size class, any other page raw in a 4 KiB slab page ([`crate::slab`]).
//! With `compress=off` every page but a zero page is raw. The budget
//! counts slab pages, raw or in zspages, so `used` is the memory really
//! held; a page handed to one export never shows bytes another freed
//! (a new raw page is filled whole, an object is written whole).
//!
//! Layout and concurrency: pages are kept in groups of 16 (64 KiB), and an
//! export's groups are spread over [`SHARDS`] read-write locks by a hash of
//! the group index, so parallel requests rarely meet on a lock and a
//! request within one group takes one lock and one hash lookup. A write or
//! discard that spans several shards locks them all in ascending order
//! (no deadlock) so that it is atomic (see [`export`] for its phases).
//! Objects are reached through handles under their class's lock, taken
//! after the shards' (see [`zs`]).

mod budget;
pub mod codec;
mod export;
mod table;
pub mod zs;

use std::collections::{BTreeMap, BinaryHeap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};

use netpager_util::{LockExt, RwLockExt};

pub use budget::Budget;
pub use codec::{Compress, Recompress};
pub use export::{Export, Recompressed};

use crate::config::{ExportSpec, PAGE_SIZE};
use crate::slab::Slabs;
use zs::ZsPool;

const PAGE: u64 = PAGE_SIZE as u64;
/// Shards per export (a power of two).
pub const SHARDS: usize = 256;
/// Length of one age tick: page stamps count ticks since the donor started.
pub const TICK_MS: u64 = 100;

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
    #[error("export {export}: the page at offset {offset} is corrupt: {why}")]
    Corrupt {
        export: String,
        offset: u64,
        why: String,
    },
    #[error("export {export} is shut: a request panicked in it ({why}); its pages are no longer served, and the donor gives their memory back when it restarts")]
    Broken { export: String, why: String },
}

impl StoreError {
    /// The errno nbdkit sends to the client.
    pub fn errno(&self) -> i32 {
        match self {
            StoreError::OutOfRange { .. } => libc::EINVAL,
            StoreError::Draining { .. } | StoreError::NoSpace { .. } => libc::ENOSPC,
            StoreError::NoMemory { .. } => libc::ENOMEM,
            StoreError::Corrupt { .. } | StoreError::Broken { .. } => libc::EIO,
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

/// What every export of a donor shares: where pages live and how.
struct Backing {
    budget: Arc<Budget>,
    slabs: Arc<Slabs>,
    zs: ZsPool,
    codec: Compress,
    /// Pages written and the bytes they took when written, since start:
    /// the ratio of what clients send now (see [`Pool::written`]).
    written_pages: AtomicU64,
    written_bytes: AtomicU64,
}

impl Backing {
    fn wrote(&self, pages: u64, bytes: u64) {
        self.written_pages.fetch_add(pages, Relaxed);
        self.written_bytes.fetch_add(bytes, Relaxed);
    }
}

/// Size, name and use of one export, for status replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub name: String,
    pub size: u64,
    /// Bytes of the pages it holds, as written (a zero page is none).
    pub logical_bytes: u64,
    /// Bytes those pages take in the store.
    pub stored_bytes: u64,
    /// Why it is shut, when a request panicked in it.
    pub broken: Option<String>,
}

/// All exports of a donor and their common budget.
pub struct Pool {
    back: Arc<Backing>,
    exports: RwLock<BTreeMap<String, Arc<Export>>>,
    max_exports: usize,
    /// The shard the recompressor goes on from, and what it did so far.
    recompress_at: Mutex<usize>,
    recompressed: Mutex<Recompressed>,
}

impl Pool {
    pub fn new(limit_pages: u64, max_exports: usize, codec: Compress) -> Self {
        Self::with_slabs(limit_pages, max_exports, codec, Slabs::new())
    }

    /// A pool whose pages come from `slabs` (small slabs for unit tests).
    pub fn with_slabs(limit_pages: u64, max_exports: usize, codec: Compress, slabs: Slabs) -> Self {
        let budget = Arc::new(Budget::new(limit_pages));
        let slabs = Arc::new(slabs);
        Pool {
            back: Arc::new(Backing {
                zs: ZsPool::new(Arc::clone(&slabs), Arc::clone(&budget)),
                budget,
                slabs,
                codec,
                written_pages: AtomicU64::new(0),
                written_bytes: AtomicU64::new(0),
            }),
            exports: RwLock::new(BTreeMap::new()),
            max_exports,
            recompress_at: Mutex::new(0),
            recompressed: Mutex::new(Recompressed::default()),
        }
    }

    pub fn budget(&self) -> &Budget {
        &self.back.budget
    }

    pub fn codec(&self) -> Compress {
        self.back.codec
    }

    /// Bytes of the slabs mapped for pages (see [`Slabs::mapped_bytes`]).
    pub fn mapped_bytes(&self) -> u64 {
        self.back.slabs.mapped_bytes()
    }

    /// Bytes held in slab pages, raw or in zspages: the budget's use.
    pub fn stored_bytes(&self) -> u64 {
        self.back.budget.used_pages() * PAGE
    }

    /// Bytes of the pages held over all exports, as written.
    pub fn logical_bytes(&self) -> u64 {
        let all = self.exports.read_or_recover();
        all.values().map(|e| e.logical_pages()).sum::<u64>() * PAGE
    }

    /// Pages written since start and the bytes they took then (a page
    /// rewritten in place counts as it is kept).
    pub fn written(&self) -> (u64, u64) {
        (
            self.back.written_pages.load(Relaxed),
            self.back.written_bytes.load(Relaxed),
        )
    }

    /// Frees every zspage whose objects fit in others of its class; the
    /// slab pages given back (their slabs unmapped once empty).
    pub fn compact(&self) -> u64 {
        self.back.zs.compact()
    }

    /// One pass of the recompressor (`store/export/recompress.rs`): packs
    /// again with `cold` the pages last touched before tick `before`,
    /// shard by shard of every export from where the last pass stopped,
    /// looking at no more than `limit` pages. Each pass visits each shard
    /// at most once; a pass the budget refuses stops there.
    pub fn recompress(&self, cold: Recompress, before: u32, limit: u64) -> Recompressed {
        // Only lz4's pages gain: zstd packed them already, `off` keeps
        // them raw on purpose.
        if self.back.codec != Compress::Lz4 || cold == Recompress::Off {
            return Recompressed::default();
        }
        let exports: Vec<Arc<Export>> = self.exports.read_or_recover().values().cloned().collect();
        let mut at = self.recompress_at.lock_or_recover();
        let mut pass = Recompressed::default();
        for _ in 0..SHARDS {
            for e in &exports {
                pass.add(e.recompress_shard(cold, *at, before, limit - pass.examined));
            }
            if pass.examined == limit || pass.refused {
                break;
            }
            *at = (*at + 1) % SHARDS;
        }
        self.recompressed.lock_or_recover().add(pass);
        pass
    }

    /// Empties the slab worth emptying, if any ([`Slabs`]' `evacuee`):
    /// moves up to `limit` of its pages, zspages' and raw, into the free
    /// pages of lower slabs; it is unmapped once its last page is out.
    /// Returns the pages moved. For the donor's watch thread, after a
    /// compaction: pages freed here and there keep their slabs mapped.
    pub fn evacuate(&self, limit: u64) -> u64 {
        let Some(slab) = self.back.slabs.lock().evacuee() else {
            return 0;
        };
        let mut moved = self.back.zs.evacuate(slab, limit);
        let exports: Vec<Arc<Export>> = self.exports.read_or_recover().values().cloned().collect();
        for e in exports {
            moved += e.evacuate(slab, limit - moved);
        }
        moved
    }

    /// What the recompressor did since the donor started.
    pub fn recompressed(&self) -> Recompressed {
        *self.recompressed.lock_or_recover()
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
            Arc::clone(&self.back),
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
                logical_bytes: e.logical_pages() * PAGE,
                stored_bytes: e.stored_bytes(),
                broken: e.broken().map(str::to_string),
            })
            .collect()
    }

    /// Stamp of the oldest page at which the pages held, oldest first,
    /// reach `x` pages' worth of stored bytes (with every page raw, the
    /// `x`-th oldest page); with fewer bytes held, of the youngest page;
    /// `None` without pages. A scan under each shard's read lock, for the
    /// status thread (never the I/O path).
    pub fn xth_oldest_stamp(&self, x: u64) -> Option<u32> {
        let target = x.max(1).saturating_mul(PAGE);
        // The oldest pages whose bytes reach the target, youngest on top.
        let mut heap: BinaryHeap<(u32, u64)> = BinaryHeap::new();
        let mut sum = 0u64;
        let exports: Vec<Arc<Export>> = self.exports.read_or_recover().values().cloned().collect();
        for e in exports {
            e.for_each_stamp(|s, w| {
                if w == 0 || (sum >= target && heap.peek().is_some_and(|top| s >= top.0)) {
                    return;
                }
                heap.push((s, w));
                sum += w;
                while heap.peek().is_some_and(|top| sum - top.1 >= target) {
                    sum -= heap.pop().expect("peeked").1;
                }
            });
        }
        heap.peek().map(|top| top.0)
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_packed;
