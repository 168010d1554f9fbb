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

use super::coalesce::{self, Stream};
use super::cursor::{CursorState, HintCursor};
use super::forestall::{must_prefetch, time_until, Missing};
use super::slots::SlotTable;
use super::timing::{Costs, RefClock};
use super::{BlockId, DonorId, FileId, JobId, Nanos};

mod disk;
mod global;
mod types;
pub use types::*;

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
    slots: SlotTable,
    outstanding: u32,
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
    bufs: SlotTable,
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
            bufs: SlotTable::new(n),
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
            self.bufs.put(b, block);
        }
        Step::Fetch(Action::FillLocal {
            block,
            buf,
            donor,
            slot,
            prefetch: false,
        })
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
        if let Some(b) = self.bufs.take_free() {
            return Some(b);
        }
        let sample = self.cfg.eviction_sample;
        let victim = self.bufs.victim(sample, |block| {
            let e = &self.local[&block];
            e.filling
                .is_none()
                .then(|| self.time_to_use(block, e.last_use, e.last_user, now))
        });
        self.bufs.advance(sample);
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
        self.bufs.vacate(idx);
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
            self.bufs.release(b);
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
        if let Some(block) = self.donors[donor].slots.get(slot) {
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
            self.bufs.put(buf, block);
            out.push(Action::FillLocal {
                block,
                buf: Some(buf),
                donor,
                slot,
                prefetch: true,
            });
        }
    }

    /// Whether `block` is resident in local memory (not being filled).
    pub fn is_local(&self, block: BlockId) -> bool {
        self.local.get(&block).is_some_and(|e| e.filling.is_none())
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
                    used: d.slots.used() as u32,
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
mod tests;
