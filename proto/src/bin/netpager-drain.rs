//! netpager-drain: drains donors and waits until they hold nothing, so
//! that stopping them drops no client's pages. The donor package's prerm
//! runs it before a removal stops the donor (`--running`).
//!
//!     netpager-drain [--psk FILE] [--timeout SECS] ADDR...
//!     netpager-drain --running [--timeout SECS]
//!
//! ADDR is a donor's status endpoint. `--running` drains every donor
//! running on this machine from the packaged plugin (nbdkit processes with
//! `nbdkit-pager-server-plugin.so` loaded), each at its own `status=` with
//! its own `psk=`. A donor that is not empty by the timeout is told to stop
//! draining (it serves as before) and the exit status is 1, with what it
//! still holds.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use netpager_proto::{unclaimed_note, LabKey, StatusClient};
use netpager_util::{defaults, format_size};

const USAGE: &str = "usage: netpager-drain [--psk FILE] [--timeout SECS] ADDR...\n\
drains the donors whose status endpoints are ADDR and waits until they hold\n\
nothing (default timeout 600 s); one that does not is told to stop draining\n\
usage: netpager-drain --running [--timeout SECS]\n\
the same for every donor running on this machine (its status= and psk=)\n\
usage: netpager-drain --version";

/// A donor to drain: its status endpoint and lab key file.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    addr: String,
    psk: Option<PathBuf>,
    /// Where it was found (an nbdkit pid), for messages.
    what: String,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("netpager-drain: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut psk, mut timeout, mut running, mut addrs) = (
        None,
        Duration::from_secs(defaults::DRAIN_TIMEOUT_SECS),
        false,
        Vec::new(),
    );
    while let Some(a) = args.next() {
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            "-V" | "--version" => {
                println!("netpager-drain {}", netpager_util::version!());
                return Ok(());
            }
            "--psk" => psk = Some(PathBuf::from(args.next().context("--psk needs a FILE")?)),
            "--timeout" => {
                let v = args.next().context("--timeout needs SECS")?;
                let secs: f64 = v
                    .parse()
                    .ok()
                    .filter(|s: &f64| *s >= 0.0 && s.is_finite())
                    .with_context(|| format!("--timeout {v:?}: not a number of seconds"))?;
                timeout = Duration::from_secs_f64(secs);
            }
            "--running" => running = true,
            a if a.starts_with('-') => bail!("unknown option {a}\n{USAGE}"),
            a => addrs.push(a.to_string()),
        }
    }
    let targets = if running {
        if !addrs.is_empty() || psk.is_some() {
            bail!("--running takes each donor's address and key from its command line\n{USAGE}");
        }
        running_donors()?
    } else {
        if addrs.is_empty() {
            bail!("no donor given\n{USAGE}");
        }
        addrs
            .into_iter()
            .map(|addr| Target {
                what: format!("donor {addr}"),
                addr,
                psk: psk.clone(),
            })
            .collect()
    };
    let mut left = Vec::new();
    for t in &targets {
        if let Err(e) = drain(t, timeout) {
            left.push(format!("{}: {e:#}", t.what));
        }
    }
    if !left.is_empty() {
        bail!("{}", left.join("\n"));
    }
    Ok(())
}

/// Drains one donor; on a timeout, ends the drain again.
fn drain(t: &Target, timeout: Duration) -> Result<()> {
    let key = t
        .psk
        .as_deref()
        .map(|f| LabKey::from_psk_file(f, None))
        .transpose()?;
    let client = StatusClient {
        timeout: Duration::from_secs(defaults::STATUS_TIMEOUT_SECS),
        key,
    };
    let s = client.set_draining(&t.addr, true)?;
    println!(
        "{} ({}) draining: {} held; waiting up to {} s for its clients to move them",
        t.what,
        s.node_id,
        format_size(s.used_bytes),
        timeout.as_secs()
    );
    match client.wait_empty(&t.addr, timeout, |_| {})? {
        None => {
            println!("{} holds nothing", t.what);
            Ok(())
        }
        Some(s) => {
            let undone = client.set_draining(&t.addr, false).is_ok();
            bail!(
                "still holds {} after {} s{}; {}",
                format_size(s.used_bytes),
                timeout.as_secs(),
                unclaimed_note(&s),
                if undone {
                    "it was told to stop draining and serves as before"
                } else {
                    "it could not be told to stop draining (pagerctl donor-drain ADDR --undo)"
                }
            )
        }
    }
}

/// Every donor running here from the packaged plugin (what removing the
/// package stops), each with the `status=` and `psk=` of its command line.
fn running_donors() -> Result<Vec<Target>> {
    let mut out = Vec::new();
    if !Path::new("/proc/self").exists() {
        eprintln!(
            "netpager-drain: /proc is not mounted: no running donor can be seen, none is drained"
        );
        return Ok(out);
    }
    for e in std::fs::read_dir("/proc").context("cannot list /proc")? {
        let Ok(e) = e else { continue };
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let maps = std::fs::read_to_string(e.path().join("maps")).unwrap_or_default();
        if !maps.contains("nbdkit-pager-server-plugin.so") {
            continue;
        }
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let argv: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        out.push(target_of(&pid, &argv)?);
    }
    Ok(out)
}

/// The donor that nbdkit `pid` with command line `argv` serves.
fn target_of(pid: &str, argv: &[String]) -> Result<Target> {
    let param = |k: &str| {
        argv.iter()
            .find_map(|a| a.strip_prefix(k)?.strip_prefix('='))
            .map(str::to_string)
    };
    let what = format!("donor nbdkit pid {pid}");
    let Some(status) = param("status") else {
        bail!("{what} has no status endpoint (status=), so it cannot be drained: stop it yourself once its clients have moved their pages");
    };
    Ok(Target {
        addr: reachable(&status),
        psk: param("psk").map(PathBuf::from),
        what: format!("{what} (status {status})"),
    })
}

/// A listening address as this machine reaches it: a wildcard bind is
/// reached on loopback.
fn reachable(listen: &str) -> String {
    match netpager_util::HostPort::parse(listen) {
        Ok(hp) if hp.host == "0.0.0.0" => format!("127.0.0.1:{}", hp.port),
        Ok(hp) if hp.host == "::" => format!("[::1]:{}", hp.port),
        _ => listen.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split(' ').map(str::to_string).collect()
    }

    #[test]
    fn a_running_donor_is_drained_where_its_command_line_says() {
        let t = target_of(
            "42",
            &argv("/usr/bin/nbdkit --foreground pager-server psk=/run/credentials/x/netpager.psk size=4G status=0.0.0.0:10810"),
        )
        .unwrap();
        assert_eq!(t.addr, "127.0.0.1:10810");
        assert_eq!(
            t.psk.as_deref(),
            Some(Path::new("/run/credentials/x/netpager.psk"))
        );
        assert_eq!(reachable("[::]:10810"), "[::1]:10810");
        assert_eq!(reachable("10.0.0.2:10810"), "10.0.0.2:10810");
        let e = target_of("7", &argv("nbdkit pager-server size=1G")).unwrap_err();
        assert!(e.to_string().contains("cannot be drained"), "{e}");
    }
}
