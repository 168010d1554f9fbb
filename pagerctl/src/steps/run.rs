//! Each attach step done, and recorded (`super::push`) as soon as there is
//! something to undo.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use pagerctl::attach::commands;
use pagerctl::attach::record::{HolderInfo, ServeInfo, StateLayout};
use pagerctl::attach::{AttachRecord, Step, Via};

use netpager_nbd::Connection;

use super::spawn::{keeper_child, spawn_detached, spawn_watched, wait_ready};
use super::{push, Plan};
use crate::probe::{free_nbd_device, is_mounted};
use crate::procs;

/// Connects the kernel to the client's nbdkit: kernel nbd, or nbdfuse and
/// a loop device.
pub(super) fn kernel_side_of_nbd(plan: &Plan, record: &mut AttachRecord) -> Result<PathBuf> {
    let layout = &plan.layout;
    Ok(match plan.via {
        Via::NbdClient => {
            let device = free_nbd_device()?;
            let cmd = commands::nbd_client_command(
                &layout.socket(),
                &device,
                &plan.export,
                4096,
                plan.swap.is_some(),
            );
            procs::run(&cmd)?;
            push(
                layout,
                record,
                Step::NbdClient {
                    device: device.clone(),
                },
            )?;
            device
        }
        Via::Nbdfuse | Via::Auto => {
            start_nbdfuse(plan, record)?;
            loop_device(layout, record, layout.fuse_file())?
        }
    })
}

/// A restartable kernel nbd device: `pagerctl hold-nbd` runs nbdkit and
/// connects a free /dev/nbdN to it over netlink; waits until it has.
pub(super) fn start_nbd_holder(plan: &Plan, record: &mut AttachRecord) -> Result<PathBuf> {
    let layout = &plan.layout;
    let device = free_nbd_device()?;
    let _ = std::fs::remove_file(layout.holder_json());
    let me = std::env::current_exe().context("cannot find pagerctl's own path")?;
    let (request, dead_conn) = plan.nbd_timeouts;
    let cmd = commands::hold_nbd_command(
        &me,
        &layout.dir,
        &device,
        &plan.plugin,
        &plan.export,
        request,
        dead_conn,
    );
    let log = layout.serve_log();
    let what = "pagerctl hold-nbd";
    let (child, pid, started) = spawn_watched(&cmd, &log, what)?;
    push(
        layout,
        record,
        Step::NbdHolder {
            pid,
            started,
            device: device.clone(),
        },
    )?;
    let holder_json = layout.holder_json();
    wait_ready(child, what, &log, plan.start_timeout, || {
        HolderInfo::load(&holder_json).is_some_and(|h| h.ready_pid.is_some())
    })?;
    Ok(device)
}

/// A loop device over `file`. Direct I/O keeps swapped pages out of the
/// FUSE file's page cache; buffered I/O where the kernel refuses it.
pub(super) fn loop_device(
    layout: &StateLayout,
    record: &mut AttachRecord,
    file: PathBuf,
) -> Result<PathBuf> {
    let out = procs::run(&commands::losetup_attach(&file, true)).or_else(|e| {
        tracing::warn!("loop device with direct I/O refused ({e:#}); using buffered I/O");
        procs::run(&commands::losetup_attach(&file, false))
    })?;
    let device = PathBuf::from(out.trim());
    if !device.starts_with("/dev/") {
        bail!("losetup printed {:?} instead of a device name", out.trim());
    }
    push(
        layout,
        record,
        Step::LoopDevice {
            device: device.clone(),
            file,
        },
    )?;
    Ok(device)
}

/// Turns the kernel's FUSE over io_uring switch on if it is off (it is
/// read when a FUSE file system is mounted), recording the old value.
pub(super) fn enable_uring(layout: &StateLayout, record: &mut AttachRecord) -> Result<()> {
    let path = PathBuf::from(pager_fuse::ENABLE_URING);
    let old = std::fs::read_to_string(&path)
        .with_context(|| {
            format!(
                "this kernel has no FUSE over io_uring ({} is missing; it needs Linux 6.14+ with CONFIG_FUSE_IO_URING): use --frontend fuse",
                path.display()
            )
        })?
        .trim()
        .to_string();
    if old == "Y" {
        return Ok(());
    }
    std::fs::write(&path, "Y").with_context(|| format!("cannot write Y to {}", path.display()))?;
    tracing::info!(
        "turned FUSE over io_uring on ({} was {old}); detach turns it back",
        path.display()
    );
    push(layout, record, Step::UringSwitch { path, old })
}

/// The FUSE mount point (created) and its file, refused while something is
/// still mounted there (an earlier `what`, undone with `unmount`).
fn free_fuse_dir(layout: &StateLayout, what: &str, unmount: &str) -> Result<(PathBuf, PathBuf)> {
    let mountpoint = layout.fuse_dir();
    std::fs::create_dir_all(&mountpoint)
        .with_context(|| format!("cannot create {}", mountpoint.display()))?;
    if is_mounted(&mountpoint) {
        bail!(
            "{} is still mounted (an earlier {what}?): run pagerctl detach, or {unmount} it",
            mountpoint.display()
        );
    }
    Ok((mountpoint, layout.fuse_file()))
}

/// Starts `pagerctl serve` (this same program) serving the device on its
/// own FUSE mount, log in the state directory, and waits until it serves.
/// A restartable device gets `pagerctl hold` instead, which mounts and
/// starts `pagerctl serve --held`; the step records the holder.
pub(super) fn start_server(plan: &Plan, record: &mut AttachRecord) -> Result<()> {
    let layout = &plan.layout;
    let (mountpoint, file) = free_fuse_dir(layout, "server", "umount")?;
    let info_path = layout.serve_json();
    let _ = std::fs::remove_file(&info_path);
    let me = std::env::current_exe().context("cannot find pagerctl's own path")?;
    let (cmd, what) = if plan.restartable {
        let _ = std::fs::remove_file(layout.holder_json());
        (
            commands::hold_command(&me, &layout.dir, &plan.serve),
            "pagerctl hold",
        )
    } else {
        let cmd = commands::plain_serve_command(&me, &layout.dir, plan.frontend, &plan.serve);
        (cmd, "pagerctl serve")
    };
    let log = layout.serve_log();
    let (child, pid, started) = spawn_watched(&cmd, &log, what)?;
    push(
        layout,
        record,
        Step::FuseServer {
            pid,
            started,
            mountpoint: mountpoint.clone(),
            file: file.clone(),
            transport: plan.frontend.to_string(),
            restartable: plan.restartable,
        },
    )?;
    let holder_json = layout.holder_json();
    let restartable = plan.restartable;
    wait_ready(child, what, &log, plan.start_timeout, || {
        ServeInfo::load(&info_path).is_some_and(|i| {
            if restartable {
                HolderInfo::load(&holder_json).is_some_and(|h| h.serve_pid == Some(i.pid))
            } else {
                i.pid == pid
            }
        }) && is_mounted(&mountpoint)
            && file.metadata().is_ok_and(|m| m.len() > 0)
    })?;
    let info = ServeInfo::load(&info_path).context("serve.json vanished")?;
    if let Some(why) = &info.fallback {
        tracing::warn!("serving over classic /dev/fuse: {why}");
    }
    if let Some(Step::FuseServer { transport, .. }) = record.steps.last_mut() {
        *transport = info.transport;
    }
    record.save(&layout.attach_json())?;
    Ok(())
}

/// Shortens the device's request queue. Reclaim in a memory cgroup v1 does
/// not wait for swap writeback: when a deep queue lets most of a cgroup's
/// pages be under writeback at once (the swap device being slower than the
/// job), reclaim finds nothing to free and the job is OOM-killed. With few
/// requests in flight, the job waits in submission instead. The old depth
/// is recorded: the kernel keeps the setting for the device's next user.
pub(super) fn set_queue_depth(
    layout: &StateLayout,
    record: &mut AttachRecord,
    device: &Path,
    depth: u32,
) -> Result<()> {
    let path = commands::nr_requests_path(device);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let old: u32 = text
        .trim()
        .parse()
        .with_context(|| format!("{}: {:?} is not a number", path.display(), text.trim()))?;
    if old == depth {
        return Ok(());
    }
    std::fs::write(&path, depth.to_string())
        .with_context(|| format!("cannot write {depth} to {}", path.display()))?;
    push(
        layout,
        record,
        Step::QueueDepth {
            device: device.to_path_buf(),
            old,
            new: depth,
        },
    )
}

/// Starts nbdkit with the client plugin under its `setsid` keeper (see
/// `commands::nbdkit_command`), log in the state directory, and waits until
/// it answers.
pub(super) fn start_nbdkit(plan: &Plan, record: &mut AttachRecord) -> Result<()> {
    let layout = &plan.layout;
    let socket = layout.socket();
    let pidfile = layout.nbdkit_pidfile();
    // Left over from a crash (the record was empty, so nothing of ours runs).
    for stale in [&socket, &pidfile] {
        match std::fs::remove_file(stale) {
            Ok(()) => tracing::info!("removed stale {}", stale.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("cannot remove stale {}", stale.display()))
            }
        }
    }
    let cmd = commands::nbdkit_command(
        Path::new("nbdkit"),
        &plan.plugin,
        &socket,
        &pidfile,
        &layout.dir,
    );
    let log = layout.nbdkit_log();
    let mut keeper = spawn_detached(&cmd, &log)?;
    let keeper_pid = keeper.id();
    procs::protect_from_oom(keeper_pid, "nbdkit's keeper");
    let pid = keeper_child(&mut keeper, &log)?;
    procs::protect_from_oom(pid, "nbdkit");
    let gone = || {
        anyhow!(
            "nbdkit (pid {pid}) exited at once; log {}:\n{}",
            log.display(),
            procs::log_tail(&log, 20)
        )
    };
    let started = procs::start_ticks(pid).ok_or_else(gone)?;
    let keeper_started = procs::start_ticks(keeper_pid).ok_or_else(gone)?;
    push(
        layout,
        record,
        Step::Nbdkit {
            pid,
            started,
            keeper_pid,
            keeper_started,
            socket: socket.clone(),
            pidfile: pidfile.clone(),
        },
    )?;
    wait_ready(keeper, "nbdkit", &log, plan.start_timeout, || {
        procs::read_pidfile(&pidfile) == Some(pid)
            && Connection::probe_unix(&socket, Duration::from_secs(2)).is_ok()
    })
}

/// Starts nbdfuse presenting the export as the state directory's
/// `fuse/device`, and waits until the file is there.
fn start_nbdfuse(plan: &Plan, record: &mut AttachRecord) -> Result<()> {
    let layout = &plan.layout;
    let (mountpoint, file) = free_fuse_dir(layout, "nbdfuse", "fusermount3 -u")?;
    let pidfile = layout.nbdfuse_pidfile();
    let _ = std::fs::remove_file(&pidfile);
    let cmd = commands::nbdfuse_command(&file, &layout.socket(), &plan.export, &pidfile);
    let log = layout.nbdfuse_log();
    let (child, pid, started) = spawn_watched(&cmd, &log, "nbdfuse")?;
    procs::protect_from_oom(pid, "nbdfuse");
    push(
        layout,
        record,
        Step::Nbdfuse {
            pid,
            started,
            mountpoint: mountpoint.clone(),
            file: file.clone(),
            pidfile: pidfile.clone(),
        },
    )?;
    wait_ready(child, "nbdfuse", &log, plan.start_timeout, || {
        pidfile.exists() && is_mounted(&mountpoint) && file.metadata().is_ok_and(|m| m.len() > 0)
    })
}
