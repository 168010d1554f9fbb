//! Plugin parameters (`key=value` on the nbdkit command line) and export
//! names, parsed without nbdkit so that every rule is unit-tested.

use std::path::PathBuf;
use std::time::Duration;

/// Bytes per page: the unit the store keeps, budgets are counted in and
/// nbdkit is told to prefer.
pub const PAGE_SIZE: usize = 4096;
/// Largest export size accepted: nbdkit reports sizes as `i64`.
pub const MAX_EXPORT_SIZE: u64 = i64::MAX as u64;
/// Longest export name (without the `@SIZE` suffix).
pub const MAX_EXPORT_NAME: usize = 64;
/// Export name used when the client asks for the empty name.
pub const DEFAULT_EXPORT: &str = "default";

/// A parameter or export name that could not be accepted.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("unknown parameter {key:?} (see pager-server(1) for the list)")]
    UnknownKey { key: String },
    #[error("parameter {key}={value:?}: {why}")]
    BadValue {
        key: String,
        value: String,
        why: String,
    },
    #[error("export name {name:?}: {why}")]
    BadExportName { name: String, why: String },
}

fn bad(key: &str, value: &str, why: impl Into<String>) -> ConfigError {
    ConfigError::BadValue {
        key: key.to_string(),
        value: value.to_string(),
        why: why.into(),
    }
}

/// The compressor of a donor (`compress=`; the store's [`crate::store::codec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compress {
    /// Every page kept raw (zero pages still as nothing).
    Off,
    /// LZ4 blocks (`lz4_flex`): the fastest to compress and decompress.
    Lz4,
    /// Zstandard level 1 (libzstd): denser (up to half LZ4's bytes on
    /// real pages), 2.5-4.6x LZ4's CPU to compress (pager-server(1)).
    Zstd,
}

/// The recompressor's codec with compress=lz4 when none is given: LZ4-HC
/// keeps a cold page's read as fast as LZ4's and holds real programs'
/// pages in at most 1.1x zram's bytes; zstd holds them in less, but reads
/// them back slower (pager-server(1)).
pub const DEFAULT_RECOMPRESS: Recompress = Recompress::Lz4hc;

/// What the recompressor packs cold pages with (`recompress=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompress {
    Off,
    /// Zstandard level 1: the densest (on real pages 1.0-1.7x fewer bytes
    /// than LZ4's), 3-5x LZ4's CPU to read back (pager-server(1)).
    Zstd,
    /// LZ4's high-compression mode (liblz4): LZ4 blocks, so read back as
    /// fast as any LZ4 page, denser than plain LZ4 by what its slower
    /// search for matches finds.
    Lz4hc,
}

impl Recompress {
    pub const ALL: [Recompress; 3] = [Recompress::Off, Recompress::Zstd, Recompress::Lz4hc];

    /// The word of `recompress=` and of status.
    pub fn word(self) -> &'static str {
        match self {
            Recompress::Off => "off",
            Recompress::Zstd => "zstd",
            Recompress::Lz4hc => "lz4hc",
        }
    }

    pub fn parse(s: &str) -> Option<Recompress> {
        Recompress::ALL.into_iter().find(|c| c.word() == s)
    }
}

impl Compress {
    pub const ALL: [Compress; 3] = [Compress::Off, Compress::Lz4, Compress::Zstd];

    /// The word of `compress=` and of status.
    pub fn word(self) -> &'static str {
        match self {
            Compress::Off => "off",
            Compress::Lz4 => "lz4",
            Compress::Zstd => "zstd",
        }
    }

    pub fn parse(s: &str) -> Option<Compress> {
        Compress::ALL.into_iter().find(|c| c.word() == s)
    }
}

/// A byte count given either absolutely or as a share of MemTotal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Amount {
    Bytes(u64),
    PercentOfMemTotal(f64),
}

impl Amount {
    /// Bytes this amount stands for on a node with `mem_total` bytes.
    pub fn resolve(self, mem_total: u64) -> u64 {
        match self {
            Amount::Bytes(b) => b,
            Amount::PercentOfMemTotal(p) => (mem_total as f64 * p / 100.0) as u64,
        }
    }
}

/// Every parameter of the plugin, with its default.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Size of an export whose name carries no `@SIZE`.
    pub size: u64,
    pub budget: Amount,
    pub reserve: Amount,
    pub mlock: bool,
    pub status: Option<String>,
    /// Where `/metrics` is served (Prometheus text over HTTP).
    pub metrics: Option<String>,
    pub node_id: Option<String>,
    pub age_x: u64,
    pub u_star: f64,
    pub window: Duration,
    pub busy_load: f64,
    /// Load per CPU from which the donor offers less (`None`: half of
    /// busy-load).
    pub shed_load: Option<f64>,
    pub poll: Duration,
    pub meminfo: PathBuf,
    /// The lab's TLS-PSK file: the status endpoint then takes only signed requests.
    pub psk: Option<PathBuf>,
    /// Hex key file: export names must then carry their client's token.
    pub export_secret: Option<PathBuf>,
    /// Allows plain-text connections and an unauthenticated status
    /// endpoint from beyond this machine.
    pub insecure: bool,
    /// Announce the donor by DNS-SD: by multicast DNS, or in the lab's DNS.
    pub announce: Announce,
    /// `announce=dns`: the DNS server taking the updates (default: the
    /// resolver's), the zone, the TSIG key file and the records' TTL.
    pub dns_server: Option<String>,
    pub dns_zone: Option<String>,
    pub dns_key: Option<PathBuf>,
    pub dns_ttl: u32,
    /// `announce=dns`: the lease in the TXT record (default 4 x `dns_ttl`),
    /// and whether the donor removes other donors' expired records.
    pub dns_lease: Option<u32>,
    pub dns_prune: bool,
    /// How pages are kept: compressed (lz4, zstd) or raw (off).
    pub compress: Compress,
    /// `recompress=`: what cold pages are packed again with (`None`: the
    /// default with compress=lz4; see [`Config::recompressor`]).
    pub recompress: Option<Recompress>,
    /// How long a page goes untouched before it is cold.
    pub recompress_idle: Duration,
    /// Bytes of cold pages the recompressor looks at a second. By default
    /// 16 MiB: LZ4-HC takes about 3-5 ms of CPU a MiB of real pages
    /// (pager-server(1)), so about 5-8% of one CPU, a GiB repacked a minute.
    pub recompress_rate: u64,
}

/// How a donor announces itself (`announce=`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Announce {
    #[default]
    Off,
    /// On the local segment, by multicast DNS (`announce=true`).
    Mdns,
    /// In a zone of the lab's DNS by signed dynamic updates (`announce=dns`).
    Dns,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            size: 1 << 30,
            budget: Amount::PercentOfMemTotal(50.0),
            reserve: Amount::PercentOfMemTotal(5.0),
            mlock: true,
            status: None,
            metrics: None,
            node_id: None,
            age_x: 64,
            u_star: 0.5,
            window: Duration::from_secs(10),
            busy_load: 0.5,
            shed_load: None,
            poll: Duration::from_millis(500),
            meminfo: PathBuf::from("/proc/meminfo"),
            psk: None,
            export_secret: None,
            insecure: false,
            announce: Announce::Off,
            dns_server: None,
            dns_zone: None,
            dns_key: None,
            dns_ttl: 60,
            dns_lease: None,
            dns_prune: true,
            compress: Compress::Lz4,
            recompress: None,
            recompress_idle: Duration::from_secs(30),
            recompress_rate: 16 << 20,
        }
    }
}

/// Help text shown by `nbdkit pager-server --help`.
pub const HELP: &str = "\
size=SIZE            Size of an export named without @SIZE (default 1G).
budget=SIZE|N%       Cap on donated bytes over all exports (default 50%).
reserve=SIZE|N%      Free memory kept for the node; below it: draining (default 5%).
mlock=BOOL           Lock the plugin's memory, donated pages included (default true).
status=ADDR:PORT     Serve the status endpoint here (default: none).
metrics=ADDR:PORT    Serve Prometheus metrics at http://ADDR:PORT/metrics (default: none).
node-id=NAME         Donor name in status replies (default: hostname).
age-x=N              Report the age of the N-th oldest page (default 64).
u-star=F             Allowed utilisation by remote requests, 0..1 (default 0.5).
window=SECS          Utilisation window in seconds (default 10).
busy-load=F          Busy when 1-min loadavg per CPU exceeds F (default 0.5).
shed-load=F          Offer less from this load per CPU on, a quarter at busy-load
                     (default half of busy-load).
poll-ms=N            Memory and load watch interval (default 500).
meminfo=PATH         Read MemTotal/MemAvailable here (default /proc/meminfo).
psk=FILE             Lab TLS-PSK file: status requests must be signed with its key,
                     metrics requests must carry its bearer token.
export-secret=FILE   Hex key: export names must be CLIENT~TOKEN[@SIZE].
insecure=BOOL        Allow plain text from non-loopback peers and an
                     unauthenticated status or metrics endpoint on a network address.
announce=BOOL|dns    Announce _netpager._tcp with the NBD and status ports and node
                     id: true by multicast DNS, dns in the lab's DNS (default
                     false; needs status=).
dns-zone=ZONE        announce=dns: the zone the records go in (_netpager._tcp.ZONE).
dns-key=FILE         announce=dns: the TSIG key (BIND key file, hmac-sha256).
dns-server=ADDR[:PORT]  announce=dns: the server taking updates (default: resolv.conf's).
dns-ttl=SECS         announce=dns: the records' TTL, and how often they are
                     published again (default 60).
dns-lease=SECS       announce=dns: readers take the records for a dead donor's
                     once not published again for this long (default 4 x dns-ttl,
                     at least 2 x dns-ttl).
dns-prune=BOOL       announce=dns: remove other donors' records past their lease
                     (default true).
compress=lz4|zstd|off  Keep pages compressed in size classes, or raw (default lz4).
recompress=lz4hc|zstd|off  compress=lz4: pack pages again once cold, while
                     the donor is not busy (default lz4hc).
recompress-idle=SECS  A page is cold once untouched this long (default 30).
recompress-rate=SIZE  Cold pages looked at a second (default 16M: about 5-8%
                     of a CPU).";

impl Config {
    /// Applies one `key=value` parameter.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        match key {
            "size" => {
                let s = parse_size(value).map_err(|why| bad(key, value, why))?;
                self.size = check_export_size(s).map_err(|why| bad(key, value, why))?;
            }
            "budget" => self.budget = parse_amount(key, value)?,
            "reserve" => self.reserve = parse_amount(key, value)?,
            "mlock" => self.mlock = parse_bool(value).map_err(|why| bad(key, value, why))?,
            "status" | "metrics" => {
                netpager_util::HostPort::parse(value)
                    .map_err(|e| bad(key, value, e.to_string()))?;
                let slot = if key == "status" {
                    &mut self.status
                } else {
                    &mut self.metrics
                };
                *slot = Some(value.to_string());
            }
            "node-id" => {
                check_node_id(value).map_err(|why| bad(key, value, why))?;
                self.node_id = Some(value.to_string());
            }
            "age-x" => {
                let x: u64 = value
                    .parse()
                    .map_err(|_| bad(key, value, "expected a whole number"))?;
                if !(1..=1 << 24).contains(&x) {
                    return Err(bad(key, value, "must be between 1 and 16777216"));
                }
                self.age_x = x;
            }
            "u-star" => self.u_star = parse_fraction(key, value, 0.0, 1.0)?,
            "busy-load" => self.busy_load = parse_fraction(key, value, 0.0, 1e6)?,
            "shed-load" => self.shed_load = Some(parse_fraction(key, value, 0.0, 1e6)?),
            "window" => {
                let secs = parse_fraction(key, value, 0.1, 86400.0)?;
                self.window = Duration::from_secs_f64(secs);
            }
            "poll-ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|_| bad(key, value, "expected a whole number of milliseconds"))?;
                if !(10..=60_000).contains(&ms) {
                    return Err(bad(key, value, "must be between 10 and 60000"));
                }
                self.poll = Duration::from_millis(ms);
            }
            "meminfo" => {
                if value.is_empty() {
                    return Err(bad(key, value, "expected a file path"));
                }
                self.meminfo = PathBuf::from(value);
            }
            "psk" => self.psk = Some(file_path(key, value)?),
            "export-secret" => self.export_secret = Some(file_path(key, value)?),
            "insecure" => self.insecure = parse_bool(value).map_err(|why| bad(key, value, why))?,
            "announce" => {
                self.announce = match value {
                    "dns" => Announce::Dns,
                    "mdns" => Announce::Mdns,
                    v => match parse_bool(v) {
                        Ok(true) => Announce::Mdns,
                        Ok(false) => Announce::Off,
                        Err(why) => return Err(bad(key, value, format!("{why}, or dns"))),
                    },
                }
            }
            "dns-server" => {
                netpager_membership::dns::parse_server(value)
                    .map_err(|why| bad(key, value, why))?;
                self.dns_server = Some(value.to_string());
            }
            "dns-zone" => {
                netpager_membership::dns::wire::Name::parse(value)
                    .map_err(|e| bad(key, value, e.to_string()))?;
                self.dns_zone = Some(value.to_string());
            }
            "dns-key" => self.dns_key = Some(file_path(key, value)?),
            "dns-ttl" => {
                self.dns_ttl = match value.parse::<u32>() {
                    Ok(t) if (1..=86400).contains(&t) => t,
                    _ => return Err(bad(key, value, "must be 1 to 86400 seconds")),
                }
            }
            "dns-lease" => {
                self.dns_lease = match value.parse::<u32>() {
                    Ok(t) if (1..=netpager_membership::dns::lease::MAX_LEASE).contains(&t) => {
                        Some(t)
                    }
                    _ => return Err(bad(key, value, "must be 1 to 86400 seconds")),
                }
            }
            "dns-prune" => {
                self.dns_prune = parse_bool(value).map_err(|why| bad(key, value, why))?
            }
            "compress" => {
                self.compress = Compress::parse(value)
                    .ok_or_else(|| bad(key, value, "expected lz4, zstd or off"))?
            }
            "recompress" => {
                self.recompress = Some(
                    Recompress::parse(value)
                        .ok_or_else(|| bad(key, value, "expected zstd, lz4hc or off"))?,
                )
            }
            "recompress-idle" => {
                let secs: u64 = value
                    .parse()
                    .map_err(|_| bad(key, value, "expected a whole number of seconds"))?;
                if secs > 86_400 {
                    return Err(bad(key, value, "must be 0 to 86400 seconds"));
                }
                self.recompress_idle = Duration::from_secs(secs);
            }
            "recompress-rate" => {
                let r = parse_size(value).map_err(|why| bad(key, value, why))?;
                if !(PAGE_SIZE as u64..=1 << 40).contains(&r) {
                    return Err(bad(
                        key,
                        value,
                        "must be 4K to 1T a second (recompress=off stops it)",
                    ));
                }
                self.recompress_rate = r;
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                })
            }
        }
        Ok(())
    }
}

impl Config {
    /// What cold pages are packed again with: by default with compress=lz4
    /// only (zstd pages gain nothing, raw ones are meant raw).
    pub fn recompressor(&self) -> Result<Recompress, String> {
        match (self.recompress, self.compress) {
            (None, Compress::Lz4) => Ok(DEFAULT_RECOMPRESS),
            (None, _) => Ok(Recompress::Off),
            (Some(r), Compress::Lz4) | (Some(r @ Recompress::Off), _) => Ok(r),
            (Some(r), c) => Err(format!(
                "recompress={} needs compress=lz4 (compress={} {})",
                r.word(),
                c.word(),
                if c == Compress::Zstd {
                    "packs every page with zstd already"
                } else {
                    "keeps pages raw"
                }
            )),
        }
    }
}

/// A key file, read (and checked) once at config_complete, before nbdkit
/// changes directory to `/`.
fn file_path(key: &str, value: &str) -> Result<PathBuf, ConfigError> {
    if value.is_empty() {
        return Err(bad(key, value, "expected a file path"));
    }
    Ok(PathBuf::from(value))
}

/// Parses a size the way nbdkit does (`nbdkit_parse_size`): netpager's
/// size syntax, plus `s` for 512-byte sectors, and at most 2^63-1 bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let sectors = s
        .trim()
        .strip_suffix(['s', 'S'])
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    let bytes = match sectors {
        Some(n) => netpager_util::parse_size(n)
            .map_err(|e| e.to_string())?
            .checked_mul(512),
        None => Some(netpager_util::parse_size(s).map_err(|e| e.to_string())?),
    };
    bytes
        .filter(|v| *v <= i64::MAX as u64)
        .ok_or_else(|| format!("size {s:?} overflows 2^63-1 bytes"))
}

fn check_export_size(size: u64) -> Result<u64, String> {
    if size == 0 {
        return Err("export size must be at least 1 byte".into());
    }
    if size > MAX_EXPORT_SIZE {
        return Err(format!(
            "export size must be at most {MAX_EXPORT_SIZE} bytes"
        ));
    }
    Ok(size)
}

/// `SIZE` or `N%` (of MemTotal, 0 < N <= 100).
fn parse_amount(key: &str, value: &str) -> Result<Amount, ConfigError> {
    if let Some(p) = value.strip_suffix('%') {
        let pct: f64 = p
            .trim()
            .parse()
            .map_err(|_| bad(key, value, "expected N% with N a number"))?;
        if !(pct.is_finite() && pct > 0.0 && pct <= 100.0) {
            return Err(bad(
                key,
                value,
                "percentage must be above 0 and at most 100",
            ));
        }
        return Ok(Amount::PercentOfMemTotal(pct));
    }
    parse_size(value)
        .map(Amount::Bytes)
        .map_err(|why| bad(key, value, why))
}

fn parse_fraction(key: &str, value: &str, min: f64, max: f64) -> Result<f64, ConfigError> {
    let f: f64 = value
        .trim()
        .parse()
        .map_err(|_| bad(key, value, "expected a number"))?;
    if !(f.is_finite() && f >= min && f <= max) {
        return Err(bad(key, value, format!("must be between {min} and {max}")));
    }
    Ok(f)
}

/// Booleans as nbdkit spells them (`nbdkit_parse_bool`).
pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" | "on" => Ok(true),
        "0" | "false" | "f" | "no" | "n" | "off" => Ok(false),
        _ => Err("expected true/false, yes/no, on/off or 1/0".into()),
    }
}

fn check_node_id(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 255 {
        return Err("must be 1 to 255 characters".into());
    }
    if s.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("must not contain spaces or control characters".into());
    }
    Ok(())
}

/// An export as the client named it: store name and optional size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    /// `CLIENT`, or `CLIENT/DEVICE` for one device of a client that has
    /// several (each device's pages are its own store).
    pub name: String,
    pub size: Option<u64>,
}

impl ExportSpec {
    /// The client's part of the name (what an export token is made for).
    pub fn client(&self) -> &str {
        self.name.split_once('/').map_or(&self.name, |(c, _)| c)
    }
}

/// Checks one part of an export name (the client's or the device's).
fn check_name_part(part: &str, what: &str) -> Result<(), String> {
    if part.len() > MAX_EXPORT_NAME {
        return Err(format!(
            "{what} is {} bytes, at most {MAX_EXPORT_NAME} allowed",
            part.len()
        ));
    }
    if let Some(c) = part
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "character {c:?} not allowed in the {what} (use A-Z a-z 0-9 . _ -)"
        ));
    }
    if !part.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!("{what} must start with a letter or digit"));
    }
    Ok(())
}

/// Parses an NBD export name `NAME[/DEVICE][@SIZE]`. The empty name is
/// [`DEFAULT_EXPORT`]. NAME and DEVICE are 1-64 characters from `A-Z a-z
/// 0-9 . _ -`, starting with a letter or digit.
pub fn parse_export_name(raw: &str) -> Result<ExportSpec, ConfigError> {
    let err = |why: String| ConfigError::BadExportName {
        name: raw.to_string(),
        why,
    };
    let (name, size) = match raw.split_once('@') {
        Some((n, s)) => {
            let size = parse_size(s).map_err(|why| err(format!("size after '@': {why}")))?;
            (n, Some(check_export_size(size).map_err(&err)?))
        }
        None => (raw, None),
    };
    let (client, device) = match name.split_once('/') {
        Some((c, d)) => (c, Some(d)),
        None => (name, None),
    };
    let client = if client.is_empty() {
        DEFAULT_EXPORT
    } else {
        check_name_part(client, "name").map_err(&err)?;
        client
    };
    let name = match device {
        Some(d) => {
            check_name_part(d, "device").map_err(&err)?;
            format!("{client}/{d}")
        }
        None => client.to_string(),
    };
    Ok(ExportSpec { name, size })
}

/// An export name as asked for on a connection: the export, and the client
/// session and connection round that ask (`NAME/DEVICE:SESSION[.CONN][@SIZE]`),
/// which fence older ones of the same device off it (see `session.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requested {
    pub spec: ExportSpec,
    pub session: Option<crate::session::Round>,
}

/// Parses `NAME[/DEVICE[:SESSION[.CONN]]][@SIZE]`: SESSION and CONN are
/// decimal numbers, and only a device's export carries them.
pub fn parse_requested(raw: &str) -> Result<Requested, ConfigError> {
    let (head, size) = match raw.split_once('@') {
        Some((h, s)) => (h, Some(s)),
        None => (raw, None),
    };
    let (head, session) = match head.split_once('/').and_then(|(_, d)| d.split_once(':')) {
        Some((_, s)) => {
            let bad = || ConfigError::BadExportName {
                name: raw.to_string(),
                why: format!(
                    "session after ':' must be SESSION or SESSION.CONN (numbers), not {s:?}"
                ),
            };
            let (session, conn) = s.split_once('.').unwrap_or((s, "0"));
            let round = crate::session::Round {
                session: session.parse().map_err(|_| bad())?,
                conn: conn.parse().map_err(|_| bad())?,
            };
            (&head[..head.len() - s.len() - 1], Some(round))
        }
        None => (head, None),
    };
    let without = match size {
        Some(s) => format!("{head}@{s}"),
        None => head.to_string(),
    };
    let spec = parse_export_name(&without).map_err(|e| match e {
        ConfigError::BadExportName { why, .. } => ConfigError::BadExportName {
            name: raw.to_string(),
            why,
        },
        e => e,
    })?;
    Ok(Requested { spec, session })
}

/// Rounds a byte budget down to whole pages.
pub fn whole_pages(bytes: u64) -> u64 {
    bytes / PAGE_SIZE as u64
}

#[cfg(test)]
mod tests;
