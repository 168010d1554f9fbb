//! The system calls the plain transport needs that std does not offer:
//! `sendmsg` with `MSG_NOSIGNAL` (a donor that hung up must be an error,
//! not a SIGPIPE that kills the process: nbdkit plugins do not control the
//! signal mask), `recv` without blocking on a socket another owner keeps
//! open (the drain's, behind libnbd), `poll(2)` with a deadline and an
//! eventfd ([`Latch`]) that wakes every poll on it; and [`LoanCell`], through
//! which a thread lends its read buffer to whichever thread reads the
//! reply on a shared connection.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use netpager_util::{CondvarExt, LockExt};

/// Sends `bufs` in one system call; returns the bytes taken. Blocking or
/// not as the socket is: the handshake waits (with the socket's timeout),
/// transmission runs on a non-blocking socket.
pub(crate) fn send(fd: RawFd, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is guaranteed ABI-compatible with iovec; sendmsg only reads.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: `msg` points at `bufs`, valid for the call; fd is a socket.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
thread_local! {
    /// The next [`poll`] on this thread fails with this errno (a test seam:
    /// poll(2) itself fails only on a broken process).
    pub(crate) static FAIL_NEXT_POLL: std::cell::Cell<Option<i32>> =
        const { std::cell::Cell::new(None) };
}

/// Receives what has arrived on `fd` into `buf` without blocking
/// (`WouldBlock` when nothing has; `Ok(0)` once the peer hung up).
pub(crate) fn recv_nowait(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the call.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Waits until one of `fds` is ready or `deadline` passes; `Ok(false)`
/// when the deadline passed with nothing ready. An interrupted wait is a
/// ready one (the caller looks again).
pub(crate) fn poll(fds: &mut [libc::pollfd], deadline: Instant) -> io::Result<bool> {
    #[cfg(test)]
    if let Some(errno) = FAIL_NEXT_POLL.with(|f| f.take()) {
        return Err(io::Error::from_raw_os_error(errno));
    }
    let now = Instant::now();
    if now >= deadline {
        return Ok(false);
    }
    let ms = deadline
        .duration_since(now)
        .as_millis()
        .clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(true);
        }
        return Err(e);
    }
    Ok(r > 0 || Instant::now() < deadline)
}

/// An eventfd that, once set, stays readable: every `poll` that includes
/// it returns, now and later.
pub(crate) struct Latch(OwnedFd);

impl Latch {
    pub fn new() -> io::Result<Latch> {
        // SAFETY: eventfd takes no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and nothing else owns it.
        Ok(Latch(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn set(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live array. It cannot fail short
        // of the counter overflowing, which a few sets never reach.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A buffer lent by one thread to others for a while, forget-safe: the
/// lender's [`LoanCell::lend`] gives it out only while its closure runs,
/// and before returning takes it back and waits until no borrower holds
/// it. A borrower ([`LoanCell::borrow`]) gets it at most once at a time.
pub(crate) struct LoanCell {
    st: Mutex<Loan>,
    cv: Condvar,
}

struct Loan {
    ptr: *mut u8,
    len: usize,
    lent: bool,
    borrowed: bool,
}

// SAFETY: the pointer is only dereferenced by `borrow` while the lender's
// `lend` keeps the buffer alive and unused (see there); the rest is plain
// data under the mutex.
unsafe impl Send for LoanCell {}
// SAFETY: as above; every access goes through the mutex.
unsafe impl Sync for LoanCell {}

impl LoanCell {
    pub fn new() -> LoanCell {
        LoanCell {
            st: Mutex::new(Loan {
                ptr: std::ptr::null_mut(),
                len: 0,
                lent: false,
                borrowed: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Lends `buf` while `f` runs (even if `f` panics, it is taken back
    /// before this returns).
    pub fn lend<R>(&self, buf: &mut [u8], f: impl FnOnce() -> R) -> R {
        {
            let mut st = self.st.lock_or_recover();
            assert!(!st.lent, "one loan at a time per cell");
            st.ptr = buf.as_mut_ptr();
            st.len = buf.len();
            st.lent = true;
        }
        struct TakeBack<'c>(&'c LoanCell);
        impl Drop for TakeBack<'_> {
            fn drop(&mut self) {
                let mut st = self.0.st.lock_or_recover();
                st.lent = false;
                while st.borrowed {
                    st = self.0.cv.wait_or_recover(st);
                }
                st.ptr = std::ptr::null_mut();
                st.len = 0;
            }
        }
        let _back = TakeBack(self);
        f()
    }

    /// Runs `f` on the lent buffer, or on `None` if nothing is lent now.
    pub fn borrow<R>(&self, f: impl FnOnce(Option<&mut [u8]>) -> R) -> R {
        let lent = {
            let mut st = self.st.lock_or_recover();
            if st.lent && !st.borrowed {
                st.borrowed = true;
                Some((st.ptr, st.len))
            } else {
                None
            }
        };
        let Some((ptr, len)) = lent else {
            return f(None);
        };
        struct GiveBack<'c>(&'c LoanCell);
        impl Drop for GiveBack<'_> {
            fn drop(&mut self) {
                self.0.st.lock_or_recover().borrowed = false;
                self.0.cv.notify_all();
            }
        }
        let _back = GiveBack(self);
        // SAFETY: `ptr`/`len` came from the `&mut [u8]` of a `lend` call
        // that has not returned: its TakeBack waits while `borrowed` is
        // set, so the buffer outlives this borrow; `lend` holds the only
        // other reference and does not use it meanwhile, and `borrowed`
        // lets one borrower at a time in.
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        f(Some(buf))
    }
}

/// A generic netlink socket (`NETLINK_GENERIC`), bound to a port the
/// kernel picks; messages sent on it without an address go to the kernel.
pub(crate) fn netlink_generic() -> io::Result<OwnedFd> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_GENERIC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_nl is valid (port 0: the kernel picks).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `addr` is a live sockaddr_nl of the size given.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Joins the netlink multicast group `group` (`NETLINK_ADD_MEMBERSHIP`):
/// the kernel's notices to it arrive on `fd` from now on.
pub(crate) fn netlink_join_group(fd: RawFd, group: u32) -> io::Result<()> {
    // SAFETY: `group` is a live u32 of the size given; fd is a socket.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_NETLINK,
            libc::NETLINK_ADD_MEMBERSHIP,
            (&group as *const u32).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One datagram into `buf`; its whole length even when `buf` was too
/// short for it (`MSG_TRUNC`), so that the caller can tell.
pub(crate) fn recv_datagram(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
