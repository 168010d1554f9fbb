//! `pagerctl detach`: undoes an attach, its recorded steps in reverse
//! (`crate::steps`): swapoff, detach the device, stop the serving process,
//! within a deadline past which the processes attach started are killed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};
use pagerctl::attach::record::StateLayout;
use pagerctl::attach::AttachRecord;

use super::parse_secs;
use crate::steps;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// How long detach waits on the device's processes (a flush through
    /// the device, their exit); past it, the processes attach started are
    /// killed (SIGKILL, by pid) and detach says which.
    #[arg(long, default_value = "60", value_parser = parse_secs, value_name = "SECS")]
    timeout: Duration,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    let Some(mut record) = AttachRecord::load(&layout.attach_json())? else {
        bail!(
            "{} is not attached (no {})",
            layout.dir.display(),
            layout.attach_json().display()
        );
    };
    let device = record.device().map(Path::to_path_buf);
    steps::undo_all(&layout, &mut record, a.timeout)?;
    match device {
        Some(d) => println!("detached {}", d.display()),
        None => println!("detached"),
    }
    Ok(())
}
