//! Raw pages moved out of a slab being emptied ([`crate::slab::Alloc::evacuee`]),
//! each under its shard's write lock, so a request never sees it half-copied;
//! a shard with none there is only read.

use netpager_util::RwLockExt;

use super::Export;

impl Export {
    /// Moves this export's raw pages that lie in slab `slab` into free
    /// pages of lower slabs; returns the pages moved, at most `limit`.
    pub(in crate::store) fn evacuate(&self, slab: u32, limit: u64) -> u64 {
        let mut moved = 0;
        for shard in self.shards.iter() {
            if !shard.read_or_recover().has_raw_in(slab) {
                continue;
            }
            let mut map = shard.write_or_recover();
            for page in map.raw_pages_mut().filter(|p| p.slab() == slab) {
                if moved == limit {
                    return moved;
                }
                if !self.back.slabs.lock().move_below(page, slab) {
                    return moved;
                }
                moved += 1;
            }
        }
        moved
    }
}
