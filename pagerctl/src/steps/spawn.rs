//! Starting the long-lived helpers an attach runs (`pagerctl serve` or
//! `hold`, nbdkit, nbdfuse) and waiting until they serve.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::procs;

/// Spawns a long-lived helper: stdin from /dev/null, stdout and stderr
/// appended to `log`, in its own process group so a terminal's Ctrl-C aimed
/// at pagerctl does not reach it.
pub(super) fn spawn_detached(cmd: &[String], log: &Path) -> Result<std::process::Child> {
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
pub(super) fn spawn_watched(
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
pub(super) fn wait_ready(
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

/// The process `setsid --fork --wait` forked (nbdkit, once it has exec'd).
pub(super) fn keeper_child(keeper: &mut std::process::Child, log: &Path) -> Result<u32> {
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
