//! Handing a FUSE connection from one serving process to the next.
//!
//! A `/dev/fuse` connection lives as long as some process holds an fd on
//! its open file. A holder process keeps one and gives a copy to each
//! serving process over a unix socket (SCM_RIGHTS). A serving process that dies then leaves the connection, and the
//! requests it had read but not answered, to the next one
//! ([`crate::Mount::serve_held`]).
//!
//! The holder's protocol is one line per connection to its socket, and
//! one line back:
//!
//! | request | reply |
//! |---|---|
//! | `take` | `fresh` or `held`, with the fd attached (`fresh`: the kernel's INIT is still to be answered) |
//! | `ready PID` | `ok` (PID serves now) |
//! | `resent PID N` | `ok` (PID answered N requests sent again) |
//! | `restart [BINARY]` | `restarted PID HELD_MS` or `error WHY` |

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sys;

/// The longest line either side sends.
pub const MAX_LINE: usize = 4096;

/// A request to the holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Give me the connection.
    Take,
    /// PID serves the connection now.
    Ready { pid: u32 },
    /// PID has answered `count` requests the kernel sent again.
    Resent { pid: u32, count: u64 },
    /// Replace the serving process (with `binary`, else the same program).
    Restart { binary: Option<PathBuf> },
}

impl Request {
    pub fn parse(line: &str) -> Result<Request, String> {
        let mut w = line.split_whitespace();
        let num = |w: Option<&str>, what: &str| -> Result<u64, String> {
            w.and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("{line:?}: {what} is not a number"))
        };
        let req = match w.next() {
            Some("take") => Request::Take,
            Some("ready") => Request::Ready {
                pid: num(w.next(), "PID")? as u32,
            },
            Some("resent") => Request::Resent {
                pid: num(w.next(), "PID")? as u32,
                count: num(w.next(), "N")?,
            },
            Some("restart") => {
                // A path may hold spaces: the rest of the line is the path.
                let rest = line.trim().strip_prefix("restart").unwrap_or("").trim();
                return Ok(Request::Restart {
                    binary: (!rest.is_empty()).then(|| PathBuf::from(rest)),
                });
            }
            _ => return Err(format!("{line:?}: unknown request")),
        };
        match w.next() {
            None => Ok(req),
            Some(extra) => Err(format!("{line:?}: unexpected {extra:?}")),
        }
    }

    pub fn line(&self) -> String {
        match self {
            Request::Take => "take".into(),
            Request::Ready { pid } => format!("ready {pid}"),
            Request::Resent { pid, count } => format!("resent {pid} {count}"),
            Request::Restart { binary: None } => "restart".into(),
            Request::Restart { binary: Some(b) } => format!("restart {}", b.display()),
        }
    }
}

/// The holder's answer to `restart`: the new serving process, and how
/// long the kernel's requests waited for anyone to read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restarted {
    pub pid: u32,
    pub held_ms: u64,
}

impl Restarted {
    pub fn line(&self) -> String {
        format!("restarted {} {}", self.pid, self.held_ms)
    }

    /// Parses `restarted PID HELD_MS`; `error WHY` becomes `Err(WHY)`.
    pub fn parse(line: &str) -> Result<Restarted, String> {
        let line = line.trim();
        if let Some(why) = line.strip_prefix("error ") {
            return Err(why.to_string());
        }
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next(), w.next()) {
            (Some("restarted"), Some(pid), Some(ms), None) => Ok(Restarted {
                pid: pid.parse().map_err(|_| format!("{line:?}: bad pid"))?,
                held_ms: ms.parse().map_err(|_| format!("{line:?}: bad time"))?,
            }),
            _ => Err(format!("unexpected answer {line:?}")),
        }
    }
}

/// Reads one request from a holder's socket (it must arrive within 10 s)
/// and parses it; `None` when none could be read (logged).
pub fn read_request(stream: &mut UnixStream) -> Option<Result<Request, String>> {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    match read_line(stream) {
        Ok(line) => Some(Request::parse(&line)),
        Err(e) => {
            tracing::warn!("holder socket: {e}");
            None
        }
    }
}

/// Reads one line (without its newline) of at most [`MAX_LINE`] bytes.
pub fn read_line(stream: &mut UnixStream) -> io::Result<String> {
    let mut out = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte)? {
            0 => break,
            _ if byte[0] == b'\n' => break,
            _ => out.push(byte[0]),
        }
        if out.len() > MAX_LINE {
            return Err(io::Error::other("line too long"));
        }
    }
    String::from_utf8(out).map_err(|_| io::Error::other("line is not UTF-8"))
}

/// Sends `request` to the holder at `socket` and returns its one-line
/// answer, waiting at most `timeout` for it.
pub fn ask(socket: &Path, request: &Request, timeout: Duration) -> io::Result<String> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(format!("{}\n", request.line()).as_bytes())?;
    read_line(&mut s)
}

/// The holder's side of `take`: the answer, with the connection attached.
pub fn give(stream: &UnixStream, connection: &File, fresh: bool) -> io::Result<()> {
    let word: &[u8] = if fresh { b"fresh\n" } else { b"held\n" };
    sys::send_with_fd(stream.as_raw_fd(), word, Some(connection.as_raw_fd()))
}

/// Takes the connection from the holder at `socket`: the fd, and whether
/// INIT is still to be answered.
pub fn take(socket: &Path, timeout: Duration) -> io::Result<(File, bool)> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(b"take\n")?;
    let mut buf = [0u8; 64];
    let (n, fd) = sys::recv_with_fd(s.as_raw_fd(), &mut buf)?;
    let fresh = match &buf[..n] {
        b"fresh\n" => true,
        b"held\n" => false,
        other => {
            return Err(io::Error::other(format!(
                "the holder answered {:?} to take",
                String::from_utf8_lossy(other)
            )))
        }
    };
    let fd = fd.ok_or_else(|| io::Error::other("the holder sent no fd"))?;
    Ok((fd, fresh))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Take,
            Request::Ready { pid: 42 },
            Request::Resent { pid: 42, count: 7 },
            Request::Restart { binary: None },
            Request::Restart {
                binary: Some("/opt/new build/pagerctl".into()),
            },
        ] {
            assert_eq!(Request::parse(&r.line()).unwrap(), r);
        }
        assert!(Request::parse("ready x").is_err());
        assert!(Request::parse("take me").is_err());
        assert!(Request::parse("resent 1").is_err());
        assert!(Request::parse("shutdown").is_err());
    }

    #[test]
    fn restarted_answers() {
        let r = Restarted {
            pid: 9,
            held_ms: 120,
        };
        assert_eq!(Restarted::parse(&r.line()).unwrap(), r);
        assert_eq!(
            Restarted::parse("error the new process exited").unwrap_err(),
            "the new process exited"
        );
        assert!(Restarted::parse("restarted 9").is_err());
    }

    #[test]
    fn an_fd_crosses_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut f = tempfile();
        f.write_all(b"held bytes").unwrap();
        give(&a, &f, false).unwrap();
        let mut buf = [0u8; 16];
        let (n, got) = sys::recv_with_fd(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"held\n");
        let mut got = got.expect("an fd came along");
        use std::io::Seek;
        got.rewind().unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "held bytes");
    }

    fn tempfile() -> File {
        let p = std::env::temp_dir().join(format!(
            "np-handover-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }
}
