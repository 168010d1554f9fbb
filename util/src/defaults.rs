//! The defaults an admin meets in more than one place (ports, paths,
//! identities, timeouts), each defined once. The code takes them from here,
//! and `pagerctl/tests/defaults.rs` checks the README, the man pages, the
//! packaged configuration and Ansible's defaults against them.

/// A donor's NBD port (nbdkit `--port`; NBD's registered port).
pub const NBD_PORT: u16 = 10809;
/// A donor's status endpoint (pager-server `status=ADDR:PORT`).
pub const STATUS_PORT: u16 = 10810;
/// A donor's `/metrics` (pager-server `metrics=ADDR:PORT`).
pub const DONOR_METRICS_PORT: u16 = 10811;
/// A client's `/metrics` (`pagerctl attach --metrics ADDR:PORT`).
pub const CLIENT_METRICS_PORT: u16 = 10812;
/// prefetchd's `/metrics` (`prefetchd serve --metrics ADDR:PORT`).
pub const PREFETCHD_METRICS_PORT: u16 = 10813;

/// The configuration directory of the packages and of Ansible.
pub const ETC_DIR: &str = "/etc/netpager";
/// The lab key: TLS-PSK lines `IDENTITY:HEXKEY`, one key for every line.
pub const LAB_KEY_FILE: &str = "/etc/netpager/netpager.psk";
/// The export secret (donors only): one hex line.
pub const EXPORT_SECRET_FILE: &str = "/etc/netpager/export.secret";
/// Where clients keep their state directories.
pub const STATE_ROOT: &str = "/var/lib/netpager";
/// The lab key file's first identity: donors sign status replies with its
/// key, clients sign requests with it.
pub const LAB_KEY_IDENTITY: &str = "netpager";

/// Connecting to a donor and negotiating NBD, milliseconds.
pub const CONNECT_TIMEOUT_MS: u64 = 3000;
/// One request to a donor: slower marks it failed, milliseconds.
pub const REQUEST_TIMEOUT_MS: u64 = 5000;
/// How often a client polls its donors' status, milliseconds.
pub const EPOCH_MS: u64 = 5000;
/// A donor dead this long is forgotten, milliseconds (0: never).
pub const FORGET_AFTER_MS: u64 = 10 * 60 * 1000;
/// One status request (`pagerctl donor-status`, `donor-drain`), seconds.
pub const STATUS_TIMEOUT_SECS: u64 = 5;
/// How long removing the donor package waits for a drain, seconds.
pub const DRAIN_TIMEOUT_SECS: u64 = 600;
