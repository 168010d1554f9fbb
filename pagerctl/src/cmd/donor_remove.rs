//! `pagerctl donor-remove`: removes a donor from an attached device through
//! its control socket (either front end), and with `--wait` follows the
//! removal in `status.json` until the donor has left.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use netpager_util::format_size;
use pager_client::device::control::Request;
use pager_client::status::ClientStatus;

use super::{ask_device, parse_secs, Progress};

/// How long the device may take to answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// The donor's name (as status shows it) or its NBD address.
    #[arg(value_name = "NAME|ADDR")]
    donor: String,
    /// Wait until it holds nothing and has left the set, printing progress.
    #[arg(long)]
    wait: bool,
    /// Give up waiting after this long (the removal goes on).
    #[arg(long, default_value = "3600", value_parser = parse_secs, value_name = "SECS")]
    wait_timeout: Duration,
}

pub fn run(a: Args) -> Result<()> {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let reply = ask_device(
        &a.state_dir,
        &Request::DonorRemove {
            donor: a.donor.clone(),
        },
        ANSWER_TIMEOUT,
    )?;
    if !a.wait {
        return Ok(());
    }
    let name = reply.donor.unwrap_or(a.donor);
    wait_until_left(&a.state_dir, &name, since, a.wait_timeout)
}

/// Where a removal stands in a status.
#[derive(Debug, PartialEq)]
enum Removal {
    /// Still in the set, holding this much.
    Moving { held_bytes: u64, extents: u64 },
    /// Left the set (at or after the request).
    Left,
    /// Back in the set and not leaving (added again meanwhile).
    Stopped,
}

fn removal(s: &ClientStatus, name: &str, since_unix: u64) -> Removal {
    match s.donors.iter().find(|d| d.name == name) {
        Some(d) if d.leaving => Removal::Moving {
            held_bytes: d.extents_held * s.extent_bytes,
            extents: d.extents_held,
        },
        Some(_) => Removal::Stopped,
        None if s
            .left
            .iter()
            .any(|l| l.name == name && l.left_unix + 1 >= since_unix) =>
        {
            Removal::Left
        }
        // Not written since: the removal is still being set up.
        None => Removal::Moving {
            held_bytes: 0,
            extents: 0,
        },
    }
}

fn wait_until_left(
    dir: &std::path::Path,
    name: &str,
    since_unix: u64,
    limit: Duration,
) -> Result<()> {
    let mut progress = Progress::default();
    let start = Instant::now();
    let mut first: Option<u64> = None;
    loop {
        let s = ClientStatus::read(dir)
            .with_context(|| format!("reading {}/status.json", dir.display()))?;
        match removal(&s, name, since_unix) {
            Removal::Left => break,
            Removal::Stopped => bail!("donor {name} is a member again (added back while leaving)"),
            Removal::Moving {
                held_bytes,
                extents,
            } => {
                let initial = *first.get_or_insert(held_bytes.max(1));
                let moved = initial.saturating_sub(held_bytes);
                let line = format!(
                    "removing {name}: {extents} extents ({}) still on it, {} moved ({:.0}%)",
                    format_size(held_bytes),
                    format_size(moved),
                    moved as f64 * 100.0 / initial as f64
                );
                progress.show(line);
            }
        }
        if start.elapsed() > limit {
            bail!("donor {name} has not left after {limit:?}; the removal goes on (pagerctl status shows it)");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    progress.done();
    println!(
        "donor {name} holds nothing of ours and left the set after {:.1} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use netpager_membership::Joined;
    use pager_client::status::{DonorReport, LeftDonor};

    fn status(donors: Vec<DonorReport>, left: Vec<LeftDonor>) -> ClientStatus {
        ClientStatus {
            extent_bytes: 1 << 20,
            donors,
            left,
            ..Default::default()
        }
    }

    #[test]
    fn a_removal_is_followed_until_the_donor_has_left() {
        let leaving = DonorReport {
            name: "d1".into(),
            leaving: true,
            extents_held: 3,
            ..Default::default()
        };
        assert_eq!(
            removal(&status(vec![leaving.clone()], vec![]), "d1", 100),
            Removal::Moving {
                held_bytes: 3 << 20,
                extents: 3
            }
        );
        let left = LeftDonor {
            name: "d1".into(),
            address: "127.0.0.2:1".into(),
            joined: Joined::Added,
            left_unix: 100,
            why: "removed".into(),
        };
        assert_eq!(
            removal(&status(vec![], vec![left.clone()]), "d1", 100),
            Removal::Left
        );
        // An older departure of the same name is not this one.
        assert_ne!(
            removal(&status(vec![], vec![left]), "d1", 200),
            Removal::Left
        );
        let back = DonorReport {
            leaving: false,
            ..leaving
        };
        assert_eq!(
            removal(&status(vec![back], vec![]), "d1", 100),
            Removal::Stopped
        );
    }
}
