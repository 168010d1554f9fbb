//! `prefetchd`: the cooperative prefetch daemon and its control commands.
//! See prefetchd.8.md.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::json;

use netpager_metrics::{Bound, EndpointConfig, Exposition};
use prefetchd::control::{self, ControlServer};
use prefetchd::daemon::{self, Config, Daemon};
use prefetchd::donor::DonorArg;
use prefetchd::fs::{self as pfs, PrefetchFs};
use prefetchd::plan::coalesce::CoalesceConfig;
use prefetchd::plan::cursor::CursorConfig;
use prefetchd::plan::engine::EngineConfig;
use prefetchd::{files, sys, table};
use std::sync::Arc;

const DEFAULT_CONTROL: &str = "/run/prefetchd.sock";

#[derive(Parser)]
#[command(
    name = "prefetchd",
    version = netpager_util::version!(),
    about = "netpager cooperative prefetch daemon (PGMS's hybrid policy)"
)]
struct Cli {
    /// Control socket of the daemon.
    #[arg(long, global = true, default_value = DEFAULT_CONTROL)]
    control: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve DATA at MOUNT with prefetching, until SIGTERM/SIGINT.
    Serve(Box<ServeArgs>),
    /// Per-job hint position, hits per level, prefetches, stall time.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Register, remove or list hinted jobs.
    Job {
        #[command(subcommand)]
        command: JobCommand,
    },
    /// Print the replica layout of a data directory: each file's offset
    /// and size in a donor's replica export, in order.
    Manifest { data: PathBuf },
}

#[derive(Subcommand)]
enum JobCommand {
    /// Job NAME reads through MOUNT/jobs/NAME/, follows HINTFILE and/or
    /// records its reads into a hint file.
    #[command(arg_required_else_help = true)]
    Add {
        name: String,
        #[arg(required_unless_present = "record")]
        hints: Option<PathBuf>,
        /// Record the job's reads into this hint file (written when the
        /// job is removed or the daemon stops).
        #[arg(long, value_name = "FILE")]
        record: Option<PathBuf>,
    },
    /// Forget job NAME (and write its recording).
    Remove {
        name: String,
    },
    List,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("discovery").multiple(true).args(["discover", "discover_domain"])))]
struct ServeArgs {
    /// Data directory to serve (read-only).
    #[arg(long)]
    data: PathBuf,
    /// Where to mount the view (an existing empty directory).
    #[arg(long)]
    mount: PathBuf,
    /// Local cache size (K, M, G suffixes).
    #[arg(long, default_value = "64M", value_parser = netpager_util::parse_size)]
    local_cache: u64,
    /// Block size in bytes (a power of two).
    #[arg(long, default_value_t = 8192)]
    block_size: u32,
    /// A donor: HOST:PORT[/EXPORT][,replica=HOST:PORT[/EXPORT]][,slots=N][,status=HOST:PORT][,psk=FILE][,user=NAME].
    #[arg(long = "donor")]
    donors: Vec<DonorArg>,
    /// A donors file: one --donor value a line, `#` comments, re-read each
    /// status-poll period (a line added: a donor joins; a line removed: it
    /// is let go). A file that does not parse changes nothing.
    #[arg(long, value_name = "PATH")]
    donors_file: Option<PathBuf>,
    /// Use donors announced on the network (pager-server announce=true);
    /// with --psk only those whose signed status verifies.
    #[arg(long)]
    discover: bool,
    /// The lab key file: TLS to discovered donors and their signed status.
    #[arg(long, value_name = "FILE", requires = "discovery")]
    psk: Option<PathBuf>,
    /// The export used on a discovered donor (default prefetchd-HOSTNAME@64M).
    #[arg(long, value_name = "NAME[@SIZE]", requires = "discovery")]
    discover_export: Option<String>,
    /// Without --psk: a network (ADDR/BITS) whose announced donors are used
    /// unverified, besides loopback (only one where nobody but the lab's
    /// own machines can announce). Repeat.
    #[arg(long, value_name = "CIDR", requires = "discovery")]
    trust_network: Vec<netpager_membership::discovery::Network>,
    /// Use discovered donors anywhere without --psk.
    #[arg(long, requires = "discovery")]
    discover_insecure: bool,
    /// Use donors published in this DNS domain (`_netpager._tcp.DOMAIN`,
    /// pager-server announce=dns), admitted as with --discover. Repeat.
    #[arg(long, value_name = "DOMAIN")]
    discover_domain: Vec<String>,
    /// The DNS server asked for --discover-domain (default: the system
    /// resolver's).
    #[arg(long, value_name = "ADDR[:PORT]", requires = "discover_domain",
          value_parser = netpager_membership::dns::parse_server)]
    dns_server: Option<std::net::SocketAddr>,
    /// Register a job at start: NAME=HINTFILE.
    #[arg(long = "job")]
    jobs: Vec<String>,
    /// Do not prefetch at all (a demand-only cache, for comparison).
    #[arg(long)]
    no_prefetch: bool,
    /// B: disk-to-global requests outstanding per donor.
    #[arg(long, default_value_t = 8)]
    outstanding: u32,
    /// Hint lookahead window, in references (default: enough to cover
    /// local and global memory twice).
    #[arg(long)]
    window: Option<usize>,
    /// Consecutive misses that demote a job to unhinted.
    #[arg(long, default_value_t = 8)]
    miss_limit: u32,
    /// Prefetch reads queued on the local disk at once.
    #[arg(long, default_value_t = 2)]
    disk_prefetch_depth: u32,
    /// io_uring slots.
    #[arg(long, default_value_t = 32)]
    disk_depth: u32,
    /// Largest local disk request coalescing a job's hinted blocks
    /// (K, M suffixes; one block: no coalescing).
    #[arg(long, default_value = "256K", value_parser = netpager_util::parse_size)]
    coalesce: u64,
    /// Largest hole of unhinted blocks read inside a coalesced request.
    #[arg(long, default_value = "32K", value_parser = netpager_util::parse_size)]
    coalesce_gap: u64,
    /// Largest sequential readahead of readers without hints (0: none).
    #[arg(long, default_value = "128K", value_parser = netpager_util::parse_size)]
    readahead: u64,
    /// How often donors' status endpoints (`status=` in --donor) are
    /// polled, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    status_poll_ms: u64,
    /// Serve every read through the daemon: the kernel neither caches the
    /// mount's file data nor reads ahead (local memory is then exactly
    /// --local-cache; for experiments).
    #[arg(long)]
    direct_io: bool,
    /// Do not lock memory (mlockall).
    #[arg(long)]
    no_mlock: bool,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (a network
    /// address needs --metrics-psk or --metrics-insecure).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// The lab's TLS-PSK file: scrapes must carry its bearer token.
    #[arg(long, value_name = "FILE", requires = "metrics")]
    metrics_psk: Option<PathBuf>,
    /// Allow --metrics on a network address without a key.
    #[arg(long, requires = "metrics")]
    metrics_insecure: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "prefetchd=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefetchd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve(args) => serve(*args, &cli.control),
        Command::Status { json } => {
            let answer = control::request(&cli.control, &json!({"op": "status"}))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&answer["status"])?);
            } else {
                print!("{}", table::status_table(&answer["status"]));
            }
            Ok(())
        }
        Command::Job { command } => {
            match command {
                JobCommand::Add {
                    name,
                    hints,
                    record,
                } => {
                    let mut req = json!({"op": "job-add", "name": name});
                    if let Some(h) = hints {
                        req["hints"] = json!(h
                            .canonicalize()
                            .with_context(|| format!("hint file {}", h.display()))?);
                    }
                    if let Some(r) = record {
                        req["record"] = json!(std::path::absolute(&r)
                            .with_context(|| format!("recording {}", r.display()))?);
                    }
                    let a = control::request(&cli.control, &req)?;
                    for s in a["added"]["stale"].as_array().into_iter().flatten() {
                        eprintln!(
                            "prefetchd: job {name}: stale hints ignored: {}",
                            s.as_str().unwrap_or("?")
                        );
                    }
                }
                JobCommand::Remove { name } => {
                    let a =
                        control::request(&cli.control, &json!({"op": "job-remove", "name": name}))?;
                    if let Some(r) = a["recorded"].as_str() {
                        eprintln!("prefetchd: job {name}: recorded in {r}");
                    }
                }
                JobCommand::List => {
                    let a = control::request(&cli.control, &json!({"op": "job-list"}))?;
                    for j in a["jobs"].as_array().into_iter().flatten() {
                        println!("{}", j.as_str().unwrap_or("?"));
                    }
                }
            }
            Ok(())
        }
        Command::Manifest { data } => {
            let mut at = 0u64;
            for (rel, size) in files::manifest(&data)? {
                println!("{at}\t{size}\t{rel}");
                at += size;
            }
            Ok(())
        }
    }
}

fn serve(args: ServeArgs, control_path: &Path) -> Result<()> {
    // Before any thread exists, so that every thread inherits the mask and
    // the stop signals reach only the sigwait below.
    sys::block_stop_signals().context("blocking stop signals")?;
    if pfs::is_mount_point(&args.mount) {
        bail!(
            "{}: something is already mounted there",
            args.mount.display()
        );
    }
    let bs = u64::from(args.block_size);
    let blocks_of = |bytes: u64, what: &str| {
        u32::try_from((bytes / bs).max(1)).with_context(|| format!("--{what} too large"))
    };
    let local_blocks = (args.local_cache / u64::from(args.block_size)).max(1);
    let local_blocks = u32::try_from(local_blocks).context("--local-cache too large")?;
    let mut engine = EngineConfig {
        local_blocks,
        donor_outstanding: args.outstanding.max(1),
        disk_prefetch_depth: args.disk_prefetch_depth.max(1),
        coalesce: CoalesceConfig {
            max_blocks: blocks_of(args.coalesce, "coalesce")?,
            max_gap: (args.coalesce_gap / bs) as u32,
        },
        readahead_blocks: blocks_of(args.readahead, "readahead")?,
        prefetch: !args.no_prefetch,
        cursor: CursorConfig {
            miss_limit: args.miss_limit.max(1),
            ..CursorConfig::default()
        },
        ..EngineConfig::default()
    };
    // Local prefetches never take more than half the buffers.
    engine.local_prefetch_depth = engine.local_prefetch_depth.min((local_blocks / 2).max(1));
    // Checked now, so that a bad key file fails the start.
    let lab_user = args
        .psk
        .as_deref()
        .map(|p| {
            netpager_proto::auth::LabKey::from_psk_file(p, None)
                .map(|k| k.username().to_string())
                .with_context(|| format!("--psk {}", p.display()))
        })
        .transpose()?;
    let cfg = Config {
        data: args.data.clone(),
        block_size: args.block_size,
        engine,
        donors: args.donors.clone(),
        disk_depth: args.disk_depth,
        max_request: engine.coalesce.max_blocks.max(engine.readahead_blocks) as usize
            * args.block_size as usize,
        page_cache: !args.direct_io,
        status_poll: std::time::Duration::from_millis(args.status_poll_ms.max(10)),
        timeouts: daemon::default_timeouts(),
        membership: prefetchd::membership::Config {
            donors_file: args
                .donors_file
                .as_ref()
                .map(std::path::absolute)
                .transpose()?,
            discover: (args.discover || !args.discover_domain.is_empty()).then(|| {
                prefetchd::membership::Discover {
                    mdns: args.discover,
                    domains: args.discover_domain.clone(),
                    dns_server: args.dns_server,
                    psk: args.psk.clone(),
                    user: lab_user.clone(),
                    export: args.discover_export.clone().unwrap_or_else(|| {
                        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                            .map(|h| h.trim().to_string())
                            .unwrap_or_default();
                        format!("prefetchd-{host}@64M")
                    }),
                    insecure: args.discover_insecure,
                    trust_network: args.trust_network.clone(),
                }
            }),
        },
    };
    // Bound before the daemon starts, so that a taken port or a refused
    // address fails the start.
    let metrics = args
        .metrics
        .as_ref()
        .map(|addr| {
            Bound::new(&EndpointConfig {
                param: "--metrics",
                addr: addr.clone(),
                key_file: args.metrics_psk.clone(),
                insecure: args.metrics_insecure,
            })
        })
        .transpose()?;
    let d = Daemon::start(cfg)?;
    if let Some(b) = metrics {
        let weak = Arc::downgrade(&d);
        b.spawn(move || match weak.upgrade() {
            Some(d) => prefetchd::metrics::exposition(&d.metrics_snapshot()),
            None => Exposition::new(),
        })
        .context("starting the metrics thread")?;
    }
    let window = args.window.unwrap_or_else(|| {
        let global: u64 = d
            .status()
            .donors
            .iter()
            .map(|x| u64::from(x.engine.slots))
            .sum();
        (2 * (u64::from(local_blocks) + global)).clamp(1024, 1 << 20) as usize
    });
    d.set_window(window);
    let result = serve_mounted(&d, &args, control_path);
    d.stop();
    result
}

fn serve_mounted(d: &std::sync::Arc<Daemon>, args: &ServeArgs, control_path: &Path) -> Result<()> {
    for j in &args.jobs {
        let (name, hints) = j
            .split_once('=')
            .with_context(|| format!("--job {j:?}: expected NAME=HINTFILE"))?;
        d.add_job(Some(name), Some(Path::new(hints)), None)?;
    }
    if !args.no_mlock {
        if let Err(e) = netpager_util::process::lock_memory(netpager_util::process::Lock::OnFault) {
            tracing::warn!("mlockall failed ({e}); the cache may be swapped out");
        }
    }
    let mut session = fuser::Session::new(
        PrefetchFs::new(d.clone(), u32::try_from(args.readahead).unwrap_or(u32::MAX)),
        &args.mount,
        &pfs::mount_options(),
    )
    .with_context(|| format!("mounting on {}", args.mount.display()))?;
    let mut unmounter = session.unmount_callable();
    let fuse_thread = std::thread::Builder::new()
        .name("fuse".into())
        .spawn(move || {
            if let Err(e) = session.run() {
                tracing::error!("FUSE session ended: {e}");
            }
            // Unmounted from outside (or failed): stop the daemon too.
            sys::raise_stop();
        })?;
    let control = ControlServer::start(control_path, d.clone());
    let outcome = match control {
        Ok(mut server) => {
            tracing::info!(
                "serving {} at {} (control {})",
                args.data.display(),
                args.mount.display(),
                control_path.display()
            );
            let sig = sys::wait_stop_signal().context("waiting for a stop signal")?;
            tracing::info!("signal {sig}: unmounting and stopping");
            server.stop();
            Ok(())
        }
        Err(e) => Err(e.into()),
    };
    if let Err(e) = unmounter.unmount() {
        tracing::warn!("unmounting {}: {e}", args.mount.display());
    }
    let _ = fuse_thread.join();
    outcome
}
