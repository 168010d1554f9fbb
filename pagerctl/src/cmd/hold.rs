//! `pagerctl hold`: the holder of a restartable device's FUSE connection.
//!
//! It mounts the connection, keeps an fd on it and does nothing else with
//! it, so the connection (and every request on it) outlives any serving
//! process. It runs `pagerctl serve --held` as its child, gives it the fd
//! over `STATE_DIR/holder.sock` (pager_fuse::handover), and when that child
//! exits while the mount is still there (a crash, a kill -9, a hand-over
//! for `pagerctl restart`) starts the next one at once. It exits when the
//! serving process exits after the mount went away (detach).
//!
//! Like the serving process it sits on the swap path: memory locked, out
//! of every memory cgroup, exempt from the OOM killer.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use netpager_util::LockExt;
use pager_fuse::handover::{self, Request, Restarted};
use pager_fuse::Options;
use pagerctl::attach::commands;
use pagerctl::attach::nbd_hold::{backoff, QUICK_DEATH};
use pagerctl::attach::record::{HolderInfo, StateLayout};

use crate::{probe, procs, sys};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Each serving process's reader threads.
    #[arg(long, default_value_t = 4, value_name = "N")]
    threads: usize,
    /// Each serving process's write-back buffer (`pagerctl serve
    /// --writeback-buffer`).
    #[arg(long, default_value = super::serve::DEFAULT_WRITEBACK, value_name = "SIZE", value_parser = super::check_size)]
    writeback_buffer: String,
}

/// How long a new serving process may take to serve before `restart`
/// gives up waiting (it keeps running; the holder keeps restarting it).
const RESTART_WAIT: Duration = Duration::from_secs(60);

/// What the holder's threads share.
struct State {
    info: HolderInfo,
    /// The kernel's INIT is still to be answered (no serving process has
    /// said ready yet).
    fresh: bool,
    /// When the kernel's requests stopped being read: the last serving
    /// process's end or hand-over; cleared when the next one serves.
    down_since: Option<Instant>,
    /// A restart asked for: the old process hands over, this is no crash.
    handing_over: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    layout: StateLayout,
}

impl Shared {
    fn save(&self, st: &State) {
        if let Err(e) = st.info.save(&self.layout.holder_json()) {
            tracing::warn!("{e}");
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    let me = std::process::id();
    procs::stay_on_swap_path("the connection holder")?;
    sys::block_stop_signals().context("cannot block SIGTERM and SIGINT")?;
    let mountpoint = layout.fuse_dir();
    std::fs::create_dir_all(&mountpoint)
        .with_context(|| format!("cannot create {}", mountpoint.display()))?;
    let connection = pager_fuse::mount_connection(&mountpoint, &Options::default())
        .with_context(|| format!("cannot mount {}", mountpoint.display()))?;
    let socket = layout.holder_socket();
    let _ = std::fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(l) => l,
        Err(e) => {
            let _ = pager_fuse::unmount(&mountpoint, true);
            return Err(e).with_context(|| format!("cannot listen on {}", socket.display()));
        }
    };
    let binary = std::env::current_exe().context("cannot find pagerctl's own path")?;
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            info: HolderInfo {
                pid: me,
                started: procs::start_ticks(me).unwrap_or(0),
                binary,
                ..HolderInfo::default()
            },
            fresh: true,
            down_since: None,
            handing_over: false,
        }),
        changed: Condvar::new(),
        layout: layout.clone(),
    });
    {
        let s = shared.clone();
        std::thread::Builder::new()
            .name("holder-socket".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    match stream {
                        Ok(stream) => {
                            let s = s.clone();
                            let connection = connection.try_clone();
                            // One thread per request: `restart` waits.
                            std::thread::spawn(move || match connection {
                                Ok(c) => answer(&s, stream, &c),
                                Err(e) => tracing::error!("cannot dup the connection: {e}"),
                            });
                        }
                        Err(e) => tracing::warn!("holder socket: {e}"),
                    }
                }
            })
            .context("cannot start the socket thread")?;
    }
    {
        let s = shared.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || forward_stop_signals(&s))
            .context("cannot start the signal thread")?;
    }
    tracing::info!(
        "holding the FUSE connection of {} (pid {me})",
        mountpoint.display()
    );
    let serve = commands::ServeOptions {
        threads: a.threads.max(1),
        writeback: a.writeback_buffer.clone(),
        // Held: acknowledged once drained whatever this says.
        ack_late: false,
    };
    let result = supervise(&shared, &layout, &serve, &mountpoint);
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_file(layout.holder_json());
    result
}

/// Runs serving processes until one exits with the mount gone.
fn supervise(
    shared: &Shared,
    layout: &StateLayout,
    serve: &commands::ServeOptions,
    mountpoint: &Path,
) -> Result<()> {
    let log = layout.serve_log();
    let mut quick = 0;
    let mut first = true;
    loop {
        let binary = shared.state.lock_or_recover().info.binary.clone();
        let cmd = commands::held_serve_command(&binary, &layout.dir, serve);
        let spawned = procs::logged_command(&cmd, &log)?.spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) if first => {
                let _ = pager_fuse::unmount(mountpoint, true);
                return Err(e).with_context(|| format!("cannot start {}", cmd.join(" ")));
            }
            Err(e) => {
                // An upgrade to a binary that is not there: the old one.
                tracing::error!("cannot start {}: {e}; trying again", cmd.join(" "));
                quick += 1;
                std::thread::sleep(backoff(quick).max(Duration::from_millis(250)));
                continue;
            }
        };
        let pid = child.id();
        let born = Instant::now();
        {
            let mut st = shared.state.lock_or_recover();
            st.info.serve_pid = Some(pid);
            if !first {
                st.info.restarts += 1;
            }
            shared.save(&st);
        }
        first = false;
        let status = child
            .wait()
            .context("cannot wait for the serving process")?;
        let crashed;
        {
            let mut st = shared.state.lock_or_recover();
            st.down_since.get_or_insert_with(Instant::now);
            crashed = !std::mem::take(&mut st.handing_over);
            st.info.serve_pid = None;
            shared.save(&st);
        }
        if !probe::is_mounted(mountpoint) {
            tracing::info!("serving process {pid} exited ({status}) after the unmount: done");
            return Ok(());
        }
        if crashed {
            shared.state.lock_or_recover().info.crashes += 1;
            tracing::warn!(
                "serving process {pid} exited ({status}) with the device still mounted: starting the next one"
            );
        } else {
            tracing::info!("serving process {pid} handed over: starting the next one");
        }
        quick = if born.elapsed() < QUICK_DEATH {
            quick + 1
        } else {
            0
        };
        std::thread::sleep(backoff(quick));
    }
}

/// Answers one request on the holder's socket.
fn answer(shared: &Shared, mut stream: UnixStream, connection: &std::fs::File) {
    let Some(request) = handover::read_request(&mut stream) else {
        return;
    };
    let reply = match request {
        Ok(Request::Take) => {
            let fresh = shared.state.lock_or_recover().fresh;
            if let Err(e) = handover::give(&stream, connection, fresh) {
                tracing::error!("cannot hand the connection over: {e}");
            }
            return;
        }
        Ok(Request::Ready { pid }) => {
            let mut st = shared.state.lock_or_recover();
            st.fresh = false;
            st.info.ready_pid = Some(pid);
            if let Some(t) = st.down_since.take() {
                let ms = t.elapsed().as_millis() as u64;
                st.info.last_held_ms = Some(ms);
                tracing::info!("serving process {pid} serves; requests were held {ms} ms");
            }
            st.info.resent_last = 0;
            shared.save(&st);
            shared.changed.notify_all();
            "ok".to_string()
        }
        Ok(Request::Resent { pid, count }) => {
            let mut st = shared.state.lock_or_recover();
            if st.info.serve_pid == Some(pid) && count > st.info.resent_last {
                st.info.resent_total += count - st.info.resent_last;
                st.info.resent_last = count;
                shared.save(&st);
            }
            "ok".to_string()
        }
        Ok(Request::Restart { binary }) => match restart(shared, binary) {
            Ok(r) => r.line(),
            Err(e) => format!("error {e}"),
        },
        Err(e) => format!("error {e}"),
    };
    use std::io::Write;
    let _ = stream.write_all(format!("{reply}\n").as_bytes());
}

/// `restart`: asks the serving process to hand over (SIGUSR1: it stops
/// taking requests, finishes those it has, and exits with the mount
/// left), lets the supervisor start the next one with `binary`, and waits
/// until that one serves.
fn restart(shared: &Shared, binary: Option<PathBuf>) -> Result<Restarted, String> {
    let mut st = shared.state.lock_or_recover();
    if let Some(b) = binary {
        if !b.is_file() {
            return Err(format!("{} is not a file", b.display()));
        }
        st.info.binary = b;
    }
    let Some(old) = st.info.serve_pid else {
        return Err("no serving process runs now (one is being started)".into());
    };
    let restarts = st.info.restarts;
    st.handing_over = true;
    st.down_since = Some(Instant::now());
    sys::signal(old, libc::SIGUSR1).map_err(|e| format!("cannot signal pid {old}: {e}"))?;
    let deadline = Instant::now() + RESTART_WAIT;
    loop {
        if st.info.restarts > restarts && st.down_since.is_none() {
            if let Some(pid) = st.info.serve_pid {
                return Ok(Restarted {
                    pid,
                    held_ms: st.info.last_held_ms.unwrap_or(0),
                });
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no new serving process served within {RESTART_WAIT:?}: see {}",
                shared.layout.serve_log().display()
            ));
        }
        st = shared
            .changed
            .wait_timeout(st, left)
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0);
    }
}

/// SIGTERM or SIGINT to the holder goes to the serving process, which
/// unmounts if it can (the holder then exits after it).
fn forward_stop_signals(shared: &Shared) {
    loop {
        let sig = sys::wait_stop_signal();
        if sig == libc::SIGUSR1 {
            continue;
        }
        let pid = shared.state.lock_or_recover().info.serve_pid;
        match pid {
            Some(pid) => {
                tracing::info!("signal {sig}: passing it to the serving process {pid}");
                let _ = sys::signal(pid, sig);
            }
            None => tracing::warn!("signal {sig}: no serving process runs now"),
        }
    }
}
