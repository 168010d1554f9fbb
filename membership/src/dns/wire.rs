//! DNS messages on the wire (RFC 1035 §4), as much as wide-area DNS-SD
//! needs: queries and their answers (PTR, SRV, TXT, A, AAAA, CNAME) and
//! dynamic updates (RFC 2136) with their TSIG record (RFC 8945). Names are
//! written uncompressed; reading follows compression pointers, only
//! backwards, so a hostile message cannot loop.

use std::net::{Ipv4Addr, Ipv6Addr};

pub const TYPE_A: u16 = 1;
pub const TYPE_CNAME: u16 = 5;
pub const TYPE_SOA: u16 = 6;
pub const TYPE_PTR: u16 = 12;
pub const TYPE_TXT: u16 = 16;
pub const TYPE_AAAA: u16 = 28;
pub const TYPE_SRV: u16 = 33;
pub const TYPE_TSIG: u16 = 250;
pub const TYPE_ANY: u16 = 255;
pub const CLASS_IN: u16 = 1;
pub const CLASS_NONE: u16 = 254;
pub const CLASS_ANY: u16 = 255;
pub const OPCODE_UPDATE: u16 = 5;
/// Header flags: a response; truncated; recursion desired.
pub const FLAG_QR: u16 = 0x8000;
pub const FLAG_TC: u16 = 0x0200;
pub const FLAG_RD: u16 = 0x0100;
/// Records read from one message at most.
const MAX_RECORDS: usize = 4096;
/// Compression pointers followed in one name at most.
const MAX_HOPS: usize = 64;

/// What is wrong with a message, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("DNS message: {what} at byte {at}")]
    Bad { what: String, at: usize },
    #[error("DNS name {name:?}: {why}")]
    Name { name: String, why: &'static str },
}

fn bad(what: impl Into<String>, at: usize) -> WireError {
    WireError::Bad {
        what: what.into(),
        at,
    }
}

/// A domain name: its labels, compared without regard to ASCII case.
#[derive(Debug, Clone, Default)]
pub struct Name(Vec<Vec<u8>>);

impl Name {
    /// `a.b.c` or `a.b.c.`; no escapes (the labels netpager writes hold no dots).
    pub fn parse(s: &str) -> Result<Name, WireError> {
        let err = |why| WireError::Name {
            name: s.to_string(),
            why,
        };
        let t = s.strip_suffix('.').unwrap_or(s);
        if t.is_empty() {
            return Ok(Name::default());
        }
        let labels: Vec<Vec<u8>> = t.split('.').map(|l| l.as_bytes().to_vec()).collect();
        if labels.iter().any(|l| l.is_empty()) {
            return Err(err("has an empty label"));
        }
        if labels.iter().any(|l| l.len() > 63) {
            return Err(err("has a label longer than 63 bytes"));
        }
        let n = Name(labels);
        if n.wire_len() > 255 {
            return Err(err("is longer than 255 bytes"));
        }
        Ok(n)
    }

    /// `label` in front of this name.
    pub fn child(&self, label: &str) -> Result<Name, WireError> {
        Name::parse(&format!("{label}.{self}"))
    }

    pub fn labels(&self) -> &[Vec<u8>] {
        &self.0
    }

    fn wire_len(&self) -> usize {
        self.0.iter().map(|l| l.len() + 1).sum::<usize>() + 1
    }

    /// Lower-case, uncompressed: TSIG's canonical form.
    pub fn write(&self, out: &mut Vec<u8>) {
        for l in &self.0 {
            out.push(l.len() as u8);
            out.extend(l.iter().map(u8::to_ascii_lowercase));
        }
        out.push(0);
    }
}

impl PartialEq for Name {
    fn eq(&self, o: &Name) -> bool {
        self.0.len() == o.0.len()
            && self
                .0
                .iter()
                .zip(&o.0)
                .all(|(a, b)| a.eq_ignore_ascii_case(b))
    }
}

impl Eq for Name {}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str(".");
        }
        let s: Vec<String> = self
            .0
            .iter()
            .map(|l| String::from_utf8_lossy(l).into_owned())
            .collect();
        f.write_str(&s.join("."))
    }
}

/// A record's data, decoded for the types DNS-SD uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RData {
    /// PTR and CNAME.
    Name(Name),
    Srv {
        priority: u16,
        weight: u16,
        port: u16,
        target: Name,
    },
    Txt(Vec<Vec<u8>>),
    A(Ipv4Addr),
    Aaaa(Ipv6Addr),
    /// Any other type, and the empty data of an update's deletions.
    Raw(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub name: Name,
    pub rtype: u16,
    pub class: u16,
    pub ttl: u32,
    pub data: RData,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub name: Name,
    pub qtype: u16,
    pub class: u16,
}

/// A message. In an update the sections are zone, prerequisites, updates
/// and additional data (RFC 2136 §2).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    pub id: u16,
    pub flags: u16,
    pub questions: Vec<Question>,
    pub answers: Vec<Record>,
    pub authority: Vec<Record>,
    pub additional: Vec<Record>,
    /// Where the last additional record starts when it is a TSIG record
    /// (set by [`Message::decode`]): the signed part ends there.
    pub tsig_at: Option<usize>,
}

impl Message {
    pub fn rcode(&self) -> u16 {
        self.flags & 0xf
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        for v in [
            self.id,
            self.flags,
            self.questions.len() as u16,
            self.answers.len() as u16,
            self.authority.len() as u16,
            self.additional.len() as u16,
        ] {
            out.extend(v.to_be_bytes());
        }
        for q in &self.questions {
            q.name.write(&mut out);
            out.extend(q.qtype.to_be_bytes());
            out.extend(q.class.to_be_bytes());
        }
        for r in self
            .answers
            .iter()
            .chain(&self.authority)
            .chain(&self.additional)
        {
            write_record(r, &mut out);
        }
        out
    }

    pub fn decode(b: &[u8]) -> Result<Message, WireError> {
        let mut r = Reader { b, pos: 0 };
        let mut h = [0u16; 6];
        for v in &mut h {
            *v = r.u16()?;
        }
        let counts = [h[2], h[3], h[4], h[5]].map(usize::from);
        if counts.iter().sum::<usize>() > MAX_RECORDS {
            return Err(bad(
                format!(
                    "{} records (at most {MAX_RECORDS})",
                    counts.iter().sum::<usize>()
                ),
                4,
            ));
        }
        let mut m = Message {
            id: h[0],
            flags: h[1],
            ..Message::default()
        };
        for _ in 0..counts[0] {
            let name = r.name()?;
            m.questions.push(Question {
                name,
                qtype: r.u16()?,
                class: r.u16()?,
            });
        }
        for (n, sec) in [(counts[1], &mut m.answers), (counts[2], &mut m.authority)] {
            for _ in 0..n {
                sec.push(r.record()?);
            }
        }
        for i in 0..counts[3] {
            let at = r.pos;
            let rec = r.record()?;
            if rec.rtype == TYPE_TSIG {
                if i + 1 != counts[3] {
                    return Err(bad("a TSIG record that is not the last one", at));
                }
                m.tsig_at = Some(at);
            }
            m.additional.push(rec);
        }
        Ok(m)
    }
}

fn write_record(r: &Record, out: &mut Vec<u8>) {
    r.name.write(out);
    out.extend(r.rtype.to_be_bytes());
    out.extend(r.class.to_be_bytes());
    out.extend(r.ttl.to_be_bytes());
    let mut d = Vec::new();
    match &r.data {
        RData::Name(n) => n.write(&mut d),
        RData::Srv {
            priority,
            weight,
            port,
            target,
        } => {
            for v in [priority, weight, port] {
                d.extend(v.to_be_bytes());
            }
            target.write(&mut d);
        }
        RData::Txt(strings) => {
            for s in strings {
                d.push(s.len().min(255) as u8);
                d.extend(&s[..s.len().min(255)]);
            }
        }
        RData::A(a) => d.extend(a.octets()),
        RData::Aaaa(a) => d.extend(a.octets()),
        RData::Raw(raw) => d.extend(raw),
    }
    out.extend((d.len() as u16).to_be_bytes());
    out.extend(d);
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let end =
            end.ok_or_else(|| bad(format!("message ends inside a {n}-byte field"), self.pos))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        let s = self.take(2)?;
        Ok(u16::from_be_bytes([s[0], s[1]]))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let s = self.take(4)?;
        Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }

    /// A name at the current position, following compression pointers.
    fn name(&mut self) -> Result<Name, WireError> {
        let (n, end) = read_name(self.b, self.pos)?;
        self.pos = end;
        Ok(n)
    }

    fn record(&mut self) -> Result<Record, WireError> {
        let name = self.name()?;
        let (rtype, class, ttl) = (self.u16()?, self.u16()?, self.u32()?);
        let len = usize::from(self.u16()?);
        let start = self.pos;
        let raw = self.take(len)?;
        let data_err = |what: &str| {
            bad(
                format!("{what} in the data of a type-{rtype} record"),
                start,
            )
        };
        let data = match rtype {
            TYPE_PTR | TYPE_CNAME => {
                let (n, end) = read_name(self.b, start)?;
                if end != start + len {
                    return Err(data_err("a name not filling it"));
                }
                RData::Name(n)
            }
            TYPE_SRV => {
                if len < 7 {
                    return Err(data_err("too few bytes"));
                }
                let f = |i: usize| u16::from_be_bytes([raw[i], raw[i + 1]]);
                let (target, end) = read_name(self.b, start + 6)?;
                if end != start + len {
                    return Err(data_err("a target not filling it"));
                }
                RData::Srv {
                    priority: f(0),
                    weight: f(2),
                    port: f(4),
                    target,
                }
            }
            TYPE_TXT => {
                let mut strings = Vec::new();
                let mut i = 0;
                while i < raw.len() {
                    let n = usize::from(raw[i]);
                    let s = raw
                        .get(i + 1..i + 1 + n)
                        .ok_or_else(|| data_err("a string past the end"))?;
                    strings.push(s.to_vec());
                    i += 1 + n;
                }
                RData::Txt(strings)
            }
            TYPE_A if len == 4 => RData::A(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3])),
            TYPE_AAAA if len == 16 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(raw);
                RData::Aaaa(Ipv6Addr::from(o))
            }
            TYPE_A | TYPE_AAAA => return Err(data_err("a wrong length")),
            _ => RData::Raw(raw.to_vec()),
        };
        Ok(Record {
            name,
            rtype,
            class,
            ttl,
            data,
        })
    }
}

/// Reads the name at `pos` of message `b`: the name and where it ends (after
/// the first pointer, if any). A pointer must point before the label that
/// holds it, so every jump goes backwards and the walk ends.
fn read_name(b: &[u8], mut pos: usize) -> Result<(Name, usize), WireError> {
    let mut labels = Vec::new();
    let (mut end, mut hops, mut len) = (None, 0, 1usize);
    loop {
        let &l = b
            .get(pos)
            .ok_or_else(|| bad("message ends inside a name", pos))?;
        match l {
            0 => {
                return Ok((Name(labels), end.unwrap_or(pos + 1)));
            }
            l if l & 0xc0 == 0xc0 => {
                let &lo = b
                    .get(pos + 1)
                    .ok_or_else(|| bad("message ends inside a pointer", pos))?;
                let target = usize::from(u16::from_be_bytes([l & 0x3f, lo]));
                hops += 1;
                if target >= pos || hops > MAX_HOPS {
                    return Err(bad(
                        "a compression pointer that does not point backwards",
                        pos,
                    ));
                }
                end.get_or_insert(pos + 2);
                pos = target;
            }
            l if l & 0xc0 != 0 => return Err(bad(format!("label type {:#x}", l & 0xc0), pos)),
            l => {
                let n = usize::from(l);
                let s = b
                    .get(pos + 1..pos + 1 + n)
                    .ok_or_else(|| bad("message ends inside a label", pos))?;
                len += n + 1;
                if len > 255 {
                    return Err(bad("a name longer than 255 bytes", pos));
                }
                labels.push(s.to_vec());
                pos += 1 + n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Name {
        Name::parse(s).unwrap()
    }

    #[test]
    fn messages_round_trip() {
        let m = Message {
            id: 7,
            flags: FLAG_QR,
            questions: vec![Question {
                name: name("_netpager._tcp.lab.example."),
                qtype: TYPE_PTR,
                class: CLASS_IN,
            }],
            answers: vec![
                Record {
                    name: name("_netpager._tcp.lab.example"),
                    rtype: TYPE_PTR,
                    class: CLASS_IN,
                    ttl: 60,
                    data: RData::Name(name("d1._netpager._tcp.lab.example")),
                },
                Record {
                    name: name("d1._netpager._tcp.lab.example"),
                    rtype: TYPE_SRV,
                    class: CLASS_IN,
                    ttl: 60,
                    data: RData::Srv {
                        priority: 0,
                        weight: 0,
                        port: 10809,
                        target: name("d1-netpager.lab.example"),
                    },
                },
                Record {
                    name: name("d1._netpager._tcp.lab.example"),
                    rtype: TYPE_TXT,
                    class: CLASS_IN,
                    ttl: 60,
                    data: RData::Txt(vec![b"v=1".to_vec(), b"node=d1".to_vec()]),
                },
            ],
            authority: vec![],
            additional: vec![Record {
                name: name("d1-netpager.lab.example"),
                rtype: TYPE_A,
                class: CLASS_IN,
                ttl: 60,
                data: RData::A(Ipv4Addr::new(127, 0, 0, 9)),
            }],
            tsig_at: None,
        };
        assert_eq!(Message::decode(&m.encode()).unwrap(), m);
        assert_eq!(name("A.b."), name("a.B"));
        assert_eq!(name("a.b").to_string(), "a.b");
    }

    #[test]
    fn compression_pointers_are_followed_backwards_only() {
        // Header, one question "lab.example" at 12, then an answer whose
        // name is a pointer to it and whose PTR data is "d1" + pointer.
        let mut b = vec![0, 1, 0x80, 0, 0, 1, 0, 1, 0, 0, 0, 0];
        name("lab.example").write(&mut b);
        b.extend([0, TYPE_PTR as u8, 0, 1]);
        b.extend([
            0xc0,
            12,
            0,
            TYPE_PTR as u8,
            0,
            1,
            0,
            0,
            0,
            60,
            0,
            5,
            2,
            b'd',
            b'1',
            0xc0,
            12,
        ]);
        let m = Message::decode(&b).unwrap();
        assert_eq!(m.answers[0].name, name("lab.example"));
        assert_eq!(m.answers[0].data, RData::Name(name("d1.lab.example")));
        // A pointer to itself, and one forward: refused, not followed.
        for target in [29u8, 40] {
            let mut l = b.clone();
            l[29] = 0xc0;
            l[30] = target;
            let e = Message::decode(&l).unwrap_err().to_string();
            assert!(
                e.contains("does not point backwards") && e.contains("byte 29"),
                "{e}"
            );
        }
    }

    #[test]
    fn hostile_and_truncated_messages_are_errors_not_panics() {
        let good = Message {
            id: 1,
            questions: vec![Question {
                name: name("x.y"),
                qtype: TYPE_TXT,
                class: CLASS_IN,
            }],
            answers: vec![Record {
                name: name("x.y"),
                rtype: TYPE_TXT,
                class: CLASS_IN,
                ttl: 1,
                data: RData::Txt(vec![b"v=1".to_vec()]),
            }],
            ..Message::default()
        }
        .encode();
        for cut in 0..good.len() {
            assert!(Message::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = vec![0u8; 12];
        long[5] = 1;
        for _ in 0..5 {
            long.push(63);
            long.extend([b'a'; 63]);
        }
        long.push(0);
        let e = Message::decode(&long).unwrap_err().to_string();
        assert!(e.contains("longer than 255"), "{e}");
        let mut many = good.clone();
        many[6] = 0xff;
        assert!(Message::decode(&many)
            .unwrap_err()
            .to_string()
            .contains("records"));
        assert!(Name::parse(&"a".repeat(64)).is_err());
        assert!(Name::parse("a..b").is_err());
    }
}
