//! The device's configuration: `device.toml` in the client's state
//! directory. `pagerctl attach` builds a [`DeviceConfig`] in code and saves
//! it; the client plugin loads it (`state=DIR`).
//!
//! Sizes are written as integers (bytes) or strings with a binary suffix
//! (`"64M"`, `"1GiB"`); they are saved as integers.//!
//! The checks of every field are in `check.rs`.

mod check;
#[cfg(test)]
mod tests;

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use netpager_util::{defaults, HostPort};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::extent_map::Redundancy;
use crate::policy;
use netpager_nbd::{Endpoint, Timeouts};

/// File name of the configuration inside a state directory.
pub const FILE_NAME: &str = "device.toml";

/// Widest parity group: bounds the members of a unit, so a request's
/// per-member bookkeeping fits in fixed-size arrays.
pub const MAX_WIDTH: u32 = 32;
// A device batch (one request per member) must fit one NBD wait.
const _: () = assert!(MAX_WIDTH as usize <= netpager_nbd::MAX_WAIT);

/// A byte count; see the module documentation for its TOML forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n)),
            Raw::Text(s) => netpager_util::parse_size(&s)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// How the device keeps remote pages safe (DESIGN.md §2.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Mode {
    /// One copy per extent; a dead donor loses its extents (reported).
    None,
    /// Two copies per extent on distinct donors.
    Mirror,
    /// RAID-5: groups of `width - 1` data extents plus one parity extent on
    /// `width` distinct donors, parity position rotating per group.
    Parity { width: u32 },
    /// One remote copy plus an asynchronous write-through copy in the local
    /// file `path` (sparse, the device's size); `queue` bounds the bytes
    /// waiting to be written there.
    Disk {
        path: PathBuf,
        #[serde(default = "default_queue")]
        queue: ByteSize,
    },
    /// Erasure-coded: groups of `data` data extents plus `parity`
    /// Reed-Solomon parity extents on `data + parity` distinct donors; any
    /// `parity` of them may be lost.
    Ec { data: u32, parity: u32 },
}

impl Mode {
    /// The mode without its paths: every property that does not depend on
    /// them is [`Redundancy`]'s.
    pub fn redundancy(&self) -> Redundancy {
        match *self {
            Mode::None => Redundancy::None,
            Mode::Mirror => Redundancy::Mirror,
            Mode::Parity { width } => Redundancy::Parity { width },
            Mode::Disk { .. } => Redundancy::Disk,
            Mode::Ec { data, parity } => Redundancy::Ec { data, parity },
        }
    }

    /// The word used in status and logs.
    pub fn word(&self) -> &'static str {
        self.redundancy().word()
    }

    /// Groups of data and parity extents (parity, ec).
    pub fn striped(&self) -> bool {
        self.redundancy().striped()
    }

    /// Distinct donors an extent (or a parity group) needs.
    pub fn donors_needed(&self) -> usize {
        self.redundancy().members()
    }
}

/// One donor: an nbdkit running the pager-server plugin (or any NBD server
/// with multi-conn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DonorConfig {
    /// Unique name; the extent map records placements by this name.
    pub name: String,
    /// NBD address `host:port`.
    pub address: String,
    /// Export to ask for; default `<client_id>@<export_size>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<String>,
    /// Size of our export on this donor; default the device size plus one
    /// extent (slot 0 holds the donor label).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export_size: Option<ByteSize>,
    /// Status endpoint `host:port` (pager-server `status=`). Without one
    /// the donor counts as idle with unknown capacity (equal weights).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// TLS pre-shared key file; TLS is required when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_psk_file: Option<PathBuf>,
    /// TLS user name for the PSK (default: `client_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_username: Option<String>,
}

impl DonorConfig {
    pub fn new(name: impl Into<String>, address: impl Into<String>) -> Self {
        DonorConfig {
            name: name.into(),
            address: address.into(),
            export: None,
            export_size: None,
            status: None,
            tls_psk_file: None,
            tls_username: None,
        }
    }

    pub fn with_status(mut self, status: impl Into<String>) -> Self {
        self.status = Some(status.into());
        self
    }

    pub fn with_export(mut self, export: impl Into<String>) -> Self {
        self.export = Some(export.into());
        self
    }

    /// The donor a spec names (`attach --donor`, `donor-add`, the donors
    /// file), with TLS when a lab key is given.
    pub fn from_spec(spec: &netpager_membership::DonorSpec, psk: Option<&Path>) -> Self {
        let mut d = DonorConfig::new(spec.name.clone(), spec.addr.clone());
        d.export = spec.export.clone();
        d.status = spec.status.clone();
        if let Some(p) = psk {
            d = d.with_tls(p, None);
        }
        d
    }

    pub fn with_tls(mut self, psk_file: impl Into<PathBuf>, username: Option<String>) -> Self {
        self.tls_psk_file = Some(psk_file.into());
        self.tls_username = username;
        self
    }
}

/// Donor selection (DESIGN.md §2.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Load-balancing rate b in [0, 1]: f_i = b·w_i + (1-b)·a_i.
    #[serde(default = "default_b")]
    pub b: f64,
    /// The x of "age of the x-th oldest page" the donors are expected to
    /// use (their `age-x=`); a donor reporting another x is logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_x: Option<u64>,
    /// Epoch: how often donors' status is polled and frequencies recomputed.
    #[serde(default = "default_epoch_ms")]
    pub epoch_ms: u64,
    /// S, mean service time of one request in microseconds; default the
    /// donors' reported `mean_service_us`, or 100 us.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_time_us: Option<f64>,
    /// N_g, number of clients sharing the donors.
    #[serde(default = "default_n_clients")]
    pub n_clients: u32,
    /// Borrow donors' unused capacity U_e (§3.6.2).
    #[serde(default)]
    pub borrowing: bool,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            b: default_b(),
            age_x: None,
            epoch_ms: default_epoch_ms(),
            service_time_us: None,
            n_clients: default_n_clients(),
            borrowing: false,
        }
    }
}

/// Timeouts towards donors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutConfig {
    /// Connect plus NBD negotiation, milliseconds.
    #[serde(default = "default_connect_ms")]
    pub connect_ms: u64,
    /// One request; a donor not answering in time is marked failed.
    #[serde(default = "default_request_ms")]
    pub request_ms: u64,
    /// How long a request's waiter looks for the donor's reply before it
    /// sleeps, microseconds (0: sleep at once). A reply usually comes in
    /// tens of microseconds, and waking a sleeping thread costs about as
    /// much again; at most one thread spins at a time.
    #[serde(default = "default_spin_us")]
    pub spin_us: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            connect_ms: default_connect_ms(),
            request_ms: default_request_ms(),
            spin_us: default_spin_us(),
        }
    }
}

/// Local file or block device used when no donor can take an extent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackConfig {
    pub path: PathBuf,
    /// Bytes of it to use (a multiple of the extent size).
    pub size: ByteSize,
}

/// Where the serving process publishes Prometheus metrics (`/metrics`
/// over HTTP); the access rule is the donors' (pagerctl(1), Monitoring).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// `ADDR:PORT`.
    pub listen: String,
    /// The lab's TLS-PSK file: scrapes must carry its bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psk: Option<PathBuf>,
    /// Serve a network address without a key.
    #[serde(default)]
    pub insecure: bool,
}

/// Everything the device needs; see `device.toml` in the state directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// This client's name; names its exports on donors and its TLS user.
    pub client_id: String,
    /// This device's own name, made when it is first attached: its export
    /// on a donor is `CLIENT/DEVICE`, so two devices of one client (two
    /// state directories on one host, or two hosts with one client id)
    /// never share one. Devices attached before it existed have none and
    /// keep the export `CLIENT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
    /// Device size in bytes (a multiple of 4 KiB).
    pub size: ByteSize,
    /// Unit of placement: a power of two, a multiple of 4 KiB (default 1 MiB).
    #[serde(default = "default_extent")]
    pub extent_size: ByteSize,
    /// Connections kept to each donor (requests in flight per donor).
    #[serde(default = "default_connections")]
    pub connections_per_donor: u32,
    /// Extent-sized I/O buffers preallocated for parity, rebuild and drain.
    #[serde(default = "default_io_buffers")]
    pub io_buffers: u32,
    /// Lock the serving process in RAM (mlockall) so swap-out never waits
    /// on swap-in of the pager itself.
    #[serde(default = "default_true")]
    pub mlock: bool,
    pub mode: Mode,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub timeouts: TimeoutConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<FallbackConfig>,
    /// Modes parity and ec: how much data the parity log may hold (default: the
    /// device's size; 0 turns it off). Small writes go to the log as whole
    /// new stripes instead of read-modify-write of their group (DESIGN.md
    /// §2.2, parity logging).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parity_log: Option<ByteSize>,
    /// Modes parity and ec: how long a group stays marked open in the
    /// map's journal after its last write at home (its write intent,
    /// DESIGN.md §2.2). Longer: fewer journal syncs on the write path;
    /// shorter: fewer groups to resync after a crash.
    #[serde(default = "default_write_intent_quiet_ms")]
    pub write_intent_quiet_ms: u64,
    /// Modes parity and ec: after this long with no request the parity
    /// log's pages are moved home and its units freed, so an idle device
    /// holds (K + R) / K donor bytes per byte; 0 keeps them in the log
    /// until the cleaner needs room.
    #[serde(default = "default_log_idle_ms")]
    pub parity_log_idle_ms: u64,
    /// Pages read ahead when the device's reads follow a stride (Leap's
    /// majority vote, `crate::readahead`), into a locked cache of eight
    /// times as many pages; 0 (the default) turns it off.
    #[serde(default)]
    pub prefetch_pages: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<MetricsConfig>,
    /// The lab's TLS-PSK file: donors that join at run time (donor-add,
    /// the donors file, discovery) are reached with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lab_key: Option<PathBuf>,
    /// A file of donor specs, one a line, re-read every epoch: a line added
    /// joins the set, a line removed leaves it (drained first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub donors_file: Option<PathBuf>,
    /// Add donors announced on the lab's network (DNS-SD, `_netpager._tcp`)
    /// once their status verifies with `lab_key`; without a key, only on
    /// loopback and the `trust_network`s unless `discover_insecure`.
    #[serde(default)]
    pub discover: bool,
    /// Use announced donors without a lab key to verify them, anywhere.
    #[serde(default)]
    pub discover_insecure: bool,
    /// Networks (`ADDR/BITS`) whose announced donors are used without a
    /// lab key, besides loopback: only a network where nobody but the
    /// lab's own machines can announce (none by default).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trust_network: Vec<netpager_membership::discovery::Network>,
    /// DNS domains browsed for `_netpager._tcp.DOMAIN` (wide-area DNS-SD,
    /// across routers); admission as for `discover`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub discover_domain: Vec<String>,
    /// The DNS server asked for `discover_domain` (`ADDR[:PORT]`; default
    /// the system resolver's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_server: Option<String>,
    /// The export asked for on discovered donors (`NAME[@SIZE]`, default
    /// the client id): a donor with `export-secret=` opens only
    /// `CLIENT~TOKEN`, and an announcement cannot carry the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discover_export: Option<String>,
    /// A donor dead this long is forgotten once nothing depends on it
    /// (0: never).
    #[serde(default = "default_forget_after_ms")]
    pub forget_after_ms: u64,
    /// How long requests wait for a donor that stopped answering before
    /// its copies are declared lost, where failing it would lose data
    /// (mode none, or a copy that is the last one left): a donor back
    /// within it loses nothing. 0: no waiting.
    #[serde(default = "default_grace_ms")]
    pub grace_ms: u64,
    /// Bytes a second the rebalancer may move so each donor's share of
    /// the device follows its selection frequency (memory follows
    /// idleness, DESIGN.md §2.3a); 0 turns it off.
    #[serde(default = "default_rebalance_rate")]
    pub rebalance_rate: ByteSize,
    /// The rebalancer's rate while the device serves requests (at most
    /// `rebalance_rate`): moves then cost the job that swaps, so they slow
    /// down, as md's resync drops to its minimum speed while the array has
    /// other I/O. 0: it moves only while the device is idle.
    #[serde(default = "default_rebalance_busy_rate")]
    pub rebalance_busy_rate: ByteSize,
    /// An extent accessed within this many epochs is hot: the rebalancer
    /// moves it only off a donor above its load bound. 0: every extent
    /// may move, accessed or not.
    #[serde(default = "default_rebalance_hot_epochs")]
    pub rebalance_hot_epochs: u32,
    /// The donors that join at attach; the set then changes at run time
    /// (donor-add, donor-remove, the donors file), kept in the map's journal.
    pub donors: Vec<DonorConfig>,
}

/// Data one extent holds in replica modes, and one full stripe's data in
/// modes parity and ec.
const STRIPE_DATA: u64 = 1 << 20;
/// Below this, per-extent work outweighs what smaller stripes save.
const MIN_PARITY_EXTENT: u64 = 64 << 10;

/// What `device.toml` means when it names no extent size (files written
/// before the default depended on the mode).
fn default_extent() -> ByteSize {
    ByteSize(STRIPE_DATA)
}

/// The extent size a new device of `mode` gets: 1 MiB; in modes parity and
/// ec the largest power of two that keeps a full stripe (`width - 1`, or
/// `data`, data extents) within 1 MiB (ec 4+2: 256 KiB), but at least 64 KiB (widths over 17). A 1 MiB
/// aligned write is then one full-stripe write without reads whenever
/// `width - 1` is a power of two; with 1 MiB extents a width-3 stripe is
/// 2 MiB and every 1 MiB write is a read-modify-write (1 MiB writes at
/// width 3: 0.50x of mode none with 1 MiB extents, 0.83x with 512 KiB).
pub fn default_extent_size(mode: &Mode) -> ByteSize {
    let r = mode.redundancy();
    if r.striped() {
        stripe_extent(r.data_members() as u32)
    } else {
        default_extent()
    }
}
fn stripe_extent(data: u32) -> ByteSize {
    let per = STRIPE_DATA / u64::from(data.max(1));
    ByteSize((1u64 << per.ilog2()).max(MIN_PARITY_EXTENT))
}

/// A new device's id: 16 hex digits, unique in practice.
pub fn new_device_id() -> String {
    format!("{:016x}", netpager_util::random_u128() as u64)
}

fn default_queue() -> ByteSize {
    ByteSize(16 << 20)
}
fn default_connections() -> u32 {
    4
}
fn default_io_buffers() -> u32 {
    8
}
fn default_write_intent_quiet_ms() -> u64 {
    5000
}
fn default_log_idle_ms() -> u64 {
    5000
}
fn default_true() -> bool {
    true
}
fn default_b() -> f64 {
    policy::DEFAULT_B
}
fn default_epoch_ms() -> u64 {
    defaults::EPOCH_MS
}
fn default_n_clients() -> u32 {
    1
}
fn default_connect_ms() -> u64 {
    defaults::CONNECT_TIMEOUT_MS
}
fn default_spin_us() -> u64 {
    50
}
fn default_forget_after_ms() -> u64 {
    defaults::FORGET_AFTER_MS
}
fn default_grace_ms() -> u64 {
    30_000
}
/// A few MiB/s: a 1 MiB member every quarter second, small against a
/// loopback donor's GiB/s and a 1 Gbit/s link's 119 MiB/s, and enough for
/// a newly idle donor to take its share of a GiB device in minutes.
pub const DEFAULT_REBALANCE_RATE: u64 = 4 << 20;
fn default_rebalance_rate() -> ByteSize {
    ByteSize(DEFAULT_REBALANCE_RATE)
}
/// A quarter of the default rate: a swap job with a donor joining took
/// 1.19x as long with the rebalancer at 4 MiB/s as with it off.
pub const DEFAULT_REBALANCE_BUSY_RATE: u64 = 1 << 20;
fn default_rebalance_busy_rate() -> ByteSize {
    ByteSize(DEFAULT_REBALANCE_BUSY_RATE)
}
fn default_rebalance_hot_epochs() -> u32 {
    crate::policy::rebalance::DEFAULT_HOT_EPOCHS
}
fn default_request_ms() -> u64 {
    defaults::REQUEST_TIMEOUT_MS
}

/// Configuration errors, naming the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{where_}field `{field}`: {reason}")]
    Invalid {
        where_: String,
        field: String,
        reason: String,
    },
    #[error("cannot encode the configuration: {0}")]
    Encode(String),
}

impl DeviceConfig {
    /// A configuration with defaults for everything but these and no donors.
    pub fn new(client_id: impl Into<String>, size: u64, mode: Mode) -> Self {
        DeviceConfig {
            client_id: client_id.into(),
            device_id: Some(new_device_id()),
            size: ByteSize(size),
            extent_size: default_extent_size(&mode),
            connections_per_donor: default_connections(),
            io_buffers: default_io_buffers(),
            mlock: true,
            mode,
            policy: PolicyConfig::default(),
            timeouts: TimeoutConfig::default(),
            fallback: None,
            parity_log: None,
            write_intent_quiet_ms: default_write_intent_quiet_ms(),
            parity_log_idle_ms: default_log_idle_ms(),
            prefetch_pages: 0,
            metrics: None,
            lab_key: None,
            donors_file: None,
            discover: false,
            discover_insecure: false,
            trust_network: Vec::new(),
            discover_domain: Vec::new(),
            dns_server: None,
            discover_export: None,
            forget_after_ms: default_forget_after_ms(),
            grace_ms: default_grace_ms(),
            rebalance_rate: default_rebalance_rate(),
            rebalance_busy_rate: default_rebalance_busy_rate(),
            rebalance_hot_epochs: default_rebalance_hot_epochs(),
            donors: Vec::new(),
        }
    }

    pub fn with_donor(mut self, d: DonorConfig) -> Self {
        self.donors.push(d);
        self
    }

    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<DeviceConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let cfg: DeviceConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        cfg.check(&format!("{}: ", path.display()))?;
        Ok(cfg)
    }

    /// Reads `DIR/device.toml`.
    pub fn load_from_state_dir(dir: &Path) -> Result<DeviceConfig, ConfigError> {
        Self::load(&dir.join(FILE_NAME))
    }

    /// Validates and writes atomically (temporary file, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<(), ConfigError> {
        self.check(&format!("{}: ", path.display()))?;
        let text = toml::to_string_pretty(self).map_err(|e| ConfigError::Encode(e.to_string()))?;
        let werr = |source| ConfigError::Write {
            path: path.to_path_buf(),
            source,
        };
        let tmp = path.with_extension("toml.tmp");
        let mut f = std::fs::File::create(&tmp).map_err(werr)?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(werr)?;
        std::fs::rename(&tmp, path).map_err(werr)
    }

    /// The lab key for donors that join at run time: `lab_key`, else the
    /// key of the donors named at attach (files written before `lab_key`).
    pub fn lab_key(&self) -> Option<PathBuf> {
        self.lab_key
            .clone()
            .or_else(|| self.donors.iter().find_map(|d| d.tls_psk_file.clone()))
    }

    /// Bytes of data the parity log may hold (0: no log).
    pub fn parity_log_bytes(&self) -> u64 {
        if self.mode.striped() {
            self.parity_log.map_or(self.size.0, |b| b.0)
        } else {
            0
        }
    }

    /// Extents in the device.
    pub fn extents(&self) -> u64 {
        self.size.0.div_ceil(self.extent_size.0)
    }

    /// Our export size on donor `d`.
    pub fn export_size(&self, d: &DonorConfig) -> u64 {
        d.export_size
            .map(|s| s.0)
            .unwrap_or((self.extents() + 1) * self.extent_size.0)
    }

    /// Our export name on donor `d` in session `session` of the device:
    /// `BASE/DEVICE:SESSION@SIZE`, where BASE is the donor's configured
    /// export (a client's token, `CLIENT~TOKEN`, goes there) or the
    /// client id, and `@SIZE` comes from the configured export or, without
    /// one, the export size. The donor keeps the pages under `BASE/DEVICE`
    /// (less the token) and refuses requests of sessions older than the
    /// newest it has seen. A device without an id asks for `BASE@SIZE`.
    pub fn export_name(&self, d: &DonorConfig, session: u64) -> String {
        let (base, size) = match &d.export {
            Some(e) => match e.split_once('@') {
                Some((b, s)) => (b.to_string(), Some(s.to_string())),
                None => (e.clone(), None),
            },
            None => (
                self.client_id.clone(),
                Some(self.export_size(d).to_string()),
            ),
        };
        let mut name = base;
        if let Some(dev) = &self.device_id {
            name = format!("{name}/{dev}:{session}");
        }
        if let Some(s) = size {
            name = format!("{name}@{s}");
        }
        name
    }

    /// The name donor `d` lists our pages under in its status: the export
    /// without its token, session and size.
    pub fn store_name(&self, d: &DonorConfig) -> String {
        let base = d.export.as_deref().map_or(self.client_id.as_str(), |e| {
            e.split('@').next().unwrap_or(e)
        });
        let client = base.split('~').next().unwrap_or(base);
        let client = if client.is_empty() { "default" } else { client };
        match &self.device_id {
            Some(dev) => format!("{client}/{dev}"),
            None => client.to_string(),
        }
    }

    /// How to reach donor `d` in session `session`.
    pub fn endpoint(&self, d: &DonorConfig, session: u64) -> Endpoint {
        let HostPort { host, port } = HostPort::parse(&d.address).unwrap_or_else(|_| HostPort {
            host: d.address.clone(),
            port: 0,
        });
        Endpoint {
            host,
            port,
            export: self.export_name(d, session),
            tls_psk_file: d.tls_psk_file.clone(),
            tls_username: d.tls_psk_file.as_ref().map(|_| {
                d.tls_username
                    .clone()
                    .unwrap_or_else(|| self.client_id.clone())
            }),
        }
    }

    pub fn nbd_timeouts(&self) -> Timeouts {
        Timeouts {
            connect: Duration::from_millis(self.timeouts.connect_ms),
            request: Duration::from_millis(self.timeouts.request_ms),
            spin: Duration::from_micros(self.timeouts.spin_us),
        }
    }
}
