//! The client device: a byte-addressed block device made of extents placed
//! on several donors (and optionally a local fallback file), in one of the
//! modes none, mirror, parity, ec or disk (see [`crate::config::Mode`]).
//!
//! [`Inner`] holds what every mode shares (map, donors, placement, epoch,
//! maintenance) and checks each request (range, lost extents, prefetch
//! cache) before its backend serves it: `backend.rs` picks one per mode
//! family at open, `replica.rs` (none, mirror, disk) or `stripe/` (parity,
//! ec). docs/DESIGN.md §1.2.1 maps the files and the lock order.
//!
//! Threading: every public method may be called from many threads at once
//! (nbdkit's parallel thread model). Each unit (extent, or parity group) has
//! its own read/write lock in the [`ExtentMap`]. Device-wide locks on the
//! I/O path are few and short: in the striped modes the page table's
//! mutex (which pages are logged), the parity log's mutex while a small
//! write's pages are copied into its queue, and the journal's mutex for
//! each logged row; mode disk's write-through queue. Background threads:
//! the epoch thread (donor status, frequencies, heartbeats, reconnects),
//! the maintenance thread (marking a failed donor's copies lost, rebuild,
//! drain, `status.json`, journal compaction, the parity log's cleaner)
//! and, in mode disk, the write-through writer.

mod backend;
pub mod control;
mod donor;
mod epoch;
mod follow;
pub use follow::{discovered_config, start_admission};
mod io;
mod label;
mod lost;
mod maintenance;
mod membership;
mod placement;
mod prefetch;
mod rebalance;
mod replica;
mod report;
pub mod session;
mod stripe;
mod transient;
mod writethrough;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{ConfigError, DeviceConfig, DonorConfig};
use crate::extent_map::{ExtentMap, Layout, MapError};
use crate::metrics::{FrontendInfo, RequestKind, RequestStats};
use crate::page_log::PAGE;
use crate::status::ClientStatus;

use backend::Backend;
use io::{BufPool, Fallback};
pub use lost::Forgotten;
use netpager_membership::Joined;
use netpager_util::{CondvarExt, LockExt, RwLockExt};
use placement::Placement;

/// Errors of device operations; [`DeviceError::errno`] maps them for NBD.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("request of {len} bytes at offset {offset} goes past the device's end ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("extent {extent} is lost: {reason}")]
    Lost { extent: u64, reason: String },
    #[error("no space for extent {extent}: {reason}")]
    NoSpace { extent: u64, reason: String },
    #[error("I/O error on extent {extent}: {reason}")]
    Io { extent: u64, reason: String },
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Map(#[from] MapError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("mode {mode}: {source}")]
    Code {
        mode: &'static str,
        #[source]
        source: crate::erasure::CodeError,
    },
    #[error(transparent)]
    Metrics(#[from] netpager_metrics::EndpointError),
    #[error("{0}")]
    Membership(String),
    #[error("extents {first}..{last}: the device has extents 0..{} only", extents.saturating_sub(1))]
    NoSuchExtents { first: u64, last: u64, extents: u64 },
    #[error("nothing is lost in extents {first}..{last}")]
    NothingLost { first: u64, last: u64 },
    #[error(
        "state directory {} is in use by another serving process ({holder}; waited {}s for it to exit)",
        dir.display(),
        waited.as_secs()
    )]
    InUse {
        dir: PathBuf,
        holder: String,
        waited: Duration,
    },
    #[error(
        "fenced: a newer session of this device owns its exports ({0}); this serving process was replaced and serves no more requests"
    )]
    Fenced(String),
    #[error("donor {donor}: lab key for its status endpoint: {source}")]
    StatusKey {
        donor: String,
        #[source]
        source: netpager_proto::auth::AuthError,
    },
}

impl DeviceError {
    /// The errno an NBD server should answer with.
    pub fn errno(&self) -> i32 {
        match self {
            DeviceError::NoSpace { .. } => libc::ENOSPC,
            DeviceError::OutOfRange { .. } => libc::EINVAL,
            _ => libc::EIO,
        }
    }
}

pub type Result<T> = std::result::Result<T, DeviceError>;

/// What a partial-extent operation carries.
#[derive(Clone, Copy)]
pub(crate) enum Payload<'a> {
    Data(&'a [u8]),
    Zero(u64),
    Trim(u64),
}

impl Payload<'_> {
    fn len(&self) -> u64 {
        match self {
            Payload::Data(d) => d.len() as u64,
            Payload::Zero(n) | Payload::Trim(n) => *n,
        }
    }
}

/// Wakes the maintenance thread early (a donor failed, a drain started).
#[derive(Default)]
pub(crate) struct Wake {
    pending: Mutex<bool>,
    cv: Condvar,
}

impl Wake {
    pub(crate) fn notify(&self) {
        *self.pending.lock_or_recover() = true;
        self.cv.notify_all();
    }

    /// Waits until notified or `timeout`; false if the device is stopping.
    pub(crate) fn wait(&self, timeout: Duration, stop: &AtomicBool) -> bool {
        let mut p = self.pending.lock_or_recover();
        if !*p && !stop.load(Ordering::Relaxed) {
            p = self.cv.wait_timeout_or_recover(p, timeout).0;
        }
        *p = false;
        !stop.load(Ordering::Relaxed)
    }
}

/// Shared state of one device.
pub(crate) struct Inner {
    pub(crate) cfg: DeviceConfig,
    /// This serving process's session of the device (its lock held).
    pub(crate) session: session::Session,
    /// Set when a donor said a newer session owns the device's exports:
    /// from then on this process serves nothing and changes nothing.
    pub(crate) fenced: OnceLock<String>,
    pub(crate) state_dir: PathBuf,
    pub(crate) layout: Layout,
    pub(crate) map: ExtentMap,
    /// The donor set, which changes while the device runs: its one owner.
    pub(crate) members: membership::Membership,
    /// Held from reading an export's label to writing ours on it.
    pub(crate) labelling: Mutex<()>,
    /// Slots written while a donor is away, to take it back cheaply.
    pub(crate) dirty: transient::Dirty,
    /// Numbers the rounds of connections to donors in this session
    /// (`netpager_nbd::Pool::numbered`).
    pub(crate) rounds: Arc<AtomicU64>,
    /// Browses the lab's network for announced donors and checks them
    /// off the epoch thread (`discover`).
    pub(crate) admission: Option<netpager_membership::discovery::Admission>,
    pub(crate) fallback: Option<Fallback>,
    /// The mode family's own state and code, chosen at open.
    pub(crate) backend: Backend,
    pub(crate) bufs: BufPool,
    pub(crate) placement: Mutex<Placement>,
    pub(crate) stop: AtomicBool,
    pub(crate) maint_wake: Wake,
    pub(crate) epoch_wake: Wake,
    /// Requests served since open.
    pub(crate) requests: AtomicU64,
    /// `requests` at the last epoch, for T_j (mean time between requests).
    pub(crate) requests_at_epoch: AtomicU64,
    /// `requests` when the maintenance thread last saw it change, and when
    /// that was: how long the device has been idle.
    pub(crate) last_request: Mutex<(u64, Instant)>,
    pub(crate) jobs: Mutex<report::Jobs>,
    /// Requests served, by kind, for `/metrics`.
    pub(crate) stats: RequestStats,
    /// How the kernel reaches the device, for `/metrics`.
    pub(crate) frontend: Mutex<FrontendInfo>,
    /// Groups whose parity was recomputed at start (left open by a crash).
    pub(crate) resynced: AtomicU64,
    /// Held while `status.json` is written.
    pub(crate) status_write: Mutex<()>,
    /// When write intents were last swept.
    pub(crate) intent_sweep: Mutex<Instant>,
    /// When a placement about to fail last started re-reading the
    /// refusing donors' statuses (epoch.rs, `refresh_refusing`); held
    /// while it does.
    pub(crate) status_refresh: Mutex<Option<Instant>>,
    /// The stride prefetcher (`prefetch_pages` > 0).
    pub(crate) prefetch: Option<prefetch::Prefetch>,
    /// The last status found lost extents: writes then recover the units
    /// they touch first (`lost.rs`); one relaxed load otherwise.
    pub(crate) lost_seen: AtomicBool,
    /// Units' recency and the moves that make shares follow f_i.
    pub(crate) rebalancer: rebalance::Rebalancer,
}

/// How long an open waits for the previous serving process of the same
/// state directory to exit (a restart starts the next one as the last
/// one dies).
const SESSION_WAIT: Duration = Duration::from_secs(30);

/// A running device. Dropping it stops its threads and syncs its map.
pub struct Device {
    inner: Arc<Inner>,
    /// Taken (and joined) by [`Device::quiesce`].
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Device {
    /// Opens the device described by `cfg` with its map and status in
    /// `state_dir`, connects to the donors and starts the background
    /// threads.
    pub fn open(cfg: DeviceConfig, state_dir: &Path) -> Result<Device> {
        cfg.validate()?;
        let session = session::begin(state_dir, SESSION_WAIT)?;
        let layout = Layout::from_config(&cfg);
        let map = ExtentMap::open(state_dir, layout)?;
        let fallback = match &cfg.fallback {
            Some(fb) => Some(Fallback::open(fb, layout.extent, &map)?),
            None => None,
        };
        let backend = Backend::open(&cfg, layout, &map)?;
        let mut book = membership::Book::default();
        let admission = if cfg.discover || !cfg.discover_domain.is_empty() {
            match follow::start_admission(&cfg, Duration::from_millis(cfg.policy.epoch_ms)) {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::error!("discovery: {e}; only the configured donors are used");
                    book.discovery_error = Some(e);
                    None
                }
            }
        } else {
            None
        };
        let inner = Arc::new(Inner {
            admission,
            prefetch: (cfg.prefetch_pages > 0).then(|| prefetch::Prefetch::new(cfg.prefetch_pages)),
            backend,
            // Room for a whole stripe's parity (full-stripe writes).
            bufs: BufPool::new(
                cfg.io_buffers as usize,
                (layout.extent as usize) * layout.parity_count().max(1),
            ),
            placement: Mutex::new(Placement::new(cfg.donors.len())),
            members: membership::Membership::new(book),
            labelling: Mutex::new(()),
            dirty: transient::Dirty::default(),
            rounds: Arc::new(AtomicU64::new(0)),
            cfg,
            session,
            fenced: OnceLock::new(),
            state_dir: state_dir.to_path_buf(),
            layout,
            map,
            fallback,
            stop: AtomicBool::new(false),
            maint_wake: Wake::default(),
            epoch_wake: Wake::default(),
            requests: AtomicU64::new(0),
            requests_at_epoch: AtomicU64::new(0),
            last_request: Mutex::new((0, Instant::now())),
            jobs: Mutex::new(report::Jobs::default()),
            stats: RequestStats::default(),
            frontend: Mutex::new(FrontendInfo::default()),
            resynced: AtomicU64::new(0),
            intent_sweep: Mutex::new(Instant::now()),
            status_refresh: Mutex::new(None),
            status_write: Mutex::new(()),
            lost_seen: AtomicBool::new(false),
            rebalancer: rebalance::Rebalancer::new(&layout),
        });
        inner.join_initial_donors()?;
        inner.forget_unconfigured_donors()?;
        inner.distrust_unlabelled()?;
        let restarted: Vec<usize> = inner
            .members
            .iter()
            .filter(|d| inner.attach(d))
            .map(|d| d.idx)
            .collect();
        let refused: Vec<String> = inner
            .members
            .iter()
            .filter_map(|d| {
                let h = d.health();
                h.refused
                    .as_ref()
                    .map(|r| format!("donor {}: {r}", d.cfg.name))
            })
            .collect();
        if !refused.is_empty() && !inner.holds_data() {
            return Err(DeviceError::Membership(refused.join("; ")));
        }
        // A device that holds data opens without them (their copies are
        // rebuilt from the others, or lost): refusing to open bricked it,
        // every restart failing on a donor named twice.
        for d in inner
            .members
            .iter()
            .filter(|d| d.health().refused.is_some())
        {
            let why = d.health().refused.clone().unwrap_or_default();
            inner.fail_donor_gone(d, &format!("refused at open: {why}"));
        }
        inner.await_discovery_at_open();
        inner.run_epoch(Duration::from_millis(inner.cfg.policy.epoch_ms));
        inner.mark_failed_donors();
        // A donor that restarted serves again at once, as a new donor:
        // writes into the extents it lost need somewhere to go now, not
        // an epoch later.
        for i in restarted {
            inner.revive(&inner.members[i]);
        }
        inner.resync_at_open()?;
        let mut threads = Vec::new();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.to_string())
                .spawn(f)
                .map_err(|source| DeviceError::File {
                    path: PathBuf::from("<thread>"),
                    source,
                })
        };
        let i = inner.clone();
        threads.push(spawn("pager-epoch", Box::new(move || i.epoch_loop()))?);
        let i = inner.clone();
        threads.push(spawn(
            "pager-maint",
            Box::new(move || i.maintenance_loop()),
        )?);
        match control::Server::bind(state_dir) {
            Ok(server) => {
                let i = inner.clone();
                threads.push(spawn("pager-control", Box::new(move || server.run(i)))?);
            }
            Err(e) => tracing::warn!(
                "{}: {e}; pagerctl donor-add, donor-remove and forget-lost cannot reach this device",
                state_dir.join(control::SOCKET_FILE).display()
            ),
        }
        for _ in 0..inner.prefetch.as_ref().map_or(0, |_| prefetch::THREADS) {
            let i = inner.clone();
            threads.push(spawn(
                "pager-prefetch",
                Box::new(move || i.prefetch_loop()),
            )?);
        }
        if inner.wt().is_some() {
            let i = inner.clone();
            threads.push(spawn(
                "pager-wt",
                Box::new(move || i.wt().expect("disk mode").writer_loop()),
            )?);
        }
        inner.write_status();
        if let Some(m) = &inner.cfg.metrics {
            report::serve_metrics(&inner, m)?;
        }
        Ok(Device {
            inner,
            threads: Mutex::new(threads),
        })
    }

    pub fn size(&self) -> u64 {
        self.inner.layout.size
    }

    /// This serving process's session of the device (counted up at each
    /// open; donors refuse requests of older ones).
    pub fn session(&self) -> u64 {
        self.inner.session.number
    }

    pub fn config(&self) -> &DeviceConfig {
        &self.inner.cfg
    }

    /// The request counters: the front end counts its requests' stages
    /// and its write-back buffer's work there (`status.json`, `/metrics`).
    pub fn stats(&self) -> &RequestStats {
        &self.inner.stats
    }

    /// Counts a finished request for `/metrics`: atomics only, so the
    /// request path stays free of locks and allocations.
    fn timed(&self, kind: RequestKind, bytes: u64, t0: Instant, r: Result<()>) -> Result<()> {
        self.inner
            .stats
            .record(kind, bytes, t0.elapsed(), r.is_ok());
        r
    }

    /// Reads `buf.len()` bytes at `offset` (any alignment).
    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let t0 = Instant::now();
        let r = self.inner.fenced_or(self.inner.read(buf, offset));
        self.timed(RequestKind::Read, buf.len() as u64, t0, r)
    }

    /// Writes `data` at `offset` (any alignment).
    pub fn write(&self, data: &[u8], offset: u64) -> Result<()> {
        let t0 = Instant::now();
        let r = self
            .inner
            .fenced_or(self.inner.modify(offset, Payload::Data(data)));
        self.timed(RequestKind::Write, data.len() as u64, t0, r)
    }

    /// Writes `len` zero bytes at `offset`; whole extents are freed.
    pub fn zero(&self, len: u64, offset: u64) -> Result<()> {
        let t0 = Instant::now();
        let r = self
            .inner
            .fenced_or(self.inner.modify(offset, Payload::Zero(len)));
        self.timed(RequestKind::Zero, len, t0, r)
    }

    /// Discards `len` bytes at `offset`: the range reads as zeros after
    /// (in modes parity and ec its whole pages; the bytes of a partial page
    /// stay, trim being advisory). Whole units are freed; in modes none,
    /// mirror and disk partial ones are passed to the donors, in parity
    /// and ec the pages are zeroed at home with the parity kept, trimmed
    /// on their donors and dropped from the parity log, and a group is
    /// freed once nothing written in it is left.
    pub fn trim(&self, len: u64, offset: u64) -> Result<()> {
        let t0 = Instant::now();
        let r = self
            .inner
            .fenced_or(self.inner.modify(offset, Payload::Trim(len)));
        self.timed(RequestKind::Trim, len, t0, r)
    }

    /// Makes everything written so far durable: donors flushed, write-through
    /// queue written and synced, fallback and map journal synced.
    pub fn flush(&self) -> Result<()> {
        let t0 = Instant::now();
        let r = self.inner.flush();
        self.timed(RequestKind::Flush, 0, t0, r)
    }

    /// For each unit-sized piece of `[offset, offset+len)`: whether it was
    /// ever written (unplaced ranges read as zeros).
    pub fn allocation(&self, offset: u64, len: u64) -> Vec<(u64, u64, bool)> {
        self.inner.allocation(offset, len)
    }

    /// The current status (what `status.json` holds).
    pub fn status(&self) -> ClientStatus {
        self.inner.build_status()
    }

    /// Runs one epoch now (status poll, heartbeats, reconnects, frequencies)
    /// instead of waiting for the next one.
    /// Records how the kernel reaches the device (shown by `/metrics`).
    pub fn set_frontend(&self, fe: FrontendInfo) {
        *self.inner.frontend.lock_or_recover() = fe;
    }

    pub fn poll_donors_now(&self) {
        self.inner.epoch_wake.notify();
    }

    /// Adds donor `cfg` to the running device's set, journaled (`pagerctl
    /// donor-add`): connected now, polled from the next epoch (run at
    /// once), new extents go to it by the weighted age/load rule. A donor
    /// that cannot be reached is not added.
    pub fn add_donor(&self, cfg: DonorConfig, how: Joined) -> Result<()> {
        self.inner.add_member(cfg, how, true).map(|_| ())
    }

    /// Starts removing the donor named (or at address) `key` (`pagerctl
    /// donor-remove`): its extents move to the other donors, then it leaves
    /// the set (status then lists it under `left`). Refused with the reason
    /// when the mode could not place a unit without it.
    pub fn remove_donor(&self, key: &str) -> Result<String> {
        self.inner.remove_member(key).map(|d| d.cfg.name.clone())
    }

    /// Gives up on the lost data in `extents` (inclusive; all when `None`),
    /// journaled (`pagerctl forget-lost`): lost extents are placed again
    /// and, with pages that read as lost, read as zeros from now on.
    /// [`DeviceError::NothingLost`] when there was nothing to forget.
    pub fn forget_lost(&self, extents: Option<std::ops::RangeInclusive<u64>>) -> Result<Forgotten> {
        self.inner.forget_lost(extents)
    }
}

impl Device {
    /// Stops the background threads (epochs, maintenance, prefetch, the
    /// control socket, the disk writer) and flushes. Once the caller's own
    /// requests are done too, nothing of this device is in flight to a
    /// donor, so the process may exit: closing a connection under replies
    /// can abort a donor (nbdkit 1.32). Requests still work afterwards,
    /// without maintenance. Dropping the device does the same.
    pub fn quiesce(&self) -> Result<()> {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.maint_wake.notify();
        self.inner.epoch_wake.notify();
        if let Some(wt) = self.inner.wt() {
            wt.stop();
        }
        let threads = std::mem::take(&mut *self.threads.lock_or_recover());
        for t in threads {
            let _ = t.join();
        }
        let flushed = self.inner.flush();
        if flushed.is_ok() {
            // Every group written lately agrees with its parity now: a
            // planned restart need not resync them (the sweep would have
            // closed them a moment later).
            if let Err(e) = self.inner.map.close_all_intents() {
                tracing::warn!(
                    "closing parity groups' write intents: {e} (the next start resyncs them)"
                );
            }
        }
        self.inner.write_status();
        flushed
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Err(e) = self.quiesce() {
            tracing::error!("final flush of device {}: {e}", self.inner.cfg.client_id);
        }
    }
}

impl Inner {
    /// Whether any unit is placed: the device holds data.
    fn holds_data(&self) -> bool {
        (0..self.layout.units()).any(|u| self.map.unit(u).read_or_recover().is_some())
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.layout.size;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(DeviceError::OutOfRange { offset, len, size });
        }
        Ok(())
    }

    /// Bytes of extent `e` inside the device (the last one may be short).
    pub(crate) fn extent_len(&self, e: u64) -> u64 {
        (self.layout.size - e * self.layout.extent).min(self.layout.extent)
    }

    /// Calls `f(extent, offset in extent, offset in request, length)` for
    /// each extent-sized piece of the range.
    pub(crate) fn pieces(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(u64, u64, u64, u64) -> Result<()>,
    ) -> Result<()> {
        let ext = self.layout.extent;
        let mut done = 0;
        while done < len {
            let pos = offset + done;
            let e = pos / ext;
            let in_off = pos % ext;
            let n = (ext - in_off).min(len - done);
            f(e, in_off, done, n)?;
            done += n;
        }
        Ok(())
    }

    /// Refuses every request once a newer session took the device over.
    fn check_fenced(&self) -> Result<()> {
        match self.fenced.get() {
            Some(why) => Err(DeviceError::Fenced(why.clone())),
            None => Ok(()),
        }
    }

    /// `r`, or [`DeviceError::Fenced`] when a failure came from being
    /// replaced.
    fn fenced_or(&self, r: Result<()>) -> Result<()> {
        if r.is_err() {
            self.check_fenced()?;
        }
        r
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check_fenced()?;
        self.check_range(offset, buf.len() as u64)?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.touch(offset, buf.len() as u64);
        // Before the prefetch cache too: it may hold an unfound page's zeros.
        if self.map.any_unfound() {
            self.check_found(offset, buf.len() as u64)?;
        }
        let took = self.read_prefetched(buf, offset);
        if took == crate::readahead::Take::Hit {
            return Ok(());
        }
        self.read_device(buf, offset)?;
        self.read_done(offset, buf.len() as u64, took);
        Ok(())
    }

    fn modify(&self, offset: u64, p: Payload<'_>) -> Result<()> {
        self.check_fenced()?;
        self.check_range(offset, p.len())?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.touch(offset, p.len());
        let writes = matches!(p, Payload::Data(_) | Payload::Zero(_));
        if writes {
            self.replace_lost_for_write(offset, p.len())?;
        }
        // After the change too: a prefetch that read the old page while
        // it was being written must not be served.
        self.written(offset, p.len());
        let mut r = self.modify_device(offset, p);
        if writes && matches!(r, Err(DeviceError::Lost { .. })) {
            // A logged page it had to merge with is lost, or a unit was
            // lost meanwhile.
            if self.recover_range_for_write(offset, p.len())? {
                r = self.modify_device(offset, p);
            }
        }
        self.written(offset, p.len());
        if r.is_ok() && writes && self.map.any_unfound() && p.len() > 0 {
            // The pages it touched hold what was written now (the rest of
            // a page written in part reads as zeros: its old data is gone).
            let (first, last) = (offset / PAGE, (offset + p.len() - 1) / PAGE);
            self.map.set_unfound(first, last - first + 1, false)?;
        }
        r
    }

    fn flush(&self) -> Result<()> {
        if let Some(wt) = self.wt() {
            wt.flush().map_err(|e| DeviceError::Io {
                extent: 0,
                reason: e,
            })?;
        }
        if let Some(fb) = &self.fallback {
            fb.sync()?;
        }
        self.flush_donors();
        self.map.sync()?;
        Ok(())
    }

    fn allocation(&self, offset: u64, len: u64) -> Vec<(u64, u64, bool)> {
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let end = offset.saturating_add(len).min(self.layout.size);
        let mut pos = offset;
        while pos < end {
            let e = pos / self.layout.extent;
            let n = ((e + 1) * self.layout.extent).min(end) - pos;
            let (u, _) = self.layout.locate(e);
            let (first_page, pages) = (pos / PAGE, (n + pos % PAGE).div_ceil(PAGE));
            let placed = self.map.unit(u).read_or_recover().is_some()
                || self.journal().any_in(first_page, pages);
            match out.last_mut() {
                Some(last) if last.2 == placed && last.0 + last.1 == pos => last.1 += n,
                _ => out.push((pos, n, placed)),
            }
            pos += n;
        }
        out
    }
}
