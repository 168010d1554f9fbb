//! libnbd for TLS connections: raw libnbd (Debian libnbd-dev 1.14)
//! declarations, a safe owner of one `struct nbd_handle`, and commands whose
//! buffers stay borrowed until libnbd retires them.
//!
//! Why the aio API: every wait goes through `poll(2)` with a deadline (the
//! crate's one wait loop, shared with plain connections), so a hung donor
//! (SIGSTOPped, black-holed) can never wedge a thread inside a blocking
//! libnbd call.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::time::Instant;

use crate::{LibError, Outcome};

#[repr(C)]
struct NbdHandle {
    _opaque: [u8; 0],
}

/// `nbd_completion_callback`, always passed empty (`NBD_NULL_COMPLETION`):
/// completion is polled with `nbd_aio_command_completed`.
#[repr(C)]
#[derive(Clone, Copy)]
struct CompletionCallback {
    callback: Option<extern "C" fn(*mut c_void, *mut c_int) -> c_int>,
    user_data: *mut c_void,
    free: Option<extern "C" fn(*mut c_void)>,
}

const NULL_COMPLETION: CompletionCallback = CompletionCallback {
    callback: None,
    user_data: std::ptr::null_mut(),
    free: None,
};

const LIBNBD_TLS_REQUIRE: c_int = 2;
const LIBNBD_AIO_DIRECTION_READ: c_uint = 1;
const LIBNBD_AIO_DIRECTION_WRITE: c_uint = 2;

#[link(name = "nbd")]
extern "C" {
    fn nbd_create() -> *mut NbdHandle;
    fn nbd_close(h: *mut NbdHandle);
    fn nbd_get_error() -> *const c_char;
    fn nbd_get_errno() -> c_int;
    fn nbd_set_handle_name(h: *mut NbdHandle, name: *const c_char) -> c_int;
    fn nbd_set_export_name(h: *mut NbdHandle, name: *const c_char) -> c_int;
    fn nbd_set_request_structured_replies(h: *mut NbdHandle, request: bool) -> c_int;
    fn nbd_set_tls(h: *mut NbdHandle, tls: c_int) -> c_int;
    fn nbd_set_tls_username(h: *mut NbdHandle, username: *const c_char) -> c_int;
    fn nbd_set_tls_psk_file(h: *mut NbdHandle, filename: *const c_char) -> c_int;
    fn nbd_aio_connect_tcp(
        h: *mut NbdHandle,
        hostname: *const c_char,
        port: *const c_char,
    ) -> c_int;
    fn nbd_aio_is_ready(h: *mut NbdHandle) -> c_int;
    fn nbd_aio_is_dead(h: *mut NbdHandle) -> c_int;
    fn nbd_aio_is_closed(h: *mut NbdHandle) -> c_int;
    fn nbd_get_size(h: *mut NbdHandle) -> i64;
    fn nbd_aio_pread(
        h: *mut NbdHandle,
        buf: *mut c_void,
        count: usize,
        offset: u64,
        cb: CompletionCallback,
        flags: u32,
    ) -> i64;
    fn nbd_aio_pwrite(
        h: *mut NbdHandle,
        buf: *const c_void,
        count: usize,
        offset: u64,
        cb: CompletionCallback,
        flags: u32,
    ) -> i64;
    fn nbd_aio_trim(
        h: *mut NbdHandle,
        count: u64,
        offset: u64,
        cb: CompletionCallback,
        flags: u32,
    ) -> i64;
    fn nbd_aio_zero(
        h: *mut NbdHandle,
        count: u64,
        offset: u64,
        cb: CompletionCallback,
        flags: u32,
    ) -> i64;
    fn nbd_aio_flush(h: *mut NbdHandle, cb: CompletionCallback, flags: u32) -> i64;
    fn nbd_aio_get_fd(h: *mut NbdHandle) -> c_int;
    fn nbd_aio_get_direction(h: *mut NbdHandle) -> c_uint;
    fn nbd_aio_notify_read(h: *mut NbdHandle) -> c_int;
    fn nbd_aio_notify_write(h: *mut NbdHandle) -> c_int;
    fn nbd_aio_command_completed(h: *mut NbdHandle, cookie: u64) -> c_int;
}

/// Reads libnbd's thread-local error of the call that just failed.
fn last_error() -> LibError {
    // SAFETY: both calls only read libnbd's thread-local error state; the
    // returned string stays valid until the next libnbd call on this thread
    // and is copied out before that.
    let (errno, msg) = unsafe { (nbd_get_errno(), nbd_get_error()) };
    let message = if msg.is_null() {
        "unknown libnbd error".to_string()
    } else {
        // SAFETY: non-null, NUL-terminated string owned by libnbd (see above).
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    };
    LibError { errno, message }
}

fn cstring(what: &str, s: &str) -> Result<CString, LibError> {
    CString::new(s).map_err(|_| LibError {
        errno: libc::EINVAL,
        message: format!("{what} {s:?} contains a NUL byte"),
    })
}

/// One libnbd handle (one connection). Dropping it closes the connection.
pub struct Handle {
    h: NonNull<NbdHandle>,
    /// Set when a command was abandoned before completing (timeout): its
    /// buffer is gone, so the state machine must never run again.
    poisoned: bool,
}

// SAFETY: libnbd handles may be used from any thread (libnbd(3) "MULTITHREADING":
// all calls on a handle are serialised by the handle's own lock); `&mut self`
// on every method keeps one thread at a time here anyway.
unsafe impl Send for Handle {}

impl Drop for Handle {
    /// A handle given up with a command in flight goes to the drain, which
    /// closes it once the donor's replies are in (see `drain`): closed now,
    /// it could abort the donor.
    fn drop(&mut self) {
        if self.poisoned {
            // SAFETY: valid handle; a query.
            let fd = unsafe { nbd_aio_get_fd(self.ptr()) };
            if fd >= 0 {
                crate::drain::adopt_tls(Abandoned(self.h), fd);
                return;
            }
        }
        // SAFETY: `h` came from nbd_create and is closed exactly once, here.
        // nbd_close never touches buffers of commands still in flight.
        unsafe { nbd_close(self.h.as_ptr()) }
    }
}

/// A handle given up with a command libnbd had not retired: never driven
/// again (the command's buffer is gone), closed when dropped.
pub(crate) struct Abandoned(NonNull<NbdHandle>);

// SAFETY: as for Handle; nothing but nbd_close is ever called on it.
unsafe impl Send for Abandoned {}

impl Drop for Abandoned {
    fn drop(&mut self) {
        // SAFETY: the handle's one owner since its Handle let go of it;
        // closed exactly once, here, never touching command buffers.
        unsafe { nbd_close(self.0.as_ptr()) }
    }
}

fn check(r: c_int) -> Result<(), LibError> {
    if r == -1 {
        Err(last_error())
    } else {
        Ok(())
    }
}

impl Handle {
    pub fn new(name: &str) -> Result<Handle, LibError> {
        // SAFETY: nbd_create has no preconditions; NULL means failure.
        let h = NonNull::new(unsafe { nbd_create() }).ok_or_else(last_error)?;
        let handle = Handle { h, poisoned: false };
        let name = cstring("handle name", name)?;
        // SAFETY: valid handle, NUL-terminated string copied by libnbd.
        check(unsafe { nbd_set_handle_name(handle.ptr(), name.as_ptr()) })?;
        // Simple replies: a read's answer is one header and the data (two
        // receives, not four). Nothing here needs structured replies: no
        // block status, no sparse reads.
        // SAFETY: valid handle, not yet connected.
        check(unsafe { nbd_set_request_structured_replies(handle.ptr(), false) })?;
        Ok(handle)
    }

    fn ptr(&self) -> *mut NbdHandle {
        self.h.as_ptr()
    }

    fn usable(&self) -> Result<(), LibError> {
        if self.poisoned {
            Err(LibError::new(
                "connection abandoned with a request libnbd had not retired (timed out or failed)",
            ))
        } else {
            Ok(())
        }
    }

    /// False once poisoned or once libnbd saw the connection die.
    pub fn usable_and_alive(&self) -> bool {
        // SAFETY: valid handle; state queries have no preconditions.
        !self.poisoned
            && unsafe { nbd_aio_is_dead(self.ptr()) == 0 && nbd_aio_is_closed(self.ptr()) == 0 }
    }

    pub fn set_export_name(&mut self, export: &str) -> Result<(), LibError> {
        let e = cstring("export name", export)?;
        // SAFETY: valid handle; libnbd copies the string.
        check(unsafe { nbd_set_export_name(self.ptr(), e.as_ptr()) })
    }

    /// Requires TLS with a pre-shared key file (and optional user name).
    pub fn set_tls_psk(&mut self, psk_file: &str, username: Option<&str>) -> Result<(), LibError> {
        let f = cstring("TLS PSK file", psk_file)?;
        // SAFETY: valid handle; libnbd copies the strings.
        unsafe {
            check(nbd_set_tls(self.ptr(), LIBNBD_TLS_REQUIRE))?;
            check(nbd_set_tls_psk_file(self.ptr(), f.as_ptr()))?;
        }
        if let Some(u) = username {
            let u = cstring("TLS user name", u)?;
            // SAFETY: valid handle; libnbd copies the string.
            check(unsafe { nbd_set_tls_username(self.ptr(), u.as_ptr()) })?;
        }
        Ok(())
    }

    /// Connects over TCP and negotiates, giving up at `deadline`.
    pub fn connect_tcp(&mut self, host: &str, port: &str, deadline: Instant) -> Outcome {
        let (host, port) = match (cstring("host", host), cstring("port", port)) {
            (Ok(h), Ok(p)) => (h, p),
            (Err(e), _) | (_, Err(e)) => return Outcome::Failed(e),
        };
        // SAFETY: valid handle; libnbd copies both strings.
        let rc = unsafe { nbd_aio_connect_tcp(self.ptr(), host.as_ptr(), port.as_ptr()) };
        if let Err(e) = check(rc) {
            return Outcome::Failed(e);
        }
        loop {
            // SAFETY: valid handle; state queries have no preconditions.
            let (ready, dead) = unsafe {
                (
                    nbd_aio_is_ready(self.ptr()),
                    nbd_aio_is_dead(self.ptr()) == 1 || nbd_aio_is_closed(self.ptr()) == 1,
                )
            };
            if ready == 1 {
                return Outcome::Done;
            }
            if dead {
                return Outcome::Failed(LibError::new("connection closed during negotiation"));
            }
            match self.poll_once(deadline) {
                Ok(true) => {}
                Ok(false) => return Outcome::TimedOut,
                Err(e) => return Outcome::Failed(e),
            }
        }
    }

    pub fn size(&self) -> Result<u64, LibError> {
        // SAFETY: valid handle; -1 on error.
        let s = unsafe { nbd_get_size(self.ptr()) };
        if s < 0 {
            Err(last_error())
        } else {
            Ok(s as u64)
        }
    }

    fn started(&mut self, cookie: i64) -> Result<u64, LibError> {
        if cookie < 0 {
            Err(last_error())
        } else {
            Ok(cookie as u64)
        }
    }

    /// Starts a read into `buf`; `buf` stays borrowed until the command ends.
    pub fn start_pread<'a>(
        &'a mut self,
        buf: &'a mut [u8],
        offset: u64,
    ) -> Result<InFlight<'a>, LibError> {
        self.usable()?;
        // SAFETY: valid handle; `buf` is valid for `buf.len()` bytes and is
        // borrowed by the returned InFlight until the command completed, or
        // else the handle is poisoned so libnbd never writes to it later.
        let c = unsafe {
            nbd_aio_pread(
                self.ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                offset,
                NULL_COMPLETION,
                0,
            )
        };
        let cookie = self.started(c)?;
        Ok(InFlight::new(self, cookie))
    }

    /// Starts a write of `buf` (`fua`: durable before the reply).
    pub fn start_pwrite<'a>(
        &'a mut self,
        buf: &'a [u8],
        offset: u64,
        fua: bool,
    ) -> Result<InFlight<'a>, LibError> {
        self.usable()?;
        let flags = if fua { 1 } else { 0 };
        // SAFETY: as in start_pread; libnbd only reads from `buf`.
        let c = unsafe {
            nbd_aio_pwrite(
                self.ptr(),
                buf.as_ptr().cast(),
                buf.len(),
                offset,
                NULL_COMPLETION,
                flags,
            )
        };
        let cookie = self.started(c)?;
        Ok(InFlight::new(self, cookie))
    }

    pub fn start_trim(&mut self, count: u64, offset: u64) -> Result<InFlight<'_>, LibError> {
        self.usable()?;
        // SAFETY: valid handle; no buffer involved.
        let c = unsafe { nbd_aio_trim(self.ptr(), count, offset, NULL_COMPLETION, 0) };
        let cookie = self.started(c)?;
        Ok(InFlight::new(self, cookie))
    }

    /// Starts a write of zeroes; the donor may punch holes (no NO_HOLE flag).
    pub fn start_zero(&mut self, count: u64, offset: u64) -> Result<InFlight<'_>, LibError> {
        self.usable()?;
        // SAFETY: valid handle; no buffer involved.
        let c = unsafe { nbd_aio_zero(self.ptr(), count, offset, NULL_COMPLETION, 0) };
        let cookie = self.started(c)?;
        Ok(InFlight::new(self, cookie))
    }

    pub fn start_flush(&mut self) -> Result<InFlight<'_>, LibError> {
        self.usable()?;
        // SAFETY: valid handle; no buffer involved.
        let c = unsafe { nbd_aio_flush(self.ptr(), NULL_COMPLETION, 0) };
        let cookie = self.started(c)?;
        Ok(InFlight::new(self, cookie))
    }
}

/// A started command. Its buffer (if any) stays borrowed for `'a`; dropping
/// it before completion poisons the handle (see [`Handle`]).
pub struct InFlight<'a> {
    h: &'a mut Handle,
    cookie: u64,
    outcome: Option<Outcome>,
    /// libnbd has retired the command and let go of its buffer. An outcome
    /// alone does not mean that: a failed poll or socket gives one while
    /// the command is still queued in libnbd.
    retired: bool,
    _buf: PhantomData<&'a mut [u8]>,
}

impl<'a> InFlight<'a> {
    fn new(h: &'a mut Handle, cookie: u64) -> Self {
        InFlight {
            h,
            cookie,
            outcome: None,
            retired: false,
            _buf: PhantomData,
        }
    }

    /// `None` while the command is still running.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    pub fn set_outcome(&mut self, o: Outcome) {
        self.outcome = Some(o);
    }

    /// The socket and the events libnbd waits for.
    pub fn poll_interest(&self) -> Result<(c_int, libc::c_short), LibError> {
        self.h.interest()
    }

    /// Lets libnbd react to what poll(2) reported, then looks whether the
    /// command is done.
    pub fn ready(&mut self, revents: libc::c_short) {
        let res = self.h.notify(revents);
        self.poll_completion();
        if let (Err(e), None) = (res, &self.outcome) {
            self.outcome = Some(Outcome::Failed(e));
        }
    }

    pub fn poll_completion(&mut self) {
        if self.outcome.is_some() {
            return;
        }
        // SAFETY: valid handle and a cookie it issued; retires the command
        // when it returns 1 or -1.
        match unsafe { nbd_aio_command_completed(self.h.ptr(), self.cookie) } {
            1 => {
                self.retired = true;
                self.outcome = Some(Outcome::Done);
            }
            0 => {
                // SAFETY: valid handle; state queries have no preconditions.
                let dead = unsafe {
                    nbd_aio_is_dead(self.h.ptr()) == 1 || nbd_aio_is_closed(self.h.ptr()) == 1
                };
                if dead {
                    self.outcome = Some(Outcome::Failed(LibError::new("connection to donor lost")));
                }
            }
            _ => {
                self.retired = true;
                self.outcome = Some(Outcome::Failed(last_error()));
            }
        }
    }
}

impl Drop for InFlight<'_> {
    /// A command libnbd has not retired may still be written into its
    /// buffer, which the caller reuses once this borrow ends: the handle
    /// is poisoned, so it is never driven again and is closed, not reused.
    fn drop(&mut self) {
        if !self.retired {
            self.h.poisoned = true;
        }
    }
}

impl Handle {
    /// The socket and the events libnbd waits for.
    fn interest(&self) -> Result<(c_int, libc::c_short), LibError> {
        // SAFETY: valid handle; queries only.
        let (fd, dir) = unsafe {
            (
                nbd_aio_get_fd(self.ptr()),
                nbd_aio_get_direction(self.ptr()),
            )
        };
        if fd < 0 {
            return Err(last_error());
        }
        let mut events = 0;
        if dir & LIBNBD_AIO_DIRECTION_READ != 0 {
            events |= libc::POLLIN;
        }
        if dir & LIBNBD_AIO_DIRECTION_WRITE != 0 {
            events |= libc::POLLOUT;
        }
        Ok((fd, events))
    }

    /// Lets libnbd's state machine react to what poll(2) reported (the
    /// same logic as libnbd's own `nbd_poll`, lib/poll.c).
    fn notify(&mut self, revents: libc::c_short) -> Result<(), LibError> {
        // SAFETY: valid handle; notify calls run the state machine, whose
        // buffers are borrowed by live InFlight values (or by nothing).
        let res = unsafe {
            if revents & (libc::POLLIN | libc::POLLHUP) != 0 {
                nbd_aio_notify_read(self.ptr())
            } else if revents & libc::POLLOUT != 0 {
                nbd_aio_notify_write(self.ptr())
            } else if revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
                return Err(LibError::new("poll: socket error"));
            } else {
                0
            }
        };
        check(res)
    }

    /// One wait for the handle's socket, then libnbd's reaction;
    /// `Ok(false)` once `deadline` passed.
    fn poll_once(&mut self, deadline: Instant) -> Result<bool, LibError> {
        let (fd, events) = self.interest()?;
        let mut fds = [libc::pollfd {
            fd,
            events,
            revents: 0,
        }];
        match crate::sys::poll(&mut fds, deadline) {
            Ok(true) => self.notify(fds[0].revents).map(|()| true),
            Ok(false) => Ok(false),
            Err(e) => Err(LibError {
                errno: e.raw_os_error().unwrap_or(libc::EIO),
                message: format!("poll: {e}"),
            }),
        }
    }
}
