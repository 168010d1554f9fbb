//! NBD connections to donors through libnbd: one connection
//! ([`Connection`]), a small pool of them per donor ([`Pool`], donors declare
//! multi-conn) and batches of requests that run in parallel on several
//! donors with one deadline ([`run`]).
//!
//! Every wait has a deadline: a donor that does not answer a request within
//! the request timeout gets [`NbdError::Timeout`] and its connection is
//! dropped, so a hung donor can never wedge a caller.

mod ffi;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use ffi::lock_all_memory;
use ffi::{Handle, InFlight, LibError, Outcome};

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
        format!("{}:{}", self.host, self.port)
    }
}

/// Connect and per-request timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub connect: Duration,
    pub request: Duration,
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
}

impl NbdError {
    /// The donor refused for lack of space (budget reached, or draining).
    pub fn is_no_space(&self) -> bool {
        matches!(self, NbdError::Request { errno, .. } if *errno == libc::ENOSPC)
    }
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

    fn len(&self) -> u64 {
        match self {
            Op::Read(b) => b.len() as u64,
            Op::Write(b) => b.len() as u64,
            Op::Zero(n) | Op::Trim(n) => *n,
            Op::Flush => 0,
        }
    }
}

/// One connection to a donor export.
pub struct Connection {
    h: Handle,
    size: u64,
    addr: String,
}

impl Connection {
    /// Connects and negotiates within `timeout`.
    pub fn connect(ep: &Endpoint, timeout: Duration) -> Result<Connection, NbdError> {
        let addr = ep.addr();
        let fail = |e: LibError| NbdError::Connect {
            addr: addr.clone(),
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
                    addr: addr.clone(),
                    export: ep.export.clone(),
                    ms: timeout.as_millis(),
                })
            }
            Outcome::Failed(e) => return Err(fail(e)),
        }
        let size = h.size().map_err(fail)?;
        Ok(Connection { h, size, addr })
    }

    /// Size of the export in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Runs one request, waiting at most `timeout`.
    pub fn run(&mut self, offset: u64, mut op: Op<'_>, timeout: Duration) -> Result<(), NbdError> {
        let (name, len) = (op.name(), op.len());
        let outcome = match start(&mut self.h, &mut op, offset) {
            Err(e) => Outcome::Failed(e),
            Ok(cmd) => {
                let mut cmds = [cmd];
                ffi::wait_all(&mut cmds, Instant::now() + timeout);
                cmds[0].outcome().cloned().unwrap_or(Outcome::TimedOut)
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
        self.h.usable_and_alive()
    }
}

fn start<'a>(h: &'a mut Handle, op: &'a mut Op<'_>, offset: u64) -> Result<InFlight<'a>, LibError> {
    match op {
        Op::Read(buf) => h.start_pread(buf, offset),
        Op::Write(buf) => h.start_pwrite(buf, offset, false),
        Op::Zero(n) => h.start_zero(*n, offset),
        Op::Trim(n) => h.start_trim(*n, offset),
        Op::Flush => h.start_flush(),
    }
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

/// A small pool of connections to one donor export, opened on demand.
pub struct Pool {
    /// Position in lock order: batches check out pools in ascending `order`
    /// so two batches never wait on each other's connections.
    order: usize,
    ep: Endpoint,
    timeouts: Timeouts,
    max: usize,
    state: Mutex<PoolState>,
    cv: Condvar,
}

struct PoolState {
    idle: Vec<Connection>,
    /// Connections of the current generation, idle or leased.
    open: usize,
    closed: bool,
    generation: u64,
    /// Threads waiting in `checkout`: a returned lease wakes one only if
    /// there is one, since a wake-up is a system call even with no waiter.
    waiting: usize,
}

impl Pool {
    /// `order` must be unique among the pools used together in [`run`].
    pub fn new(order: usize, ep: Endpoint, timeouts: Timeouts, max: usize) -> Pool {
        Pool {
            order,
            ep,
            timeouts,
            max: max.max(1),
            state: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
                closed: false,
                generation: 0,
                waiting: 0,
            }),
            cv: Condvar::new(),
        }
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes an idle connection, opens a new one if fewer than the maximum
    /// are open, or waits for one to come back.
    pub fn checkout(&self) -> Result<Lease<'_>, NbdError> {
        let mut st = self.lock();
        loop {
            if st.closed {
                return Err(NbdError::Unavailable {
                    addr: self.ep.addr(),
                });
            }
            if let Some(c) = st.idle.pop() {
                return Ok(Lease {
                    pool: self,
                    conn: Some(c),
                    generation: st.generation,
                });
            }
            if st.open < self.max {
                st.open += 1;
                let generation = st.generation;
                drop(st);
                return match Connection::connect(&self.ep, self.timeouts.connect) {
                    Ok(c) => Ok(Lease {
                        pool: self,
                        conn: Some(c),
                        generation,
                    }),
                    Err(e) => {
                        let mut st = self.lock();
                        if st.generation == generation {
                            st.open -= 1;
                        }
                        if st.waiting > 0 {
                            self.cv.notify_one();
                        }
                        Err(e)
                    }
                };
            }
            st.waiting += 1;
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            st.waiting -= 1;
        }
    }

    /// Drops every connection and refuses new ones until [`Pool::reopen`]
    /// (the donor is marked failed). Leased connections are dropped when
    /// they come back.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.generation += 1;
        st.open = 0;
        st.idle.clear();
        self.cv.notify_all();
    }

    pub fn reopen(&self) {
        self.lock().closed = false;
    }
}

/// A connection borrowed from a [`Pool`]; goes back on drop if still usable.
pub struct Lease<'p> {
    pool: &'p Pool,
    conn: Option<Connection>,
    generation: u64,
}

impl Lease<'_> {
    pub fn conn(&mut self) -> &mut Connection {
        self.conn
            .as_mut()
            .expect("lease holds a connection until dropped")
    }

    /// Runs one request with the pool's request timeout.
    pub fn run(&mut self, offset: u64, op: Op<'_>) -> Result<(), NbdError> {
        let t = self.pool.timeouts.request;
        self.conn().run(offset, op, t)
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        let mut st = self.pool.lock();
        if st.generation == self.generation {
            if conn.usable() && !st.closed {
                st.idle.push(conn);
            } else {
                st.open -= 1;
            }
        }
        if st.waiting > 0 {
            self.pool.cv.notify_one();
        }
    }
}

/// One request of a batch: `op` at `offset` on `pool`'s donor.
pub struct Request<'p, 'b> {
    pub pool: &'p Pool,
    pub offset: u64,
    pub op: Op<'b>,
}

/// Runs a batch: requests to different donors run in parallel, requests to
/// the same donor one after another on one connection. Returns one result
/// per request, in order. A donor that does not answer within the request
/// timeout gets [`NbdError::Timeout`].
pub fn run(reqs: &mut [Request<'_, '_>]) -> Vec<Result<(), NbdError>> {
    let n = reqs.len();
    let mut results: Vec<Option<Result<(), NbdError>>> = vec![None; n];
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (reqs[i].pool.order, i));

    // Check out one connection per donor, in lock order.
    let mut groups: Vec<(Lease<'_>, VecDeque<usize>)> = Vec::new();
    let mut failed_pool: Option<(usize, NbdError)> = None;
    for &i in &order {
        let pool = reqs[i].pool;
        if let Some((o, e)) = &failed_pool {
            if *o == pool.order {
                results[i] = Some(Err(e.clone()));
                continue;
            }
        }
        if let Some((lease, q)) = groups.last_mut() {
            if lease.pool.order == pool.order {
                q.push_back(i);
                continue;
            }
        }
        match pool.checkout() {
            Ok(lease) => groups.push((lease, VecDeque::from([i]))),
            Err(e) => {
                results[i] = Some(Err(e.clone()));
                failed_pool = Some((pool.order, e));
            }
        }
    }

    loop {
        let mut slots: Vec<Option<&mut Request<'_, '_>>> = reqs.iter_mut().map(Some).collect();
        let mut cmds = Vec::new();
        let mut who = Vec::new();
        let mut timeout = Duration::ZERO;
        let mut any = false;
        for (g, (lease, q)) in groups.iter_mut().enumerate() {
            let Some(&i) = q.front() else { continue };
            any = true;
            let r = slots[i].take().expect("each request is in one queue once");
            let (name, len, offset) = (r.op.name(), r.op.len(), r.offset);
            timeout = timeout.max(lease.pool.timeouts.request);
            let addr = lease.pool.ep.addr();
            match start(
                &mut lease.conn.as_mut().expect("leased").h,
                &mut r.op,
                offset,
            ) {
                Ok(c) => {
                    cmds.push(c);
                    who.push((g, i, name, len, offset, addr));
                }
                Err(e) => {
                    results[i] = Some(to_result(
                        &addr,
                        name,
                        offset,
                        len,
                        timeout,
                        Outcome::Failed(e),
                    ));
                    q.pop_front();
                }
            }
        }
        if !any {
            break;
        }
        ffi::wait_all(&mut cmds, Instant::now() + timeout);
        let outcomes: Vec<Outcome> = cmds
            .iter()
            .map(|c| c.outcome().cloned().unwrap_or(Outcome::TimedOut))
            .collect();
        drop(cmds);
        drop(slots);
        for ((g, i, name, len, offset, addr), o) in who.into_iter().zip(outcomes) {
            let (lease, q) = &mut groups[g];
            q.pop_front();
            let res = to_result(&addr, name, offset, len, lease.pool.timeouts.request, o);
            if res.is_err() && !lease.conn().usable() {
                // The connection is gone: the donor's remaining requests fail
                // the same way instead of waiting again.
                for j in q.drain(..) {
                    results[j] = Some(res.clone());
                }
            }
            results[i] = Some(res);
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every request has a result"))
        .collect()
}
