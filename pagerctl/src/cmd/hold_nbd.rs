//! `pagerctl hold-nbd`: the holder of a restartable kernel nbd device.
//!
//! It runs the device's serving process, nbdkit with the client plugin on
//! the state directory's unix socket, as its child; negotiates a
//! connection with it and gives the socket to the kernel
//! (`NBD_CMD_CONNECT` of /dev/nbdN with the request and dead-conn
//! timeouts). When nbdkit exits while the device is attached (a crash, a
//! kill -9, `pagerctl restart`) it starts the next one, negotiates again
//! and gives the kernel the new socket (`NBD_CMD_RECONFIGURE`): within the
//! dead-conn timeout the kernel's requests wait instead of failing. On
//! SIGTERM (detach) it disconnects the device, flushes and stops nbdkit
//! and exits. When to do what is `pagerctl::attach::nbd_hold`.
//!
//! Like `pagerctl hold` it sits on the swap path: memory locked, out of
//! every memory cgroup, exempt from the OOM killer (nbdkit inherits the
//! last two).

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use netpager_nbd::genl::ConnectConfig;
use netpager_nbd::kernel::NbdNetlink;
use netpager_nbd::{Connection, Negotiated};
use pager_fuse::handover::{self, Request, Restarted};
use pagerctl::attach::commands;
use pagerctl::attach::nbd_hold::{Action, Event, Holder};
use pagerctl::attach::record::{HolderInfo, StateLayout};

use super::parse_secs;
use crate::{procs, sys};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// The kernel nbd device (/dev/nbdN).
    #[arg(long, value_name = "DEVICE")]
    device: PathBuf,
    /// The client plugin nbdkit serves.
    #[arg(long, value_name = "PATH")]
    plugin: PathBuf,
    /// The export name to negotiate.
    #[arg(long, default_value = "")]
    export: String,
    /// How long the kernel holds the device's requests while no serving
    /// process answers, before it fails them.
    #[arg(long, default_value = "120", value_parser = parse_secs, value_name = "SECS")]
    dead_conn_timeout: Duration,
    /// A request unanswered this long is sent again (on the next
    /// connection, once there is one).
    #[arg(long, default_value = "10", value_parser = parse_secs, value_name = "SECS")]
    nbd_timeout: Duration,
}

/// How often the holder looks at its child and its socket.
const POLL: Duration = Duration::from_millis(20);

/// How long `pagerctl restart` may wait for the next nbdkit to serve.
const RESTART_WAIT: Duration = Duration::from_secs(60);

/// What the signal and socket threads tell the main loop.
enum Msg {
    Detach(libc::c_int),
    Restart(mpsc::Sender<String>),
}

/// The running nbdkit.
struct Server {
    child: Child,
    pid: u32,
    born: Instant,
    /// Stopped by the holder for `pagerctl restart`.
    asked: bool,
    /// Its socket is negotiated (given to the kernel, or about to be).
    negotiated: bool,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    let index = commands::nbd_index(&a.device)?;
    // Refused before anything is set up where the driver is not loaded.
    let mut kernel = NbdNetlink::open().context("cannot reach the kernel's nbd driver")?;
    procs::stay_on_swap_path("the nbd device's holder")?;
    sys::block_stop_signals().context("cannot block SIGTERM and SIGINT")?;
    let control = layout.holder_socket();
    let _ = std::fs::remove_file(&control);
    let listener = UnixListener::bind(&control)
        .with_context(|| format!("cannot listen on {}", control.display()))?;
    let (tx, rx) = mpsc::channel();
    {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name("holder-socket".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let tx = tx.clone();
                    // One thread per request: `restart` waits.
                    std::thread::spawn(move || answer(stream, &tx));
                }
            })
            .context("cannot start the socket thread")?;
    }
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let sig = sys::wait_stop_signal();
            if sig != libc::SIGUSR1 && tx.send(Msg::Detach(sig)).is_err() {
                return;
            }
        })
        .context("cannot start the signal thread")?;
    let me = std::process::id();
    let mut h = Hold {
        a: &a,
        layout: &layout,
        index,
        info: HolderInfo {
            pid: me,
            started: procs::start_ticks(me).unwrap_or(0),
            binary: a.plugin.clone(),
            ..HolderInfo::default()
        },
        server: None,
        socket: None,
        waiters: Vec::new(),
    };
    tracing::info!(
        "holding kernel nbd {} (pid {me}; dead-conn timeout {:?}, request timeout {:?})",
        a.device.display(),
        a.dead_conn_timeout,
        a.nbd_timeout
    );
    let result = h.main_loop(&mut kernel, &rx);
    if result.is_err() {
        if let Some(s) = &h.server {
            let _ = sys::signal(s.pid, libc::SIGTERM);
        }
    }
    let _ = std::fs::remove_file(&control);
    let _ = std::fs::remove_file(layout.holder_json());
    result
}

struct Hold<'a> {
    a: &'a Args,
    layout: &'a StateLayout,
    index: u32,
    info: HolderInfo,
    server: Option<Server>,
    /// The negotiated socket not yet given to the kernel.
    socket: Option<Negotiated>,
    /// `pagerctl restart` callers waiting for the next nbdkit to serve.
    waiters: Vec<mpsc::Sender<String>>,
}

impl Hold<'_> {
    fn main_loop(&mut self, kernel: &mut NbdNetlink, rx: &mpsc::Receiver<Msg>) -> Result<()> {
        let mut holder = Holder::new(self.a.dead_conn_timeout);
        let mut start_at = Some(Instant::now());
        let mut first = true;
        loop {
            let now = Instant::now();
            if self.server.is_none() && start_at.is_some_and(|t| now >= t) {
                start_at = None;
                match self.start() {
                    Ok(()) => {}
                    Err(e) if first => return Err(e),
                    // Another try later: the device waits meanwhile.
                    Err(e) => {
                        tracing::error!("{e:#}; trying again in 1 s");
                        start_at = Some(now + Duration::from_secs(1));
                    }
                }
                first = false;
            }
            let mut events = Vec::new();
            if let Some(ev) = self.watch_server()? {
                events.push(ev);
            }
            match rx.recv_timeout(POLL) {
                Ok(Msg::Detach(sig)) => {
                    tracing::info!("signal {sig}: disconnecting {}", self.a.device.display());
                    events.push(Event::Detach);
                }
                Ok(Msg::Restart(reply)) => self.restart(&holder, reply),
                Err(_) => {}
            }
            events.push(Event::Tick);
            for ev in events {
                for action in holder.on(ev, Instant::now()) {
                    match action {
                        Action::Connect => self.connect(kernel)?,
                        Action::Reconfigure { held, late } => self.reconfigure(kernel, held, late),
                        Action::Start { after } => start_at = Some(Instant::now() + after),
                        Action::Expired { down } => {
                            tracing::error!(
                                "no nbdkit has served {} for {down:?}, past the dead-conn timeout: the kernel fails its requests until one does (swapped pages read meanwhile are lost to their jobs)",
                                self.a.device.display()
                            );
                            self.info.expired += 1;
                            self.save();
                        }
                        Action::Disconnect => {
                            if let Err(e) = kernel.disconnect(self.index) {
                                tracing::error!("disconnecting {}: {e}", self.a.device.display());
                            }
                        }
                        Action::StopServer => {
                            start_at = None;
                            if !self.stop_server() {
                                return Ok(());
                            }
                        }
                        Action::Exit => {
                            tracing::info!("nbdkit stopped after the disconnect: done");
                            return Ok(());
                        }
                        Action::Fail => bail!(
                            "nbdkit exited before it served; log {}:\n{}",
                            self.layout.nbdkit_log().display(),
                            procs::log_tail(&self.layout.nbdkit_log(), 20)
                        ),
                    }
                }
            }
        }
    }

    /// Starts nbdkit, log appended to the state directory's.
    fn start(&mut self) -> Result<()> {
        let socket = self.layout.socket();
        // Left by a killed nbdkit: the new one could not bind it.
        let _ = std::fs::remove_file(&socket);
        let cmd = commands::held_nbdkit_command(
            Path::new("nbdkit"),
            &self.a.plugin,
            &socket,
            &self.layout.dir,
        );
        let log = self.layout.nbdkit_log();
        let child = procs::logged_command(&cmd, &log)?
            .spawn()
            .with_context(|| format!("cannot start {}", cmd.join(" ")))?;
        let pid = child.id();
        self.info.serve_pid = Some(pid);
        self.info.serve_started = procs::start_ticks(pid);
        if self.info.ready_pid.is_some() {
            self.info.restarts += 1;
        }
        self.save();
        self.server = Some(Server {
            child,
            pid,
            born: Instant::now(),
            asked: false,
            negotiated: false,
        });
        Ok(())
    }

    /// The server's exit, or its socket negotiated.
    fn watch_server(&mut self) -> Result<Option<Event>> {
        let Some(s) = &mut self.server else {
            return Ok(None);
        };
        if let Some(status) = s.child.try_wait().context("cannot watch nbdkit")? {
            let (pid, lived, asked) = (s.pid, s.born.elapsed(), s.asked);
            self.server = None;
            self.socket = None;
            self.info.serve_pid = None;
            self.info.serve_started = None;
            if asked {
                tracing::info!("nbdkit {pid} stopped for the restart ({status})");
            } else {
                self.info.crashes += 1;
                tracing::warn!("nbdkit {pid} exited ({status}) with the device attached");
            }
            self.save();
            return Ok(Some(Event::ServerExited { lived, asked }));
        }
        if s.negotiated {
            return Ok(None);
        }
        // Refused until nbdkit listens; it answers at once once it does.
        match Connection::handover_unix(
            &self.layout.socket(),
            &self.a.export,
            Duration::from_secs(5),
        ) {
            Ok(n) => {
                s.negotiated = true;
                self.socket = Some(n);
                Ok(Some(Event::Negotiated))
            }
            Err(e) => {
                tracing::debug!("nbdkit {} not serving yet: {e}", s.pid);
                Ok(None)
            }
        }
    }

    fn connect(&mut self, kernel: &mut NbdNetlink) -> Result<()> {
        let n = self.socket.take().context("no negotiated socket")?;
        let cfg = ConnectConfig {
            index: self.index,
            size_bytes: n.size,
            block_size: 4096,
            server_flags: n.flags.into(),
            timeout_secs: self.a.nbd_timeout.as_secs().max(1),
            dead_conn_timeout_secs: self.a.dead_conn_timeout.as_secs().max(1),
        };
        kernel
            .connect(&cfg, &[n.fd.as_raw_fd()])
            .with_context(|| format!("cannot connect {}", self.a.device.display()))?;
        self.served(Duration::ZERO);
        tracing::info!(
            "{} connected to nbdkit {} ({} bytes)",
            self.a.device.display(),
            self.info.serve_pid.unwrap_or(0),
            n.size
        );
        Ok(())
    }

    fn reconfigure(&mut self, kernel: &mut NbdNetlink, held: Duration, late: bool) {
        let Some(n) = self.socket.take() else {
            return;
        };
        // The kernel replaces only a connection it has marked dead; it did
        // so when the old nbdkit's end closed, before this one could start.
        if let Err(e) = kernel.reconfigure(self.index, &[n.fd.as_raw_fd()]) {
            tracing::error!(
                "cannot give {} the new connection: {e}; starting another nbdkit",
                self.a.device.display()
            );
            if let Some(s) = &self.server {
                let _ = sys::signal(s.pid, libc::SIGTERM);
            }
            return;
        }
        self.served(held);
        if late {
            tracing::error!(
                "{} reconnected after {held:?}, past the dead-conn timeout: requests failed meanwhile",
                self.a.device.display()
            );
        } else {
            tracing::info!(
                "{} reconnected to nbdkit {}; requests were held {} ms",
                self.a.device.display(),
                self.info.serve_pid.unwrap_or(0),
                held.as_millis()
            );
        }
    }

    /// Records that the current nbdkit serves, and answers `restart`.
    fn served(&mut self, held: Duration) {
        let pid = self.info.serve_pid.unwrap_or(0);
        self.info.ready_pid = Some(pid);
        if self.info.restarts > 0 {
            self.info.last_held_ms = Some(held.as_millis() as u64);
        }
        self.save();
        let line = Restarted {
            pid,
            held_ms: held.as_millis() as u64,
        }
        .line();
        for w in self.waiters.drain(..) {
            let _ = w.send(line.clone());
        }
    }

    /// `pagerctl restart`: stop nbdkit (it answers what it has read; what
    /// it had not, the kernel sends again after the request timeout), and
    /// answer once the next one serves.
    fn restart(&mut self, holder: &Holder, reply: mpsc::Sender<String>) {
        match &mut self.server {
            Some(s) if holder.serving() => {
                s.asked = true;
                if let Err(e) = sys::signal(s.pid, libc::SIGTERM) {
                    let _ = reply.send(format!("error cannot signal nbdkit {}: {e}", s.pid));
                    return;
                }
                tracing::info!("restart: stopping nbdkit {}", s.pid);
                self.waiters.push(reply);
            }
            _ => {
                let _ = reply.send("error no nbdkit serves now (one is being started)".into());
            }
        }
    }

    /// Flushes what nbdkit holds to the donors, then asks it to stop;
    /// false when none runs.
    fn stop_server(&mut self) -> bool {
        for w in self.waiters.drain(..) {
            let _ = w.send("error the device is being detached".into());
        }
        let Some(s) = &self.server else {
            return false;
        };
        let grace = Duration::from_secs(10);
        let flushed = Connection::connect_unix(&self.layout.socket(), &self.a.export, grace)
            .and_then(|mut c| c.flush(grace));
        if let Err(e) = flushed {
            tracing::warn!("flushing nbdkit {} before stopping it: {e}", s.pid);
        }
        let _ = sys::signal(s.pid, libc::SIGTERM);
        true
    }

    fn save(&self) {
        if let Err(e) = self.info.save(&self.layout.holder_json()) {
            tracing::warn!("{e}");
        }
    }
}

/// Answers one request on the holder's socket: `restart` only (a kernel
/// nbd device has no FUSE connection to hand over).
fn answer(mut stream: UnixStream, tx: &mpsc::Sender<Msg>) {
    let Some(request) = handover::read_request(&mut stream) else {
        return;
    };
    let reply = match request {
        Ok(Request::Restart { binary: None }) => {
            let (rtx, rrx) = mpsc::channel();
            if tx.send(Msg::Restart(rtx)).is_err() {
                "error the holder is exiting".to_string()
            } else {
                rrx.recv_timeout(RESTART_WAIT).unwrap_or_else(|_| {
                    format!("error no new nbdkit served within {RESTART_WAIT:?}")
                })
            }
        }
        Ok(Request::Restart { binary: Some(_) }) => {
            "error a kernel nbd device's serving process is nbdkit with the client plugin: upgrade the plugin file, then restart without --binary".to_string()
        }
        Ok(_) => "error a kernel nbd holder only restarts".to_string(),
        Err(e) => format!("error {e}"),
    };
    use std::io::Write;
    let _ = stream.write_all(format!("{reply}\n").as_bytes());
}
