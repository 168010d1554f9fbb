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
//! `FileDescriptorStoreMax=`) and serves it as a held one; it is
//! restartable only when the manager says it keeps fds (`$FDSTORE`).
//! Started again with that fd in `$LISTEN_FDS`, it takes it over as
//! `--held` does.
//!
//! It sits on the swap path, so it locks its memory, marks itself an I/O
//! flusher, leaves every memory cgroup (the job that swaps is limited, not
//! its pager) and is exempt from the OOM killer.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use pager_client::config::DeviceConfig;
use pager_client::device::Device;
use pager_fuse::fdstore::{self, Stored};
use pager_fuse::handover::{self, Request};
use pager_fuse::{Mount, Options, Transport};
use pagerctl::attach::record::{frontend_info, ServeInfo, StateLayout};

use crate::serving::{Buffer, DeviceBackend, Gate};
use crate::{probe, procs, sys};

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
    /// The write-back buffer: swap-outs acknowledged once buffered and
    /// sent to the donors in the background in batches (0: none; a
    /// restartable device has none; pagerctl(1) PERFORMANCE).
    #[arg(long, default_value = DEFAULT_WRITEBACK, value_parser = parse_size, value_name = "SIZE")]
    writeback_buffer: u64,
    /// Acknowledge writes only once they are on the donors, with no
    /// buffer, as a restartable device does (attach sets it for a block
    /// device: what it acknowledged survives a crash of this process and a
    /// re-attach).
    #[arg(long)]
    writeback_ack_late: bool,
}

/// `--writeback-buffer`'s default (pagerctl(1) PERFORMANCE says why).
pub const DEFAULT_WRITEBACK: &str = "8M";

fn parse_size(s: &str) -> Result<u64, String> {
    netpager_util::parse_size(s).map_err(|e| e.to_string())
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
        fdstore::ListenFds::claim()
            .and_then(|mut fds| fds.take(FDSTORE_NAME))
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
    // Restartable once the connection is known to outlive this process.
    let mut restartable = a.held || stored.is_some();
    // No buffer wherever the connection may outlive this process
    // (serving.rs; a stored connection counts before the service manager
    // says it keeps it) or a block device's data must: a write is then
    // acknowledged once on the donors.
    let late = restartable || store_in.is_some() || a.writeback_ack_late;
    let buffer = (a.writeback_buffer > 0 && !late)
        .then(|| Buffer::start(&device, a.writeback_buffer))
        .transpose()
        .context("cannot start the write-back buffer's drainers")?;
    let backend = DeviceBackend {
        device: device.clone(),
        gate: gate.clone(),
        buffer: buffer.clone(),
    };
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
        let fdstore_max = std::env::var("FDSTORE").ok();
        match fdstore::store(&notify, fdstore_max.as_deref(), FDSTORE_NAME, &keep) {
            Ok(Stored::Kept { max }) => {
                restartable = true;
                tracing::info!(
                    "gave the FUSE connection to the service manager's fd store as {FDSTORE_NAME} (it keeps up to {max} fds: FDSTORE={max})"
                )
            }
            Ok(Stored::NotKnownKept) => tracing::warn!(
                "sent the FUSE connection to NOTIFY_SOCKET={notify}, but it is NOT known to be kept: FDSTORE is not set (the service manager keeps no fds for this unit, or is systemd before 254, which does not say: set FileDescriptorStoreMax=1, and on systemd before 254 Environment=FDSTORE=1 too); if this process dies, the device is lost, and SIGUSR1 does not hand over"
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
    let (held, to_flush, buf) = (restartable, device.clone(), buffer.clone());
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || on_signals(&stopper, held, &gate, &to_flush, buf.as_deref()))
        .context("cannot start the signal thread")?;
    let served = mount.wait();
    let _ = std::fs::remove_file(layout.serve_json());
    // A detach: every acknowledged write reaches the donors before the
    // device's final flush.
    if let Some(b) = &buffer {
        if let Err(e) = b.drain() {
            tracing::error!("draining the write-back buffer at unmount: {e}");
        }
    }
    drop(device);
    let left = netpager_nbd::wait_given_up_ended(netpager_nbd::EXIT_WAIT);
    if left > 0 {
        tracing::warn!(
            "closing {left} connections given up on donors that have not finished answering them: an nbdkit before 1.33.10 may abort"
        );
    }
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
fn hand_over(gate: &Gate, device: &Device, buffer: Option<&Buffer>) -> ! {
    let t0 = Instant::now();
    if !gate.close_and_drain(DRAIN_LIMIT) {
        tracing::warn!(
            "requests still running after {DRAIN_LIMIT:?}: the next process answers them again"
        );
    }
    if let Some(Err(e)) = buffer.map(Buffer::drain) {
        tracing::warn!("draining the write-back buffer before the hand-over: {e}");
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

fn on_signals(
    mountpoint: &Path,
    held: bool,
    gate: &Gate,
    device: &Device,
    buffer: Option<&Buffer>,
) {
    loop {
        match sys::wait_stop_signal() {
            libc::SIGUSR1 if held => hand_over(gate, device, buffer),
            libc::SIGUSR1 => tracing::warn!(
                "SIGUSR1: not restartable (attach --restartable, or a service manager that keeps the connection: FDSTORE)"
            ),
            // Unmounted here while the connection lives on (another mount
            // namespace holds a copy of the mount, or detach unmounted it
            // lazily while a process still used it): no request will end
            // the threads. A holder exits after this process.
            sig if !probe::is_mounted(mountpoint) => {
                tracing::info!(
                    "signal {sig}: {} is unmounted here: exiting",
                    mountpoint.display()
                );
                hand_over(gate, device, buffer)
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
