//! The status endpoint: a TCP listener answering `netpager_proto`
//! requests (length-delimited protobuf) with the donor's status.
//!
//! Hostile input is bounded: at most [`MAX_CONNECTIONS`] connections are
//! served at once (others get an error reply and are closed), every read
//! and write times out after [`IO_TIMEOUT`], a connection lives at most
//! [`CONNECTION_LIFETIME`], and a malformed, oversized or truncated message
//! gets an `error` reply (when the socket still takes one) and a close.
//!
//! With the lab key ([`Auth`]) a request must be signed: one that is
//! unsigned, signed with another key, stale or replayed gets an `error`
//! reply carrying no status and the connection is closed. Replies are
//! signed over the request's nonce whenever the request's MAC verified.
//! The key file is read again when it changes, as nbdkit's TLS reads it at
//! every handshake, so replacing it rotates both keys without a restart.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use netpager_proto::auth::{AuthError, LabKey, Verifier};
use netpager_proto::v1::{reply, Reply, Request};
use netpager_proto::{read_message, write_message, ProtoError};
use netpager_util::LockExt;

use crate::donor::Donor;

/// Every client keeps one connection to each donor from one epoch to the
/// next (`StatusSession`), so this bounds the clients a donor serves at
/// once, not just bursts.
pub const MAX_CONNECTIONS: usize = 128;
/// A connection thread decodes one small message at a time; under
/// `mlock=true` every stack page it touches stays locked.
const CONNECTION_STACK: usize = 256 << 10;
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("status={addr}: cannot resolve the address")]
    Resolve { addr: String },
    #[error("status={addr}: cannot listen: {source}")]
    Bind {
        addr: String,
        #[source]
        source: io::Error,
    },
}

/// The socket address `status=ADDR:PORT` names.
pub fn resolve(addr: &str) -> Result<SocketAddr, StatusError> {
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| StatusError::Resolve {
            addr: addr.to_string(),
        })
}

/// Listens on `addr` (`ADDR:PORT`), before nbdkit forks, so that a taken
/// port stops nbdkit at start instead of failing silently later.
pub fn bind(addr: &str) -> Result<TcpListener, StatusError> {
    TcpListener::bind(resolve(addr)?).map_err(|source| StatusError::Bind {
        addr: addr.to_string(),
        source,
    })
}

/// What identifies one version of a key file: a replaced file (rename) has
/// a new inode, a rewritten one a new mtime or length.
type FileStamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &Path) -> FileStamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// Request authentication with the lab key of a TLS-PSK file (`psk=`).
pub struct Auth {
    path: PathBuf,
    current: Mutex<Keyed>,
}

struct Keyed {
    stamp: FileStamp,
    key: LabKey,
    verifier: Verifier,
}

impl Auth {
    /// Loads the key of the file's first line.
    pub fn load(path: &Path) -> Result<Auth, AuthError> {
        let stamp = stamp(path);
        let key = LabKey::from_psk_file(path, None)?;
        Ok(Auth {
            path: path.to_path_buf(),
            current: Mutex::new(Keyed {
                stamp,
                verifier: Verifier::new(key.clone()),
                key,
            }),
        })
    }

    /// Checks a request against the key in force, first reloading the key
    /// if the file changed. A file that cannot be read or parsed leaves the
    /// old key in force and is reported once per change. Returns the key,
    /// for signing the reply, and the verdict.
    fn verify(&self, req: &Request, donor: &Donor) -> (LabKey, Result<Vec<u8>, AuthError>) {
        let mut k = self.current.lock_or_recover();
        let now = stamp(&self.path);
        if now != k.stamp {
            k.stamp = now;
            match LabKey::from_psk_file(&self.path, None) {
                Ok(key) => {
                    (donor.log().debug)(&format!(
                        "psk={}: file changed, status key reloaded",
                        self.path.display()
                    ));
                    k.verifier = Verifier::new(key.clone());
                    k.key = key;
                }
                Err(e) => (donor.log().error)(&format!("psk=: {e}; keeping the key loaded before")),
            }
        }
        let verdict = k.verifier.verify(req);
        (k.key.clone(), verdict)
    }
}

/// Serves the endpoint on its own thread, for the life of the process.
pub fn spawn(listener: TcpListener, donor: Arc<Donor>, auth: Option<Arc<Auth>>) -> io::Result<()> {
    std::thread::Builder::new()
        .name("pager-status".into())
        .spawn(move || accept_loop(listener, donor, auth))?;
    Ok(())
}

/// Decrements the live-connection count when a connection thread ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(listener: TcpListener, donor: Arc<Donor>, auth: Option<Arc<Auth>>) {
    // Status is polled every epoch by every client: its threads (they
    // inherit this one's priority) must not delay a data request's reply.
    if let Err(e) = netpager_util::process::background_thread() {
        (donor.log().debug)(&format!("status endpoint stays at its priority: {e}"));
    }
    let live = Arc::new(AtomicUsize::new(0));
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors and the like: wait rather than spin.
                (donor.log().debug)(&format!("status endpoint: accept: {e}"));
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "unknown peer".to_string(), |a| a.to_string());
        if live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            let _slot = Slot(Arc::clone(&live));
            refuse(stream, &peer, "too many status connections; try again");
            continue;
        }
        let slot = Slot(Arc::clone(&live));
        let d = Arc::clone(&donor);
        let a = auth.clone();
        let spawned = std::thread::Builder::new()
            .name("pager-status-conn".into())
            .stack_size(CONNECTION_STACK)
            .spawn(move || {
                let _slot = slot;
                serve(stream, &peer, &d, a.as_deref());
            });
        if let Err(e) = spawned {
            (donor.log().error)(&format!(
                "status endpoint: cannot start a connection thread: {e}"
            ));
        }
    }
}

fn error_reply(why: String) -> Reply {
    Reply {
        body: Some(reply::Body::Error(why)),
        ..Default::default()
    }
}

fn refuse(mut stream: TcpStream, peer: &str, why: &str) {
    if stream.set_write_timeout(Some(IO_TIMEOUT)).is_ok() {
        let _ = write_message(&mut stream, &error_reply(why.to_string()), peer);
    }
}

/// Reads from a socket with a timeout that never reaches past `deadline`.
struct Bounded<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "status connection lifetime over",
            ));
        }
        self.stream.set_read_timeout(Some(left.min(IO_TIMEOUT)))?;
        self.stream.read(buf)
    }
}

/// The reply to one request, and whether the connection may carry more.
fn answer(req: Request, peer: &str, donor: &Donor, auth: Option<&Auth>) -> (Reply, bool) {
    let Some(auth) = auth else {
        return (donor.handle(req, Instant::now()), true);
    };
    let (key, verified) = auth.verify(&req, donor);
    match verified {
        Ok(nonce) => {
            let mut reply = donor.handle(req, Instant::now());
            key.sign_reply(&nonce, &mut reply);
            (reply, true)
        }
        Err(e) => {
            (donor.log().debug)(&format!(
                "status endpoint: refused a request from {peer}: {e}"
            ));
            let mut reply = error_reply(format!("not authenticated: {e}"));
            // A replayed request's MAC verified: its sender holds the key
            // and may check who refused it.
            if let (AuthError::Replay, Some(a)) = (&e, &req.auth) {
                key.sign_reply(&a.nonce, &mut reply);
            }
            (reply, false)
        }
    }
}

/// Answers requests on one connection until the peer closes it, it stalls,
/// it sends garbage or an unauthenticated request, or its lifetime is over.
pub fn serve(stream: TcpStream, peer: &str, donor: &Donor, auth: Option<&Auth>) {
    let deadline = Instant::now() + CONNECTION_LIFETIME;
    if stream.set_write_timeout(Some(IO_TIMEOUT)).is_err() || stream.set_nodelay(true).is_err() {
        return;
    }
    let mut writer = &stream;
    loop {
        let mut reader = Bounded {
            stream: &stream,
            deadline,
        };
        let (reply, more) = match read_message::<Request>(&mut reader, peer) {
            Ok(None) => return,
            Ok(Some(req)) => answer(req, peer, donor, auth),
            Err(ProtoError::Io { .. }) => return,
            Err(e) => {
                (donor.log().debug)(&format!("status endpoint: {e}"));
                let _ = write_message(&mut writer, &error_reply(e.to_string()), peer);
                return;
            }
        };
        if write_message(&mut writer, &reply, peer).is_err() || !more {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::donor::{Logger, Settings};
    use crate::memwatch::MemInfo;
    use crate::state::Observation;
    use netpager_proto::v1::{request, DrainCommand, StatusQuery};
    use std::io::Write;

    fn quiet(_: &str) {}

    fn endpoint(auth: Option<Arc<Auth>>) -> String {
        let mem = MemInfo {
            total: 1 << 30,
            available: 1 << 29,
        };
        let settings = Settings::resolve(&Config::default(), mem, "st", 2);
        let donor = Donor::new(
            settings,
            Observation { mem, load1: 0.0 },
            Instant::now(),
            Logger {
                debug: quiet,
                error: quiet,
            },
        );
        let listener = bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        spawn(listener, Arc::new(donor), auth).unwrap();
        addr
    }

    fn raw_exchange(addr: &str, bytes: &[u8]) -> Option<Reply> {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The endpoint may answer and close before all of it is sent.
        let _ = s
            .write_all(bytes)
            .and_then(|_| s.shutdown(std::net::Shutdown::Write));
        read_message::<Reply>(&mut s, "test").ok().flatten()
    }

    #[test]
    fn answers_queries_and_survives_garbage() {
        let addr = endpoint(None);
        let t = Duration::from_secs(10);
        assert_eq!(
            netpager_proto::query_status(&addr, t).unwrap().node_id,
            "st"
        );
        // Undecodable body: an error reply.
        let reply = raw_exchange(&addr, &[3, 0xff, 0xff, 0xff]).unwrap();
        assert!(
            matches!(reply.body, Some(reply::Body::Error(ref e)) if e.contains("undecodable")),
            "{reply:?}"
        );
        // Oversized length prefix: an error reply, nothing allocated.
        let reply = raw_exchange(&addr, &[0xff, 0xff, 0xff, 0xff, 0x0f]).unwrap();
        assert!(
            matches!(reply.body, Some(reply::Body::Error(ref e)) if e.contains("more than")),
            "{reply:?}"
        );
        // Truncated message and endless varint: closed, or an error reply.
        for junk in [&[10u8, 1, 2][..], &[0x80; 12][..]] {
            if let Some(r) = raw_exchange(&addr, junk) {
                assert!(matches!(r.body, Some(reply::Body::Error(_))), "{r:?}");
            }
        }
        // An empty message decodes as a Request without a body.
        let reply = raw_exchange(&addr, &[0]).unwrap();
        assert!(
            matches!(reply.body, Some(reply::Body::Error(ref e)) if e.contains("no body")),
            "{reply:?}"
        );
        // Many idle connections: the endpoint still answers (excess ones
        // are refused, not queued).
        let idle: Vec<_> = (0..MAX_CONNECTIONS + 4)
            .map(|_| TcpStream::connect(&addr).unwrap())
            .collect();
        let mut extra = TcpStream::connect(&addr).unwrap();
        extra.set_read_timeout(Some(t)).unwrap();
        let refused = read_message::<Reply>(&mut extra, "test").unwrap().unwrap();
        assert!(
            matches!(refused.body, Some(reply::Body::Error(ref e)) if e.contains("too many")),
            "{refused:?}"
        );
        drop(idle);
        // Up to a minute: the endpoint's threads see the hang-ups when the
        // machine lets them run.
        let back = (0..1200).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            netpager_proto::query_status(&addr, t).is_ok()
        });
        assert!(
            back,
            "the endpoint answers again once idle connections close"
        );
    }

    /// Writes a one-line key file the way Ansible does (aside, then renamed).
    fn key_file(dir: &Path, name: &str, hex: &str) -> LabKey {
        let p = dir.join(name);
        let tmp = dir.join(format!("{name}.new"));
        std::fs::write(&tmp, format!("lab:{hex}\n")).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
        LabKey::from_psk_file(&p, None).unwrap()
    }

    fn exchange(s: &mut TcpStream, req: &Request) -> Option<Reply> {
        write_message(s, req, "test").ok()?;
        read_message::<Reply>(s, "test").ok().flatten()
    }

    fn request(body: request::Body) -> Request {
        Request {
            body: Some(body),
            auth: None,
        }
    }

    fn refusal(r: &Reply) -> &str {
        match &r.body {
            Some(reply::Body::Error(e)) => e,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn keyed_endpoint_answers_only_signed_fresh_requests() {
        let dir = tempfile::tempdir().unwrap();
        let key = key_file(dir.path(), "lab.psk", "00112233445566778899aabbccddeeff");
        let wrong = key_file(dir.path(), "wrong.psk", "ffeeddccbbaa99887766554433221100");
        let addr = endpoint(Some(Arc::new(
            Auth::load(&dir.path().join("lab.psk")).unwrap(),
        )));
        let connect = || {
            let s = TcpStream::connect(&addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s
        };
        let status = || request(request::Body::Status(StatusQuery {}));
        let drain = |on| request(request::Body::Drain(DrainCommand { drain: on }));

        // Signed: the status, signed over our nonce; the connection stays open.
        let mut s = connect();
        let mut req = status();
        key.sign_request(&mut req);
        let r = exchange(&mut s, &req).unwrap();
        assert!(
            matches!(r.body, Some(reply::Body::Status(ref st)) if st.node_id == "st"),
            "{r:?}"
        );
        key.verify_reply(&req.auth.as_ref().unwrap().nonce, &r)
            .unwrap();
        // The same request again is a replay: refused (signed, its MAC was
        // right), and the connection is closed.
        let r = exchange(&mut s, &req).unwrap();
        assert!(refusal(&r).contains("replayed"), "{r:?}");
        key.verify_reply(&req.auth.as_ref().unwrap().nonce, &r)
            .unwrap();
        assert!(
            exchange(&mut s, &req).is_none(),
            "connection closed after a refusal"
        );

        // Unsigned, signed with another key, stale: refused, no status,
        // unsigned reply.
        let mut wrong_req = status();
        wrong.sign_request(&mut wrong_req);
        let mut stale = status();
        key.sign_request(&mut stale);
        stale.auth.as_mut().unwrap().timestamp_ms -= 3_600_000;
        for (req, why) in [
            (status(), "authentication required"),
            (wrong_req, "bad MAC"),
            (stale, "away from"),
        ] {
            let r = exchange(&mut connect(), &req).unwrap();
            assert!(refusal(&r).contains(why), "{why}: {r:?}");
            assert!(
                r.mac.is_empty(),
                "{why}: a refusal of an unverified request is not signed"
            );
        }

        // A drain without the key changes nothing; with it, the donor drains.
        let r = exchange(&mut connect(), &drain(true)).unwrap();
        assert!(refusal(&r).contains("authentication required"), "{r:?}");
        let signed = netpager_proto::StatusClient {
            timeout: Duration::from_secs(10),
            key: Some(key.clone()),
        };
        assert_eq!(
            signed.query(&addr).unwrap().state(),
            netpager_proto::DonorState::Idle
        );
        assert_eq!(
            signed.set_draining(&addr, true).unwrap().state(),
            netpager_proto::DonorState::Draining
        );
        // The keyless client of the protocol crate is refused too.
        assert!(netpager_proto::query_status(&addr, Duration::from_secs(10)).is_err());
    }

    #[test]
    fn a_replaced_key_file_rotates_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let old = key_file(dir.path(), "lab.psk", "00112233445566778899aabbccddeeff");
        let addr = endpoint(Some(Arc::new(
            Auth::load(&dir.path().join("lab.psk")).unwrap(),
        )));
        let client = |key: &LabKey| netpager_proto::StatusClient {
            timeout: Duration::from_secs(10),
            key: Some(key.clone()),
        };
        assert!(client(&old).query(&addr).is_ok());
        let new = key_file(dir.path(), "lab.psk", "0f1e2d3c4b5a69788796a5b4c3d2e1f0");
        assert_eq!(client(&new).query(&addr).unwrap().node_id, "st");
        assert!(
            client(&old).query(&addr).is_err(),
            "the old key still works"
        );
        // A broken file leaves the key in force.
        std::fs::write(dir.path().join("lab.psk"), "lab:zz\n").unwrap();
        assert!(client(&new).query(&addr).is_ok());
    }
}
