//! The device's control socket, `STATE_DIR/control.sock`: how `pagerctl
//! donor-add`, `donor-remove` and `forget-lost` reach a running device, whichever front
//! end serves it (`pagerctl serve`, or nbdkit with the client plugin). One
//! JSON request a connection, one JSON reply; the socket is the owner's
//! only (mode 0600 in a root-owned state directory).
//!
//! Calls: `Inner::add_member`/`remove_member` (membership.rs),
//! `Inner::forget_lost` (lost.rs).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use netpager_membership::{DonorSpec, Joined};
use serde::{Deserialize, Serialize};

use super::{DeviceError, Inner};
use crate::config::DonorConfig;

/// File name inside the state directory.
pub const SOCKET_FILE: &str = "control.sock";
/// How often an idle control thread looks whether the device stops.
const STOP_CHECK: Duration = Duration::from_millis(100);
/// Longest request a client may send.
const MAX_REQUEST: u64 = 64 << 10;

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Add a donor (a spec as `attach --donor` takes it).
    DonorAdd { spec: String },
    /// Start removing the donor with this name or address.
    DonorRemove { donor: String },
    /// Give up on lost data: lost extents in `[first, last]` (all when
    /// absent) are placed again and read as zeros.
    ForgetLost {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        extents: Option<(u64, u64)>,
    },
}

/// What the device answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    /// What was done, or why not.
    pub message: String,
    /// The donor's name (its key in status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub donor: Option<String>,
}

/// Errors of a control client.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(
        "{path}: cannot reach the device's serving process ({source}); is the device attached?"
    )]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: the device answered something that is not a reply: {reason}")]
    Protocol { path: PathBuf, reason: String },
}

/// Sends `req` to the device whose state directory is `dir`.
pub fn send(dir: &Path, req: &Request, timeout: Duration) -> Result<Reply, ControlError> {
    let path = dir.join(SOCKET_FILE);
    let io = |source| ControlError::Io {
        path: path.clone(),
        source,
    };
    let mut s = UnixStream::connect(&path).map_err(|source| ControlError::Connect {
        path: path.clone(),
        source,
    })?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    let mut line = serde_json::to_string(req).expect("a request encodes");
    line.push('\n');
    s.write_all(line.as_bytes()).map_err(io)?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).map_err(io)?;
    serde_json::from_str(&answer).map_err(|e| ControlError::Protocol {
        path: path.clone(),
        reason: format!("{e}: {:?}", answer.trim_end()),
    })
}

/// The listening side, run by a thread of the device.
pub(crate) struct Server {
    listener: UnixListener,
    path: PathBuf,
    /// The socket file's inode, so a stop removes only our own.
    ino: u64,
}

impl Server {
    /// Binds `dir/control.sock`, replacing a stale one.
    pub(crate) fn bind(dir: &Path) -> std::io::Result<Server> {
        let path = dir.join(SOCKET_FILE);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let ino = std::fs::metadata(&path)?.ino();
        Ok(Server {
            listener,
            path,
            ino,
        })
    }

    /// Serves requests until the device stops. The listener does not
    /// block, so the thread notices the stop within [`STOP_CHECK`] without
    /// anyone having to reach the socket (another device may have taken
    /// its path meanwhile).
    pub(crate) fn run(self, inner: Arc<Inner>) {
        if let Err(e) = self.listener.set_nonblocking(true) {
            tracing::error!(
                "{}: {e}; donor-add, donor-remove and forget-lost cannot reach this device",
                self.path.display()
            );
            return;
        }
        while !inner.stop.load(Ordering::Relaxed) {
            let conn = match self.listener.accept() {
                Ok((conn, _)) => conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(STOP_CHECK);
                    continue;
                }
                Err(_) => continue,
            };
            let _ = conn.set_nonblocking(false);
            // One slow client must not hold the socket for long.
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let reply = match read_request(&conn) {
                Ok(req) => answer(&inner, req),
                Err(reason) => Reply {
                    ok: false,
                    message: reason,
                    donor: None,
                },
            };
            let mut line = serde_json::to_string(&reply).expect("a reply encodes");
            line.push('\n');
            let _ = (&conn).write_all(line.as_bytes());
        }
        if std::fs::metadata(&self.path).is_ok_and(|m| m.ino() == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn read_request(conn: &UnixStream) -> Result<Request, String> {
    use std::io::Read;
    let mut line = String::new();
    BufReader::new(conn.take(MAX_REQUEST))
        .read_line(&mut line)
        .map_err(|e| format!("reading the request: {e}"))?;
    serde_json::from_str(&line).map_err(|e| format!("not a request: {e}"))
}

fn answer(inner: &Inner, req: Request) -> Reply {
    let done = |donor: &str, message: String| Reply {
        ok: true,
        message,
        donor: Some(donor.to_string()),
    };
    let failed = |e: String| Reply {
        ok: false,
        message: e,
        donor: None,
    };
    match req {
        Request::DonorAdd { spec } => {
            let spec: DonorSpec = match spec.parse() {
                Ok(s) => s,
                Err(e) => return failed(format!("{e}")),
            };
            let c = DonorConfig::from_spec(&spec, inner.cfg.lab_key().as_deref());
            match inner.add_member(c, Joined::Added, true) {
                Ok(d) => done(
                    &d.cfg.name,
                    format!(
                        "donor {} ({}) added; new extents go to it from the next epoch",
                        d.cfg.name, d.cfg.address
                    ),
                ),
                Err(e) => failed(e.to_string()),
            }
        }
        Request::DonorRemove { donor } => match inner.remove_member(&donor) {
            Ok(d) => done(
                &d.cfg.name,
                format!(
                    "donor {} is leaving: its extents move to the other donors, then it leaves the set",
                    d.cfg.name
                ),
            ),
            Err(DeviceError::Membership(e)) => failed(e),
            Err(e) => failed(e.to_string()),
        },
        Request::ForgetLost { extents } => {
            match inner.forget_lost(extents.map(|(a, b)| a..=b)) {
                Ok(f) => Reply {
                    ok: true,
                    message: forgotten_message(&f),
                    donor: None,
                },
                Err(e) => failed(e.to_string()),
            }
        }
    }
}

fn forgotten_message(f: &super::Forgotten) -> String {
    let extents = if f.extents.is_empty() {
        "no lost extent to place again".to_string()
    } else {
        format!(
            "lost extents {} placed again",
            crate::status::format_ranges(&f.extents)
        )
    };
    format!(
        "{extents}; {} lost pages forgotten; all of them read as zeros now",
        f.pages
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip_as_json() {
        let r = Request::DonorAdd {
            spec: "127.0.0.5:10809,status=127.0.0.5:7070".into(),
        };
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.contains(r#""op":"donor-add""#), "{line}");
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        let r = Request::DonorRemove { donor: "d1".into() };
        assert_eq!(
            serde_json::from_str::<Request>(&serde_json::to_string(&r).unwrap()).unwrap(),
            r
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"format-disk"}"#).is_err());
        for extents in [None, Some((3, 9))] {
            let r = Request::ForgetLost { extents };
            let line = serde_json::to_string(&r).unwrap();
            assert!(line.contains(r#""op":"forget-lost""#), "{line}");
            assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        }
    }

    #[test]
    fn a_missing_socket_says_the_device_is_not_attached() {
        let dir = tempfile::tempdir().unwrap();
        let e = send(
            dir.path(),
            &Request::DonorRemove { donor: "x".into() },
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(e.to_string().contains("is the device attached?"), "{e}");
    }
}
