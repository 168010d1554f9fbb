//! NBD connections to donors through libnbd: one connection
//! ([`Connection`]), a small pool of them per donor ([`Pool`], donors declare
//! multi-conn) and batches of requests that run in parallel on several
//! donors with one deadline ([`run`]).
//!
//! Every wait has a deadline: a donor that does not answer a request within
//! the request timeout gets [`NbdError::Timeout`] and its connection is
//! dropped, so a hung donor can never wedge a caller.

#[allow(unsafe_code)]
mod ffi;

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
                let mut cmds = [Some(cmd)];
                ffi::wait_all(&mut cmds, Instant::now() + timeout);
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

/// How a started command ended (`TimedOut` if it is still running).
fn outcome_of(cmd: &Option<InFlight<'_>>) -> Outcome {
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
                // Its full size now: returning a lease never allocates.
                idle: Vec::with_capacity(max.max(1)),
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
/// timeout gets [`NbdError::Timeout`]. See [`run_into`].
pub fn run(reqs: &mut [Request<'_, '_>]) -> Vec<Result<(), NbdError>> {
    let mut batch: Vec<Option<Request<'_, '_>>> = reqs
        .iter_mut()
        .map(|r| {
            Some(Request {
                pool: r.pool,
                offset: r.offset,
                op: r.op.reborrow(),
            })
        })
        .collect();
    let mut results = vec![Ok(()); batch.len()];
    run_into(&mut batch, &mut results);
    results
}

/// Donors one wave of a batch talks to in parallel.
const WAVE: usize = ffi::MAX_WAIT;

/// One donor's part of a wave: a connection and the request running on it.
struct Group<'p, 'b> {
    lease: Lease<'p>,
    /// The request to run next on it, or the one running.
    next: Option<usize>,
    /// The running request's op, out of the batch while it runs.
    op: Option<Op<'b>>,
}

/// [`run`] without allocating: `None` entries are skipped, and the result
/// of request `i` goes to `results[i]` (left alone for `None`). Up to 32
/// donors (the widest parity group, so a device batch never has more) run
/// in parallel; the donors of a larger batch run in successive waves.
pub fn run_into(reqs: &mut [Option<Request<'_, '_>>], results: &mut [Result<(), NbdError>]) {
    assert_eq!(reqs.len(), results.len(), "one result per request");
    // Pools below `from` are done. Within a wave, connections are checked
    // out in ascending pool order, so two batches never wait on each
    // other's connections; a wave gives its connections back before the
    // next one starts.
    let mut from = 0;
    loop {
        let mut groups: [Option<Group<'_, '_>>; WAVE] = std::array::from_fn(|_| None);
        let mut n = 0;
        let mut more = false;
        while n < WAVE {
            let Some(first) = lowest_pool(reqs, from) else {
                break;
            };
            let pool = reqs[first].as_ref().expect("found above").pool;
            from = pool.order + 1;
            more = true;
            match pool.checkout() {
                Ok(lease) => {
                    groups[n] = Some(Group {
                        lease,
                        next: Some(first),
                        op: None,
                    });
                    n += 1;
                }
                Err(e) => {
                    for (r, res) in reqs.iter().zip(results.iter_mut()) {
                        if r.as_ref().is_some_and(|r| r.pool.order == pool.order) {
                            *res = Err(e.clone());
                        }
                    }
                }
            }
        }
        if !more {
            return;
        }
        run_wave(reqs, results, &mut groups[..n]);
    }
}

/// The first request on the pool with the lowest order at or above `from`.
fn lowest_pool(reqs: &[Option<Request<'_, '_>>], from: usize) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None;
    for (i, r) in reqs.iter().enumerate() {
        let Some(r) = r else { continue };
        let o = r.pool.order;
        if o >= from && best.is_none_or(|(b, _)| o < b) {
            best = Some((o, i));
        }
    }
    best.map(|(_, i)| i)
}

/// The next request at or after `at` on the pool of order `order`.
fn next_on(reqs: &[Option<Request<'_, '_>>], order: usize, at: usize) -> Option<usize> {
    reqs[at..]
        .iter()
        .position(|r| r.as_ref().is_some_and(|r| r.pool.order == order))
        .map(|k| at + k)
}

/// Runs the groups' requests, one per group at a time, all groups at once.
fn run_wave<'b>(
    reqs: &mut [Option<Request<'_, 'b>>],
    results: &mut [Result<(), NbdError>],
    groups: &mut [Option<Group<'_, 'b>>],
) {
    loop {
        let mut timeout = Duration::ZERO;
        let mut any = false;
        for g in groups.iter_mut().flatten() {
            let Some(i) = g.next else { continue };
            let r = reqs[i].as_mut().expect("queued requests exist");
            g.op = Some(std::mem::replace(&mut r.op, Op::Flush));
            timeout = timeout.max(g.lease.pool.timeouts.request);
            any = true;
        }
        if !any {
            return;
        }
        let mut outcomes: [Option<Outcome>; WAVE] = std::array::from_fn(|_| None);
        let n = groups.len();
        {
            let mut cmds: [Option<InFlight<'_>>; WAVE] = std::array::from_fn(|_| None);
            for ((g, cmd), out) in groups.iter_mut().zip(&mut cmds).zip(&mut outcomes) {
                let Some(Group { lease, next, op }) = g else {
                    continue;
                };
                let (Some(i), Some(op)) = (*next, op.as_mut()) else {
                    continue;
                };
                let offset = reqs[i].as_ref().expect("queued requests exist").offset;
                let h = &mut lease.conn.as_mut().expect("leased").h;
                match start(h, op, offset) {
                    Ok(c) => *cmd = Some(c),
                    Err(e) => *out = Some(Outcome::Failed(e)),
                }
            }
            ffi::wait_all(&mut cmds[..n], Instant::now() + timeout);
            for (cmd, out) in cmds.iter().zip(&mut outcomes) {
                if cmd.is_some() {
                    *out = Some(outcome_of(cmd));
                }
            }
        }
        for (g, o) in groups.iter_mut().zip(outcomes) {
            let (Some(g), Some(o)) = (g.as_mut(), o) else {
                continue;
            };
            let i = g.next.expect("it ran a request");
            let r = reqs[i].as_mut().expect("queued requests exist");
            r.op = g.op.take().expect("taken above");
            let order = r.pool.order;
            let t = g.lease.pool.timeouts.request;
            let res = to_result(
                &g.lease.conn().addr,
                r.op.name(),
                r.offset,
                r.op.len(),
                t,
                o,
            );
            g.next = next_on(reqs, order, i + 1);
            if res.is_err() && !g.lease.conn().usable() {
                // The connection is gone: the donor's remaining requests fail
                // the same way instead of waiting again.
                while let Some(j) = g.next {
                    results[j] = res.clone();
                    g.next = next_on(reqs, order, j + 1);
                }
            }
            results[i] = res;
        }
    }
}
