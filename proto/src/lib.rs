//! Messages and framing of the donor status endpoint.
//!
//! A pager-server donor publishes its state on `status=ADDR:PORT`; clients
//! (pager-client's epoch poller, `pagerctl donor-status`, prefetchd) read it
//! here. Every message is a prost length-delimited protobuf message; see
//! `proto/netpager.proto` for the fields and their meaning.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use prost::Message;

pub mod auth;

pub use auth::LabKey;

/// Generated protobuf types (package `netpager.v1`).
// Generated code, not ours to box: one 240-byte reply per request is fine.
#[allow(clippy::large_enum_variant)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/netpager.v1.rs"));
}

pub use v1::{DonorState, DonorStatus, ExportUsage};

/// Largest message either side accepts; anything longer is garbage.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// Errors of the status protocol.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("i/o with status endpoint {addr}: {source}")]
    Io {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot connect to status endpoint {addr}: {source}{}", connect_hint(.source))]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("status endpoint {addr} sent no reply within {secs} s: is it the donor's status port (pager-server status=), and is the donor running rather than stopped or overloaded?")]
    NoAnswer { addr: String, secs: u64 },
    #[error("{addr} is not a status endpoint: it speaks NBD (it is the donor's NBD port; the status endpoint is the address given to pager-server status=)")]
    SpeaksNbd { addr: String },
    #[error("status message from {addr} announces {len} bytes, more than the {max} allowed")]
    TooLong { addr: String, len: u64, max: usize },
    #[error("malformed length prefix from {addr}")]
    BadLength { addr: String },
    #[error("undecodable status message from {addr}: {source}")]
    Decode {
        addr: String,
        #[source]
        source: prost::DecodeError,
    },
    #[error("donor {addr} refused the request: {reason}")]
    Refused { addr: String, reason: String },
    #[error("donor {addr} sent a reply without a body")]
    EmptyReply { addr: String },
    #[error("cannot resolve status address {addr:?}")]
    Resolve { addr: String },
}

/// Reads one length-delimited message. `Ok(None)` is a clean end of stream
/// before the first byte of a message.
pub fn read_message<M: Message + Default>(
    r: &mut impl Read,
    peer: &str,
) -> Result<Option<M>, ProtoError> {
    let io_err = |source| ProtoError::Io {
        addr: peer.to_string(),
        source,
    };
    let mut len: u64 = 0;
    for i in 0..10 {
        let mut b = [0u8; 1];
        match r.read(&mut b) {
            Ok(0) if i == 0 => return Ok(None),
            Ok(0) => return Err(io_err(io::ErrorKind::UnexpectedEof.into())),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err(e)),
        }
        len |= u64::from(b[0] & 0x7f) << (7 * i);
        if b[0] & 0x80 == 0 {
            if len > MAX_MESSAGE_BYTES as u64 {
                return Err(ProtoError::TooLong {
                    addr: peer.to_string(),
                    len,
                    max: MAX_MESSAGE_BYTES,
                });
            }
            let mut buf = vec![0u8; len as usize];
            r.read_exact(&mut buf).map_err(io_err)?;
            return M::decode(buf.as_slice())
                .map(Some)
                .map_err(|source| ProtoError::Decode {
                    addr: peer.to_string(),
                    source,
                });
        }
    }
    Err(ProtoError::BadLength {
        addr: peer.to_string(),
    })
}

/// Writes one length-delimited message.
pub fn write_message<M: Message>(
    w: &mut impl Write,
    msg: &M,
    peer: &str,
) -> Result<(), ProtoError> {
    w.write_all(&msg.encode_length_delimited_to_vec())
        .and_then(|_| w.flush())
        .map_err(|source| ProtoError::Io {
            addr: peer.to_string(),
            source,
        })
}

/// What to check when a connection to a status endpoint fails.
fn connect_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => {
            " (nothing listens there: is the donor running, and was it started with status= at this address?)"
        }
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
            " (no answer: is the host up, and does a firewall let the port through?)"
        }
        _ => "",
    }
}

/// The first bytes an NBD server sends on every new connection
/// (`NBDMAGIC`, then `IHAVEOPT`).
const NBD_GREETING: &[u8; 16] = b"NBDMAGICIHAVEOPT";

/// An error of a read or write on a connected status endpoint: a timeout
/// is named as one.
fn io_error(addr: &str, source: io::Error, timeout: Duration) -> ProtoError {
    match source.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ProtoError::NoAnswer {
            addr: addr.to_string(),
            secs: timeout.as_secs_f64().ceil() as u64,
        },
        _ => ProtoError::Io {
            addr: addr.to_string(),
            source,
        },
    }
}

/// Whether the peer greets like an NBD server (it sends its greeting
/// before any request). Waits up to `timeout` for the first bytes of the
/// reply without consuming them.
fn speaks_nbd(s: &TcpStream, timeout: Duration) -> io::Result<bool> {
    let deadline = std::time::Instant::now() + timeout;
    let mut buf = [0u8; 16];
    loop {
        let n = s.peek(&mut buf)?;
        if n == 0 || buf[..n] != NBD_GREETING[..n] {
            return Ok(false);
        }
        if n == buf.len() {
            return Ok(true);
        }
        // A partial greeting: the rest follows at once, or the reply's
        // own read times out.
        if std::time::Instant::now() > deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, ProtoError> {
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| ProtoError::Resolve {
            addr: addr.to_string(),
        })
}

/// Talks to donors' status endpoints, signing requests when it holds the
/// lab key (donors started with a key refuse anything else).
#[derive(Debug, Clone)]
pub struct StatusClient {
    pub timeout: Duration,
    pub key: Option<LabKey>,
}

impl StatusClient {
    /// Sends one request on a new connection and returns the donor's
    /// reply, checking the reply's signature when a key is held.
    pub fn call(&self, addr: &str, req: v1::Request) -> Result<v1::Reply, ProtoError> {
        let mut s = self.connect(addr)?;
        self.exchange(&mut s, addr, req)
    }

    fn connect(&self, addr: &str) -> Result<TcpStream, ProtoError> {
        let io_err = |source| ProtoError::Io {
            addr: addr.to_string(),
            source,
        };
        let sa = resolve(addr)?;
        let s = TcpStream::connect_timeout(&sa, self.timeout).map_err(|source| {
            ProtoError::Connect {
                addr: addr.to_string(),
                source,
            }
        })?;
        s.set_read_timeout(Some(self.timeout)).map_err(io_err)?;
        s.set_write_timeout(Some(self.timeout)).map_err(io_err)?;
        s.set_nodelay(true).map_err(io_err)?;
        Ok(s)
    }

    /// One request and its reply on connection `s`.
    fn exchange(
        &self,
        s: &mut TcpStream,
        addr: &str,
        mut req: v1::Request,
    ) -> Result<v1::Reply, ProtoError> {
        if let Some(key) = &self.key {
            key.sign_request(&mut req);
        }
        write_message(s, &req, addr).map_err(|e| self.named(e))?;
        if speaks_nbd(s, self.timeout).map_err(|e| io_error(addr, e, self.timeout))? {
            return Err(ProtoError::SpeaksNbd {
                addr: addr.to_string(),
            });
        }
        let reply = read_message::<v1::Reply>(s, addr)
            .map_err(|e| self.named(e))?
            .ok_or_else(|| ProtoError::Io {
                addr: addr.to_string(),
                source: io::ErrorKind::UnexpectedEof.into(),
            })?;
        if let (Some(key), Some(auth)) = (&self.key, &req.auth) {
            // A donor refusing a request it could not authenticate does not
            // sign the refusal: report its reason rather than the signature.
            if reply.mac.is_empty() {
                let reason = match &reply.body {
                    Some(v1::reply::Body::Error(reason)) => format!("{reason} (unsigned refusal)"),
                    _ => "its reply is not signed: the donor runs without psk= (the lab key), so its status cannot be trusted".into(),
                };
                return Err(ProtoError::Refused {
                    addr: addr.to_string(),
                    reason,
                });
            }
            key.verify_reply(&auth.nonce, &reply)
                .map_err(|e| ProtoError::Refused {
                    addr: addr.to_string(),
                    reason: format!("reply not signed by the lab key: {e}"),
                })?;
        }
        Ok(reply)
    }

    /// A timeout of the framing's i/o named as one.
    fn named(&self, e: ProtoError) -> ProtoError {
        match e {
            ProtoError::Io { addr, source } => io_error(&addr, source, self.timeout),
            e => e,
        }
    }

    /// Reads a donor's current status.
    pub fn query(&self, addr: &str) -> Result<DonorStatus, ProtoError> {
        expect_status(addr, self.call(addr, status_query())?)
    }

    /// Asks a donor to start or stop draining; returns its status afterwards.
    pub fn set_draining(&self, addr: &str, drain: bool) -> Result<DonorStatus, ProtoError> {
        let req = v1::Request {
            body: Some(v1::request::Body::Drain(v1::DrainCommand { drain })),
            auth: None,
        };
        expect_status(addr, self.call(addr, req)?)
    }

    /// Polls the donor at `addr` every half second until it holds nothing
    /// (`None`: a drain is over) or `limit` has passed (its last status);
    /// `seen` gets every status on the way.
    pub fn wait_empty(
        &self,
        addr: &str,
        limit: Duration,
        mut seen: impl FnMut(&DonorStatus),
    ) -> Result<Option<DonorStatus>, ProtoError> {
        let start = std::time::Instant::now();
        loop {
            let s = self.query(addr)?;
            seen(&s);
            if s.used_bytes == 0 {
                return Ok(None);
            }
            if start.elapsed() > limit {
                return Ok(Some(s));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// A status connection to one donor kept from one query to the next, so
/// that polling a donor every epoch costs it one request, not a connection
/// and a thread. A kept connection the donor has closed (its lifetime or
/// idle timeout is over) is replaced once by a fresh one.
#[derive(Debug)]
pub struct StatusSession {
    client: StatusClient,
    conn: Option<TcpStream>,
}

impl StatusSession {
    pub fn new(client: StatusClient) -> StatusSession {
        StatusSession { client, conn: None }
    }

    /// A connection is kept: the next query is one round trip, no connect.
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Reads the status of the donor at `addr`.
    pub fn query(&mut self, addr: &str) -> Result<DonorStatus, ProtoError> {
        if let Some(mut s) = self.conn.take() {
            match self.client.exchange(&mut s, addr, status_query()) {
                Ok(reply) => return self.keep(s, addr, reply),
                // Closed while idle: a fresh connection below. A timeout
                // (NoAnswer) is a slow or hung donor, and asking again
                // would wait as long.
                Err(ProtoError::Io { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let mut s = self.client.connect(addr)?;
        let reply = self.client.exchange(&mut s, addr, status_query())?;
        self.keep(s, addr, reply)
    }

    /// Keeps `s` when `reply` is a status; a refusal closes the connection
    /// on the donor's side, so it is dropped here too.
    fn keep(
        &mut self,
        s: TcpStream,
        addr: &str,
        reply: v1::Reply,
    ) -> Result<DonorStatus, ProtoError> {
        let status = expect_status(addr, reply)?;
        self.conn = Some(s);
        Ok(status)
    }
}

fn status_query() -> v1::Request {
    v1::Request {
        body: Some(v1::request::Body::Status(v1::StatusQuery {})),
        auth: None,
    }
}

fn expect_status(addr: &str, reply: v1::Reply) -> Result<DonorStatus, ProtoError> {
    match reply.body {
        Some(v1::reply::Body::Status(s)) => Ok(s),
        Some(v1::reply::Body::Error(reason)) => Err(ProtoError::Refused {
            addr: addr.to_string(),
            reason,
        }),
        None => Err(ProtoError::EmptyReply {
            addr: addr.to_string(),
        }),
    }
}

/// Reads a donor's current status without a key (donors on loopback demos).
pub fn query_status(addr: &str, timeout: Duration) -> Result<DonorStatus, ProtoError> {
    StatusClient { timeout, key: None }.query(addr)
}

/// Asks a keyless donor to start or stop draining.
pub fn set_draining(addr: &str, drain: bool, timeout: Duration) -> Result<DonorStatus, ProtoError> {
    StatusClient { timeout, key: None }.set_draining(addr, drain)
}

impl DonorState {
    /// The lower-case word used in tables, JSON and logs.
    pub fn word(self) -> &'static str {
        match self {
            DonorState::Idle => "idle",
            DonorState::Busy => "busy",
            DonorState::Draining => "draining",
        }
    }
}

/// The exports of `s` holding pages that no client is connected to, as
/// `NAME (SIZE)`: pages of a detached device, or of a client that is gone.
pub fn unclaimed_exports(s: &DonorStatus) -> Vec<String> {
    s.exports
        .iter()
        .filter(|e| e.clients == 0 && e.used_bytes > 0)
        .map(|e| format!("{} ({})", e.name, netpager_util::format_size(e.used_bytes)))
        .collect()
}

/// What a drain that did not finish says about pages no client can move
/// (empty when there are none).
pub fn unclaimed_note(s: &DonorStatus) -> String {
    let u = unclaimed_exports(s);
    if u.is_empty() {
        return String::new();
    }
    format!(
        "; no client is connected to {}: pages of a detached device no drain moves (pagerctl release --state-dir DIR on its client frees them)",
        u.join(", ")
    )
}

/// A donor's status as JSON, with the state as a word.
/// Logical bytes over the bytes they take (a donor's or an export's
/// compression ratio); `None` while they take nothing.
pub fn compression_ratio(logical: u64, stored: u64) -> Option<f64> {
    (stored > 0).then(|| logical as f64 / stored as f64)
}

pub fn status_json(s: &DonorStatus) -> serde_json::Value {
    serde_json::json!({
        "node_id": s.node_id,
        "state": s.state().word(),
        "state_reason": s.state_reason,
        "budget_bytes": s.budget_bytes,
        "used_bytes": s.used_bytes,
        "free_bytes": s.free_bytes,
        "reserve_bytes": s.reserve_bytes,
        "mem_available_bytes": s.mem_available_bytes,
        "page_size": s.page_size,
        "age_x": s.age_x,
        "age_x_ms": s.age_x_ms,
        "utilisation": s.utilisation,
        "u_star": s.u_star,
        "u_unused": s.u_unused,
        "mean_service_us": s.mean_service_us,
        "reads": s.reads,
        "writes": s.writes,
        "bytes_read": s.bytes_read,
        "bytes_written": s.bytes_written,
        "trims": s.trims,
        "zeroes": s.zeroes,
        "enospc": s.enospc,
        "uptime_ms": s.uptime_ms,
        "compress": s.compress,
        "logical_bytes": s.logical_bytes,
        "ratio": compression_ratio(s.logical_bytes, s.used_bytes),
        "capacity_bytes": s.capacity_bytes,
        "offered_ratio": s.offered_ratio,
        "exports": s.exports.iter().map(|e| serde_json::json!({
            "name": e.name, "size_bytes": e.size_bytes, "used_bytes": e.used_bytes,
            "clients": e.clients,
            "logical_bytes": e.logical_bytes,
            "ratio": compression_ratio(e.logical_bytes, e.used_bytes),
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_through_framing() {
        let msg = DonorStatus {
            node_id: "d1".into(),
            used_bytes: 4096,
            ..Default::default()
        };
        let mut buf = Vec::new();
        write_message(&mut buf, &msg, "test").unwrap();
        let got: DonorStatus = read_message(&mut buf.as_slice(), "test").unwrap().unwrap();
        assert_eq!(got, msg);
    }

    #[test]
    fn clean_eof_is_none_and_truncation_is_an_error() {
        assert!(read_message::<DonorStatus>(&mut &[][..], "t")
            .unwrap()
            .is_none());
        let msg = DonorStatus {
            node_id: "d1".into(),
            ..Default::default()
        };
        let buf = msg.encode_length_delimited_to_vec();
        assert!(read_message::<DonorStatus>(&mut &buf[..buf.len() - 1], "t").is_err());
    }

    #[test]
    fn oversized_and_endless_prefixes_are_refused() {
        let mut big = Vec::new();
        prost::encoding::encode_varint((MAX_MESSAGE_BYTES + 1) as u64, &mut big);
        assert!(matches!(
            read_message::<DonorStatus>(&mut big.as_slice(), "t"),
            Err(ProtoError::TooLong { .. })
        ));
        let endless = [0xffu8; 16];
        assert!(matches!(
            read_message::<DonorStatus>(&mut &endless[..], "t"),
            Err(ProtoError::BadLength { .. })
        ));
    }

    /// A keyed client asking a donor that answers with `reply`; the
    /// donor's end is a one-shot listener on loopback.
    fn keyed_call(reply: v1::Reply) -> Result<v1::Reply, ProtoError> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let donor = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let _: v1::Request = read_message(&mut s, "client").unwrap().unwrap();
            write_message(&mut s, &reply, "client").unwrap();
        });
        let dir = std::env::temp_dir().join(format!("netpager-proto-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let psk = dir.join("lab.psk");
        std::fs::write(&psk, "lab:00112233445566778899aabbccddeeff\n").unwrap();
        let key = LabKey::from_psk_file(&psk, None).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let client = StatusClient {
            timeout: Duration::from_secs(5),
            key: Some(key),
        };
        let got = client.call(
            &addr,
            v1::Request {
                body: Some(v1::request::Body::Status(v1::StatusQuery {})),
                auth: None,
            },
        );
        donor.join().unwrap();
        got
    }

    #[test]
    fn a_keyed_client_names_a_donor_without_psk() {
        let unsigned = v1::Reply {
            body: Some(v1::reply::Body::Status(DonorStatus::default())),
            mac: Vec::new(),
        };
        let err = keyed_call(unsigned).unwrap_err().to_string();
        assert!(err.contains("not signed") && err.contains("psk="), "{err}");
        let refusal = v1::Reply {
            body: Some(v1::reply::Body::Error("bad MAC".into())),
            mac: Vec::new(),
        };
        let err = keyed_call(refusal).unwrap_err().to_string();
        assert!(err.contains("bad MAC (unsigned refusal)"), "{err}");
        let forged = v1::Reply {
            body: Some(v1::reply::Body::Status(DonorStatus::default())),
            mac: vec![0; 32],
        };
        let err = keyed_call(forged).unwrap_err().to_string();
        assert!(err.contains("reply not signed by the lab key"), "{err}");
    }

    #[test]
    fn a_session_keeps_its_connection_and_replaces_one_the_donor_closed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        // The donor answers two requests on its first connection, then
        // closes it (as its lifetime running out does), then one more on a
        // second connection.
        let donor = std::thread::spawn(move || {
            for answers in [2u64, 1] {
                let (mut s, _) = listener.accept().unwrap();
                for n in 0..answers {
                    let _: v1::Request = read_message(&mut s, "client").unwrap().unwrap();
                    let reply = v1::Reply {
                        body: Some(v1::reply::Body::Status(DonorStatus {
                            used_bytes: answers * 10 + n,
                            ..Default::default()
                        })),
                        mac: Vec::new(),
                    };
                    write_message(&mut s, &reply, "client").unwrap();
                }
            }
        });
        let mut session = StatusSession::new(StatusClient {
            timeout: Duration::from_secs(5),
            key: None,
        });
        assert!(!session.is_connected());
        let used: Vec<u64> = (0..3)
            .map(|_| session.query(&addr).unwrap().used_bytes)
            .collect();
        assert_eq!(used, [20, 21, 10]);
        assert!(session.is_connected());
        donor.join().unwrap();
    }

    /// What a status query says when the address is not a status
    /// endpoint: an NBD server (it greets first), a silent one, nothing.
    #[test]
    fn a_wrong_address_is_named_in_words() {
        let client = StatusClient {
            timeout: Duration::from_millis(300),
            key: None,
        };
        let nbd = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = nbd.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = nbd.accept().unwrap();
            s.write_all(b"NBDMAGICIHAVEOPT\x00\x03").unwrap();
            // Held open: the client must not wait for it to close.
            let mut b = [0u8; 64];
            let _ = s.read(&mut b);
        });
        let start = std::time::Instant::now();
        let e = client.query(&addr).unwrap_err();
        assert!(matches!(e, ProtoError::SpeaksNbd { .. }), "{e}");
        assert!(e.to_string().contains("it speaks NBD"), "{e}");
        assert!(
            start.elapsed() < Duration::from_millis(300),
            "waited for a timeout"
        );
        server.join().unwrap();

        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap().to_string();
        let e = client.query(&addr).unwrap_err();
        assert!(matches!(e, ProtoError::NoAnswer { .. }), "{e}");
        assert!(e.to_string().contains("sent no reply within 1 s"), "{e}");
        drop(silent);

        let e = client.query(&addr).unwrap_err();
        assert!(e.to_string().contains("nothing listens there"), "{e}");
    }

    #[test]
    fn json_names_the_state() {
        let s = DonorStatus {
            state: DonorState::Draining as i32,
            ..Default::default()
        };
        assert_eq!(status_json(&s)["state"], "draining");
    }
}
