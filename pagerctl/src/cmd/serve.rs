//! `pagerctl serve`: the process that serves a device to the kernel itself,
//! as the file `STATE_DIR/fuse/device` on its own FUSE mount, calling the
//! device directly. `attach` starts it; it runs until the mount goes away.
//!
//! With `--held` it serves a restartable device instead: the connection
//! comes from the holder (`pagerctl hold`, which mounted it), the device is
//! opened as after a crash, the kernel is asked to resend what a dead
//! predecessor left unanswered, and SIGUSR1 hands over to the next process
//! (`pagerctl restart`).
//!
//! Under a service manager (`$NOTIFY_SOCKET` set, `--transport fuse`) it
//! gives the connection to the manager's fd store (systemd's
//! `FileDescriptorStoreMax=`) and serves it as a held one; started again
//! with that fd in `$LISTEN_FDS`, it takes it over as `--held` does.
//!
//! It sits on the swap path, so it locks its memory, marks itself an I/O
//! flusher, leaves every memory cgroup (the job that swaps is limited, not
//! its pager) and is exempt from the OOM killer.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use pager_client::config::DeviceConfig;
use pager_client::device::Device;
use pager_fuse::fdstore;
use pager_fuse::handover::{self, Request};
use pager_fuse::{Backend, Mount, Options, Transport};
use pagerctl::attach::record::{frontend_info, ServeInfo, StateLayout};

use crate::{devices, procs, sys};

/// Closed when the process hands over to the next one: a request that
/// reaches the device after that waits forever, unanswered, and the
/// kernel sends it again to the next process. Counts the requests inside.
#[derive(Default)]
struct Gate {
    closed: AtomicBool,
    inside: AtomicUsize,
}

struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    fn enter(&self) -> Inside<'_> {
        self.inside.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.inside.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        Inside(self)
    }

    /// Closes the gate and waits until no request is inside (at most
    /// `limit`); whether none is.
    fn close_and_drain(&self, limit: Duration) -> bool {
        self.closed.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while self.inside.load(Ordering::SeqCst) > 0 {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// The device as the FUSE front end sees it.
struct DeviceBackend {
    device: Arc<Device>,
    gate: Arc<Gate>,
}

impl Backend for DeviceBackend {
    fn size(&self) -> u64 {
        self.device.size()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        self.device
            .read(buf, offset)
            .map_err(|e| log_errno("read", offset, e))
    }
    fn write(&self, data: &[u8], offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        self.device
            .write(data, offset)
            .map_err(|e| log_errno("write", offset, e))
    }
    fn zero(&self, len: u64, offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        self.device
            .zero(len, offset)
            .map_err(|e| log_errno("zero", offset, e))
    }
    fn trim(&self, len: u64, offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        self.device
            .trim(len, offset)
            .map_err(|e| log_errno("trim", offset, e))
    }
    fn flush(&self) -> Result<(), i32> {
        let _in = self.gate.enter();
        self.device.flush().map_err(|e| log_errno("flush", 0, e))
    }
}

/// The kernel sees only an errno: the reason goes to the log.
fn log_errno(what: &str, offset: u64, e: pager_client::device::DeviceError) -> i32 {
    tracing::error!("{what} at offset {offset}: {e}");
    e.errno()
}

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// fuse-uring (falls back to fuse when the kernel does not offer it)
    /// or fuse.
    #[arg(long, default_value = "fuse-uring", value_parser = parse_transport)]
    transport: Transport,
    /// Reader threads (fuse), or serving threads per CPU (fuse-uring).
    #[arg(long, default_value_t = 16, value_name = "N")]
    threads: usize,
    /// Take the FUSE connection from the holder (`pagerctl hold`) of a
    /// restartable device instead of mounting one.
    #[arg(long)]
    held: bool,
}

fn parse_transport(s: &str) -> Result<Transport, String> {
    match s {
        "fuse-uring" => Ok(Transport::Uring),
        "fuse" => Ok(Transport::Classic),
        _ => Err(format!("{s:?}: expected fuse-uring or fuse")),
    }
}

/// The FUSE connection's name in the service manager's fd store.
const FDSTORE_NAME: &str = "netpager-fuse";

/// How long a hand-over waits for the requests being answered.
const DRAIN_LIMIT: Duration = Duration::from_secs(20);

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    let cfg = DeviceConfig::load_from_state_dir(&layout.dir)?;
    let me = std::process::id();
    if cfg.mlock {
        netpager_util::process::lock_memory(netpager_util::process::Lock::Prefault)
            .context("mlockall (set mlock = false in device.toml to run unlocked)")?;
    }
    if let Err(e) = pager_fuse::set_io_flusher() {
        tracing::warn!(
            "PR_SET_IO_FLUSHER refused ({e}): reclaim may wait on this process's own I/O"
        );
    }
    procs::protect_from_oom(me, "the serving process");
    procs::leave_memory_cgroups(me);
    // Signals wait for their own thread, so that SIGTERM unmounts cleanly
    // instead of cutting the kernel's device off.
    sys::block_stop_signals().context("cannot block SIGTERM and SIGINT")?;
    let device = Arc::new(Device::open(cfg, &layout.dir)?);
    let gate = Arc::new(Gate::default());
    let backend = DeviceBackend {
        device: device.clone(),
        gate: gate.clone(),
    };
    let mountpoint = layout.fuse_dir();
    let opts = Options {
        transport: a.transport,
        threads: a.threads,
        ..Options::default()
    };
    // systemd's fd store (pagerctl(1) RESTARTS): the connection a
    // predecessor gave the service manager, or a new one to give it.
    let notify = std::env::var("NOTIFY_SOCKET")
        .ok()
        .filter(|s| !s.is_empty() && !a.held);
    let stored = if a.held {
        None
    } else {
        fdstore::take(FDSTORE_NAME)
            .context("taking the FUSE connection the service manager passed (LISTEN_FDS)")?
    };
    let store_in = match notify {
        Some(_) if stored.is_some() => None,
        Some(_) if a.transport != Transport::Classic => {
            tracing::warn!(
                "NOTIFY_SOCKET is set but the transport is {}: the connection is not stored, since the kernel never resends a request a dead server left in an io_uring entry (serve --transport fuse to store it)",
                a.transport
            );
            None
        }
        n => n,
    };
    let restartable = a.held || stored.is_some() || store_in.is_some();
    let mount = if a.held {
        let socket = layout.holder_socket();
        let (fd, fresh) = handover::take(&socket, Duration::from_secs(10))
            .with_context(|| format!("cannot take the connection from {}", socket.display()))?;
        Mount::serve_held(backend, fd, &mountpoint, &opts, fresh)
            .with_context(|| format!("cannot serve {}", mountpoint.display()))?
    } else if let Some(fd) = stored {
        tracing::info!("took the FUSE connection from the service manager's fd store");
        let mount = Mount::serve_held(backend, fd, &mountpoint, &opts, false)
            .with_context(|| format!("cannot serve {}", mountpoint.display()))?;
        let resent = mount.resent_counter();
        std::thread::Builder::new()
            .name("resent".into())
            .spawn(move || {
                // FUSE_NOTIFY_RESEND brings them all at once: the first
                // seconds tell.
                let mut told = 0;
                for _ in 0..50 {
                    std::thread::sleep(Duration::from_millis(100));
                    let n = resent.load(Ordering::Relaxed);
                    if n != told {
                        tracing::info!("answered {n} requests a dead serving process had left");
                        told = n;
                    }
                }
            })
            .context("cannot start the resent thread")?;
        mount
    } else if let Some(notify) = store_in {
        std::fs::create_dir_all(&mountpoint)
            .with_context(|| format!("cannot create {}", mountpoint.display()))?;
        let fd = pager_fuse::mount_connection(&mountpoint, &opts)
            .with_context(|| format!("cannot mount {}", mountpoint.display()))?;
        let keep = fd.try_clone().context("cannot dup the /dev/fuse fd")?;
        // Served as a held connection (its readers all on this one open
        // file), so that a successor can take it over.
        let mount = match Mount::serve_held(backend, fd, &mountpoint, &opts, true) {
            Ok(m) => m,
            Err(e) => {
                let _ = pager_fuse::unmount(&mountpoint, true);
                return Err(e).with_context(|| format!("cannot serve {}", mountpoint.display()));
            }
        };
        // Stored once INIT is answered: a successor never has to.
        match fdstore::store(&notify, FDSTORE_NAME, &keep) {
            Ok(()) => tracing::info!(
                "gave the FUSE connection to the service manager's fd store as {FDSTORE_NAME}"
            ),
            Err(e) => tracing::warn!(
                "cannot store the FUSE connection at NOTIFY_SOCKET={notify}: {e}; if this process dies, the device is lost"
            ),
        }
        mount
    } else {
        std::fs::create_dir_all(&mountpoint)
            .with_context(|| format!("cannot create {}", mountpoint.display()))?;
        Mount::start(backend, &mountpoint, &opts)
            .with_context(|| format!("cannot serve {}", mountpoint.display()))?
    };
    if let Some(why) = mount.fallback_reason() {
        tracing::warn!("using classic /dev/fuse: {why}");
    }
    tracing::info!(
        "serving {} over {}{}",
        layout.fuse_file().display(),
        mount.transport(),
        if restartable { " (restartable)" } else { "" }
    );
    let info = ServeInfo {
        pid: me,
        transport: mount.transport().to_string(),
        fallback: mount.fallback_reason().map(str::to_string),
    };
    info.save(&layout.serve_json())?;
    device.set_frontend(frontend_info(&layout));
    if a.held {
        let socket = layout.holder_socket();
        handover::ask(
            &socket,
            &Request::Ready { pid: me },
            Duration::from_secs(10),
        )
        .with_context(|| format!("cannot tell the holder at {}", socket.display()))?;
        let resent = mount.resent_counter();
        std::thread::Builder::new()
            .name("resent".into())
            .spawn(move || report_resent(&socket, me, &resent))
            .context("cannot start the resent thread")?;
    }
    let stopper = mountpoint.clone();
    let (held, to_flush) = (restartable, device.clone());
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || on_signals(&stopper, held, &gate, &to_flush))
        .context("cannot start the signal thread")?;
    let served = mount.wait();
    let _ = std::fs::remove_file(layout.serve_json());
    drop(device);
    served.context("serving the FUSE mount")?;
    tracing::info!("unmounted; the device's map is synced");
    Ok(())
}

/// Tells the holder how many requests came again after
/// FUSE_NOTIFY_RESEND: they all come at once, so for the first seconds.
fn report_resent(socket: &Path, me: u32, resent: &std::sync::atomic::AtomicU64) {
    let mut told = 0;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let n = resent.load(Ordering::Relaxed);
        if n != told {
            let r = Request::Resent { pid: me, count: n };
            match handover::ask(socket, &r, Duration::from_secs(5)) {
                Ok(_) => told = n,
                Err(e) => tracing::warn!("cannot tell the holder of {n} resent requests: {e}"),
            }
        }
    }
    if told > 0 {
        tracing::info!("answered {told} requests a dead serving process had left");
    }
}

/// SIGUSR1 (from the holder, for pagerctl restart): hand over. Requests
/// stop reaching the device; once those inside are answered and the
/// device quiesced (background work stopped, flushed: no request left in
/// flight to a donor), the process exits leaving the mount to the next
/// one.
fn hand_over(gate: &Gate, device: &Device) -> ! {
    let t0 = Instant::now();
    if !gate.close_and_drain(DRAIN_LIMIT) {
        tracing::warn!(
            "requests still running after {DRAIN_LIMIT:?}: the next process answers them again"
        );
    }
    if let Err(e) = device.quiesce() {
        tracing::warn!("flush before the hand-over: {e} (the next process resyncs)");
    }
    tracing::info!(
        "handing over to the next serving process ({} ms to drain and flush)",
        t0.elapsed().as_millis()
    );
    std::process::exit(0)
}

fn on_signals(mountpoint: &Path, held: bool, gate: &Gate, device: &Device) {
    loop {
        match sys::wait_stop_signal() {
            libc::SIGUSR1 if held => hand_over(gate, device),
            libc::SIGUSR1 => tracing::warn!("SIGUSR1: not restartable (attach --restartable)"),
            // Unmounted here while another mount namespace still holds a
            // copy of the mount: the connection lives on, and no request
            // will end the threads. The holder exits after this process.
            sig if held && !devices::is_mounted(mountpoint) => {
                tracing::info!(
                    "signal {sig}: {} is unmounted here: exiting",
                    mountpoint.display()
                );
                hand_over(gate, device)
            }
            sig => unmount_on_signal(mountpoint, sig),
        }
    }
}

/// On SIGTERM or SIGINT, unmounts (which ends the serving threads) unless
/// the device is still in use: pulling it from under a loop device would
/// fail every swapped page.
fn unmount_on_signal(mountpoint: &Path, sig: libc::c_int) {
    match pager_fuse::unmount(mountpoint, false) {
        Ok(()) => tracing::info!("signal {sig}: unmounted {}", mountpoint.display()),
        Err(e) => tracing::warn!(
            "signal {sig}: cannot unmount {} ({e}); it is still in use: run pagerctl detach",
            mountpoint.display()
        ),
    }
}
