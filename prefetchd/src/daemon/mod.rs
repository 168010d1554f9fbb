//! The daemon's core: the planner, the local cache buffers, pending reads,
//! and the disk and donor levels it drives.
//!
//! One lock guards the [`Engine`] and the cache. A read copies resident
//! blocks at once and registers as a *waiter* on the others; fills deliver
//! their bytes to every waiting read when they complete, under the same
//! lock, so a block can never be evicted between its arrival and its
//! delivery. I/O is started only after the lock is released.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use hints::HintError;
use serde_json::{json, Value};

use crate::disk::{Disk, Urgency};
use crate::donor::{DonorArg, DonorError, FillSource};
use crate::files::{FileEntry, FileError, FileTable};
use crate::lanes::{LaneKit, Lanes, Planner};
use crate::membership::MembershipError;
use crate::plan::engine::{
    Action, DonorSpec, Engine, EngineConfig, GlobalSource, LocalSource, RunId, Step,
};
use crate::plan::{BlockId, DonorId, FileId, JobId, Nanos};
use crate::source::{open_hints, SourceReport};
use crate::status::{Costs, Donor, Job, Local, Registered, Status};
use hints::{FileDecl, Recorder};

mod fills;

/// Why the daemon did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("block size {0} must be a power of two of at least 512")]
    BlockSize(u32),
    #[error("data directory {}", path.display())]
    Data { path: PathBuf, source: FileError },
    #[error("starting the io_uring disk level")]
    Disk(#[source] std::io::Error),
    #[error(transparent)]
    Donor(Box<DonorError>),
    #[error(transparent)]
    Membership(#[from] MembershipError),
}

/// A job that could not be added or removed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("hint file {}", path.display())]
    Hints {
        path: PathBuf,
        source: Box<HintError>,
    },
    #[error("a job without hints needs a name")]
    NoName,
    #[error("job name {0:?} must be a non-empty file name")]
    BadName(String),
    #[error("job {0}: give a hint file to follow, a file to record into, or both")]
    NothingToDo(String),
    #[error("job {0:?} is already registered")]
    Exists(String),
    #[error("job {name}: recording into {}", path.display())]
    Record {
        name: String,
        path: PathBuf,
        source: Box<HintError>,
    },
    #[error("no job {0:?}")]
    NoSuchJob(String),
    /// Recording stopped while the job ran (`why`, as status showed it).
    #[error("job {name}: recording failed: {why}")]
    RecordingFailed { name: String, why: String },
    #[error("job {name}: writing its recording")]
    WriteRecording {
        name: String,
        source: Box<HintError>,
    },
}

/// Answers a read: its bytes, or an errno.
pub type Reply = Box<dyn FnOnce(Result<Vec<u8>, i32>) + Send>;

/// How the daemon is set up.
pub struct Config {
    pub data: PathBuf,
    pub block_size: u32,
    pub engine: EngineConfig,
    pub donors: Vec<DonorArg>,
    /// io_uring slots (reads in flight on the local disk).
    pub disk_depth: u32,
    /// Largest local disk request, in bytes (coalesced runs, readahead).
    pub max_request: usize,
    /// Whether the mount lets the kernel cache file data (else every read
    /// reaches the daemon: direct I/O).
    pub page_cache: bool,
    /// How often donors' status endpoints are polled.
    pub status_poll: Duration,
    pub timeouts: netpager_nbd::Timeouts,
    /// Donors joining and leaving while the daemon runs.
    pub membership: crate::membership::Config,
}

struct JobInfo {
    id: JobId,
    hints: Option<PathBuf>,
    stale: Vec<String>,
    report: Arc<SourceReport>,
    /// Where the job's reads are being recorded.
    recorder: Option<Recorder>,
    /// Why recording stopped early.
    record_error: Option<String>,
}

struct PendingRead {
    job: Option<JobId>,
    file: FileId,
    offset: u64,
    data: Vec<u8>,
    remaining: usize,
    blocks: u64,
    started: Instant,
    reply: Reply,
}

struct State {
    engine: Engine,
    cache: Vec<u8>,
    cache_len: Vec<u32>,
    reads: HashMap<u64, PendingRead>,
    next_read: u64,
    waiters: HashMap<BlockId, Vec<u64>>,
    jobs: BTreeMap<String, JobInfo>,
}

/// Reads finished under the lock, answered after it is released.
type Finished = Vec<(Reply, Result<Vec<u8>, i32>)>;

/// See the module documentation.
pub struct Daemon {
    state: Mutex<State>,
    files: Arc<FileTable>,
    disk: Arc<Disk>,
    lanes: Arc<Lanes>,
    epoch: Instant,
    bs: usize,
    page_cache: bool,
    started: Instant,
}

impl Daemon {
    /// Opens the data directory, starts the disk level, connects to the
    /// donors and preallocates the local cache.
    pub fn start(cfg: Config) -> Result<Arc<Daemon>, StartError> {
        let bs = cfg.block_size as usize;
        let membership = cfg.membership.clone();
        if !cfg.block_size.is_power_of_two() || cfg.block_size < 512 {
            return Err(StartError::BlockSize(cfg.block_size));
        }
        let files = Arc::new(
            FileTable::new(&cfg.data).map_err(|source| StartError::Data {
                path: cfg.data.clone(),
                source,
            })?,
        );
        let disk = Arc::new(
            Disk::start(cfg.disk_depth, cfg.max_request.max(bs)).map_err(StartError::Disk)?,
        );
        let kit = LaneKit {
            block_size: bs,
            replica_size: files.replica_size(),
            disk: disk.clone(),
            timeouts: cfg.timeouts,
        };
        let mut donors = Vec::new();
        for (i, d) in cfg.donors.iter().enumerate() {
            match kit.start(i, d) {
                Ok(l) => donors.push(l),
                Err(e) => {
                    for l in &donors {
                        l.stop();
                    }
                    disk.stop();
                    return Err(StartError::Donor(Box::new(e)));
                }
            }
        }
        let specs: Vec<DonorSpec> = donors
            .iter()
            .map(|l| DonorSpec {
                slots: l.slots,
                replica: l.has_replica,
            })
            .collect();
        let n = cfg.engine.local_blocks.max(1) as usize;
        // A non-zero fill writes every page now (zeroed memory would be
        // mapped lazily): the cache is resident before mlockall locks it.
        // Bytes past a block's valid length are never read.
        let cache = vec![0xa5u8; n * bs];
        let state = State {
            engine: Engine::new(cfg.engine, &specs),
            cache,
            cache_len: vec![0; n],
            reads: HashMap::new(),
            next_read: 1,
            waiters: HashMap::new(),
            jobs: BTreeMap::new(),
        };
        for l in &donors {
            tracing::info!(
                "donor {}: {} slots of {bs} bytes{}",
                l.name,
                l.slots,
                if l.has_replica {
                    ", with a replica"
                } else {
                    ""
                }
            );
        }
        let d = Arc::new_cyclic(|me: &Weak<Daemon>| Daemon {
            state: Mutex::new(state),
            files,
            disk,
            lanes: Arc::new(Lanes::new(
                kit,
                me.clone(),
                cfg.donors,
                donors,
                cfg.status_poll,
            )),
            epoch: Instant::now(),
            bs,
            page_cache: cfg.page_cache,
            started: Instant::now(),
        });
        if let Err(e) = d
            .lanes
            .start_pollers()
            .map_err(|e| StartError::Donor(Box::new(e)))
            .and_then(|()| Ok(crate::membership::start(membership, &d.lanes)?))
        {
            d.stop();
            return Err(e);
        }
        Ok(d)
    }

    pub fn files(&self) -> &Arc<FileTable> {
        &self.files
    }

    pub fn block_size(&self) -> usize {
        self.bs
    }

    /// Whether the kernel caches the mount's file data.
    pub fn page_cache(&self) -> bool {
        self.page_cache
    }

    fn now(&self) -> Nanos {
        self.epoch.elapsed().as_nanos() as Nanos
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("daemon state lock")
    }

    /// Stops the disk and donor workers (pending reads get EIO) and
    /// writes the jobs' recordings.
    pub fn stop(&self) {
        let recorders: Vec<(String, Recorder)> = {
            let mut st = self.lock();
            st.jobs
                .iter_mut()
                .filter_map(|(n, j)| Some((n.clone(), j.recorder.take()?)))
                .collect()
        };
        for (name, r) in recorders {
            if let Err(e) = finish_recording(&name, r) {
                tracing::warn!("{}", crate::error_chain(&e));
            }
        }
        self.lanes.stop();
        self.disk.stop();
        let pending: Vec<PendingRead> = {
            let mut st = self.lock();
            st.waiters.clear();
            st.reads.drain().map(|(_, r)| r).collect()
        };
        for r in pending {
            (r.reply)(Err(libc::EIO));
        }
    }

    /// Sets the hint lookahead window of jobs registered from now on.
    pub fn set_window(&self, window: usize) {
        self.lock().engine.set_window(window);
    }

    /// Whether a job of this name is registered.
    pub fn has_job(&self, name: &str) -> bool {
        self.lock().jobs.contains_key(name)
    }

    pub fn job_names(&self) -> Vec<String> {
        self.lock().jobs.keys().cloned().collect()
    }

    /// Registers job `name` following the hint file `hints` (its own job
    /// name when `name` is None), recording its reads into `record` if
    /// given. Returns the name and the stale-hint report.
    pub fn add_job(
        self: &Arc<Self>,
        name: Option<&str>,
        hints: Option<&Path>,
        record: Option<&Path>,
    ) -> Result<Value, JobError> {
        let opened = match hints {
            Some(h) => Some(open_hints(h, self.files.clone(), self.bs as u32).map_err(
                |source| JobError::Hints {
                    path: h.to_path_buf(),
                    source: Box::new(source),
                },
            )?),
            None => None,
        };
        let name = match (name, &opened) {
            (Some(n), _) => n.to_owned(),
            (None, Some(o)) => o.job.clone(),
            (None, None) => return Err(JobError::NoName),
        };
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(JobError::BadName(name));
        }
        if hints.is_none() && record.is_none() {
            return Err(JobError::NothingToDo(name));
        }
        let stale: Vec<String> = opened
            .iter()
            .flat_map(|o| o.stale.iter().map(|s| s.to_string()))
            .collect();
        for s in &stale {
            tracing::warn!("job {name}: stale hints ignored: {s}");
        }
        let mut st = self.lock();
        if st.jobs.contains_key(&name) {
            return Err(JobError::Exists(name));
        }
        let recorder = match record {
            Some(r) => Some(
                Recorder::create(r, &name, self.bs as u32).map_err(|source| JobError::Record {
                    name: name.clone(),
                    path: r.to_path_buf(),
                    source: Box::new(source),
                })?,
            ),
            None => None,
        };
        let (source, report): (crate::plan::engine::BlockSource, _) = match opened {
            Some(o) => (Box::new(o.blocks), o.report),
            None => (Box::new(std::iter::empty()), Arc::default()),
        };
        let id = st.engine.add_job(&name, source);
        st.jobs.insert(
            name.clone(),
            JobInfo {
                id,
                hints: hints.map(Path::to_path_buf),
                stale: stale.clone(),
                report,
                recorder,
                record_error: None,
            },
        );
        match (hints, record) {
            (Some(h), None) => tracing::info!("job {name} added with hints {}", h.display()),
            (None, Some(r)) => tracing::info!("job {name} added, recording into {}", r.display()),
            (Some(h), Some(r)) => tracing::info!(
                "job {name} added with hints {}, recording into {}",
                h.display(),
                r.display()
            ),
            (None, None) => {}
        }
        // Disk-to-global prefetching starts now, before the job's first read.
        let actions = st.engine.plan(self.now());
        drop(st);
        self.execute(actions);
        Ok(json!({ "job": name, "id": id, "stale": stale, "recording": record }))
    }

    /// Forgets job `name`, writing its recording. Returns the recording's
    /// path, if there is one.
    pub fn remove_job(&self, name: &str) -> Result<Option<PathBuf>, JobError> {
        let info = {
            let mut st = self.lock();
            let Some(info) = st.jobs.remove(name) else {
                return Err(JobError::NoSuchJob(name.to_owned()));
            };
            st.engine.remove_job(info.id);
            info
        };
        tracing::info!("job {name} removed");
        if let Some(e) = info.record_error {
            return Err(JobError::RecordingFailed {
                name: name.to_owned(),
                why: e,
            });
        }
        info.recorder.map(|r| finish_recording(name, r)).transpose()
    }

    /// Serves a read of `size` bytes at `offset` of `file`, attributed to
    /// job `job` (None: an unhinted reader).
    pub fn read(
        self: &Arc<Self>,
        job: Option<&str>,
        file: &FileEntry,
        offset: u64,
        size: u32,
        reply: Reply,
    ) {
        let end = (offset.saturating_add(u64::from(size))).min(file.size());
        if offset >= end {
            reply(Ok(Vec::new()));
            return;
        }
        let bs = self.bs as u64;
        let (first, last) = (offset / bs, (end - 1) / bs);
        let file_blocks = file.size().div_ceil(bs);
        let nblocks = last - first + 1;
        let began = Instant::now();
        let now = self.now();
        let mut done: Finished = Vec::new();
        let actions = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let info = job.and_then(|n| st.jobs.get_mut(n));
            if let Some(info) = info.filter(|i| i.recorder.is_some()) {
                record_read(info, file, offset, end - offset);
            }
            let job = job.and_then(|n| st.jobs.get(n)).map(|j| j.id);
            st.engine.read_started(job, nblocks, now);
            let mut data = vec![0u8; (end - offset) as usize];
            let id = st.next_read;
            st.next_read += 1;
            let mut remaining = 0;
            let mut actions = Vec::new();
            for index in first..=last {
                let block = BlockId::new(file.id, index);
                let step = st
                    .engine
                    .access_read(job, block, last + 1..file_blocks, now);
                // The kernel keeps what it is given; a block it gets only
                // part of is still read through the daemon.
                let block_end = ((index + 1) * bs).min(file.size());
                if self.page_cache && offset <= index * bs && end >= block_end {
                    st.engine.page_cached(job, block);
                }
                match step {
                    Step::Hit { buf } => {
                        let b = buf as usize;
                        let bytes = &st.cache[b * self.bs..b * self.bs + st.cache_len[b] as usize];
                        copy_block(bytes, index * bs, offset, &mut data);
                    }
                    step => {
                        if let Step::Fetch(a) = step {
                            actions.push(a);
                        }
                        st.waiters.entry(block).or_default().push(id);
                        remaining += 1;
                    }
                }
            }
            if remaining == 0 {
                st.engine.read_done(
                    job,
                    self.now(),
                    began.elapsed().as_nanos() as Nanos,
                    0,
                    nblocks,
                );
                done.push((reply, Ok(data)));
            } else {
                st.reads.insert(
                    id,
                    PendingRead {
                        job,
                        file: file.id,
                        offset,
                        data,
                        remaining,
                        blocks: nblocks,
                        started: began,
                        reply,
                    },
                );
            }
            actions.extend(st.engine.plan(now));
            actions
        };
        answer(done);
        self.execute(actions);
    }

    /// What `/metrics` shows (crate::metrics).
    pub fn metrics_snapshot(&self) -> crate::metrics::Snapshot {
        let st = self.lock();
        crate::metrics::Snapshot {
            engine: st.engine.status(),
            stale: st.jobs.values().map(|j| (j.id, j.stale.len())).collect(),
            donor_names: self.lanes.names(),
        }
    }

    /// Status of every job and level.
    pub fn status(&self) -> Status {
        let st = self.lock();
        let es = st.engine.status();
        let by_id: HashMap<JobId, &JobInfo> = st.jobs.values().map(|j| (j.id, j)).collect();
        let jobs = es
            .jobs
            .into_iter()
            .map(|j| {
                let registered = by_id.get(&j.id).map(|info| Registered {
                    hints: info.hints.clone(),
                    recording: info.recorder.as_ref().map(|r| r.path().to_path_buf()),
                    record_error: info.record_error.clone(),
                    stale: info.stale.clone(),
                    hint_stream: info.report.snapshot(),
                });
                Job {
                    engine: j,
                    registered,
                }
            })
            .collect();
        let donors = es
            .donors
            .into_iter()
            .map(|d| Donor {
                lane: self.lanes.describe(d.id, d.alive),
                engine: d,
            })
            .collect();
        Status {
            data: self.files.root().to_path_buf(),
            block_size: self.bs,
            uptime_s: self.started.elapsed().as_secs_f64(),
            prefetch: st.engine.config().prefetch,
            page_cache: self.page_cache,
            local: Local {
                blocks: es.local_blocks,
                resident: es.local_resident,
                filling: es.local_filling,
            },
            costs_ns: Costs {
                local: es.f_local_ns,
                global: es.f_global_ns,
                disk: es.f_disk_ns,
            },
            pending_reads: st.reads.len(),
            donors,
            jobs,
            unhinted: es.unhinted,
        }
    }
}

impl Planner for Daemon {
    fn forget_donor(&self, id: DonorId) {
        self.lock().engine.donor_failed(id);
    }

    fn add_donor(self: Arc<Self>, spec: DonorSpec, register: Box<dyn FnOnce(DonorId) + '_>) {
        let actions = {
            let mut st = self.lock();
            let id = st.engine.add_donor(spec);
            register(id);
            st.engine.plan(self.now())
        };
        self.execute(actions);
    }
}

/// Appends a read to the job's recording; a failure stops the recording
/// (the job goes on) and is reported when the job is removed.
fn record_read(info: &mut JobInfo, file: &FileEntry, offset: u64, len: u64) {
    let Some(rec) = info.recorder.as_mut() else {
        return;
    };
    let decl = || FileDecl {
        path: file.rel.clone(),
        size: file.size(),
        mtime_ns: i64::try_from(file.identity.mtime_ns).ok(),
    };
    if let Err(e) = rec.read(&file.rel, offset, len, decl) {
        tracing::warn!("recording stops: {e}");
        info.record_error = Some(e.to_string());
        info.recorder = None;
    }
}

/// Writes a job's recording.
fn finish_recording(name: &str, r: Recorder) -> Result<PathBuf, JobError> {
    let path = r.path().to_path_buf();
    let n = r.finish().map_err(|source| JobError::WriteRecording {
        name: name.to_owned(),
        source: Box::new(source),
    })?;
    tracing::info!("job {name}: {n} reads recorded in {}", path.display());
    Ok(path)
}

/// Copies the part of a block (whose first byte is at file offset
/// `block_at`) that falls in a read starting at `read_at`.
fn copy_block(bytes: &[u8], block_at: u64, read_at: u64, out: &mut [u8]) {
    let read_end = read_at + out.len() as u64;
    let from = block_at.max(read_at);
    let to = (block_at + bytes.len() as u64).min(read_end);
    if from >= to {
        return;
    }
    let src = &bytes[(from - block_at) as usize..(to - block_at) as usize];
    out[(from - read_at) as usize..(to - read_at) as usize].copy_from_slice(src);
}

fn answer(done: Finished) {
    for (reply, r) in done {
        reply(r);
    }
}

/// Default NBD timeouts: generous for slow replica disks, short enough
/// that a hung donor is dropped quickly.
pub fn default_timeouts() -> netpager_nbd::Timeouts {
    netpager_nbd::Timeouts {
        connect: Duration::from_secs(5),
        request: Duration::from_secs(10),
        // prefetchd's reads are not on a faulting thread's path.
        spin: Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::copy_block;

    #[test]
    fn copy_block_takes_only_the_overlap() {
        let block: Vec<u8> = (0..8).collect();
        let mut out = vec![0xffu8; 6];
        // Block covers file bytes 8..16, the read 12..18.
        copy_block(&block, 8, 12, &mut out);
        assert_eq!(out, vec![4, 5, 6, 7, 0xff, 0xff]);
        let mut out = vec![0u8; 4];
        copy_block(&block[..3], 0, 1, &mut out);
        assert_eq!(out, vec![1, 2, 0, 0]);
        copy_block(&block, 100, 0, &mut out);
        assert_eq!(out, vec![1, 2, 0, 0]);
    }
}
