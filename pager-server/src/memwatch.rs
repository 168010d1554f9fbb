//! What the donor watches on its own node: MemTotal/MemAvailable
//! (`/proc/meminfo` or the `meminfo=` test file), the 1-minute load
//! average, and whether the process may lock memory without limit: pure
//! parsers and readers (the thread that feeds them to the donor is
//! `donor::spawn_watch`).

use std::path::{Path, PathBuf};

/// The two meminfo fields the donor uses, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: line {line}: {why}")]
    Parse {
        path: PathBuf,
        line: usize,
        why: String,
    },
    #[error("{path}: no {field} line")]
    Missing { path: PathBuf, field: &'static str },
}

fn read_text(path: &Path) -> Result<String, WatchError> {
    std::fs::read_to_string(path).map_err(|source| WatchError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Parses meminfo text (`Name:   123 kB` lines). `path` only names the
/// source in errors.
pub fn parse_meminfo(text: &str, path: &Path) -> Result<MemInfo, WatchError> {
    let mut total = None;
    let mut available = None;
    for (i, line) in text.lines().enumerate() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let slot = match key.trim() {
            "MemTotal" => &mut total,
            "MemAvailable" => &mut available,
            _ => continue,
        };
        let parse_err = |why: String| WatchError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            why,
        };
        let mut words = rest.split_whitespace();
        let n: u64 = words.next().and_then(|w| w.parse().ok()).ok_or_else(|| {
            parse_err(format!(
                "{}: expected a number of kB, got {rest:?}",
                key.trim()
            ))
        })?;
        let scale = match words.next() {
            Some("kB") => 1024,
            None => 1,
            Some(u) => return Err(parse_err(format!("{}: unknown unit {u:?}", key.trim()))),
        };
        *slot = Some(n.saturating_mul(scale));
    }
    let missing = |field| WatchError::Missing {
        path: path.to_path_buf(),
        field,
    };
    Ok(MemInfo {
        total: total.ok_or_else(|| missing("MemTotal"))?,
        available: available.ok_or_else(|| missing("MemAvailable"))?,
    })
}

pub fn read_meminfo(path: &Path) -> Result<MemInfo, WatchError> {
    parse_meminfo(&read_text(path)?, path)
}

/// The 1-minute load average: first field of `/proc/loadavg`.
pub fn parse_loadavg(text: &str, path: &Path) -> Result<f64, WatchError> {
    text.split_whitespace()
        .next()
        .and_then(|w| w.parse::<f64>().ok())
        .filter(|l| l.is_finite() && *l >= 0.0)
        .ok_or_else(|| WatchError::Parse {
            path: path.to_path_buf(),
            line: 1,
            why: format!(
                "expected a load average, got {:?}",
                text.lines().next().unwrap_or("")
            ),
        })
}

pub fn read_loadavg() -> Result<f64, WatchError> {
    let path = Path::new("/proc/loadavg");
    parse_loadavg(&read_text(path)?, path)
}

/// Whether the `CapEff:` line of `/proc/self/status` holds `bit`.
pub fn parse_cap_eff(status_text: &str, bit: u32) -> Option<bool> {
    let hex = status_text
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(hex, 16)
        .ok()
        .map(|caps| caps & (1u64 << bit) != 0)
}

/// Linux capability number of CAP_IPC_LOCK (lock memory beyond RLIMIT_MEMLOCK).
pub const CAP_IPC_LOCK: u32 = 14;

pub fn has_cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| parse_cap_eff(&t, CAP_IPC_LOCK))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\nBuffers:            1234 kB\n";

    #[test]
    fn meminfo_fields_in_bytes() {
        let m = parse_meminfo(MEMINFO, Path::new("/proc/meminfo")).unwrap();
        assert_eq!(
            m,
            MemInfo {
                total: 24_576_000 * 1024,
                available: 20_000_000 * 1024
            }
        );
    }

    #[test]
    fn meminfo_errors_name_file_line_and_field() {
        let p = Path::new("/tmp/fake");
        let e = parse_meminfo("MemTotal: 100 kB\n", p)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "/tmp/fake: no MemAvailable line");
        let e = parse_meminfo("MemTotal: 100 kB\nMemAvailable: lots kB\n", p)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/tmp/fake: line 2: MemAvailable: expected a number"),
            "{e}"
        );
        let e = parse_meminfo("MemTotal: 100 MB\n", p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 1") && e.contains("unknown unit \"MB\""),
            "{e}"
        );
        assert!(parse_meminfo("", p).is_err());
    }

    #[test]
    fn loadavg_first_field() {
        let p = Path::new("/proc/loadavg");
        assert_eq!(
            parse_loadavg("1.52 0.80 0.40 3/173 10763\n", p).unwrap(),
            1.52
        );
        assert!(parse_loadavg("", p).is_err());
        assert!(parse_loadavg("-1 0 0", p).is_err());
        assert!(parse_loadavg("x 0 0", p)
            .unwrap_err()
            .to_string()
            .contains("\"x 0 0\""));
    }

    #[test]
    fn capability_bits() {
        let status = "Name:\tnbdkit\nCapEff:\t000001fffeffffff\n";
        assert_eq!(parse_cap_eff(status, CAP_IPC_LOCK), Some(true));
        assert_eq!(
            parse_cap_eff("CapEff:\t0000000000000000\n", CAP_IPC_LOCK),
            Some(false)
        );
        assert_eq!(parse_cap_eff("Name: x\n", CAP_IPC_LOCK), None);
    }
}
