//! The recompressor (`recompress=zstd|lz4hc`): a page nobody has read or
//! written for a while is packed again, on the donor's idle CPU, as zram's
//! `recompress type=idle` packs idle pages with its second algorithm.
//! Writes stay with the fast codec (lz4), whose latency the client sees;
//! the pages that stay cold, most of a swapped job's, end up in a denser
//! form: zstd's (on real programs' pages 1.0-1.7x fewer bytes than lz4's:
//! pager-server(1)), which a read of the page decompresses more slowly,
//! or LZ4-HC's, LZ4 blocks read as fast as lz4's. Rewritten, a page is
//! lz4 again.
//!
//! One page at a time under its shard's write lock (the lock a write of
//! that page takes), so a request never sees it half-moved, and only when
//! the codec saves at least one size class; a raw page (lz4 could not pack
//! it) is tried too. A page touched since the scan found it is left alone.
//! A page the codec cannot shrink, and a page LZ4-HC has packed (it is an
//! LZ4 page again, and would not shrink twice), is marked and not tried
//! again until it changes, so a page costs one try, not one a pass.

use std::sync::atomic::Ordering::Relaxed;

use netpager_util::RwLockExt;

use super::{Export, Freer};
use crate::config::PAGE_SIZE;
use crate::store::codec::{self, Recompress};
use crate::store::table::Entry;

/// What one pass of the recompressor did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recompressed {
    /// Cold pages looked at (each one decompressed and compressed again).
    pub examined: u64,
    /// Of which now kept in a smaller class.
    pub pages: u64,
    /// Bytes those pages took before, less what they take now.
    pub saved_bytes: u64,
    /// The pass stopped because the budget had no room for a new zspage
    /// (draining, or full): the rest waits for the next pass.
    pub refused: bool,
}

impl Recompressed {
    pub fn add(&mut self, o: Recompressed) {
        self.examined += o.examined;
        self.pages += o.pages;
        self.saved_bytes += o.saved_bytes;
        self.refused |= o.refused;
    }
}

/// Entries the recompressor may shrink.
fn candidate(e: &Entry) -> bool {
    matches!(e, Entry::Packed(_) | Entry::Raw(_))
}

impl Export {
    /// Recompresses with `cold` the pages of shard `shard` last touched
    /// before tick `before`, looking at no more than `limit` of them.
    pub(in crate::store) fn recompress_shard(
        &self,
        cold: Recompress,
        shard: usize,
        before: u32,
        limit: u64,
    ) -> Recompressed {
        let mut done = Recompressed::default();
        let pages = self.shards[shard]
            .read_or_recover()
            .pages_before(before, candidate);
        let zs = &self.back.zs;
        let mut page_buf = [0u8; PAGE_SIZE];
        let mut out = [0u8; codec::BOUND];
        for page in pages {
            if done.examined == limit {
                break;
            }
            let mut map = self.shards[shard].write_or_recover();
            let Some((e, stamp)) = map.get_mut(page) else {
                continue; // trimmed since
            };
            if *stamp >= before || !candidate(e) {
                continue; // touched since
            }
            done.examined += 1;
            let old = self.weight(e);
            let class = match e {
                Entry::Packed(h) => Some(*h),
                _ => None,
            };
            // At least a class smaller, or packed at all when raw.
            let room = class.map_or(zs.max_packed(), |h| zs.class_size(h) - 1);
            // A corrupt object is left for a read to report.
            let packed = self
                .load(Some(&*e), page, &mut page_buf)
                .ok()
                .and_then(|()| codec::recompress(cold, &page_buf, &mut out, room))
                .filter(|&n| !class.is_some_and(|h| zs.same_class(h, n)));
            let Some(n) = packed else {
                map.keep_as_is(page);
                continue;
            };
            let Ok(h) = zs.alloc(&out[..n]) else {
                done.refused = true;
                break;
            };
            let new = zs.class_size(h) as u64;
            // LZ4-HC's object is an LZ4 page, which it would not shrink again.
            let (entry, keep) = match cold {
                Recompress::Lz4hc => (Entry::Packed(h), true),
                _ => (Entry::Cold(h), false),
            };
            Freer::new(&self.back).free(std::mem::replace(e, entry));
            if keep {
                map.keep_as_is(page);
            }
            self.stored.fetch_sub(old - new, Relaxed);
            done.pages += 1;
            done.saved_bytes += old - new;
        }
        done
    }
}
