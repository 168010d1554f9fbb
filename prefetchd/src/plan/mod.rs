//! The pure planning library: PGMS's hybrid prefetching and caching policy
//! (docs/DESIGN.md "2.4 Prefetching with hints", PGMS §2-3) with no I/O and no
//! clock of its own.
//!
//! - [`cursor`]: follows one job through its hinted reference stream.
//! - [`timing`]: time per reference and the fetch costs F_L, F_G, F_D.
//! - [`forestall`]: the conservative local prefetch predicate.
//! - [`coalesce`]: which blocks one disk request reads.
//! - [`slots`]: a table of block slots and its victim search (local
//!   memory's buffers and each donor's slots).
//! - [`engine`]: the planner tying them together with the local cache,
//!   the global-memory directory (donor slots), block values, replacement
//!   and the aggressive disk-to-global policy.
//!
//! Time is given by the caller in nanoseconds ([`Nanos`]) so tests drive a
//! simulated clock.

pub mod coalesce;
pub mod cursor;
pub mod engine;
pub mod forestall;
pub mod slots;
pub mod timing;

/// Monotonic time or a duration, in nanoseconds.
pub type Nanos = u64;

/// Index of a file in the daemon's file table.
pub type FileId = u32;

/// Identifies a registered job (never reused while the daemon runs).
pub type JobId = u32;

/// Index of a donor in the daemon's donor list.
pub type DonorId = usize;

/// One block of one file: bytes `index * block_size ..` of file `file`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId {
    pub file: FileId,
    pub index: u64,
}

impl BlockId {
    pub fn new(file: FileId, index: u64) -> BlockId {
        BlockId { file, index }
    }
}
