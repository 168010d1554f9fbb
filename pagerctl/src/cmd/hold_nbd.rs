//! `pagerctl hold-nbd`: the holder of a restartable kernel nbd device.
//!
//! It runs the device's serving process, nbdkit with the client plugin on
//! the state directory's unix socket, as its child; negotiates a
//! connection with it and gives the socket to the kernel
//! (`NBD_CMD_CONNECT` of /dev/nbdN with the request and dead-conn
//! timeouts). It listens to the driver's `NBD_CMD_LINK_DEAD` notices. When
//! nbdkit exits while the device is attached (a crash, a kill -9,
//! `pagerctl restart`), or stalls until the kernel gives up on its
//! connection (then it is killed), it starts the next one, negotiates
//! again and, once the kernel has announced the old connection dead, gives
//! it the new socket (`NBD_CMD_RECONFIGURE`): within the dead-conn timeout
//! the kernel's requests wait instead of failing. On SIGTERM (detach) it
//! disconnects the device, stops nbdkit (killing it past a deadline) and
//! exits. When to do what is `pagerctl::attach::nbd_hold`.
//!
//! Like `pagerctl hold` it sits on the swap path: memory locked, out of
//! every memory cgroup, exempt from the OOM killer (nbdkit inherits the
//! last two).

use std::collections::VecDeque;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use netpager_nbd::genl::{ConnectConfig, GenlError};
use netpager_nbd::kernel::NbdNetlink;
use netpager_nbd::{Connection, Negotiated};
use pager_fuse::handover::{self, Request, Restarted};
use pagerctl::attach::commands;
use pagerctl::attach::nbd_hold::{Action, Event, Holder, Kill};
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
    /// connection, once there is one); the kernel then gives up on the
    /// connection, and the holder replaces its nbdkit.
    #[arg(long, default_value = "10", value_parser = parse_secs, value_name = "SECS")]
    nbd_timeout: Duration,
    /// How long nbdkit may take to stop (a restart, a detach) before it is
    /// killed; shorter than detach's own --timeout.
    #[arg(long, default_value = "30", value_parser = parse_secs, value_name = "SECS")]
    stop_timeout: Duration,
}

/// How often the holder looks at its child and its socket.
const POLL: Duration = Duration::from_millis(20);

/// How long `pagerctl restart` may wait for the next nbdkit to serve.
const RESTART_WAIT: Duration = Duration::from_secs(60);

/// What the signal, socket and notice threads tell the main loop.
enum Msg {
    Detach(libc::c_int),
    Restart(mpsc::Sender<String>),
    /// `NBD_CMD_LINK_DEAD` for our device.
    LinkDead,
    /// The kernel's notices were lost; `for_good`: the watch failed.
    NoticesLost {
        for_good: bool,
    },
}

/// The running nbdkit.
struct Server {
    child: Child,
    pid: u32,
    born: Instant,
    /// Stopped by the holder for `pagerctl restart`.
    asked: bool,
    /// Killed by the holder, and why.
    killed: Option<Kill>,
    /// Its socket is negotiated (given to the kernel, or about to be).
    negotiated: bool,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    let index = commands::nbd_index(&a.device)?;
    // Refused before anything is set up where the driver is not loaded.
    let mut kernel = NbdNetlink::open().context("cannot reach the kernel's nbd driver")?;
    // Listening before the first connect: no notice is missed.
    let mut watch = kernel
        .watch_link_dead()
        .context("cannot listen to the kernel's nbd notices")?;
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
    {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name("link-dead".into())
            .spawn(move || loop {
                let msg = match watch.wait() {
                    Ok(indexes) if indexes.contains(&index) => Msg::LinkDead,
                    Ok(_) => continue,
                    Err(GenlError::Overrun) => {
                        tracing::error!("{}", GenlError::Overrun);
                        Msg::NoticesLost { for_good: false }
                    }
                    Err(e) => {
                        tracing::error!("listening to the kernel's nbd notices: {e}; a reconnect now waits only for the new nbdkit");
                        let _ = tx.send(Msg::NoticesLost { for_good: true });
                        return;
                    }
                };
                if tx.send(msg).is_err() {
                    return;
                }
            })
            .context("cannot start the notice thread")?;
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
        kernel_sock: None,
        waiters: Vec::new(),
        blind: false,
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
    // nbdkit leaves its socket behind.
    let _ = std::fs::remove_file(layout.socket());
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
    /// Our end of the socket the kernel has: shut for writing, it tells
    /// nbdkit that no request follows (`pagerctl restart`).
    kernel_sock: Option<UnixStream>,
    /// `pagerctl restart` callers waiting for the next nbdkit to serve.
    waiters: Vec<mpsc::Sender<String>>,
    /// The kernel's notices can no longer be heard.
    blind: bool,
}

impl Hold<'_> {
    fn main_loop(&mut self, kernel: &mut NbdNetlink, rx: &mpsc::Receiver<Msg>) -> Result<()> {
        let mut holder = Holder::new(self.a.dead_conn_timeout, self.a.stop_timeout);
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
            let mut events = VecDeque::new();
            if let Some(ev) = self.watch_server()? {
                events.push_back(ev);
            }
            let mut msgs: Vec<Msg> = rx.recv_timeout(POLL).into_iter().collect();
            msgs.extend(rx.try_iter());
            for msg in msgs {
                match msg {
                    Msg::Detach(sig) => {
                        tracing::info!("signal {sig}: disconnecting {}", self.a.device.display());
                        events.push_back(Event::Detach);
                    }
                    Msg::Restart(reply) => {
                        self.waiters.push(reply);
                        events.push_back(Event::Restart);
                    }
                    Msg::LinkDead => {
                        tracing::info!(
                            "the kernel marked {}'s connection dead",
                            self.a.device.display()
                        );
                        // A crash closes the socket before its process can
                        // be reaped: its exit comes first, so that it
                        // counts as the crash it is.
                        if let Some(ev) = self.reap_exiting()? {
                            events.push_back(ev);
                        }
                        events.push_back(Event::LinkDead);
                    }
                    Msg::NoticesLost { for_good } => {
                        self.blind |= for_good;
                        events.push_back(Event::NoticesLost);
                    }
                }
            }
            if self.blind && events.contains(&Event::Negotiated) {
                events.push_back(Event::NoticesLost);
            }
            events.push_back(Event::Tick);
            while let Some(ev) = events.pop_front() {
                for action in holder.on(ev, Instant::now()) {
                    match action {
                        Action::Connect => self.connect(kernel)?,
                        Action::Reconfigure => events.push_back(self.reconfigure(kernel)),
                        Action::Served { held, late } => self.served(held, late),
                        Action::Start { after } => start_at = Some(Instant::now() + after),
                        Action::Drain => self.drain(),
                        Action::Kill(why) => self.kill(why),
                        Action::Expired { down } => {
                            tracing::error!(
                                "no nbdkit has served {} for {down:?}, past the dead-conn timeout: the kernel fails its requests until one does (swapped pages read meanwhile are lost to their jobs)",
                                self.a.device.display()
                            );
                            self.info.expired += 1;
                            self.save();
                        }
                        Action::Disconnect => {
                            // Its last connection closes: nbdkit exits, as asked.
                            if let Some(s) = &mut self.server {
                                s.asked = true;
                            }
                            if let Err(e) = kernel.disconnect(self.index) {
                                tracing::error!("disconnecting {}: {e}", self.a.device.display());
                            }
                            self.kernel_sock = None;
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
                        Action::RefuseRestart => {
                            if let Some(w) = self.waiters.pop() {
                                let _ = w.send(
                                    "error no nbdkit serves now (one is being started)".into(),
                                );
                            }
                        }
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
            killed: None,
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
            return Ok(Some(self.exited(status)));
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

    /// The exit of a server that is on its way out (its socket already
    /// closed), reaped now.
    fn reap_exiting(&mut self) -> Result<Option<Event>> {
        let Some(s) = &mut self.server else {
            return Ok(None);
        };
        if !procs::exiting(s.pid) {
            return Ok(None);
        }
        let status = s.child.wait().context("cannot reap nbdkit")?;
        Ok(Some(self.exited(status)))
    }

    /// Records the server's exit; the event for the state machine.
    fn exited(&mut self, status: std::process::ExitStatus) -> Event {
        let s = self.server.take().expect("a server exited");
        let (pid, lived, asked) = (s.pid, s.born.elapsed(), s.asked);
        self.socket = None;
        self.info.serve_pid = None;
        self.info.serve_started = None;
        match s.killed {
            Some(Kill::LinkDead) => {
                self.info.link_dead += 1;
                tracing::warn!(
                    "nbdkit {pid} killed ({status}): the kernel had given up on its connection"
                );
            }
            Some(Kill::Refused) => {
                self.info.refused += 1;
                tracing::warn!("nbdkit {pid} killed ({status}): the kernel refused its socket");
            }
            Some(Kill::StopTimedOut) => {
                tracing::warn!(
                    "nbdkit {pid} killed ({status}): it did not stop within {:?}",
                    self.a.stop_timeout
                );
            }
            None if asked => tracing::info!("nbdkit {pid} stopped as asked ({status})"),
            None => {
                self.info.crashes += 1;
                tracing::warn!("nbdkit {pid} exited ({status}) with the device attached");
            }
        }
        self.save();
        Event::ServerExited { lived, asked }
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
        self.kernel_sock = Some(UnixStream::from(n.fd));
        self.served(Duration::ZERO, false);
        tracing::info!(
            "{} connected to nbdkit {} ({} bytes)",
            self.a.device.display(),
            self.info.serve_pid.unwrap_or(0),
            n.size
        );
        Ok(())
    }

    /// Gives the kernel the negotiated socket in place of the dead one.
    fn reconfigure(&mut self, kernel: &mut NbdNetlink) -> Event {
        let Some(n) = self.socket.take() else {
            return Event::ReconfigureFailed;
        };
        match kernel.reconfigure(self.index, &[n.fd.as_raw_fd()]) {
            Ok(()) => {
                self.kernel_sock = Some(UnixStream::from(n.fd));
                Event::Reconfigured
            }
            Err(e) => {
                tracing::error!(
                    "cannot give {} nbdkit {}'s connection: {e}; replacing that nbdkit",
                    self.a.device.display(),
                    self.info.serve_pid.unwrap_or(0),
                );
                Event::ReconfigureFailed
            }
        }
    }

    /// Records that the current nbdkit serves, and answers `restart`.
    fn served(&mut self, held: Duration, late: bool) {
        let pid = self.info.serve_pid.unwrap_or(0);
        if self.info.ready_pid.is_some() {
            if late {
                tracing::error!(
                    "{} reconnected after {held:?}, past the dead-conn timeout: requests failed meanwhile",
                    self.a.device.display()
                );
            } else {
                tracing::info!(
                    "{} reconnected to nbdkit {pid}; requests were held {} ms",
                    self.a.device.display(),
                    held.as_millis()
                );
            }
        }
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

    /// `pagerctl restart`: the kernel's socket shut for writing. nbdkit
    /// answers the requests it has read, sees the end of the stream and,
    /// its last connection closed, exits (exitlast; its plugin's unload
    /// flushes). What the kernel sends meanwhile waits for the next nbdkit;
    /// what it had sent and gets no answer from a connection it has marked
    /// dead, it sends again after the request timeout.
    fn drain(&mut self) {
        let Some(s) = &mut self.server else {
            return;
        };
        s.asked = true;
        tracing::info!("restart: ending nbdkit {}'s request stream", s.pid);
        let shut = match &self.kernel_sock {
            Some(k) => k.shutdown(Shutdown::Write),
            None => Err(std::io::Error::from(std::io::ErrorKind::NotConnected)),
        };
        if let Err(e) = shut {
            // It would wait for a request that never comes: stop it.
            tracing::warn!(
                "cannot shut the kernel's connection for writing ({e}); stopping nbdkit {}",
                s.pid
            );
            let _ = sys::signal(s.pid, libc::SIGTERM);
        }
    }

    fn kill(&mut self, why: Kill) {
        let Some(s) = &mut self.server else {
            return;
        };
        match why {
            Kill::LinkDead => tracing::warn!(
                "nbdkit {} stalled past the request timeout ({:?}): killing it, so that nothing it holds lands after the kernel's retries",
                s.pid,
                self.a.nbd_timeout
            ),
            Kill::Refused => tracing::warn!("killing nbdkit {}, whose socket the kernel refused", s.pid),
            Kill::StopTimedOut => tracing::warn!(
                "nbdkit {} did not stop within {:?}: killing it",
                s.pid,
                self.a.stop_timeout
            ),
        }
        s.killed = Some(why);
        if let Err(e) = sys::signal(s.pid, libc::SIGKILL) {
            tracing::error!("cannot kill nbdkit {}: {e}", s.pid);
        }
    }

    /// Asks nbdkit to stop (the device is disconnected: it has no request
    /// left to fail; its plugin's unload flushes to the donors); false
    /// when none runs.
    fn stop_server(&mut self) -> bool {
        for w in self.waiters.drain(..) {
            let _ = w.send("error the device is being detached".into());
        }
        let Some(s) = &mut self.server else {
            return false;
        };
        s.asked = true;
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
