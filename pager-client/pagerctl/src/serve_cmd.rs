//! `pagerctl serve`: the process that serves a device to the kernel itself,
//! as the file `STATE_DIR/fuse/device` on its own FUSE mount, calling the
//! device directly. `attach` starts it; it runs until the mount goes away.
//!
//! It sits on the swap path, so it locks its memory, marks itself an I/O
//! flusher, leaves every memory cgroup (the job that swaps is limited, not
//! its pager) and is exempt from the OOM killer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use pager_client::config::DeviceConfig;
use pager_client::device::Device;
use pager_fuse::{Backend, Mount, Options, Transport};
use pagerctl::attach::record::{frontend_info, ServeInfo, StateLayout};

use crate::{procs, sys};

/// The device as the FUSE front end sees it.
struct DeviceBackend(Arc<Device>);

impl Backend for DeviceBackend {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        self.0
            .read(buf, offset)
            .map_err(|e| log_errno("read", offset, e))
    }
    fn write(&self, data: &[u8], offset: u64) -> Result<(), i32> {
        self.0
            .write(data, offset)
            .map_err(|e| log_errno("write", offset, e))
    }
    fn zero(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.0
            .zero(len, offset)
            .map_err(|e| log_errno("zero", offset, e))
    }
    fn trim(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.0
            .trim(len, offset)
            .map_err(|e| log_errno("trim", offset, e))
    }
    fn flush(&self) -> Result<(), i32> {
        self.0.flush().map_err(|e| log_errno("flush", 0, e))
    }
}

/// The kernel sees only an errno: the reason goes to the log.
fn log_errno(what: &str, offset: u64, e: pager_client::device::DeviceError) -> i32 {
    tracing::error!("{what} at offset {offset}: {e}");
    e.errno()
}

pub struct ServeArgs {
    pub state_dir: PathBuf,
    pub transport: Transport,
    pub threads: usize,
}

pub fn run(a: ServeArgs) -> Result<()> {
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
    leave_memory_cgroups(me);
    // Signals wait for their own thread, so that SIGTERM unmounts cleanly
    // instead of cutting the kernel's device off.
    sys::block_stop_signals().context("cannot block SIGTERM and SIGINT")?;
    let device = Arc::new(Device::open(cfg, &layout.dir)?);
    let mountpoint = layout.fuse_dir();
    std::fs::create_dir_all(&mountpoint)
        .with_context(|| format!("cannot create {}", mountpoint.display()))?;
    let opts = Options {
        transport: a.transport,
        threads: a.threads,
        ..Options::default()
    };
    let mount = Mount::start(DeviceBackend(device.clone()), &mountpoint, &opts)
        .with_context(|| format!("cannot serve {}", mountpoint.display()))?;
    if let Some(why) = mount.fallback_reason() {
        tracing::warn!("using classic /dev/fuse: {why}");
    }
    tracing::info!(
        "serving {} over {}",
        layout.fuse_file().display(),
        mount.transport()
    );
    let info = ServeInfo {
        pid: me,
        transport: mount.transport().to_string(),
        fallback: mount.fallback_reason().map(str::to_string),
    };
    info.save(&layout.serve_json())?;
    device.set_frontend(frontend_info(&layout));
    let stopper = mountpoint.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || unmount_on_signal(&stopper))
        .context("cannot start the signal thread")?;
    let served = mount.wait();
    let _ = std::fs::remove_file(layout.serve_json());
    drop(device);
    served.context("serving the FUSE mount")?;
    tracing::info!("unmounted; the device's map is synced");
    Ok(())
}

/// On SIGTERM or SIGINT, unmounts (which ends the serving threads) unless
/// the device is still in use: pulling it from under a loop device would
/// fail every swapped page.
fn unmount_on_signal(mountpoint: &Path) {
    loop {
        let sig = sys::wait_stop_signal();
        match pager_fuse::unmount(mountpoint, false) {
            Ok(()) => {
                tracing::info!("signal {sig}: unmounted {}", mountpoint.display());
                return;
            }
            Err(e) => tracing::warn!(
                "signal {sig}: cannot unmount {} ({e}); it is still in use: run pagerctl detach",
                mountpoint.display()
            ),
        }
    }
}

/// Moves `pid` to the root of every memory cgroup hierarchy (v1 and v2):
/// the pager must not be reclaimed by the limit of the job it pages for.
fn leave_memory_cgroups(pid: u32) {
    for procs_file in [
        "/sys/fs/cgroup/memory/cgroup.procs",
        "/sys/fs/cgroup/cgroup.procs",
        "/sys/fs/cgroup/unified/cgroup.procs",
    ] {
        if Path::new(procs_file).exists() {
            if let Err(e) = std::fs::write(procs_file, pid.to_string()) {
                tracing::debug!("cannot move to {procs_file}: {e}");
            }
        }
    }
}
