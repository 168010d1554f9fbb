//! Connections given up while replies are still owed to them.
//!
//! nbdkit before 1.33.10 (Debian 12 ships 1.32.5) aborts when a client
//! hangs up while several of its replies are being sent: one worker's send
//! fails, it closes the socket, and the next worker's send trips an
//! assertion (nbdkit commit 9d82aa4f). A donor that aborts loses every
//! page it holds. So a shared connection abandoned with requests in flight
//! is never simply closed: its write side is shut, which tells the server
//! no more requests come (it answers those it has, then hangs up), and
//! what it still sends is read and dropped by one background thread until
//! it hangs up or [`LINGER`] passes.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd};
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

struct Lingering {
    sock: File,
    until: Instant,
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
    let mut d = DRAIN.lock_or_recover();
    if d.socks.len() >= MAX {
        return;
    }
    d.socks.push(Lingering {
        sock: File::from(sock),
        until: Instant::now() + LINGER,
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

/// Sockets the drain holds now.
#[cfg(test)]
pub(crate) fn held() -> usize {
    DRAIN.lock_or_recover().socks.len()
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
                fd: l.sock.as_raw_fd(),
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
                Some(true) => !hung_up(&mut l.sock, &mut scratch),
                _ => true,
            };
            open && now < l.until
        });
    }
}

/// Reads what has arrived; true once the peer hung up or the socket failed.
fn hung_up(sock: &mut File, scratch: &mut [u8]) -> bool {
    loop {
        match sock.read(scratch) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}
