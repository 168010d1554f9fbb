//! `announce=true`: the donor's DNS-SD announcement on the lab's network
//! (netpager_membership::discovery), or with `announce=dns` its records in
//! a zone of the lab's DNS (netpager_membership::dns). The announcement
//! names the NBD port nbdkit listens on, which nbdkit does not tell its
//! plugins: it is found among the process's listening TCP sockets
//! (`/proc/self/fd` and `/proc/self/net/tcp{,6}`) once nbdkit has bound
//! them, at `after_fork`.

use std::collections::{BTreeSet, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use netpager_membership::discovery::Announcer;
use netpager_membership::dns::{self, tsig, wire::Name, Publication, Publisher};

use crate::config::{Announce, Config};

/// How long one DNS update waits for the server's answer.
const DNS_TIMEOUT: Duration = Duration::from_secs(3);

/// The donor's announcement, withdrawn at unload.
pub enum Announcement {
    Mdns(Announcer),
    Dns(Publisher),
}

/// `announce=dns`'s settings, read and checked at config_complete.
pub struct DnsSettings {
    server: SocketAddr,
    zone: Name,
    key: tsig::Key,
    ttl: u32,
    lease: u32,
    prune: bool,
}

/// The lease a donor publishing every `ttl` seconds puts in its records:
/// `lease` given, or 4 x `ttl` (a reader re-reads the records about every
/// TTL and may read the same publication twice; a caching resolver between
/// adds up to one TTL more); at least 2 x `ttl`.
pub fn dns_lease(ttl: u32, lease: Option<u32>) -> Result<u32, String> {
    let min = ttl.saturating_mul(2);
    match lease {
        None => Ok(ttl
            .saturating_mul(4)
            .min(netpager_membership::dns::lease::MAX_LEASE)
            .max(min.min(netpager_membership::dns::lease::MAX_LEASE))),
        Some(l) if l >= min => Ok(l),
        Some(l) => Err(format!(
            "dns-lease={l}: at least twice dns-ttl={ttl} (the records are published again every dns-ttl; a lease shorter than two of those expires live donors)"
        )),
    }
}

impl DnsSettings {
    /// `None` unless `announce=dns`; an error names the parameter.
    pub fn load(cfg: &Config) -> Result<Option<DnsSettings>, String> {
        if cfg.announce != Announce::Dns {
            return Ok(None);
        }
        let zone = cfg
            .dns_zone
            .as_deref()
            .ok_or("announce=dns needs dns-zone=ZONE (the zone the records go in)")?;
        let key = cfg.dns_key.as_deref().ok_or(
            "announce=dns needs dns-key=FILE (the TSIG key the server takes updates with)",
        )?;
        let named = cfg
            .dns_server
            .as_deref()
            .map(dns::parse_server)
            .transpose()?;
        Ok(Some(DnsSettings {
            server: dns::server_or_resolver(named).map_err(|e| format!("announce=dns: {e}"))?,
            zone: Name::parse(zone).map_err(|e| format!("dns-zone=: {e}"))?,
            key: tsig::Key::from_file(key).map_err(|e| format!("dns-key=: {e}"))?,
            ttl: cfg.dns_ttl,
            lease: dns_lease(cfg.dns_ttl, cfg.dns_lease)?,
            prune: cfg.dns_prune,
        }))
    }

    /// Publishes the donor (node id, NBD port, status endpoint `status`)
    /// and keeps it published; a first failure is logged and retried.
    pub fn publish(
        &self,
        node_id: &str,
        nbd_port: u16,
        status: SocketAddr,
        log: impl Fn(&str) + Send + 'static,
    ) -> Result<Publisher, String> {
        // Listening on every address: the one the DNS server is reached from.
        let addr: IpAddr = if status.ip().is_unspecified() {
            dns::local_address_towards(self.server)
                .map_err(|e| format!("announce=dns: no address towards {}: {e}", self.server))?
        } else {
            status.ip()
        };
        let p = Publication {
            server: self.server,
            zone: self.zone.clone(),
            key: self.key.clone(),
            ttl: self.ttl,
            node_id: node_id.to_string(),
            addr,
            nbd_port,
            status_port: status.port(),
            timeout: DNS_TIMEOUT,
            lease: self.lease,
            prune: self.prune,
        };
        let what = format!("{node_id} at {addr} in {}", self.zone);
        let (publisher, first) = Publisher::start(p, log);
        match first {
            Ok(()) => Ok(publisher),
            Err(e) => {
                crate::sys::log_error(&format!(
                    "announce=dns: {what} not published yet: {e}; trying again every {} s",
                    self.ttl
                ));
                Ok(publisher)
            }
        }
    }
}

/// The local ports of the sockets in LISTEN state among `inodes`, from the
/// text of `/proc/net/tcp` or `/proc/net/tcp6` tables.
pub fn listening_ports<'a>(
    tables: impl IntoIterator<Item = &'a str>,
    inodes: &HashSet<u64>,
) -> BTreeSet<u16> {
    let mut ports = BTreeSet::new();
    for table in tables {
        // sl local_address rem_address st tx:rx tr:tm retrnsmt uid timeout inode ...
        for line in table.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            let port = f[1]
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            let inode = f[9].parse::<u64>().ok();
            if let (Some(port), Some(inode)) = (port, inode) {
                if inodes.contains(&inode) {
                    ports.insert(port);
                }
            }
        }
    }
    ports
}

/// nbdkit's NBD port: the one listening port that is not one of the
/// plugin's own (`own`: status, metrics).
pub fn nbd_port(listening: &BTreeSet<u16>, own: &[u16]) -> Result<u16, String> {
    let left: Vec<u16> = listening
        .iter()
        .copied()
        .filter(|p| !own.contains(p))
        .collect();
    match left[..] {
        [p] => Ok(p),
        [] => Err(
            "announce=true: nbdkit listens on no TCP port (a Unix socket cannot be announced)"
                .into(),
        ),
        _ => Err(format!(
            "announce=true: nbdkit listens on several TCP ports {left:?}; announce needs one"
        )),
    }
}

/// The inodes of this process's sockets.
fn socket_inodes(fd_dir: &Path) -> std::io::Result<HashSet<u64>> {
    let mut inodes = HashSet::new();
    for e in std::fs::read_dir(fd_dir)? {
        // An fd closed since the listing is simply not a socket of ours.
        let Ok(target) = std::fs::read_link(e?.path()) else {
            continue;
        };
        if let Some(n) = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse().ok())
        {
            inodes.insert(n);
        }
    }
    Ok(inodes)
}

/// The TCP ports this process listens on.
pub fn own_listening_ports() -> Result<BTreeSet<u16>, String> {
    let inodes = socket_inodes(Path::new("/proc/self/fd"))
        .map_err(|e| format!("announce=true: cannot list /proc/self/fd: {e}"))?;
    let mut tables = Vec::new();
    for t in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        match std::fs::read_to_string(t) {
            Ok(s) => tables.push(s),
            // No IPv6 in this kernel or namespace.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("announce=true: cannot read {t}: {e}")),
        }
    }
    Ok(listening_ports(tables.iter().map(String::as_str), &inodes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0200007F:2A41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
   1: 0200007F:2A42 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1002 1 0000000000000000 100 0 0 10 0
   2: 0200007F:2A41 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0000000000000000 20 4 30 10 -1
   3: 0300007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 100 0 0 10 0
";
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:2A41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1004 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn listening_ports_are_ours_and_in_listen_state() {
        let ours: HashSet<u64> = [1001, 1002, 1003, 1004].into();
        let ports = listening_ports([TCP, TCP6], &ours);
        // 10817 (IPv4 and IPv6), 10818; not the connection (1003), not
        // another process's listener (2001, port 8080).
        assert_eq!(ports, BTreeSet::from([0x2A41, 0x2A42]));
    }

    #[test]
    fn the_nbd_port_is_the_one_left() {
        let l = BTreeSet::from([10809, 10810, 10811]);
        assert_eq!(nbd_port(&l, &[10810, 10811]), Ok(10809));
        let e = nbd_port(&l, &[10810]).unwrap_err();
        assert!(e.contains("several") && e.contains("10811"), "{e}");
        assert!(nbd_port(&BTreeSet::from([10810]), &[10810])
            .unwrap_err()
            .contains("no TCP port"));
    }

    #[test]
    fn the_lease_is_a_few_publications_and_never_shorter_than_two() {
        assert_eq!(dns_lease(60, None), Ok(240));
        assert_eq!(dns_lease(1, None), Ok(4));
        assert_eq!(dns_lease(86400, None), Ok(86400));
        assert_eq!(dns_lease(60, Some(120)), Ok(120));
        let e = dns_lease(60, Some(119)).unwrap_err();
        assert!(
            e.contains("dns-lease=119") && e.contains("dns-ttl=60"),
            "{e}"
        );
    }

    #[test]
    fn finds_a_listener_of_this_process() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(own_listening_ports().unwrap().contains(&port));
        drop(l);
        assert!(!own_listening_ports().unwrap().contains(&port));
    }
}
