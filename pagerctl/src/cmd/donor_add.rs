//! `pagerctl donor-add`: adds a donor to an attached device through its
//! control socket (either front end).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use pager_client::device::control::Request;

use super::ask_device;

/// How long the device may take to answer (a donor-add connects to the
/// donor first).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// The donor, as `attach --donor` takes it:
    /// HOST:PORT[/EXPORT][,status=HOST:PORT][,name=NAME].
    #[arg(value_name = "SPEC")]
    spec: String,
}

pub fn run(a: Args) -> Result<()> {
    // Parsed here too, so a typo is named before the device is asked.
    a.spec
        .parse::<netpager_membership::DonorSpec>()
        .map_err(anyhow::Error::msg)?;
    ask_device(
        &a.state_dir,
        &Request::DonorAdd { spec: a.spec },
        ANSWER_TIMEOUT,
    )
    .map(|_| ())
}
