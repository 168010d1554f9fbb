//! TSIG (RFC 8945): a dynamic update signed with a key shared with the DNS
//! server, HMAC-SHA256, the algorithm `tsig-keygen` writes by default. The
//! key is read from a BIND key file (`key "NAME" { algorithm hmac-sha256;
//! secret "BASE64"; };`), the same file the server's configuration includes.

use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::{Message, Name, RData, Record, CLASS_ANY, TYPE_TSIG};

/// How far the server's clock may be from ours (RFC 8945 recommends 300 s).
const FUDGE: u16 = 300;
const ALGORITHM: &str = "hmac-sha256";

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("TSIG key file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TSIG key file {path}: {why}")]
    Bad { path: PathBuf, why: String },
}

/// A TSIG key.
#[derive(Clone)]
pub struct Key {
    pub name: Name,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({})", self.name)
    }
}

impl Key {
    pub fn from_file(path: &Path) -> Result<Key, KeyError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Key::parse(&text).map_err(|why| KeyError::Bad {
            path: path.to_path_buf(),
            why,
        })
    }

    /// The first `key` clause of a BIND key file.
    pub fn parse(text: &str) -> Result<Key, String> {
        let text = strip_comments(text);
        let after = |word: &str, from: usize| -> Option<(usize, String)> {
            let i = text[from..].find(word)? + from + word.len();
            let rest = text[i..].trim_start();
            let start = text.len() - rest.len();
            let v: String = if let Some(q) = rest.strip_prefix('"') {
                q.split('"').next()?.to_string()
            } else {
                rest.split(|c: char| c == ';' || c.is_whitespace())
                    .next()?
                    .to_string()
            };
            Some((start, v))
        };
        let (at, name) = after("key", 0).ok_or("no key \"NAME\" { ... } clause")?;
        let (_, algorithm) = after("algorithm", at).ok_or("no algorithm in the key clause")?;
        let (_, secret) = after("secret", at).ok_or("no secret in the key clause")?;
        if !algorithm.eq_ignore_ascii_case(ALGORITHM) {
            return Err(format!(
                "algorithm {algorithm}: only {ALGORITHM} is supported (tsig-keygen -a hmac-sha256)"
            ));
        }
        let name = Name::parse(&name).map_err(|e| format!("key name: {e}"))?;
        let secret = base64(&secret).ok_or("secret is not base64")?;
        if secret.is_empty() {
            return Err("secret is empty".into());
        }
        Ok(Key { name, secret })
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        Hmac::<Sha256>::new_from_slice(&self.secret).unwrap_or_else(|_| unreachable!())
    }

    /// The TSIG variables after the message (RFC 8945 §4.3.3).
    fn variables(&self, out: &mut Vec<u8>, time: u64, error: u16, other: &[u8]) {
        self.name.write(out);
        out.extend(CLASS_ANY.to_be_bytes());
        out.extend(0u32.to_be_bytes());
        algorithm().write(out);
        out.extend(&time.to_be_bytes()[2..]);
        out.extend(FUDGE.to_be_bytes());
        out.extend(error.to_be_bytes());
        out.extend((other.len() as u16).to_be_bytes());
        out.extend(other);
    }

    /// Signs request `m` at `time` (seconds since 1970): its bytes with the
    /// TSIG record added, and the MAC, which the response's signature covers.
    pub fn sign(&self, m: &Message, time: u64) -> (Vec<u8>, Vec<u8>) {
        let mut msg = m.encode();
        let mut h = self.mac();
        h.update(&msg);
        let mut vars = Vec::new();
        self.variables(&mut vars, time, 0, &[]);
        h.update(&vars);
        let mac = h.finalize().into_bytes().to_vec();
        let mut signed = m.clone();
        signed.additional.push(self.record(m.id, time, &mac));
        msg = signed.encode();
        (msg, mac)
    }

    fn record(&self, id: u16, time: u64, mac: &[u8]) -> Record {
        let mut d = Vec::new();
        algorithm().write(&mut d);
        d.extend(&time.to_be_bytes()[2..]);
        d.extend(FUDGE.to_be_bytes());
        d.extend((mac.len() as u16).to_be_bytes());
        d.extend(mac);
        d.extend(id.to_be_bytes());
        d.extend([0, 0, 0, 0]);
        Record {
            name: self.name.clone(),
            rtype: TYPE_TSIG,
            class: CLASS_ANY,
            ttl: 0,
            data: RData::Raw(d),
        }
    }

    /// Checks the signature of response `bytes` (decoded as `m`) to the
    /// request whose MAC was `request_mac`.
    pub fn verify(&self, bytes: &[u8], m: &Message, request_mac: &[u8]) -> Result<(), String> {
        let (Some(at), Some(rec)) = (m.tsig_at, m.additional.last()) else {
            return Err("the response is not signed (no TSIG record)".into());
        };
        if rec.name != self.name {
            return Err(format!("the response is signed with key {}", rec.name));
        }
        let RData::Raw(d) = &rec.data else {
            return Err("bad TSIG record".into());
        };
        let t = parse_tsig(d).ok_or("bad TSIG record")?;
        if t.error != 0 {
            return Err(format!(
                "the server refused the signature: TSIG error {}",
                t.error
            ));
        }
        let mut h = self.mac();
        h.update(&(request_mac.len() as u16).to_be_bytes());
        h.update(request_mac);
        let mut head = bytes[..at].to_vec();
        head[0..2].copy_from_slice(&t.original_id.to_be_bytes());
        let arcount = u16::from_be_bytes([head[10], head[11]]).saturating_sub(1);
        head[10..12].copy_from_slice(&arcount.to_be_bytes());
        h.update(&head);
        let mut vars = Vec::new();
        self.variables(&mut vars, t.time, t.error, &t.other);
        h.update(&vars);
        h.verify_slice(&t.mac)
            .map_err(|_| "the response's TSIG MAC does not verify".to_string())
    }
}

fn algorithm() -> Name {
    Name::parse(ALGORITHM).unwrap_or_default()
}

struct Tsig {
    time: u64,
    mac: Vec<u8>,
    original_id: u16,
    error: u16,
    other: Vec<u8>,
}

fn parse_tsig(d: &[u8]) -> Option<Tsig> {
    // The algorithm name, uncompressed.
    let mut i = 0;
    while *d.get(i)? != 0 {
        i += 1 + usize::from(d[i]);
    }
    i += 1;
    let u16_at = |i: usize| Some(u16::from_be_bytes([*d.get(i)?, *d.get(i + 1)?]));
    let mut time = [0u8; 8];
    time[2..].copy_from_slice(d.get(i..i + 6)?);
    let mac_len = usize::from(u16_at(i + 8)?);
    let mac = d.get(i + 10..i + 10 + mac_len)?.to_vec();
    let j = i + 10 + mac_len;
    let other_len = usize::from(u16_at(j + 4)?);
    Some(Tsig {
        time: u64::from_be_bytes(time),
        mac,
        original_id: u16_at(j)?,
        error: u16_at(j + 2)?,
        other: d.get(j + 6..j + 6 + other_len)?.to_vec(),
    })
}

/// A key file's text without its comments (`//` and `#` to the end of
/// the line), but for what is inside quotes: a base64 secret may hold
/// `//` (one key in about a hundred did, and was refused as not base64).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut quoted = false;
        let mut end = line.len();
        let mut chars = line.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => quoted = !quoted,
                '#' if !quoted => {
                    end = i;
                    break;
                }
                '/' if !quoted && chars.peek().is_some_and(|&(_, n)| n == '/') => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        out.push_str(&line[..end]);
        out.push('\n');
    }
    out
}

/// Standard base64 with padding, whitespace ignored.
fn base64(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let clean: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let body = clean
        .strip_suffix(b"==")
        .or_else(|| clean.strip_suffix(b"="))
        .unwrap_or(&clean);
    if !clean.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::new();
    for chunk in body.chunks(4) {
        let mut acc = 0u32;
        for &c in chunk {
            acc = acc << 6 | val(c)?;
        }
        acc <<= 6 * (4 - chunk.len() as u32);
        let bytes = acc.to_be_bytes();
        out.extend(&bytes[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dns::wire::{Question, CLASS_IN, TYPE_SOA};

    const KEY: &str = "key \"netpager-lab\" {\n\talgorithm hmac-sha256;\n\tsecret \"c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0IQ==\";\n};\n";

    #[test]
    fn bind_key_files_are_read() {
        let k = Key::parse(KEY).unwrap();
        assert_eq!(k.name, Name::parse("netpager-lab").unwrap());
        assert_eq!(k.secret, b"secret-secret-secret-secret!");
        assert_eq!(base64("YWJj").unwrap(), b"abc");
        assert_eq!(base64("YWI=").unwrap(), b"ab");
        assert_eq!(base64("YQ==").unwrap(), b"a");
        // A secret holding "//" is no comment; comments outside quotes are.
        let k = Key::parse(
            "# made by tsig-keygen\nkey \"k\" { // the lab's\n algorithm hmac-sha256; # sha256\n secret \"ab//cd//+/8=\"; // secret\n};\n",
        )
        .unwrap();
        assert_eq!(k.secret, base64("ab//cd//+/8=").unwrap());
        assert_eq!(k.secret.len(), 8);
        for (text, needle) in [
            ("", "no key"),
            ("key \"k\" { secret \"YQ==\"; };", "no algorithm"),
            (
                "key \"k\" { algorithm hmac-md5; secret \"YQ==\"; };",
                "only hmac-sha256",
            ),
            (
                "key \"k\" { algorithm hmac-sha256; secret \"Y!==\"; };",
                "not base64",
            ),
        ] {
            let e = Key::parse(text).unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn a_signed_message_verifies_as_a_server_would_and_tampering_does_not() {
        let k = Key::parse(KEY).unwrap();
        let m = Message {
            id: 0x1234,
            flags: super::super::wire::OPCODE_UPDATE << 11,
            questions: vec![Question {
                name: Name::parse("lab.test").unwrap(),
                qtype: TYPE_SOA,
                class: CLASS_IN,
            }],
            ..Message::default()
        };
        let (bytes, mac) = k.sign(&m, 1_700_000_000);
        // The server's answer: our request's header as a response, signed
        // over our MAC (a server verifies a request the same way).
        let mut reply = m.clone();
        reply.flags |= super::super::wire::FLAG_QR;
        let mut h = k.mac();
        h.update(&(mac.len() as u16).to_be_bytes());
        h.update(&mac);
        h.update(&reply.encode());
        let mut vars = Vec::new();
        k.variables(&mut vars, 1_700_000_001, 0, &[]);
        h.update(&vars);
        let rmac = h.finalize().into_bytes().to_vec();
        reply.additional.push(k.record(m.id, 1_700_000_001, &rmac));
        let rb = reply.encode();
        let decoded = Message::decode(&rb).unwrap();
        assert!(decoded.tsig_at.is_some());
        k.verify(&rb, &decoded, &mac).unwrap();
        let e = k.verify(&rb, &decoded, &[0; 32]).unwrap_err();
        assert!(e.contains("does not verify"), "{e}");
        let mut unsigned = reply.clone();
        unsigned.additional.clear();
        let ub = unsigned.encode();
        assert!(k.verify(&ub, &Message::decode(&ub).unwrap(), &mac).is_err());
        assert!(Message::decode(&bytes).unwrap().tsig_at.is_some());
    }
}
