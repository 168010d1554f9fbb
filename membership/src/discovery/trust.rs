//! Which announced donors may join without a lab key to verify them, and
//! the admission rule itself ([`admit`]).
//!
//! An announcement proves nothing: anyone on a network can announce. With
//! a lab key a donor is used only once its signed status verifies. Without
//! one, only donors on networks the admin trusts (loopback always, and the
//! networks named by `trust_network`, for instance a lab's own isolated
//! subnet), or anywhere with `insecure`. Nothing else is trusted by default.

use std::net::IpAddr;
use std::str::FromStr;

use netpager_proto::StatusClient;

use super::{Announced, Verdict};

/// A network (`ADDR/BITS`, or one address) trusted without a lab key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    bits: u8,
}

impl Network {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.bits)).unwrap_or(0);
                u32::from(ip) & mask == u32::from(net) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.bits))
                    .unwrap_or(0);
                u128::from(ip) & mask == u128::from(net) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Network {
    type Err = String;

    fn from_str(s: &str) -> Result<Network, String> {
        let (addr, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("trusted network {s:?}: {addr:?} is not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(b) => match b.parse::<u8>() {
                Ok(n) if n <= max => n,
                _ => {
                    return Err(format!(
                        "trusted network {s:?}: prefix length {b:?} is not 0-{max}"
                    ))
                }
            },
        };
        let net = Network {
            addr: addr.to_canonical(),
            bits,
        };
        // 10.213.47.5/24 is most likely a typo for the network or the host.
        if net.to_string() != format!("{}/{bits}", net.addr) {
            return Err(format!(
                "trusted network {s:?}: host bits are set (the network is {})",
                net.masked()
            ));
        }
        Ok(net)
    }
}

impl Network {
    fn masked(&self) -> String {
        match self.addr {
            IpAddr::V4(v) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.bits)).unwrap_or(0);
                format!(
                    "{}/{}",
                    std::net::Ipv4Addr::from(u32::from(v) & mask),
                    self.bits
                )
            }
            IpAddr::V6(v) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.bits))
                    .unwrap_or(0);
                format!(
                    "{}/{}",
                    std::net::Ipv6Addr::from(u128::from(v) & mask),
                    self.bits
                )
            }
        }
    }
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.masked())
    }
}

impl serde::Serialize for Network {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Network {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Network, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Whom a device or daemon believes without a lab key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trust {
    /// Trusted besides loopback (`trust_network`, `--trust-network`).
    pub networks: Vec<Network>,
    /// Anyone anywhere (`--insecure`).
    pub insecure: bool,
}

impl Trust {
    /// Whether `ip` is loopback or on a trusted network.
    pub fn trusts(&self, ip: IpAddr) -> bool {
        ip.to_canonical().is_loopback() || self.networks.iter().any(|n| n.contains(ip))
    }

    /// The trusted networks, for messages: "loopback, 10.213.47.0/24".
    pub fn describe(&self) -> String {
        std::iter::once("loopback".to_string())
            .chain(self.networks.iter().map(Network::to_string))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What is known of an announced donor beyond its announcement: its status,
/// read with the lab key (signed) or without one (a device without a key):
/// the node id the reply names, or why it could not be read or verified.
#[derive(Debug, Clone, Copy)]
pub enum Check<'a> {
    Signed(Result<&'a str, &'a str>),
    Unsigned(Result<&'a str, &'a str>),
}

/// Whether an announced donor may join a device's set: with a lab key,
/// only once its signed status verifies and names the announced node (a
/// donor must not announce itself as another); without one, only when
/// both its addresses are trusted (or `insecure`) and its status answers
/// naming the announced node. `Ok` says why it may.
pub fn admit(a: &Announced, check: Check<'_>, trust: &Trust) -> Result<&'static str, String> {
    let names = |node: &str| -> Result<(), String> {
        if node == a.node_id {
            Ok(())
        } else {
            Err(format!(
                "announced as {:?} but its status names {node:?}",
                a.node_id
            ))
        }
    };
    match check {
        Check::Signed(Ok(node)) => names(node).map(|()| "verified with the lab key"),
        Check::Signed(Err(why)) => Err(format!("status not verified with the lab key: {why}")),
        Check::Unsigned(status) => {
            let trusted = [a.nbd, a.status].iter().all(|s| trust.trusts(s.ip()));
            if !trusted && !trust.insecure {
                return Err(format!(
                    "no lab key to verify it, and {} is not on a trusted network ({}): \
                     give --psk (the lab key), --trust-network CIDR, or --insecure \
                     to use it unverified",
                    a.nbd.ip(),
                    trust.describe()
                ));
            }
            names(status.map_err(|why| format!("status not read: {why}"))?)?;
            Ok(if trusted {
                "no lab key: on a trusted network"
            } else {
                "no lab key: allowed by --insecure"
            })
        }
    }
}

/// Checks an announced donor as every user of discovery does: reads its
/// status with `client` (signed when it holds the lab key) and [`admit`]s
/// it. A stranger on an untrusted network is not contacted without a key.
pub fn check(client: &StatusClient, a: &Announced, trust: &Trust) -> Verdict {
    let keyless = client.key.is_none();
    if keyless && !trust.insecure && ![a.nbd, a.status].iter().all(|s| trust.trusts(s.ip())) {
        return admit(a, Check::Unsigned(Err("not asked")), trust);
    }
    let status = client.query(&a.status.to_string());
    let failed = status.as_ref().err().map(ToString::to_string);
    let node = match (&status, &failed) {
        (Ok(s), _) => Ok(s.node_id.as_str()),
        (Err(_), f) => Err(f.as_deref().unwrap_or_default()),
    };
    admit(
        a,
        if keyless {
            Check::Unsigned(node)
        } else {
            Check::Signed(node)
        },
        trust,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn announced(ip: &str) -> Announced {
        let txt: HashMap<String, String> = super::super::txt_record("d1", 1, 2)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        super::super::decode("d1", &txt, [ip.parse().unwrap()]).unwrap()
    }

    #[test]
    fn only_loopback_is_trusted_by_default() {
        let t = Trust::default();
        for ok in ["127.0.0.1", "127.9.8.7", "::1", "::ffff:127.0.0.2"] {
            assert!(t.trusts(ip(ok)), "{ok}");
        }
        for no in [
            "10.213.47.1",
            "10.0.0.1",
            "192.168.1.10",
            "0.0.0.0",
            "2001:db8::1",
            "fe80::1",
        ] {
            assert!(!t.trusts(ip(no)), "{no}");
        }
    }

    #[test]
    fn trusted_networks_are_what_the_admin_names() {
        let t = Trust {
            networks: vec![
                "10.213.47.0/24".parse().unwrap(),
                "2001:db8::/32".parse().unwrap(),
            ],
            insecure: false,
        };
        for ok in [
            "10.213.47.1",
            "10.213.47.254",
            "::ffff:10.213.47.9",
            "2001:db8::5",
        ] {
            assert!(t.trusts(ip(ok)), "{ok}");
        }
        for no in ["10.213.46.255", "10.213.48.0", "2001:db9::1"] {
            assert!(!t.trusts(ip(no)), "{no}");
        }
        assert_eq!(t.describe(), "loopback, 10.213.47.0/24, 2001:db8::/32");
        let host: Network = "192.168.1.5".parse().unwrap();
        assert!(host.contains(ip("192.168.1.5")) && !host.contains(ip("192.168.1.6")));
        assert_eq!(host.to_string(), "192.168.1.5/32");
        let all: Network = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("8.8.8.8")) && !all.contains(ip("::1")));
        for (bad, needle) in [
            (
                "10.213.47.5/24",
                "host bits are set (the network is 10.213.47.0/24)",
            ),
            ("10.213.47.0/33", "prefix length \"33\""),
            ("lab/24", "\"lab\" is not an IP address"),
            ("10.0.0.0/x", "prefix length \"x\""),
        ] {
            let e = bad.parse::<Network>().unwrap_err();
            assert!(e.contains(needle) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn admission_needs_a_verified_status_or_a_trusted_network() {
        let lab = announced("10.213.47.11");
        let trusted = Trust {
            networks: vec!["10.213.47.0/24".parse().unwrap()],
            insecure: false,
        };
        let default = Trust::default();
        let insecure = Trust {
            insecure: true,
            ..Trust::default()
        };
        for t in [&default, &trusted, &insecure] {
            assert!(admit(&lab, Check::Signed(Ok("d1")), t).is_ok());
            let e = admit(&lab, Check::Signed(Ok("d2")), t).unwrap_err();
            assert!(e.contains("\"d2\""), "{e}");
            let e = admit(&lab, Check::Signed(Err("MAC mismatch")), t).unwrap_err();
            assert!(e.contains("MAC mismatch"), "{e}");
        }
        let e = admit(&lab, Check::Unsigned(Ok("d1")), &default).unwrap_err();
        assert!(
            e.contains("10.213.47.11 is not on a trusted network (loopback)")
                && e.contains("--trust-network"),
            "{e}"
        );
        assert_eq!(
            admit(&lab, Check::Unsigned(Ok("d1")), &trusted),
            Ok("no lab key: on a trusted network")
        );
        assert_eq!(
            admit(&lab, Check::Unsigned(Ok("d1")), &insecure),
            Ok("no lab key: allowed by --insecure")
        );
        let e = admit(&lab, Check::Unsigned(Err("connection refused")), &trusted).unwrap_err();
        assert!(e.contains("status not read: connection refused"), "{e}");
        let e = admit(&lab, Check::Unsigned(Ok("d7")), &trusted).unwrap_err();
        assert!(e.contains("\"d7\""), "{e}");
        assert!(admit(&announced("127.0.0.5"), Check::Unsigned(Ok("d1")), &default).is_ok());
    }
}
