//! The attach steps of `pagerctl::attach` carried out (for `pagerctl
//! attach` and `detach`): each recorded in `attach.json` as it is done
//! (`run.rs`, with the helper processes it starts in `spawn.rs`), and
//! undone in reverse (`undo.rs`: on detach, or when an attach fails
//! half-way). What the kernel says is set up is read in `crate::probe`.

mod run;
mod spawn;
mod undo;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use pagerctl::attach::commands;
use pagerctl::attach::record::StateLayout;
use pagerctl::attach::{AttachRecord, Frontend, Step, Via};

use pager_client::status::ClientStatus;

use crate::procs;
use run::{
    enable_uring, kernel_side_of_nbd, loop_device, set_queue_depth, start_nbd_holder, start_nbdkit,
    start_server,
};
pub use undo::undo_all;

/// What the attach needs beyond the device configuration.
pub struct Plan {
    pub layout: StateLayout,
    pub plugin: PathBuf,
    pub export: String,
    /// Resolved: never `Auto`.
    pub frontend: Frontend,
    pub via: Via,
    /// How `pagerctl serve` runs (threads, write-back buffer).
    pub serve: commands::ServeOptions,
    /// A holder keeps the FUSE connection; serving processes may come and go.
    pub restartable: bool,
    /// A restartable kernel nbd device's request and dead-conn timeouts.
    pub nbd_timeouts: (Duration, Duration),
    /// Swap at this priority.
    pub swap: Option<i32>,
    /// Swap with `--discard=pages`.
    pub swap_discard: bool,
    pub start_timeout: Duration,
    pub queue_depth: Option<u32>,
}

/// Runs an attach; on failure undoes whatever it had done and returns the
/// first error. Returns the block device.
pub fn attach(plan: &Plan) -> Result<PathBuf> {
    let path = plan.layout.attach_json();
    let mut record = AttachRecord::new(plan.frontend, plan.via, &plan.export);
    record.save(&path)?;
    match run_steps(plan, &mut record) {
        Ok(device) => Ok(device),
        Err(e) => {
            tracing::error!("attach failed: {e:#}; undoing what was done");
            if let Err(undo) = undo_all(&plan.layout, &mut record, Duration::from_secs(30)) {
                return Err(e.context(format!(
                    "and undoing the attach failed too ({undo:#}); what is left is in {}",
                    path.display()
                )));
            }
            Err(e)
        }
    }
}

fn push(layout: &StateLayout, record: &mut AttachRecord, step: Step) -> Result<()> {
    tracing::info!("done: {}", step.describe());
    record.steps.push(step);
    record.save(&layout.attach_json())?;
    Ok(())
}

fn run_steps(plan: &Plan, record: &mut AttachRecord) -> Result<PathBuf> {
    let layout = &plan.layout;
    let device = match plan.frontend {
        Frontend::FuseUring | Frontend::Fuse => {
            if plan.frontend == Frontend::FuseUring {
                enable_uring(layout, record)?;
            }
            start_server(plan, record)?;
            loop_device(layout, record, layout.fuse_file())?
        }
        Frontend::Nbd if plan.restartable => start_nbd_holder(plan, record)?,
        Frontend::Nbd | Frontend::Auto => {
            start_nbdkit(plan, record)?;
            kernel_side_of_nbd(plan, record)?
        }
    };
    if let Some(depth) = plan.queue_depth {
        set_queue_depth(layout, record, &device, depth)?;
    }
    if let Some(priority) = plan.swap {
        // status.json is written as the device opened: donors that went
        // away since attach checked them mean no swap.
        if let Some(why) = ClientStatus::read(&layout.dir)
            .ok()
            .and_then(|s| s.cannot_place())
        {
            anyhow::bail!("the device cannot place a unit: {why}; swap is not turned on");
        }
        procs::run(&commands::mkswap(&device, "netpager"))?;
        procs::run(&commands::swapon(&device, priority, plan.swap_discard))?;
        push(
            layout,
            record,
            Step::Swap {
                device: device.clone(),
                priority,
            },
        )?;
    }
    Ok(device)
}

/// Creates the state directory (private: it holds keys' paths and the map).
pub fn make_state_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create state directory {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make {} private", dir.display()))
}
