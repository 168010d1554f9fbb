//! A small pool of connections per donor export, and batches of requests
//! that run in parallel on several donors with one deadline.
//!
//! Plain connections are shared ([`Mux`]): each carries up to
//! [`DEPTH`](crate::mux::DEPTH) requests at once, and a lease holds one of
//! its slots, so a donor serves many requests in flight on a few
//! connections. A TLS connection (libnbd) carries one request at a time
//! and a lease holds it whole.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::mux::{Mux, DEPTH};
use crate::plain::Plain;
use crate::{
    outcome_of, to_result, wait_all, Cmd, Connection, Endpoint, NbdError, Op, Outcome, Timeouts,
    MAX_WAIT,
};
use netpager_util::{CondvarExt, LockExt};

/// Leases a shared connection carries before the pool opens another (up
/// to its maximum): a few connections with many requests each keep the
/// donor's threads busy without a thread and a socket per request.
const SPREAD: usize = 16;

/// What a pool asks of each connection it opens after its first (see
/// [`Pool::verified`]).
pub type Check = Arc<dyn Fn(&mut Lease<'_>) -> Result<(), NbdError> + Send + Sync>;

/// A small pool of connections to one donor export, opened on demand.
pub struct Pool {
    /// Position in lock order: batches check out pools in ascending `order`
    /// so two batches never wait on each other's connections. Unique among
    /// live pools (a batch tells its donors apart by it).
    order: usize,
    ep: Endpoint,
    /// `ep`'s address, made once: errors name it, and making it on the
    /// request path would allocate.
    addr: String,
    timeouts: Timeouts,
    max: usize,
    /// The export name ends in a session (`...:SESSION[@SIZE]`, a netpager
    /// device's): each round of connections adds its number
    /// (`:SESSION.ROUND`), so the donor refuses requests still queued on
    /// connections a [`Pool::close`] gave up on once a new round connects.
    /// Rounds are drawn from one counter shared by every pool of the
    /// session, so two pools that reach one export (a donor named twice
    /// for a moment) never reuse each other's numbers.
    rounds: Option<Arc<AtomicU64>>,
    check: Option<Check>,
    state: Mutex<PoolState>,
    cv: Condvar,
}

struct PoolState {
    /// TLS connections not leased.
    idle: Vec<Connection>,
    /// Plain connections of the current generation, leased or not.
    shared: Vec<Arc<Mux>>,
    /// Connections of the current generation, idle, leased or shared.
    open: usize,
    closed: bool,
    generation: u64,
    /// The export name's round of connections (numbered pools).
    round: u64,
    /// Threads waiting in `checkout`: a returned lease wakes one only if
    /// there is one, since a wake-up is a system call even with no waiter.
    waiting: usize,
    /// A connection has been opened: later ones pass `check` first.
    connected: bool,
}

impl Pool {
    /// `order` must differ from that of every other pool used in the same
    /// batches: a batch groups its requests by it (and panics on two pools
    /// with one order, which would send one donor's requests on the
    /// other's connection).
    pub fn new(order: usize, ep: Endpoint, timeouts: Timeouts, max: usize) -> Pool {
        Pool {
            order,
            addr: ep.addr(),
            ep,
            timeouts,
            max: max.max(1),
            rounds: None,
            check: None,
            state: Mutex::new(PoolState {
                // Their full sizes now: returning a lease never allocates.
                idle: Vec::with_capacity(max.max(1)),
                shared: Vec::with_capacity(max.max(1)),
                open: 0,
                closed: false,
                generation: 0,
                round: 0,
                waiting: 0,
                connected: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Numbers each round of connections in the export name, from the
    /// session's counter `rounds` (see the field).
    pub fn numbered(mut self, rounds: Arc<AtomicU64>) -> Pool {
        self.lock().round = rounds.fetch_add(1, Ordering::AcqRel) + 1;
        self.rounds = Some(rounds);
        self
    }

    /// Every connection opened after the pool's first runs `check` on its
    /// lease before it carries a request or is shared; one that fails it
    /// is closed and `checkout` returns the error. A server restarted at
    /// the same address accepts a new connection to an export of the same
    /// name, empty: a request sent again after its connection broke must
    /// not read that as the data the first process held. The check (the
    /// client's: its label is still there) tells the two apart.
    pub fn verified(mut self, check: Check) -> Pool {
        self.check = Some(check);
        self
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// The export name connections of round `round` ask for.
    fn export_of(&self, round: u64) -> String {
        if self.rounds.is_none() {
            return self.ep.export.clone();
        }
        match self.ep.export.split_once('@') {
            Some((name, size)) => format!("{name}.{round}@{size}"),
            None => format!("{}.{round}", self.ep.export),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock_or_recover()
    }

    /// A slot on the least busy shared connection, unless it is busy
    /// enough that opening another is better.
    fn shared_slot(&self, st: &PoolState) -> Option<Lease<'_>> {
        let (m, n) = st
            .shared
            .iter()
            .filter(|m| m.usable())
            .map(|m| (m, m.reserved()))
            .min_by_key(|(_, n)| *n)?;
        if n >= DEPTH || (n >= SPREAD && st.open < self.max) {
            return None;
        }
        let slot = m.reserve()?;
        Some(Lease {
            pool: self,
            conn: Leased::Shared {
                mux: m.clone(),
                slot,
            },
            generation: st.generation,
        })
    }

    /// Takes a slot on a shared connection or an idle connection, opens a
    /// new one if fewer than the maximum are open, or waits for one to
    /// come back.
    pub fn checkout(&self) -> Result<Lease<'_>, NbdError> {
        let mut st = self.lock();
        loop {
            if st.closed {
                return Err(NbdError::Unavailable {
                    addr: self.ep.addr(),
                });
            }
            if let Some(l) = self.shared_slot(&st) {
                return Ok(l);
            }
            if let Some(c) = st.idle.pop() {
                return Ok(Lease {
                    pool: self,
                    conn: Leased::Own(Some(c)),
                    generation: st.generation,
                });
            }
            if st.open < self.max {
                st.open += 1;
                let (generation, round) = (st.generation, st.round);
                let check = self.check.as_ref().filter(|_| st.connected);
                drop(st);
                let opened = self.connect(round).and_then(|conn| {
                    let conn = match conn {
                        Leased::Shared { mux, .. } => {
                            let slot = mux.reserve().expect("a new connection has free slots");
                            Leased::Shared { mux, slot }
                        }
                        own => own,
                    };
                    let mut lease = Lease {
                        pool: self,
                        conn,
                        generation,
                    };
                    match check.map_or(Ok(()), |c| c(&mut lease)) {
                        Ok(()) => Ok(lease),
                        Err(e) => {
                            // Closed, not kept: nothing may run on it.
                            lease.discard();
                            Err(e)
                        }
                    }
                });
                let mut st = self.lock();
                return match opened {
                    Ok(lease) => {
                        st.connected = true;
                        if let (Leased::Shared { mux, .. }, true) =
                            (&lease.conn, st.generation == generation)
                        {
                            st.shared.push(mux.clone());
                        }
                        if st.waiting > 0 {
                            // Others may share the new connection.
                            self.cv.notify_all();
                        }
                        Ok(lease)
                    }
                    Err(e) => {
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

    fn connect(&self, round: u64) -> Result<Leased, NbdError> {
        let t = self.timeouts.connect;
        let export = self.export_of(round);
        if self.ep.tls_psk_file.is_some() {
            let ep = Endpoint {
                export,
                ..self.ep.clone()
            };
            return Connection::connect(&ep, t).map(|c| Leased::Own(Some(c)));
        }
        let p = Plain::connect_tcp(&self.ep.host, self.ep.port, &export, t)
            .map_err(|e| crate::connect_error(e, &self.ep.addr(), &export, t))?;
        let mux = Mux::new(p).map_err(|e| NbdError::Connect {
            addr: self.addr.clone(),
            export,
            message: format!("eventfd: {e}"),
        })?;
        Ok(Leased::Shared {
            mux: Arc::new(mux),
            slot: 0,
        })
    }

    /// Drops every connection and refuses new ones until [`Pool::reopen`]
    /// (the donor is marked failed). Leased connections are dropped when
    /// they come back.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        self.next_round(&mut st);
    }

    /// Drops every connection if the pool is still at `generation` (see
    /// [`Pool::generation`]): the next checkout connects on a new round
    /// (the donor refused that generation's requests because a newer round
    /// of the same export connected). Only once per generation: each new
    /// round fences the one before, so callers that saw the same refusal
    /// must not each open one. Unlike [`Pool::close`] then
    /// [`Pool::reopen`], no checkout meanwhile is refused.
    pub fn renew_from(&self, generation: u64) {
        let mut st = self.lock();
        if st.generation == generation {
            self.next_round(&mut st);
        }
    }

    fn next_round(&self, st: &mut PoolState) {
        st.generation += 1;
        if let Some(r) = &self.rounds {
            st.round = r.fetch_add(1, Ordering::AcqRel) + 1;
        }
        st.open = 0;
        st.idle.clear();
        st.shared.clear();
        self.cv.notify_all();
    }

    pub fn reopen(&self) {
        self.lock().closed = false;
    }

    /// The round of connections open now (counted up by [`Pool::close`]).
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Connections open now (for tests of how requests share them).
    #[cfg(test)]
    pub(crate) fn open_connections(&self) -> usize {
        self.lock().open
    }
}

/// What a lease holds.
enum Leased {
    /// A connection of its own (TLS).
    Own(Option<Connection>),
    /// A slot on a shared connection (plain).
    Shared { mux: Arc<Mux>, slot: usize },
}

/// A connection, or a slot on a shared one, borrowed from a [`Pool`]; goes
/// back on drop.
pub struct Lease<'p> {
    pool: &'p Pool,
    conn: Leased,
    generation: u64,
}

impl Lease<'_> {
    /// Size of the export in bytes.
    pub fn size(&self) -> u64 {
        match &self.conn {
            Leased::Own(c) => c.as_ref().expect("held until dropped").size(),
            Leased::Shared { mux, .. } => mux.size(),
        }
    }

    fn usable(&self) -> bool {
        match &self.conn {
            Leased::Own(c) => c.as_ref().is_some_and(Connection::usable),
            Leased::Shared { mux, .. } => mux.usable(),
        }
    }

    /// The donor's address, as errors name it.
    pub fn addr(&self) -> &str {
        &self.pool.addr
    }

    /// Drops a connection that failed the pool's check without giving it
    /// back: the caller accounts for it as never opened.
    fn discard(mut self) {
        if let Leased::Own(c) = &mut self.conn {
            drop(c.take());
        }
        // Of no generation: Drop frees its slot and counts nothing.
        self.generation = u64::MAX;
    }

    /// Runs one request with the pool's timeouts.
    pub fn run(&mut self, offset: u64, mut op: Op<'_>) -> Result<(), NbdError> {
        let t = self.pool.timeouts;
        match &mut self.conn {
            Leased::Own(c) => c
                .as_mut()
                .expect("held until dropped")
                .run_spinning(offset, op, t.request, t.spin),
            Leased::Shared { mux, slot } => {
                let o = mux.run(*slot, &mut op, offset, Instant::now() + t.request, t.spin);
                to_result(self.addr(), op.name(), offset, op.len(), t.request, o)
            }
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let mut st = self.pool.lock();
        let current = st.generation == self.generation;
        match &mut self.conn {
            Leased::Own(c) => {
                let Some(conn) = c.take() else { return };
                if current {
                    if conn.usable() && !st.closed {
                        st.idle.push(conn);
                    } else {
                        st.open -= 1;
                    }
                }
            }
            Leased::Shared { mux, slot } => {
                mux.release(*slot);
                if current && !mux.usable() {
                    let before = st.shared.len();
                    st.shared.retain(|m| !Arc::ptr_eq(m, mux));
                    st.open -= before - st.shared.len();
                }
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
                        if r.as_ref().is_some_and(|r| same_pool(r.pool, pool)) {
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

/// The next request at or after `at` on `pool`.
fn next_on(reqs: &[Option<Request<'_, '_>>], pool: &Pool, at: usize) -> Option<usize> {
    reqs[at..]
        .iter()
        .position(|r| r.as_ref().is_some_and(|r| same_pool(r.pool, pool)))
        .map(|k| at + k)
}

/// Whether `a` and `b` are one pool; panics on two pools with one order,
/// which a batch would take for one (sending one donor's requests on the
/// other's connection).
fn same_pool(a: &Pool, b: &Pool) -> bool {
    if a.order != b.order {
        return false;
    }
    assert!(
        std::ptr::eq(a, b),
        "two NBD pools share order {} ({} and {}): each donor's pool needs its own",
        a.order,
        a.ep.addr(),
        b.ep.addr()
    );
    true
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
        let deadline = Instant::now() + timeout;
        let mut outcomes: [Option<Outcome>; WAVE] = std::array::from_fn(|_| None);
        let n = groups.len();
        {
            // Each group's part: a request on a connection of its own
            // (TLS), or in a slot of a shared one (its read buffer, if a
            // read, lent to the shared connection's reader).
            let mut own: [Option<(&mut Connection, &mut Op<'b>, u64)>; WAVE] =
                std::array::from_fn(|_| None);
            let mut shared: [Option<(&Mux, usize, u64)>; WAVE] = [None; WAVE];
            let mut reads: [Option<&mut [u8]>; WAVE] = std::array::from_fn(|_| None);
            for (k, g) in groups.iter_mut().enumerate() {
                let Some(Group { lease, next, op }) = g else {
                    continue;
                };
                let (Some(i), Some(op)) = (*next, op.as_mut()) else {
                    continue;
                };
                let offset = reqs[i].as_ref().expect("queued requests exist").offset;
                match &mut lease.conn {
                    Leased::Own(c) => own[k] = Some((c.as_mut().expect("leased"), op, offset)),
                    Leased::Shared { mux, slot } => {
                        shared[k] = Some((&**mux, *slot, offset));
                        match op {
                            Op::Read(b) => reads[k] = Some(&mut **b),
                            op => mux.start_op(*slot, op, offset, deadline),
                        }
                    }
                }
            }
            lend_reads(&shared[..n], &mut reads[..n], deadline, &mut || {
                let mut cmds: [Option<Cmd<'_>>; WAVE] = std::array::from_fn(|_| None);
                for ((o, cmd), out) in own.iter_mut().zip(&mut cmds).zip(&mut outcomes) {
                    let Some((conn, op, offset)) = o else {
                        continue;
                    };
                    match conn.start(op, *offset) {
                        Ok(c) => *cmd = Some(c),
                        Err(e) => *out = Some(Outcome::Failed(e)),
                    }
                }
                if cmds.iter().any(Option::is_some) {
                    wait_all(&mut cmds[..n], deadline, spin);
                }
                for (cmd, out) in cmds.iter().zip(&mut outcomes) {
                    if cmd.is_some() {
                        *out = Some(outcome_of(cmd));
                    }
                }
                for (sh, out) in shared.iter().zip(&mut outcomes) {
                    if let Some((mux, slot, _)) = sh {
                        *out = Some(mux.wait(*slot, deadline, spin));
                    }
                }
            });
        }
        for (g, o) in groups.iter_mut().zip(outcomes) {
            let (Some(g), Some(o)) = (g.as_mut(), o) else {
                continue;
            };
            let i = g.next.expect("it ran a request");
            let r = reqs[i].as_mut().expect("queued requests exist");
            r.op = g.op.take().expect("taken above");
            let t = g.lease.pool.timeouts.request;
            let res = to_result(g.lease.addr(), r.op.name(), r.offset, r.op.len(), t, o);
            g.next = next_on(reqs, g.lease.pool, i + 1);
            if res.is_err() && !g.lease.usable() {
                // The connection is gone: the donor's remaining requests fail
                // the same way instead of waiting again.
                while let Some(j) = g.next {
                    results[j] = res.clone();
                    g.next = next_on(reqs, g.lease.pool, j + 1);
                }
            }
            results[i] = res;
        }
    }
}

/// Lends each read buffer in `reads` to its shared connection and sends
/// the read, then runs `then` (which waits for the replies) while they
/// are all lent.
fn lend_reads(
    shared: &[Option<(&Mux, usize, u64)>],
    reads: &mut [Option<&mut [u8]>],
    deadline: Instant,
    then: &mut dyn FnMut(),
) {
    let (Some((first, rest)), Some((sh, more))) = (reads.split_first_mut(), shared.split_first())
    else {
        return then();
    };
    match (sh, first) {
        (Some((mux, slot, offset)), Some(buf)) => {
            mux.start_read(*slot, buf, *offset, deadline, || {
                lend_reads(more, rest, deadline, then)
            })
        }
        _ => lend_reads(more, rest, deadline, then),
    }
}
