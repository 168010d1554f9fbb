//! The planner: PGMS's hybrid policy over three levels (docs/DESIGN.md "2.4
//! Prefetching with hints").
//!
//! The [`Engine`] owns the *metadata* of local memory (which block is in
//! which cache buffer) and of global memory (which block is in which donor
//! slot), follows every job through its hints, and answers two questions:
//!
//! - **a read arrives** ([`Engine::access`]): is the block here (a local
//!   hit), on its way (wait), or must it be fetched from global memory or
//!   disk, into which buffer?
//! - **what to prefetch now** ([`Engine::plan`]):
//!   - *global-to-local, conservative*: per hinted job, Forestall's
//!     predicate over its next missing blocks; when it holds, the first
//!     missing block is fetched, from global memory when it is there, else
//!     from disk, and only if a free buffer or a resident block used later
//!     exists (do no harm). A block still on its way into a donor is
//!     skipped for the next one: it is fetched from the donor when it
//!     lands, and the local disk meanwhile serves a later block in
//!     parallel with the donors' disks;
//!   - *disk-to-global, aggressive*: going through the hinted references
//!     of every job in order of use, a block on disk is put into a donor if
//!     that donor has a free slot or a block used later, evicting the one
//!     used furthest in the future. Donors are taken round-robin among
//!     those with fewer than B requests outstanding; each request carries
//!     its deadline so the donor serves the most valuable first.
//!
//! **Values.** A block's value is the estimated time to its next use: for
//! a block in a hinted job's window, its distance times the job's time per
//! reference (the smallest over jobs); otherwise the time since its last
//! use, which for a block last read by a hinted job is at least the time
//! that job needs to get through its window (it is not in it). Both caches
//! replace the block of largest value, the one used furthest in the future;
//! blocks of unhinted readers so behave LRU. Victims are chosen among at
//! most `eviction_sample` entries taken round-robin over the buffers or
//! slots, so a very large cache costs bounded time per eviction.
//!
//! **Disk requests.** Local disk reads are runs of blocks ([`coalesce`]):
//! a hinted prefetch or a following job's miss reads its block together
//! with the job's other upcoming blocks near it; other readers' misses
//! read ahead sequentially like the kernel. The disk queue limits count
//! requests, not blocks.
//!
//! The engine does no I/O: it returns [`Action`]s, and the daemon reports
//! back when they finish. A changed file gets a new [`FileId`] from the
//! daemon, so stale blocks are simply never asked for again and age out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use serde::Serialize;

use super::coalesce::{self, CoalesceConfig, Stream};
use super::cursor::{CursorConfig, CursorState, HintCursor};
use super::forestall::{must_prefetch, time_until, Missing};
use super::timing::{CostDefaults, Costs, RefClock};
use super::{BlockId, DonorId, FileId, JobId, Nanos};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    GlobalToLocal,
    DiskToLocal,
    DiskToGlobal,
}

/// A prefetched block not yet used, and the job to credit.
#[derive(Debug, Clone, Copy)]
struct Pending {
    job: JobId,
    kind: Kind,
}

#[derive(Debug, Clone, Copy)]
struct LocalEntry {
    buf: Option<u32>,
    /// Some while being filled.
    filling: Option<LocalSource>,
    last_use: Nanos,
    last_user: Option<JobId>,
    /// Whether the fill is a prefetch (as opposed to a demand fetch).
    prefetched: bool,
    /// Unused prefetch to credit on first use or eviction.
    prefetch: Option<Pending>,
}

#[derive(Debug, Clone, Copy)]
struct GlobalEntry {
    donor: DonorId,
    slot: u32,
    filling: bool,
    /// The donor has begun the fill (PGMS's acknowledgement).
    started: bool,
    /// Fills into local memory reading this slot right now.
    readers: u32,
    last_use: Nanos,
    last_user: Option<JobId>,
    prefetch: Option<Pending>,
}

struct Donor {
    spec: DonorSpec,
    alive: bool,
    slots: Vec<Option<BlockId>>,
    free: Vec<u32>,
    outstanding: u32,
    sweep: usize,
}

/// Why a disk request is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunKind {
    /// A read waits for its first block.
    Demand,
    /// Sequential readahead, ahead of an unhinted reader.
    Readahead,
    /// A hinted prefetch (counted against the prefetch depths).
    Prefetch,
}

/// A block a disk request may fill.
struct RunBlock {
    block: BlockId,
    /// Its time to use, to find a buffer without harm (None: a waited-for
    /// block, which takes any buffer).
    value: Option<Nanos>,
    prefetch: Option<Pending>,
}

/// A disk request in flight: the blocks it fills.
struct Run {
    blocks: Vec<BlockId>,
    counted: bool,
}

struct Job {
    name: String,
    cursor: HintCursor<BlockSource>,
    clock: RefClock,
    stats: JobStats,
}

/// See the module documentation.
pub struct Engine {
    cfg: EngineConfig,
    costs: Costs,
    jobs: BTreeMap<JobId, Job>,
    next_job: JobId,
    unhinted: JobStats,
    local: HashMap<BlockId, LocalEntry>,
    bufs: Vec<Option<BlockId>>,
    free_bufs: Vec<u32>,
    local_sweep: usize,
    local_prefetching: u32,
    disk_prefetching: u32,
    runs: HashMap<RunId, Run>,
    next_run: RunId,
    /// Readahead state per (reader, file).
    streams: HashMap<(Option<JobId>, FileId), Stream>,
    /// Readahead requests decided during reads, handed out by `plan`.
    queued: Vec<Action>,
    global: HashMap<BlockId, GlobalEntry>,
    donors: Vec<Donor>,
    donor_rr: usize,
    last_global_plan: Option<Nanos>,
    global_dirty: bool,
}

impl Engine {
    pub fn new(cfg: EngineConfig, donors: &[DonorSpec]) -> Engine {
        let n = cfg.local_blocks.max(1);
        let cfg = EngineConfig {
            local_blocks: n,
            eviction_sample: cfg.eviction_sample.max(1),
            ..cfg
        };
        let mut e = Engine {
            cfg,
            costs: Costs::new(cfg.costs),
            jobs: BTreeMap::new(),
            next_job: 1,
            unhinted: JobStats::default(),
            local: HashMap::with_capacity(n as usize),
            bufs: vec![None; n as usize],
            free_bufs: (0..n).rev().collect(),
            local_sweep: 0,
            local_prefetching: 0,
            disk_prefetching: 0,
            runs: HashMap::new(),
            next_run: 1,
            streams: HashMap::new(),
            queued: Vec::new(),
            global: HashMap::new(),
            donors: Vec::new(),
            donor_rr: 0,
            last_global_plan: None,
            global_dirty: true,
        };
        for &spec in donors {
            e.add_donor(spec);
        }
        e
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Sets the lookahead window of jobs added from now on (and the scan
    /// of disk-to-global planning with it).
    pub fn set_window(&mut self, window: usize) {
        self.cfg.cursor.window = window.max(1);
        self.cfg.global_scan = window.max(1);
    }

    /// Registers a job following `source`; returns its id.
    pub fn add_job(&mut self, name: &str, source: BlockSource) -> JobId {
        let id = self.next_job;
        self.next_job += 1;
        self.jobs.insert(
            id,
            Job {
                name: name.to_owned(),
                cursor: HintCursor::new(self.cfg.cursor, source),
                clock: RefClock::default(),
                stats: JobStats::default(),
            },
        );
        self.global_dirty = true;
        id
    }

    /// Forgets a job; its prefetched blocks stay cached and age out.
    pub fn remove_job(&mut self, job: JobId) -> bool {
        self.jobs.remove(&job).is_some()
    }

    fn stats_mut(&mut self, job: Option<JobId>) -> &mut JobStats {
        match job.and_then(|id| self.jobs.get_mut(&id)) {
            Some(j) => &mut j.stats,
            None => &mut self.unhinted,
        }
    }

    fn credit(&mut self, p: Pending, used: bool) {
        if let Some(j) = self.jobs.get_mut(&p.job) {
            let c = match p.kind {
                Kind::GlobalToLocal => &mut j.stats.global_to_local,
                Kind::DiskToLocal => &mut j.stats.disk_to_local,
                Kind::DiskToGlobal => &mut j.stats.disk_to_global,
            };
            if used {
                c.used += 1;
            } else {
                c.wasted += 1;
            }
        }
    }

    fn count_issued(&mut self, job: JobId, kind: Kind) {
        if let Some(j) = self.jobs.get_mut(&job) {
            let c = match kind {
                Kind::GlobalToLocal => &mut j.stats.global_to_local,
                Kind::DiskToLocal => &mut j.stats.disk_to_local,
                Kind::DiskToGlobal => &mut j.stats.disk_to_global,
            };
            c.issued += 1;
        }
    }

    /// A read of `blocks` blocks by `job` (None: an unhinted reader) starts.
    pub fn read_started(&mut self, job: Option<JobId>, blocks: u64, now: Nanos) {
        if let Some(j) = job.and_then(|id| self.jobs.get_mut(&id)) {
            j.clock.read_started(now, blocks);
        }
        self.stats_mut(job).reads += 1;
    }

    /// The read's bytes were returned; it waited `stalled` for fills. A
    /// read served wholly from local memory samples F_L.
    pub fn read_done(
        &mut self,
        job: Option<JobId>,
        now: Nanos,
        took: Nanos,
        stalled: Nanos,
        blocks: u64,
    ) {
        if let Some(j) = job.and_then(|id| self.jobs.get_mut(&id)) {
            j.clock.read_done(now);
        }
        self.stats_mut(job).stall_ns += stalled;
        if stalled == 0 {
            self.costs.local_sample(took / blocks.max(1));
        }
    }

    /// One block of a read by `job`: follows the job's hints, counts where
    /// the block is served from, and says how to get it.
    pub fn access(&mut self, job: Option<JobId>, block: BlockId, now: Nanos) -> Step {
        self.access_read(job, block, block.index + 1..u64::MAX, now)
    }

    /// As [`Engine::access`], for a read that goes on to block `ends.start`
    /// (exclusive) of a file of `ends.end` blocks: a disk request for this
    /// block reads the rest of the read too, and readahead stops at the end
    /// of the file.
    pub fn access_read(
        &mut self,
        job: Option<JobId>,
        block: BlockId,
        ends: Range<u64>,
        now: Nanos,
    ) -> Step {
        let job = job.filter(|id| self.jobs.contains_key(id));
        if let Some(j) = job.and_then(|id| self.jobs.get_mut(&id)) {
            j.cursor.observe(block);
        }
        self.stats_mut(job).blocks += 1;
        if let Some(e) = self.local.get_mut(&block) {
            e.last_use = now;
            e.last_user = job;
            let pending = e.prefetch.take();
            let level = match (e.filling, pending) {
                (None, _) | (Some(_), Some(_)) => Level::Local,
                (Some(LocalSource::Global { .. }), None) => Level::Global,
                (Some(LocalSource::Disk), None) => Level::Disk,
            };
            let step = match e.filling {
                None => Step::Hit {
                    buf: e.buf.expect("resident entries have a buffer"),
                },
                Some(_) => Step::Wait,
            };
            if let Some(p) = pending {
                self.credit(p, true);
            }
            self.count_hit(job, level);
            if !self.follows(job) {
                self.read_ahead(job, block, ends.end, now);
            }
            return step;
        }
        let level = if self.global.contains_key(&block) {
            Level::Global
        } else {
            Level::Disk
        };
        self.count_hit(job, level);
        let read_end = ends.start.max(block.index + 1);
        self.demand(block, job, read_end..ends.end.max(read_end), now)
    }

    /// A read by `job` returned all of `block` to the kernel, which keeps
    /// it in its page cache: the job's later references to it are served
    /// there, so they are no longer prefetched nor expected as reads, and
    /// a copy in local memory is worth no more than one the job read last.
    pub fn page_cached(&mut self, job: Option<JobId>, block: BlockId) {
        if let Some(j) = job.and_then(|id| self.jobs.get_mut(&id)) {
            j.cursor.mark_cached(block);
        }
    }

    /// Whether `job`'s hints drive its disk requests.
    fn follows(&self, job: Option<JobId>) -> bool {
        self.cfg.prefetch
            && job
                .and_then(|id| self.jobs.get(&id))
                .is_some_and(|j| j.cursor.hinted())
    }

    /// A read by a reader without hints found `block` cached or coming:
    /// queues the next readahead window when it reached the last one.
    fn read_ahead(&mut self, job: Option<JobId>, block: BlockId, file_end: u64, now: Nanos) {
        let max = u64::from(self.cfg.readahead_blocks);
        let Some(next) = self
            .streams
            .get_mut(&(job, block.file))
            .and_then(|s| s.hit(block.index, max))
        else {
            return;
        };
        let blocks = (next.start..next.end.min(file_end))
            .map(|index| RunBlock {
                block: BlockId::new(block.file, index),
                value: Some(0),
                prefetch: None,
            })
            .collect();
        if let Some(a) = self.start_run(blocks, job, RunKind::Readahead, now) {
            self.queued.push(a);
        }
    }

    fn count_hit(&mut self, job: Option<JobId>, level: Level) {
        let h = &mut self.stats_mut(job).hits;
        match level {
            Level::Local => h.local += 1,
            Level::Global => h.global += 1,
            Level::Disk => h.disk += 1,
        }
    }

    /// A block that reads are waiting for, looked at again (after a failed
    /// fill, or once it reached global memory).
    pub fn retry(&mut self, block: BlockId, now: Nanos) -> Step {
        match self.local.get(&block) {
            Some(e) if e.filling.is_none() => Step::Hit {
                buf: e.buf.expect("resident entries have a buffer"),
            },
            Some(_) => Step::Wait,
            None => self.demand(block, None, block.index + 1..block.index + 1, now),
        }
    }

    /// A demand fetch of a block not in local memory, for a read going on
    /// to block `ends.start` of a file of `ends.end` blocks.
    fn demand(&mut self, block: BlockId, job: Option<JobId>, ends: Range<u64>, now: Nanos) -> Step {
        let Some(g) = self.global.get_mut(&block) else {
            return self.demand_disk(block, job, ends, now);
        };
        if g.filling {
            return Step::Wait;
        }
        g.readers += 1;
        g.last_use = now;
        g.last_user = job;
        let p = g.prefetch.take();
        let (donor, slot) = (g.donor, g.slot);
        if let Some(p) = p {
            self.credit(p, true);
        }
        let buf = self.take_buffer(None, now);
        self.local.insert(
            block,
            LocalEntry {
                buf,
                filling: Some(LocalSource::Global { donor, slot }),
                last_use: now,
                last_user: job,
                prefetched: false,
                prefetch: None,
            },
        );
        if let Some(b) = buf {
            self.bufs[b as usize] = Some(block);
        }
        Step::Fetch(Action::FillLocal {
            block,
            buf,
            donor,
            slot,
            prefetch: false,
        })
    }

    /// A demand read from disk: with the rest of the read, and with the
    /// job's upcoming blocks nearby if it follows its hints, else with a
    /// sequential reader's readahead.
    fn demand_disk(
        &mut self,
        block: BlockId,
        job: Option<JobId>,
        ends: Range<u64>,
        now: Nanos,
    ) -> Step {
        let read_end = ends.start;
        let rest = (block.index + 1..read_end).map(|index| RunBlock {
            block: BlockId::new(block.file, index),
            value: Some(0),
            prefetch: None,
        });
        let mut blocks = vec![RunBlock {
            block,
            value: None,
            prefetch: None,
        }];
        match job.filter(|_| self.follows(job)) {
            Some(id) => {
                let wanted = self.upcoming_missing(id, block.file);
                let run = coalesce::run_around(
                    block.index,
                    &wanted.iter().map(|w| w.block.index).collect::<Vec<_>>(),
                    self.cfg.coalesce,
                );
                blocks.extend(rest);
                blocks.extend(
                    wanted
                        .into_iter()
                        .filter(|w| run.contains(&w.block.index) && w.block.index >= read_end),
                );
            }
            None => {
                let max = u64::from(self.cfg.readahead_blocks);
                let run = self
                    .streams
                    .entry((job, block.file))
                    .or_default()
                    .miss(block.index..read_end, max);
                blocks.extend(rest);
                blocks.extend((read_end..run.end.min(ends.end)).map(|index| RunBlock {
                    block: BlockId::new(block.file, index),
                    value: Some(0),
                    prefetch: None,
                }));
            }
        }
        let run = self
            .start_run(blocks, job, RunKind::Demand, now)
            .expect("a waited-for block always joins its run");
        Step::Fetch(run)
    }

    /// The next blocks of `file` job `id` will read that are neither local
    /// nor in global memory, first use first, as prefetches of the job.
    /// Only as far ahead as local memory holds blocks: one used later would
    /// likely be evicted before its use by those used before it.
    fn upcoming_missing(&self, id: JobId, file: FileId) -> Vec<RunBlock> {
        let Some(j) = self.jobs.get(&id) else {
            return Vec::new();
        };
        let per_ref = self.per_ref(j);
        let mut seen = HashSet::new();
        j.cursor
            .upcoming()
            .take(self.cfg.forestall_scan.min(self.bufs.len()))
            .filter(|(_, b)| {
                b.file == file
                    && !self.local.contains_key(b)
                    && !self.global.contains_key(b)
                    && seen.insert(*b)
            })
            .map(|(d, block)| RunBlock {
                block,
                value: Some(time_until(d, per_ref)),
                prefetch: Some(Pending {
                    job: id,
                    kind: Kind::DiskToLocal,
                }),
            })
            .collect()
    }

    /// One disk request filling what it can of `blocks` (the first is the
    /// one it is made for: without a buffer for it, there is no request),
    /// reading from the lowest to the highest block filled, at most
    /// [`Engine::max_run`] blocks.
    fn start_run(
        &mut self,
        blocks: Vec<RunBlock>,
        job: Option<JobId>,
        kind: RunKind,
        now: Nanos,
    ) -> Option<Action> {
        let file = blocks.first()?.block.file;
        let limit = u64::from(self.max_run());
        let mut filled: Vec<BlockId> = Vec::with_capacity(blocks.len());
        let mut span = blocks[0].block.index..blocks[0].block.index + 1;
        for (i, rb) in blocks.into_iter().enumerate() {
            let index = rb.block.index;
            let wider = span.start.min(index)..span.end.max(index + 1);
            if wider.end - wider.start > limit {
                continue;
            }
            if self.local.contains_key(&rb.block) {
                if i == 0 {
                    return None;
                }
                continue;
            }
            let buf = match rb.value {
                None => self.take_buffer(None, now),
                Some(v) => match self.take_buffer(Some(v), now) {
                    Some(b) => Some(b),
                    None if i == 0 => return None,
                    None => continue,
                },
            };
            if let Some(p) = rb.prefetch {
                self.count_issued(p.job, p.kind);
            }
            self.local.insert(
                rb.block,
                LocalEntry {
                    buf,
                    filling: Some(LocalSource::Disk),
                    last_use: now,
                    last_user: job,
                    prefetched: kind == RunKind::Prefetch,
                    prefetch: rb.prefetch,
                },
            );
            if let Some(b) = buf {
                self.bufs[b as usize] = Some(rb.block);
            }
            filled.push(rb.block);
            span = wider;
        }
        let first = filled.iter().map(|b| b.index).min()?;
        let last = filled.iter().map(|b| b.index).max()?;
        let counted = kind == RunKind::Prefetch;
        if counted {
            self.disk_prefetching += 1;
            self.local_prefetching += 1;
        }
        let run = self.next_run;
        self.next_run += 1;
        self.runs.insert(
            run,
            Run {
                blocks: filled,
                counted,
            },
        );
        Some(Action::ReadDisk {
            run,
            file,
            first,
            count: (last - first + 1) as u32,
            prefetch: kind != RunKind::Demand,
        })
    }

    /// The longest disk request, in blocks.
    pub fn max_run(&self) -> u32 {
        self.cfg
            .coalesce
            .max_blocks
            .max(self.cfg.readahead_blocks)
            .max(1)
    }

    /// Disk request `run` finished: the blocks it was to fill, to report
    /// with [`Engine::local_filled`] or [`Engine::local_failed`] each.
    pub fn run_done(&mut self, run: RunId) -> Vec<BlockId> {
        let Some(r) = self.runs.remove(&run) else {
            return Vec::new();
        };
        if r.counted {
            self.disk_prefetching = self.disk_prefetching.saturating_sub(1);
            self.local_prefetching = self.local_prefetching.saturating_sub(1);
        }
        r.blocks
    }

    /// The estimated time until `block` is next used (see the module
    /// documentation).
    fn time_to_use(
        &self,
        block: BlockId,
        last_use: Nanos,
        last_user: Option<JobId>,
        now: Nanos,
    ) -> Nanos {
        let mut best: Option<Nanos> = None;
        for j in self.jobs.values() {
            if !j.cursor.hinted() {
                continue;
            }
            if let Some(d) = j.cursor.next_use(block) {
                let t = time_until(d, self.per_ref(j));
                best = Some(best.map_or(t, |b| b.min(t)));
            }
        }
        if let Some(t) = best {
            return t;
        }
        let since = now.saturating_sub(last_use);
        match last_user.and_then(|id| self.jobs.get(&id)) {
            Some(j) if j.cursor.hinted() => {
                since.max(time_until(j.cursor.window_len() as u64, self.per_ref(j)))
            }
            _ => since,
        }
    }

    fn per_ref(&self, j: &Job) -> Nanos {
        j.clock.gap(self.cfg.costs.gap) + self.costs.local()
    }

    /// A free buffer, or the one holding the resident block used furthest
    /// in the future, if that is later than `better_than`.
    fn take_buffer(&mut self, better_than: Option<Nanos>, now: Nanos) -> Option<u32> {
        if let Some(b) = self.free_bufs.pop() {
            return Some(b);
        }
        let n = self.bufs.len();
        let sample = self.cfg.eviction_sample.min(n);
        let mut victim: Option<(Nanos, u32, BlockId)> = None;
        for i in 0..sample {
            let idx = (self.local_sweep + i) % n;
            let Some(block) = self.bufs[idx] else {
                continue;
            };
            let e = &self.local[&block];
            if e.filling.is_some() {
                continue;
            }
            let v = self.time_to_use(block, e.last_use, e.last_user, now);
            if victim.is_none_or(|(best, _, _)| v > best) {
                victim = Some((v, idx as u32, block));
            }
        }
        self.local_sweep = (self.local_sweep + sample) % n;
        let (value, idx, block) = victim?;
        if better_than.is_some_and(|t| value <= t) {
            return None;
        }
        let e = self
            .local
            .remove(&block)
            .expect("buffer map and entries agree");
        if let Some(p) = e.prefetch {
            self.credit(p, false);
        }
        self.bufs[idx as usize] = None;
        Some(idx)
    }

    /// A fill into local memory completed: returns the buffer to copy the
    /// block into (None: deliver it to its waiting reads only).
    pub fn local_filled(&mut self, block: BlockId) -> Option<u32> {
        let e = self.local.get_mut(&block)?;
        let from = e.filling.take()?;
        let (buf, prefetched) = (e.buf, e.prefetched);
        if buf.is_none() {
            self.local.remove(&block);
        }
        self.fill_finished(from, prefetched);
        buf
    }

    /// A fill into local memory failed: the block is not there.
    pub fn local_failed(&mut self, block: BlockId) {
        let Some(from) = self.local.get(&block).and_then(|e| e.filling) else {
            return;
        };
        let e = self.local.remove(&block).expect("present");
        if let Some(b) = e.buf {
            self.bufs[b as usize] = None;
            self.free_bufs.push(b);
        }
        if let Some(p) = e.prefetch {
            self.credit(p, false);
        }
        self.fill_finished(from, e.prefetched);
    }

    /// Disk requests are accounted for by [`Engine::run_done`].
    fn fill_finished(&mut self, from: LocalSource, was_prefetch: bool) {
        let LocalSource::Global { donor, slot } = from else {
            return;
        };
        if let Some(block) = self.donors[donor].slots[slot as usize] {
            if let Some(g) = self.global.get_mut(&block) {
                g.readers = g.readers.saturating_sub(1);
            }
        }
        if was_prefetch {
            self.local_prefetching = self.local_prefetching.saturating_sub(1);
        }
    }

    /// A local disk read submitted at `submitted` completed at `done`.
    pub fn disk_sample(&mut self, submitted: Nanos, done: Nanos) {
        self.costs.disk_done(submitted, done);
    }

    /// A read of one block out of a donor's memory took `took`.
    pub fn global_sample(&mut self, took: Nanos) {
        self.costs.global_sample(took);
    }

    /// The donor began a disk-to-global fill.
    pub fn global_started(&mut self, block: BlockId) {
        if let Some(g) = self.global.get_mut(&block) {
            g.started = true;
        }
    }

    /// A disk-to-global fill completed: the block is in the donor's slot.
    pub fn global_filled(&mut self, block: BlockId, now: Nanos) {
        let Some(g) = self.global.get_mut(&block) else {
            return;
        };
        if !g.filling {
            return;
        }
        g.filling = false;
        g.started = true;
        g.last_use = now;
        let (donor, from_local_disk) = (g.donor, !self.donors[g.donor].spec.replica);
        if !self.donors[donor].alive {
            // Landed in a donor that is gone or was let go meanwhile.
            let g = self.global.remove(&block).expect("present");
            let d = &mut self.donors[donor];
            d.slots[g.slot as usize] = None;
            d.free.push(g.slot);
            if let Some(p) = g.prefetch {
                self.credit(p, false);
            }
        }
        self.finish_global(donor, from_local_disk);
    }

    /// A disk-to-global fill failed: the slot is free again.
    pub fn global_failed(&mut self, block: BlockId) {
        let Some(g) = self.global.get(&block) else {
            return;
        };
        if !g.filling {
            return;
        }
        let g = self.global.remove(&block).expect("present");
        let d = &mut self.donors[g.donor];
        d.slots[g.slot as usize] = None;
        d.free.push(g.slot);
        let from_local_disk = !d.spec.replica;
        if let Some(p) = g.prefetch {
            self.credit(p, false);
        }
        self.finish_global(g.donor, from_local_disk);
    }

    fn finish_global(&mut self, donor: DonorId, from_local_disk: bool) {
        let d = &mut self.donors[donor];
        d.outstanding = d.outstanding.saturating_sub(1);
        if from_local_disk {
            self.disk_prefetching = self.disk_prefetching.saturating_sub(1);
        }
        self.global_dirty = true;
    }

    /// A donor comes (back): a fresh one, with every slot empty, under a
    /// new id (requests decided for an earlier life of the same donor keep
    /// the old id, so they can never touch the new one's slots).
    pub fn add_donor(&mut self, spec: DonorSpec) -> DonorId {
        self.donors.push(Donor {
            spec,
            alive: true,
            slots: vec![None; spec.slots as usize],
            free: (0..spec.slots).rev().collect(),
            outstanding: 0,
            sweep: 0,
        });
        self.global_dirty = true;
        self.donors.len() - 1
    }

    /// A donor stopped answering, or is let go: everything it held is
    /// forgotten and it gets no more requests. Fills in flight report their
    /// own end.
    pub fn donor_failed(&mut self, donor: DonorId) {
        let Some(d) = self.donors.get_mut(donor) else {
            return;
        };
        if !d.alive {
            return;
        }
        d.alive = false;
        let lost: Vec<BlockId> = d.slots.iter().flatten().copied().collect();
        for block in lost {
            if let Some(g) = self.global.get(&block) {
                if !g.filling {
                    let g = self.global.remove(&block).expect("present");
                    if let Some(p) = g.prefetch {
                        self.credit(p, false);
                    }
                }
            }
        }
        let d = &mut self.donors[donor];
        for (i, s) in d.slots.iter_mut().enumerate() {
            if s.is_some_and(|b| !self.global.contains_key(&b)) {
                *s = None;
                d.free.push(i as u32);
            }
        }
        self.global_dirty = true;
    }

    /// Prefetches to start now.
    pub fn plan(&mut self, now: Nanos) -> Vec<Action> {
        let mut out = std::mem::take(&mut self.queued);
        if !self.cfg.prefetch {
            return out;
        }
        let ids: Vec<JobId> = self.jobs.keys().copied().collect();
        for id in ids {
            self.plan_local(id, now, &mut out);
        }
        let due = self.global_dirty
            || self
                .last_global_plan
                .is_none_or(|t| now.saturating_sub(t) >= self.cfg.global_interval);
        if due && self.donors.iter().any(|d| d.alive) {
            self.last_global_plan = Some(now);
            self.global_dirty = false;
            self.plan_global(now, &mut out);
        }
        out
    }

    /// Forestall for one job: prefetch its first missing block while the
    /// predicate holds and a buffer can be had without harm.
    fn plan_local(&mut self, id: JobId, now: Nanos, out: &mut Vec<Action>) {
        while self.local_prefetching < self.cfg.local_prefetch_depth {
            let Some(j) = self.jobs.get(&id) else { return };
            if !j.cursor.hinted() {
                return;
            }
            let per_ref = self.per_ref(j);
            let (fg, fd) = (self.costs.global(), self.costs.disk());
            // The block to fetch: the first missing one not already on
            // its way into a donor (that one is fetched from the donor once
            // it lands), so the local disk works in parallel with the
            // donors' disks instead of idling behind them.
            let mut target: Option<(u64, BlockId)> = None;
            let mut missing = Vec::new();
            let mut seen = HashSet::new();
            for (d, b) in j.cursor.upcoming().take(self.cfg.forestall_scan) {
                if self.local.contains_key(&b) || !seen.insert(b) {
                    continue;
                }
                let (fetch, filling) = match self.global.get(&b) {
                    Some(g) => (if g.started { fg } else { fd }, g.filling),
                    None => (fd, false),
                };
                if target.is_none() && !filling {
                    target = Some((d, b));
                }
                missing.push((d, b, fetch));
            }
            let Some((distance, block)) = target else {
                return;
            };
            let urgent = must_prefetch(
                missing
                    .iter()
                    .map(|&(distance, _, fetch)| Missing { distance, fetch }),
                per_ref,
            );
            if !urgent {
                return;
            }
            let t = time_until(distance, per_ref);
            let Some(&GlobalEntry { donor, slot, .. }) = self.global.get(&block) else {
                if self.disk_prefetching >= self.cfg.disk_prefetch_depth {
                    return;
                }
                // The target first, then its upcoming neighbours in the run.
                let wanted = self.upcoming_missing(id, block.file);
                let run = coalesce::run_around(
                    block.index,
                    &wanted.iter().map(|w| w.block.index).collect::<Vec<_>>(),
                    self.cfg.coalesce,
                );
                let mut blocks = vec![RunBlock {
                    block,
                    value: Some(t),
                    prefetch: Some(Pending {
                        job: id,
                        kind: Kind::DiskToLocal,
                    }),
                }];
                blocks.extend(
                    wanted
                        .into_iter()
                        .filter(|w| w.block != block && run.contains(&w.block.index)),
                );
                match self.start_run(blocks, Some(id), RunKind::Prefetch, now) {
                    Some(a) => {
                        out.push(a);
                        continue;
                    }
                    None => return,
                }
            };
            let Some(buf) = self.take_buffer(Some(t), now) else {
                return;
            };
            let g = self.global.get_mut(&block).expect("checked above");
            g.readers += 1;
            g.last_use = now;
            if let Some(p) = g.prefetch.take() {
                self.credit(p, true);
            }
            self.local_prefetching += 1;
            let kind = Kind::GlobalToLocal;
            self.count_issued(id, kind);
            self.local.insert(
                block,
                LocalEntry {
                    buf: Some(buf),
                    filling: Some(LocalSource::Global { donor, slot }),
                    last_use: now,
                    last_user: Some(id),
                    prefetched: true,
                    prefetch: Some(Pending { job: id, kind }),
                },
            );
            self.bufs[buf as usize] = Some(block);
            out.push(Action::FillLocal {
                block,
                buf: Some(buf),
                donor,
                slot,
                prefetch: true,
            });
        }
    }

    /// The hinted references of every following job in order of expected
    /// use, at most `global_scan` of them: (time to use, block, job).
    fn upcoming_by_time(&self) -> Vec<(Nanos, BlockId, JobId)> {
        let mut all = Vec::new();
        for (&id, j) in &self.jobs {
            if !j.cursor.hinted() {
                continue;
            }
            let per_ref = self.per_ref(j);
            all.extend(
                j.cursor
                    .upcoming()
                    .take(self.cfg.global_scan)
                    .map(|(d, b)| (time_until(d, per_ref), b, id)),
            );
        }
        // Each job's references are already in order; a stable sort merges.
        all.sort_by_key(|&(t, _, _)| t);
        all.truncate(self.cfg.global_scan);
        all
    }

    /// Aggressive disk-to-global prefetching.
    fn plan_global(&mut self, now: Nanos, out: &mut Vec<Action>) {
        let mut victims: Vec<Option<Option<(Nanos, u32)>>> = vec![None; self.donors.len()];
        for (t, block, job) in self.upcoming_by_time() {
            if self.local.contains_key(&block) || self.global.contains_key(&block) {
                continue;
            }
            let mut placed = false;
            for k in 0..self.donors.len() {
                let d = (self.donor_rr + k) % self.donors.len();
                let donor = &self.donors[d];
                if !donor.alive || donor.outstanding >= self.cfg.donor_outstanding {
                    continue;
                }
                if !donor.spec.replica && self.disk_prefetching >= self.cfg.disk_prefetch_depth {
                    continue;
                }
                let slot = if let Some(&s) = donor.free.last() {
                    self.donors[d].free.pop();
                    s
                } else {
                    let v = match victims[d] {
                        Some(v) => v,
                        None => {
                            let v = self.global_victim(d, now);
                            victims[d] = Some(v);
                            v
                        }
                    };
                    match v {
                        Some((value, slot)) if value > t => {
                            victims[d] = None;
                            self.evict_global(d, slot);
                            slot
                        }
                        _ => continue,
                    }
                };
                let replica = self.donors[d].spec.replica;
                let donor = &mut self.donors[d];
                donor.slots[slot as usize] = Some(block);
                donor.outstanding += 1;
                if !replica {
                    self.disk_prefetching += 1;
                }
                self.global.insert(
                    block,
                    GlobalEntry {
                        donor: d,
                        slot,
                        filling: true,
                        started: false,
                        readers: 0,
                        last_use: now,
                        last_user: Some(job),
                        prefetch: Some(Pending {
                            job,
                            kind: Kind::DiskToGlobal,
                        }),
                    },
                );
                self.count_issued(job, Kind::DiskToGlobal);
                out.push(Action::FillGlobal {
                    block,
                    donor: d,
                    slot,
                    from: if replica {
                        GlobalSource::Replica
                    } else {
                        GlobalSource::LocalDisk
                    },
                    deadline: now.saturating_add(t),
                });
                self.donor_rr = (d + 1) % self.donors.len();
                placed = true;
                break;
            }
            // References come in order of use: once no donor takes this one,
            // none takes a later one.
            if !placed {
                return;
            }
        }
    }

    /// The block in `donor` used furthest in the future: (value, slot).
    fn global_victim(&self, donor: DonorId, now: Nanos) -> Option<(Nanos, u32)> {
        let d = &self.donors[donor];
        let n = d.slots.len();
        if n == 0 {
            return None;
        }
        let sample = self.cfg.eviction_sample.min(n);
        let mut best: Option<(Nanos, u32)> = None;
        for i in 0..sample {
            let idx = (d.sweep + i) % n;
            let Some(block) = d.slots[idx] else { continue };
            let g = &self.global[&block];
            if g.filling || g.readers > 0 {
                continue;
            }
            let v = self.time_to_use(block, g.last_use, g.last_user, now);
            if best.is_none_or(|(b, _)| v > b) {
                best = Some((v, idx as u32));
            }
        }
        best
    }

    fn evict_global(&mut self, donor: DonorId, slot: u32) {
        let d = &mut self.donors[donor];
        d.sweep = (slot as usize + 1) % d.slots.len();
        let block = d.slots[slot as usize]
            .take()
            .expect("victim slot holds a block");
        let g = self
            .global
            .remove(&block)
            .expect("slot map and entries agree");
        if let Some(p) = g.prefetch {
            self.credit(p, false);
        }
    }

    /// Whether `block` is resident in local memory (not being filled).
    pub fn is_local(&self, block: BlockId) -> bool {
        self.local.get(&block).is_some_and(|e| e.filling.is_none())
    }

    /// Whether `block` is resident in a donor (not being filled).
    pub fn is_global(&self, block: BlockId) -> bool {
        self.global.get(&block).is_some_and(|g| !g.filling)
    }

    pub fn status(&self) -> EngineStatus {
        EngineStatus {
            jobs: self
                .jobs
                .iter()
                .map(|(&id, j)| {
                    let c = j.cursor.counts();
                    JobStatus {
                        id,
                        name: j.name.clone(),
                        state: j.cursor.state().name(),
                        position: j.cursor.position(),
                        window: j.cursor.window_len(),
                        matched: c.matched,
                        missed: c.missed,
                        demotions: c.demotions,
                        promotions: c.promotions,
                        page_cache_refs: c.page_cache_refs,
                        per_ref_ns: self.per_ref(j),
                        stats: j.stats,
                    }
                })
                .collect(),
            unhinted: self.unhinted,
            local_blocks: self.cfg.local_blocks,
            local_resident: self.local.values().filter(|e| e.filling.is_none()).count() as u32,
            local_filling: self.local.values().filter(|e| e.filling.is_some()).count() as u32,
            donors: self
                .donors
                .iter()
                .enumerate()
                .map(|(id, d)| DonorStatus {
                    id,
                    alive: d.alive,
                    replica: d.spec.replica,
                    slots: d.spec.slots,
                    used: d.slots.iter().filter(|s| s.is_some()).count() as u32,
                    outstanding: d.outstanding,
                })
                .collect(),
            f_local_ns: self.costs.local(),
            f_global_ns: self.costs.global(),
            f_disk_ns: self.costs.disk(),
        }
    }

    /// The state of a job's cursor, if it exists.
    pub fn job_state(&self, job: JobId) -> Option<CursorState> {
        self.jobs.get(&job).map(|j| j.cursor.state())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    const MS: Nanos = 1_000_000;
    const US: Nanos = 1_000;

    fn b(i: u64) -> BlockId {
        BlockId::new(1, i)
    }

    fn source(refs: Vec<u64>) -> BlockSource {
        Box::new(refs.into_iter().map(b).collect::<Vec<_>>().into_iter())
    }

    fn cfg(local_blocks: u32) -> EngineConfig {
        EngineConfig {
            local_blocks,
            cursor: CursorConfig {
                window: 256,
                ..CursorConfig::default()
            },
            costs: CostDefaults {
                local: 10 * US,
                global: 200 * US,
                disk: 10 * MS,
                gap: 250 * US,
            },
            // One block per disk request unless a test says otherwise.
            coalesce: CoalesceConfig {
                max_blocks: 1,
                max_gap: 0,
            },
            readahead_blocks: 1,
            ..EngineConfig::default()
        }
    }

    /// Fetches `block` by demand and completes the fill at once.
    fn read_now(e: &mut Engine, job: Option<JobId>, block: BlockId, now: Nanos) -> Level {
        match e.access(job, block, now) {
            Step::Hit { .. } => Level::Local,
            Step::Fetch(Action::FillLocal { .. }) => {
                e.local_filled(block);
                Level::Global
            }
            Step::Fetch(Action::ReadDisk { run, .. }) => {
                for b in e.run_done(run) {
                    e.local_filled(b);
                }
                Level::Disk
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn demand_read_then_local_hit() {
        let mut e = Engine::new(cfg(4), &[]);
        assert_eq!(read_now(&mut e, None, b(1), 0), Level::Disk);
        assert_eq!(read_now(&mut e, None, b(1), 1), Level::Local);
        assert_eq!(
            e.status().unhinted.hits,
            Hits {
                local: 1,
                global: 0,
                disk: 1
            }
        );
    }

    #[test]
    fn unhinted_blocks_are_replaced_lru() {
        let mut e = Engine::new(cfg(3), &[]);
        for (t, i) in [1, 2, 3].into_iter().enumerate() {
            read_now(&mut e, None, b(i), t as Nanos * 10);
        }
        read_now(&mut e, None, b(1), 40); // 2 is now least recently used
        read_now(&mut e, None, b(4), 50);
        assert!(e.is_local(b(1)) && e.is_local(b(3)) && e.is_local(b(4)));
        assert!(!e.is_local(b(2)));
    }

    #[test]
    fn hinted_job_replaces_the_block_used_furthest_in_the_future() {
        let mut e = Engine::new(
            EngineConfig {
                prefetch: false,
                ..cfg(3)
            },
            &[],
        );
        let j = e.add_job("j", source(vec![1, 2, 3, 4, 2, 1, 3]));
        for (t, i) in [1, 2, 3, 4].into_iter().enumerate() {
            read_now(&mut e, Some(j), b(i), t as Nanos * MS);
        }
        // Reading 4 evicted 3, the resident block needed last.
        assert!(e.is_local(b(1)) && e.is_local(b(2)) && !e.is_local(b(3)));
    }

    #[test]
    fn a_block_in_the_page_cache_gives_up_its_buffer_first_and_is_not_prefetched() {
        let mut e = Engine::new(
            EngineConfig {
                prefetch: false,
                ..cfg(2)
            },
            &[],
        );
        let j = e.add_job("j", source(vec![1, 2, 1, 2, 3, 1]));
        read_now(&mut e, Some(j), b(1), 0);
        e.page_cached(Some(j), b(1));
        // 2 was read only in part: the kernel does not hold all of it.
        read_now(&mut e, Some(j), b(2), MS);
        read_now(&mut e, Some(j), b(3), 2 * MS);
        // Without the page cache 1 would be kept (used again soonest).
        assert!(!e.is_local(b(1)) && e.is_local(b(2)) && e.is_local(b(3)));
        let st = &e.status().jobs[0];
        assert_eq!((st.page_cache_refs, st.missed), (2, 0), "{st:?}");
        // One buffer: reading 2 evicts 1, which the page cache still holds.
        let mut e = Engine::new(cfg(1), &[]);
        let j = e.add_job("j", source(vec![1, 2, 1, 3]));
        read_now(&mut e, Some(j), b(1), 0);
        e.page_cached(Some(j), b(1));
        read_now(&mut e, Some(j), b(2), MS);
        let wanted: Vec<u64> = disk_runs(&e.plan(MS)).iter().map(|r| r.1).collect();
        assert_eq!(wanted, vec![3], "1 comes from the page cache");
    }

    #[test]
    fn an_io_bound_job_prefetches_from_disk_and_hits() {
        let mut e = Engine::new(cfg(64), &[]);
        let j = e.add_job("j", source((0..40).collect()));
        let actions = e.plan(0);
        assert!(!actions.is_empty());
        // The local disk gets a short queue of prefetches, in stream order.
        assert_eq!(actions.len() as u32, e.config().disk_prefetch_depth);
        for (i, a) in actions.iter().enumerate() {
            let Action::ReadDisk {
                run,
                first,
                count,
                prefetch,
                ..
            } = *a
            else {
                panic!("{a:?}")
            };
            assert_eq!((first, count, prefetch), (i as u64, 1, true));
            for block in e.run_done(run) {
                assert!(e.local_filled(block).is_some());
            }
        }
        assert!(matches!(e.access(Some(j), b(0), MS), Step::Hit { .. }));
        let s = &e.status().jobs[0].stats;
        assert_eq!(
            (s.hits.local, s.disk_to_local.issued, s.disk_to_local.used),
            (1, 2, 1)
        );
    }

    #[test]
    fn a_compute_bound_job_does_not_prefetch_early() {
        // 100 ms per reference: each disk read fits between two reads, so
        // only the next block is fetched now.
        let mut e = Engine::new(
            EngineConfig {
                costs: CostDefaults {
                    gap: 100 * MS,
                    ..cfg(64).costs
                },
                ..cfg(64)
            },
            &[],
        );
        e.add_job("j", source((0..40).collect()));
        assert_eq!(e.plan(0).len(), 1);
    }

    #[test]
    fn local_prefetch_does_no_harm() {
        // The cache is full of blocks the job needs before the missing one.
        let mut e = Engine::new(
            EngineConfig {
                disk_prefetch_depth: 8,
                ..cfg(2)
            },
            &[],
        );
        let j = e.add_job("j", source(vec![1, 2, 1, 2, 1, 2, 9]));
        read_now(&mut e, Some(j), b(1), 0);
        read_now(&mut e, Some(j), b(2), 0);
        assert!(e.plan(0).is_empty(), "would evict a block used before 9");
    }

    #[test]
    fn demoted_job_stops_prefetching() {
        let mut e = Engine::new(cfg(64), &[]);
        let j = e.add_job("j", source((0..100).collect()));
        for i in 1000..1008 {
            read_now(&mut e, Some(j), b(i), 0);
        }
        assert_eq!(e.job_state(j), Some(CursorState::Unhinted));
        // Clear what was prefetched before, then nothing new is planned.
        assert!(e
            .plan(0)
            .iter()
            .all(|a| !matches!(a, Action::FillLocal { prefetch: true, .. })));
    }

    #[test]
    fn disk_to_global_is_aggressive_bounded_by_b_and_round_robin() {
        let donors = [
            DonorSpec {
                slots: 100,
                replica: true,
            },
            DonorSpec {
                slots: 100,
                replica: true,
            },
        ];
        let mut e = Engine::new(cfg(8), &donors);
        e.add_job("j", source((0..200).collect()));
        let actions = e.plan(0);
        let fills: Vec<_> = actions
            .iter()
            .filter_map(|a| match *a {
                Action::FillGlobal {
                    block,
                    donor,
                    from,
                    deadline,
                    ..
                } => Some((block, donor, from, deadline)),
                _ => None,
            })
            .collect();
        // B = 8 outstanding on each donor.
        assert_eq!(fills.len(), 16);
        assert_eq!(fills.iter().filter(|f| f.1 == 0).count(), 8);
        // Alternating donors, earliest deadlines first, all from replicas.
        assert!(fills
            .windows(2)
            .all(|w| w[0].1 != w[1].1 && w[0].3 <= w[1].3));
        assert!(fills.iter().all(|f| f.2 == GlobalSource::Replica));
        // Nothing more until some complete.
        assert!(e
            .plan(10 * MS)
            .iter()
            .all(|a| !matches!(a, Action::FillGlobal { .. })));
        e.global_filled(fills[0].0, 20 * MS);
        let more = e.plan(20 * MS);
        assert_eq!(
            more.iter()
                .filter(|a| matches!(a, Action::FillGlobal { donor: 0, .. }))
                .count(),
            1
        );
    }

    #[test]
    fn the_local_disk_serves_blocks_not_already_headed_for_a_donor() {
        let donors = [DonorSpec {
            slots: 100,
            replica: true,
        }];
        let mut e = Engine::new(cfg(64), &donors);
        e.add_job("j", source((0..100).collect()));
        let a = e.plan(0);
        let to_global: HashSet<BlockId> = a
            .iter()
            .filter_map(|a| match a {
                Action::FillGlobal { block, .. } => Some(*block),
                _ => None,
            })
            .collect();
        let to_local: Vec<BlockId> = a
            .iter()
            .filter_map(|a| match a {
                Action::ReadDisk { file, first, .. } => Some(BlockId::new(*file, *first)),
                _ => None,
            })
            .collect();
        assert_eq!(to_global.len(), 8);
        assert!(!to_local.is_empty());
        assert!(
            to_local.iter().all(|b| !to_global.contains(b)),
            "{to_local:?} {to_global:?}"
        );
        assert_eq!(
            to_local[0],
            b(0),
            "nothing is headed for a donor before planning"
        );
    }

    #[test]
    fn global_eviction_replaces_the_block_used_furthest_and_only_if_later() {
        let donors = [DonorSpec {
            slots: 2,
            replica: true,
        }];
        let mut e = Engine::new(
            EngineConfig {
                local_prefetch_depth: 0,
                ..cfg(8)
            },
            &donors,
        );
        let j = e.add_job("j", source(vec![1, 2, 9, 3, 2, 1]));
        let fills: Vec<_> = e
            .plan(0)
            .into_iter()
            .filter_map(|a| match a {
                Action::FillGlobal { block, slot, .. } => Some((block, slot)),
                _ => None,
            })
            .collect();
        assert_eq!(fills, vec![(b(1), 0), (b(2), 1)]);
        e.global_filled(b(1), MS);
        e.global_filled(b(2), MS);
        assert_eq!(read_now(&mut e, Some(j), b(1), MS), Level::Global);
        // 9 is needed before 1 is needed again: 1 makes room. 3 is needed
        // after 2, so 2 stays.
        let a = e.plan(2 * MS);
        assert_eq!(
            a,
            vec![Action::FillGlobal {
                block: b(9),
                donor: 0,
                slot: 0,
                from: GlobalSource::Replica,
                deadline: 2 * MS + time_until(1, e.per_ref(&e.jobs[&j])),
            }]
        );
        assert!(e.is_global(b(2)) && !e.is_global(b(1)));
        let s = e.status().jobs[0].stats.disk_to_global;
        assert_eq!((s.issued, s.used, s.wasted), (3, 1, 0));
    }

    #[test]
    fn reads_from_global_credit_the_disk_to_global_prefetch() {
        let donors = [DonorSpec {
            slots: 8,
            replica: false,
        }];
        let mut e = Engine::new(
            EngineConfig {
                local_prefetch_depth: 0,
                ..cfg(8)
            },
            &donors,
        );
        let j = e.add_job("j", source(vec![1, 2]));
        let a = e.plan(0);
        assert!(a.iter().all(|a| matches!(
            a,
            Action::FillGlobal {
                from: GlobalSource::LocalDisk,
                ..
            }
        )));
        e.global_filled(b(1), MS);
        assert_eq!(read_now(&mut e, Some(j), b(1), 2 * MS), Level::Global);
        let s = e.status().jobs[0].stats;
        assert_eq!((s.hits.global, s.disk_to_global.used), (1, 1));
    }

    #[test]
    fn reads_wait_for_a_block_on_its_way_to_global_memory() {
        let donors = [DonorSpec {
            slots: 8,
            replica: true,
        }];
        let mut e = Engine::new(
            EngineConfig {
                local_prefetch_depth: 0,
                ..cfg(8)
            },
            &donors,
        );
        let j = e.add_job("j", source(vec![1]));
        e.plan(0);
        assert_eq!(e.access(Some(j), b(1), 0), Step::Wait);
        e.global_filled(b(1), MS);
        match e.retry(b(1), MS) {
            Step::Fetch(Action::FillLocal { .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_dead_donor_loses_its_blocks_and_reads_go_to_disk() {
        let donors = [DonorSpec {
            slots: 8,
            replica: true,
        }];
        let mut e = Engine::new(
            EngineConfig {
                local_prefetch_depth: 0,
                ..cfg(8)
            },
            &donors,
        );
        let j = e.add_job("j", source(vec![1, 2]));
        e.plan(0);
        e.global_filled(b(1), MS);
        e.donor_failed(0);
        assert!(!e.is_global(b(1)));
        assert_eq!(read_now(&mut e, Some(j), b(1), 2 * MS), Level::Disk);
        // The fill still in flight reports its failure later: harmless.
        e.global_failed(b(2));
        assert!(e
            .plan(3 * MS)
            .iter()
            .all(|a| !matches!(a, Action::FillGlobal { .. })));
        assert!(!e.status().donors[0].alive);
    }

    #[test]
    fn a_donor_let_go_and_back_is_a_fresh_one_under_a_new_id() {
        let spec = DonorSpec {
            slots: 8,
            replica: true,
        };
        let mut e = Engine::new(
            EngineConfig {
                local_prefetch_depth: 0,
                ..cfg(8)
            },
            &[spec],
        );
        e.add_job("j", source(vec![1, 2, 3]));
        e.plan(0);
        e.global_filled(b(1), MS);
        e.donor_failed(0);
        // A fill that lands after the donor was let go is not trusted.
        e.global_filled(b(2), MS);
        assert!(!e.is_global(b(1)) && !e.is_global(b(2)));
        e.global_failed(b(3));
        assert_eq!(e.add_donor(spec), 1);
        let placed: Vec<(u64, DonorId)> = e
            .plan(2 * MS)
            .iter()
            .filter_map(|a| match *a {
                Action::FillGlobal { block, donor, .. } => Some((block.index, donor)),
                _ => None,
            })
            .collect();
        assert_eq!(placed, vec![(1, 1), (2, 1), (3, 1)]);
        let st = e.status();
        assert!(!st.donors[0].alive && st.donors[1].alive);
        assert_eq!((st.donors[0].used, st.donors[0].outstanding), (0, 0));
    }

    #[test]
    fn failed_fill_frees_its_buffer_and_retry_fetches_again() {
        let mut e = Engine::new(cfg(1), &[]);
        let Step::Fetch(Action::ReadDisk { run, .. }) = e.access(None, b(1), 0) else {
            panic!()
        };
        assert_eq!(e.run_done(run), vec![b(1)]);
        e.local_failed(b(1));
        assert_eq!(e.status().local_filling, 0);
        let Step::Fetch(Action::ReadDisk { run, .. }) = e.retry(b(1), 1) else {
            panic!()
        };
        assert_eq!(e.run_done(run), vec![b(1)]);
        assert_eq!(e.local_filled(b(1)), Some(0));
    }

    #[test]
    fn when_every_buffer_is_being_filled_reads_are_served_uncached() {
        let mut e = Engine::new(cfg(1), &[]);
        assert!(matches!(
            e.access(None, b(1), 0),
            Step::Fetch(Action::ReadDisk { .. })
        ));
        assert!(matches!(
            e.access(None, b(2), 0),
            Step::Fetch(Action::ReadDisk { .. })
        ));
        assert_eq!(e.local_filled(b(2)), None);
        assert!(!e.is_local(b(2)));
        assert_eq!(e.local_filled(b(1)), Some(0));
    }

    fn coalescing(max_blocks: u32, max_gap: u32, readahead_blocks: u32) -> EngineConfig {
        EngineConfig {
            coalesce: CoalesceConfig {
                max_blocks,
                max_gap,
            },
            readahead_blocks,
            ..cfg(64)
        }
    }

    fn disk_runs(actions: &[Action]) -> Vec<(RunId, u64, u32, bool)> {
        actions
            .iter()
            .filter_map(|a| match *a {
                Action::ReadDisk {
                    run,
                    first,
                    count,
                    prefetch,
                    ..
                } => Some((run, first, count, prefetch)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_prefetch_reads_the_jobs_nearby_upcoming_blocks_in_one_request() {
        let mut e = Engine::new(coalescing(8, 1, 1), &[]);
        let j = e.add_job("j", source(vec![10, 50, 12, 11, 200, 14, 51, 10]));
        let runs = disk_runs(&e.plan(0));
        // 10..=14 (13 is a hole, read and dropped), then 50..=51; 200 waits
        // for a disk request to finish (two are queued at most).
        assert_eq!(
            runs.iter().map(|r| (r.1, r.2, r.3)).collect::<Vec<_>>(),
            vec![(10, 5, true), (50, 2, true)]
        );
        assert_eq!(e.run_done(runs[0].0), vec![b(10), b(12), b(11), b(14)]);
        for i in [10, 12, 11, 14] {
            assert!(e.local_filled(b(i)).is_some());
        }
        assert!(matches!(e.access(Some(j), b(10), MS), Step::Hit { .. }));
        let s = e.status().jobs[0].stats;
        assert_eq!((s.disk_to_local.issued, s.disk_to_local.used), (6, 1));
        // A finished request makes room for the next one.
        assert_eq!(
            disk_runs(&e.plan(MS))
                .iter()
                .map(|r| (r.1, r.2))
                .collect::<Vec<_>>(),
            vec![(200, 1)]
        );
    }

    #[test]
    fn a_following_jobs_miss_brings_its_upcoming_neighbours() {
        let mut e = Engine::new(
            EngineConfig {
                prefetch: true,
                local_prefetch_depth: 0,
                ..coalescing(8, 0, 1)
            },
            &[],
        );
        let j = e.add_job("j", source(vec![5, 7, 6, 30]));
        let Step::Fetch(Action::ReadDisk {
            run,
            first,
            count,
            prefetch,
            ..
        }) = e.access(Some(j), b(5), 0)
        else {
            panic!()
        };
        assert_eq!((first, count, prefetch), (5, 3, false));
        assert_eq!(e.run_done(run), vec![b(5), b(7), b(6)]);
    }

    #[test]
    fn a_read_of_several_blocks_is_one_request() {
        let mut e = Engine::new(coalescing(8, 0, 1), &[]);
        let Step::Fetch(Action::ReadDisk { first, count, .. }) =
            e.access_read(None, b(3), 7..100, 0)
        else {
            panic!()
        };
        assert_eq!((first, count), (3, 4));
        for i in 4..7 {
            assert_eq!(e.access_read(None, b(i), 7..100, 0), Step::Wait);
        }
    }

    #[test]
    fn sequential_readers_without_hints_read_ahead_up_to_the_end_of_the_file() {
        let mut e = Engine::new(
            EngineConfig {
                prefetch: false,
                ..coalescing(1, 0, 32)
            },
            &[],
        );
        // The start of a file: the block and three ahead.
        let Step::Fetch(Action::ReadDisk {
            run, first, count, ..
        }) = e.access_read(None, b(0), 1..100, 0)
        else {
            panic!()
        };
        assert_eq!((first, count), (0, 4));
        for i in e.run_done(run) {
            e.local_filled(i);
        }
        // Reaching the window queues the next one, even without prefetching.
        assert!(matches!(
            e.access_read(None, b(1), 2..100, 0),
            Step::Hit { .. }
        ));
        let runs = disk_runs(&e.plan(0));
        assert_eq!(
            runs.iter().map(|r| (r.1, r.2, r.3)).collect::<Vec<_>>(),
            vec![(4, 8, true)]
        );
        // A random miss reads what was asked; readahead stops at the end.
        let Step::Fetch(Action::ReadDisk { count, .. }) = e.access_read(None, b(50), 51..100, 0)
        else {
            panic!()
        };
        assert_eq!(count, 1);
        let Step::Fetch(Action::ReadDisk { first, count, .. }) =
            e.access_read(None, b(51), 52..53, 0)
        else {
            panic!()
        };
        assert_eq!((first, count), (51, 2));
    }

    /// A small discrete-event simulation: one job reads `refs` one block at
    /// a time with `gap` compute between reads; the local disk and each
    /// donor's replica serve one request at a time in `fd`; donor memory
    /// answers in `fg`.
    struct Sim {
        e: Engine,
        job: JobId,
        now: Nanos,
        events: BinaryHeap<Reverse<(Nanos, u64, Ev)>>,
        seq: u64,
        disk_free: Nanos,
        replica_free: Vec<Nanos>,
        fd: Nanos,
        fg: Nanos,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    enum Ev {
        JobRead,
        Run(RunId),
        Local(BlockId),
        Global(BlockId),
    }

    impl Sim {
        fn new(e: Engine, job: JobId, donors: usize) -> Sim {
            Sim {
                e,
                job,
                now: 0,
                events: BinaryHeap::new(),
                seq: 0,
                disk_free: 0,
                replica_free: vec![0; donors],
                fd: 10 * MS,
                fg: 200 * US,
            }
        }

        fn at(&mut self, t: Nanos, ev: Ev) {
            self.seq += 1;
            self.events.push(Reverse((t, self.seq, ev)));
        }

        fn issue(&mut self, a: Action) {
            match a {
                Action::ReadDisk { run, .. } => {
                    // The disk's cost is per request, whatever its length.
                    self.disk_free = self.disk_free.max(self.now) + self.fd;
                    let t = self.disk_free;
                    self.at(t, Ev::Run(run));
                }
                Action::FillLocal { block, .. } => {
                    let t = self.now + self.fg;
                    self.at(t, Ev::Local(block));
                }
                Action::FillGlobal {
                    block, donor, from, ..
                } => {
                    let free = match from {
                        GlobalSource::Replica => &mut self.replica_free[donor],
                        GlobalSource::LocalDisk => &mut self.disk_free,
                    };
                    *free = (*free).max(self.now) + self.fd;
                    let t = *free + self.fg;
                    self.at(t, Ev::Global(block));
                }
            }
        }

        /// Runs the job to its end; returns the elapsed time.
        fn run(&mut self, refs: &[u64], gap: Nanos) -> Nanos {
            let mut next = 0;
            let mut waiting: Option<BlockId> = None;
            self.at(0, Ev::JobRead);
            while let Some(Reverse((t, _, ev))) = self.events.pop() {
                self.now = t;
                match ev {
                    Ev::JobRead => {
                        let block = b(refs[next]);
                        self.e.read_started(Some(self.job), 1, t);
                        match self.e.access(Some(self.job), block, t) {
                            Step::Hit { .. } => {
                                self.e.read_done(Some(self.job), t, 10 * US, 0, 1);
                                next += 1;
                                if next < refs.len() {
                                    self.at(t + 10 * US + gap, Ev::JobRead);
                                }
                            }
                            Step::Wait => waiting = Some(block),
                            Step::Fetch(a) => {
                                waiting = Some(block);
                                self.issue(a);
                            }
                        }
                    }
                    Ev::Run(run) => {
                        for block in self.e.run_done(run) {
                            self.e.local_filled(block);
                            if waiting == Some(block) {
                                waiting = None;
                                self.e.read_done(Some(self.job), t, 0, 1, 1);
                                next += 1;
                                if next < refs.len() {
                                    self.at(t + gap, Ev::JobRead);
                                }
                            }
                        }
                    }
                    Ev::Local(block) => {
                        self.e.local_filled(block);
                        if waiting == Some(block) {
                            waiting = None;
                            self.e.read_done(Some(self.job), t, 0, 1, 1);
                            next += 1;
                            if next < refs.len() {
                                self.at(t + gap, Ev::JobRead);
                            }
                        }
                    }
                    Ev::Global(block) => {
                        self.e.global_filled(block, t);
                        if waiting == Some(block) && !self.e.local.contains_key(&block) {
                            if let Step::Fetch(a) = self.e.retry(block, t) {
                                self.issue(a);
                            }
                        }
                    }
                }
                for a in self.e.plan(self.now) {
                    self.issue(a);
                }
            }
            assert_eq!(next, refs.len(), "the job finished");
            self.now
        }
    }

    fn shuffled(n: u64, seed: u64) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).collect();
        let mut x = seed;
        for i in (1..v.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.swap(i, (x % (i as u64 + 1)) as usize);
        }
        v
    }

    fn simulate(refs: &[u64], donors: usize, prefetch: bool) -> (Nanos, JobStats) {
        let specs = vec![
            DonorSpec {
                slots: 128,
                replica: true
            };
            donors
        ];
        let mut e = Engine::new(
            EngineConfig {
                prefetch,
                ..cfg(128)
            },
            &specs,
        );
        let job = e.add_job("sim", source(refs.to_vec()));
        let mut sim = Sim::new(e, job, donors);
        let took = sim.run(refs, 250 * US);
        (took, sim.e.status().jobs[0].stats)
    }

    #[test]
    fn simulated_coalescing_cuts_disk_requests_for_clustered_reads() {
        // 16 regions of 16 blocks, regions in random order, blocks in
        // random order within each: what a B-tree scan looks like.
        let mut refs = Vec::new();
        for r in shuffled(16, 3) {
            refs.extend(shuffled(16, r + 11).into_iter().map(|i| r * 16 + i));
        }
        let run = |coalesce: u32| {
            let mut e = Engine::new(
                EngineConfig {
                    coalesce: CoalesceConfig {
                        max_blocks: coalesce,
                        max_gap: 2,
                    },
                    ..cfg(128)
                },
                &[],
            );
            let job = e.add_job("sim", source(refs.clone()));
            let mut sim = Sim::new(e, job, 0);
            let took = sim.run(&refs, 250 * US);
            (took, sim.e.status().jobs[0].stats)
        };
        let (single, s1) = run(1);
        let (coalesced, s32) = run(32);
        for s in [&s1, &s32] {
            assert_eq!(s.hits.local + s.hits.global + s.hits.disk, s.blocks);
        }
        // Simulated time, so a comparison is deterministic here.
        assert!(
            coalesced * 3 < single,
            "single {single} coalesced {coalesced}"
        );
    }

    #[test]
    fn simulated_random_workload_gains_from_donors_and_counts_add_up() {
        let refs = shuffled(400, 7);
        let (none, s0) = simulate(&refs, 0, false);
        let (local, s1) = simulate(&refs, 0, true);
        let (coop, s4) = simulate(&refs, 4, true);
        for s in [&s0, &s1, &s4] {
            assert_eq!(s.blocks, refs.len() as u64);
            assert_eq!(s.hits.local + s.hits.global + s.hits.disk, s.blocks);
        }
        assert_eq!(s0.hits.disk, 400);
        // Prefetching turns demand disk reads into local hits...
        assert!(s1.disk_to_local.used > 300, "{s1:?}");
        // ...and four donors with their own disks bring most blocks ahead of
        // time into global memory, the local disk the rest, and then they
        // are prefetched into local memory.
        assert!(s4.disk_to_global.used > 250, "{s4:?}");
        assert!(
            s4.global_to_local.used + s4.disk_to_local.used > 300,
            "{s4:?}"
        );
        assert!(s4.hits.disk < 40, "{s4:?}");
        // Simulated time, so a comparison is deterministic here.
        assert!(
            local <= none && coop * 2 < local,
            "none {none} local {local} coop {coop}"
        );
    }
}
