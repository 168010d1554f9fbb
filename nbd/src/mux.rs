//! A plain connection that carries several requests at once: NBD matches
//! each reply to its request by cookie, and a server may answer in any
//! order (nbdkit plugins whose thread model is parallel do).
//!
//! Every request has a slot (its cookie names the slot and the slot's
//! sequence number). A thread sends its request whole under the send lock,
//! then waits. No thread is dedicated to reading: the first waiter takes
//! the reader role and reads replies, each routed to its slot (a read's
//! data goes straight into its waiter's buffer, lent through the slot's
//! [`LoanCell`]), waking that slot's waiter; when its own reply is in, it
//! hands the role to a waiter still waiting. So a lone request (queue
//! depth 1) reads its own reply, as on an unshared connection, with the
//! same spin before sleeping, and at depth one thread reads many replies
//! per wake-up.
//!
//! A request that times out, a broken socket or a reply that matches no
//! request fails the whole connection: every request in flight on it gets
//! an outcome at once, a latch wakes whoever waits on the socket, and the
//! pool opens a new connection for later requests. The socket itself is
//! not closed while replies may still come: it goes to the drain (see
//! `drain`), since closing it under a server still sending can kill the
//! server.

use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::Thread;
use std::time::{Duration, Instant};

use netpager_util::{trace, LockExt};

use crate::plain::Plain;
use crate::sys::{self, Latch, LoanCell};
use crate::wire::{self, Command};
use crate::{LibError, Outcome, Spinner};

/// Requests one connection carries at once.
pub const DEPTH: usize = 64;

/// A plain connection shared by up to [`DEPTH`] requests in flight.
pub(crate) struct Mux {
    conn: Plain,
    /// Held while one request's header and data go out, so requests never
    /// interleave on the wire.
    send: Mutex<()>,
    st: Mutex<State>,
    /// Each slot's read buffer, lent by its waiter to the reader.
    cells: [LoanCell; DEPTH],
    /// Set once the connection failed: no new request starts on it.
    broken: AtomicBool,
    /// Set with `broken`: wakes a thread polling the socket.
    given_up: Latch,
}

struct State {
    slots: [Slot; DEPTH],
    /// Slots held by leases (bit i: slot i).
    reserved: u64,
    /// A thread holds the reader role.
    reading: bool,
}

#[derive(Default)]
struct Slot {
    /// Part of the cookie: a late or duplicate reply never matches a newer
    /// request in the same slot.
    seq: u32,
    phase: Phase,
    /// Bytes of data a successful reply carries (reads).
    want: usize,
    waiter: Option<Thread>,
    /// When its reply was read off the socket, for its waiter's request
    /// clock (`netpager_util::trace`): the time between that and the
    /// waiter running again is the hand-off's.
    read_at: Option<Instant>,
}

#[derive(Default)]
enum Phase {
    #[default]
    Idle,
    /// Sent (or being sent); its reply has not been read.
    Waiting,
    /// The reply is in (or the connection failed).
    Done(Outcome),
}

const _: () = assert!(DEPTH <= u64::BITS as usize, "slots are a u64 bitmask");

fn cookie(slot: usize, seq: u32) -> u64 {
    (u64::from(seq) << 32) | slot as u64
}

impl Mux {
    pub fn new(conn: Plain) -> io::Result<Mux> {
        Ok(Mux {
            conn,
            send: Mutex::new(()),
            st: Mutex::new(State {
                slots: std::array::from_fn(|_| Slot::default()),
                reserved: 0,
                reading: false,
            }),
            cells: std::array::from_fn(|_| LoanCell::new()),
            broken: AtomicBool::new(false),
            given_up: Latch::new()?,
        })
    }

    pub fn size(&self) -> u64 {
        self.conn.size()
    }

    pub fn usable(&self) -> bool {
        !self.broken.load(Ordering::Acquire)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock_or_recover()
    }

    /// Slots held by leases now.
    pub fn reserved(&self) -> usize {
        self.lock().reserved.count_ones() as usize
    }

    /// Holds a free slot for a lease, if one is free.
    pub fn reserve(&self) -> Option<usize> {
        let mut st = self.lock();
        let free = !st.reserved;
        if free == 0 {
            return None;
        }
        let i = free.trailing_zeros() as usize;
        st.reserved |= 1 << i;
        Some(i)
    }

    pub fn release(&self, slot: usize) {
        let mut st = self.lock();
        st.reserved &= !(1 << slot);
        st.slots[slot].phase = Phase::Idle;
        st.slots[slot].waiter = None;
    }

    /// Runs one request in `slot` (reserved by the caller): sends it, then
    /// waits for its reply until `deadline`, reading replies for others
    /// while it holds the reader role.
    pub fn run(
        &self,
        slot: usize,
        op: &mut crate::Op<'_>,
        offset: u64,
        deadline: Instant,
        spin: Duration,
    ) -> Outcome {
        match op {
            crate::Op::Read(buf) => self.start_read(slot, buf, offset, deadline, || {
                self.wait(slot, deadline, spin)
            }),
            op => {
                self.start_op(slot, op, offset, deadline);
                self.wait(slot, deadline, spin)
            }
        }
    }

    /// Sends a read of `buf.len()` bytes at `offset` in `slot` and runs
    /// `then` (which must wait for its reply, [`Mux::wait`]) while `buf`
    /// is lent to the connection's reader.
    pub fn start_read<R>(
        &self,
        slot: usize,
        buf: &mut [u8],
        offset: u64,
        deadline: Instant,
        then: impl FnOnce() -> R,
    ) -> R {
        let want = buf.len();
        self.cells[slot].lend(buf, || {
            self.start(slot, Command::Read, offset, want, &[], deadline);
            then()
        })
    }

    /// Sends a request that carries no read buffer (see [`Mux::run`]).
    pub fn start_op(&self, slot: usize, op: &crate::Op<'_>, offset: u64, deadline: Instant) {
        let (cmd, len, data): (Command, u64, &[u8]) = match op {
            crate::Op::Read(b) => (Command::Read, b.len() as u64, &[]),
            crate::Op::Write(b) => (Command::Write, b.len() as u64, b),
            crate::Op::Zero(n) => (Command::WriteZeroes, *n, &[]),
            crate::Op::Trim(n) => (Command::Trim, *n, &[]),
            crate::Op::Flush => (Command::Flush, 0, &[]),
        };
        debug_assert!(cmd != Command::Read, "reads go through Mux::run");
        self.start(slot, cmd, offset, len as usize, data, deadline);
    }

    /// Registers the request in its slot, then sends it. Failures become
    /// the slot's outcome, which [`Mux::wait`] returns.
    fn start(
        &self,
        slot: usize,
        cmd: Command,
        offset: u64,
        len: usize,
        data: &[u8],
        deadline: Instant,
    ) {
        let c = {
            let mut st = self.lock();
            let s = &mut st.slots[slot];
            s.seq = s.seq.wrapping_add(1);
            s.want = if cmd == Command::Read { len } else { 0 };
            s.waiter = Some(std::thread::current());
            s.read_at = None;
            if !self.usable() {
                s.phase = Phase::Done(Outcome::Failed(LibError::new(
                    "connection abandoned with requests in flight (one timed out or failed)",
                )));
                return;
            }
            if let Err(e) = self.conn.check(cmd, len as u64) {
                s.phase = Phase::Done(Outcome::Failed(e));
                return;
            }
            // Registered before a byte goes out: the reply may be read by
            // another thread as soon as the request is sent.
            s.phase = Phase::Waiting;
            cookie(slot, s.seq)
        };
        let header = wire::request(cmd, 0, c, offset, len as u32);
        let sent = {
            let _g = self.send.lock_or_recover();
            self.send_all(&header, data, deadline)
        };
        match sent {
            Ok(()) => trace::sent(),
            Err(e) => self.fail_waiting(slot, e),
        }
    }

    /// Sends header and data whole (the socket is non-blocking).
    fn send_all(&self, header: &[u8], data: &[u8], deadline: Instant) -> Result<(), Outcome> {
        let fd = self.conn.fd();
        let total = header.len() + data.len();
        let mut sent = 0;
        while sent < total {
            let slices = if sent < header.len() {
                [IoSlice::new(&header[sent..]), IoSlice::new(data)]
            } else {
                [
                    IoSlice::new(&data[sent - header.len()..]),
                    IoSlice::new(&[]),
                ]
            };
            match sys::send(fd, &slices) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait_fd(libc::POLLOUT, deadline)?;
                }
                Err(e) => return Err(lost(e)),
            }
            if !self.usable() {
                return Err(Outcome::Failed(LibError::new("connection abandoned")));
            }
        }
        Ok(())
    }

    /// Waits until the socket is ready for `events` or `deadline` passes
    /// or the connection is given up.
    fn wait_fd(&self, events: libc::c_short, deadline: Instant) -> Result<(), Outcome> {
        let mut fds = [
            libc::pollfd {
                fd: self.conn.fd(),
                events,
                revents: 0,
            },
            libc::pollfd {
                fd: self.given_up.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        match sys::poll(&mut fds, deadline) {
            Ok(_) if !self.usable() => Err(Outcome::Failed(LibError::new("connection abandoned"))),
            Ok(true) => Ok(()),
            Ok(false) => Err(Outcome::TimedOut),
            Err(e) => Err(Outcome::Failed(LibError {
                errno: e.raw_os_error().unwrap_or(libc::EIO),
                message: format!("poll: {e}"),
            })),
        }
    }

    /// Waits for the reply in `slot` and frees the slot for the lease's
    /// next request.
    pub fn wait(&self, slot: usize, deadline: Instant, spin: Duration) -> Outcome {
        loop {
            let mut st = self.lock();
            if matches!(st.slots[slot].phase, Phase::Done(_)) {
                let Phase::Done(o) = std::mem::take(&mut st.slots[slot].phase) else {
                    unreachable!("matched above")
                };
                if let Some(at) = st.slots[slot].read_at.take() {
                    trace::replied(at);
                }
                return o;
            }
            if !st.reading {
                st.reading = true;
                drop(st);
                self.read_until(slot, deadline, spin);
                let mut st = self.lock();
                st.reading = false;
                // Hands the reader role on to a waiter still waiting.
                if let Some(w) = st
                    .slots
                    .iter()
                    .find(|s| matches!(s.phase, Phase::Waiting))
                    .and_then(|s| s.waiter.as_ref())
                {
                    w.unpark();
                }
                continue;
            }
            drop(st);
            let now = Instant::now();
            if now >= deadline {
                self.fail(
                    LibError::new("connection abandoned: a request on it timed out"),
                    Some((slot, Some(Outcome::TimedOut))),
                );
                continue;
            }
            std::thread::park_timeout(deadline - now);
        }
    }

    /// Reads replies as the reader until `me`'s is in or the connection
    /// fails; never stops in the middle of a reply.
    fn read_until(&self, me: usize, deadline: Instant, spin: Duration) {
        let mut spinner = Spinner::try_take(spin);
        let mut hdr = [0u8; wire::REPLY_LEN];
        let mut got = 0;
        loop {
            if got == 0 && self.done(me) {
                return;
            }
            match self.conn.recv(&mut hdr[got..]) {
                Ok(0) => return self.fail_eof(),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if spinner.as_mut().is_some_and(Spinner::again) {
                        continue;
                    }
                    spinner = None;
                    if let Err(o) = self.wait_fd(libc::POLLIN, deadline) {
                        return self.fail_waiting(me, o);
                    }
                }
                Err(e) => return self.fail_lost(e),
            }
            if got < wire::REPLY_LEN {
                continue;
            }
            got = 0;
            if let Err(o) = self.route(&hdr, me, deadline) {
                return self.fail_waiting(me, o);
            }
        }
    }

    /// Routes one reply (its header read): its data into its slot's
    /// buffer, its outcome into its slot, its waiter woken.
    fn route(
        &self,
        hdr: &[u8; wire::REPLY_LEN],
        me: usize,
        deadline: Instant,
    ) -> Result<(), Outcome> {
        let bad = |m: String| {
            Outcome::Failed(LibError {
                errno: libc::EPROTO,
                message: m,
            })
        };
        let (c, errno) =
            wire::any_reply(hdr).map_err(|e| bad(format!("donor sent a bad reply: {e}")))?;
        let slot = (c & 0xffff_ffff) as usize;
        let want = {
            let st = self.lock();
            match st.slots.get(slot) {
                Some(s) if matches!(s.phase, Phase::Waiting) && cookie(slot, s.seq) == c => s.want,
                _ => {
                    return Err(bad(format!(
                        "donor answered cookie {c:#x}, which no request in flight has"
                    )))
                }
            }
        };
        if errno == 0 && want > 0 {
            self.cells[slot].borrow(|buf| match buf {
                Some(buf) if buf.len() == want => self.recv_exact(buf, deadline),
                _ => Err(bad(format!("no buffer lent for the read in slot {slot}"))),
            })?;
        }
        let o = if errno == 0 {
            Outcome::Done
        } else {
            Outcome::Failed(LibError {
                errno: errno as i32,
                message: format!(
                    "the donor answered: {}",
                    io::Error::from_raw_os_error(errno as i32)
                ),
            })
        };
        let read_at = Instant::now();
        let mut st = self.lock();
        let s = &mut st.slots[slot];
        if matches!(s.phase, Phase::Waiting) {
            s.phase = Phase::Done(o);
            s.read_at = Some(read_at);
            if slot != me {
                if let Some(w) = &s.waiter {
                    w.unpark();
                }
            }
        }
        Ok(())
    }

    fn recv_exact(&self, buf: &mut [u8], deadline: Instant) -> Result<(), Outcome> {
        let mut at = 0;
        while at < buf.len() {
            match self.conn.recv(&mut buf[at..]) {
                Ok(0) => return Err(lost(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait_fd(libc::POLLIN, deadline)?
                }
                Err(e) => return Err(lost(e)),
            }
        }
        Ok(())
    }

    fn done(&self, slot: usize) -> bool {
        matches!(self.lock().slots[slot].phase, Phase::Done(_))
    }

    fn fail_eof(&self) {
        self.fail_lost(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the donor closed the connection",
        ))
    }

    fn fail_lost(&self, e: io::Error) {
        let Outcome::Failed(e) = lost(e) else {
            unreachable!("lost() fails")
        };
        self.fail(e, None);
    }

    /// The reader's wait ended without a reply: `o` for its own request,
    /// the connection abandoned for the others.
    fn fail_waiting(&self, me: usize, o: Outcome) {
        match o {
            Outcome::Failed(e) => self.fail(e, None),
            o => self.fail(
                LibError::new("connection abandoned: a request on it timed out"),
                Some((me, Some(o))),
            ),
        }
    }

    /// Fails the connection: every request still waiting gets `why` (and
    /// `except.0` gets `except.1` when given), their waiters are woken and
    /// so is a thread polling the socket, in the middle of a reply or of
    /// sending a request.
    fn fail(&self, why: LibError, except: Option<(usize, Option<Outcome>)>) {
        let mut st = self.lock();
        self.broken.store(true, Ordering::Release);
        for (i, s) in st.slots.iter_mut().enumerate() {
            if !matches!(s.phase, Phase::Waiting) {
                continue;
            }
            let o = match &except {
                Some((j, Some(o))) if *j == i => o.clone(),
                _ => Outcome::Failed(why.clone()),
            };
            s.phase = Phase::Done(o);
            if let Some(w) = &s.waiter {
                w.unpark();
            }
        }
        drop(st);
        // After the outcomes above: the poller this wakes gives any request
        // still waiting a vaguer reason, and must not overwrite these.
        self.given_up.set();
    }
}

impl Drop for Mux {
    fn drop(&mut self) {
        if !self.usable() {
            self.conn.linger();
        }
    }
}

fn lost(e: io::Error) -> Outcome {
    Outcome::Failed(LibError {
        errno: e.raw_os_error().unwrap_or(libc::ECONNRESET),
        message: format!("connection to donor lost: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    use crate::{Endpoint, NbdError, Op, Pool, Timeouts};
    use netpager_test_support::Nbdkit;

    const T: Duration = Duration::from_secs(20);
    /// Requests in flight at once, all on one connection.
    const IN_FLIGHT: usize = 64;

    use super::*;

    /// A pool of plain connections to `addr` with request timeout
    /// `request` and `spin`.
    fn pool(addr: &str, request: Duration, spin: Duration) -> Pool {
        let hp = netpager_util::HostPort::parse(addr).unwrap();
        let ep = Endpoint {
            host: hp.host,
            port: hp.port,
            export: String::new(),
            tls_psk_file: None,
            tls_username: None,
        };
        let t = Timeouts {
            connect: T,
            request,
            spin,
        };
        Pool::new(0, ep, t, 1)
    }

    /// What request `k` of thread `t` writes: its own bytes, so a reply
    /// routed to the wrong waiter shows.
    fn page(t: usize, k: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13) ^ (t as u8).wrapping_mul(71) ^ k as u8)
            .collect()
    }

    /// 64 requests in flight on one connection to a donor that answers
    /// out of order (reads wait 1-4 ms, by size, writes not at all): every
    /// reply reaches its own waiter, every byte reads back, and requests
    /// did finish in another order than they started.
    #[test]
    fn replies_out_of_order_reach_their_waiters() {
        // Reads of more pages take longer (the delay filter waits per
        // read, the rate filter by size): replies overtake each other.
        let d = Nbdkit::with_args(&[
            "--filter=delay",
            "--filter=rate",
            "memory",
            "64M",
            "delay-read=1ms",
            "rate=2G",
        ]);
        let p = pool(&d.addr, T, Duration::from_micros(20));
        let start = Barrier::new(IN_FLIGHT);
        let (began, ended) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let overtaken = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..IN_FLIGHT {
                let (p, start, began, ended, overtaken) = (&p, &start, &began, &ended, &overtaken);
                s.spawn(move || {
                    let mut lease = p.checkout().unwrap();
                    // Thread t owns 64 KiB at t * 64 KiB; sizes vary by thread.
                    let len = 4096 * (1 + t % 8);
                    let base = (t * 65536) as u64;
                    start.wait();
                    for k in 0..8 {
                        let data = page(t, k, len);
                        lease.run(base, Op::Write(&data)).unwrap();
                        let mut back = vec![0u8; len];
                        let order = began.fetch_add(1, Ordering::SeqCst);
                        lease.run(base, Op::Read(&mut back)).unwrap();
                        if ended.fetch_add(1, Ordering::SeqCst) != order {
                            overtaken.fetch_add(1, Ordering::Relaxed);
                        }
                        assert!(
                            back == data,
                            "thread {t} request {k}: another reply's bytes"
                        );
                        // Zero and trim come back without data in between.
                        if k % 3 == 0 {
                            lease.run(base + len as u64, Op::Zero(4096)).unwrap();
                            lease.run(base + len as u64, Op::Trim(4096)).unwrap();
                        }
                    }
                });
            }
        });
        assert!(
            overtaken.load(Ordering::Relaxed) > 0,
            "no reply finished out of order: the test shows nothing"
        );
        // Everything went over one connection.
        assert_eq!(p.open_connections(), 1);
        // And every page holds what its thread wrote last.
        let mut lease = p.checkout().unwrap();
        for t in 0..IN_FLIGHT {
            let len = 4096 * (1 + t % 8);
            let mut back = vec![0u8; len];
            lease.run((t * 65536) as u64, Op::Read(&mut back)).unwrap();
            assert!(back == page(t, 7, len), "thread {t}: final read");
        }
    }

    /// A request that times out with others in flight fails them all at
    /// once (the connection is out of use), the pool opens a new one, and
    /// the donor, once it runs again, survives answering the old one.
    #[test]
    fn a_timeout_fails_the_shared_connection_and_the_pool_opens_another() {
        let mut d = Nbdkit::memory("1M");
        // Long enough that a loaded machine never passes for a hung donor
        // once it runs again.
        let p = pool(&d.addr, Duration::from_secs(3), Duration::ZERO);
        p.checkout()
            .unwrap()
            .run(0, Op::Write(&[7u8; 4096]))
            .unwrap();
        d.stop();
        let results: Vec<Result<(), NbdError>> = std::thread::scope(|s| {
            // Many in flight: nbdkit answers them on several threads.
            let hs: Vec<_> = (0..32)
                .map(|_| {
                    s.spawn(|| {
                        let mut b = [0u8; 4096];
                        p.checkout().unwrap().run(0, Op::Read(&mut b))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(Result::is_err), "{results:?}");
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(NbdError::Timeout { .. }))),
            "{results:?}"
        );
        d.cont();
        // Connections the pool tried while the donor was stopped wait in
        // its accept queue, and nbdkit may reset them once it runs again:
        // the pool must get through within a few tries.
        let mut b = [0u8; 4096];
        let mut last = None;
        for _ in 0..5 {
            match p.checkout().and_then(|mut l| l.run(0, Op::Read(&mut b))) {
                Ok(()) => {
                    last = None;
                    break;
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // The abandoned connection was not closed under the donor while
        // it answered (nbdkit 1.32 aborts then); it was drained instead,
        // and the donor hung up on it once done.
        assert_eq!(d.exited(), None, "the donor died");
        assert!(last.is_none(), "the pool never got through: {last:?}");
        assert_eq!(b, [7u8; 4096]);
        assert_eq!(
            crate::drain::wait_ended(Duration::from_secs(10)),
            0,
            "the donor never hung up"
        );
        assert_eq!(d.exited(), None, "the donor died");
    }
}
