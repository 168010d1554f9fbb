//! Discovery of donors on the lab's network: DNS-SD (RFC 6763) over
//! multicast DNS on the local segment (RFC 6762, [`mdns`], the way printers
//! and file servers are found on a LAN).
//!
//! A donor started with `announce=true` registers one instance of
//! [`SERVICE_TYPE`], named by its node id, whose SRV port is its NBD port and
//! whose TXT record ([`txt_record`]) carries the node id and both ports. A
//! [`Browser`] keeps what is announced now; [`Announced::spec`] turns an
//! announcement into a donor spec. An announcement proves nothing: whoever
//! uses one first checks the donor's status ([`admit`]: signed with the lab
//! key, or without a key only on a trusted network), on the [`Admission`]
//! thread, never on a device's epoch thread.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use crate::DonorSpec;

pub mod admission;
pub mod mdns;
pub mod trust;

use crate::dns::DomainBrowser;
pub use admission::{Admission, Verdict};
pub use mdns::{Announcer, Browser};
pub use trust::{admit, check, Check, Network, Trust};

/// The DNS-SD service type donors announce.
pub const SERVICE_TYPE: &str = "_netpager._tcp.local.";
/// The TXT record's format, in its `v` key: a browser skips other versions.
pub const TXT_VERSION: &str = "1";

/// What went wrong with discovery.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("mDNS: cannot start the responder thread: {0}")]
    Start(String),
    #[error("mDNS: cannot browse {SERVICE_TYPE}: {0}")]
    Browse(String),
    #[error("mDNS: cannot announce {instance:?}: {why}")]
    Announce { instance: String, why: String },
    #[error("announcement {instance:?}: {why}")]
    BadAnnouncement { instance: String, why: String },
}

/// A donor announced on the network now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announced {
    pub node_id: String,
    pub nbd: SocketAddr,
    pub status: SocketAddr,
}

impl Announced {
    /// The donor spec it stands for: named by its node id, so the extent
    /// map's placements follow the donor, not the address it was seen at.
    pub fn spec(&self) -> DonorSpec {
        DonorSpec {
            addr: self.nbd.to_string(),
            export: None,
            status: Some(self.status.to_string()),
            name: self.node_id.clone(),
        }
    }

    /// The same as a line of a donors file (or `attach --donor`'s value).
    pub fn spec_line(&self) -> String {
        format!("{},status={},name={}", self.nbd, self.status, self.node_id)
    }
}

/// The TXT record of a donor's announcement.
pub fn txt_record(node_id: &str, nbd_port: u16, status_port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("v", TXT_VERSION.to_string()),
        ("node", node_id.to_string()),
        ("nbd", nbd_port.to_string()),
        ("status", status_port.to_string()),
    ]
}

/// The address to reach an announced donor at, of those its announcement
/// lists: IPv4 before IPv6 (the lab's network), link-local last (it needs a
/// scope), the lowest of a kind, so the choice is stable.
pub fn pick_address(addrs: impl IntoIterator<Item = IpAddr>) -> Option<IpAddr> {
    addrs.into_iter().min_by_key(|a| {
        let rank = match a {
            IpAddr::V4(v4) if v4.is_link_local() => 1,
            IpAddr::V4(_) => 0,
            IpAddr::V6(v6) if v6.is_unicast_link_local() => 3,
            IpAddr::V6(_) => 2,
        };
        (rank, *a)
    })
}

/// Decodes one resolved announcement: `instance` names it in errors, `txt`
/// is its TXT record, `addrs` the addresses it resolved to.
pub fn decode(
    instance: &str,
    txt: &HashMap<String, String>,
    addrs: impl IntoIterator<Item = IpAddr>,
) -> Result<Announced, DiscoveryError> {
    let bad = |why: String| DiscoveryError::BadAnnouncement {
        instance: instance.to_string(),
        why,
    };
    let field = |k: &str| {
        txt.get(k)
            .map(String::as_str)
            .ok_or_else(|| bad(format!("TXT record has no {k}=")))
    };
    let v = field("v")?;
    if v != TXT_VERSION {
        return Err(bad(format!(
            "TXT v={v:?}: this netpager reads version {TXT_VERSION}"
        )));
    }
    let node_id = field("node")?;
    if node_id.is_empty() || node_id.len() > 200 {
        return Err(bad("TXT node= must be 1 to 200 bytes".into()));
    }
    let port = |k: &str| -> Result<u16, DiscoveryError> {
        let s = field(k)?;
        match s.parse::<u16>() {
            Ok(p) if p != 0 => Ok(p),
            _ => Err(bad(format!("TXT {k}={s:?} is not a port (1-65535)"))),
        }
    };
    let (nbd, status) = (port("nbd")?, port("status")?);
    let ip = pick_address(addrs).ok_or_else(|| bad("no address".into()))?;
    Ok(Announced {
        node_id: node_id.to_string(),
        nbd: SocketAddr::new(ip, nbd),
        status: SocketAddr::new(ip, status),
    })
}

/// What a browser has seen, fed by events, without I/O.
#[derive(Debug, Default)]
pub struct Seen {
    /// By DNS-SD instance (full name): the announcement and when it came
    /// (a counter), so that of two instances with one node id the latest wins.
    by_instance: HashMap<String, (u64, Announced)>,
    count: u64,
}

impl Seen {
    /// An instance resolved (again): its newest announcement replaces what
    /// it said before. A bad one removes the instance and is returned.
    pub fn resolved(
        &mut self,
        fullname: &str,
        txt: &HashMap<String, String>,
        addrs: impl IntoIterator<Item = IpAddr>,
    ) -> Result<(), DiscoveryError> {
        match decode(fullname, txt, addrs) {
            Ok(a) => {
                self.count += 1;
                self.by_instance
                    .insert(fullname.to_string(), (self.count, a));
                Ok(())
            }
            Err(e) => {
                self.by_instance.remove(fullname);
                Err(e)
            }
        }
    }

    /// An instance said goodbye or its records expired.
    pub fn removed(&mut self, fullname: &str) {
        self.by_instance.remove(fullname);
    }

    /// One announcement per node id, the latest, sorted by node id.
    pub fn announced(&self) -> Vec<Announced> {
        let mut by_node: BTreeMap<&str, &(u64, Announced)> = BTreeMap::new();
        for e in self.by_instance.values() {
            let slot = by_node.entry(e.1.node_id.as_str()).or_insert(e);
            if e.0 > slot.0 {
                *slot = e;
            }
        }
        by_node.into_values().map(|(_, a)| a.clone()).collect()
    }
}

/// The node id as one DNS label that leaves room for `-netpager`: anything
/// but letters, digits and `-` becomes `-` (the names of a donor's SRV
/// target and DNS instance; browsers go by the TXT record's node id).
pub fn node_label(node_id: &str) -> String {
    node_id
        .chars()
        .take(54)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// Where announcements come from: multicast DNS on the local segment, and
/// DNS domains browsed on the lab's DNS (wide-area DNS-SD).
pub struct Sources {
    pub mdns: Option<Browser>,
    pub domains: Vec<DomainBrowser>,
}

impl Sources {
    /// `mdns`: browse the local segment; `domains`: browse these on
    /// `server` (else the system resolver's), each query waiting `timeout`.
    pub fn start(
        mdns: bool,
        domains: &[String],
        server: Option<SocketAddr>,
        timeout: std::time::Duration,
    ) -> Result<Sources, String> {
        let domains = domains
            .iter()
            .map(|d| DomainBrowser::new(d, server, timeout).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let mdns = match mdns {
            true => Some(Browser::start().map_err(|e| e.to_string())?),
            false => None,
        };
        Ok(Sources { mdns, domains })
    }

    /// One round: every source's donors, one per node id (multicast DNS's
    /// first, then the domains' in order), and what went wrong.
    pub fn announced(&mut self) -> (Vec<Announced>, Vec<String>) {
        let r = self.round();
        (r.announced, r.errors)
    }

    /// One round, with the records past their lease (`dns::lease`).
    pub fn round(&mut self) -> Round {
        let mut found: Vec<Announced> = self
            .mdns
            .as_ref()
            .map(Browser::announced)
            .unwrap_or_default();
        let (mut errors, mut expired) = (Vec::new(), Vec::new());
        for d in &mut self.domains {
            match d.browse() {
                Ok(b) => {
                    for a in b.found {
                        if !found.iter().any(|f| f.node_id == a.node_id) {
                            found.push(a);
                        }
                    }
                    expired.extend(b.expired.into_iter().map(|(r, why)| Expired {
                        a: r.a,
                        why: format!("domain {}: {why}", d.domain),
                    }));
                    errors.extend(
                        b.errors
                            .into_iter()
                            .map(|e| format!("domain {}: {e}", d.domain)),
                    );
                }
                Err(e) => errors.push(format!("domain {}: {e}", d.domain)),
            }
        }
        // A node announced afresh elsewhere (another domain, mDNS) is not expired.
        expired.retain(|e| !found.iter().any(|f| f.node_id == e.a.node_id));
        Round {
            announced: found,
            expired,
            errors,
        }
    }
}

/// A donor whose records are past their lease: not used, shown as expired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    pub a: Announced,
    pub why: String,
}

/// What the sources say in one round.
#[derive(Debug, Clone, Default)]
pub struct Round {
    /// The donors announced now.
    pub announced: Vec<Announced>,
    /// Records still there but past their lease.
    pub expired: Vec<Expired>,
    /// What went wrong finding out.
    pub errors: Vec<String>,
}

impl From<(Vec<Announced>, Vec<String>)> for Round {
    fn from((announced, errors): (Vec<Announced>, Vec<String>)) -> Round {
        Round {
            announced,
            expired: Vec::new(),
            errors,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(node: &str, nbd: u16, status: u16) -> HashMap<String, String> {
        txt_record(node, nbd, status)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn txt_record_round_trips_into_a_spec() {
        let a = decode("d1", &record("d1", 10809, 10810), [ip("10.213.47.11")]).unwrap();
        assert_eq!(
            a,
            Announced {
                node_id: "d1".into(),
                nbd: "10.213.47.11:10809".parse().unwrap(),
                status: "10.213.47.11:10810".parse().unwrap(),
            }
        );
        let line = a.spec_line();
        assert_eq!(line, "10.213.47.11:10809,status=10.213.47.11:10810,name=d1");
        assert_eq!(line.parse::<DonorSpec>().unwrap(), a.spec());
        let v6 = decode("d2", &record("d2", 1, 2), [ip("2001:db8::5")]).unwrap();
        assert_eq!(v6.spec_line().parse::<DonorSpec>().unwrap(), v6.spec());
    }

    #[test]
    fn bad_txt_records_name_the_field() {
        let good = record("d1", 1, 2);
        for (key, value, needle) in [
            ("v", Some("2"), "version 1"),
            ("v", None, "no v="),
            ("node", None, "no node="),
            ("node", Some(""), "node="),
            ("nbd", Some("0"), "nbd=\"0\""),
            ("nbd", Some("70000"), "nbd=\"70000\""),
            ("status", Some("x"), "status=\"x\""),
            ("status", None, "no status="),
        ] {
            let mut t = good.clone();
            match value {
                Some(v) => t.insert(key.to_string(), v.to_string()),
                None => t.remove(key),
            };
            let e = decode("inst", &t, [ip("10.213.47.11")])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("\"inst\"") && e.contains(needle),
                "{key}={value:?}: {e}"
            );
        }
        let e = decode("inst", &good, []).unwrap_err().to_string();
        assert!(e.contains("no address"), "{e}");
    }

    #[test]
    fn address_choice_is_stable_and_prefers_routable_ipv4() {
        assert_eq!(
            pick_address([
                ip("fe80::1"),
                ip("2001:db8::1"),
                ip("10.0.0.9"),
                ip("10.0.0.2")
            ]),
            Some(ip("10.0.0.2"))
        );
        assert_eq!(
            pick_address([ip("169.254.1.1"), ip("2001:db8::1")]),
            Some(ip("169.254.1.1"))
        );
        assert_eq!(
            pick_address([ip("fe80::1"), ip("2001:db8::2")]),
            Some(ip("2001:db8::2"))
        );
        assert_eq!(pick_address([]), None);
    }

    #[test]
    fn seen_keeps_the_latest_announcement_per_node_and_forgets_goodbyes() {
        let mut s = Seen::default();
        s.resolved("a._netpager", &record("d1", 1, 2), [ip("10.213.47.11")])
            .unwrap();
        s.resolved("b._netpager", &record("d2", 1, 2), [ip("10.213.47.12")])
            .unwrap();
        // d1 came back under another instance name and address.
        s.resolved("c._netpager", &record("d1", 3, 4), [ip("10.213.47.13")])
            .unwrap();
        let nodes: Vec<_> = s
            .announced()
            .iter()
            .map(|a| (a.node_id.clone(), a.nbd))
            .collect();
        assert_eq!(
            nodes,
            vec![
                ("d1".to_string(), "10.213.47.13:3".parse().unwrap()),
                ("d2".to_string(), "10.213.47.12:1".parse().unwrap())
            ]
        );
        // The newer instance says goodbye: the older one still stands.
        s.removed("c._netpager");
        assert_eq!(s.announced()[0].nbd, "10.213.47.11:1".parse().unwrap());
        // A bad re-announcement withdraws what the instance said before.
        let mut bad = record("d2", 1, 2);
        bad.remove("status");
        assert!(s
            .resolved("b._netpager", &bad, [ip("10.213.47.12")])
            .is_err());
        assert_eq!(s.announced().len(), 1);
        s.removed("a._netpager");
        assert!(s.announced().is_empty());
    }
}
