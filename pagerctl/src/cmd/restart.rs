//! `pagerctl restart`: replaces the serving process of a restartable
//! device (an upgrade: `--binary` names the new pagerctl) while the device
//! stays attached and swap stays on. The holder asks the old process to
//! hand over, starts the new one on the same FUSE connection and answers
//! once it serves, with how long the kernel's requests waited. For a
//! kernel nbd device the holder (`pagerctl hold-nbd`) stops nbdkit and
//! reconnects the device to the next one.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use pager_fuse::handover::{self, Request, Restarted};
use pagerctl::attach::record::{HolderInfo, StateLayout};
use pagerctl::attach::{AttachRecord, Step};

use super::parse_secs;
use crate::procs;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// The pagerctl the new serving process runs (default: the one running
    /// now); later restarts after a crash use it too. Not for kernel nbd,
    /// whose serving process is nbdkit.
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
    /// How long to wait for the new process to serve.
    #[arg(long, default_value = "60", value_parser = parse_secs, value_name = "SECS")]
    timeout: Duration,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    let record = AttachRecord::load(&layout.attach_json())?
        .ok_or_else(|| anyhow!("{} is not attached", layout.dir.display()))?;
    let Some((pid, started)) = record.holder() else {
        bail!(
            "{} was not attached --restartable: its serving process cannot be replaced without a detach",
            layout.dir.display()
        );
    };
    let kernel_nbd = record
        .steps
        .iter()
        .any(|s| matches!(s, Step::NbdHolder { .. }));
    if kernel_nbd && a.binary.is_some() {
        bail!(
            "{}'s serving process is nbdkit with the client plugin: upgrade the plugin file, then restart without --binary",
            layout.dir.display()
        );
    }
    if !procs::owned(pid, started) {
        bail!(
            "the connection holder (pid {pid}) is gone: replacing the serving process now would lose the device; detach and attach again when swap can go off"
        );
    }
    let binary = a
        .binary
        .map(|b| {
            b.canonicalize()
                .with_context(|| format!("cannot resolve {}", b.display()))
        })
        .transpose()?;
    let old = HolderInfo::load(&layout.holder_json()).and_then(|h| h.serve_pid);
    let socket = layout.holder_socket();
    let answer = handover::ask(&socket, &Request::Restart { binary }, a.timeout)
        .with_context(|| format!("asking the holder at {}", socket.display()))?;
    let r = Restarted::parse(&answer).map_err(|e| anyhow!("the holder: {e}"))?;
    match old {
        Some(old) => println!(
            "serving process {old} replaced by {}; requests were held {} ms",
            r.pid, r.held_ms
        ),
        None => println!(
            "serving process {} started; requests were held {} ms",
            r.pid, r.held_ms
        ),
    }
    Ok(())
}
