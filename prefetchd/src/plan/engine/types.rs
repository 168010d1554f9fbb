//! The planner's public types: configuration, actions, answers and status.

use serde::Serialize;

use crate::plan::coalesce::CoalesceConfig;
use crate::plan::cursor::CursorConfig;
use crate::plan::timing::CostDefaults;
use crate::plan::{BlockId, DonorId, FileId, JobId, Nanos};

/// A job's hinted references, as blocks.
pub type BlockSource = Box<dyn Iterator<Item = BlockId> + Send>;

/// Tunables of the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Local cache size in blocks.
    pub local_blocks: u32,
    pub cursor: CursorConfig,
    pub costs: CostDefaults,
    /// B: most disk-to-global requests outstanding per donor (PGMS: 8).
    pub donor_outstanding: u32,
    /// Most prefetch requests into local memory in flight at once (a disk
    /// run counts once).
    pub local_prefetch_depth: u32,
    /// Most prefetch requests queued on the local disk at once (it serves
    /// one request at a time; a short queue keeps it busy without starving
    /// demand reads).
    pub disk_prefetch_depth: u32,
    /// How hinted blocks are coalesced into disk requests.
    pub coalesce: CoalesceConfig,
    /// Largest sequential readahead window, in blocks (1: none).
    pub readahead_blocks: u32,
    /// References examined per job for the Forestall predicate.
    pub forestall_scan: usize,
    /// References examined per disk-to-global planning pass.
    pub global_scan: usize,
    /// Least time between two disk-to-global passes unless global memory
    /// changed meanwhile.
    pub global_interval: Nanos,
    /// Entries examined to choose a victim.
    pub eviction_sample: usize,
    /// Whether prefetching happens at all (off: a demand-only cache).
    pub prefetch: bool,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            local_blocks: 1024,
            cursor: CursorConfig::default(),
            costs: CostDefaults::default(),
            donor_outstanding: 8,
            local_prefetch_depth: 16,
            disk_prefetch_depth: 2,
            coalesce: CoalesceConfig::default(),
            readahead_blocks: 16,
            forestall_scan: 1024,
            global_scan: 4096,
            global_interval: 1_000_000,
            eviction_sample: 4096,
            prefetch: true,
        }
    }
}

/// What a donor offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DonorSpec {
    /// Block slots in its export.
    pub slots: u32,
    /// Whether it has its own replica of the data set to read from.
    pub replica: bool,
}

/// The three levels a block can be served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Local,
    Global,
    Disk,
}

/// Identifies one local disk request.
pub type RunId = u64;

/// Where a fill into local memory reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalSource {
    Global { donor: DonorId, slot: u32 },
    Disk,
}

/// Where a fill into global memory reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalSource {
    /// The donor's own replica of the data set (its own disk).
    Replica,
    /// The busy node's disk, written to the donor.
    LocalDisk,
}

/// I/O the daemon must perform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Read `block` from `slot` of `donor` into local cache buffer `buf`
    /// (None: deliver it to its waiting reads without caching: every
    /// buffer was busy).
    FillLocal {
        block: BlockId,
        buf: Option<u32>,
        donor: DonorId,
        slot: u32,
        prefetch: bool,
    },
    /// Read blocks `first..first + count` of `file` from the local disk in
    /// one request; [`Engine::run_done`] then names the blocks it fills
    /// (the others were holes, or arrived meanwhile).
    ReadDisk {
        run: RunId,
        file: FileId,
        first: u64,
        count: u32,
        /// Queued behind demand reads.
        prefetch: bool,
    },
    /// Put `block` into `slot` of `donor`.
    FillGlobal {
        block: BlockId,
        donor: DonorId,
        slot: u32,
        from: GlobalSource,
        /// When the block is expected to be used: donors serve the
        /// earliest deadline first.
        deadline: Nanos,
    },
}

/// The answer to a read of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Resident in this cache buffer: copy it now.
    Hit { buf: u32 },
    /// Already on its way: it will be delivered when its fill completes.
    Wait,
    /// Perform this fill; the block is delivered when it completes.
    Fetch(Action),
}

/// Prefetches issued at one level and what became of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PrefetchCounts {
    pub issued: u64,
    /// Read by a job (or, for disk-to-global, fetched out of the donor).
    pub used: u64,
    /// Evicted (or lost with a donor) before any use.
    pub wasted: u64,
}

/// Where a job's block reads were served from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Hits {
    pub local: u64,
    pub global: u64,
    pub disk: u64,
}

/// Counters of one job (or of all unhinted readers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct JobStats {
    pub reads: u64,
    pub blocks: u64,
    pub hits: Hits,
    pub stall_ns: u64,
    pub global_to_local: PrefetchCounts,
    pub disk_to_local: PrefetchCounts,
    pub disk_to_global: PrefetchCounts,
}

/// A job as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobStatus {
    pub id: JobId,
    pub name: String,
    pub state: &'static str,
    /// References consumed in the hint stream.
    pub position: u64,
    pub window: usize,
    pub matched: u64,
    pub missed: u64,
    pub demotions: u64,
    pub promotions: u64,
    /// Hinted references served by the kernel's page cache (passed over
    /// without a read reaching prefetchd).
    pub page_cache_refs: u64,
    /// Estimated time per reference (compute + F_L).
    pub per_ref_ns: Nanos,
    pub stats: JobStats,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DonorStatus {
    pub id: DonorId,
    pub alive: bool,
    pub replica: bool,
    pub slots: u32,
    pub used: u32,
    pub outstanding: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineStatus {
    pub jobs: Vec<JobStatus>,
    pub unhinted: JobStats,
    pub local_blocks: u32,
    pub local_resident: u32,
    pub local_filling: u32,
    pub donors: Vec<DonorStatus>,
    pub f_local_ns: Nanos,
    pub f_global_ns: Nanos,
    pub f_disk_ns: Nanos,
}
