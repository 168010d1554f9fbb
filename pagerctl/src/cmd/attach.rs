//! `pagerctl attach`: checks the options against the state directory (a
//! new device's device.toml, or the one there), picks the front end and
//! runs the attach steps (`crate::steps`); prints the block device.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use netpager_membership::discovery::{Admission, Network};
use pager_client::config::{DeviceConfig, DonorConfig};
use pager_client::probe;
use pagerctl::attach::check::{self, Checked, Verdict};
use pagerctl::attach::record::StateLayout;
use pagerctl::attach::{self, AttachRecord, DeviceOptions, DonorSpec, Frontend, ModeChoice, Via};
use pagerctl::lost;

use super::{check_size, parse_secs, parse_secs_or_zero};
use crate::{procs, steps};

/// `p` from the working directory: the serving process runs elsewhere.
fn absolute(p: &Path) -> std::io::Result<PathBuf> {
    Ok(std::env::current_dir()?.join(p))
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("discovery").multiple(true).args(["discover", "discover_domain"])))]
pub struct Args {
    /// The client's state directory: device.toml, extent map, status, socket.
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Device size (e.g. 256M, 4G). Required unless DIR already holds a device.
    #[arg(long, value_parser = netpager_util::parse_size, value_name = "SIZE")]
    size: Option<u64>,
    /// How remote pages are kept safe: none, mirror, parity, ec or disk.
    #[arg(long, value_parser = |s: &str| s.parse::<ModeChoice>().map_err(|e| e.to_string()))]
    mode: Option<ModeChoice>,
    /// Donors per parity group (N-1 data + 1 parity), default 3.
    #[arg(long, value_name = "N")]
    parity_width: Option<u32>,
    /// Mode ec: data extents per stripe (K), default 4.
    #[arg(long = "data", value_name = "K")]
    ec_data: Option<u32>,
    /// Mode ec: Reed-Solomon parity extents per stripe (R, the donor
    /// failures a stripe survives), default 2.
    #[arg(long = "parity", value_name = "R")]
    ec_parity: Option<u32>,
    /// Parity log size (modes parity and ec; default the device size, 0 turns it
    /// off): small writes go there as whole new rows instead of
    /// read-modify-writing their group.
    #[arg(long, value_parser = netpager_util::parse_size, value_name = "SIZE")]
    parity_log: Option<u64>,
    /// Write-through file of mode disk (default DIR/writethrough.img).
    #[arg(long, value_name = "PATH")]
    disk_file: Option<PathBuf>,
    /// A donor: HOST:PORT[/EXPORT][,status=HOST:PORT][,name=NAME]. Repeat.
    #[arg(long = "donor", value_name = "SPEC", value_parser = |s: &str| s.parse::<DonorSpec>().map_err(|e| e.to_string()))]
    donors: Vec<DonorSpec>,
    /// A file of donor specs, one a line (`#` comments), that the device's
    /// set follows while attached: a line added joins, a line removed
    /// leaves (its extents moved off first). Re-read every epoch.
    #[arg(long, value_name = "PATH")]
    donors_file: Option<PathBuf>,
    /// Add donors announced on the lab's network (DNS-SD, `_netpager._tcp`,
    /// as `pagerctl discover` lists them) once their status verifies with
    /// --psk; without a key only on loopback and --trust-network.
    #[arg(long)]
    discover: bool,
    /// With --discover and no --psk: a network (ADDR/BITS) whose announced
    /// donors are used unverified, besides loopback; only one where nobody
    /// but the lab's own machines can announce. Repeat.
    #[arg(long, value_name = "CIDR", requires = "discovery")]
    trust_network: Vec<Network>,
    /// With --discover: use announced donors without a lab key, on any
    /// network (anyone there can then lend this device memory).
    #[arg(long, requires = "discovery")]
    insecure: bool,
    /// Add donors published in this DNS domain (`_netpager._tcp.DOMAIN`
    /// PTR/SRV/TXT records: wide-area DNS-SD, across routers), admitted as
    /// with --discover. Repeat.
    #[arg(long, value_name = "DOMAIN")]
    discover_domain: Vec<String>,
    /// The DNS server asked for --discover-domain (default: the system
    /// resolver's).
    #[arg(long, value_name = "ADDR[:PORT]", requires = "discover_domain")]
    dns_server: Option<String>,
    /// The export asked for on discovered donors (default the client id):
    /// `CLIENT~TOKEN` where donors require export tokens (netpager-token).
    #[arg(long, value_name = "NAME[@SIZE]", requires = "discovery")]
    discover_export: Option<String>,
    /// Forget a donor dead this long (its pages already rebuilt
    /// elsewhere); 0 keeps it in the set for ever. Default 600.
    #[arg(long, value_parser = parse_secs_or_zero, value_name = "SECS")]
    forget_after: Option<Duration>,
    /// How long requests wait for a donor that stopped answering before its
    /// copies are declared lost, where failing it would lose data (mode
    /// none, or the last copy left); a donor back in time loses nothing.
    /// 0 fails it at its first timeout. Default 30.
    #[arg(long, value_parser = parse_secs_or_zero, value_name = "SECS")]
    grace: Option<Duration>,
    /// Bytes a second the rebalancer may move so that each donor's share
    /// of the device follows its selection frequency (memory follows
    /// idleness); 0 turns it off. Default 4M.
    #[arg(long, value_parser = netpager_util::parse_size, value_name = "SIZE")]
    rebalance_rate: Option<u64>,
    /// The rebalancer's rate while the device serves requests (at most
    /// --rebalance-rate); 0: it moves only while the device is idle.
    /// Default 1M.
    #[arg(long, value_parser = netpager_util::parse_size, value_name = "SIZE")]
    rebalance_busy_rate: Option<u64>,
    /// Epochs an extent stays hot after an access: the rebalancer moves a
    /// hot extent only off a donor above its load bound. 0 lets it move
    /// any extent, in use or not. Default 2.
    #[arg(long, value_name = "N")]
    rebalance_hot_epochs: Option<u32>,
    /// Unit of placement (power of two, 4K..64M; default 1M, in modes parity
    /// and ec the largest that keeps a full stripe's data within 1M).
    #[arg(long, value_parser = netpager_util::parse_size, value_name = "SIZE")]
    extent_size: Option<u64>,
    /// Load-balancing rate b in [0, 1]: f = b*w + (1-b)*a.
    #[arg(long = "b", value_name = "F")]
    b: Option<f64>,
    /// Epoch: how often donors are polled and frequencies recomputed.
    #[arg(long, value_parser = parse_secs, value_name = "SECS")]
    epoch: Option<Duration>,
    /// Local file taking extents no donor can take.
    #[arg(long, value_name = "PATH", requires = "fallback_size")]
    fallback: Option<PathBuf>,
    /// How much of the fallback file to use (a multiple of the extent size).
    #[arg(long, value_parser = netpager_util::parse_size, value_name = "SIZE", requires = "fallback")]
    fallback_size: Option<u64>,
    /// TLS pre-shared key file for every donor (TLS becomes required).
    #[arg(long, value_name = "FILE")]
    psk: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics from the
    /// serving process (keyed with --psk when given; a network address
    /// needs --psk or --metrics-insecure).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// Allow --metrics on a network address without a key.
    #[arg(long, requires = "metrics")]
    metrics_insecure: bool,
    /// This client's name on donors (default: the host name).
    #[arg(long, value_name = "ID")]
    client_id: Option<String>,
    /// Donor connect + negotiation timeout.
    #[arg(long, value_parser = parse_secs, value_name = "SECS")]
    connect_timeout: Option<Duration>,
    /// Donor request timeout: a donor that takes longer is marked failed.
    #[arg(long, value_parser = parse_secs, value_name = "SECS")]
    request_timeout: Option<Duration>,
    /// Microseconds a request waits actively for a donor's reply before it
    /// sleeps (0: sleep at once; default 50).
    #[arg(long, value_name = "US")]
    spin_us: Option<u64>,
    /// Pages read ahead when reads follow a stride (0: off, the default).
    #[arg(long, value_name = "PAGES")]
    prefetch_pages: Option<u32>,
    /// mkswap and swapon the device.
    #[arg(long)]
    swap: bool,
    /// Swap priority (higher is used first).
    #[arg(
        long,
        default_value_t = 100,
        value_name = "N",
        requires = "swap",
        allow_negative_numbers = true
    )]
    priority: i32,
    /// Swap without discard: freed swap pages stay on the donors until the
    /// kernel writes their slots again or the device is detached. By
    /// default swapon runs with `--discard=pages`, so every swap cluster
    /// the kernel frees is trimmed and the donors free its memory.
    #[arg(long, requires = "swap")]
    no_discard: bool,
    /// How the kernel reaches the device: auto, fuse-uring, fuse or nbd.
    /// auto: fuse-uring where the kernel has it, else nbd where kernel nbd
    /// exists, else fuse.
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<Frontend>().map_err(|e| e.to_string()))]
    frontend: Frontend,
    /// Threads serving the kernel (fuse: readers; fuse-uring: per CPU,
    /// the requests one CPU's queue answers at once).
    #[arg(long, default_value_t = 16, value_name = "N")]
    serve_threads: usize,
    /// The serving process's write-back buffer for swap-outs (FUSE front
    /// ends; 0: none; none with --restartable): writes acknowledged once
    /// buffered, sent to the donors in batches in the background, reads of
    /// buffered pages served from it (pagerctl(1) PERFORMANCE).
    #[arg(long, default_value = super::serve::DEFAULT_WRITEBACK, value_name = "SIZE", value_parser = check_size)]
    writeback_buffer: String,
    /// A block device's writes buffered and acknowledged once buffered, as
    /// swap's are, like a disk with a volatile write cache: a crash of the
    /// serving process loses what was not flushed (default: acknowledged
    /// once on the donors).
    #[arg(long)]
    writeback_ack_early: bool,
    /// Keep the device's FUSE connection (or kernel nbd device) in a
    /// holder process, so that the serving process can crash (it is
    /// restarted at once) or be replaced (pagerctl restart) while swap
    /// stays on. Classic /dev/fuse or kernel nbd: --frontend auto then
    /// means fuse (pagerctl(1) RESTARTS). The default with --swap (over
    /// FUSE: auto or fuse).
    #[arg(long, overrides_with = "no_restartable")]
    restartable: bool,
    /// The serving process is the device: if it dies, the device is lost
    /// (the default without --swap). With --swap it buys the last ~10% of
    /// speed (fuse-uring where the kernel has it) at that risk.
    #[arg(long, overrides_with = "restartable")]
    no_restartable: bool,
    /// With --restartable --frontend nbd: how long the kernel holds the
    /// device's requests while no nbdkit serves, before failing them.
    #[arg(long, default_value = "120", value_parser = parse_secs, value_name = "SECS")]
    dead_conn_timeout: Duration,
    /// With --restartable --frontend nbd: a request unanswered this long
    /// is sent again (on the next nbdkit's connection).
    #[arg(long, default_value = "10", value_parser = parse_secs, value_name = "SECS")]
    nbd_timeout: Duration,
    /// With --frontend nbd: how the kernel reaches the client's nbdkit:
    /// auto, nbd-client or nbdfuse.
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<Via>().map_err(|e| e.to_string()))]
    via: Via,
    /// The client plugin, for --frontend nbd (default: next to pagerctl, or
    /// in $NETPAGER_PLUGIN_DIR).
    #[arg(long, value_name = "PATH")]
    plugin: Option<PathBuf>,
    /// Requests the kernel keeps in flight to the device (0: leave the
    /// kernel's default). A short queue makes a swapping job wait for its
    /// writeback instead of being OOM-killed in a memory cgroup v1.
    #[arg(long, default_value_t = 16, value_name = "N")]
    queue_depth: u32,
    /// Wait up to this long for enough donors to take pages before the
    /// device is created (at boot, donors or the network may come up
    /// later). Without it attach fails at once, naming each donor's
    /// problem.
    #[arg(long, value_parser = parse_secs, value_name = "SECS")]
    wait_donors: Option<Duration>,
    /// Attach even when fewer donors take pages than the mode places a unit
    /// on (writes to unplaced extents fail until donors come). Never with
    /// --swap.
    #[arg(long)]
    allow_degraded: bool,
    /// How long the serving process (or nbdkit and nbdfuse) may take to
    /// start.
    #[arg(long, default_value = "30", value_parser = parse_secs, value_name = "SECS")]
    start_timeout: Duration,
}

impl Args {
    fn device_options(&self) -> DeviceOptions {
        DeviceOptions {
            client_id: self.client_id.clone(),
            size: self.size,
            mode: self.mode,
            parity_width: self.parity_width,
            ec_data: self.ec_data,
            ec_parity: self.ec_parity,
            parity_log: self.parity_log,
            disk_file: self.disk_file.clone(),
            donors: self.donors.clone(),
            extent_size: self.extent_size,
            b: self.b,
            epoch: self.epoch,
            fallback: self.fallback.clone().zip(self.fallback_size),
            psk: self.psk.clone(),
            metrics: self.metrics.clone(),
            metrics_insecure: self.metrics_insecure,
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
            spin_us: self.spin_us,
            donors_file: self
                .donors_file
                .as_deref()
                .map(absolute)
                .transpose()
                .expect("the working directory is readable"),
            forget_after: self.forget_after,
            grace: self.grace,
            rebalance_rate: self.rebalance_rate,
            rebalance_busy_rate: self.rebalance_busy_rate,
            rebalance_hot_epochs: self.rebalance_hot_epochs,
            discover: self.discover,
            insecure: self.insecure,
            trust_network: self.trust_network.clone(),
            discover_domain: self.discover_domain.clone(),
            dns_server: self.dns_server.clone(),
            discover_export: self.discover_export.clone(),
            prefetch_pages: self.prefetch_pages,
        }
    }
}

/// The client plugin: --plugin, else $NETPAGER_PLUGIN_DIR, else next to
/// pagerctl (cargo puts both in target/release), else in ../lib/netpager
/// from pagerctl's directory (the package's /usr/lib/netpager).
fn find_plugin(given: Option<&Path>) -> Result<PathBuf> {
    const NAME: &str = "libpager_client_plugin.so";
    let path = match (given, std::env::var_os("NETPAGER_PLUGIN_DIR")) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(dir)) => PathBuf::from(dir).join(NAME),
        (None, None) => {
            let beside = std::env::current_exe()
                .context("cannot find pagerctl's own path")?
                .with_file_name(NAME);
            let packaged = beside.with_file_name("../lib/netpager").join(NAME);
            if !beside.is_file() && packaged.is_file() {
                packaged
            } else {
                beside
            }
        }
    };
    if !path.is_file() {
        bail!(
            "client plugin {} not found (build it with make build, or pass --plugin)",
            path.display()
        );
    }
    // nbdkit resolves a relative plugin path from its own working directory.
    path.canonicalize()
        .with_context(|| format!("cannot resolve {}", path.display()))
}

/// The device: a new one's configuration (true: not saved yet), or the
/// one the state directory holds, checked against the options given.
fn prepare_config(a: &Args, layout: &StateLayout) -> Result<(DeviceConfig, bool)> {
    let path = layout.device_toml();
    let mut o = a.device_options();
    if path.exists() {
        let old = DeviceConfig::load(&path)?;
        let diff = attach::differences(&old, &attach::apply_options(&old, &o, &layout.dir)?);
        if !diff.is_empty() {
            bail!(
                "{} holds a device that differs in {}: attach without those options to reuse it, or use another --state-dir",
                path.display(),
                diff.join(", ")
            );
        }
        tracing::info!("reusing {}", path.display());
        return Ok((old, false));
    }
    o.client_id.get_or_insert_with(super::host_name);
    Ok((attach::build_config(&o, &layout.dir)?, true))
}

/// Checks every donor the device starts with (`pager_client::probe`), in
/// parallel.
fn check_donors(cfg: &DeviceConfig, donors: &[DonorConfig]) -> Vec<Checked> {
    std::thread::scope(|s| {
        let running: Vec<_> = donors
            .iter()
            .map(|d| s.spawn(move || probe::check(cfg, d).err()))
            .collect();
        donors
            .iter()
            .zip(running)
            .map(|(d, t)| Checked {
                name: d.name.clone(),
                address: d.address.clone(),
                problem: t.join().unwrap_or_else(|_| {
                    Some(probe::Problem::Unreachable("its check panicked".into()))
                }),
            })
            .collect()
    })
}

/// What discovery found and admitted now (the admission the device's
/// epochs use), each admitted donor checked as a given one is; donors
/// given already (by name or address) are not counted twice.
fn discovered(cfg: &DeviceConfig, adm: &Admission, given: &[DonorConfig]) -> check::Found {
    let mut through: Vec<String> = Vec::new();
    if cfg.discover {
        through.push("multicast DNS".into());
    }
    through.extend(
        cfg.discover_domain
            .iter()
            .map(|d| format!("DNS domain {d}")),
    );
    let mut found = check::Found {
        through,
        errors: adm.source_errors(),
        expired: adm
            .expired()
            .into_iter()
            .map(|e| (e.a.node_id, e.why))
            .collect(),
        ..check::Found::default()
    };
    let mut configs = Vec::new();
    for (d, verdict) in adm.verdicts() {
        let nbd = d.nbd.to_string();
        if given
            .iter()
            .any(|g| g.name == d.node_id || g.address == nbd)
        {
            continue;
        }
        match verdict {
            Ok(_) => configs.push(pager_client::device::discovered_config(cfg, &d)),
            Err(why) => found.refused.push((d.node_id.clone(), nbd, why)),
        }
    }
    found.admitted = check_donors(cfg, &configs);
    found
}

/// Before the device is created: enough donors take pages for the mode to
/// place a unit, or attach waits (--wait-donors), goes on degraded
/// (--allow-degraded, never with --swap) or fails naming each donor's
/// problem. With discovery the donors it finds and admits count too (a
/// client with no donors file). `existing`: the state directory of a
/// device that exists (its map's journal names members that joined later).
fn require_donors(a: &Args, cfg: &DeviceConfig, existing: Option<&Path>) -> Result<()> {
    let donors = probe::starting_donors(cfg, existing).map_err(anyhow::Error::msg)?;
    let needed = probe::donors_needed(cfg);
    let deadline = a.wait_donors.map(|w| Instant::now() + w);
    let discovering = cfg.discover || !cfg.discover_domain.is_empty();
    // Its rounds pace the wait: one a second.
    let admission = discovering
        .then(|| pager_client::device::start_admission(cfg, Duration::from_secs(1)))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let round_bound = Duration::from_millis(cfg.timeouts.connect_ms)
        .saturating_mul(4)
        .max(Duration::from_secs(5));
    let mut rounds = 0;
    let mut progress = super::Progress::default();
    loop {
        let checked = check_donors(cfg, &donors);
        let found = admission.as_ref().map(|adm| {
            rounds = adm.wait_round(rounds, round_bound);
            discovered(cfg, adm, &donors)
        });
        let why = match check::verdict(&checked, found.as_ref(), needed, cfg.mode.word()) {
            Verdict::Enough { warnings } => {
                progress.done();
                for w in warnings {
                    tracing::warn!("{w}");
                }
                return Ok(());
            }
            Verdict::TooFew(why) => why,
        };
        if deadline.is_some_and(|d| Instant::now() < d) {
            let admitted = found.as_ref().map_or(&[][..], |f| &f.admitted[..]);
            let usable = checked
                .iter()
                .chain(admitted)
                .filter(|c| c.problem.is_none())
                .count();
            progress.show(format!(
                "waiting for donors (--wait-donors): {usable} of {needed} needed take pages"
            ));
            if admission.is_none() {
                std::thread::sleep(Duration::from_secs(1));
            }
            continue;
        }
        progress.done();
        let waited = a
            .wait_donors
            .map(|w| format!(" after waiting {} s", w.as_secs_f64()))
            .unwrap_or_default();
        if a.swap {
            bail!("{why}\nswap is not turned on for a device that cannot place a unit{waited}; fix the donors above, or attach with --wait-donors SECS to wait for them");
        }
        // Without --wait-donors, donors discovery finds later join then.
        if a.allow_degraded || (discovering && a.wait_donors.is_none()) {
            tracing::warn!("{why}\nattaching anyway (--allow-degraded, or discovery without --wait-donors): writes to extents not placed yet fail until donors can take them");
            return Ok(());
        }
        bail!("{why}\nnothing was attached{waited}; fix the donors above, or attach with --wait-donors SECS to wait for them, or --allow-degraded to attach anyway");
    }
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    steps::make_state_dir(&layout.dir)?;
    let state_dir = layout
        .dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", layout.dir.display()))?;
    let layout = StateLayout::new(state_dir);
    if let Some(rec) = AttachRecord::load(&layout.attach_json())? {
        let done: Vec<String> = rec.steps.iter().map(|s| s.describe()).collect();
        bail!(
            "{} is attached already ({}): run pagerctl detach --state-dir {} first",
            layout.dir.display(),
            if done.is_empty() {
                "attach in progress or interrupted".to_string()
            } else {
                done.join(", ")
            },
            layout.dir.display()
        );
    }
    let asked = if a.restartable {
        Some(true)
    } else if a.no_restartable {
        Some(false)
    } else {
        None
    };
    // A restartable device connects over netlink itself: no nbd-client.
    let served = a.frontend.resolve_attach(
        asked,
        a.swap,
        Path::new(pager_fuse::ENABLE_URING).exists(),
        Path::new("/dev/nbd0").exists(),
        procs::on_path("nbd-client"),
    )?;
    let (frontend, restartable) = (served.frontend, served.restartable);
    if let Some(why) = served.not_restartable {
        tracing::warn!("this swap device is not restartable: {why}");
    }
    if a.frontend == Frontend::Auto || asked.is_none() {
        tracing::info!(
            "front end: {frontend}{}",
            if restartable { ", restartable" } else { "" }
        );
    }
    let plugin = if frontend == Frontend::Nbd {
        layout.checked_socket().map_err(anyhow::Error::msg)?;
        find_plugin(a.plugin.as_deref())?
    } else {
        PathBuf::new()
    };
    let (cfg, new) = prepare_config(&a, &layout)?;
    require_donors(&a, &cfg, (!new).then_some(layout.dir.as_path()))?;
    if new {
        cfg.save(&layout.device_toml())?;
        tracing::info!("wrote {}", layout.device_toml().display());
    }
    if a.swap {
        // Swap's contents never outlive a detach: whatever an old map says
        // is lost there is garbage, and mkswap must be able to write.
        pager_client::extent_map::ExtentMap::start_empty(
            &layout.dir,
            pager_client::extent_map::Layout::from_config(&cfg),
        )
        .with_context(|| format!("starting {} with an empty extent map", layout.dir.display()))?;
    }
    let via = a.via.resolve(
        Path::new("/dev/nbd0").exists(),
        procs::on_path("nbd-client"),
    );
    let plan = steps::Plan {
        layout,
        plugin,
        export: cfg.client_id.clone(),
        frontend,
        via,
        serve: pagerctl::attach::commands::ServeOptions {
            threads: a.serve_threads.max(1),
            writeback: a.writeback_buffer.clone(),
            // Early acknowledgement only for swap, whose pages die with a
            // serving process that is the device anyway; a held device
            // acknowledges late by itself (and its holder takes no such
            // option).
            ack_late: !a.swap && !restartable && !a.writeback_ack_early,
        },
        restartable,
        nbd_timeouts: (a.nbd_timeout, a.dead_conn_timeout),
        swap: a.swap.then_some(a.priority),
        swap_discard: !a.no_discard,
        start_timeout: a.start_timeout,
        queue_depth: (a.queue_depth > 0).then_some(a.queue_depth),
    };
    let state_dir = plan.layout.dir.clone();
    let device = steps::attach(&plan)?;
    println!("{}", device.display());
    // Written by the device as it opened, before it served.
    match pager_client::status::ClientStatus::read(&state_dir) {
        Ok(s) => {
            if let Some(w) = lost::attach_warning(&s, &device, &state_dir) {
                eprintln!("{w}");
            }
        }
        Err(e) => tracing::warn!(
            "reading {}/status.json: {e}; pagerctl status shows whether anything is lost",
            state_dir.display()
        ),
    }
    Ok(())
}
