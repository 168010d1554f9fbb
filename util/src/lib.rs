//! The small things every netpager binary and plugin parses or prints the
//! same way: byte sizes (`64K`, `1GiB`) and `HOST:PORT` addresses
//! (`[::1]:10809` too). One implementation, so a size or address accepted
//! by one command is accepted by all of them. Also the one lock-poisoning
//! policy ([`LockExt`] and its kin): recover, never propagate; and the one
//! way to lock a swap-path process's memory ([`process::lock_memory`]),
//! and what `--version` prints on every command ([`version`]); a
//! request's clock through the serving process's hops ([`trace`]); and
//! the defaults an admin meets in several places, each defined once
//! ([`defaults`]).

pub mod defaults;
pub mod process;
mod sync;
#[allow(unsafe_code)]
mod sys;
pub mod trace;
pub mod version;

pub use sync::{panic_message, CondvarExt, LockExt, RwLockExt};

/// A random, non-zero 128-bit number from the kernel's generator, mixed
/// with the time and pid should `/dev/urandom` be unreadable: for names
/// that must differ between devices and incarnations (device ids, export
/// labels), not for keys.
pub fn random_u128() -> u128 {
    use std::io::Read;
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = f.read_exact(&mut b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(1);
    (u128::from_le_bytes(b) ^ t ^ u128::from(std::process::id())).max(1)
}

use std::fmt;
use std::net::Ipv6Addr;

/// Why a size was refused; every variant names the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("size {0:?} is negative")]
    Negative(String),
    #[error("{0:?} is not a size (expected digits with an optional K, M, G, T, P or E suffix, e.g. 4096, 64K, 1GiB)")]
    Invalid(String),
    #[error("size {text:?} has an unknown unit {unit:?} (use K, M, G, T, P or E, optionally followed by iB or B)")]
    Unit { text: String, unit: String },
    #[error("size {0:?} does not fit in 64 bits")]
    Overflow(String),
}

/// Parses a byte count: decimal digits, then an optional unit `K`, `M`,
/// `G`, `T`, `P` or `E` (powers of 1024, either case), which may be
/// followed by `iB` or `B` (`64K`, `64KiB` and `64KB` are the same), or
/// `B` alone for bytes. Space around the text and before the unit is
/// ignored.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(end);
    if digits.is_empty() {
        let rest = t.strip_prefix('-').unwrap_or("");
        return Err(if rest.starts_with(|c: char| c.is_ascii_digit()) {
            SizeError::Negative(text.to_owned())
        } else {
            SizeError::Invalid(text.to_owned())
        });
    }
    let unit = unit.trim_start();
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        "e" | "eb" | "eib" => 60,
        _ if unit.chars().all(|c| c.is_ascii_alphabetic()) => {
            return Err(SizeError::Unit {
                text: text.to_owned(),
                unit: unit.to_owned(),
            })
        }
        _ => return Err(SizeError::Invalid(text.to_owned())),
    };
    let overflow = || SizeError::Overflow(text.to_owned());
    digits
        .parse::<u64>()
        .map_err(|_| overflow())?
        .checked_mul(1 << shift)
        .ok_or_else(overflow)
}

/// A byte count for people: `512 B`, `64 KiB`, `1.5 GiB` (binary units,
/// at most one decimal, none when it is 0).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    // Compare after rounding to one decimal, so 1023.96 KiB reads 1 MiB.
    while u + 1 < UNITS.len() && (v * 10.0).round() >= 10240.0 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        return format!("{bytes} B");
    }
    let tenths = (v * 10.0).round() as u64;
    if tenths.is_multiple_of(10) {
        format!("{} {}", tenths / 10, UNITS[u])
    } else {
        format!("{}.{} {}", tenths / 10, tenths % 10, UNITS[u])
    }
}

/// A `HOST:PORT` address. `host` carries no brackets: an IPv6 literal is
/// written `[::1]:10809` and stored as `::1`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

/// Why an address was refused; every variant names the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostPortError {
    #[error("address {0:?} has no :PORT (expected HOST:PORT, [IPV6]:PORT)")]
    NoPort(String),
    #[error("address {0:?} has no host before ':'")]
    NoHost(String),
    #[error("address {text:?}: port {port:?} is not a number from 1 to 65535")]
    Port { text: String, port: String },
    #[error("address {0:?}: write an IPv6 address in brackets, [ADDR]:PORT")]
    Unbracketed(String),
    #[error("address {0:?}: the host in brackets is not an IPv6 address")]
    BadIpv6(String),
    #[error("address {0:?}: the host contains a space, bracket or slash")]
    BadHost(String),
}

impl HostPort {
    /// Parses `HOST:PORT`: an IPv4 address, a host name or an IPv6
    /// address in brackets, and a port from 1 to 65535.
    pub fn parse(text: &str) -> Result<HostPort, HostPortError> {
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (v6, after) = rest
                .split_once(']')
                .ok_or_else(|| HostPortError::BadIpv6(text.to_owned()))?;
            let port = after
                .strip_prefix(':')
                .ok_or_else(|| HostPortError::NoPort(text.to_owned()))?;
            if v6.parse::<Ipv6Addr>().is_err() {
                return Err(HostPortError::BadIpv6(text.to_owned()));
            }
            (v6, port)
        } else {
            let (host, port) = text
                .rsplit_once(':')
                .ok_or_else(|| HostPortError::NoPort(text.to_owned()))?;
            if host.contains(':') {
                return Err(HostPortError::Unbracketed(text.to_owned()));
            }
            if host.contains(|c: char| c.is_whitespace() || "[]/".contains(c)) {
                return Err(HostPortError::BadHost(text.to_owned()));
            }
            (host, port)
        };
        if host.is_empty() {
            return Err(HostPortError::NoHost(text.to_owned()));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => Ok(HostPort {
                host: host.to_owned(),
                port: p,
            }),
            _ => Err(HostPortError::Port {
                text: text.to_owned(),
                port: port.to_owned(),
            }),
        }
    }
}

impl fmt::Display for HostPort {
    /// Back to `HOST:PORT`, with brackets around an IPv6 host.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl std::str::FromStr for HostPort {
    type Err = HostPortError;

    fn from_str(s: &str) -> Result<HostPort, HostPortError> {
        HostPort::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_with_units() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("7B"), Ok(7));
        assert_eq!(parse_size("7b"), Ok(7));
        for (t, v) in [
            ("64K", 64 << 10),
            ("64k", 64 << 10),
            ("64KiB", 64 << 10),
            ("64kb", 64 << 10),
            ("3m", 3 << 20),
            ("32MiB", 32 << 20),
            ("2G", 2 << 30),
            ("1GB", 1 << 30),
            ("1T", 1 << 40),
            ("1TiB", 1 << 40),
            ("2P", 2 << 50),
            ("7E", 7 << 60),
            (" 64 M ", 64 << 20),
        ] {
            assert_eq!(parse_size(t), Ok(v), "{t:?}");
        }
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn bad_sizes_name_the_text() {
        for t in ["", "K", "+1", "1.5", "1.5G", "0x10", "G1"] {
            let e = parse_size(t).unwrap_err();
            assert_eq!(e, SizeError::Invalid(t.into()), "{t:?}");
            assert!(e.to_string().contains(&format!("{t:?}")), "{e}");
        }
        assert_eq!(parse_size("-3"), Err(SizeError::Negative("-3".into())));
        assert_eq!(parse_size("-3K"), Err(SizeError::Negative("-3K".into())));
        let e = parse_size("12x").unwrap_err();
        assert_eq!(
            e,
            SizeError::Unit {
                text: "12x".into(),
                unit: "x".into()
            }
        );
        assert!(e.to_string().contains("\"12x\""), "{e}");
        for t in ["1Ki", "1KK", "1MiBs", "4 s"] {
            assert!(
                matches!(parse_size(t), Err(SizeError::Unit { .. })),
                "{t:?}"
            );
        }
        for t in [
            "18446744073709551616",
            "17179869184G",
            "16E",
            "99999999999999999999999",
        ] {
            assert_eq!(parse_size(t), Err(SizeError::Overflow(t.into())), "{t:?}");
        }
    }

    #[test]
    fn formatted_sizes() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(1024), "1 KiB");
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(180 << 20), "180 MiB");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
        assert_eq!(format_size((1 << 20) - 1), "1 MiB");
        assert_eq!(format_size(u64::MAX), "16 EiB");
    }

    #[test]
    fn formatted_sizes_parse_back() {
        for v in [0, 1, 1023, 1 << 10, 64 << 20, 5 << 40] {
            let s = format_size(v).replace(' ', "");
            assert_eq!(parse_size(&s), Ok(v), "{s}");
        }
    }

    fn hp(host: &str, port: u16) -> HostPort {
        HostPort {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn addresses() {
        assert_eq!(
            HostPort::parse("127.0.0.2:10809"),
            Ok(hp("127.0.0.2", 10809))
        );
        assert_eq!(HostPort::parse("[::1]:10809"), Ok(hp("::1", 10809)));
        assert_eq!(HostPort::parse("[fe80::1:2]:1"), Ok(hp("fe80::1:2", 1)));
        assert_eq!(
            HostPort::parse("donor-1.lab.example:65535"),
            Ok(hp("donor-1.lab.example", 65535))
        );
        assert_eq!("localhost:80".parse(), Ok(hp("localhost", 80)));
    }

    #[test]
    fn addresses_print_back() {
        for t in ["127.0.0.2:10809", "[::1]:10809", "donor:1"] {
            assert_eq!(HostPort::parse(t).unwrap().to_string(), t);
        }
    }

    #[test]
    fn bad_addresses_name_the_text() {
        use HostPortError::*;
        type Kind = fn(String) -> HostPortError;
        let cases: [(&str, Kind); 9] = [
            ("127.0.0.1", NoPort),
            ("[::1]", NoPort),
            (":10809", NoHost),
            ("::1:10809", Unbracketed),
            ("[::1:10809", BadIpv6),
            ("[nope]:1", BadIpv6),
            ("[]:1", BadIpv6),
            ("a b:1", BadHost),
            ("h/x:1", BadHost),
        ];
        for (t, want) in cases {
            let e = HostPort::parse(t).unwrap_err();
            assert_eq!(e, want(t.into()), "{t:?}");
            assert!(e.to_string().contains(&format!("{t:?}")), "{e}");
        }
        for (t, port) in [
            ("h:", ""),
            ("h:0", "0"),
            ("h:65536", "65536"),
            ("h:+1", "+1"),
            ("h:x", "x"),
            ("[::1]:99999", "99999"),
        ] {
            assert_eq!(
                HostPort::parse(t),
                Err(Port {
                    text: t.into(),
                    port: port.into()
                }),
                "{t:?}"
            );
        }
    }
}
