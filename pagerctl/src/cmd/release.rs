//! `pagerctl release`: frees a detached device's pages on its donors. A
//! detach keeps them (a block device's data survives until the next
//! attach); when the device is not coming back, its exports are trimmed
//! whole here and its map starts empty, so nothing reads as stale.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use netpager_util::format_size;
use pager_client::config::{DeviceConfig, DonorConfig};
use pager_client::device::session;
use pager_client::extent_map::{ExtentMap, Layout};
use pager_client::probe;
use pagerctl::attach::record::StateLayout;
use pagerctl::attach::AttachRecord;

/// Largest single trim.
const TRIM_CHUNK: u64 = 1 << 30;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    if AttachRecord::load(&layout.attach_json())?.is_some() {
        bail!(
            "{} is attached: release frees a detached device's pages; run pagerctl detach --state-dir {} first",
            layout.dir.display(),
            layout.dir.display()
        );
    }
    let cfg = DeviceConfig::load(&layout.device_toml())?;
    // A session of its own, newer than the last attach's: the donors take
    // its trims, and a serving process still running somewhere is fenced.
    let session = session::begin(&layout.dir, Duration::from_secs(10))
        .with_context(|| format!("cannot take {}", layout.dir.display()))?;
    let donors = probe::starting_donors(&cfg, Some(&layout.dir)).map_err(anyhow::Error::msg)?;
    let mut failed = Vec::new();
    for d in &donors {
        let who = if d.name == d.address {
            format!("donor {}", d.name)
        } else {
            format!("donor {} ({})", d.name, d.address)
        };
        match release(&cfg, d, session.number) {
            Ok(bytes) => println!(
                "{who}: export {} released ({} trimmed)",
                cfg.store_name(d),
                format_size(bytes)
            ),
            Err(e) => {
                eprintln!("{who}: {e:#}");
                failed.push(d.name.clone());
            }
        }
    }
    // The data is gone: the next attach must not read the old placements.
    ExtentMap::start_empty(&layout.dir, Layout::from_config(&cfg))
        .with_context(|| format!("emptying the extent map in {}", layout.dir.display()))?;
    println!(
        "the device's data is gone: its next attach starts empty ({})",
        layout.dir.display()
    );
    if !failed.is_empty() {
        bail!(
            "not released on {}: their pages stay there until released (run pagerctl release again when they answer) or the donor restarts",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Trims our whole export on donor `d`; the bytes trimmed.
fn release(cfg: &DeviceConfig, d: &DonorConfig, session: u64) -> Result<u64> {
    let t = cfg.nbd_timeouts();
    let mut c =
        netpager_nbd::Connection::connect(&cfg.endpoint(d, session), t.connect).map_err(|e| {
            match probe::check(cfg, d) {
                Err(p) => anyhow::anyhow!("{p}"),
                Ok(_) => anyhow::Error::new(e),
            }
        })?;
    let size = c.size();
    let mut off = 0;
    while off < size {
        let n = (size - off).min(TRIM_CHUNK);
        c.trim(n, off, t.request.max(Duration::from_secs(30)))?;
        off += n;
    }
    c.flush(t.request)?;
    Ok(size)
}
