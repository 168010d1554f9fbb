//! The attach steps of `pagerctl::attach` carried out (for `pagerctl
//! attach` and `detach`): each recorded in `attach.json` as it is done,
//! and undone in reverse (on detach, or when an attach fails half-way).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use pagerctl::attach::commands;
use pagerctl::attach::record::{HolderInfo, ServeInfo, StateLayout};
use pagerctl::attach::{AttachRecord, Frontend, Step, Via};

use netpager_nbd::Connection;
use pager_client::status::ClientStatus;

use crate::devices::{is_mounted, loop_backing, swap_active};
use crate::procs;

/// What the attach needs beyond the device configuration.
pub struct Plan {
    pub layout: StateLayout,
    pub plugin: PathBuf,
    pub export: String,
    /// Resolved: never `Auto`.
    pub frontend: Frontend,
    pub via: Via,
    /// `pagerctl serve`'s threads (per queue with io_uring).
    pub serve_threads: usize,
    /// A holder keeps the FUSE connection; serving processes may come and go.
    pub restartable: bool,
    /// A restartable kernel nbd device's request and dead-conn timeouts.
    pub nbd_timeouts: (Duration, Duration),
    /// Swap at this priority.
    pub swap: Option<i32>,
    /// Swap with `--discard=pages`.
    pub swap_discard: bool,
    pub start_timeout: Duration,
    pub queue_depth: Option<u32>,
}

/// Runs an attach; on failure undoes whatever it had done and returns the
/// first error. Returns the block device.
pub fn attach(plan: &Plan) -> Result<PathBuf> {
    let path = plan.layout.attach_json();
    let mut record = AttachRecord::new(plan.frontend, plan.via, &plan.export);
    record.save(&path)?;
    match run_steps(plan, &mut record) {
        Ok(device) => Ok(device),
        Err(e) => {
            tracing::error!("attach failed: {e:#}; undoing what was done");
            if let Err(undo) = undo_all(&plan.layout, &mut record, Duration::from_secs(30)) {
                return Err(e.context(format!(
                    "and undoing the attach failed too ({undo:#}); what is left is in {}",
                    path.display()
                )));
            }
            Err(e)
        }
    }
}

fn push(layout: &StateLayout, record: &mut AttachRecord, step: Step) -> Result<()> {
    tracing::info!("done: {}", step.describe());
    record.steps.push(step);
    record.save(&layout.attach_json())?;
    Ok(())
}

fn run_steps(plan: &Plan, record: &mut AttachRecord) -> Result<PathBuf> {
    let layout = &plan.layout;
    let device = match plan.frontend {
        Frontend::FuseUring | Frontend::Fuse => {
            if plan.frontend == Frontend::FuseUring {
                enable_uring(layout, record)?;
            }
            start_server(plan, record)?;
            loop_device(layout, record, layout.fuse_file())?
        }
        Frontend::Nbd if plan.restartable => start_nbd_holder(plan, record)?,
        Frontend::Nbd | Frontend::Auto => {
            start_nbdkit(plan, record)?;
            kernel_side_of_nbd(plan, record)?
        }
    };
    if let Some(depth) = plan.queue_depth {
        set_queue_depth(layout, record, &device, depth)?;
    }
    if let Some(priority) = plan.swap {
        // status.json is written as the device opened: donors that went
        // away since attach checked them mean no swap.
        if let Some(why) = ClientStatus::read(&layout.dir)
            .ok()
            .and_then(|s| s.cannot_place())
        {
            bail!("the device cannot place a unit: {why}; swap is not turned on");
        }
        procs::run(&commands::mkswap(&device, "netpager"))?;
        procs::run(&commands::swapon(&device, priority, plan.swap_discard))?;
        push(
            layout,
            record,
            Step::Swap {
                device: device.clone(),
                priority,
            },
        )?;
    }
    Ok(device)
}

/// Connects the kernel to the client's nbdkit: kernel nbd, or nbdfuse and
/// a loop device.
fn kernel_side_of_nbd(plan: &Plan, record: &mut AttachRecord) -> Result<PathBuf> {
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
fn start_nbd_holder(plan: &Plan, record: &mut AttachRecord) -> Result<PathBuf> {
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
fn loop_device(layout: &StateLayout, record: &mut AttachRecord, file: PathBuf) -> Result<PathBuf> {
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
fn enable_uring(layout: &StateLayout, record: &mut AttachRecord) -> Result<()> {
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
fn start_server(plan: &Plan, record: &mut AttachRecord) -> Result<()> {
    let layout = &plan.layout;
    let (mountpoint, file) = free_fuse_dir(layout, "server", "umount")?;
    let info_path = layout.serve_json();
    let _ = std::fs::remove_file(&info_path);
    let me = std::env::current_exe().context("cannot find pagerctl's own path")?;
    let (cmd, what) = if plan.restartable {
        let _ = std::fs::remove_file(layout.holder_json());
        (
            commands::hold_command(&me, &layout.dir, plan.serve_threads),
            "pagerctl hold",
        )
    } else {
        let mut cmd = commands::serve_command(&me, &layout.dir, plan.frontend);
        cmd.extend(["--threads".into(), plan.serve_threads.to_string()]);
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
fn set_queue_depth(
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
fn start_nbdkit(plan: &Plan, record: &mut AttachRecord) -> Result<()> {
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

/// The process `setsid --fork --wait` forked (nbdkit, once it has exec'd).
fn keeper_child(keeper: &mut std::process::Child, log: &Path) -> Result<u32> {
    let k = keeper.id();
    let start = Instant::now();
    loop {
        let children =
            std::fs::read_to_string(format!("/proc/{k}/task/{k}/children")).unwrap_or_default();
        if let Some(pid) = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
        {
            return Ok(pid);
        }
        if let Some(status) = keeper.try_wait()? {
            bail!(
                "nbdkit exited while starting ({status}); log {}:\n{}",
                log.display(),
                procs::log_tail(log, 20)
            );
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("setsid (pid {k}) did not start nbdkit within 10 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
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

/// Spawns a long-lived helper: stdin from /dev/null, stdout and stderr
/// appended to `log`, in its own process group so a terminal's Ctrl-C aimed
/// at pagerctl does not reach it.
fn spawn_detached(cmd: &[String], log: &Path) -> Result<std::process::Child> {
    let mut c = procs::logged_command(cmd, log)?;
    tracing::info!("starting {} (log {})", cmd.join(" "), log.display());
    c.process_group(0)
        // The service manager's fd store is for a `pagerctl serve` it runs
        // itself; what attach starts is attach's.
        .env_remove("NOTIFY_SOCKET")
        .spawn()
        .with_context(|| format!("cannot start {}", cmd[0]))
}

/// [`spawn_detached`], plus the child's pid and start time (for a record
/// step), failing with its log if it is gone at once.
fn spawn_watched(
    cmd: &[String],
    log: &Path,
    what: &str,
) -> Result<(std::process::Child, u32, u64)> {
    let child = spawn_detached(cmd, log)?;
    let pid = child.id();
    let started = procs::start_ticks(pid).ok_or_else(|| {
        anyhow!(
            "{what} (pid {pid}) exited at once; log {}:\n{}",
            log.display(),
            procs::log_tail(log, 20)
        )
    })?;
    Ok((child, pid, started))
}

/// Polls `ready` until it holds; fails early, with the log, if the child exits.
fn wait_ready(
    mut child: std::process::Child,
    what: &str,
    log: &Path,
    limit: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<()> {
    let start = Instant::now();
    loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("cannot watch {what}"))?
        {
            bail!(
                "{what} exited while starting ({status}); log {}:\n{}",
                log.display(),
                procs::log_tail(log, 20)
            );
        }
        if ready() {
            return Ok(());
        }
        if start.elapsed() > limit {
            bail!(
                "{what} did not become ready within {limit:?}; log {}:\n{}",
                log.display(),
                procs::log_tail(log, 20)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn free_nbd_device() -> Result<PathBuf> {
    let mut devs = Vec::new();
    for entry in std::fs::read_dir("/sys/block").context("cannot list /sys/block")? {
        let entry = entry.context("cannot list /sys/block")?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("nbd") {
            let connected = entry.path().join("pid").exists();
            devs.push((name, connected));
        }
    }
    if devs.is_empty() {
        bail!("no kernel nbd devices (/sys/block/nbdN): load the nbd module (modprobe nbd) or use --via nbdfuse");
    }
    commands::first_free_nbd(&devs)
        .map(PathBuf::from)
        .ok_or_else(|| {
            anyhow!(
                "no free /dev/nbdN: all {} kernel nbd devices are connected",
                devs.len()
            )
        })
}

/// Who holds `device` (`devices::holders`) once they have had `limit` to
/// let go (a udev probe opens a device for a moment), saying whom it
/// waits for.
fn wait_unheld(device: &Path, limit: Duration) -> Vec<String> {
    let start = Instant::now();
    let mut said = false;
    loop {
        let held = crate::devices::holders(device);
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

/// Flushes the device's write cache down to nbdkit: fsync on a block device
/// sends a flush request, which the client plugin passes to its donors.
fn flush_device(device: &Path) -> Result<()> {
    let f = std::fs::File::open(device)
        .with_context(|| format!("cannot open {} to flush it", device.display()))?;
    f.sync_all()
        .with_context(|| format!("flushing {}", device.display()))
}

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
                let held = wait_unheld(device, grace.min(Duration::from_secs(5)));
                if !held.is_empty() {
                    bail!(
                        "{} is in use: {}; stop that (close it, umount), then run pagerctl detach again",
                        device.display(),
                        held.join(", ")
                    );
                }
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
                            "{} still holds {} {grace:?} after losetup --detach ({})",
                            device.display(),
                            file.display(),
                            crate::devices::holders(device).join(", ")
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

/// Creates the state directory (private: it holds keys' paths and the map).
pub fn make_state_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create state directory {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make {} private", dir.display()))
}
