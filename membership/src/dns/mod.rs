//! Wide-area DNS-SD (RFC 6763 over unicast DNS): donors found through the
//! lab's own DNS, across routers that stop multicast DNS.
//!
//! A donor with `announce=dns` publishes `_netpager._tcp.ZONE` PTR, SRV and
//! TXT records (the TXT as its mDNS announcement) and an address record for
//! the SRV target, by RFC 2136 dynamic updates signed with a TSIG key
//! ([`Publisher`]), and removes them at a clean stop. A client browsing a
//! domain ([`DomainBrowser`]) asks the system's resolver or a named server
//! for the PTR records, then each new instance's SRV, TXT and address. The
//! messages are ours ([`wire`], [`tsig`]): a small codec over UDP, and TCP
//! when an answer does not fit.

pub mod lease;
pub mod prune;
pub mod tsig;
pub mod wire;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::discovery::{decode, node_label, txt_record, Announced};
use wire::{Message, Name, Question, RData, Record};
use wire::{CLASS_ANY, CLASS_IN, CLASS_NONE, FLAG_QR, FLAG_RD, FLAG_TC, OPCODE_UPDATE};
use wire::{TYPE_A, TYPE_AAAA, TYPE_ANY, TYPE_CNAME, TYPE_PTR, TYPE_SOA, TYPE_SRV, TYPE_TXT};

/// The service's label pair under a domain.
pub const SERVICE: &str = "_netpager._tcp";
/// Instances listed from one domain at most.
const MAX_INSTANCES: usize = 1024;
/// CNAMEs followed within one answer at most.
const MAX_CNAMES: usize = 8;
/// An instance's records are asked again after their TTL, within these.
const MIN_CACHE: Duration = Duration::from_secs(1);
const MAX_CACHE: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("DNS server {server}: {why}")]
    Server { server: SocketAddr, why: String },
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error(transparent)]
    Key(#[from] tsig::KeyError),
    #[error("no DNS server: {0}")]
    NoServer(String),
}

/// The first `nameserver` of resolv.conf's text, port 53.
pub fn resolv_conf_server(text: &str) -> Option<SocketAddr> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("nameserver"))
            .then(|| w.next()?.parse::<IpAddr>().ok())
            .flatten()
            .map(|ip| SocketAddr::new(ip, 53))
    })
}

/// `ADDR` or `ADDR:PORT` (port 53 when not given).
pub fn parse_server(s: &str) -> Result<SocketAddr, String> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 53));
    }
    s.parse::<SocketAddr>()
        .map_err(|_| format!("DNS server {s:?}: not ADDR or ADDR:PORT"))
}

/// The server named, else the system resolver's.
pub fn server_or_resolver(named: Option<SocketAddr>) -> Result<SocketAddr, DnsError> {
    if let Some(s) = named {
        return Ok(s);
    }
    let text = std::fs::read_to_string("/etc/resolv.conf")
        .map_err(|e| DnsError::NoServer(format!("/etc/resolv.conf: {e}")))?;
    resolv_conf_server(&text)
        .ok_or_else(|| DnsError::NoServer("/etc/resolv.conf names no nameserver".into()))
}

fn message_id() -> u16 {
    let mut b = [0u8; 2];
    // An id we cannot make random is still an id; the answer must also
    // come from the server's address and name our question.
    let _ = getrandom::fill(&mut b);
    u16::from_ne_bytes(b)
}

/// Sends `msg` to `server` and returns the answer with the same id: UDP,
/// then TCP when the answer was truncated (or `tcp`).
fn exchange(
    server: SocketAddr,
    msg: &[u8],
    id: u16,
    timeout: Duration,
    tcp: bool,
) -> Result<(Vec<u8>, Message), DnsError> {
    let err = |why: String| DnsError::Server { server, why };
    let io = |what: &str, e: std::io::Error| err(format!("{what}: {e}"));
    if !tcp {
        let local: SocketAddr = if server.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        }
        .parse()
        .unwrap_or(server);
        let s = UdpSocket::bind(local).map_err(|e| io("bind", e))?;
        s.connect(server).map_err(|e| io("connect", e))?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| io("timeout", e))?;
        s.send(msg).map_err(|e| io("send", e))?;
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 65535];
        loop {
            let n = s.recv(&mut buf).map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    err(format!("no answer within {timeout:?}"))
                }
                _ => io("receive", e),
            })?;
            let Ok(m) = Message::decode(&buf[..n]) else {
                continue;
            };
            if m.id == id && m.flags & FLAG_QR != 0 {
                if m.flags & FLAG_TC != 0 {
                    return exchange(server, msg, id, timeout, true);
                }
                return Ok((buf[..n].to_vec(), m));
            }
            if Instant::now() >= deadline {
                return Err(err(format!("no answer within {timeout:?}")));
            }
        }
    }
    let mut s = TcpStream::connect_timeout(&server, timeout).map_err(|e| io("connect", e))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| io("timeout", e))?;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| io("timeout", e))?;
    let mut framed = (msg.len() as u16).to_be_bytes().to_vec();
    framed.extend(msg);
    s.write_all(&framed).map_err(|e| io("send", e))?;
    let mut len = [0u8; 2];
    s.read_exact(&mut len).map_err(|e| io("receive", e))?;
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut buf).map_err(|e| io("receive", e))?;
    let m = Message::decode(&buf)?;
    if m.id != id {
        return Err(err(format!("answer with id {} to question {id}", m.id)));
    }
    Ok((buf, m))
}

/// Asks `server` for `name`'s records of `qtype`: the answer's records of
/// that type for `name` or the end of its CNAME chain, and the answer.
fn query(
    server: SocketAddr,
    name: &Name,
    qtype: u16,
    timeout: Duration,
) -> Result<(Vec<Record>, Message), DnsError> {
    let id = message_id();
    let q = Message {
        id,
        flags: FLAG_RD,
        questions: vec![Question {
            name: name.clone(),
            qtype,
            class: CLASS_IN,
        }],
        ..Message::default()
    };
    let (_, m) = exchange(server, &q.encode(), id, timeout, false)?;
    match m.rcode() {
        0 => {}
        // NXDOMAIN: nothing by that name.
        3 => return Ok((Vec::new(), m)),
        r => {
            return Err(DnsError::Server {
                server,
                why: format!("{name} {}: {}", type_name(qtype), rcode_name(r)),
            })
        }
    }
    let mut owner = name.clone();
    for _ in 0..MAX_CNAMES {
        let next = m.answers.iter().find_map(|r| match &r.data {
            RData::Name(n) if r.rtype == TYPE_CNAME && r.name == owner => Some(n.clone()),
            _ => None,
        });
        match next {
            Some(n) if qtype != TYPE_CNAME => owner = n,
            _ => break,
        }
    }
    let found = m
        .answers
        .iter()
        .filter(|r| r.rtype == qtype && r.name == owner)
        .cloned()
        .collect();
    Ok((found, m))
}

fn type_name(t: u16) -> &'static str {
    match t {
        TYPE_PTR => "PTR",
        TYPE_SRV => "SRV",
        TYPE_TXT => "TXT",
        TYPE_A => "A",
        TYPE_AAAA => "AAAA",
        _ => "record",
    }
}

fn rcode_name(r: u16) -> String {
    match r {
        1 => "FORMERR (the server could not read the message)".into(),
        2 => "SERVFAIL".into(),
        4 => "NOTIMP".into(),
        5 => "REFUSED (the server does not allow this: allow-update, the key?)".into(),
        9 => "NOTAUTH (the key does not verify, or the server is not authoritative for the zone)"
            .into(),
        10 => "NOTZONE (a name outside the zone)".into(),
        r => format!("rcode {r}"),
    }
}

/// An instance as resolved: the donor it announces, its lease, and what
/// a conditional removal needs (its TXT records as read, its SRV target).
#[derive(Debug, Clone)]
pub struct Resolved {
    pub a: Announced,
    pub lease: Option<lease::Lease>,
    pub instance: Name,
    pub txt: Vec<Record>,
    pub target: Name,
}

/// What one instance resolved to, and until when that holds.
struct Cached {
    found: Result<Resolved, String>,
    until: Instant,
}

/// One round of browsing a domain.
#[derive(Debug, Default)]
pub struct Browsed {
    /// The donors announced now, their records within their lease.
    pub found: Vec<Announced>,
    /// Records past their lease, and why (`lease::Judgement::why`).
    pub expired: Vec<(Resolved, String)>,
    /// What could not be read: an instance's records.
    pub errors: Vec<String>,
}

/// Browses `_netpager._tcp.DOMAIN` on a DNS server: the PTR records each
/// round, an instance's SRV, TXT and address records when new or when
/// their TTL ran out.
pub struct DomainBrowser {
    pub domain: Name,
    server: Option<SocketAddr>,
    timeout: Duration,
    cache: HashMap<String, Cached>,
    freshness: lease::Freshness,
}

impl DomainBrowser {
    /// `server`: the DNS server to ask (else the system resolver's).
    pub fn new(
        domain: &str,
        server: Option<SocketAddr>,
        timeout: Duration,
    ) -> Result<DomainBrowser, DnsError> {
        Ok(DomainBrowser {
            domain: Name::parse(domain)?,
            server,
            timeout,
            cache: HashMap::new(),
            freshness: lease::Freshness::default(),
        })
    }

    /// One round: the donors announced now, those whose records are past
    /// their lease, and what could not be read (an instance's records; the
    /// whole round fails when the server does).
    pub fn browse(&mut self) -> Result<Browsed, DnsError> {
        let server = server_or_resolver(self.server)?;
        let service = Name::parse(&format!("{SERVICE}.{}", self.domain))?;
        let (ptrs, _) = query(server, &service, TYPE_PTR, self.timeout)?;
        let now = Instant::now();
        let instances: Vec<Name> = ptrs
            .into_iter()
            .filter_map(|r| match r.data {
                RData::Name(n) => Some(n),
                _ => None,
            })
            .take(MAX_INSTANCES)
            .collect();
        let names: Vec<String> = instances.iter().map(Name::to_string).collect();
        self.cache.retain(|k, _| names.contains(k));
        self.freshness.retain(&names);
        let mut out = Browsed::default();
        for (inst, key) in instances.iter().zip(&names) {
            if self.cache.get(key).is_none_or(|c| now >= c.until) {
                let (res, ttl) = match self.resolve(server, inst) {
                    Ok((r, ttl)) => (Ok(r), ttl),
                    Err(e) => (Err(e), 0),
                };
                if let Ok(r) = &res {
                    self.freshness.observe(key, r.lease, now);
                }
                let until = now + Duration::from_secs(ttl.into()).clamp(MIN_CACHE, MAX_CACHE);
                self.cache.insert(key.clone(), Cached { found: res, until });
            }
            match &self.cache[key].found {
                Ok(r) => match self.freshness.judge(key, r.lease, now).why() {
                    None => out.found.push(r.a.clone()),
                    Some(why) => out.expired.push((r.clone(), why)),
                },
                Err(e) => out.errors.push(format!("{key}: {e}")),
            }
        }
        Ok(out)
    }

    /// An instance's announcement and the shortest TTL of its records.
    fn resolve(&self, server: SocketAddr, inst: &Name) -> Result<(Resolved, u32), String> {
        let e = |e: DnsError| e.to_string();
        let (srv, answer) = query(server, inst, TYPE_SRV, self.timeout).map_err(e)?;
        let Some((target, port, srv_ttl)) = srv.iter().find_map(|r| match &r.data {
            RData::Srv { target, port, .. } => Some((target.clone(), *port, r.ttl)),
            _ => None,
        }) else {
            return Err("no SRV record".into());
        };
        let (txt, _) = query(server, inst, TYPE_TXT, self.timeout).map_err(e)?;
        let map = txt_map(&txt);
        let ttl = txt.iter().fold(srv_ttl, |t, r| t.min(r.ttl));
        // The server may have sent the target's addresses along.
        let addr_of = |rs: &[Record]| -> Vec<IpAddr> {
            rs.iter()
                .filter(|r| r.name == target)
                .filter_map(|r| match r.data {
                    RData::A(a) => Some(IpAddr::V4(a)),
                    RData::Aaaa(a) => Some(IpAddr::V6(a)),
                    _ => None,
                })
                .collect()
        };
        let mut addrs = addr_of(&answer.additional);
        if addrs.is_empty() {
            for t in [TYPE_A, TYPE_AAAA] {
                let (rs, _) = query(server, &target, t, self.timeout).map_err(e)?;
                addrs.extend(rs.iter().filter_map(|r| match r.data {
                    RData::A(a) => Some(IpAddr::V4(a)),
                    RData::Aaaa(a) => Some(IpAddr::V6(a)),
                    _ => None,
                }));
            }
        }
        let a = decode(&inst.to_string(), &map, addrs).map_err(|e| e.to_string())?;
        // The SRV's port is the NBD port; the TXT's must agree.
        if a.nbd.port() != port {
            return Err(format!("SRV port {port} but TXT nbd={}", a.nbd.port()));
        }
        let lease =
            lease::parse(&map).map_err(|e| format!("announcement {:?}: {e}", inst.to_string()))?;
        let resolved = Resolved {
            a,
            lease,
            instance: inst.clone(),
            txt,
            target,
        };
        Ok((resolved, ttl))
    }
}

/// The `key=value` strings of TXT records as a map: keys are
/// case-insensitive and the first of a key wins (RFC 6763 §6.4, §6.5).
pub fn txt_map(records: &[Record]) -> HashMap<String, String> {
    let mut map = HashMap::new();
    for r in records {
        if let RData::Txt(strings) = &r.data {
            for s in strings {
                let s = String::from_utf8_lossy(s);
                let (k, v) = s.split_once('=').unwrap_or((&s, ""));
                map.entry(k.to_ascii_lowercase())
                    .or_insert_with(|| v.to_string());
            }
        }
    }
    map
}

/// Where and how a donor publishes itself (`announce=dns`).
#[derive(Debug, Clone)]
pub struct Publication {
    pub server: SocketAddr,
    pub zone: Name,
    pub key: tsig::Key,
    pub ttl: u32,
    pub node_id: String,
    /// The donor's address in its SRV target's record.
    pub addr: IpAddr,
    pub nbd_port: u16,
    pub status_port: u16,
    pub timeout: Duration,
    /// The lease in the TXT record (`lease::Lease`): seconds within which
    /// readers must see the record published again (at least twice `ttl`).
    pub lease: u32,
    /// Remove other donors' records in the zone once past their lease
    /// (`prune`).
    pub prune: bool,
}

/// The names a donor with node id `node` publishes under in `zone`: the
/// service, its instance, its SRV target.
pub fn donor_names(zone: &Name, node: &str) -> Result<(Name, Name, Name), wire::WireError> {
    let service = Name::parse(&format!("{SERVICE}.{zone}"))?;
    let instance = service.child(&node_label(node))?;
    let host = zone.child(&format!("{}-netpager", node_label(node)))?;
    Ok((service, instance, host))
}

impl Publication {
    fn names(&self) -> Result<(Name, Name, Name), wire::WireError> {
        donor_names(&self.zone, &self.node_id)
    }

    /// The update that replaces what the donor published before with its
    /// records now (`add`, with refresh counter `seq`), or removes them
    /// (`!add`).
    pub fn update(&self, add: bool, seq: u64, id: u16) -> Result<Message, wire::WireError> {
        let (service, instance, host) = self.names()?;
        let rec = |name: &Name, rtype, class, ttl, data| Record {
            name: name.clone(),
            rtype,
            class,
            ttl,
            data,
        };
        let mut updates = vec![
            // The PTR to this instance only: other donors' stay.
            rec(
                &service,
                TYPE_PTR,
                CLASS_NONE,
                0,
                RData::Name(instance.clone()),
            ),
            rec(&instance, TYPE_ANY, CLASS_ANY, 0, RData::Raw(Vec::new())),
            rec(&host, TYPE_ANY, CLASS_ANY, 0, RData::Raw(Vec::new())),
        ];
        if add {
            let leased = lease::Lease {
                seq,
                secs: self.lease,
            };
            let txt = txt_record(&self.node_id, self.nbd_port, self.status_port)
                .into_iter()
                .chain(lease::txt(leased))
                .map(|(k, v)| format!("{k}={v}").into_bytes())
                .collect();
            let address = match self.addr {
                IpAddr::V4(a) => (TYPE_A, RData::A(a)),
                IpAddr::V6(a) => (TYPE_AAAA, RData::Aaaa(a)),
            };
            updates.extend([
                rec(
                    &service,
                    TYPE_PTR,
                    CLASS_IN,
                    self.ttl,
                    RData::Name(instance.clone()),
                ),
                rec(
                    &instance,
                    TYPE_SRV,
                    CLASS_IN,
                    self.ttl,
                    RData::Srv {
                        priority: 0,
                        weight: 0,
                        port: self.nbd_port,
                        target: host.clone(),
                    },
                ),
                rec(&instance, TYPE_TXT, CLASS_IN, self.ttl, RData::Txt(txt)),
                rec(&host, address.0, CLASS_IN, self.ttl, address.1),
            ]);
        }
        Ok(Message {
            id,
            flags: OPCODE_UPDATE << 11,
            questions: vec![Question {
                name: self.zone.clone(),
                qtype: TYPE_SOA,
                class: CLASS_IN,
            }],
            authority: updates,
            ..Message::default()
        })
    }

    /// Sends the update (with refresh counter `seq`) signed with the key
    /// and checks the server took it and signed its answer.
    pub fn send(&self, add: bool, seq: u64) -> Result<(), DnsError> {
        let m = self.update(add, seq, message_id())?;
        match self.send_signed(&m)? {
            0 => Ok(()),
            r => Err(DnsError::Server {
                server: self.server,
                why: format!("update of {}: {}", self.zone, rcode_name(r)),
            }),
        }
    }

    /// Sends update `m` signed with the key; the answer's rcode, once its
    /// signature verifies (an error answer may come unsigned: its rcode).
    pub(crate) fn send_signed(&self, m: &Message) -> Result<u16, DnsError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let (bytes, mac) = self.key.sign(m, now);
        let (raw, answer) = exchange(self.server, &bytes, m.id, self.timeout, false)?;
        let server = self.server;
        if answer.rcode() != 0 {
            return Ok(answer.rcode());
        }
        self.key
            .verify(&raw, &answer, &mac)
            .map_err(|why| DnsError::Server { server, why })?;
        Ok(0)
    }
}

/// A donor's records in the lab's DNS, published again every TTL (a server
/// that lost them gets them back) and removed when dropped.
pub struct Publisher {
    publication: Publication,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Publisher {
    /// Publishes now (an error is returned, and retried by the thread) and
    /// every `ttl` seconds after, each time with a new refresh counter;
    /// with `prune`, then removes other donors' records past their lease.
    /// `log` says what happened.
    pub fn start(
        p: Publication,
        log: impl Fn(&str) + Send + 'static,
    ) -> (Publisher, Result<(), DnsError>) {
        // Random, so that a restarted donor's counter differs from the
        // one its records were last seen with.
        let mut seq = u64::from((u32::from(message_id()) << 16) | u32::from(message_id()));
        let first = p.send(true, seq);
        let (stop, stopped) = mpsc::channel::<()>();
        let q = p.clone();
        let mut failing = first.is_err();
        let thread = std::thread::Builder::new()
            .name("dns-publish".into())
            .spawn(move || {
                let every = Duration::from_secs(q.ttl.max(1).into());
                let mut pruner = q.prune.then(|| prune::Pruner::new(&q));
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    seq = seq.wrapping_add(1);
                    match q.send(true, seq) {
                        Ok(()) if failing => {
                            failing = false;
                            log(&format!(
                                "announce=dns: published {} in {}",
                                q.node_id, q.zone
                            ));
                        }
                        Ok(()) => {}
                        Err(e) => {
                            if !failing {
                                log(&format!("announce=dns: {e}; trying again every {every:?}"));
                            }
                            failing = true;
                        }
                    }
                    if let Some(pr) = pruner.as_mut() {
                        for line in pr.round(&q) {
                            log(&line);
                        }
                    }
                }
            })
            .ok();
        (
            Publisher {
                publication: p,
                stop: Some(stop),
                thread,
            },
            first,
        )
    }

    /// Removes the records (at a clean stop).
    pub fn withdraw(mut self) -> Result<(), DnsError> {
        self.stop_thread();
        self.publication.send(false, 0)
    }

    fn stop_thread(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop_thread();
            let _ = self.publication.send(false, 0);
        }
    }
}

/// The local address this machine reaches `server` from: the address a
/// donor publishes when it listens on all of them.
pub fn local_address_towards(server: SocketAddr) -> std::io::Result<IpAddr> {
    let local = if server.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let s = UdpSocket::bind(local)?;
    s.connect(server)?;
    Ok(s.local_addr()?.ip())
}

/// Records as "NAME TYPE CLASS TTL" lines, for tests to compare.
#[cfg(test)]
pub(crate) fn record_lines(records: &[Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| format!("{} {} {} {}", r.name, r.rtype, r.class, r.ttl))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_come_from_the_option_or_resolv_conf() {
        let text = "# generated\nsearch lab\nnameserver 127.0.0.53\nnameserver 10.0.0.1\n";
        assert_eq!(
            resolv_conf_server(text),
            Some("127.0.0.53:53".parse().unwrap())
        );
        assert_eq!(resolv_conf_server("search lab\n"), None);
        assert_eq!(
            parse_server("127.0.0.7").unwrap(),
            "127.0.0.7:53".parse().unwrap()
        );
        assert_eq!(
            parse_server("127.0.0.7:5353").unwrap(),
            "127.0.0.7:5353".parse().unwrap()
        );
        assert!(parse_server("dns.lab").unwrap_err().contains("\"dns.lab\""));
    }

    #[test]
    fn an_update_replaces_the_donors_own_records_only() {
        let p = Publication {
            server: "127.0.0.1:53".parse().unwrap(),
            zone: Name::parse("lab.test").unwrap(),
            key: tsig::Key::parse("key \"k\" { algorithm hmac-sha256; secret \"YWJj\"; };")
                .unwrap(),
            ttl: 30,
            node_id: "rack2.d_1".into(),
            addr: "127.0.0.9".parse().unwrap(),
            nbd_port: 10809,
            status_port: 10810,
            timeout: Duration::from_secs(1),
            lease: 120,
            prune: true,
        };
        let m = Message::decode(&p.update(true, 42, 5).unwrap().encode()).unwrap();
        assert_eq!(m.flags >> 11, OPCODE_UPDATE);
        assert_eq!(
            record_lines(&m.authority),
            [
                "_netpager._tcp.lab.test 12 254 0",
                "rack2-d-1._netpager._tcp.lab.test 255 255 0",
                "rack2-d-1-netpager.lab.test 255 255 0",
                "_netpager._tcp.lab.test 12 1 30",
                "rack2-d-1._netpager._tcp.lab.test 33 1 30",
                "rack2-d-1._netpager._tcp.lab.test 16 1 30",
                "rack2-d-1-netpager.lab.test 1 1 30",
            ]
        );
        let RData::Txt(t) = &m.authority[5].data else {
            panic!("{:?}", m.authority[5])
        };
        assert!(t.contains(&b"node=rack2.d_1".to_vec()) && t.contains(&b"nbd=10809".to_vec()));
        assert!(t.contains(&b"seq=42".to_vec()) && t.contains(&b"lease=120".to_vec()));
        assert_eq!(p.update(false, 0, 6).unwrap().authority.len(), 3);
    }
}
