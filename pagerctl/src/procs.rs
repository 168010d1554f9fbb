//! Running commands and watching processes: the thin layer under attach and
//! detach.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::sys;

/// Runs a command to completion and returns its stdout; a failure names the
/// command line and carries its stderr.
pub fn run(cmd: &[String]) -> Result<String> {
    run_while(cmd, || true)
}

/// Whether an executable of this name is on PATH.
pub fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false)
}

/// Field `n` (1-based, as proc(5) numbers them) of a /proc/PID/stat line.
/// The fields from the third on follow the parenthesised command name,
/// which may itself contain parentheses and spaces.
fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n.checked_sub(3)?)
}

fn read_stat(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()
}

/// Whether `pid` is a live process (zombies count as gone).
pub fn alive(pid: u32) -> bool {
    read_stat(pid).is_some_and(|stat| stat_field(&stat, 3) != Some("Z"))
}

/// Start time of `pid` in clock ticks since boot (field 22 of
/// /proc/PID/stat), `None` when there is no such process.
pub fn start_ticks(pid: u32) -> Option<u64> {
    stat_field(&read_stat(pid)?, 22)?.parse().ok()
}

/// PF_MEMALLOC_NOIO (include/linux/sched.h), which PR_SET_IO_FLUSHER sets.
const PF_MEMALLOC_NOIO: u64 = 0x0008_0000;

/// Whether `pid` frees memory rather than waiting for it
/// (PR_SET_IO_FLUSHER, field 9's PF_MEMALLOC_NOIO): reclaim on its behalf
/// never starts I/O, so it cannot wait on the swap device it serves.
/// `None` when there is no such process.
pub fn io_flusher(pid: u32) -> Option<bool> {
    let flags: u64 = stat_field(&read_stat(pid)?, 9)?.parse().ok()?;
    Some(flags & PF_MEMALLOC_NOIO != 0)
}

/// PF_EXITING (include/linux/sched.h): the process is in exit(2).
const PF_EXITING: u64 = 0x4;

/// Whether `pid` is on its way out (in exit(2), or a zombie): its files,
/// sockets included, are closing or closed.
pub fn exiting(pid: u32) -> bool {
    let Some(stat) = read_stat(pid) else {
        return true;
    };
    let flags: u64 = stat_field(&stat, 9)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0);
    stat_field(&stat, 3) == Some("Z") || flags & PF_EXITING != 0
}

/// Whether `pid` is still the live process that started at `started`; a pid
/// reused after a crash or a reboot is never ours.
pub fn owned(pid: u32, started: u64) -> bool {
    alive(pid) && start_ticks(pid) == Some(started)
}

/// Waits until our process `pid` is gone, for at most `limit`.
pub fn wait_gone(pid: u32, started: u64, limit: Duration) -> bool {
    let start = Instant::now();
    while owned(pid, started) {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// Stops our process `pid` (started at `started`): SIGTERM, then SIGKILL if
/// it is still there after `grace`. Gone or not ours: nothing to do.
pub fn stop(pid: u32, started: u64, what: &str, grace: Duration) -> Result<()> {
    if !owned(pid, started) {
        return Ok(());
    }
    tracing::info!("stopping {what} (pid {pid})");
    sys::signal(pid, libc::SIGTERM).with_context(|| format!("cannot signal {what} (pid {pid})"))?;
    if wait_gone(pid, started, grace) {
        return Ok(());
    }
    sys::signal(pid, libc::SIGKILL).with_context(|| format!("cannot kill {what} (pid {pid})"))?;
    tracing::warn!(
        "killed {what} (pid {pid}, {}) with SIGKILL: it was still there {grace:?} after SIGTERM",
        state_name(pid)
    );
    if !wait_gone(pid, started, Duration::from_secs(5)) {
        bail!("{what} (pid {pid}) survives SIGKILL");
    }
    Ok(())
}

/// What /proc says `pid` is doing, in words (for a message about it).
pub fn state_name(pid: u32) -> &'static str {
    match read_stat(pid).as_deref().and_then(|s| stat_field(s, 3)) {
        Some("R") => "running",
        Some("S") => "sleeping",
        Some("D") => "waiting in the kernel",
        Some("T") | Some("t") => "stopped",
        Some("Z") => "a zombie",
        Some(_) => "alive",
        None => "gone",
    }
}

/// The children of `pid` (of each of its threads).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Kills our process `pid` (started at `started`) and its children with
/// SIGKILL. It is stopped first (SIGSTOP) so that it can neither start a
/// child nor reap one meanwhile: a child's pid is not reused while its
/// parent is stopped, so every pid killed is one it started. Returns what
/// was killed, as "WHAT (pid N)", children first; nothing when `pid` is
/// gone or not ours.
pub fn kill_tree(pid: u32, started: u64, what: &str) -> Vec<String> {
    if !owned(pid, started) || sys::signal(pid, libc::SIGSTOP).is_err() {
        return Vec::new();
    }
    // SIGSTOP takes effect when the process next leaves the kernel: wait
    // for it (not forever: one stuck in the kernel forks nothing either).
    let t0 = Instant::now();
    while state_name(pid) != "stopped" && t0.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut killed = Vec::new();
    let kids = children(pid);
    for &child in &kids {
        let name = std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
        if sys::signal(child, libc::SIGKILL).is_ok() {
            killed.push(format!(
                "{} (pid {child}, a child of pid {pid})",
                name.trim()
            ));
        }
    }
    // Dead children stay zombies (unreaped), which count as gone.
    let t0 = Instant::now();
    while kids.iter().any(|&c| alive(c)) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    if sys::signal(pid, libc::SIGKILL).is_ok() {
        killed.push(format!("{what} (pid {pid})"));
        wait_gone(pid, started, Duration::from_secs(5));
    }
    killed
}

/// Runs a command to completion as [`run`] does, while `keep_waiting`
/// says so (asked every 50 ms); then kills it (SIGKILL, our child by its
/// pid) and fails, naming it.
pub fn run_while(cmd: &[String], mut keep_waiting: impl FnMut() -> bool) -> Result<String> {
    let line = cmd.join(" ");
    tracing::info!("running {line}");
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {line}"))?;
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut out);
            }
            String::from_utf8_lossy(&out).into_owned()
        })
    };
    let stdout = drain(child.stdout.take().map(|o| Box::new(o) as _));
    let stderr = drain(child.stderr.take().map(|e| Box::new(e) as _));
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("cannot wait for {line}"))?
        {
            break status;
        }
        if !keep_waiting() {
            let pid = child.id();
            let _ = child.kill();
            let _ = child.wait();
            bail!("{line} (pid {pid}) did not finish; killed it");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, stderr) = (
        stdout.join().unwrap_or_default(),
        stderr.join().unwrap_or_default(),
    );
    if !status.success() {
        bail!("{line} failed ({status}): {}", stderr.trim());
    }
    Ok(stdout)
}

/// Exempts `pid` from the OOM killer: a process on the swap path that the
/// kernel kills to free memory takes every swapped page with it (nbd-client
/// -swap does the same for itself). Best effort: a warning when refused.
pub fn protect_from_oom(pid: u32, what: &str) {
    if let Err(e) = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "-1000") {
        tracing::warn!("cannot exempt {what} (pid {pid}) from the OOM killer: {e}");
    }
}

/// The last lines of a log file, to explain a process that died.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `cmd` with stdin from /dev/null and stdout and stderr appended to `log`,
/// ready to spawn: how every helper pagerctl starts keeps its output.
pub fn logged_command(cmd: &[String], log: &Path) -> Result<Command> {
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open log {}", log.display()))
    };
    let mut c = Command::new(&cmd[0]);
    c.args(&cmd[1..])
        .stdin(Stdio::null())
        .stdout(open()?)
        .stderr(open()?);
    Ok(c)
}

/// Reads a pid file.
pub fn read_pidfile(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Moves `pid` to the root of every memory cgroup hierarchy (v1 and v2):
/// the pager must not be reclaimed by the limit of the job it pages for.
pub fn leave_memory_cgroups(pid: u32) {
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

/// What a holder on the swap path (`pagerctl hold`, `pagerctl hold-nbd`)
/// does first: lock its memory (prefaulted), leave every memory cgroup
/// and exempt itself from the OOM killer, so that neither the job's limit
/// nor the machine's lack of memory can take it while the kernel's
/// device depends on it.
pub fn stay_on_swap_path(what: &str) -> Result<()> {
    let me = std::process::id();
    netpager_util::process::lock_memory(netpager_util::process::Lock::Prefault)
        .context("mlockall")?;
    protect_from_oom(me, what);
    leave_memory_cgroups(me);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_past_a_command_name_with_parentheses() {
        let stat =
            "4242 (fuse (ring) 1) S 1 4242 4242 0 -1 4718656 12 0 0 0 3 1 0 0 20 0 9 0 777 1";
        assert_eq!(stat_field(stat, 3), Some("S"));
        assert_eq!(stat_field(stat, 9), Some("4718656"));
        assert_eq!(stat_field(stat, 22), Some("777"));
        assert_eq!(stat_field(stat, 2), None);
        assert_eq!(stat_field("no command name", 3), None);
        // 4718656 = 0x480040: PF_MEMALLOC_NOIO (0x80000) is set.
        assert_ne!(4_718_656 & PF_MEMALLOC_NOIO, 0);
    }

    #[test]
    fn a_command_runs_while_asked_and_is_killed_after() {
        let echo = ["echo".to_string(), "hi".to_string()];
        assert_eq!(run_while(&echo, || true).unwrap(), "hi\n");
        let sleep = ["sleep".to_string(), "600".to_string()];
        let mut polls = 0;
        let e = run_while(&sleep, || {
            polls += 1;
            polls < 3
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("sleep 600") && e.contains("killed it"), "{e}");
        let fail = ["false".to_string()];
        assert!(run_while(&fail, || true).is_err());
    }

    #[test]
    fn a_stopped_process_and_its_children_are_killed_by_pid() {
        // sh starts a sleep and waits for it; stopped, it reaps nothing.
        struct Reaped(std::process::Child, Option<u32>);
        impl Drop for Reaped {
            // Whatever the test's outcome: neither is left behind.
            fn drop(&mut self) {
                if let Some(child) = self.1 {
                    let _ = sys::signal(child, libc::SIGKILL);
                }
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let sh = Command::new("sh")
            .args(["-c", "sleep 600 & wait"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = sh.id();
        let mut sh = Reaped(sh, None);
        let started = start_ticks(pid).unwrap();
        let start = Instant::now();
        while children(pid).is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "sh started no child"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let child = children(pid)[0];
        sh.1 = Some(child);
        let killed = kill_tree(pid, started, "sh");
        sh.0.wait().unwrap();
        assert_eq!(
            killed,
            [
                format!("sleep (pid {child}, a child of pid {pid})"),
                format!("sh (pid {pid})")
            ]
        );
        assert!(!alive(child));
        // Gone: nothing more to kill.
        assert!(kill_tree(pid, started, "sh").is_empty());
    }

    #[test]
    fn this_process_is_no_io_flusher_unless_it_asked() {
        assert_eq!(io_flusher(std::process::id()), Some(false));
        assert_eq!(io_flusher(u32::MAX), None);
    }
}
