//! Who may reach the donor's pages and its status endpoint: TLS for every
//! connection that does not come from this machine, exports opened only
//! with their client's token, and no unauthenticated status endpoint on a
//! network address. Pure rules, so each one is unit-tested; the plugin
//! feeds them what nbdkit reports about the connection.

use std::net::{IpAddr, SocketAddr};

pub use netpager_metrics::is_loopback;
use netpager_proto::auth::{check_export_token, EXPORT_TOKEN_HEX};

use crate::config::{parse_requested, ConfigError, Requested};

/// Separates the client from its token in an export name: `CLIENT~TOKEN`.
pub const TOKEN_SEPARATOR: char = '~';

/// The other end of an NBD connection, as `nbdkit_peer_name` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Ip(IpAddr),
    /// A Unix domain socket (`nbdkit -U`): a process on this machine.
    Unix,
    /// Another address family (vsock, ...), or none could be read.
    Other,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Ip(ip) => write!(f, "{ip}"),
            Peer::Unix => f.write_str("a Unix socket"),
            Peer::Other => f.write_str("an unknown peer"),
        }
    }
}

/// Why a connection, an export or a start was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AccessError {
    #[error(
        "refusing a plain-text connection from {0}: pages leave this machine only over TLS \
         (start nbdkit with --tls=require --tls-psk=FILE, or set insecure=true)"
    )]
    TlsRequired(Peer),
    #[error(
        "status={addr} is not a loopback address and the endpoint would take unauthenticated \
         drain commands from the network: give psk=FILE (the lab key), or set insecure=true"
    )]
    OpenStatus { addr: SocketAddr },
    #[error("export for client {client:?}: no token (export-secret= is set: ask for CLIENT~TOKEN, see netpager-token)")]
    MissingToken { client: String },
    #[error("export for client {client:?}: wrong token")]
    WrongToken { client: String },
    #[error("export name has a token ({TOKEN_SEPARATOR}) but this donor has no export-secret=")]
    UnexpectedToken,
    #[error("{0}")]
    Name(#[from] ConfigError),
}

impl AccessError {
    /// The errno nbdkit returns to the client.
    pub fn errno(&self) -> i32 {
        match self {
            AccessError::Name(_) | AccessError::UnexpectedToken => libc::EINVAL,
            _ => libc::EACCES,
        }
    }
}

/// A connection may go on in plain text only from this machine (loopback
/// or a Unix socket), or when the admin said `insecure=true`: anywhere
/// else a client's pages would cross the network readable and forgeable.
pub fn requires_tls(peer: Peer, is_tls: bool, insecure: bool) -> Result<(), AccessError> {
    let local = match peer {
        Peer::Ip(ip) => is_loopback(ip),
        Peer::Unix => true,
        Peer::Other => false,
    };
    if local || is_tls || insecure {
        Ok(())
    } else {
        Err(AccessError::TlsRequired(peer))
    }
}

/// A status endpoint on a non-loopback address must authenticate requests
/// (`psk=`), unless the admin said `insecure=true`.
pub fn check_status_address(
    addr: SocketAddr,
    keyed: bool,
    insecure: bool,
) -> Result<(), AccessError> {
    if is_loopback(addr.ip()) || keyed || insecure {
        Ok(())
    } else {
        Err(AccessError::OpenStatus { addr })
    }
}

/// Parses a requested export name and, with an export secret, checks the
/// token: `CLIENT~TOKEN[/DEVICE[:SESSION]][@SIZE]`, the token made for
/// CLIENT (every device of a client shares it).
pub fn admit_export(raw: &str, secret: Option<&[u8]>) -> Result<Requested, AccessError> {
    let Some(secret) = secret else {
        if raw.contains(TOKEN_SEPARATOR) {
            return Err(AccessError::UnexpectedToken);
        }
        return Ok(parse_requested(raw)?);
    };
    let (head, size) = match raw.split_once('@') {
        Some((n, s)) => (n, Some(s)),
        None => (raw, None),
    };
    let (client_and_token, device) = match head.split_once('/') {
        Some((c, d)) => (c, Some(d)),
        None => (head, None),
    };
    if device.is_some_and(|d| d.contains(TOKEN_SEPARATOR)) {
        // Not quoted: the name may hold a token.
        return Err(AccessError::Name(ConfigError::BadExportName {
            name: "(not shown: it may hold a token)".into(),
            why: format!(
                "the token goes right after the client: CLIENT{TOKEN_SEPARATOR}TOKEN/DEVICE"
            ),
        }));
    }
    let (client, token) = client_and_token
        .split_once(TOKEN_SEPARATOR)
        .unwrap_or((client_and_token, ""));
    // Name rules first, on the name without its token: errors quote it.
    let mut without_token = client.to_string();
    if let Some(d) = device {
        without_token = format!("{without_token}/{d}");
    }
    if let Some(s) = size {
        without_token = format!("{without_token}@{s}");
    }
    let req = parse_requested(&without_token)?;
    let client = req.spec.client();
    if token.is_empty() {
        return Err(AccessError::MissingToken {
            client: client.to_string(),
        });
    }
    // Checked against the client's store name, so `~TOKEN` and
    // `default~TOKEN` agree.
    if token.len() != EXPORT_TOKEN_HEX || !check_export_token(secret, client, token) {
        return Err(AccessError::WrongToken {
            client: client.to_string(),
        });
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExportSpec;
    use netpager_proto::auth::export_token;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ip(s: &str) -> Peer {
        Peer::Ip(s.parse().unwrap())
    }

    #[test]
    fn plain_text_only_from_this_machine() {
        for local in [
            ip("127.0.0.1"),
            ip("127.3.4.5"),
            ip("::1"),
            ip("::ffff:127.0.0.2"),
            Peer::Unix,
        ] {
            assert_eq!(requires_tls(local, false, false), Ok(()), "{local}");
        }
        for remote in [
            ip("10.0.0.7"),
            ip("192.168.1.2"),
            ip("0.0.0.0"),
            ip("fe80::1"),
            ip("::ffff:10.0.0.1"),
            Peer::Other,
        ] {
            assert_eq!(
                requires_tls(remote, false, false),
                Err(AccessError::TlsRequired(remote)),
                "{remote}"
            );
            assert_eq!(
                requires_tls(remote, true, false),
                Ok(()),
                "TLS from {remote}"
            );
            assert_eq!(
                requires_tls(remote, false, true),
                Ok(()),
                "insecure=true, {remote}"
            );
        }
        let msg = requires_tls(ip("10.1.2.3"), false, false)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("10.1.2.3") && msg.contains("--tls=require"),
            "{msg}"
        );
    }

    #[test]
    fn network_status_endpoint_needs_a_key() {
        let any = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 10900));
        let lan = SocketAddr::from((Ipv4Addr::new(10, 0, 0, 1), 10900));
        let lo = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), 10900));
        let lo6 = SocketAddr::from((Ipv6Addr::LOCALHOST, 10900));
        for a in [any, lan] {
            assert_eq!(
                check_status_address(a, false, false),
                Err(AccessError::OpenStatus { addr: a })
            );
            assert_eq!(check_status_address(a, true, false), Ok(()));
            assert_eq!(check_status_address(a, false, true), Ok(()));
        }
        for a in [lo, lo6] {
            assert_eq!(check_status_address(a, false, false), Ok(()));
        }
    }

    #[test]
    fn tokens_bind_exports_to_their_client() {
        let secret = [7u8; 32];
        let t1 = export_token(&secret, "c1");
        let ok = admit_export(&format!("c1~{t1}@64M"), Some(&secret)).unwrap();
        assert_eq!(
            ok.spec,
            ExportSpec {
                name: "c1".into(),
                size: Some(64 << 20)
            }
        );
        assert_eq!(
            admit_export(&format!("c1~{t1}"), Some(&secret))
                .unwrap()
                .spec
                .size,
            None
        );
        // Every device of a client opens with the client's token.
        let dev = admit_export(&format!("c1~{t1}/d7:3@64M"), Some(&secret)).unwrap();
        assert_eq!(dev.spec.name, "c1/d7");
        assert_eq!(dev.session.map(|r| (r.session, r.conn)), Some((3, 0)));
        // Another client's name with c1's token, a missing token, a bad one.
        let refused = [
            (
                format!("c2~{t1}"),
                AccessError::WrongToken {
                    client: "c2".into(),
                },
            ),
            (
                "c2".to_string(),
                AccessError::MissingToken {
                    client: "c2".into(),
                },
            ),
            (
                "c2@1G".to_string(),
                AccessError::MissingToken {
                    client: "c2".into(),
                },
            ),
            (
                "c2~".to_string(),
                AccessError::MissingToken {
                    client: "c2".into(),
                },
            ),
            (
                format!("c1~{}", &t1[..31]),
                AccessError::WrongToken {
                    client: "c1".into(),
                },
            ),
            (
                format!("c1~{t1}~{t1}"),
                AccessError::WrongToken {
                    client: "c1".into(),
                },
            ),
        ];
        for (name, want) in refused {
            let got = admit_export(&name, Some(&secret)).unwrap_err();
            assert_eq!(got, want, "{name}");
            assert_eq!(got.errno(), libc::EACCES);
            assert!(
                !got.to_string().contains(&t1[..8]),
                "the error shows the token: {got}"
            );
        }
        // Name rules still apply to CLIENT, and their errors leave the token out.
        let bad = admit_export(&format!("a/b~{t1}"), Some(&secret)).unwrap_err();
        assert!(
            matches!(bad, AccessError::Name(_)) && !bad.to_string().contains(&t1),
            "{bad}"
        );
        let bad = admit_export(&format!("a.b~{t1}/c d"), Some(&secret)).unwrap_err();
        assert!(
            matches!(bad, AccessError::Name(_)) && !bad.to_string().contains(&t1),
            "{bad}"
        );
        assert_eq!(bad.errno(), libc::EINVAL);
        // The empty name is `default`, which has a token like any client.
        assert_eq!(
            admit_export("", Some(&secret)),
            Err(AccessError::MissingToken {
                client: "default".into()
            })
        );
    }

    #[test]
    fn without_a_secret_names_are_plain() {
        assert_eq!(
            admit_export("a@1M", None).unwrap().spec,
            ExportSpec {
                name: "a".into(),
                size: Some(1 << 20)
            }
        );
        assert_eq!(
            admit_export("a~0011", None),
            Err(AccessError::UnexpectedToken)
        );
    }
}
