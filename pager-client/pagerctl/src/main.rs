//! pagerctl: attach remote memory as a swap or block device, watch it, and
//! talk to donors. See pagerctl(1) (`pager-client/pagerctl/pagerctl.1.md`).

mod attach_cmd;
mod discover_cmd;
mod donor;
mod durability;
mod forget_lost_cmd;
mod hold_cmd;
mod membership_cmd;
mod procs;
mod restart_cmd;
mod serve_cmd;
mod simulate;
mod status_cmd;
#[allow(unsafe_code)]
mod sys;
mod top_cmd;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use pager_client::config::DeviceConfig;
use pagerctl::attach::record::StateLayout;
use pagerctl::attach::{self, AttachRecord, DeviceOptions, DonorSpec, Frontend, ModeChoice, Via};

/// Remote memory as swap or a block device (netpager client).
#[derive(Parser)]
#[command(name = "pagerctl", version = netpager_util::version!(), about, max_term_width = 100)]
struct Cli {
    /// Log more (-v: debug, -vv: trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the client device and attach it as a block device (or swap).
    Attach(Box<AttachArgs>),
    /// Undo an attach: swapoff, detach the device, stop the serving process.
    Detach(DetachArgs),
    /// Serve a device to the kernel on this process's own FUSE mount
    /// (started by attach; runs until unmounted).
    Serve(ServeArgs),
    /// Replace the serving process of a device attached --restartable (an
    /// upgrade: --binary) while it stays attached and swap stays on.
    Restart(RestartArgs),
    /// Keep a restartable device's FUSE connection and run its serving
    /// processes one after another (started by attach).
    #[command(hide = true)]
    Hold(HoldArgs),
    /// Show the device's status (donors, placement, rebuild, drain).
    Status(StatusArgs),
    /// A live view of the device (donors, rates, latency, rebuild and
    /// drain), redrawn every interval; q quits.
    Top(TopArgs),
    /// Show donors' status endpoints.
    DonorStatus(DonorStatusArgs),
    /// Ask a donor to drain (clients move their extents away), or stop.
    DonorDrain(DonorDrainArgs),
    /// Add a donor to an attached device (it stays attached).
    DonorAdd(membership_cmd::AddArgs),
    /// Remove a donor from an attached device: its extents move to the
    /// other donors first.
    DonorRemove(membership_cmd::RemoveArgs),
    /// Give up on an attached device's lost data: lost extents are placed
    /// again and read as zeros, as do pages that read as lost.
    ForgetLost(forget_lost_cmd::Args),
    /// List the donors announced on the network (DNS-SD) and whether a
    /// device would use each.
    Discover(discover_cmd::Args),
    /// Compare donor-selection policies on a simulated cluster.
    Simulate(simulate::Args),
    /// The chance of data loss per mode (none, mirror, parity, ec) from a
    /// donor failure rate and a rebuild time.
    Durability(durability::Args),
}

/// Seconds, 0 allowed (0 turns the thing off).
fn parse_secs_or_zero(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    parse_secs(s)
}

/// `p` from the working directory: the serving process runs elsewhere.
fn absolute(p: &Path) -> std::io::Result<PathBuf> {
    Ok(std::env::current_dir()?.join(p))
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("{s:?} must be a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

#[derive(clap::Args)]
struct AttachArgs {
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
    /// --psk; without a key only on loopback and the test network.
    #[arg(long)]
    discover: bool,
    /// With --discover: use announced donors without a lab key, on any
    /// network (anyone there can then lend this device memory).
    #[arg(long, requires = "discover")]
    insecure: bool,
    /// Forget a donor dead this long (its pages already rebuilt
    /// elsewhere); 0 keeps it in the set for ever. Default 600.
    #[arg(long, value_parser = parse_secs_or_zero, value_name = "SECS")]
    forget_after: Option<Duration>,
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
    /// Keep the device's FUSE connection in a holder process, so that the
    /// serving process can crash (it is restarted at once) or be replaced
    /// (pagerctl restart) while swap stays on. Classic /dev/fuse only:
    /// --frontend auto then means fuse (pagerctl(1) RESTARTS).
    #[arg(long, overrides_with = "no_restartable")]
    restartable: bool,
    /// The serving process is the device: if it dies, the device is lost
    /// (the default).
    #[arg(long, overrides_with = "restartable")]
    no_restartable: bool,
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
    /// How long the serving process (or nbdkit and nbdfuse) may take to
    /// start.
    #[arg(long, default_value = "30", value_parser = parse_secs, value_name = "SECS")]
    start_timeout: Duration,
}

impl AttachArgs {
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
            discover: self.discover,
            insecure: self.insecure,
            prefetch_pages: self.prefetch_pages,
        }
    }
}

#[derive(clap::Args)]
struct DetachArgs {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// How long each process may take to stop before it is killed.
    #[arg(long, default_value = "60", value_parser = parse_secs, value_name = "SECS")]
    timeout: Duration,
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// fuse-uring (falls back to fuse when the kernel does not offer it)
    /// or fuse.
    #[arg(long, default_value = "fuse-uring", value_parser = parse_transport)]
    transport: pager_fuse::Transport,
    /// Reader threads (fuse), or serving threads per CPU (fuse-uring).
    #[arg(long, default_value_t = 16, value_name = "N")]
    threads: usize,
    /// Take the FUSE connection from the holder (`pagerctl hold`) of a
    /// restartable device instead of mounting one.
    #[arg(long)]
    held: bool,
}

#[derive(clap::Args)]
struct HoldArgs {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Each serving process's reader threads.
    #[arg(long, default_value_t = 4, value_name = "N")]
    threads: usize,
}

#[derive(clap::Args)]
struct RestartArgs {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// The pagerctl the new serving process runs (default: the one running
    /// now); later restarts after a crash use it too.
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
    /// How long to wait for the new process to serve.
    #[arg(long, default_value = "60", value_parser = parse_secs, value_name = "SECS")]
    timeout: Duration,
}

fn parse_transport(s: &str) -> Result<pager_fuse::Transport, String> {
    match s {
        "fuse-uring" => Ok(pager_fuse::Transport::Uring),
        "fuse" => Ok(pager_fuse::Transport::Classic),
        _ => Err(format!("{s:?}: expected fuse-uring or fuse")),
    }
}

#[derive(clap::Args)]
struct TopArgs {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Seconds between redraws.
    #[arg(long, default_value = "1", value_parser = parse_secs, value_name = "SECS")]
    interval: Duration,
}

#[derive(clap::Args)]
struct StatusArgs {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct DonorStatusArgs {
    /// Donors' status endpoints, HOST:PORT (one or more).
    #[arg(required = true, value_name = "ADDR")]
    addrs: Vec<String>,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    endpoint: EndpointArgs,
}

/// How to reach donors' status endpoints.
#[derive(clap::Args)]
struct EndpointArgs {
    #[arg(long, default_value = "5", value_parser = parse_secs, value_name = "SECS")]
    timeout: Duration,
    /// The lab's key file (`username:hexkey`, as given to the donors' psk=):
    /// requests are signed and replies checked. Needed for donors started
    /// with psk=.
    #[arg(long, value_name = "FILE")]
    psk: Option<PathBuf>,
}

impl EndpointArgs {
    fn client(&self) -> Result<netpager_proto::StatusClient> {
        let key = self
            .psk
            .as_deref()
            .map(|f| netpager_proto::LabKey::from_psk_file(f, None))
            .transpose()?;
        Ok(netpager_proto::StatusClient {
            timeout: self.timeout,
            key,
        })
    }
}

#[derive(clap::Args)]
struct DonorDrainArgs {
    /// The donor's status endpoint, HOST:PORT.
    addr: String,
    /// Stop draining: the donor accepts pages again.
    #[arg(long)]
    undo: bool,
    /// Wait until the donor holds nothing, printing progress.
    #[arg(long)]
    wait: bool,
    /// Give up waiting after this long.
    #[arg(long, default_value = "600", value_parser = parse_secs, value_name = "SECS")]
    wait_timeout: Duration,
    #[command(flatten)]
    endpoint: EndpointArgs,
}

fn main() {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let result = match cli.command {
        Cmd::Attach(a) => attach(*a),
        Cmd::Detach(a) => detach(a),
        Cmd::Serve(a) => serve_cmd::run(serve_cmd::ServeArgs {
            state_dir: a.state_dir,
            transport: a.transport,
            threads: a.threads,
            held: a.held,
        }),
        Cmd::Hold(a) => hold_cmd::run(hold_cmd::HoldArgs {
            state_dir: a.state_dir,
            threads: a.threads.max(1),
        }),
        Cmd::Restart(a) => restart_cmd::run(&StateLayout::new(a.state_dir), a.binary, a.timeout),
        Cmd::Status(a) => status_cmd::run(&StateLayout::new(a.state_dir), a.json),
        Cmd::Top(a) => top_cmd::run(&StateLayout::new(a.state_dir), a.interval),
        Cmd::DonorStatus(a) => a
            .endpoint
            .client()
            .and_then(|c| donor::status(&a.addrs, a.json, &c)),
        Cmd::DonorDrain(a) => a
            .endpoint
            .client()
            .and_then(|c| donor::drain(&a.addr, a.undo, a.wait, &c, a.wait_timeout)),
        Cmd::DonorAdd(a) => membership_cmd::add(a),
        Cmd::DonorRemove(a) => membership_cmd::remove(a),
        Cmd::ForgetLost(a) => forget_lost_cmd::run(a),
        Cmd::Discover(a) => discover_cmd::run(a),
        Cmd::Simulate(a) => simulate::run(a),
        Cmd::Durability(a) => durability::run(a),
    };
    if let Err(e) = result {
        eprintln!("pagerctl: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, skipping a cause whose text its
/// parent already carries (library errors often embed their source).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "client".to_string())
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

/// Writes device.toml for a new device, or checks that the options given
/// to a re-attach match the device the state directory already holds.
fn prepare_config(a: &AttachArgs, layout: &StateLayout) -> Result<DeviceConfig> {
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
        return Ok(old);
    }
    o.client_id.get_or_insert_with(host_name);
    let cfg = attach::build_config(&o, &layout.dir)?;
    cfg.save(&path)?;
    tracing::info!("wrote {}", path.display());
    Ok(cfg)
}

fn attach(a: AttachArgs) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    attach_cmd::make_state_dir(&layout.dir)?;
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
    let kernel_nbd = Path::new("/dev/nbd0").exists() && procs::on_path("nbd-client");
    let restartable = a.restartable && !a.no_restartable;
    let frontend = a.frontend.resolve_restartable(
        restartable,
        Path::new(pager_fuse::ENABLE_URING).exists(),
        kernel_nbd,
    )?;
    if a.frontend == Frontend::Auto {
        tracing::info!("front end: {frontend}");
    }
    let plugin = if frontend == Frontend::Nbd {
        layout.checked_socket().map_err(anyhow::Error::msg)?;
        find_plugin(a.plugin.as_deref())?
    } else {
        PathBuf::new()
    };
    let cfg = prepare_config(&a, &layout)?;
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
    let plan = attach_cmd::Plan {
        layout,
        plugin,
        export: cfg.client_id.clone(),
        frontend,
        via,
        serve_threads: a.serve_threads.max(1),
        restartable,
        swap: a.swap.then_some(a.priority),
        swap_discard: !a.no_discard,
        start_timeout: a.start_timeout,
        queue_depth: (a.queue_depth > 0).then_some(a.queue_depth),
    };
    let state_dir = plan.layout.dir.clone();
    let device = attach_cmd::attach(&plan)?;
    println!("{}", device.display());
    // Written by the device as it opened, before it served.
    match pager_client::status::ClientStatus::read(&state_dir) {
        Ok(s) => {
            if let Some(w) = pagerctl::lost::attach_warning(&s, &device, &state_dir) {
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

fn detach(a: DetachArgs) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    let Some(mut record) = AttachRecord::load(&layout.attach_json())? else {
        bail!(
            "{} is not attached (no {})",
            layout.dir.display(),
            layout.attach_json().display()
        );
    };
    let device = record.device().map(Path::to_path_buf);
    attach_cmd::undo_all(&layout, &mut record, a.timeout)?;
    match device {
        Some(d) => println!("detached {}", d.display()),
        None => println!("detached"),
    }
    Ok(())
}
