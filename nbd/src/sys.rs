//! The system calls the plain transport needs that std does not offer:
//! `sendmsg` with `MSG_NOSIGNAL` (a donor that hung up must be an error,
//! not a SIGPIPE that kills the process: nbdkit plugins do not control the
//! signal mask), and `poll(2)` with a deadline.

use std::io::{self, IoSlice};
use std::os::fd::RawFd;
use std::time::Instant;

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
