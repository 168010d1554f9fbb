//! pager-server: an nbdkit plugin that donates a node's spare RAM to
//! netpager clients (see `pager-server.1.md`).
//!
//! The library does the work: [`store`] (pages, budget, ages), [`slab`]
//! (the memory pages live in), [`config`]
//! (parameters, export names), [`memwatch`] (meminfo, load), [`state`]
//! (idle/busy/draining, utilisation), [`donor`] (the whole donor and its
//! status), [`status`] (the TCP endpoint), [`access`] (who may reach
//! pages and status). This file is the thin nbdkit shell around them;
//! [`sys`] holds every `unsafe`.
//!
//! The modules form layers; each uses only those below it, so there is no
//! import cycle:
//!
//! 1. [`config`] (parameters, export names, the page size),
//!    [`memwatch`] (meminfo, load average) and [`ratio`] (the compression
//!    ratio offered) use nothing of the crate;
//! 2. [`access`] uses `config`; [`state`] uses `memwatch`;
//! 3. [`sys`] (FFI: pages, slabs, the peer's address) uses `access` and
//!    `config`; [`slab`] uses `sys`; [`store`] uses `slab`, `sys` and
//!    `config`;
//! 4. [`donor`] (the whole donor, and the thread that feeds it meminfo)
//!    uses `store`, `state`, `ratio`, `memwatch` and `config`; [`replay`]
//!    (recorded pages through the store, for `make bench-compress`) uses
//!    `store`, `sys` (a thread's CPU clock) and `config`;
//! 5. [`status`] uses `donor`; this file uses them all.
//!
//! The one edge upward is nbdkit's entry point, `sys::plugin_init`, which
//! registers [`PagerServer`] from this file: it must be `#[no_mangle]`,
//! which only `sys` may be.

pub mod access;
pub mod announce;
pub mod config;
pub mod donor;
pub mod memwatch;
pub mod metrics;
pub mod ratio;
pub mod replay;
pub mod session;
pub mod slab;
pub mod state;
pub mod status;
pub mod store;
#[allow(unsafe_code)]
pub mod sys;

use std::net::TcpListener;
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::Instant;

use nbdkit::{
    CacheFlags, Error, ExtentHandle, ExtentType, Flags, FuaFlags, Result, Server, ThreadModel,
};

use access::{admit_export, check_status_address, requires_tls, AccessError};
use announce::Announcement;
use config::Announce;
use config::Config;
use donor::{describe, Donor, Logger, Op, Settings};
use memwatch::{has_cap_ipc_lock, read_loadavg, read_meminfo};
use netpager_membership::discovery::Announcer;
use netpager_metrics::{Bound, EndpointConfig};
use netpager_proto::auth::load_export_secret;
use netpager_util::{format_size, LockExt};
use session::{Claim, Sessions};
use state::Observation;
use store::{Export, StoreError};

static CONFIG: Mutex<Option<Config>> = Mutex::new(None);
static DONOR: OnceLock<Arc<Donor>> = OnceLock::new();
static LISTENER: Mutex<Option<TcpListener>> = Mutex::new(None);
static METRICS: Mutex<Option<Bound>> = Mutex::new(None);
static GUARD: OnceLock<Guard> = OnceLock::new();
/// The DNS-SD announcement of `announce=`, withdrawn at unload.
static ANNOUNCER: Mutex<Option<Announcement>> = Mutex::new(None);
/// Which client session owns each device's export.
static SESSIONS: LazyLock<Sessions> = LazyLock::new(Sessions::default);

/// The access rules' inputs, loaded at config_complete.
struct Guard {
    /// The lab key of `psk=`, for the status endpoint.
    status_auth: Option<Arc<status::Auth>>,
    /// The key of `export-secret=`.
    export_secret: Option<Vec<u8>>,
    insecure: bool,
    /// `metrics=`, with the lab key file that keys it (`psk=`).
    metrics: Option<EndpointConfig>,
    announce: Announce,
    /// `announce=dns`: where and with which key.
    dns: Option<announce::DnsSettings>,
}

const NBDKIT_LOG: Logger = Logger {
    debug: sys::log_debug,
    error: sys::log_error,
};
/// Blocks from this size up get their own mapping (glibc's default, pinned).
const MMAP_THRESHOLD: i32 = 128 << 10;
/// Pages one extents request looks at, at most (512 MiB of export).
const EXTENTS_MAX_PAGES: u64 = 1 << 17;

fn einval(msg: impl Into<String>) -> Error {
    Error::new(libc::EINVAL, msg.into())
}

fn donor() -> Result<&'static Arc<Donor>> {
    DONOR
        .get()
        .ok_or_else(|| einval("pager-server: used before config_complete"))
}

fn guard() -> Result<&'static Guard> {
    GUARD
        .get()
        .ok_or_else(|| einval("pager-server: used before config_complete"))
}

fn refused(e: AccessError) -> Error {
    Error::new(e.errno(), e.to_string())
}

/// Loads the key files and checks that a status endpoint on the network
/// authenticates its requests.
fn load_guard(cfg: &Config) -> Result<Guard> {
    let status_auth = cfg
        .psk
        .as_deref()
        .map(status::Auth::load)
        .transpose()
        .map_err(|e| einval(format!("psk=: {e}")))?
        .map(Arc::new);
    let export_secret = cfg
        .export_secret
        .as_deref()
        .map(load_export_secret)
        .transpose()
        .map_err(|e| einval(format!("export-secret=: {e}")))?;
    if let Some(addr) = &cfg.status {
        let sa = status::resolve(addr).map_err(|e| einval(e.to_string()))?;
        check_status_address(sa, status_auth.is_some(), cfg.insecure).map_err(refused)?;
    } else if cfg.announce != Announce::Off {
        return Err(einval(
            "announce=true needs status=ADDR:PORT: clients verify an announced donor by its status",
        ));
    }
    let metrics = cfg.metrics.as_ref().map(|addr| EndpointConfig {
        param: "metrics",
        addr: addr.clone(),
        key_file: cfg.psk.clone(),
        insecure: cfg.insecure,
    });
    if let Some(m) = &metrics {
        let sa = netpager_metrics::resolve(m.param, &m.addr).map_err(|e| einval(e.to_string()))?;
        netpager_metrics::check_address(m.param, sa, m.key_file.is_some(), m.insecure)
            .map_err(|e| Error::new(libc::EACCES, e.to_string()))?;
    }
    Ok(Guard {
        status_auth,
        export_secret,
        insecure: cfg.insecure,
        metrics,
        announce: cfg.announce,
        dns: announce::DnsSettings::load(cfg).map_err(einval)?,
    })
}

/// One client connection: a handle on the export it named.
pub struct PagerServer {
    export: Arc<Export>,
    donor: Arc<Donor>,
    /// The client session's claim on the export, when it named one.
    claim: Option<Claim>,
    /// Counts this connection in the export's status while it lives.
    _counted: donor::Connected,
}

impl PagerServer {
    fn io(
        &self,
        op: Op,
        bytes: u64,
        f: impl FnOnce(u32) -> std::result::Result<(), StoreError>,
    ) -> Result<()> {
        // Held for the request: a newer claim waits for it to end.
        let _owned = match &self.claim {
            Some(c) => Some(c.hold().map_err(|e| Error::new(e.errno(), e.to_string()))?),
            None => None,
        };
        let t0 = Instant::now();
        let r = self.guarded(|| f(self.donor.tick(t0)));
        self.donor
            .record(op, bytes, t0.elapsed(), r.as_ref().map(|_| ()));
        r.map_err(|e| Error::new(e.errno(), e.to_string()))
    }

    /// [`Export::guarded`], saying in the log when it shuts the export.
    fn guarded<R>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, StoreError>,
    ) -> std::result::Result<R, StoreError> {
        let was_open = self.export.broken().is_none();
        let r = self.export.guarded(|_| f());
        if let (true, Err(e @ StoreError::Broken { .. })) = (was_open, &r) {
            sys::log_error(&e.to_string());
        }
        r
    }
}

/// Checks before the start that `mlockall` will not run into
/// RLIMIT_MEMLOCK later. The kernel charges the whole size of every locked
/// mapping against that limit, touched or not, and nbdkit reserves address
/// space per thread (an 8 MiB stack, a malloc arena of up to 64 MiB), so
/// no finite limit sized from the budget is safe: once reached, nbdkit's
/// own allocations would fail. Hence CAP_IPC_LOCK or an unlimited limit.
fn check_mlock(s: &Settings) -> Result<()> {
    if !s.mlock || has_cap_ipc_lock() {
        return Ok(());
    }
    let limit = sys::memlock_limit()
        .map_err(|e| einval(format!("mlock=true: getrlimit(RLIMIT_MEMLOCK): {e}")))?;
    match limit {
        Some(l) => Err(einval(format!(
            "mlock=true: RLIMIT_MEMLOCK is {} and the process lacks CAP_IPC_LOCK; locking a budget of {} \
             needs CAP_IPC_LOCK or an unlimited RLIMIT_MEMLOCK (ulimit -l unlimited), or set mlock=false",
            format_size(l),
            format_size(s.budget_bytes),
        ))),
        None => Ok(()),
    }
}

fn hostname() -> Result<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .map_err(|e| einval(format!("cannot read the hostname for node-id (/proc/sys/kernel/hostname: {e}); set node-id=")))
}

impl Server for PagerServer {
    fn name() -> &'static str {
        "pager-server"
    }

    fn longname() -> Option<&'static str> {
        Some("netpager donor: spare RAM served as NBD exports")
    }

    fn version() -> Option<&'static str> {
        Some(env!("CARGO_PKG_VERSION"))
    }

    fn description() -> Option<&'static str> {
        Some("Stores clients' pages in this node's spare memory under a budget, one sparse export per name.")
    }

    fn config_help() -> Option<&'static str> {
        Some(config::HELP)
    }

    fn config(key: &str, value: &str) -> Result<()> {
        let mut c = CONFIG.lock_or_recover();
        c.get_or_insert_with(Config::default)
            .set(key, value)
            .map_err(|e| einval(e.to_string()))
    }

    fn config_complete() -> Result<()> {
        let cfg = CONFIG.lock_or_recover().take().unwrap_or_default();
        let mem = read_meminfo(&cfg.meminfo).map_err(|e| einval(e.to_string()))?;
        let load1 = read_loadavg().map_err(|e| einval(e.to_string()))?;
        let host = match &cfg.node_id {
            Some(n) => n.clone(),
            None => hostname()?,
        };
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        cfg.recompressor().map_err(einval)?;
        let settings = Settings::resolve(&cfg, mem, &host, ncpu);
        settings.check_budget(&mem).map_err(einval)?;
        check_mlock(&settings)?;
        let guard = load_guard(&cfg)?;
        sys::log_debug(&describe(&settings));
        sys::log_debug(&format!(
            "status requests {}, export tokens {}, plain text from other machines {}",
            if guard.status_auth.is_some() {
                "signed with the lab key"
            } else {
                "unauthenticated"
            },
            if guard.export_secret.is_some() {
                "required"
            } else {
                "off"
            },
            if guard.insecure {
                "allowed (insecure=true)"
            } else {
                "refused"
            },
        ));
        if let Some(m) = &guard.metrics {
            sys::log_debug(&format!(
                "metrics at http://{}/metrics, {}",
                m.addr,
                if m.key_file.is_some() {
                    "scrapes need the lab key's bearer token"
                } else {
                    "open to whoever reaches the address"
                }
            ));
        }
        if GUARD.set(guard).is_err() {
            return Err(einval("pager-server: configured twice"));
        }
        let donor = Donor::new(
            settings,
            Observation { mem, load1 },
            Instant::now(),
            NBDKIT_LOG,
        );
        DONOR
            .set(Arc::new(donor))
            .map_err(|_| einval("pager-server: configured twice"))
    }

    fn thread_model() -> Result<ThreadModel> {
        // Each connection is served by its own one thread, requests in
        // order, while connections run in parallel (the client spreads its
        // requests over several). A request takes microseconds here, and
        // nbdkit's worker pool handed every request from the thread that
        // read it to another: a third of the donor's CPU in a swap job
        // went to those wake-ups. One thread per connection also means no
        // reply is ever encrypted while another thread ends the TLS
        // session (nbdkit 1.32's abort, pager-server(1) BUGS).
        Ok(ThreadModel::SerializeRequests)
    }

    fn get_ready() -> Result<()> {
        // Bound before nbdkit forks so that a taken port fails the start.
        if let Some(addr) = &donor()?.settings().status {
            let l = status::bind(addr).map_err(|e| einval(e.to_string()))?;
            *LISTENER.lock_or_recover() = Some(l);
        }
        if let Some(m) = &guard()?.metrics {
            let b = Bound::new(m).map_err(|e| einval(e.to_string()))?;
            *METRICS.lock_or_recover() = Some(b);
        }
        Ok(())
    }

    fn after_fork() -> Result<()> {
        // Threads and memory locks do not survive fork: start them here,
        // in the process that serves. nbdkit -u/-g has dropped privileges
        // by now, so the mlock check made at config_complete is repeated.
        let d = donor()?;
        // Connections come and go with request buffers of up to 64 MiB;
        // these must go back to the node with them (see the function).
        if !sys::fix_mmap_threshold(MMAP_THRESHOLD) {
            sys::log_error(
                "cannot set malloc's mmap threshold: freed request buffers may stay resident",
            );
        }
        if d.settings().mlock {
            check_mlock(d.settings())?;
            netpager_util::process::lock_memory(netpager_util::process::Lock::OnFault).map_err(|e| {
                Error::new(
                    e.raw_os_error().unwrap_or(libc::ENOMEM),
                    format!("mlock=true: mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT) failed: {e}; set mlock=false to donate unlocked pages"),
                )
            })?;
        }
        donor::spawn_watch(Arc::clone(d))
            .map_err(|e| einval(format!("cannot start the memory watch thread: {e}")))?;
        let mut status_addr = None;
        let mut own_ports = Vec::new();
        if let Some(l) = LISTENER.lock_or_recover().take() {
            status_addr = l.local_addr().ok();
            own_ports.extend(status_addr.map(|a| a.port()));
            status::spawn(l, Arc::clone(d), guard()?.status_auth.clone())
                .map_err(|e| einval(format!("cannot start the status thread: {e}")))?;
        }
        if let Some(b) = METRICS.lock_or_recover().take() {
            own_ports.extend(b.local_addr().ok().map(|a| a.port()));
            let d = Arc::clone(d);
            b.spawn(move || metrics::exposition(&d.status(Instant::now()), &d.service_times()))
                .map_err(|e| einval(format!("cannot start the metrics thread: {e}")))?;
        }
        if guard()?.announce != Announce::Off {
            let status = status_addr
                .ok_or_else(|| einval("announce=: the status endpoint is not listening"))?;
            start_announcing(d, status, &own_ports)?;
        }
        Ok(())
    }

    fn unload() {
        // Dropped here, so the announcement is withdrawn by a goodbye
        // packet rather than left to expire in browsers' caches.
        if let Some(Announcement::Dns(p)) = ANNOUNCER.lock_or_recover().take() {
            match p.withdraw() {
                Ok(()) => sys::log_debug("announce=dns: records removed"),
                Err(e) => sys::log_error(&format!("announce=dns: records not removed: {e}")),
            }
        }
    }

    fn open(_readonly: bool) -> Result<Box<dyn Server>> {
        let d = donor()?;
        let g = guard()?;
        requires_tls(sys::peer_name(), nbdkit::is_tls()?, g.insecure).map_err(refused)?;
        let raw = nbdkit::export_name()
            .map_err(|e| einval(format!("cannot read the export name: {e}")))?;
        let req = admit_export(&raw, g.export_secret.as_deref()).map_err(refused)?;
        let export = d
            .pool()
            .open(&req.spec, d.settings().default_size)
            .map_err(|e| einval(e.to_string()))?;
        let claim = req.session.map(|s| SESSIONS.claim(&req.spec.name, s));
        if let Some(Err(e)) = claim.as_ref().map(Claim::hold) {
            sys::log_error(&format!("{e}: its requests are refused"));
        }
        Ok(Box::new(PagerServer {
            export,
            donor: Arc::clone(d),
            claim,
            _counted: d.connected(&req.spec.name),
        }))
    }

    fn get_size(&self) -> Result<i64> {
        Ok(self.export.size() as i64)
    }

    // Every write is in the store when the callback returns.
    fn can_write(&self) -> Result<bool> {
        Ok(true)
    }

    // Memory has nothing to flush; advertised so clients may send flushes.
    fn can_flush(&self) -> Result<bool> {
        Ok(true)
    }

    // Native: a write is as durable as it will ever be on return, so FUA is free.
    fn can_fua(&self) -> Result<FuaFlags> {
        Ok(FuaFlags::Native)
    }

    // All connections to a name share one store and see every completed write.
    fn can_multi_conn(&self) -> Result<bool> {
        Ok(true)
    }

    // Trim frees pages: the point of a donor.
    fn can_trim(&self) -> Result<bool> {
        Ok(true)
    }

    // Zero frees or zeroes pages without client data on the wire.
    fn can_zero(&self) -> Result<bool> {
        Ok(true)
    }

    // Zeroing never allocates, so it is always faster than writing zeros.
    fn can_fast_zero(&self) -> Result<bool> {
        Ok(true)
    }

    // Allocated pages versus holes is exactly what the page table knows.
    fn can_extents(&self) -> Result<bool> {
        Ok(true)
    }

    // Native without a .cache callback: nbdkit answers cache requests as a
    // no-op, right for data that is already in RAM.
    fn can_cache(&self) -> Result<CacheFlags> {
        Ok(CacheFlags::Native)
    }

    fn is_rotational(&self) -> Result<bool> {
        Ok(false)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.io(Op::Read, len, |now| self.export.read(buf, offset, now))
    }

    fn write_at(&self, buf: &[u8], offset: u64, _flags: Flags) -> Result<()> {
        self.io(Op::Write, buf.len() as u64, |now| {
            self.export.write(buf, offset, now)
        })
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn trim(&self, count: u32, offset: u64, _flags: Flags) -> Result<()> {
        self.io(Op::Trim, u64::from(count), |_| {
            self.export.discard(offset, u64::from(count)).map(|_| ())
        })
    }

    fn zero(&self, count: u32, offset: u64, _flags: Flags) -> Result<()> {
        self.io(Op::Zero, u64::from(count), |_| {
            self.export.discard(offset, u64::from(count)).map(|_| ())
        })
    }

    fn extents(&self, count: u32, offset: u64, flags: Flags, h: &mut ExtentHandle) -> Result<()> {
        let one = flags.contains(Flags::REQ_ONE);
        let mut failed = None;
        self.guarded(|| {
            self.export.extents(
                offset,
                u64::from(count),
                EXTENTS_MAX_PAGES,
                |o, l, allocated| {
                    let kind = if allocated {
                        ExtentType::Allocated
                    } else {
                        ExtentType::HoleZero
                    };
                    match h.add(o, l, kind) {
                        Ok(()) => !one,
                        Err(e) => {
                            failed = Some(e);
                            false
                        }
                    }
                },
            );
            Ok(())
        })
        .map_err(|e| Error::new(e.errno(), e.to_string()))?;
        failed.map_or(Ok(()), Err)
    }
}

/// Announces the donor with nbdkit's NBD port (the listening port that is
/// not one of `own_ports`, the plugin's status and metrics ports).
fn start_announcing(d: &Donor, status: std::net::SocketAddr, own_ports: &[u16]) -> Result<()> {
    let status_port = status.port();
    let nbd = announce::own_listening_ports()
        .and_then(|l| announce::nbd_port(&l, own_ports))
        .map_err(einval)?;
    let node = &d.settings().node_id;
    let a = match &guard()?.dns {
        Some(dns) => {
            let log = |m: &str| sys::log_error(m);
            Announcement::Dns(dns.publish(node, nbd, status, log).map_err(einval)?)
        }
        None => Announcement::Mdns(
            Announcer::start(node, nbd, status_port)
                .map_err(|e| einval(format!("announce=true: {e}")))?,
        ),
    };
    sys::log_debug(&format!(
        "announcing {node} on the network: NBD port {nbd}, status port {status_port}"
    ));
    *ANNOUNCER.lock_or_recover() = Some(a);
    Ok(())
}

/// The callbacks [`sys::plugin_init`] registers.
fn register(b: &mut nbdkit::Builder) {
    b.config = true;
    b.config_complete = true;
    b.thread_model = true;
    b.get_ready = true;
    b.after_fork = true;
    b.unload = true;
    b.write_at = true;
    b.flush = true;
    b.trim = true;
    b.zero = true;
    b.extents = true;
    b.can_write = true;
    b.can_flush = true;
    b.can_fua = true;
    b.can_multi_conn = true;
    b.can_trim = true;
    b.can_zero = true;
    b.can_fast_zero = true;
    b.can_extents = true;
    b.can_cache = true;
    b.is_rotational = true;
}
