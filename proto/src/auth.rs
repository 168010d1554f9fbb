//! Authentication of the status endpoint with the lab's pre-shared key.
//!
//! The same key file that nbdkit uses for TLS-PSK (`--tls-psk=FILE`, lines
//! of `username:hexkey`) authenticates status requests, so a lab has one
//! secret. Each request carries a timestamp, a fresh nonce and
//! HMAC-SHA256(key, tag ‖ timestamp ‖ nonce ‖ request-without-auth); the
//! donor checks the MAC, refuses stale timestamps and replayed nonces, and
//! signs its reply over the request's nonce so the client knows who answered.
//! The endpoint is not encrypted: status carries counters, not pages.
//!
//! Exports belong to their client: a donor started with an export secret
//! (known to donors and admins, not to clients) opens an export only under
//! the name `CLIENT~TOKEN`, TOKEN = [`export_token`] of the secret and
//! CLIENT, so the lab key alone does not let one client open another's pages.

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use prost::Message;
use sha2::Sha256;

use crate::v1;

type HmacSha256 = Hmac<Sha256>;

const REQUEST_TAG: &[u8] = b"netpager-status-request-v1";
const REPLY_TAG: &[u8] = b"netpager-status-reply-v1";
const METRICS_TAG: &[u8] = b"netpager-metrics-bearer-v1";
const EXPORT_TAG: &[u8] = b"netpager-export-v1";
/// Hex characters of an export token (the first 16 bytes of the HMAC).
pub const EXPORT_TOKEN_HEX: usize = 32;
/// How far a request's timestamp may be from the donor's clock.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);
const NONCE_BYTES: usize = 16;
/// Nonces remembered against replay; older ones are outside the skew window.
const REPLAY_MEMORY: usize = 65_536;

/// Why a key file could not be used or a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot read key file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: expected `username:hexkey`")]
    Syntax { path: String, line: usize },
    #[error("{path}:{line}: key is not even-length hex of at least 16 bytes")]
    BadKey { path: String, line: usize },
    #[error("{path}: no key for username {username:?}")]
    NoSuchUser { path: String, username: String },
    #[error("{path}: no key in file")]
    Empty { path: String },
    #[error("authentication required: this donor was started with a key")]
    Missing,
    #[error("request timestamp is {0:?} away from the donor's clock")]
    Stale(Duration),
    #[error("nonce must be {NONCE_BYTES} bytes")]
    BadNonce,
    #[error("replayed request (nonce seen before)")]
    Replay,
    #[error("bad MAC: the sender does not hold the lab key")]
    BadMac,
}

/// The lab's shared secret, loaded from a TLS-PSK file.
#[derive(Clone)]
pub struct LabKey {
    username: String,
    key: Vec<u8>,
}

impl std::fmt::Debug for LabKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key itself.
        f.debug_struct("LabKey")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

impl LabKey {
    /// Loads the key of `username` (or the first key when `None`) from a
    /// `username:hexkey` file as written by psktool or the Ansible roles.
    pub fn from_psk_file(path: &Path, username: Option<&str>) -> Result<LabKey, AuthError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
            path: p.clone(),
            source,
        })?;
        let mut first = None;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (user, hex) = line.split_once(':').ok_or(AuthError::Syntax {
                path: p.clone(),
                line: i + 1,
            })?;
            let key =
                decode_hex(hex.trim())
                    .filter(|k| k.len() >= 16)
                    .ok_or(AuthError::BadKey {
                        path: p.clone(),
                        line: i + 1,
                    })?;
            let entry = LabKey {
                username: user.to_string(),
                key,
            };
            match username {
                Some(u) if u == entry.username => return Ok(entry),
                Some(_) => {}
                None => {
                    if first.is_none() {
                        first = Some(entry);
                    }
                }
            }
        }
        match username {
            Some(u) => Err(AuthError::NoSuchUser {
                path: p,
                username: u.to_string(),
            }),
            None => first.ok_or(AuthError::Empty { path: p }),
        }
    }

    /// The username the key belongs to (the TLS-PSK identity).
    pub fn username(&self) -> &str {
        &self.username
    }

    /// Whether `other` holds the same key (whatever its username).
    pub fn same_key(&self, other: &LabKey) -> bool {
        self.key == other.key
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.key).expect("HMAC takes keys of any length")
    }

    /// Adds a fresh `Auth` to a request.
    pub fn sign_request(&self, req: &mut v1::Request) {
        let mut nonce = vec![0u8; NONCE_BYTES];
        getrandom::fill(&mut nonce).expect("the kernel's random source is available");
        let timestamp_ms = now_ms();
        req.auth = None;
        let mac = self.request_mac(timestamp_ms, &nonce, &req.encode_to_vec());
        req.auth = Some(v1::Auth {
            timestamp_ms,
            nonce,
            mac,
        });
    }

    fn request_mac(&self, timestamp_ms: u64, nonce: &[u8], body: &[u8]) -> Vec<u8> {
        let mut m = self.mac();
        m.update(REQUEST_TAG);
        m.update(&timestamp_ms.to_le_bytes());
        m.update(nonce);
        m.update(body);
        m.finalize().into_bytes().to_vec()
    }

    fn reply_mac(&self, nonce: &[u8], reply: &v1::Reply) -> HmacSha256 {
        let mut unsigned = reply.clone();
        unsigned.mac.clear();
        let mut m = self.mac();
        m.update(REPLY_TAG);
        m.update(nonce);
        m.update(&unsigned.encode_to_vec());
        m
    }

    /// Signs a donor's reply to a request carrying `nonce`.
    pub fn sign_reply(&self, nonce: &[u8], reply: &mut v1::Reply) {
        reply.mac = self
            .reply_mac(nonce, reply)
            .finalize()
            .into_bytes()
            .to_vec();
    }

    /// The bearer token that opens `/metrics` endpoints keyed with this
    /// key: lower-case hex of HMAC-SHA256(key, "netpager-metrics-bearer-v1").
    /// Prometheus presents it (`authorization: credentials_file`) without
    /// holding the lab key itself, which also keys TLS and status requests.
    pub fn metrics_token(&self) -> String {
        let mut m = self.mac();
        m.update(METRICS_TAG);
        m.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Whether `presented` is [`LabKey::metrics_token`], compared in
    /// constant time.
    pub fn check_metrics_token(&self, presented: &str) -> bool {
        let Some(t) = decode_hex(presented) else {
            return false;
        };
        let mut m = self.mac();
        m.update(METRICS_TAG);
        m.verify_slice(&t).is_ok()
    }

    /// Checks a donor's reply to a request carrying `nonce`.
    pub fn verify_reply(&self, nonce: &[u8], reply: &v1::Reply) -> Result<(), AuthError> {
        self.reply_mac(nonce, reply)
            .verify_slice(&reply.mac)
            .map_err(|_| AuthError::BadMac)
    }
}

/// Donor-side check of requests, remembering nonces against replay.
pub struct Verifier {
    key: LabKey,
    seen: HashSet<Vec<u8>>,
    order: VecDeque<Vec<u8>>,
}

impl Verifier {
    pub fn new(key: LabKey) -> Verifier {
        Verifier {
            key,
            seen: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    pub fn key(&self) -> &LabKey {
        &self.key
    }

    /// Accepts a request only if its MAC is right, its timestamp recent and
    /// its nonce new. Returns the nonce, for signing the reply.
    pub fn verify(&mut self, req: &v1::Request) -> Result<Vec<u8>, AuthError> {
        let auth = req.auth.as_ref().ok_or(AuthError::Missing)?;
        if auth.nonce.len() != NONCE_BYTES {
            return Err(AuthError::BadNonce);
        }
        let skew = now_ms().abs_diff(auth.timestamp_ms);
        if skew > MAX_CLOCK_SKEW.as_millis() as u64 {
            return Err(AuthError::Stale(Duration::from_millis(skew)));
        }
        let mut unsigned = req.clone();
        unsigned.auth = None;
        let mut m = self.key.mac();
        m.update(REQUEST_TAG);
        m.update(&auth.timestamp_ms.to_le_bytes());
        m.update(&auth.nonce);
        m.update(&unsigned.encode_to_vec());
        m.verify_slice(&auth.mac).map_err(|_| AuthError::BadMac)?;
        if !self.seen.insert(auth.nonce.clone()) {
            return Err(AuthError::Replay);
        }
        self.order.push_back(auth.nonce.clone());
        if self.order.len() > REPLAY_MEMORY {
            if let Some(old) = self.order.pop_front() {
                self.seen.remove(&old);
            }
        }
        Ok(auth.nonce.clone())
    }
}

/// Loads an export secret: the first line of `path` that is neither empty
/// nor a `#` comment, even-length hex of at least 16 bytes (as written by
/// `openssl rand -hex 32`).
pub fn load_export_secret(path: &Path) -> Result<Vec<u8>, AuthError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
        path: p.clone(),
        source,
    })?;
    let (i, line) = text
        .lines()
        .map(str::trim)
        .enumerate()
        .find(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .ok_or(AuthError::Empty { path: p.clone() })?;
    decode_hex(line)
        .filter(|k| k.len() >= 16)
        .ok_or(AuthError::BadKey {
            path: p,
            line: i + 1,
        })
}

fn export_mac(secret: &[u8], client: &str) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(EXPORT_TAG);
    m.update(client.as_bytes());
    m
}

/// The token that entitles `client` to its exports: the first
/// [`EXPORT_TOKEN_HEX`] lower-case hex characters of
/// HMAC-SHA256(secret, "netpager-export-v1" ‖ client).
pub fn export_token(secret: &[u8], client: &str) -> String {
    export_mac(secret, client).finalize().into_bytes()[..EXPORT_TOKEN_HEX / 2]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `token` is `client`'s export token, compared in constant time
/// so that timing does not reveal how much of a guess was right.
pub fn check_export_token(secret: &[u8], client: &str, token: &str) -> bool {
    match decode_hex(token) {
        Some(t) if t.len() == EXPORT_TOKEN_HEX / 2 => {
            export_mac(secret, client).verify_truncated_left(&t).is_ok()
        }
        _ => false,
    }
}

/// Why an identity cannot be a line of a lab key file.
fn check_identity(id: &str) -> Result<(), String> {
    if id.is_empty() || id.contains(':') || id.chars().any(char::is_whitespace) {
        return Err(format!(
            "identity {id:?}: must be non-empty, without ':' or spaces"
        ));
    }
    Ok(())
}

/// The text of a new lab key file: a line `IDENTITY:HEXKEY` for each of
/// `identities` (the lab identity first, then every client id: a client
/// presents its id as its TLS identity), all with one fresh random 32-byte
/// key. Donors and clients take the same file.
pub fn new_psk_file_text(identities: &[&str]) -> Result<String, String> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| format!("the kernel's random source: {e}"))?;
    psk_lines(&key, identities)
}

/// Lines for `identities` not in the lab key file `path` yet, with its key
/// (the first line's).
pub fn psk_lines_to_add(path: &Path, identities: &[&str]) -> Result<String, String> {
    let first = LabKey::from_psk_file(path, None).map_err(|e| e.to_string())?;
    let new: Vec<&str> = identities
        .iter()
        .copied()
        .filter(|id| LabKey::from_psk_file(path, Some(id)).is_err())
        .collect();
    psk_lines(&first.key, &new)
}

fn psk_lines(key: &[u8], identities: &[&str]) -> Result<String, String> {
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = String::new();
    for id in identities {
        check_identity(id)?;
        if !out.lines().any(|l| l.split(':').next() == Some(id)) {
            out.push_str(&format!("{id}:{hex}\n"));
        }
    }
    Ok(out)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_psk_file_holds_one_key_for_every_identity() {
        let dir = std::env::temp_dir().join(format!("netpager-psk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lab.psk");
        let text = new_psk_file_text(&["netpager", "c1", "c1"]).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
        std::fs::write(&path, &text).unwrap();
        let lab = LabKey::from_psk_file(&path, None).unwrap();
        assert_eq!(lab.username(), "netpager");
        assert!(lab.same_key(&LabKey::from_psk_file(&path, Some("c1")).unwrap()));
        // Another file gets another key.
        let other = new_psk_file_text(&["netpager"]).unwrap();
        assert_ne!(other.lines().next(), text.lines().next());
        // Adding: only the missing identities, with the file's key.
        let add = psk_lines_to_add(&path, &["c1", "c2"]).unwrap();
        assert!(add.starts_with("c2:") && add.lines().count() == 1, "{add}");
        std::fs::write(&path, text + &add).unwrap();
        assert!(lab.same_key(&LabKey::from_psk_file(&path, Some("c2")).unwrap()));
        assert!(new_psk_file_text(&["a b"]).unwrap_err().contains("spaces"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn key(hex: &str) -> LabKey {
        LabKey {
            username: "lab".into(),
            key: decode_hex(hex).unwrap(),
        }
    }

    fn status_request() -> v1::Request {
        v1::Request {
            body: Some(v1::request::Body::Status(v1::StatusQuery {})),
            auth: None,
        }
    }

    #[test]
    fn metrics_token_is_the_documented_hmac() {
        let k = key("00112233445566778899aabbccddeeff");
        // HMAC-SHA256(key, "netpager-metrics-bearer-v1"), as Python's hmac
        // module computes it: what pager-server(1) tells admins to expect.
        let want = "076efc5a5be79ec12a1b296862d25bf53f7e32d2826f65f3f8bfc282a4432f10";
        assert_eq!(k.metrics_token(), want);
        assert!(k.check_metrics_token(want));
        assert!(!k.check_metrics_token(&want[..62]));
        assert!(!k.check_metrics_token(&want.replace('0', "1")));
        assert!(!k.check_metrics_token("zz"));
        assert!(!k.check_metrics_token(""));
        let other = key("ffeeddccbbaa99887766554433221100");
        assert!(!other.check_metrics_token(want));
    }

    #[test]
    fn signed_request_verifies_once() {
        let k = key("00112233445566778899aabbccddeeff");
        let mut v = Verifier::new(k.clone());
        let mut req = status_request();
        k.sign_request(&mut req);
        assert!(v.verify(&req).is_ok());
        assert!(matches!(v.verify(&req), Err(AuthError::Replay)));
    }

    #[test]
    fn wrong_key_missing_auth_and_tampering_are_refused() {
        let k = key("00112233445566778899aabbccddeeff");
        let other = key("ffeeddccbbaa99887766554433221100");
        let mut v = Verifier::new(k.clone());
        let mut req = status_request();
        other.sign_request(&mut req);
        assert!(matches!(v.verify(&req), Err(AuthError::BadMac)));
        assert!(matches!(
            v.verify(&status_request()),
            Err(AuthError::Missing)
        ));
        let mut req = status_request();
        k.sign_request(&mut req);
        req.body = Some(v1::request::Body::Drain(v1::DrainCommand { drain: true }));
        assert!(matches!(v.verify(&req), Err(AuthError::BadMac)));
    }

    #[test]
    fn stale_timestamp_is_refused() {
        let k = key("00112233445566778899aabbccddeeff");
        let mut v = Verifier::new(k.clone());
        let mut req = status_request();
        k.sign_request(&mut req);
        let auth = req.auth.as_mut().unwrap();
        auth.timestamp_ms -= 10 * MAX_CLOCK_SKEW.as_millis() as u64;
        assert!(matches!(v.verify(&req), Err(AuthError::Stale(_))));
    }

    #[test]
    fn reply_signature_binds_nonce_and_content() {
        let k = key("00112233445566778899aabbccddeeff");
        let mut reply = v1::Reply {
            body: Some(v1::reply::Body::Error("x".into())),
            mac: vec![],
        };
        k.sign_reply(b"nonce-one-16byte", &mut reply);
        assert!(k.verify_reply(b"nonce-one-16byte", &reply).is_ok());
        assert!(k.verify_reply(b"nonce-two-16byte", &reply).is_err());
        reply.body = Some(v1::reply::Body::Error("y".into()));
        assert!(k.verify_reply(b"nonce-one-16byte", &reply).is_err());
    }

    #[test]
    fn export_tokens_are_per_client_and_per_secret() {
        let secret = decode_hex("000102030405060708090a0b0c0d0e0f").unwrap();
        let t = export_token(&secret, "c1");
        // HMAC-SHA256(secret, "netpager-export-v1c1"), first 16 bytes; the
        // same recipe as SECURITY.md's openssl line.
        assert_eq!(t, "2aa4f884c232b7839fb1c4d683aec0f6");
        assert_eq!(t.len(), EXPORT_TOKEN_HEX);
        assert!(check_export_token(&secret, "c1", &t));
        assert!(check_export_token(&secret, "c1", &t.to_uppercase()));
        assert_ne!(export_token(&secret, "c2"), t);
        assert!(!check_export_token(&secret, "c2", &t));
        assert!(!check_export_token(&secret, "c1", &t[..30]));
        assert!(!check_export_token(&secret, "c1", &format!("{t}00")));
        assert!(!check_export_token(&secret, "c1", ""));
        let other = decode_hex("0f0e0d0c0b0a09080706050403020100").unwrap();
        assert!(!check_export_token(&other, "c1", &t));
    }

    #[test]
    fn export_secret_file_is_one_hex_line() {
        let dir = std::env::temp_dir().join(format!("netpager-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("export.secret");
        std::fs::write(&f, "# export secret\n\n000102030405060708090a0b0c0d0e0f\n").unwrap();
        assert_eq!(
            load_export_secret(&f).unwrap(),
            decode_hex("000102030405060708090a0b0c0d0e0f").unwrap()
        );
        std::fs::write(&f, "\n0011\n").unwrap();
        let err = load_export_secret(&f).unwrap_err().to_string();
        assert!(err.contains(":2:"), "{err}");
        std::fs::write(&f, "# nothing\n").unwrap();
        assert!(matches!(
            load_export_secret(&f),
            Err(AuthError::Empty { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(
            load_export_secret(&f),
            Err(AuthError::Read { .. })
        ));
    }

    #[test]
    fn psk_file_parsing_names_the_line() {
        let dir = std::env::temp_dir().join(format!("netpager-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("keys.psk");
        std::fs::write(&f, "# lab key\nalice:00112233445566778899aabbccddeeff\nbob:ffeeddccbbaa99887766554433221100\n").unwrap();
        assert_eq!(LabKey::from_psk_file(&f, None).unwrap().username(), "alice");
        assert_eq!(
            LabKey::from_psk_file(&f, Some("bob")).unwrap().username(),
            "bob"
        );
        assert!(matches!(
            LabKey::from_psk_file(&f, Some("carol")),
            Err(AuthError::NoSuchUser { .. })
        ));
        std::fs::write(&f, "alice:00112233445566778899aabbccddeeff\nbob:zz\n").unwrap();
        let err = LabKey::from_psk_file(&f, None).unwrap_err().to_string();
        assert!(err.contains(":2:"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
