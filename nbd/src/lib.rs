//! netpager-nbd: talking NBD to donors. One connection ([`Connection`]),
//! a small pool of them per donor ([`Pool`], donors declare multi-conn)
//! and batches of requests that run in parallel on several donors with one
//! deadline ([`run`]).
//!
//! Two transports behind one API: plain TCP (or a unix socket) is spoken
//! by this crate itself (`plain`, protocol bytes in [`wire`]), so a request
//! costs one `sendmsg` and, once its reply is there, one `readv`; TLS with a
//! pre-shared key goes through libnbd (`ffi`), which has GnuTLS.
//!
//! Every wait has a deadline: a donor that does not answer a request within
//! the request timeout gets [`NbdError::Timeout`] and its connection is
//! dropped, so a hung donor can never wedge a caller. Before sleeping in
//! `poll(2)`, a waiter on plain connections may look at its sockets for a
//! short while ([`Timeouts::spin`]): a donor's reply usually comes within
//! tens of microseconds, and a sleeping thread's wake-up costs as much.
//!
//! For the kernel's own nbd driver, [`Connection::handover_unix`] gives
//! away a negotiated socket, and [`kernel`] (messages in [`genl`]) connects,
//! reconfigures and disconnects `/dev/nbdN` over generic netlink.

mod drain;
#[allow(unsafe_code)]
mod ffi;
pub mod genl;
pub mod kernel;
mod mux;
mod plain;
mod pool;
#[allow(unsafe_code)]
mod sys;
pub mod wire;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub use drain::{wait_ended as wait_given_up_ended, EXIT_WAIT};
use ffi::{Handle, InFlight};
pub use mux::DEPTH as REQUESTS_PER_CONNECTION;
use plain::{Buf, Plain, PlainCmd};
pub use pool::{run, run_into, Check, Lease, Pool, Request};
use wire::Command;

/// Most commands one wait drives at once (one per member of the widest
/// parity group): its bookkeeping lives on the stack, not the heap.
pub const MAX_WAIT: usize = 32;

/// Where a donor's export is and how to authenticate to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub export: String,
    /// TLS pre-shared key file (`nbdkit --tls-psk`); TLS is required when set.
    pub tls_psk_file: Option<PathBuf>,
    /// User name for the PSK (libnbd defaults to the login name).
    pub tls_username: Option<String>,
}

impl Endpoint {
    pub fn addr(&self) -> String {
        netpager_util::HostPort {
            host: self.host.clone(),
            port: self.port,
        }
        .to_string()
    }
}

/// Connect and per-request timeouts, and how long a waiter spins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub connect: Duration,
    pub request: Duration,
    /// How long a request's waiter keeps looking at its plain sockets
    /// before it sleeps in poll(2) (zero: sleep at once). At most one
    /// thread of the process spins at a time, so spinning never takes
    /// more than one CPU.
    pub spin: Duration,
}

/// Errors talking to one donor.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NbdError {
    #[error("cannot connect to donor {addr} export {export:?}: {message}")]
    Connect {
        addr: String,
        export: String,
        message: String,
    },
    #[error("connecting to donor {addr} export {export:?} timed out after {ms} ms")]
    ConnectTimeout {
        addr: String,
        export: String,
        ms: u128,
    },
    #[error(
        "{op} of {len} bytes at offset {offset} on donor {addr} failed: {message} (errno {errno})"
    )]
    Request {
        addr: String,
        op: &'static str,
        offset: u64,
        len: u64,
        errno: i32,
        message: String,
    },
    #[error("{op} of {len} bytes at offset {offset} on donor {addr} timed out after {ms} ms")]
    Timeout {
        addr: String,
        op: &'static str,
        offset: u64,
        len: u64,
        ms: u128,
    },
    #[error("donor {addr} is marked failed; no new connections")]
    Unavailable { addr: String },
    /// A new connection reached an export that is not the one the pool's
    /// earlier connections served (see [`Pool::verified`]).
    #[error("donor {addr}: {message}")]
    Restarted { addr: String, message: String },
}

impl NbdError {
    /// The donor refused for lack of space (budget reached, or draining).
    pub fn is_no_space(&self) -> bool {
        matches!(self, NbdError::Request { errno, .. } if *errno == libc::ENOSPC)
    }

    /// Nothing listens at the donor's address (its process is gone): the
    /// kernel refused the connection.
    pub fn is_refused(&self) -> bool {
        matches!(self, NbdError::Connect { message, .. } if message.contains("Connection refused"))
    }

    /// The donor refused a request because a newer session of the same
    /// device owns the export (pager-server answers EPERM for nothing
    /// else).
    pub fn is_fenced(&self) -> bool {
        matches!(self, NbdError::Request { errno, .. } if *errno == libc::EPERM)
    }

    /// A new connection found the export changed under it: the donor
    /// restarted (see [`Pool::verified`]).
    pub fn is_restarted(&self) -> bool {
        matches!(self, NbdError::Restarted { .. })
    }
}

/// A failure below the request level: its errno and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LibError {
    pub errno: i32,
    pub message: String,
}

impl LibError {
    fn new(message: impl Into<String>) -> Self {
        LibError {
            errno: libc::ENOTCONN,
            message: message.into(),
        }
    }
}

/// How a command or a connect attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Done,
    Failed(LibError),
    TimedOut,
}

/// One NBD request.
pub enum Op<'b> {
    Read(&'b mut [u8]),
    Write(&'b [u8]),
    /// Write this many zero bytes (the donor may free the pages).
    Zero(u64),
    /// Discard this many bytes.
    Trim(u64),
    Flush,
}

impl Op<'_> {
    fn name(&self) -> &'static str {
        match self {
            Op::Read(_) => "read",
            Op::Write(_) => "write",
            Op::Zero(_) => "zero",
            Op::Trim(_) => "trim",
            Op::Flush => "flush",
        }
    }

    /// The same request, borrowing its buffer for a shorter time.
    pub fn reborrow(&mut self) -> Op<'_> {
        match self {
            Op::Read(b) => Op::Read(b),
            Op::Write(b) => Op::Write(b),
            Op::Zero(n) => Op::Zero(*n),
            Op::Trim(n) => Op::Trim(*n),
            Op::Flush => Op::Flush,
        }
    }

    fn len(&self) -> u64 {
        match self {
            Op::Read(b) => b.len() as u64,
            Op::Write(b) => b.len() as u64,
            Op::Zero(n) | Op::Trim(n) => *n,
            Op::Flush => 0,
        }
    }
}

enum Transport {
    Plain(Plain),
    Tls { h: Handle, size: u64 },
}

/// A socket negotiated up to transmission, no request sent on it yet.
#[derive(Debug)]
pub struct Negotiated {
    pub fd: std::os::fd::OwnedFd,
    /// The export's size in bytes.
    pub size: u64,
    /// The export's transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
}

/// One connection to a donor export.
pub struct Connection {
    t: Transport,
    addr: String,
}

impl Connection {
    /// Connects and negotiates within `timeout`: in our own code, or
    /// through libnbd when the endpoint asks for TLS.
    pub fn connect(ep: &Endpoint, timeout: Duration) -> Result<Connection, NbdError> {
        let addr = ep.addr();
        let t = if ep.tls_psk_file.is_some() {
            connect_tls(ep, &addr, timeout)?
        } else {
            Plain::connect_tcp(&ep.host, ep.port, &ep.export, timeout)
                .map(Transport::Plain)
                .map_err(|e| connect_error(e, &addr, &ep.export, timeout))?
        };
        Ok(Connection { t, addr })
    }

    /// Connects to an NBD server on a unix socket (plain).
    pub fn connect_unix(
        path: &Path,
        export: &str,
        timeout: Duration,
    ) -> Result<Connection, NbdError> {
        let addr = path.display().to_string();
        let p = Plain::connect_unix(path, export, timeout)
            .map_err(|e| connect_error(e, &addr, export, timeout))?;
        Ok(Connection {
            t: Transport::Plain(p),
            addr,
        })
    }

    /// Whether an NBD server answers on the unix socket `path` (its
    /// greeting, then `NBD_OPT_ABORT`: no export is opened).
    pub fn probe_unix(path: &Path, timeout: Duration) -> Result<(), NbdError> {
        Plain::probe_unix(path, timeout)
            .map_err(|e| connect_error(e, &path.display().to_string(), "", timeout))
    }

    /// Negotiates with the NBD server on the unix socket `path` up to
    /// transmission and gives the socket away, for the kernel's nbd driver
    /// to send requests on ([`kernel::NbdNetlink::connect`]).
    pub fn handover_unix(
        path: &Path,
        export: &str,
        timeout: Duration,
    ) -> Result<Negotiated, NbdError> {
        let addr = path.display().to_string();
        let p = Plain::connect_unix(path, export, timeout)
            .map_err(|e| connect_error(e, &addr, export, timeout))?;
        let (fd, size, flags) = p.into_socket().map_err(|e| NbdError::Connect {
            addr,
            export: export.to_string(),
            message: format!("blocking socket: {e}"),
        })?;
        Ok(Negotiated { fd, size, flags })
    }

    /// Size of the export in bytes.
    pub fn size(&self) -> u64 {
        match &self.t {
            Transport::Plain(p) => p.size(),
            Transport::Tls { size, .. } => *size,
        }
    }

    /// Runs one request, waiting at most `timeout`.
    pub fn run(&mut self, offset: u64, op: Op<'_>, timeout: Duration) -> Result<(), NbdError> {
        self.run_spinning(offset, op, timeout, Duration::ZERO)
    }

    /// [`Connection::run`], spinning up to `spin` before sleeping.
    fn run_spinning(
        &mut self,
        offset: u64,
        mut op: Op<'_>,
        timeout: Duration,
        spin: Duration,
    ) -> Result<(), NbdError> {
        let (name, len) = (op.name(), op.len());
        let outcome = match self.start(&mut op, offset) {
            Err(e) => Outcome::Failed(e),
            Ok(cmd) => {
                let mut cmds = [Some(cmd)];
                wait_all(&mut cmds, Instant::now() + timeout, spin);
                outcome_of(&cmds[0])
            }
        };
        to_result(&self.addr, name, offset, len, timeout, outcome)
    }

    pub fn pread(
        &mut self,
        buf: &mut [u8],
        offset: u64,
        timeout: Duration,
    ) -> Result<(), NbdError> {
        self.run(offset, Op::Read(buf), timeout)
    }

    pub fn pwrite(&mut self, buf: &[u8], offset: u64, timeout: Duration) -> Result<(), NbdError> {
        self.run(offset, Op::Write(buf), timeout)
    }

    pub fn zero(&mut self, len: u64, offset: u64, timeout: Duration) -> Result<(), NbdError> {
        self.run(offset, Op::Zero(len), timeout)
    }

    pub fn trim(&mut self, len: u64, offset: u64, timeout: Duration) -> Result<(), NbdError> {
        self.run(offset, Op::Trim(len), timeout)
    }

    pub fn flush(&mut self, timeout: Duration) -> Result<(), NbdError> {
        self.run(0, Op::Flush, timeout)
    }

    /// False once the connection broke or a request on it was abandoned.
    fn usable(&self) -> bool {
        match &self.t {
            Transport::Plain(p) => p.usable(),
            Transport::Tls { h, .. } => h.usable_and_alive(),
        }
    }

    fn start<'a>(&'a mut self, op: &'a mut Op<'_>, offset: u64) -> Result<Cmd<'a>, LibError> {
        match &mut self.t {
            Transport::Plain(p) => {
                let (cmd, buf) = match op {
                    Op::Read(b) => (Command::Read, Buf::In(b)),
                    Op::Write(b) => (Command::Write, Buf::Out(b)),
                    Op::Zero(n) => (Command::WriteZeroes, Buf::Len(*n)),
                    Op::Trim(n) => (Command::Trim, Buf::Len(*n)),
                    Op::Flush => (Command::Flush, Buf::Len(0)),
                };
                p.start(cmd, 0, offset, buf).map(Cmd::Plain)
            }
            Transport::Tls { h, .. } => match op {
                Op::Read(buf) => h.start_pread(buf, offset),
                Op::Write(buf) => h.start_pwrite(buf, offset, false),
                Op::Zero(n) => h.start_zero(*n, offset),
                Op::Trim(n) => h.start_trim(*n, offset),
                Op::Flush => h.start_flush(),
            }
            .map(Cmd::Tls),
        }
    }
}

fn connect_error(e: plain::ConnectError, addr: &str, export: &str, timeout: Duration) -> NbdError {
    match e {
        plain::ConnectError::TimedOut => NbdError::ConnectTimeout {
            addr: addr.to_string(),
            export: export.to_string(),
            ms: timeout.as_millis(),
        },
        plain::ConnectError::Failed(message) => NbdError::Connect {
            addr: addr.to_string(),
            export: export.to_string(),
            message,
        },
    }
}

fn connect_tls(ep: &Endpoint, addr: &str, timeout: Duration) -> Result<Transport, NbdError> {
    let fail = |e: LibError| NbdError::Connect {
        addr: addr.to_string(),
        export: ep.export.clone(),
        message: e.message,
    };
    let mut h = Handle::new(&format!("netpager {addr}/{}", ep.export)).map_err(fail)?;
    h.set_export_name(&ep.export).map_err(fail)?;
    if let Some(psk) = &ep.tls_psk_file {
        h.set_tls_psk(&psk.to_string_lossy(), ep.tls_username.as_deref())
            .map_err(fail)?;
    }
    match h.connect_tcp(&ep.host, &ep.port.to_string(), Instant::now() + timeout) {
        Outcome::Done => {}
        Outcome::TimedOut => {
            return Err(NbdError::ConnectTimeout {
                addr: addr.to_string(),
                export: ep.export.clone(),
                ms: timeout.as_millis(),
            })
        }
        Outcome::Failed(e) => return Err(fail(e)),
    }
    let size = h.size().map_err(fail)?;
    Ok(Transport::Tls { h, size })
}

/// A started request on either transport.
enum Cmd<'a> {
    Plain(PlainCmd<'a>),
    Tls(InFlight<'a>),
}

impl Cmd<'_> {
    fn outcome(&self) -> Option<&Outcome> {
        match self {
            Cmd::Plain(c) => c.outcome(),
            Cmd::Tls(c) => c.outcome(),
        }
    }

    /// Moves the request on without blocking.
    fn progress(&mut self) {
        match self {
            Cmd::Plain(c) => c.progress(),
            Cmd::Tls(c) => c.poll_completion(),
        }
    }

    fn pollfd(&self) -> Result<libc::pollfd, LibError> {
        let (fd, events) = match self {
            Cmd::Plain(c) => (c.fd(), c.events()),
            Cmd::Tls(c) => c.poll_interest()?,
        };
        Ok(libc::pollfd {
            fd,
            events,
            revents: 0,
        })
    }

    /// Reacts to what poll(2) reported for this request's socket.
    fn ready(&mut self, revents: libc::c_short) {
        match self {
            Cmd::Plain(c) => c.progress(),
            Cmd::Tls(c) => c.ready(revents),
        }
    }

    fn fail(&mut self, o: Outcome) {
        match self {
            Cmd::Plain(c) => c.set_outcome(o),
            Cmd::Tls(c) => c.set_outcome(o),
        }
    }
}

/// Threads spinning in [`wait_all`] right now.
static SPINNERS: AtomicUsize = AtomicUsize::new(0);
/// At most this many threads spin at once.
const MAX_SPINNERS: usize = 1;

/// Drives every command until each has an outcome or `deadline` passes;
/// commands still running then get `Outcome::TimedOut` (and their
/// connections are given up when they are dropped). A broken socket fails
/// only the command on it. `None` entries are skipped; at most
/// [`MAX_WAIT`] entries. For up to `spin`, sockets are looked at again
/// without sleeping (only if no other thread is spinning).
fn wait_all(cmds: &mut [Option<Cmd<'_>>], deadline: Instant, spin: Duration) {
    assert!(cmds.len() <= MAX_WAIT, "{} commands at once", cmds.len());
    let pending = |cmds: &mut [Option<Cmd<'_>>]| {
        cmds.iter_mut()
            .flatten()
            .filter(|c| c.outcome().is_none())
            .count()
    };
    for c in cmds.iter_mut().flatten() {
        c.progress();
    }
    if !spin.is_zero() && pending(cmds) > 0 {
        spin_until_done(cmds, spin);
    }
    loop {
        let unused = libc::pollfd {
            fd: -1,
            events: 0,
            revents: 0,
        };
        let mut fds = [unused; MAX_WAIT];
        for (c, p) in cmds.iter_mut().zip(&mut fds) {
            let Some(c) = c.as_mut().filter(|c| c.outcome().is_none()) else {
                continue;
            };
            // A negative fd (the unused entry) is ignored by poll(2).
            match c.pollfd() {
                Ok(pfd) => *p = pfd,
                Err(e) => c.fail(Outcome::Failed(e)),
            }
        }
        if pending(cmds) == 0 {
            return;
        }
        let n = cmds.len();
        let o = match sys::poll(&mut fds[..n], deadline) {
            Ok(true) => None,
            Ok(false) => Some(Outcome::TimedOut),
            Err(e) => Some(Outcome::Failed(LibError {
                errno: e.raw_os_error().unwrap_or(libc::EIO),
                message: format!("poll: {e}"),
            })),
        };
        for (c, p) in cmds.iter_mut().zip(&fds) {
            let Some(c) = c.as_mut().filter(|c| c.outcome().is_none()) else {
                continue;
            };
            match &o {
                Some(o) => c.fail(o.clone()),
                None if p.revents != 0 => c.ready(p.revents),
                None => {}
            }
        }
    }
}

/// Looks at the commands' sockets without sleeping for up to `spin`, or
/// until every command has an outcome; does nothing if another thread is
/// spinning already.
fn spin_until_done(cmds: &mut [Option<Cmd<'_>>], spin: Duration) {
    // libnbd's commands move only when poll(2) says so.
    if cmds.iter().flatten().any(|c| matches!(c, Cmd::Tls(_))) {
        return;
    }
    let Some(mut spinner) = Spinner::try_take(spin) else {
        return;
    };
    while cmds.iter().flatten().any(|c| c.outcome().is_none()) && spinner.again() {
        for c in cmds.iter_mut().flatten() {
            c.progress();
        }
    }
}

/// The right to spin for a while instead of sleeping in poll(2), held by
/// at most [`MAX_SPINNERS`] threads at once.
pub(crate) struct Spinner {
    until: Instant,
}

impl Spinner {
    /// The right to spin for `spin`, if no other thread holds it.
    pub(crate) fn try_take(spin: Duration) -> Option<Spinner> {
        if spin.is_zero() {
            return None;
        }
        if SPINNERS.fetch_add(1, Ordering::AcqRel) < MAX_SPINNERS {
            return Some(Spinner {
                until: Instant::now() + spin,
            });
        }
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
        None
    }

    /// Whether to look again (after yielding the CPU: a donor on this
    /// machine may wait for this very CPU) rather than sleep.
    pub(crate) fn again(&mut self) -> bool {
        if Instant::now() >= self.until {
            return false;
        }
        std::thread::yield_now();
        true
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a started command ended (`TimedOut` if it is still running).
fn outcome_of(cmd: &Option<Cmd<'_>>) -> Outcome {
    cmd.as_ref()
        .and_then(|c| c.outcome().cloned())
        .unwrap_or(Outcome::TimedOut)
}

fn to_result(
    addr: &str,
    op: &'static str,
    offset: u64,
    len: u64,
    timeout: Duration,
    o: Outcome,
) -> Result<(), NbdError> {
    match o {
        Outcome::Done => Ok(()),
        Outcome::TimedOut => Err(NbdError::Timeout {
            addr: addr.to_string(),
            op,
            offset,
            len,
            ms: timeout.as_millis(),
        }),
        Outcome::Failed(e) => Err(NbdError::Request {
            addr: addr.to_string(),
            op,
            offset,
            len,
            errno: e.errno,
            message: e.message,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netpager_test_support::{Nbdkit, PSK_USER};

    const T: Duration = Duration::from_secs(5);

    fn endpoint(addr: &str, psk: Option<&Path>) -> Endpoint {
        let hp = netpager_util::HostPort::parse(addr).unwrap();
        Endpoint {
            host: hp.host,
            port: hp.port,
            export: String::new(),
            tls_psk_file: psk.map(Path::to_path_buf),
            tls_username: psk.map(|_| PSK_USER.into()),
        }
    }

    /// A read whose wait fails in poll(2) must fail, and its connection must
    /// never serve another request: libnbd (TLS) may still hold the read's
    /// buffer, and a plain connection is out of step. Before, a failed poll
    /// left a libnbd handle usable with the command still queued in it.
    #[test]
    fn a_failed_poll_fails_the_request_and_retires_the_connection() {
        let dir = tempfile::tempdir().unwrap();
        let mut plain = Nbdkit::memory("1M");
        let (mut tls, psk) = Nbdkit::memory_tls("1M", dir.path());
        let (plain_ep, tls_ep) = (endpoint(&plain.addr, None), endpoint(&tls.addr, Some(&psk)));
        for (server, ep) in [(&mut plain, plain_ep), (&mut tls, tls_ep)] {
            let mut c = Connection::connect(&ep, T).unwrap();
            c.pwrite(&[5u8; 4096], 0, T).unwrap();
            let mut b = [0u8; 4096];
            // The server is stopped, so the reply cannot be there before
            // the wait reaches poll(2).
            server.stop();
            let mut op = Op::Read(&mut b);
            let cmd = c.start(&mut op, 0).unwrap();
            sys::FAIL_NEXT_POLL.with(|f| f.set(Some(libc::EBADF)));
            let mut cmds = [Some(cmd)];
            wait_all(&mut cmds, Instant::now() + T, Duration::ZERO);
            match outcome_of(&cmds[0]) {
                Outcome::Failed(e) => assert!(e.message.contains("poll"), "{e:?}"),
                o => panic!("{}: {o:?}", ep.addr()),
            }
            drop(cmds);
            server.cont();
            assert!(!c.usable(), "{}: the connection was kept", ep.addr());
            assert!(c.pread(&mut b, 0, T).is_err());
            // A new connection serves the data.
            let mut c = Connection::connect(&ep, T).unwrap();
            c.pread(&mut b, 0, T).unwrap();
            assert_eq!(b, [5u8; 4096]);
        }
    }
}
