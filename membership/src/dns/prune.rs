//! Removing the records of donors that died without removing them: a
//! publishing donor (`announce=dns`) browses its own zone after each
//! publication and, with its TSIG key, removes the records of any other
//! donor that are past their lease (`lease`). The removal is conditional
//! (RFC 2136 prerequisites): it applies only while the instance's TXT
//! records are still exactly the ones judged expired, so a donor that
//! published again meanwhile (a new `seq=`) keeps its records, and two
//! donors removing the same records at once do no harm (the second finds
//! the prerequisite false, NXRRSET). Only names a donor publishes are
//! touched: the instance under `_netpager._tcp.ZONE`, its PTR, and its SRV
//! target when that is the donor's own `NODE-netpager.ZONE`; never a record
//! without a lease (Ansible's).

use super::wire::{Message, Name, Question, RData, Record};
use super::wire::{CLASS_ANY, CLASS_IN, CLASS_NONE, OPCODE_UPDATE, TYPE_ANY, TYPE_PTR, TYPE_SOA};
use super::{donor_names, message_id, DomainBrowser, Publication, Resolved};

/// NXRRSET: a prerequisite did not hold (the records changed meanwhile).
const RCODE_NXRRSET: u16 = 8;

/// The conditional update that removes expired instance `r`'s records
/// from `zone`; `None` when its names are not the ones a donor publishes
/// (a forged PTR pointing elsewhere in the zone) or it has no lease.
pub fn removal(zone: &Name, r: &Resolved, id: u16) -> Option<Message> {
    // Records without a lease (Ansible's) are never removed.
    r.lease?;
    let (service, own_instance, own_host) = donor_names(zone, &r.a.node_id).ok()?;
    let label = r.instance.labels().first()?;
    let instance = service.child(std::str::from_utf8(label).ok()?).ok()?;
    if instance != r.instance || r.txt.is_empty() || r.txt.iter().any(|t| t.name != r.instance) {
        return None;
    }
    let rec = |name: &Name, rtype, class, data| Record {
        name: name.clone(),
        rtype,
        class,
        ttl: 0,
        data,
    };
    // RRset exists, value dependent: every TXT record as it was read.
    let prerequisites = r
        .txt
        .iter()
        .map(|t| rec(&t.name, t.rtype, CLASS_IN, t.data.clone()))
        .collect();
    let mut updates = vec![
        rec(
            &service,
            TYPE_PTR,
            CLASS_NONE,
            RData::Name(r.instance.clone()),
        ),
        rec(&r.instance, TYPE_ANY, CLASS_ANY, RData::Raw(Vec::new())),
    ];
    // The target's address only when it is the donor's own name for it
    // (and this instance is its own: the node's label).
    if r.target == own_host && r.instance == own_instance {
        updates.push(rec(&own_host, TYPE_ANY, CLASS_ANY, RData::Raw(Vec::new())));
    }
    Some(Message {
        id,
        flags: OPCODE_UPDATE << 11,
        questions: vec![Question {
            name: zone.clone(),
            qtype: TYPE_SOA,
            class: CLASS_IN,
        }],
        answers: prerequisites,
        authority: updates,
        ..Message::default()
    })
}

/// A publishing donor's view of its zone, between publications.
pub struct Pruner {
    browser: Option<DomainBrowser>,
    /// The last browsing error said, so that it is said once.
    said: Option<String>,
}

impl Pruner {
    pub fn new(p: &Publication) -> Pruner {
        Pruner {
            browser: DomainBrowser::new(&p.zone.to_string(), Some(p.server), p.timeout).ok(),
            said: None,
        }
    }

    /// Browses the zone and removes other donors' expired records; what
    /// to log.
    pub fn round(&mut self, p: &Publication) -> Vec<String> {
        let Some(b) = self.browser.as_mut() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let browsed = match b.browse() {
            Ok(x) => x,
            Err(e) => {
                let msg = format!(
                    "announce=dns: cannot browse {} to remove expired records: {e}",
                    p.zone
                );
                if self.said.as_deref() != Some(msg.as_str()) {
                    out.push(msg.clone());
                    self.said = Some(msg);
                }
                return out;
            }
        };
        self.said = None;
        for (r, why) in browsed.expired {
            if r.a.node_id == p.node_id {
                continue;
            }
            let Some(m) = removal(&p.zone, &r, message_id()) else {
                continue;
            };
            match p.send_signed(&m) {
                Ok(0) => out.push(format!(
                    "announce=dns: removed donor {}'s records ({}) from {}: {why}",
                    r.a.node_id, r.instance, p.zone
                )),
                // Published again, or removed by another donor, meanwhile.
                Ok(RCODE_NXRRSET) => {}
                Ok(rc) => out.push(format!(
                    "announce=dns: removing donor {}'s expired records from {}: {}",
                    r.a.node_id,
                    p.zone,
                    super::rcode_name(rc)
                )),
                Err(e) => out.push(format!(
                    "announce=dns: removing donor {}'s expired records from {}: {e}",
                    r.a.node_id, p.zone
                )),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::lease::Lease;
    use super::super::wire::TYPE_TXT;
    use super::*;
    use crate::discovery::Announced;

    fn resolved(node: &str, instance: &str, target: &str, lease: Option<Lease>) -> Resolved {
        let instance = Name::parse(instance).unwrap();
        Resolved {
            a: Announced {
                node_id: node.into(),
                nbd: "127.0.0.5:10809".parse().unwrap(),
                status: "127.0.0.5:10810".parse().unwrap(),
            },
            lease,
            txt: vec![Record {
                name: instance.clone(),
                rtype: TYPE_TXT,
                class: CLASS_IN,
                ttl: 30,
                data: RData::Txt(vec![b"v=1".to_vec(), b"seq=9".to_vec()]),
            }],
            instance,
            target: Name::parse(target).unwrap(),
        }
    }

    const LEASE: Option<Lease> = Some(Lease { seq: 9, secs: 8 });

    #[test]
    fn an_expired_donors_records_go_only_while_its_txt_is_as_judged() {
        let zone = Name::parse("lab.test").unwrap();
        let r = resolved(
            "rack.d1",
            "rack-d1._netpager._tcp.lab.test",
            "rack-d1-netpager.lab.test",
            LEASE,
        );
        let m = Message::decode(&removal(&zone, &r, 7).unwrap().encode()).unwrap();
        assert_eq!(m.flags >> 11, OPCODE_UPDATE);
        assert_eq!(
            super::super::record_lines(&m.answers),
            ["rack-d1._netpager._tcp.lab.test 16 1 0"]
        );
        assert_eq!(m.answers[0].data, r.txt[0].data);
        assert_eq!(
            super::super::record_lines(&m.authority),
            [
                "_netpager._tcp.lab.test 12 254 0",
                "rack-d1._netpager._tcp.lab.test 255 255 0",
                "rack-d1-netpager.lab.test 255 255 0",
            ]
        );
    }

    #[test]
    fn hostile_records_remove_nothing_outside_a_donors_names() {
        let zone = Name::parse("lab.test").unwrap();
        let inst = "d1._netpager._tcp.lab.test";
        let host = "d1-netpager.lab.test";
        let gone = |r: &Resolved| removal(&zone, r, 1).is_none();
        // No lease (Ansible's records): never removed.
        assert!(gone(&resolved("d1", inst, host, None)));
        // A PTR pointing outside the service: nothing removed.
        assert!(gone(&resolved("d1", "www.lab.test", host, LEASE)));
        assert!(gone(&resolved(
            "d1",
            "d1._netpager._tcp.other.test",
            host,
            LEASE
        )));
        // A target that is someone else's name (the name server): the
        // instance goes, the target's records stay.
        let m = removal(&zone, &resolved("d1", inst, "ns.lab.test", LEASE), 1).unwrap();
        assert_eq!(m.authority.len(), 2);
        assert!(m
            .authority
            .iter()
            .all(|x| x.name.to_string() != "ns.lab.test"));
        // TXT records read under another name (a CNAME followed): nothing.
        let mut r = resolved("d1", inst, host, LEASE);
        r.txt[0].name = Name::parse("elsewhere.lab.test").unwrap();
        assert!(gone(&r));
        r.txt.clear();
        assert!(gone(&r));
        // An instance named for another node than its TXT says: the
        // instance and PTR go (they are under the service), no target.
        let m = removal(&zone, &resolved("d2", inst, host, LEASE), 1).unwrap();
        assert_eq!(m.authority.len(), 2);
    }
}
