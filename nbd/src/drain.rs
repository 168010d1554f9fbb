//! Connections given up while replies are still owed to them.
//!
//! nbdkit before 1.33.10 (Debian 12 ships 1.32.5) aborts when a client
//! hangs up while a connection's replies are being sent, and a donor that
//! aborts loses every page it holds:
//! - plain: one worker's send fails, it closes the socket, and the next
//!   worker's send trips an assertion (nbdkit commit 9d82aa4f);
//! - TLS: the thread that sees the client gone sends the TLS goodbye
//!   (`gnutls_bye` from `connection_set_status`) while another encrypts a
//!   reply on the same session, and nettle asserts (the nemesis, mirror
//!   seed 8000004: "nettle_chacha_poly1305_encrypt: Assertion ...").
//!
//! So a connection abandoned with requests in flight is never simply
//! closed. A plain one has its write side shut, which tells the server no
//! more requests come (it answers those it has, then hangs up). A TLS one
//! cannot say so without driving libnbd, whose abandoned command's buffer
//! is gone, and a bare TCP shutdown is the hang-up that trips the bug: it
//! stays open, and is closed once its replies are in (nothing more arrived
//! for [`QUIET`] after something did), when no thread of the server is
//! sending on it any more. One background thread reads and drops what
//! arrives on each until then, or until [`LINGER`] passes.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use netpager_util::LockExt;

use crate::sys;

/// How long a stopped or hung donor may take to answer what it was asked
/// before its connection is closed anyway.
const LINGER: Duration = Duration::from_secs(600);

/// Sockets held at most: beyond this a given-up connection is closed at
/// once (a client that abandons this many connections has worse trouble).
const MAX: usize = 1024;

/// How often the thread looks at the deadlines when nothing arrives.
const TICK: Duration = Duration::from_millis(200);

/// A TLS connection whose replies started arriving is closed once nothing
/// more came for this long: a reply of megabytes takes milliseconds once
/// the donor runs.
const QUIET: Duration = Duration::from_secs(2);

struct Lingering {
    fd: RawFd,
    /// Keeps the socket open; dropped (closing it) when the entry goes: a
    /// plain connection's socket (`File`), or a libnbd TLS handle given up
    /// with a command in flight (`ffi::Abandoned`), whose socket is read
    /// behind libnbd's back, as libnbd never runs again.
    _owner: Box<dyn Send>,
    until: Instant,
    /// TLS: when it is closed, [`QUIET`] after the last bytes arrived.
    close_at: Option<Instant>,
    tls: bool,
}

struct Drain {
    socks: Vec<Lingering>,
    /// The drain thread runs; it exits when the last socket goes.
    running: bool,
}

static DRAIN: Mutex<Drain> = Mutex::new(Drain {
    socks: Vec::new(),
    running: false,
});

/// Takes over `sock` (a non-blocking socket whose write side the caller
/// has shut): reads and drops what arrives until the peer hangs up.
pub(crate) fn adopt(sock: OwnedFd) {
    let fd = sock.as_raw_fd();
    hold(fd, Box::new(File::from(sock)), false);
}

/// Takes over a TLS handle given up with a command in flight, `fd` its
/// socket: reads and drops what arrives until its replies are in.
pub(crate) fn adopt_tls(h: crate::ffi::Abandoned, fd: RawFd) {
    hold(fd, Box::new(h), true);
}

fn hold(fd: RawFd, owner: Box<dyn Send>, tls: bool) {
    let mut d = DRAIN.lock_or_recover();
    if d.socks.len() >= MAX {
        return;
    }
    d.socks.push(Lingering {
        fd,
        _owner: owner,
        until: Instant::now() + LINGER,
        close_at: None,
        tls,
    });
    if !d.running {
        d.running = std::thread::Builder::new()
            .name("nbd-drain".into())
            .stack_size(64 << 10)
            .spawn(run)
            .is_ok();
        if !d.running {
            d.socks.clear();
        }
    }
}

/// How long a process about to exit waits for its given-up connections:
/// a donor that runs answers them in milliseconds; one still stopped or
/// cut off may never.
pub const EXIT_WAIT: Duration = Duration::from_secs(10);

/// Waits until the drain holds no connection, or `within` has passed;
/// returns how many it still holds. Call it with [`EXIT_WAIT`] before the
/// process exits: exiting closes them at once, the hang-up that aborts an
/// nbdkit still answering on them (the nemesis's late-writes schedule: a
/// detach right after a partition healed closed connections the donor was
/// still answering, and it aborted).
pub fn wait_ended(within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        let n = DRAIN.lock_or_recover().socks.len();
        if n == 0 || Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(TICK / 4);
    }
}

fn run() {
    let mut scratch = vec![0u8; 64 << 10];
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        fds.clear();
        {
            let mut d = DRAIN.lock_or_recover();
            if d.socks.is_empty() {
                d.running = false;
                return;
            }
            fds.extend(d.socks.iter().map(|l| libc::pollfd {
                fd: l.fd,
                events: libc::POLLIN,
                revents: 0,
            }));
        }
        // A failed poll (only on a broken process) just waits a tick.
        if sys::poll(&mut fds, Instant::now() + TICK).is_err() {
            std::thread::sleep(TICK);
        }
        let now = Instant::now();
        let mut d = DRAIN.lock_or_recover();
        // Sockets adopted since the poll sit past `fds` and stay.
        let mut i = 0;
        d.socks.retain_mut(|l| {
            let ready = fds.get(i).map(|p| p.revents != 0);
            i += 1;
            let open = match ready {
                Some(true) => match read_all(l.fd, &mut scratch) {
                    Arrived::HungUp => false,
                    Arrived::Some if l.tls => {
                        l.close_at = Some(now + QUIET);
                        true
                    }
                    Arrived::Some | Arrived::Nothing => true,
                },
                _ => true,
            };
            open && now < l.until && l.close_at.is_none_or(|q| now < q)
        });
    }
}

enum Arrived {
    Nothing,
    Some,
    HungUp,
}

/// Reads and drops what has arrived on the non-blocking socket `fd`.
fn read_all(fd: RawFd, scratch: &mut [u8]) -> Arrived {
    let mut got = Arrived::Nothing;
    loop {
        match sys::recv_nowait(fd, scratch) {
            Ok(0) => return Arrived::HungUp,
            Ok(_) => got = Arrived::Some,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return got,
            Err(_) => return Arrived::HungUp,
        }
    }
}
