//! Undoing attach steps, newest first: on detach, or when an attach
//! fails half-way.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use pagerctl::attach::commands;
use pagerctl::attach::record::{HolderInfo, StateLayout};
use pagerctl::attach::{AttachRecord, Step};

use netpager_nbd::Connection;

use crate::probe::{is_mounted, loop_backing, swap_active};
use crate::procs;

/// Undoes every recorded step, newest first, saving the record after each
/// so that a failed detach can be resumed. Stops at the first failure: going
/// on (say, stopping nbdkit after swapoff failed) would lose data.
pub fn undo_all(layout: &StateLayout, record: &mut AttachRecord, grace: Duration) -> Result<()> {
    while let Some(step) = record.steps.last().cloned() {
        undo(&step, layout, &record.export, grace)
            .with_context(|| format!("undoing {}", step.describe()))?;
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

fn undo(step: &Step, layout: &StateLayout, export: &str, grace: Duration) -> Result<()> {
    match step {
        Step::Swap { device, .. } => {
            if swap_active(device) {
                procs::run(&commands::swapoff(device))?;
            }
        }
        Step::LoopDevice { device, file } => {
            if loop_backing(device).as_deref() == Some(file.as_path()) {
                if let Err(e) = flush_device(device) {
                    tracing::warn!("{e:#} (the device's server may be gone)");
                }
                procs::run(&commands::losetup_detach(device))?;
                // The kernel lets go of the backing file asynchronously;
                // unmounting FUSE before that fails with EBUSY.
                let start = Instant::now();
                while loop_backing(device).as_deref() == Some(file.as_path()) {
                    if start.elapsed() > grace {
                        bail!(
                            "{} still holds {} {grace:?} after losetup --detach",
                            device.display(),
                            file.display()
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
                if let Err(e) = flush_device(device) {
                    tracing::warn!("{e:#} (the device's server may be gone)");
                }
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
                if let Err(e) = flush_device(device) {
                    tracing::warn!("{e:#} (the device's server may be gone)");
                }
            }
            // The holder disconnects the device, flushes and stops nbdkit.
            let nbdkit = HolderInfo::load(&layout.holder_json())
                .and_then(|h| Some((h.serve_pid?, h.serve_started?)));
            procs::stop(*pid, *started, "pagerctl hold-nbd", grace)?;
            // A holder that was gone already did neither.
            if Path::new(&format!("/sys/block/nbd{index}/pid")).exists() {
                netpager_nbd::kernel::NbdNetlink::open()
                    .and_then(|mut k| k.disconnect(index))
                    .with_context(|| format!("cannot disconnect {}", device.display()))?;
            }
            if let Some((nbdkit, nbdkit_started)) = nbdkit {
                if procs::owned(nbdkit, nbdkit_started) {
                    let flushed = Connection::connect_unix(&layout.socket(), export, grace)
                        .and_then(|mut c| c.flush(grace));
                    if let Err(e) = flushed {
                        tracing::warn!("flushing nbdkit before stopping it: {e:#}");
                    }
                    procs::stop(nbdkit, nbdkit_started, "nbdkit", grace)?;
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
            let start = Instant::now();
            while is_mounted(mountpoint) {
                match procs::run(&commands::fuse_unmount(mountpoint)) {
                    Ok(_) => break,
                    Err(e) if start.elapsed() > grace => return Err(e),
                    // Busy for a moment after the loop device let go.
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
            // nbdfuse exits by itself once unmounted.
            if !procs::wait_gone(*pid, *started, grace) {
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
            let start = Instant::now();
            while is_mounted(mountpoint) {
                // A server that died leaves a dead connection: detach it.
                let lazy = !procs::owned(*pid, *started);
                match pager_fuse::unmount(mountpoint, lazy) {
                    Ok(()) => break,
                    Err(e) if start.elapsed() > grace => {
                        return Err(e)
                            .with_context(|| format!("cannot unmount {}", mountpoint.display()))
                    }
                    // Busy for a moment after the loop device let go.
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
            // The server exits by itself once unmounted, its map synced
            // (and a holder right after its serving process). Not when
            // another mount namespace keeps a copy of the mount (the
            // connection lives on): a restartable device's serving process
            // is then told to exit.
            if *restartable && !procs::wait_gone(*pid, *started, Duration::from_secs(2)) {
                if let Some(serving) = HolderInfo::load(&holder_json).and_then(|h| h.serve_pid) {
                    tracing::info!("asking serving process {serving} to exit");
                    let _ = crate::sys::signal(serving, libc::SIGTERM);
                }
            }
            if !procs::wait_gone(*pid, *started, grace) {
                procs::stop(*pid, *started, "pagerctl serve", Duration::from_secs(5))?;
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
                // The client plugin advertises multi-conn, so one
                // connection's flush covers them all.
                let flushed = Connection::connect_unix(socket, export, grace)
                    .and_then(|mut c| c.flush(grace));
                if let Err(e) = flushed {
                    tracing::warn!(
                        "flushing {} before stopping nbdkit: {e:#}",
                        socket.display()
                    );
                }
            }
            procs::stop(*pid, *started, "nbdkit", grace)?;
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

/// Flushes the device's write cache down to nbdkit: fsync on a block device
/// sends a flush request, which the client plugin passes to its donors.
fn flush_device(device: &Path) -> Result<()> {
    let f = std::fs::File::open(device)
        .with_context(|| format!("cannot open {} to flush it", device.display()))?;
    f.sync_all()
        .with_context(|| format!("flushing {}", device.display()))
}
