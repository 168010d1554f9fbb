//! Plain NBD over a TCP or unix socket in our own code, no library between
//! the caller and the socket: one request at a time per connection, the
//! request header and a write's data leave in one `sendmsg`, a read's reply
//! header and data arrive in one `readv`. TLS connections go through libnbd
//! instead (`ffi`).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::sys;
use crate::wire::{self, Command, GoStep};
use crate::{LibError, Outcome};

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(true),
            Stream::Unix(s) => s.set_nonblocking(true),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }

    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read_vectored(bufs),
            Stream::Unix(s) => s.read_vectored(bufs),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        sys::send(self.as_raw_fd(), &[IoSlice::new(buf)])
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

/// Why a plain connection could not be made.
#[derive(Debug)]
pub(crate) enum ConnectError {
    TimedOut,
    Failed(String),
}

fn io_fail(what: &str) -> impl Fn(io::Error) -> ConnectError + '_ {
    move |e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ConnectError::TimedOut,
        _ => ConnectError::Failed(format!("{what}: {e}")),
    }
}

/// One negotiated connection in transmission phase.
pub(crate) struct Plain {
    stream: Stream,
    size: u64,
    flags: u16,
    cookie: u64,
    /// A request was abandoned half-way or the stream failed: the next
    /// bytes on it would be out of step, so it is never used again.
    broken: bool,
}

impl Plain {
    pub fn connect_tcp(
        host: &str,
        port: u16,
        export: &str,
        timeout: Duration,
    ) -> Result<Plain, ConnectError> {
        let deadline = Instant::now() + timeout;
        let addrs = (host, port)
            .to_socket_addrs()
            .map_err(|e| ConnectError::Failed(format!("resolving {host}: {e}")))?;
        let mut last = ConnectError::Failed(format!("{host} has no address"));
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ConnectError::TimedOut);
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    // Requests are small and each waits for its reply.
                    s.set_nodelay(true)
                        .map_err(|e| ConnectError::Failed(format!("TCP_NODELAY: {e}")))?;
                    return Plain::negotiate(Stream::Tcp(s), export, deadline);
                }
                Err(e) => last = io_fail("connect")(e),
            }
        }
        Err(last)
    }

    pub fn connect_unix(
        path: &Path,
        export: &str,
        timeout: Duration,
    ) -> Result<Plain, ConnectError> {
        let deadline = Instant::now() + timeout;
        let s = UnixStream::connect(path)
            .map_err(|e| ConnectError::Failed(format!("connect to {}: {e}", path.display())))?;
        Plain::negotiate(Stream::Unix(s), export, deadline)
    }

    /// Whether an NBD server on `path` completes the greeting. The probe
    /// ends with `NBD_OPT_ABORT`, so the server opens no export and logs
    /// no broken connection.
    pub fn probe_unix(path: &Path, timeout: Duration) -> Result<(), ConnectError> {
        let deadline = Instant::now() + timeout;
        let mut s = UnixStream::connect(path)
            .map(Stream::Unix)
            .map_err(|e| ConnectError::Failed(format!("connect to {}: {e}", path.display())))?;
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_timeouts(Some(left.max(Duration::from_millis(1))))
            .map_err(io_fail("socket timeout"))?;
        let mut greeting = [0u8; wire::GREETING_LEN];
        s.read_exact(&mut greeting)
            .map_err(io_fail("reading the greeting"))?;
        let ours =
            wire::client_flags(&greeting).map_err(|e| ConnectError::Failed(e.to_string()))?;
        let mut bye = ours.to_be_bytes().to_vec();
        bye.extend_from_slice(&wire::option(wire::OPT_ABORT, &[]));
        s.write_all(&bye)
            .map_err(io_fail("sending NBD_OPT_ABORT"))?;
        // The server acknowledges the abort, or just closes: either will do.
        let mut ack = [0u8; wire::OPT_REPLY_LEN];
        let _ = s.read_exact(&mut ack);
        Ok(())
    }

    /// Fixed-newstyle handshake and `NBD_OPT_GO`, blocking, by `deadline`.
    fn negotiate(mut s: Stream, export: &str, deadline: Instant) -> Result<Plain, ConnectError> {
        let step = |s: &Stream| {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ConnectError::TimedOut);
            }
            s.set_timeouts(Some(left))
                .map_err(io_fail("socket timeout"))
        };
        let wire_fail = |e: wire::WireError| ConnectError::Failed(e.to_string());
        step(&s)?;
        let mut greeting = [0u8; wire::GREETING_LEN];
        s.read_exact(&mut greeting)
            .map_err(io_fail("reading the greeting"))?;
        let ours = wire::client_flags(&greeting).map_err(wire_fail)?;
        let mut hello = ours.to_be_bytes().to_vec();
        hello.extend_from_slice(&wire::opt_go(export));
        step(&s)?;
        s.write_all(&hello).map_err(io_fail("sending NBD_OPT_GO"))?;
        let mut export_info = None;
        loop {
            step(&s)?;
            let mut h = [0u8; wire::OPT_REPLY_LEN];
            s.read_exact(&mut h)
                .map_err(io_fail("reading an option reply"))?;
            let r = wire::opt_reply(&h, wire::OPT_GO).map_err(wire_fail)?;
            // Replies to NBD_OPT_GO are small; anything larger is not one.
            if r.len > 64 << 10 {
                return Err(wire_fail(wire::WireError::UnexpectedReply {
                    kind: r.kind,
                    len: r.len,
                }));
            }
            let mut data = vec![0u8; r.len as usize];
            s.read_exact(&mut data)
                .map_err(io_fail("reading an option reply"))?;
            match wire::go_step(r, &data).map_err(wire_fail)? {
                GoStep::Export { size, flags } => export_info = Some((size, flags)),
                GoStep::Info => {}
                GoStep::Ack => break,
            }
        }
        let (size, flags) = export_info.ok_or_else(|| wire_fail(wire::WireError::NoSize))?;
        s.set_timeouts(None).map_err(io_fail("socket timeout"))?;
        s.set_nonblocking()
            .map_err(io_fail("non-blocking socket"))?;
        Ok(Plain {
            stream: s,
            size,
            flags,
            cookie: 0,
            broken: false,
        })
    }

    /// The socket itself, in transmission phase, blocking and without
    /// timeouts (as the kernel's nbd driver wants it: it waits on it with
    /// its own request timeout), with the export's size and transmission
    /// flags.
    pub fn into_socket(mut self) -> io::Result<(OwnedFd, u64, u16)> {
        // Given away: dropping `self` must not send NBD_CMD_DISC on it.
        self.broken = true;
        let fd: OwnedFd = match &self.stream {
            Stream::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.try_clone()?.into()
            }
            Stream::Unix(s) => {
                s.set_nonblocking(false)?;
                s.try_clone()?.into()
            }
        };
        Ok((fd, self.size, self.flags))
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn usable(&self) -> bool {
        !self.broken
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Receives what has arrived, up to `buf.len()` bytes (the socket is
    /// non-blocking: `WouldBlock` when nothing has).
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.stream {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }

    /// Hands the socket to the drain instead of closing it, because
    /// replies may still be on their way (see `drain`): shuts the write
    /// side, so the server answers what it has and hangs up.
    pub fn linger(&mut self) {
        self.broken = true;
        let sock: io::Result<std::os::fd::OwnedFd> = match &self.stream {
            Stream::Tcp(s) => s
                .shutdown(std::net::Shutdown::Write)
                .and_then(|()| s.try_clone())
                .map(Into::into),
            Stream::Unix(s) => s
                .shutdown(std::net::Shutdown::Write)
                .and_then(|()| s.try_clone())
                .map(Into::into),
        };
        // Without a clone the socket is closed as before: nothing better.
        if let Ok(sock) = sock {
            crate::drain::adopt(sock);
        }
    }

    /// Whether the export takes `cmd` with `len` bytes.
    pub fn check(&self, cmd: Command, len: u64) -> Result<(), LibError> {
        if let Some(f) = cmd.needs() {
            if self.flags & f == 0 {
                return Err(LibError {
                    errno: libc::ENOTSUP,
                    message: format!(
                        "the server does not take {cmd:?} (export flags {:#x})",
                        self.flags
                    ),
                });
            }
        }
        if cmd == Command::Write && self.flags & wire::TX_READ_ONLY != 0 {
            return Err(LibError {
                errno: libc::EPERM,
                message: "the export is read-only".into(),
            });
        }
        if u32::try_from(len).is_err() {
            return Err(LibError {
                errno: libc::EINVAL,
                message: format!("request of {len} bytes is too large for NBD"),
            });
        }
        Ok(())
    }

    /// Starts one request (sending as much as the socket takes now).
    pub fn start<'a>(
        &'a mut self,
        cmd: Command,
        flags: u16,
        offset: u64,
        buf: Buf<'a>,
    ) -> Result<PlainCmd<'a>, LibError> {
        if self.broken {
            return Err(LibError::new(
                "connection abandoned with a request in flight (timed out or failed)",
            ));
        }
        self.check(cmd, buf.len())?;
        let len = buf.len() as u32;
        self.cookie = self.cookie.wrapping_add(1);
        let cookie = self.cookie;
        let mut c = PlainCmd {
            header: wire::request(cmd, flags, cookie, offset, len),
            conn: self,
            buf,
            sent: 0,
            reply: [0; wire::REPLY_LEN],
            got: 0,
            cookie,
            outcome: None,
        };
        c.progress();
        Ok(c)
    }

    /// Tells the server we are leaving (best effort, no reply).
    pub fn disconnect(&mut self) {
        if !self.broken {
            let h = wire::request(Command::Disconnect, 0, 0, 0, 0);
            let _ = sys::send(self.stream.as_raw_fd(), &[IoSlice::new(&h)]);
            self.broken = true;
        }
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        self.disconnect();
    }
}

/// What a request carries: a length alone, data to send, or room for data
/// to receive.
pub(crate) enum Buf<'a> {
    Len(u64),
    Out(&'a [u8]),
    In(&'a mut [u8]),
}

impl Buf<'_> {
    fn len(&self) -> u64 {
        match self {
            Buf::Len(n) => *n,
            Buf::Out(b) => b.len() as u64,
            Buf::In(b) => b.len() as u64,
        }
    }
}

/// A request on a [`Plain`] connection, from its first byte sent to its
/// reply's last byte received. Dropping it unfinished breaks the
/// connection.
pub(crate) struct PlainCmd<'a> {
    conn: &'a mut Plain,
    header: [u8; wire::REQUEST_LEN],
    buf: Buf<'a>,
    /// Bytes of header and outgoing data sent.
    sent: usize,
    reply: [u8; wire::REPLY_LEN],
    /// Bytes of reply header and incoming data received.
    got: usize,
    cookie: u64,
    outcome: Option<Outcome>,
}

impl PlainCmd<'_> {
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    pub fn fd(&self) -> RawFd {
        self.conn.stream.as_raw_fd()
    }

    /// What to poll for: the rest of the request to send, or the reply.
    pub fn events(&self) -> libc::c_short {
        if self.sent < self.to_send() {
            libc::POLLOUT
        } else {
            libc::POLLIN
        }
    }

    fn to_send(&self) -> usize {
        wire::REQUEST_LEN
            + match &self.buf {
                Buf::Out(b) => b.len(),
                _ => 0,
            }
    }

    fn fail(&mut self, errno: i32, message: String) {
        self.conn.broken = true;
        self.outcome = Some(Outcome::Failed(LibError { errno, message }));
    }

    /// Sends and receives what the socket allows now, without blocking.
    pub fn progress(&mut self) {
        while self.outcome.is_none() {
            let r = if self.sent < self.to_send() {
                self.send()
            } else {
                self.receive()
            };
            match r {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let errno = e.raw_os_error().unwrap_or(libc::ECONNRESET);
                    return self.fail(errno, format!("connection to donor lost: {e}"));
                }
            }
        }
    }

    /// `Ok(false)` when the socket takes no more now.
    fn send(&mut self) -> io::Result<bool> {
        let n = {
            let out: &[u8] = match &self.buf {
                Buf::Out(b) => b,
                _ => &[],
            };
            let slices = if self.sent < wire::REQUEST_LEN {
                [IoSlice::new(&self.header[self.sent..]), IoSlice::new(out)]
            } else {
                [
                    IoSlice::new(&out[self.sent - wire::REQUEST_LEN..]),
                    IoSlice::new(&[]),
                ]
            };
            match sys::send(self.fd(), &slices) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                r => r?,
            }
        };
        self.sent += n;
        Ok(true)
    }

    /// `Ok(false)` when nothing more has arrived yet.
    fn receive(&mut self) -> io::Result<bool> {
        // Data follows the header only if the reply is a success.
        let data_may_come = self.got < wire::REPLY_LEN || self.reply_ok();
        let n = {
            let data: &mut [u8] = match &mut self.buf {
                Buf::In(b) if data_may_come => b,
                _ => &mut [],
            };
            let mut slices = if self.got < wire::REPLY_LEN {
                [
                    IoSliceMut::new(&mut self.reply[self.got..]),
                    IoSliceMut::new(data),
                ]
            } else {
                let at = self.got - wire::REPLY_LEN;
                [IoSliceMut::new(&mut data[at..]), IoSliceMut::new(&mut [])]
            };
            match self.conn.stream.read_vectored(&mut slices) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the donor closed the connection",
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                r => r?,
            }
        };
        self.got += n;
        if self.got < wire::REPLY_LEN {
            return Ok(true);
        }
        match wire::reply(&self.reply, self.cookie) {
            Err(e) => self.fail(libc::EPROTO, format!("donor sent a bad reply: {e}")),
            Ok(0) => {
                let want = wire::REPLY_LEN
                    + match &self.buf {
                        Buf::In(b) => b.len(),
                        _ => 0,
                    };
                if self.got == want {
                    self.outcome = Some(Outcome::Done);
                }
            }
            Ok(errno) => {
                if self.got > wire::REPLY_LEN {
                    return Err(io::Error::other("data after an error reply"));
                }
                self.outcome = Some(Outcome::Failed(LibError {
                    errno: errno as i32,
                    message: format!(
                        "the donor answered: {}",
                        io::Error::from_raw_os_error(errno as i32)
                    ),
                }));
            }
        }
        Ok(true)
    }

    fn reply_ok(&self) -> bool {
        self.got >= wire::REPLY_LEN && self.reply[4..8] == [0; 4]
    }

    /// Ends the request without its reply (timed out, or the wait
    /// failed): the connection is out of step from here on.
    pub fn set_outcome(&mut self, o: Outcome) {
        if self.outcome.is_none() {
            self.conn.broken = true;
        }
        self.outcome = Some(o);
    }
}

impl Drop for PlainCmd<'_> {
    fn drop(&mut self) {
        if self.outcome.is_none() {
            self.conn.broken = true;
        }
    }
}
