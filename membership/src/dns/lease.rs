//! How long a donor's records in the lab's DNS stand for a live donor.
//!
//! A donor killed without a clean stop cannot remove its records. So a
//! publishing donor puts a lease in its TXT record: `seq=N`, a counter it
//! changes each time it publishes again (every `dns-ttl`), and `lease=S`,
//! the seconds within which an observer must see `seq` change. Whoever
//! reads the records (a client browsing the domain, another donor pruning
//! the zone) judges them by its own monotonic clock: a record whose `seq`
//! has not changed for `lease` seconds since this observer first saw that
//! value is expired ([`Freshness`]). No two machines' clocks are compared,
//! so a lab whose clocks disagree still ages records correctly; the price
//! is that an observer needs to have watched a record for one lease before
//! it can call it expired (a donor that is dead when a client starts is
//! still refused by admission meanwhile: its status does not answer).
//!
//! Records without a lease (written by Ansible, `netpager_dns_publish`
//! `ansible` or `zonefile`, or by an older donor) never expire here: they
//! stay until whoever wrote them removes them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The longest lease taken: a record claiming more is refused, so that a
/// forged record cannot make itself outlive any check.
pub const MAX_LEASE: u32 = 86_400;

/// A record's lease, as its TXT record states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The refresh counter: a new value at each publication.
    pub seq: u64,
    /// Seconds within which `seq` changes while the donor lives.
    pub secs: u32,
}

/// The TXT keys of a lease.
pub const SEQ_KEY: &str = "seq";
pub const LEASE_KEY: &str = "lease";

/// The lease a TXT record (its `key=value` strings, keys in lower case)
/// states: `None` when it has neither `seq=` nor `lease=` (a record that
/// never expires); an error naming the field when it has one without the
/// other, or a value that is not a number in range.
pub fn parse(txt: &HashMap<String, String>) -> Result<Option<Lease>, String> {
    let (seq, lease) = (txt.get(SEQ_KEY), txt.get(LEASE_KEY));
    let (seq, lease) = match (seq, lease) {
        (None, None) => return Ok(None),
        (Some(s), Some(l)) => (s, l),
        (Some(_), None) => return Err("TXT has seq= but no lease=".into()),
        (None, Some(_)) => return Err("TXT has lease= but no seq=".into()),
    };
    let seq = seq
        .parse::<u64>()
        .map_err(|_| format!("TXT seq={seq:?} is not a counter (0 to 2^64-1)"))?;
    let secs = match lease.parse::<u32>() {
        Ok(s) if (1..=MAX_LEASE).contains(&s) => s,
        _ => {
            return Err(format!(
                "TXT lease={lease:?} is not a number of seconds from 1 to {MAX_LEASE}"
            ))
        }
    };
    Ok(Some(Lease { seq, secs }))
}

/// The TXT strings of a lease, as a donor publishes them.
pub fn txt(lease: Lease) -> [(&'static str, String); 2] {
    [
        (SEQ_KEY, lease.seq.to_string()),
        (LEASE_KEY, lease.secs.to_string()),
    ]
}

/// What an observer concludes about one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judgement {
    /// No lease: the record stands until removed.
    Unleased,
    /// Its counter changed within its lease.
    Fresh,
    /// Its counter stayed at `seq` for `unchanged`, at least its lease.
    Expired {
        seq: u64,
        unchanged: Duration,
        lease: u32,
    },
}

impl Judgement {
    /// Why an expired record is not used, in words.
    pub fn why(&self) -> Option<String> {
        match self {
            Judgement::Expired {
                seq,
                unchanged,
                lease,
            } => Some(format!(
                "expired: its record was not published again for {} s (seq={seq}), past its lease of {lease} s: the donor stopped without removing it",
                unchanged.as_secs()
            )),
            _ => None,
        }
    }
}

/// What one observer has seen of each record's counter: the value, and
/// when (on this observer's clock) it first saw that value. Pure: the
/// caller says what time it is.
#[derive(Debug, Default)]
pub struct Freshness {
    seen: HashMap<String, (u64, Instant)>,
}

impl Freshness {
    /// Record `key` (an instance's name) read at `now` with `lease`.
    pub fn observe(&mut self, key: &str, lease: Option<Lease>, now: Instant) {
        match lease {
            None => {
                self.seen.remove(key);
            }
            Some(l) => match self.seen.get_mut(key) {
                Some((seq, _)) if *seq == l.seq => {}
                Some(e) => *e = (l.seq, now),
                None => {
                    self.seen.insert(key.to_string(), (l.seq, now));
                }
            },
        }
    }

    /// The judgement on `key`, last read with `lease`, at `now`.
    pub fn judge(&self, key: &str, lease: Option<Lease>, now: Instant) -> Judgement {
        let Some(l) = lease else {
            return Judgement::Unleased;
        };
        match self.seen.get(key) {
            Some((seq, since)) if *seq == l.seq => {
                let unchanged = now.saturating_duration_since(*since);
                if unchanged >= Duration::from_secs(l.secs.into()) {
                    Judgement::Expired {
                        seq: *seq,
                        unchanged,
                        lease: l.secs,
                    }
                } else {
                    Judgement::Fresh
                }
            }
            // Not observed yet (or observed with another value since):
            // fresh until watched for a lease.
            _ => Judgement::Fresh,
        }
    }

    /// Forgets records no longer listed.
    pub fn retain(&mut self, keys: &[String]) {
        self.seen.retain(|k, _| keys.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn txt_of(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_lease_round_trips_and_hostile_ones_are_refused_naming_the_field() {
        let l = Lease { seq: 7, secs: 240 };
        let t: HashMap<String, String> = txt(l)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(parse(&t), Ok(Some(l)));
        // Missing: a record that never expires (Ansible's, older donors').
        assert_eq!(parse(&txt_of(&[("v", "1"), ("node", "d1")])), Ok(None));
        for (pairs, needle) in [
            (&[("seq", "1")][..], "no lease="),
            (&[("lease", "60")][..], "no seq="),
            (&[("seq", "x"), ("lease", "60")][..], "seq=\"x\""),
            (&[("seq", "-1"), ("lease", "60")][..], "seq=\"-1\""),
            (
                &[("seq", "1"), ("lease", "garbage")][..],
                "lease=\"garbage\"",
            ),
            (&[("seq", "1"), ("lease", "0")][..], "lease=\"0\""),
            (&[("seq", "1"), ("lease", "")][..], "lease=\"\""),
            // Far in the future: no record outlives a day unwatched.
            (&[("seq", "1"), ("lease", "86401")][..], "1 to 86400"),
            (&[("seq", "1"), ("lease", "99999999999999")][..], "lease="),
        ] {
            let e = parse(&txt_of(pairs)).unwrap_err();
            assert!(e.contains(needle), "{pairs:?}: {e}");
        }
        assert_eq!(
            parse(&txt_of(&[
                ("seq", "18446744073709551615"),
                ("lease", "86400")
            ])),
            Ok(Some(Lease {
                seq: u64::MAX,
                secs: MAX_LEASE
            }))
        );
    }

    #[test]
    fn a_record_expires_only_after_its_counter_stood_still_for_a_lease_of_the_observers_clock() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let lease = |seq| Some(Lease { seq, secs: 10 });
        let mut f = Freshness::default();
        // Never seen: fresh (the observer has not watched it yet).
        assert_eq!(f.judge("a", lease(1), t0), Judgement::Fresh);
        f.observe("a", lease(1), t0);
        assert_eq!(f.judge("a", lease(1), s(9)), Judgement::Fresh);
        // Read again with the same counter: the lease runs from the first sight.
        f.observe("a", lease(1), s(5));
        let j = f.judge("a", lease(1), s(10));
        assert_eq!(
            j,
            Judgement::Expired {
                seq: 1,
                unchanged: Duration::from_secs(10),
                lease: 10
            }
        );
        assert!(j.why().unwrap().contains("past its lease of 10 s"), "{j:?}");
        // Published again (any change counts, a restart's lower value too).
        f.observe("a", lease(0), s(11));
        assert_eq!(f.judge("a", lease(0), s(20)), Judgement::Fresh);
        assert!(matches!(
            f.judge("a", lease(0), s(21)),
            Judgement::Expired { seq: 0, .. }
        ));
        // An observer whose clock is years off judges the same way: only
        // differences of its own clock count. No lease: never expires.
        f.observe("b", None, t0);
        assert_eq!(f.judge("b", None, s(1_000_000)), Judgement::Unleased);
        assert_eq!(Judgement::Unleased.why(), None);
        // A lease dropped from the record forgets what was seen.
        f.observe("a", None, s(30));
        assert_eq!(f.judge("a", lease(0), s(30)), Judgement::Fresh);
        f.observe("c", lease(3), t0);
        f.retain(&["b".to_string()]);
        assert_eq!(f.judge("c", lease(3), s(100)), Judgement::Fresh);
    }
}
