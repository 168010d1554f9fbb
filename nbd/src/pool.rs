//! A small pool of connections per donor export, and batches of requests
//! that run in parallel on several donors with one deadline.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{
    outcome_of, to_result, wait_all, Cmd, Connection, Endpoint, NbdError, Op, Outcome, Timeouts,
    MAX_WAIT,
};
use netpager_util::{CondvarExt, LockExt};

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
        self.state.lock_or_recover()
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
            st = self.cv.wait_or_recover(st);
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

    /// Runs one request with the pool's timeouts.
    pub fn run(&mut self, offset: u64, op: Op<'_>) -> Result<(), NbdError> {
        let t = self.pool.timeouts;
        self.conn().run_spinning(offset, op, t.request, t.spin)
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
const WAVE: usize = MAX_WAIT;

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
        let (mut timeout, mut spin) = (Duration::ZERO, Duration::MAX);
        let mut any = false;
        for g in groups.iter_mut().flatten() {
            let Some(i) = g.next else { continue };
            let r = reqs[i].as_mut().expect("queued requests exist");
            g.op = Some(std::mem::replace(&mut r.op, Op::Flush));
            timeout = timeout.max(g.lease.pool.timeouts.request);
            spin = spin.min(g.lease.pool.timeouts.spin);
            any = true;
        }
        if !any {
            return;
        }
        let mut outcomes: [Option<Outcome>; WAVE] = std::array::from_fn(|_| None);
        let n = groups.len();
        {
            let mut cmds: [Option<Cmd<'_>>; WAVE] = std::array::from_fn(|_| None);
            for ((g, cmd), out) in groups.iter_mut().zip(&mut cmds).zip(&mut outcomes) {
                let Some(Group { lease, next, op }) = g else {
                    continue;
                };
                let (Some(i), Some(op)) = (*next, op.as_mut()) else {
                    continue;
                };
                let offset = reqs[i].as_ref().expect("queued requests exist").offset;
                let conn = lease.conn.as_mut().expect("leased");
                match conn.start(op, offset) {
                    Ok(c) => *cmd = Some(c),
                    Err(e) => *out = Some(Outcome::Failed(e)),
                }
            }
            wait_all(&mut cmds[..n], Instant::now() + timeout, spin);
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
