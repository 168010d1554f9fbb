//! pagerctl: attach remote memory as a swap or block device, watch it, and
//! talk to donors. See pagerctl(1) (`pagerctl/pagerctl.1.md`).
//!
//! One module per subcommand in `cmd/` (its arguments and `run`); the
//! machinery they share is the `pagerctl` library (`attach`, `sim`, `top`,
//! `lost`) and, where it runs processes, `steps`, `procs` and `sys` here.

mod cmd;
mod probe;
mod procs;
mod serving;
mod steps;
#[allow(unsafe_code)]
mod sys;

use std::io::Write;

use clap::{Parser, Subcommand};

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
    Attach(Box<cmd::attach::Args>),
    /// Undo an attach: swapoff, detach the device, stop the serving process.
    Detach(cmd::detach::Args),
    /// Serve a device to the kernel on this process's own FUSE mount
    /// (started by attach; runs until unmounted).
    Serve(cmd::serve::Args),
    /// Replace the serving process of a device attached --restartable (an
    /// upgrade: --binary) while it stays attached and swap stays on.
    Restart(cmd::restart::Args),
    /// Keep a restartable device's FUSE connection and run its serving
    /// processes one after another (started by attach).
    #[command(hide = true)]
    Hold(cmd::hold::Args),
    /// Keep a restartable kernel nbd device: run nbdkit with the client
    /// plugin and reconnect the device to each new one (started by attach).
    #[command(hide = true)]
    HoldNbd(cmd::hold_nbd::Args),
    /// Show the device's status (donors, placement, rebuild, drain).
    Status(cmd::status::Args),
    /// A live view of the device (donors, rates, latency, rebuild and
    /// drain), redrawn every interval; q quits.
    Top(cmd::top::Args),
    /// Show donors' status endpoints.
    DonorStatus(cmd::donor_status::Args),
    /// Ask a donor to drain (clients move their extents away), or stop.
    DonorDrain(cmd::donor_drain::Args),
    /// Add a donor to an attached device (it stays attached).
    DonorAdd(cmd::donor_add::Args),
    /// Remove a donor from an attached device: its extents move to the
    /// other donors first.
    DonorRemove(cmd::donor_remove::Args),
    /// Free a detached device's pages on its donors (its data is gone; the
    /// next attach starts empty).
    Release(cmd::release::Args),
    /// Make the lab key file (TLS-PSK), right for donors and clients alike.
    Psk(cmd::psk::Args),
    /// Give up on an attached device's lost data: lost extents are placed
    /// again and read as zeros, as do pages that read as lost.
    ForgetLost(cmd::forget_lost::Args),
    /// List the donors announced on the network (DNS-SD) and whether a
    /// device would use each.
    Discover(cmd::discover::Args),
    /// Compare donor-selection policies on a simulated cluster.
    Simulate(cmd::simulate::Args),
    /// The chance of data loss per mode (none, mirror, parity, ec) from a
    /// donor failure rate and a rebuild time.
    Durability(cmd::durability::Args),
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
    // A reader that goes away (`pagerctl status | head`) ends a report
    // quietly, as it ends cat; other commands too, after their work.
    if matches!(
        cli.command,
        Cmd::Status(_)
            | Cmd::Top(_)
            | Cmd::DonorStatus(_)
            | Cmd::Discover(_)
            | Cmd::Simulate(_)
            | Cmd::Durability(_)
    ) {
        sys::default_sigpipe();
    }
    quiet_broken_pipe();
    let result = match cli.command {
        Cmd::Status(a) => cmd::status::run(a).map(|h| h.code()),
        Cmd::Attach(a) => cmd::attach::run(*a).map(|()| 0),
        Cmd::Detach(a) => cmd::detach::run(a).map(|()| 0),
        Cmd::Serve(a) => cmd::serve::run(a).map(|()| 0),
        Cmd::Restart(a) => cmd::restart::run(a).map(|()| 0),
        Cmd::Hold(a) => cmd::hold::run(a).map(|()| 0),
        Cmd::HoldNbd(a) => cmd::hold_nbd::run(a).map(|()| 0),
        Cmd::Top(a) => cmd::top::run(a).map(|()| 0),
        Cmd::DonorStatus(a) => cmd::donor_status::run(a).map(|()| 0),
        Cmd::DonorDrain(a) => cmd::donor_drain::run(a).map(|()| 0),
        Cmd::DonorAdd(a) => cmd::donor_add::run(a).map(|()| 0),
        Cmd::DonorRemove(a) => cmd::donor_remove::run(a).map(|()| 0),
        Cmd::ForgetLost(a) => cmd::forget_lost::run(a).map(|()| 0),
        Cmd::Release(a) => cmd::release::run(a).map(|()| 0),
        Cmd::Psk(a) => cmd::psk::run(a).map(|()| 0),
        Cmd::Discover(a) => cmd::discover::run(a).map(|()| 0),
        Cmd::Simulate(a) => cmd::simulate::run(a).map(|()| 0),
        Cmd::Durability(a) => cmd::durability::run(a).map(|()| 0),
    };
    match result {
        Ok(code) => {
            let _ = std::io::stdout().flush();
            std::process::exit(code)
        }
        Err(e) => {
            eprintln!("pagerctl: {}", error_chain(&e));
            std::process::exit(1);
        }
    }
}

/// Rust ignores SIGPIPE, so printing to a closed pipe panics: such a
/// panic ends the command quietly, with the status a SIGPIPE gives.
fn quiet_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = netpager_util::panic_message(info.payload());
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(128 + libc::SIGPIPE);
        }
        default(info)
    }));
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
