//! nbdkit plugin serving a netpager client device: a thin shell over
//! [`pager_client::device::Device`].
//!
//! `nbdkit [-f] -U SOCK libpager_client_plugin.so state=DIR` reads
//! `DIR/device.toml`, and after nbdkit has forked (background threads do
//! not survive a fork) locks its memory and opens the device, which all
//! connections share. See `pager-client-plugin.1.md`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use nbdkit::{
    plugin, CacheFlags, Error, ExtentHandle, ExtentType, Flags, FuaFlags, Result, Server,
    ThreadModel,
};
use netpager_util::LockExt;
use pager_client::config::DeviceConfig;
use pager_client::device::{Device, DeviceError};

static STATE_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);
static CONFIG: Mutex<Option<DeviceConfig>> = Mutex::new(None);
static DEVICE: OnceLock<Device> = OnceLock::new();

fn einval(msg: impl Into<String>) -> Error {
    Error::new(libc::EINVAL, msg.into())
}

fn nbd_err(e: DeviceError) -> Error {
    Error::new(e.errno(), e.to_string())
}

/// Routes the library's `tracing` events to nbdkit's debug log (`-v`) and,
/// from level info up, to stderr (shown with `-f`, or `--log=stderr`).
struct NbdkitLog;

struct EventWriter {
    to_stderr: bool,
    buf: Vec<u8>,
}

impl Write for EventWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.buf);
        let line = text.trim_end();
        if line.is_empty() {
            return;
        }
        nbdkit::debug!("{line}");
        if self.to_stderr {
            eprintln!("pager-client: {line}");
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for NbdkitLog {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter {
            to_stderr: true,
            buf: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> EventWriter {
        EventWriter {
            to_stderr: *meta.level() <= tracing::Level::INFO,
            buf: Vec::new(),
        }
    }
}

/// One NBD connection; all of them share the device.
struct PagerClient {
    device: &'static Device,
}

impl Server for PagerClient {
    fn name() -> &'static str {
        "pager-client"
    }

    fn longname() -> Option<&'static str> {
        Some("netpager client: a block device made of donors' memory")
    }

    fn config_help() -> Option<&'static str> {
        Some("state=DIR   (required) state directory with device.toml; the extent map and status.json live there too")
    }

    fn config(key: &str, value: &str) -> Result<()> {
        match key {
            "state" => {
                // Absolute now: nbdkit changes directory to / when it forks.
                let dir = std::path::absolute(value)
                    .map_err(|e| einval(format!("state={value}: {e}")))?;
                *STATE_DIR.lock_or_recover() = Some(dir);
                Ok(())
            }
            _ => Err(einval(format!(
                "unknown parameter {key:?} (expected state=DIR)"
            ))),
        }
    }

    /// Loads and validates device.toml now, so mistakes show before nbdkit
    /// forks.
    fn config_complete() -> Result<()> {
        let dir = STATE_DIR
            .lock_or_recover()
            .clone()
            .ok_or_else(|| einval("state=DIR is required"))?;
        let cfg = DeviceConfig::load_from_state_dir(&dir).map_err(|e| einval(e.to_string()))?;
        *CONFIG.lock_or_recover() = Some(cfg);
        Ok(())
    }

    fn thread_model() -> Result<ThreadModel> {
        Ok(ThreadModel::Parallel)
    }

    /// Locks memory and opens the device (connects to donors, starts its
    /// threads): after the fork, since threads and memory locks are not
    /// inherited by nbdkit's daemon child.
    fn after_fork() -> Result<()> {
        let _ = tracing_subscriber::fmt()
            .with_writer(NbdkitLog)
            .with_ansi(false)
            .without_time()
            .with_target(false)
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("PAGER_CLIENT_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .try_init();
        let dir = STATE_DIR
            .lock_or_recover()
            .clone()
            .ok_or_else(|| einval("state=DIR is required"))?;
        let cfg = CONFIG
            .lock_or_recover()
            .take()
            .ok_or_else(|| einval("configuration not loaded"))?;
        if cfg.mlock {
            netpager_util::process::lock_memory(netpager_util::process::Lock::OnFault).map_err(
                |e| {
                    Error::new(
                        e.raw_os_error().unwrap_or(libc::EPERM),
                        format!("mlockall: {e} (set mlock = false in device.toml to run unlocked)"),
                    )
                },
            )?;
        }
        let device = Device::open(cfg, &dir).map_err(|e| {
            Error::new(
                e.errno(),
                format!("opening the device in {}: {e}", dir.display()),
            )
        })?;
        // This plugin is the nbd front end (kernel nbd, nbdfuse or any NBD
        // client on its socket).
        device.set_frontend(pager_client::metrics::FrontendInfo {
            frontend: "nbd".into(),
            ..Default::default()
        });
        DEVICE
            .set(device)
            .map_err(|_| einval("the device was already opened"))?;
        Ok(())
    }

    /// Makes the map and the write-through copy durable before nbdkit exits,
    /// and lets connections given up on donors end first (netpager_nbd's drain).
    fn unload() {
        if let Some(d) = DEVICE.get() {
            if let Err(e) = d.flush() {
                eprintln!("pager-client: final flush: {e}");
            }
        }
        let left = netpager_nbd::wait_given_up_ended(netpager_nbd::EXIT_WAIT);
        if left > 0 {
            eprintln!(
                "pager-client: closing {left} connections given up on donors that have not finished answering them: an nbdkit before 1.33.10 may abort"
            );
        }
    }

    fn open(_readonly: bool) -> Result<Box<dyn Server>> {
        let device = DEVICE
            .get()
            .ok_or_else(|| Error::new(libc::EIO, "the device is not open"))?;
        Ok(Box::new(PagerClient { device }))
    }

    fn get_size(&self) -> Result<i64> {
        Ok(self.device.size() as i64)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.device.read(buf, offset).map_err(nbd_err)
    }

    fn write_at(&self, buf: &[u8], offset: u64, _flags: Flags) -> Result<()> {
        self.device.write(buf, offset).map_err(nbd_err)
    }

    fn flush(&self) -> Result<()> {
        self.device.flush().map_err(nbd_err)
    }

    fn trim(&self, count: u32, offset: u64, _flags: Flags) -> Result<()> {
        self.device.trim(count as u64, offset).map_err(nbd_err)
    }

    fn zero(&self, count: u32, offset: u64, _flags: Flags) -> Result<()> {
        self.device.zero(count as u64, offset).map_err(nbd_err)
    }

    fn extents(&self, count: u32, offset: u64, _flags: Flags, h: &mut ExtentHandle) -> Result<()> {
        for (off, len, placed) in self.device.allocation(offset, count as u64) {
            h.add(
                off,
                len,
                if placed {
                    ExtentType::Allocated
                } else {
                    ExtentType::HoleZero
                },
            )?;
        }
        Ok(())
    }

    /// Writable: it is a swap device.
    fn can_write(&self) -> Result<bool> {
        Ok(true)
    }

    /// Flush syncs the write-through file, the fallback, the map journal
    /// and the donors.
    fn can_flush(&self) -> Result<bool> {
        Ok(true)
    }

    /// FUA is a write plus a flush; nothing finer exists across donors.
    fn can_fua(&self) -> Result<FuaFlags> {
        Ok(FuaFlags::Emulate)
    }

    /// Trimming whole extents gives their memory back to the donors.
    fn can_trim(&self) -> Result<bool> {
        Ok(true)
    }

    /// Zeroing whole extents frees them, which beats writing zeros.
    fn can_zero(&self) -> Result<bool> {
        Ok(true)
    }

    /// Zeroing part of a parity extent is a read-modify-write: not fast.
    fn can_fast_zero(&self) -> Result<bool> {
        Ok(false)
    }

    /// One device serves every connection, so a flush covers them all.
    fn can_multi_conn(&self) -> Result<bool> {
        Ok(true)
    }

    /// Never-written extents are holes that read as zeros (sparse copies).
    fn can_extents(&self) -> Result<bool> {
        Ok(true)
    }

    /// No local cache to warm: donors' memory already is the cache.
    fn can_cache(&self) -> Result<CacheFlags> {
        Ok(CacheFlags::None)
    }
}

plugin!(PagerClient {
    thread_model,
    config,
    config_complete,
    after_fork,
    unload,
    write_at,
    flush,
    trim,
    zero,
    extents,
    can_write,
    can_flush,
    can_fua,
    can_trim,
    can_zero,
    can_fast_zero,
    can_multi_conn,
    can_extents,
    can_cache
});
