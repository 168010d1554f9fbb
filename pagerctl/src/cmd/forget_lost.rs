//! `pagerctl forget-lost`: gives up on an attached device's lost data
//! through its control socket (either front end): lost extents are placed
//! again, and they and the pages that read as lost read as zeros.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use pager_client::device::control::Request;
use pagerctl::attach::record::StateLayout;

use super::ask_device;

/// Forgetting writes every lost extent's new place (zeros, and parity).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Only these extents, A..B (inclusive, as status lists them) or A;
    /// default every lost extent.
    #[arg(long, value_name = "A..B", value_parser = pagerctl::lost::parse_extents)]
    extents: Option<(u64, u64)>,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    if !layout.attach_json().exists() {
        bail!(
            "{} is not attached (no {}): forget-lost talks to the running device",
            layout.dir.display(),
            layout.attach_json().display()
        );
    }
    ask_device(
        &layout.dir,
        &Request::ForgetLost { extents: a.extents },
        ANSWER_TIMEOUT,
    )
    .map(|_| ())
}
