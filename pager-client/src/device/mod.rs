//! The client device: a byte-addressed block device made of extents placed
//! on several donors (and optionally a local fallback file), in one of the
//! modes none, mirror, parity, ec or disk (see [`crate::config::Mode`]).
//!
//! Threading: every public method may be called from many threads at once
//! (nbdkit's parallel thread model). Each unit (extent, or parity group) has
//! its own read/write lock in the [`ExtentMap`]; there is no device-wide lock
//! on the I/O path. Background threads: the epoch thread (donor status,
//! frequencies, heartbeats, reconnects), the maintenance thread (marking a
//! failed donor's copies lost, rebuild, drain, `status.json`, journal
//! compaction) and, in mode disk, the write-through writer.

mod donor;
mod epoch;
mod io;
mod maintenance;
mod parity;
mod parity_log;
mod parity_read;
mod placement;
mod replica;
mod report;
mod resync;
mod writethrough;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{ConfigError, DeviceConfig, Mode};
use crate::extent_map::{ExtentMap, Layout, MapError, Redundancy};
use crate::metrics::{FrontendInfo, RequestKind, RequestStats};
use crate::page_log::PAGE;
use crate::status::ClientStatus;

use donor::Donor;
use io::{BufPool, CodecPool, Fallback};
use netpager_util::{CondvarExt, LockExt, RwLockExt};
use parity_log::ParityLog;
use placement::Placement;
use writethrough::WriteThrough;

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
    Metrics(#[from] netpager_proto::metrics::EndpointError),
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
    pub(crate) state_dir: PathBuf,
    pub(crate) layout: Layout,
    pub(crate) map: ExtentMap,
    pub(crate) donors: Vec<Donor>,
    /// Map donor id -> index in `donors` (`None`: not configured).
    pub(crate) donor_index: Vec<Option<usize>>,
    pub(crate) fallback: Option<Fallback>,
    pub(crate) wt: Option<WriteThrough>,
    /// Mode parity with a parity log.
    pub(crate) plog: Option<ParityLog>,
    pub(crate) bufs: BufPool,
    /// Codecs of a striped mode's groups.
    pub(crate) codecs: Option<CodecPool>,
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
    /// Alternates mirror reads between copies.
    pub(crate) read_turn: AtomicUsize,
    pub(crate) jobs: Mutex<report::Jobs>,
    /// Requests served, by kind, for `/metrics`.
    pub(crate) stats: RequestStats,
    /// How the kernel reaches the device, for `/metrics`.
    pub(crate) frontend: Mutex<FrontendInfo>,
    /// Groups whose parity was recomputed at start (left open by a crash).
    pub(crate) resynced: AtomicU64,
    /// When write intents were last swept.
    pub(crate) intent_sweep: Mutex<Instant>,
}

/// A running device. Dropping it stops its threads and syncs its map.
pub struct Device {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl Device {
    /// Opens the device described by `cfg` with its map and status in
    /// `state_dir`, connects to the donors and starts the background
    /// threads.
    pub fn open(cfg: DeviceConfig, state_dir: &Path) -> Result<Device> {
        cfg.validate()?;
        let layout = Layout::from_config(&cfg);
        let map = ExtentMap::open(state_dir, layout)?;
        let timeouts = cfg.nbd_timeouts();
        let mut donors = Vec::with_capacity(cfg.donors.len());
        for (i, d) in cfg.donors.iter().enumerate() {
            let id = map.donor_id(&d.name)?;
            // The TLS key file doubles as the status endpoint's key: donors
            // started with psk= answer only signed requests.
            let key = d
                .tls_psk_file
                .as_deref()
                .map(|f| netpager_proto::LabKey::from_psk_file(f, None))
                .transpose()
                .map_err(|source| DeviceError::StatusKey {
                    donor: d.name.clone(),
                    source,
                })?;
            let status_client = netpager_proto::StatusClient {
                timeout: std::time::Duration::from_millis(cfg.timeouts.connect_ms),
                key,
            };
            donors.push(Donor::new(
                i,
                id,
                d.clone(),
                cfg.endpoint(d),
                timeouts,
                cfg.connections_per_donor as usize,
                status_client,
            ));
        }
        let mut donor_index = Vec::new();
        for d in &donors {
            let id = d.id as usize;
            if donor_index.len() <= id {
                donor_index.resize(id + 1, None);
            }
            donor_index[id] = Some(d.idx);
        }
        let fallback = match &cfg.fallback {
            Some(fb) => Some(Fallback::open(fb, layout.extent, &map)?),
            None => None,
        };
        let wt = match &cfg.mode {
            Mode::Disk { path, queue } => {
                Some(WriteThrough::open(path, layout.size, queue.0 as usize)?)
            }
            _ => None,
        };
        let plog = map.log_geometry().map(|geo| {
            let placed: Vec<bool> = (0..geo.units)
                .map(|lu| map.unit(layout.log_unit(lu)).read_or_recover().is_some())
                .collect();
            ParityLog::new(
                geo,
                layout.members(),
                &placed,
                cfg.connections_per_donor as usize,
            )
        });
        let codecs = if layout.mode.striped() {
            let (k, r) = (layout.data_per_unit() as usize, layout.parity_count());
            // Log leaders, plus the threads that rebuild and read degraded.
            let n = cfg.connections_per_donor as usize + 2;
            let xor = matches!(layout.mode, Redundancy::Parity { .. });
            Some(
                CodecPool::new(n, k, r, xor).map_err(|source| DeviceError::Code {
                    mode: cfg.mode.word(),
                    source,
                })?,
            )
        } else {
            None
        };
        let inner = Arc::new(Inner {
            plog,
            // Room for a whole stripe's parity (full-stripe writes).
            bufs: BufPool::new(
                cfg.io_buffers as usize,
                (layout.extent as usize) * layout.parity_count().max(1),
            ),
            codecs,
            placement: Mutex::new(Placement::new(cfg.donors.len())),
            cfg,
            state_dir: state_dir.to_path_buf(),
            layout,
            map,
            donors,
            donor_index,
            fallback,
            wt,
            stop: AtomicBool::new(false),
            maint_wake: Wake::default(),
            epoch_wake: Wake::default(),
            requests: AtomicU64::new(0),
            requests_at_epoch: AtomicU64::new(0),
            last_request: Mutex::new((0, Instant::now())),
            read_turn: AtomicUsize::new(0),
            jobs: Mutex::new(report::Jobs::default()),
            stats: RequestStats::default(),
            frontend: Mutex::new(FrontendInfo::default()),
            resynced: AtomicU64::new(0),
            intent_sweep: Mutex::new(Instant::now()),
        });
        inner.forget_unconfigured_donors()?;
        for d in &inner.donors {
            inner.attach(d);
        }
        inner.run_epoch(Duration::from_millis(inner.cfg.policy.epoch_ms));
        inner.mark_failed_donors();
        inner.resync_open_groups()?;
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
        if inner.wt.is_some() {
            let i = inner.clone();
            threads.push(spawn(
                "pager-wt",
                Box::new(move || i.wt.as_ref().expect("disk mode").writer_loop()),
            )?);
        }
        inner.write_status();
        if let Some(m) = &inner.cfg.metrics {
            report::serve_metrics(&inner, m)?;
        }
        Ok(Device { inner, threads })
    }

    pub fn size(&self) -> u64 {
        self.inner.layout.size
    }

    pub fn config(&self) -> &DeviceConfig {
        &self.inner.cfg
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
        let r = self.inner.read(buf, offset);
        self.timed(RequestKind::Read, buf.len() as u64, t0, r)
    }

    /// Writes `data` at `offset` (any alignment).
    pub fn write(&self, data: &[u8], offset: u64) -> Result<()> {
        let t0 = Instant::now();
        let r = self.inner.modify(offset, Payload::Data(data));
        self.timed(RequestKind::Write, data.len() as u64, t0, r)
    }

    /// Writes `len` zero bytes at `offset`; whole extents are freed.
    pub fn zero(&self, len: u64, offset: u64) -> Result<()> {
        let t0 = Instant::now();
        let r = self.inner.modify(offset, Payload::Zero(len));
        self.timed(RequestKind::Zero, len, t0, r)
    }

    /// Discards `len` bytes at `offset`; whole extents are freed, partial
    /// ones are passed to the donors (parity: ignored, trim is advisory).
    pub fn trim(&self, len: u64, offset: u64) -> Result<()> {
        let t0 = Instant::now();
        let r = self.inner.modify(offset, Payload::Trim(len));
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
}

impl Drop for Device {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.maint_wake.notify();
        self.inner.epoch_wake.notify();
        if let Some(wt) = &self.inner.wt {
            wt.stop();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Err(e) = self.inner.flush() {
            tracing::error!("final flush of device {}: {e}", self.inner.cfg.client_id);
        }
        self.inner.write_status();
    }
}

impl Inner {
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
    fn pieces(
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

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        if self.layout.mode.striped() {
            return self.read_striped(buf, offset);
        }
        self.pieces(offset, buf.len() as u64, |e, in_off, at, n| {
            self.read_replica(e, in_off, &mut buf[at as usize..(at + n) as usize])
        })
    }

    fn modify(&self, offset: u64, p: Payload<'_>) -> Result<()> {
        self.check_range(offset, p.len())?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        if let (true, Payload::Data(d)) = (self.layout.mode.striped(), p) {
            return self.write_parity_range(offset, d);
        }
        self.pieces(offset, p.len(), |e, in_off, at, n| {
            let piece = match p {
                Payload::Data(d) => Payload::Data(&d[at as usize..(at + n) as usize]),
                Payload::Zero(_) => Payload::Zero(n),
                Payload::Trim(_) => Payload::Trim(n),
            };
            if self.layout.mode.striped() {
                self.modify_parity(e, in_off, piece)
            } else {
                self.modify_replica(e, in_off, piece)
            }
        })
    }

    fn flush(&self) -> Result<()> {
        if let Some(wt) = &self.wt {
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
                || self.map.log_any_in(first_page, pages);
            match out.last_mut() {
                Some(last) if last.2 == placed && last.0 + last.1 == pos => last.1 += n,
                _ => out.push((pos, n, placed)),
            }
            pos += n;
        }
        out
    }
}
