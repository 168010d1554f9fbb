//! The device configuration `pagerctl attach` writes, built from its
//! options, and the check that a re-attach asks for the same device.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{AttachError, DonorSpec};
use pager_client::config::{
    ByteSize, DeviceConfig, DonorConfig, FallbackConfig, MetricsConfig, Mode,
};

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeChoice {
    None,
    Mirror,
    Parity,
    Disk,
    Ec,
}

impl std::str::FromStr for ModeChoice {
    type Err = AttachError;
    fn from_str(s: &str) -> Result<Self, AttachError> {
        match s {
            "none" => Ok(ModeChoice::None),
            "mirror" => Ok(ModeChoice::Mirror),
            "parity" => Ok(ModeChoice::Parity),
            "disk" => Ok(ModeChoice::Disk),
            "ec" => Ok(ModeChoice::Ec),
            _ => Err(AttachError::BadOption {
                option: "--mode",
                reason: format!("{s:?}: expected none, mirror, parity, ec or disk"),
            }),
        }
    }
}

/// Parity width when `--parity-width` is not given: the narrowest group,
/// which leaves the most donors free to rebuild onto after a failure.
pub const DEFAULT_PARITY_WIDTH: u32 = 3;
/// Mode ec's code when `--data`/`--parity` are not given: Hydra's 4+2,
/// two failures survived for 1.5x memory.
pub const DEFAULT_EC: (u32, u32) = (4, 2);

/// The options of `pagerctl attach` that shape the device. `None` (or no
/// donors) means "not given": a new device takes the default, a re-attach
/// keeps what the state directory holds.
#[derive(Debug, Clone, Default)]
pub struct DeviceOptions {
    pub client_id: Option<String>,
    pub size: Option<u64>,
    pub mode: Option<ModeChoice>,
    pub parity_width: Option<u32>,
    /// Mode ec: data and parity extents per stripe.
    pub ec_data: Option<u32>,
    pub ec_parity: Option<u32>,
    /// Bytes of parity log (mode parity; 0 turns it off).
    pub parity_log: Option<u64>,
    /// Write-through file of mode disk (default `STATE_DIR/writethrough.img`).
    pub disk_file: Option<PathBuf>,
    pub donors: Vec<DonorSpec>,
    pub extent_size: Option<u64>,
    pub b: Option<f64>,
    pub epoch: Option<Duration>,
    pub fallback: Option<(PathBuf, u64)>,
    pub psk: Option<PathBuf>,
    /// `ADDR:PORT` of the metrics endpoint, keyed with `psk` when given.
    pub metrics: Option<String>,
    pub metrics_insecure: bool,
    pub connect_timeout: Option<Duration>,
    pub request_timeout: Option<Duration>,
    /// Microseconds a request's waiter spins for the donor's reply.
    pub spin_us: Option<u64>,
    /// A file of donor specs the device's set follows while attached.
    pub donors_file: Option<PathBuf>,
    /// How long a dead donor stays in the set (0: for ever).
    pub forget_after: Option<Duration>,
    pub grace: Option<Duration>,
    /// Bytes a second the rebalancer may move (0: off).
    pub rebalance_rate: Option<u64>,
    /// Its rate while the device serves requests.
    pub rebalance_busy_rate: Option<u64>,
    /// Epochs since its last access an extent stays hot to the rebalancer.
    pub rebalance_hot_epochs: Option<u32>,
    /// Add donors announced on the lab's network (verified with `psk`).
    pub discover: bool,
    /// With `discover`: use announced donors without a key, anywhere.
    pub insecure: bool,
    /// With `discover`: networks whose announced donors need no key.
    pub trust_network: Vec<netpager_membership::discovery::Network>,
    /// DNS domains browsed for announced donors, and the server asked.
    pub discover_domain: Vec<String>,
    pub dns_server: Option<String>,
    /// The export asked for on discovered donors (`CLIENT~TOKEN`).
    pub discover_export: Option<String>,
    /// Pages the stride prefetcher reads ahead (0: off).
    pub prefetch_pages: Option<u32>,
}

impl ModeChoice {
    fn of(mode: &Mode) -> ModeChoice {
        match mode {
            Mode::None => ModeChoice::None,
            Mode::Mirror => ModeChoice::Mirror,
            Mode::Parity { .. } => ModeChoice::Parity,
            Mode::Disk { .. } => ModeChoice::Disk,
            Mode::Ec { .. } => ModeChoice::Ec,
        }
    }
}

fn bad(option: &'static str, reason: &str) -> AttachError {
    AttachError::BadOption {
        option,
        reason: reason.into(),
    }
}

/// Builds and validates the configuration of a new device.
pub fn build_config(o: &DeviceOptions, state_dir: &Path) -> Result<DeviceConfig, AttachError> {
    let no_donors = o.donors.is_empty()
        && o.donors_file.is_none()
        && !o.discover
        && o.discover_domain.is_empty();
    let (Some(id), Some(size), Some(choice), false) = (&o.client_id, o.size, o.mode, no_donors)
    else {
        let missing: Vec<&str> = [
            ("--client-id", o.client_id.is_none()),
            ("--size", o.size.is_none()),
            ("--mode", o.mode.is_none()),
            (
                "--donor, --donors-file, --discover or --discover-domain",
                no_donors,
            ),
        ]
        .iter()
        .filter(|(_, m)| *m)
        .map(|(name, _)| *name)
        .collect();
        return Err(AttachError::Missing(missing.join(", ")));
    };
    let mut base = DeviceConfig::new(id.clone(), size, mode_of(choice, o, None, state_dir)?);
    base.lab_key = o.psk.clone();
    let c = apply_options(&base, o, state_dir)?;
    c.validate().map_err(AttachError::Config)?;
    Ok(c)
}

/// `old` with the options that were given put over it: the device a
/// re-attach asks for. Compare it with [`differences`]; it is not validated,
/// since only an identical device is reused.
pub fn apply_options(
    old: &DeviceConfig,
    o: &DeviceOptions,
    state_dir: &Path,
) -> Result<DeviceConfig, AttachError> {
    let mut c = old.clone();
    c.mode = mode_of(
        o.mode.unwrap_or_else(|| ModeChoice::of(&old.mode)),
        o,
        Some(&old.mode),
        state_dir,
    )?;
    if o.parity_log.is_some() && !c.mode.striped() {
        return Err(bad("--parity-log", "only applies to --mode parity or ec"));
    }
    if let Some(id) = &o.client_id {
        c.client_id = id.clone();
    }
    if let Some(s) = o.size {
        c.size = ByteSize(s);
    }
    if let Some(l) = o.parity_log {
        c.parity_log = Some(ByteSize(l));
    }
    if let Some(e) = o.extent_size {
        c.extent_size = ByteSize(e);
    }
    if let Some(b) = o.b {
        c.policy.b = b;
    }
    if let Some(e) = o.epoch {
        c.policy.epoch_ms = e.as_millis() as u64;
    }
    if let Some(t) = o.connect_timeout {
        c.timeouts.connect_ms = t.as_millis() as u64;
    }
    if let Some(t) = o.request_timeout {
        c.timeouts.request_ms = t.as_millis() as u64;
    }
    if let Some(us) = o.spin_us {
        c.timeouts.spin_us = us;
    }
    if let Some(f) = &o.donors_file {
        c.donors_file = Some(f.clone());
    }
    if let Some(t) = o.forget_after {
        c.forget_after_ms = t.as_millis() as u64;
    }
    if let Some(t) = o.grace {
        c.grace_ms = t.as_millis() as u64;
    }
    if let Some(r) = o.rebalance_rate {
        c.rebalance_rate = ByteSize(r);
    }
    if let Some(r) = o.rebalance_busy_rate {
        c.rebalance_busy_rate = ByteSize(r);
    }
    if let Some(h) = o.rebalance_hot_epochs {
        c.rebalance_hot_epochs = h;
    }
    if o.discover || !o.discover_domain.is_empty() {
        c.discover = o.discover;
        c.discover_insecure = o.insecure;
        c.trust_network.clone_from(&o.trust_network);
        c.discover_domain.clone_from(&o.discover_domain);
        c.dns_server.clone_from(&o.dns_server);
        c.discover_export.clone_from(&o.discover_export);
    }
    if let Some(n) = o.prefetch_pages {
        c.prefetch_pages = n;
    }
    if let Some((path, size)) = &o.fallback {
        c.fallback = Some(FallbackConfig {
            path: path.clone(),
            size: ByteSize(*size),
        });
    }
    if let Some(listen) = &o.metrics {
        c.metrics = Some(MetricsConfig {
            listen: listen.clone(),
            psk: o.psk.clone(),
            insecure: o.metrics_insecure,
        });
    }
    // A key given alone applies to the donors held; donors given alone keep
    // the key they had.
    let psk = o
        .psk
        .clone()
        .or_else(|| old.donors.first().and_then(|d| d.tls_psk_file.clone()));
    if !o.donors.is_empty() {
        c.donors = o
            .donors
            .iter()
            .map(|d| DonorConfig::from_spec(d, psk.as_deref()))
            .collect();
    } else if let Some(p) = &o.psk {
        c.donors = old
            .donors
            .iter()
            .map(|d| d.clone().with_tls(p, d.tls_username.clone()))
            .collect();
    }
    Ok(c)
}

/// The mode `choice` names, its details taken from the options, else from
/// the device's `old` mode of the same kind, else the defaults.
fn mode_of(
    choice: ModeChoice,
    o: &DeviceOptions,
    old: Option<&Mode>,
    state_dir: &Path,
) -> Result<Mode, AttachError> {
    if o.parity_width.is_some() && choice != ModeChoice::Parity {
        return Err(bad("--parity-width", "only applies to --mode parity"));
    }
    if (o.ec_data.is_some() || o.ec_parity.is_some()) && choice != ModeChoice::Ec {
        return Err(bad("--data/--parity", "only apply to --mode ec"));
    }
    if o.disk_file.is_some() && choice != ModeChoice::Disk {
        return Err(bad("--disk-file", "only applies to --mode disk"));
    }
    Ok(match (choice, old) {
        (ModeChoice::None, _) => Mode::None,
        (ModeChoice::Mirror, _) => Mode::Mirror,
        (ModeChoice::Parity, old) => Mode::Parity {
            width: o.parity_width.unwrap_or(match old {
                Some(Mode::Parity { width }) => *width,
                _ => DEFAULT_PARITY_WIDTH,
            }),
        },
        (ModeChoice::Ec, old) => {
            let (data, parity) = match old {
                Some(Mode::Ec { data, parity }) => (*data, *parity),
                _ => DEFAULT_EC,
            };
            Mode::Ec {
                data: o.ec_data.unwrap_or(data),
                parity: o.ec_parity.unwrap_or(parity),
            }
        }
        (ModeChoice::Disk, Some(Mode::Disk { path, queue })) => Mode::Disk {
            path: o.disk_file.clone().unwrap_or_else(|| path.clone()),
            queue: *queue,
        },
        (ModeChoice::Disk, _) => Mode::Disk {
            path: o
                .disk_file
                .clone()
                .unwrap_or_else(|| state_dir.join("writethrough.img")),
            queue: ByteSize(16 << 20),
        },
    })
}

/// The top-level fields (`policy.b` style for nested ones) in which two
/// configurations differ, so a re-attach that asks for another device than
/// the state directory holds is refused by name.
pub fn differences(old: &DeviceConfig, new: &DeviceConfig) -> Vec<String> {
    let a = serde_json::to_value(old).expect("config serialises");
    let b = serde_json::to_value(new).expect("config serialises");
    let mut out = Vec::new();
    diff("", &a, &b, &mut out);
    out
}

fn diff(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value::Object;
    match (a, b) {
        (Object(x), Object(y))
            if prefix.is_empty() || prefix == "policy" || prefix == "timeouts" =>
        {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let null = serde_json::Value::Null;
                let name = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                diff(
                    &name,
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    out,
                );
            }
        }
        _ if a != b => out.push(prefix.to_string()),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(mode: ModeChoice) -> DeviceOptions {
        DeviceOptions {
            client_id: Some("busy1".into()),
            size: Some(64 << 20),
            mode: Some(mode),
            donors: [
                "127.0.0.2:10809,status=127.0.0.2:7000",
                "127.0.0.3:10809",
                "127.0.0.4:10809/x@80M",
            ]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect(),
            ..DeviceOptions::default()
        }
    }

    #[test]
    fn modes_map_to_the_device_config() {
        let st = Path::new("/st");
        assert_eq!(
            build_config(&opts(ModeChoice::None), st).unwrap().mode,
            Mode::None
        );
        assert_eq!(
            build_config(&opts(ModeChoice::Mirror), st).unwrap().mode,
            Mode::Mirror
        );
        assert_eq!(
            build_config(&opts(ModeChoice::Parity), st).unwrap().mode,
            Mode::Parity {
                width: DEFAULT_PARITY_WIDTH
            }
        );
        assert_eq!(
            build_config(&opts(ModeChoice::Disk), st).unwrap().mode,
            Mode::Disk {
                path: "/st/writethrough.img".into(),
                queue: ByteSize(16 << 20)
            }
        );
    }

    #[test]
    fn options_land_in_their_fields() {
        let mut o = opts(ModeChoice::Parity);
        o.parity_width = Some(3);
        o.extent_size = Some(4 << 20);
        o.b = Some(0.25);
        o.epoch = Some(Duration::from_secs(2));
        o.request_timeout = Some(Duration::from_millis(1500));
        o.fallback = Some(("/var/tmp/fb".into(), 16 << 20));
        o.psk = Some("/etc/np.psk".into());
        let c = build_config(&o, Path::new("/st")).unwrap();
        assert_eq!(c.extent_size.0, 4 << 20);
        assert_eq!(c.policy.b, 0.25);
        assert_eq!(c.policy.epoch_ms, 2000);
        assert_eq!(c.timeouts.request_ms, 1500);
        assert_eq!(c.fallback.as_ref().unwrap().size.0, 16 << 20);
        assert_eq!(c.donors[0].status.as_deref(), Some("127.0.0.2:7000"));
        assert_eq!(c.donors[2].export.as_deref(), Some("x@80M"));
        assert_eq!(c.donors[2].name, "127.0.0.4:10809/x@80M");
        assert!(c
            .donors
            .iter()
            .all(|d| d.tls_psk_file.as_deref() == Some(Path::new("/etc/np.psk"))));
    }

    #[test]
    fn invalid_combinations_are_refused_by_option() {
        let mut o = opts(ModeChoice::Mirror);
        o.parity_width = Some(3);
        assert!(build_config(&o, Path::new("/st"))
            .unwrap_err()
            .to_string()
            .contains("--parity-width"));
        let mut o = opts(ModeChoice::Parity);
        o.parity_width = Some(4);
        let e = build_config(&o, Path::new("/st")).unwrap_err().to_string();
        assert!(e.contains("width 4 needs at least 4"), "{e}");
        let mut o = opts(ModeChoice::None);
        o.b = Some(1.5);
        assert!(build_config(&o, Path::new("/st"))
            .unwrap_err()
            .to_string()
            .contains("policy.b"));
    }

    #[test]
    fn differences_name_the_fields() {
        let st = Path::new("/st");
        let a = build_config(&opts(ModeChoice::Mirror), st).unwrap();
        assert!(differences(&a, &a.clone()).is_empty());
        let mut o = opts(ModeChoice::Parity);
        o.size = Some(128 << 20);
        o.b = Some(0.3);
        let b = build_config(&o, st).unwrap();
        // Parity's default extent is smaller than mirror's; each new
        // device has an id of its own.
        assert_eq!(
            differences(&a, &b),
            ["device_id", "extent_size", "mode", "policy.b", "size"]
        );
    }

    #[test]
    fn a_new_device_names_the_options_it_lacks() {
        let o = DeviceOptions {
            size: Some(1 << 30),
            ..DeviceOptions::default()
        };
        let e = build_config(&o, Path::new("/st")).unwrap_err().to_string();
        assert_eq!(
            e,
            "a new device needs --client-id, --mode, --donor, --donors-file, --discover or --discover-domain"
        );
    }

    #[test]
    fn a_reattach_compares_only_the_options_given() {
        let st = Path::new("/st");
        let mut o = opts(ModeChoice::Parity);
        o.parity_width = Some(3);
        o.parity_log = Some(8 << 20);
        o.b = Some(0.25);
        o.psk = Some("/etc/np.psk".into());
        let held = build_config(&o, st).unwrap();
        let again = |o: &DeviceOptions| differences(&held, &apply_options(&held, o, st).unwrap());
        assert!(again(&DeviceOptions::default()).is_empty());
        // The parity width, log, key and policy are the device's own.
        assert!(again(&opts(ModeChoice::Parity)).is_empty());
        let mut size_only = DeviceOptions {
            size: Some(64 << 20),
            ..DeviceOptions::default()
        };
        assert!(again(&size_only).is_empty());
        size_only.size = Some(32 << 20);
        assert_eq!(again(&size_only), ["size"]);
        let width = DeviceOptions {
            parity_width: Some(4),
            ..DeviceOptions::default()
        };
        assert_eq!(again(&width), ["mode"]);
        let log = DeviceOptions {
            parity_log: Some(0),
            ..DeviceOptions::default()
        };
        assert_eq!(again(&log), ["parity_log"]);
        let key = DeviceOptions {
            psk: Some("/etc/other.psk".into()),
            ..DeviceOptions::default()
        };
        assert_eq!(again(&key), ["donors"]);
        assert_eq!(again(&opts(ModeChoice::Mirror)), ["mode"]);
    }

    #[test]
    fn ec_takes_its_code_and_a_reattach_with_another_is_refused() {
        let st = Path::new("/st");
        let mut o = opts(ModeChoice::Ec);
        let e = build_config(&o, st).unwrap_err().to_string();
        assert!(e.contains("ec 4+2 needs at least 6 distinct donors"), "{e}");
        o.donors = (2..8)
            .map(|i| format!("127.0.0.{i}:10809").parse().unwrap())
            .collect();
        let held = build_config(&o, st).unwrap();
        assert_eq!(held.mode, Mode::Ec { data: 4, parity: 2 });
        let again = |o: &DeviceOptions| differences(&held, &apply_options(&held, o, st).unwrap());
        assert!(again(&DeviceOptions::default()).is_empty());
        let code = DeviceOptions {
            ec_parity: Some(3),
            ..DeviceOptions::default()
        };
        assert_eq!(again(&code), ["mode"]);
        let mut p = opts(ModeChoice::Parity);
        p.ec_data = Some(3);
        let e = build_config(&p, st).unwrap_err().to_string();
        assert!(
            e.starts_with("--data/--parity: only apply to --mode ec"),
            "{e}"
        );
    }

    #[test]
    fn discovered_donors_are_asked_for_the_export_given() {
        let mut o = opts(ModeChoice::Mirror);
        o.discover_domain = vec!["lab.test".into()];
        o.discover_export = Some("busy1~00ff".into());
        let c = build_config(&o, Path::new("/st")).unwrap();
        assert_eq!(c.discover_export.as_deref(), Some("busy1~00ff"));
        o.discover_export = Some("busy1,x".into());
        let e = build_config(&o, Path::new("/st")).unwrap_err().to_string();
        assert!(e.contains("discover_export"), "{e}");
    }

    #[test]
    fn a_parity_log_needs_mode_parity() {
        let mut o = opts(ModeChoice::Mirror);
        o.parity_log = Some(1 << 20);
        let e = build_config(&o, Path::new("/st")).unwrap_err().to_string();
        assert!(e.starts_with("--parity-log: only applies"), "{e}");
        let mut o = opts(ModeChoice::Parity);
        o.parity_log = Some(1000);
        let e = build_config(&o, Path::new("/st")).unwrap_err().to_string();
        assert!(e.contains("parity_log"), "{e}");
    }
}
