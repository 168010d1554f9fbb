//! `pagerctl donor-drain`: asks a donor's status endpoint to drain (its
//! clients move their extents away) or to stop draining, and with `--wait`
//! follows the drain until the donor holds nothing.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use netpager_proto::StatusClient;
use netpager_util::format_size;

use pager_client::probe;

use super::{parse_secs, EndpointArgs, Progress};

#[derive(clap::Args)]
pub struct Args {
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

pub fn run(a: Args) -> Result<()> {
    let client = a.endpoint.client()?;
    drain(&a.addr, a.undo, a.wait, &client, a.wait_timeout)
}

/// The progress line of a drain: how much is left and how much has moved.
fn drain_progress(addr: &str, initial_used: u64, used: u64) -> String {
    let moved = initial_used.saturating_sub(used);
    let pct = if initial_used == 0 {
        100.0
    } else {
        moved as f64 * 100.0 / initial_used as f64
    };
    format!(
        "draining {addr}: {} still held, {} moved away ({pct:.0}%)",
        format_size(used),
        format_size(moved)
    )
}

fn drain(
    addr: &str,
    undo: bool,
    wait: bool,
    client: &StatusClient,
    wait_limit: Duration,
) -> Result<()> {
    if undo && wait {
        bail!("--wait waits for a drain to finish; it makes no sense with --undo");
    }
    let s = client.set_draining(addr, !undo).with_context(|| {
        format!(
            "cannot {} donor {addr}",
            if undo { "stop draining" } else { "drain" }
        )
    })?;
    println!(
        "donor {addr} ({}) is now {}, holding {}",
        s.node_id,
        s.state().word(),
        format_size(s.used_bytes)
    );
    if !wait {
        return Ok(());
    }
    let mut progress = Progress::default();
    let initial = s.used_bytes;
    let start = Instant::now();
    let left = client
        .wait_empty(addr, wait_limit, |s| {
            progress.show(drain_progress(addr, initial, s.used_bytes))
        })
        .map_err(|e| anyhow::anyhow!("{}", probe::status_failure(addr, &e)))?;
    progress.done();
    if let Some(s) = left {
        bail!(
            "donor {addr} still holds {} after waiting {wait_limit:?}{}",
            format_size(s.used_bytes),
            netpager_proto::unclaimed_note(&s)
        );
    }
    println!(
        "donor {addr} is empty after {:.1} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_progress_line() {
        assert_eq!(
            drain_progress("a:1", 4 << 20, 1 << 20),
            "draining a:1: 1 MiB still held, 3 MiB moved away (75%)"
        );
        assert!(drain_progress("a:1", 0, 0).ends_with("(100%)"));
    }
}
