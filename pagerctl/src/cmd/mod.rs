//! The subcommands, one module each (named as on the command line, `-` as
//! `_`): its clap arguments `Args` and its `run`. Here, what several share.

pub mod attach;
pub mod detach;
pub mod discover;
pub mod donor_add;
pub mod donor_drain;
pub mod donor_remove;
pub mod donor_status;
pub mod durability;
pub mod forget_lost;
pub mod hold;
pub mod hold_nbd;
pub mod psk;
pub mod release;
pub mod restart;
pub mod serve;
pub mod simulate;
pub mod status;
pub mod top;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};
use netpager_proto::{DonorStatus, StatusClient};
use pager_client::device::control::{self, Request};

/// This host's name: a client's default id (and TLS identity).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "client".to_string())
}

/// Seconds, 0 allowed (0 turns the thing off).
pub fn parse_secs_or_zero(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    parse_secs(s)
}

/// Seconds, more than 0.
/// A size as `--writeback-buffer` takes it (`8M`), checked, kept as given
/// for the serving processes' command lines.
pub fn check_size(s: &str) -> Result<String, String> {
    netpager_util::parse_size(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("{s:?} must be a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// How to reach donors' status endpoints.
#[derive(clap::Args)]
pub struct EndpointArgs {
    #[arg(long, default_value = "5", value_parser = parse_secs, value_name = "SECS")]
    timeout: Duration,
    /// The lab's key file (`username:hexkey`, as given to the donors' psk=):
    /// requests are signed and replies checked. Needed for donors started
    /// with psk=.
    #[arg(long, value_name = "FILE")]
    psk: Option<PathBuf>,
}

impl EndpointArgs {
    pub fn client(&self) -> Result<netpager_proto::StatusClient> {
        let key = self
            .psk
            .as_deref()
            .map(|f| netpager_proto::LabKey::from_psk_file(f, None))
            .transpose()?;
        Ok(netpager_proto::StatusClient {
            timeout: self.timeout,
            key,
        })
    }
}

/// A progress line on standard error: on a terminal redrawn in place, in a
/// log a new line only when it changed.
pub struct Progress {
    tty: bool,
    last: Option<String>,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            tty: std::io::stderr().is_terminal(),
            last: None,
        }
    }
}

impl Progress {
    pub fn show(&mut self, line: String) {
        if self.tty {
            eprint!("\r{line}\x1b[K");
            let _ = std::io::stderr().flush();
        } else if self.last.as_ref() != Some(&line) {
            eprintln!("{line}");
        }
        self.last = Some(line);
    }

    /// Ends the redrawn line.
    pub fn done(&self) {
        if self.tty && self.last.is_some() {
            eprintln!();
        }
    }
}

/// A donor's status, or an error naming the donor and what to do.
pub fn query_donor(client: &StatusClient, addr: &str) -> Result<DonorStatus> {
    client.query(addr).map_err(|e| {
        anyhow::anyhow!(
            "cannot read the status of donor {addr}: {}",
            pager_client::probe::status_failure(addr, &e)
        )
    })
}

/// Sends `req` to the attached device's control socket (either front end)
/// and prints its answer; a refusal is the error.
pub fn ask_device(state_dir: &Path, req: &Request, timeout: Duration) -> Result<control::Reply> {
    let reply = control::send(state_dir, req, timeout)?;
    if !reply.ok {
        bail!("{}", reply.message);
    }
    println!("{}", reply.message);
    Ok(reply)
}
