//! Undoing attach steps, newest first: on detach, or when an attach
//! fails half-way.
//!
//! Everything that waits on the device's processes (a flush through the
//! device, their exit after an unmount or SIGTERM, nbdkit's flush) waits
//! until one deadline at most (`detach --timeout`). A flush the processes
//! do not answer by then means they hang (stopped, say, or stuck): detach
//! kills every process the attach started (SIGKILL, by the pids it
//! recorded), says which, and undoes the rest, which then has nothing to
//! wait for. swapoff is never a reason to kill: the pages it reads back
//! belong to running processes; it is given up (and the swap area left on)
//! when it makes no progress past the deadline.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use pagerctl::attach::commands;
use pagerctl::attach::record::{HolderInfo, StateLayout};
use pagerctl::attach::{AttachRecord, Step};

use netpager_nbd::Connection;

use crate::probe::{holders, is_mounted, loop_backing, mount_users, swap_active, swap_used};
use crate::procs;

/// How long the rest of a detach may take once the processes were killed:
/// the kernel lets go of a device whose server is gone at once.
const AFTER_KILL: Duration = Duration::from_secs(15);

/// How long swapoff may go without taking a page back, past the deadline,
/// before it is given up.
const SWAPOFF_STALL: Duration = Duration::from_secs(5);

/// When the waiting ends.
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    limit: Duration,
}

impl Deadline {
    fn after(limit: Duration) -> Deadline {
        Deadline {
            at: Instant::now() + limit,
            limit,
        }
    }

    fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    fn passed(&self) -> bool {
        Instant::now() >= self.at
    }
}

/// A wait on the device's processes that the deadline ended: they do not
/// answer.
#[derive(Debug)]
struct NotAnswering(String);

impl std::fmt::Display for NotAnswering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotAnswering {}

/// Undoes every recorded step, newest first, saving the record after each
/// so that a failed detach can be resumed. Stops at the first failure: going
/// on (say, stopping nbdkit after swapoff failed) would lose data. Waits on
/// the device's processes end at `limit` from now; when they do not answer
/// by then, they are killed (module documentation).
pub fn undo_all(layout: &StateLayout, record: &mut AttachRecord, limit: Duration) -> Result<()> {
    let mut deadline = Deadline::after(limit);
    let mut killed = false;
    while let Some(step) = record.steps.last().cloned() {
        match undo(&step, layout, &record.export, deadline) {
            Ok(()) => {}
            Err(e) if !killed && e.downcast_ref::<NotAnswering>().is_some() => {
                let gone = kill_started(&record.steps);
                tracing::warn!(
                    "{e:#} within the detach deadline ({limit:?}): killed {} with SIGKILL; undoing the rest",
                    if gone.is_empty() {
                        "nothing (its processes were gone)".to_string()
                    } else {
                        gone.join(", ")
                    }
                );
                killed = true;
                deadline = Deadline::after(AFTER_KILL);
                continue;
            }
            Err(e) => return Err(e.context(format!("undoing {}", step.describe()))),
        }
        tracing::info!("undone: {}", step.describe());
        record.steps.pop();
        record.save(&layout.attach_json())?;
    }
    std::fs::remove_file(layout.attach_json())
        .with_context(|| format!("cannot remove {}", layout.attach_json().display()))?;
    // Left by a server (or holder) that was killed.
    let _ = std::fs::remove_file(layout.serve_json());
    let _ = std::fs::remove_file(layout.holder_json());
    let _ = std::fs::remove_file(layout.holder_socket());
    let fuse = layout.fuse_dir();
    if fuse.is_dir() && !is_mounted(&fuse) {
        let _ = std::fs::remove_dir(&fuse);
    }
    Ok(())
}

/// Kills every process the steps recorded (and their children: a holder's
/// serving process, the keeper's nbdkit); returns what was killed.
fn kill_started(steps: &[Step]) -> Vec<String> {
    let mut killed = Vec::new();
    for step in steps.iter().rev() {
        let procs: Vec<(u32, u64, &str)> = match step {
            Step::FuseServer {
                pid,
                started,
                restartable,
                ..
            } => vec![(
                *pid,
                *started,
                if *restartable {
                    "pagerctl hold"
                } else {
                    "pagerctl serve"
                },
            )],
            Step::NbdHolder { pid, started, .. } => vec![(*pid, *started, "pagerctl hold-nbd")],
            Step::Nbdfuse { pid, started, .. } => vec![(*pid, *started, "nbdfuse")],
            Step::Nbdkit {
                pid,
                started,
                keeper_pid,
                keeper_started,
                ..
            } => vec![
                (*keeper_pid, *keeper_started, "nbdkit's keeper (setsid)"),
                (*pid, *started, "nbdkit"),
            ],
            _ => Vec::new(),
        };
        for (pid, started, what) in procs {
            killed.extend(procs::kill_tree(pid, started, what));
        }
    }
    killed
}

/// Who holds `device` ([`holders`]) once they have had `limit` to let go
/// (a udev probe opens a device for a moment), saying whom it waits for.
fn wait_unheld(device: &Path, limit: Duration) -> Vec<String> {
    let start = Instant::now();
    let mut said = false;
    loop {
        let held = holders(device);
        if held.is_empty() || start.elapsed() >= limit {
            return held;
        }
        if !said {
            tracing::info!("waiting for {}: {}", device.display(), held.join(", "));
            said = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn undo(step: &Step, layout: &StateLayout, export: &str, deadline: Deadline) -> Result<()> {
    match step {
        Step::Swap { device, .. } => {
            if swap_active(device) {
                swapoff(device, deadline)?;
            }
        }
        Step::LoopDevice { device, file } => {
            if loop_backing(device).as_deref() == Some(file.as_path()) {
                let held = wait_unheld(device, deadline.left().min(Duration::from_secs(5)));
                if !held.is_empty() {
                    bail!(
                        "{} is in use: {}; stop that (close it, umount), then run pagerctl detach again",
                        device.display(),
                        held.join(", ")
                    );
                }
                flush_device(device, deadline)?;
                procs::run(&commands::losetup_detach(device))?;
                // The kernel lets go of the backing file asynchronously;
                // unmounting FUSE before that fails with EBUSY.
                while loop_backing(device).as_deref() == Some(file.as_path()) {
                    if deadline.passed() {
                        bail!(
                            "{} still holds {} {:?} after losetup --detach ({})",
                            device.display(),
                            file.display(),
                            deadline.limit,
                            holders(device).join(", ")
                        );
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        Step::QueueDepth { device, old, .. } => {
            let path = commands::nr_requests_path(device);
            // Gone with its device: nothing to give back.
            if path.exists() {
                std::fs::write(&path, old.to_string())
                    .with_context(|| format!("cannot write {old} to {}", path.display()))?;
            }
        }
        Step::NbdClient { device } => {
            let name = device
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if Path::new(&format!("/sys/block/{name}/pid")).exists() {
                flush_device(device, deadline)?;
                procs::run(&commands::nbd_client_disconnect(device))?;
            }
        }
        Step::NbdHolder {
            pid,
            started,
            device,
        } => {
            let index = commands::nbd_index(device)?;
            let connected = Path::new(&format!("/sys/block/nbd{index}/pid")).exists();
            if connected {
                flush_device(device, deadline)?;
            }
            // The holder disconnects the device, flushes and stops nbdkit.
            let nbdkit = HolderInfo::load(&layout.holder_json())
                .and_then(|h| Some((h.serve_pid?, h.serve_started?)));
            procs::stop(*pid, *started, "pagerctl hold-nbd", deadline.left())?;
            // A holder that was gone already did neither.
            if Path::new(&format!("/sys/block/nbd{index}/pid")).exists() {
                netpager_nbd::kernel::NbdNetlink::open()
                    .and_then(|mut k| k.disconnect(index))
                    .with_context(|| format!("cannot disconnect {}", device.display()))?;
            }
            if let Some((nbdkit, nbdkit_started)) = nbdkit {
                if procs::owned(nbdkit, nbdkit_started) {
                    flush_nbdkit(&layout.socket(), export, deadline);
                    procs::stop(nbdkit, nbdkit_started, "nbdkit", deadline.left())?;
                }
            }
        }
        Step::Nbdfuse {
            pid,
            started,
            mountpoint,
            pidfile,
            ..
        } => {
            unmount(mountpoint, deadline, || {
                procs::run(&commands::fuse_unmount(mountpoint)).map(drop)
            });
            // nbdfuse exits by itself once unmounted.
            if !procs::wait_gone(*pid, *started, deadline.left()) {
                procs::stop(*pid, *started, "nbdfuse", Duration::from_secs(5))?;
            }
            let _ = std::fs::remove_file(pidfile);
        }
        Step::UringSwitch { path, old } => {
            std::fs::write(path, old)
                .with_context(|| format!("cannot write {old} back to {}", path.display()))?;
        }
        Step::FuseServer {
            pid,
            started,
            mountpoint,
            restartable,
            ..
        } => {
            let holder_json = mountpoint.with_file_name("holder.json");
            // A server that died leaves a dead connection: detach it.
            let lazy = !procs::owned(*pid, *started);
            unmount(mountpoint, deadline, || {
                pager_fuse::unmount(mountpoint, lazy).map_err(anyhow::Error::from)
            });
            // The server exits by itself once unmounted, its map synced
            // (and a holder right after its serving process). Not when the
            // connection lives on (another mount namespace keeps a copy of
            // the mount, or a process used it when it was detached
            // lazily): a restartable device's serving process is then
            // told to exit, and a plain one is at the deadline.
            if *restartable && !procs::wait_gone(*pid, *started, Duration::from_secs(2)) {
                if let Some(serving) = HolderInfo::load(&holder_json).and_then(|h| h.serve_pid) {
                    tracing::info!("asking serving process {serving} to exit");
                    let _ = crate::sys::signal(serving, libc::SIGTERM);
                }
            }
            if !procs::wait_gone(*pid, *started, deadline.left()) {
                let what = if *restartable {
                    "pagerctl hold"
                } else {
                    "pagerctl serve"
                };
                procs::stop(*pid, *started, what, Duration::from_secs(5))?;
            }
        }
        Step::Nbdkit {
            pid,
            started,
            keeper_pid,
            keeper_started,
            socket,
            pidfile,
        } => {
            // Whatever any NBD client wrote (the kernel side flushed its own
            // writes already) reaches the donors and the map before nbdkit
            // goes. A failed flush is no reason to keep a dead attach.
            if procs::owned(*pid, *started) {
                flush_nbdkit(socket, export, deadline);
            }
            procs::stop(*pid, *started, "nbdkit", deadline.left())?;
            // The keeper exits as soon as it has reaped nbdkit.
            if !procs::wait_gone(*keeper_pid, *keeper_started, Duration::from_secs(5)) {
                procs::stop(
                    *keeper_pid,
                    *keeper_started,
                    "nbdkit's keeper (setsid)",
                    Duration::from_secs(5),
                )?;
            }
            for f in [socket, pidfile] {
                let _ = std::fs::remove_file(f);
            }
        }
    }
    Ok(())
}

/// Unmounts `mountpoint` with `unmount`, again while it is busy (for a
/// moment after a loop device let go of its file), until the deadline;
/// then detaches it lazily, naming what still uses it (a process that
/// opened the directory, say): the mount is gone from here at once, and
/// its server is told to exit as after any unmount.
fn unmount(mountpoint: &Path, deadline: Deadline, mut unmount: impl FnMut() -> Result<()>) {
    while is_mounted(mountpoint) {
        match unmount() {
            Ok(()) => return,
            Err(e) if deadline.passed() => {
                let users = mount_users(mountpoint);
                tracing::warn!(
                    "cannot unmount {} within the detach deadline ({:?}): {e:#}; used by {}; detaching it lazily",
                    mountpoint.display(),
                    deadline.limit,
                    if users.is_empty() {
                        "nothing this namespace shows".to_string()
                    } else {
                        users.join(", ")
                    }
                );
                if let Err(e) = pager_fuse::unmount(mountpoint, true) {
                    tracing::warn!("lazy unmount of {}: {e}", mountpoint.display());
                }
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Flushes the device's write cache down to its server: fsync on a block
/// device sends a flush request, which the server passes to its donors.
/// An error (a server gone: the request fails at once) is only said; a
/// flush still unanswered at the deadline is [`NotAnswering`] (the thread
/// doing it is left to end when the server does).
fn flush_device(device: &Path, deadline: Deadline) -> Result<()> {
    let path = device.to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("flush".into())
        .spawn(move || {
            let flushed = std::fs::File::open(&path)
                .with_context(|| format!("cannot open {} to flush it", path.display()))
                .and_then(|f| {
                    f.sync_all()
                        .with_context(|| format!("flushing {}", path.display()))
                });
            let _ = tx.send(flushed);
        })
        .context("cannot start a thread to flush the device")?;
    match rx.recv_timeout(deadline.left()) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            tracing::warn!("{e:#} (the device's server may be gone)");
            Ok(())
        }
        Err(_) => Err(anyhow!(NotAnswering(format!(
            "flushing {} was not answered",
            device.display()
        )))),
    }
}

/// Whatever any NBD client wrote (the kernel side flushed its own writes
/// already) reaches the donors and the map before nbdkit goes; the client
/// plugin advertises multi-conn, so one connection's flush covers them
/// all. A failed flush is no reason to keep a dead attach: only said.
fn flush_nbdkit(socket: &Path, export: &str, deadline: Deadline) {
    // At least a moment, even past the deadline: a live nbdkit answers.
    let limit = deadline.left().max(Duration::from_secs(1));
    let flushed = Connection::connect_unix(socket, export, limit).and_then(|mut c| c.flush(limit));
    if let Err(e) = flushed {
        tracing::warn!(
            "flushing {} before stopping nbdkit: {e:#}",
            socket.display()
        );
    }
}

/// swapoff, which reads every page back through the device: waited for
/// while it makes progress, or until the deadline; given up (killed, the
/// swap area left on) once it took no page back for [`SWAPOFF_STALL`]
/// past it. Never a reason to kill the device's processes: the pages
/// belong to running processes.
fn swapoff(device: &Path, deadline: Deadline) -> Result<()> {
    let mut used = swap_used(device);
    let mut moved = Instant::now();
    let mut stalled = false;
    let done = procs::run_while(&commands::swapoff(device), || {
        let now = swap_used(device);
        if now != used {
            used = now;
            moved = Instant::now();
        }
        stalled = deadline.passed() && moved.elapsed() >= SWAPOFF_STALL;
        !stalled
    });
    match done {
        Ok(_) => Ok(()),
        Err(e) if stalled => Err(e.context(format!(
            "swapoff took no page back for {SWAPOFF_STALL:?} past the detach deadline ({:?}); the swap area stays on ({} KiB in use) and nothing was killed, since its pages belong to running processes: see whether the device's serving process answers (pagerctl status)",
            deadline.limit,
            swap_used(device).unwrap_or(0)
        ))),
        Err(e) => Err(e),
    }
}
