//! `pagerctl status`: the device's own status (status.json, written by the
//! serving process about once a second) plus what pagerctl attached, the
//! front end in use and whether the serving process still runs.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use pager_client::status::{render_table, ClientStatus};
use pagerctl::attach::record::{HolderInfo, ServeInfo, StateLayout};
use pagerctl::attach::{AttachRecord, Frontend};

use crate::procs;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// How old status.json may be while the server runs before it is called stale
/// (the device rewrites it about once a second).
const STALE_MS: u64 = 10_000;

/// What `pagerctl status` exits with (pagerctl(1), EXIT STATUS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Attached, serving, every unit whole and new ones placeable: 0.
    Ok,
    /// Nothing attached in the state directory: 3.
    NotAttached,
    /// Attached, but the serving process is gone or its status is stale: 4.
    NotServing,
    /// Serving, but units miss copies, data is lost, the write-through
    /// copy stopped, or no new unit can be placed: 5.
    Degraded,
}

impl Health {
    pub fn code(self) -> i32 {
        match self {
            Health::Ok => 0,
            Health::NotAttached => 3,
            Health::NotServing => 4,
            Health::Degraded => 5,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Health::Ok => "ok",
            Health::NotAttached => "not attached",
            Health::NotServing => "not serving",
            Health::Degraded => "degraded",
        }
    }

    /// From what status found: attached, serving (the serving process runs
    /// and wrote its status lately), whether it warns (a restartable
    /// device's holder is gone), and the device's own status.
    fn of(attached: bool, serving: bool, warned: bool, status: Option<&ClientStatus>) -> Health {
        if !attached {
            return Health::NotAttached;
        }
        let Some(s) = status.filter(|_| serving) else {
            return Health::NotServing;
        };
        let t = &s.totals;
        if warned
            || t.degraded > 0
            || t.lost > 0
            || t.unfound_pages > 0
            || t.writethrough_error.is_some()
            || s.cannot_place().is_some()
        {
            Health::Degraded
        } else {
            Health::Ok
        }
    }
}

pub fn run(a: Args) -> Result<Health> {
    let layout = StateLayout::new(&a.state_dir);
    if !layout.dir.is_dir() {
        bail!("state directory {} does not exist", layout.dir.display());
    }
    let record = AttachRecord::load(&layout.attach_json())?;
    let server = record.as_ref().and_then(|r| r.server_process());
    let server_alive = server.is_some_and(|(pid, started)| procs::owned(pid, started));
    let frontend = record.as_ref().map(|r| r.frontend);
    let serve = ServeInfo::load(&layout.serve_json());
    let restartable = record.as_ref().is_some_and(|r| r.holder().is_some());
    // A restartable device's `server` is its holder; the serving process
    // is the one serve.json names (kernel nbd: holder.json, nbdkit).
    let holder = restartable.then(|| HolderInfo::load(&layout.holder_json()));
    let serving = match frontend {
        Some(Frontend::Nbd) => holder.clone().flatten().and_then(|h| h.serve_pid),
        _ => serve.as_ref().map(|s| s.pid),
    }
    .filter(|&p| procs::alive(p));
    let warning = restartable.then(|| holder_warning(server_alive)).flatten();
    let serving_pid = if restartable {
        serving
    } else {
        server.filter(|_| server_alive).map(|(pid, _)| pid)
    };
    let io_flusher = serving_pid.and_then(procs::io_flusher);
    let swapping = record.as_ref().is_some_and(|r| r.swapping());
    let log = match frontend {
        Some(Frontend::Nbd) => layout.nbdkit_log(),
        _ => layout.serve_log(),
    };
    let status = match ClientStatus::read(&layout.dir) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => bail!("cannot read the device status: {e}"),
    };
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let age_ms = status
        .as_ref()
        .map(|s| now_ms.saturating_sub(s.updated_unix_ms));
    let stale = !server_alive || age_ms.is_some_and(|a| a > STALE_MS);
    let attached = record.as_ref().is_some_and(|r| !r.steps.is_empty());
    let is_serving = if restartable {
        serving.is_some()
    } else {
        server_alive
    } && age_ms.is_none_or(|a| a <= STALE_MS);
    let health = Health::of(attached, is_serving, warning.is_some(), status.as_ref());
    if a.json {
        let v = serde_json::json!({
            "state_dir": layout.dir,
            "attached": attached,
            "health": health.word(),
            "device": record.as_ref().and_then(|r| r.device()),
            "frontend": frontend,
            "transport": serve.as_ref().map(|s| s.transport.clone()),
            "transport_fallback": serve.as_ref().and_then(|s| s.fallback.clone()),
            "via": record.as_ref().map(|r| r.via),
            "swap": record.as_ref().is_some_and(|r| r.swapping()),
            "steps": record.as_ref().map(|r| r.steps.clone()).unwrap_or_default(),
            "server": server.map(|(pid, _)| serde_json::json!({ "pid": pid, "alive": server_alive, "log": log })),
            "status": status,
            "status_age_ms": age_ms,
            "stale": stale,
            "restartable": restartable,
            "holder": holder.as_ref().map(|h| serde_json::json!({
                "alive": server_alive,
                "info": h,
                "serving_pid": serving,
            })),
            "warning": warning,
            "io_flusher": io_flusher,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(health);
    }
    match &record {
        Some(r) if !r.steps.is_empty() => {
            let steps: Vec<String> = r.steps.iter().map(|s| s.describe()).collect();
            println!("attached: {}", steps.join("; "));
        }
        _ => println!("not attached ({})", layout.dir.display()),
    }
    if let Some(f) = frontend.filter(|_| server.is_some()) {
        match &serve {
            Some(ServeInfo {
                transport,
                fallback: Some(why),
                ..
            }) => println!("front end: {transport} (io_uring not used: {why})"),
            Some(s) => println!("front end: {}", s.transport),
            None => println!("front end: {f}"),
        }
    }
    if let (true, Some((pid, _))) = (restartable, server) {
        let h = holder.flatten().unwrap_or_default();
        let line = match serving {
            Some(s) => format!("running, pid {s}"),
            None => "NOT RUNNING (being restarted)".to_string(),
        };
        let held = h
            .last_held_ms
            .map(|ms| format!(", requests held {ms} ms at the last"))
            .unwrap_or_default();
        if frontend == Some(Frontend::Nbd) {
            let expired = match h.expired {
                0 => String::new(),
                n => {
                    format!("; the dead-conn timeout passed {n} times: the kernel failed requests")
                }
            };
            println!(
                "server: {line}; restartable, kernel nbd held by pid {pid}; {} restarts ({} after a crash){held}{expired}",
                h.restarts, h.crashes
            );
        } else {
            println!(
                "server: {line}; restartable, connection held by pid {pid}; {} restarts ({} after a crash){held}; {} requests resent ({} at the last)",
                h.restarts, h.crashes, h.resent_total, h.resent_last
            );
        }
    }
    if let Some(w) = &warning {
        println!("WARNING: {w}");
    }
    if let (true, Some(false), Some(pid)) = (swapping, io_flusher, serving_pid) {
        println!("WARNING: {}", io_flusher_warning(pid));
    }
    match server.filter(|_| !restartable) {
        Some((pid, _)) if server_alive => println!("server: running, pid {pid}"),
        Some((pid, _)) => {
            println!(
                "server: NOT RUNNING (pid {pid} is gone; see {})",
                log.display()
            )
        }
        None => {}
    }
    match (&status, age_ms) {
        (Some(s), Some(age)) => {
            if stale {
                println!(
                    "status below is {:.1} s old and may be out of date",
                    age as f64 / 1000.0
                );
            }
            println!();
            print!("{}", render_table(s));
        }
        _ => println!(
            "no device status yet ({} missing)",
            layout.status_json().display()
        ),
    }
    if health != Health::Ok {
        println!(
            "\nhealth: {} (exit status {})",
            health.word(),
            health.code()
        );
    }
    Ok(health)
}

/// What status says when a restartable device's holder is gone: the
/// promise is broken before anything is lost, and the operator can act.
fn holder_warning(holder_alive: bool) -> Option<String> {
    (!holder_alive).then(|| {
        "the connection holder is gone: the device is no longer restartable, and if the serving process exits now the device is lost (its swapped pages with it); detach and attach again when swap can go off".to_string()
    })
}

/// What status says of a swap device whose serving process could not be
/// made an I/O flusher (its log says why): global reclaim can then make it
/// wait on its own device.
fn io_flusher_warning(pid: u32) -> String {
    format!(
        "the serving process (pid {pid}) is not an I/O flusher (PR_SET_IO_FLUSHER needs CAP_SYS_RESOURCE): if the whole machine runs out of memory, reclaim on its behalf can write to this swap device and wait on itself, hanging the device (pagerctl(1) MEMORY PRESSURE)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use pager_client::status::DonorReport;

    #[test]
    fn health_follows_attach_serving_and_the_device() {
        let mut s = ClientStatus {
            mode: "none".into(),
            code: "1+0".into(),
            extent_bytes: 1 << 20,
            donors: vec![DonorReport {
                name: "d1".into(),
                state: "idle".into(),
                slots_free: 8,
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(Health::of(false, false, false, None), Health::NotAttached);
        assert_eq!(Health::of(true, false, false, Some(&s)), Health::NotServing);
        assert_eq!(Health::of(true, true, false, None), Health::NotServing);
        assert_eq!(Health::of(true, true, false, Some(&s)), Health::Ok);
        assert_eq!(
            Health::of(true, true, true, Some(&s)),
            Health::Degraded,
            "holder gone"
        );
        s.totals.lost = 1;
        assert_eq!(Health::of(true, true, false, Some(&s)), Health::Degraded);
        s.totals.lost = 0;
        s.donors[0].failed = true;
        assert_eq!(
            Health::of(true, true, false, Some(&s)),
            Health::Degraded,
            "no donor takes pages"
        );
        let codes: Vec<i32> = [
            Health::Ok,
            Health::NotAttached,
            Health::NotServing,
            Health::Degraded,
        ]
        .iter()
        .map(|h| h.code())
        .collect();
        assert_eq!(codes, [0, 3, 4, 5]);
    }
}
