//! `pagerctl donor-status` and `pagerctl donor-drain`: one donor's status
//! endpoint, read and commanded through `netpager_proto`.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use netpager_proto::{DonorStatus, StatusClient};

use netpager_util::format_size;

/// A donor's status as a two-column table, then its exports.
pub fn render(addr: &str, s: &DonorStatus) -> String {
    let state = if s.state_reason.is_empty() {
        s.state().word().to_string()
    } else {
        format!("{} ({})", s.state().word(), s.state_reason)
    };
    let rows = [
        ("donor", addr.to_string()),
        ("node", s.node_id.clone()),
        ("state", state),
        ("budget", format_size(s.budget_bytes)),
        ("used", format_size(s.used_bytes)),
        ("free", format_size(s.free_bytes)),
        ("reserve", format_size(s.reserve_bytes)),
        ("MemAvailable", format_size(s.mem_available_bytes)),
        ("page size", format_size(s.page_size)),
        (
            "age of x-th oldest page",
            format!("x={}: {} ms", s.age_x, s.age_x_ms),
        ),
        (
            "utilisation / U*",
            format!(
                "{:.3} / {:.2} (unused {:.3})",
                s.utilisation, s.u_star, s.u_unused
            ),
        ),
        ("mean service time", format!("{:.1} us", s.mean_service_us)),
        ("reads / writes", format!("{} / {}", s.reads, s.writes)),
        (
            "bytes read / written",
            format!(
                "{} / {}",
                format_size(s.bytes_read),
                format_size(s.bytes_written)
            ),
        ),
        ("trims / zeroes", format!("{} / {}", s.trims, s.zeroes)),
        ("ENOSPC refusals", s.enospc.to_string()),
        ("uptime", format!("{:.1} s", s.uptime_ms as f64 / 1000.0)),
    ];
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out: Vec<String> = rows.iter().map(|(k, v)| format!("{k:<w$}  {v}")).collect();
    if !s.exports.is_empty() {
        let nw = s
            .exports
            .iter()
            .map(|e| e.name.len())
            .max()
            .unwrap_or(0)
            .max("export".len());
        out.push(String::new());
        out.push(format!("{:<nw$}  {:>12}  {:>12}", "export", "size", "used"));
        for e in &s.exports {
            out.push(format!(
                "{:<nw$}  {:>12}  {:>12}",
                e.name,
                format_size(e.size_bytes),
                format_size(e.used_bytes)
            ));
        }
    }
    out.join("\n")
}

fn query(client: &StatusClient, addr: &str) -> Result<DonorStatus> {
    client
        .query(addr)
        .with_context(|| format!("cannot read the status of donor {addr}"))
}

/// Prints the donors' status: tables one after the other, or JSON (an
/// object for one donor, an array of them for several).
pub fn status(addrs: &[String], json: bool, client: &StatusClient) -> Result<()> {
    let statuses = addrs
        .iter()
        .map(|a| query(client, a))
        .collect::<Result<Vec<_>>>()?;
    if json {
        let mut v: Vec<_> = statuses.iter().map(netpager_proto::status_json).collect();
        let out = if v.len() == 1 {
            v.remove(0)
        } else {
            serde_json::Value::Array(v)
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let tables: Vec<String> = addrs
            .iter()
            .zip(&statuses)
            .map(|(a, s)| render(a, s))
            .collect();
        println!("{}", tables.join("\n\n"));
    }
    Ok(())
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

/// The progress line of a drain: how much is left and how much has moved.
pub fn drain_progress(addr: &str, initial_used: u64, used: u64) -> String {
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

pub fn drain(
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
    let mut used = initial;
    while used > 0 {
        if start.elapsed() > wait_limit {
            bail!(
                "donor {addr} still holds {} after waiting {wait_limit:?}",
                format_size(used)
            );
        }
        std::thread::sleep(Duration::from_millis(500));
        used = query(client, addr)?.used_bytes;
        progress.show(drain_progress(addr, initial, used));
    }
    progress.done();
    println!(
        "donor {addr} is empty after {:.1} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use netpager_proto::{DonorState, ExportUsage};

    #[test]
    fn table_names_state_reason_and_exports() {
        let s = DonorStatus {
            node_id: "d1".into(),
            state: DonorState::Draining as i32,
            state_reason: "asked by 127.0.0.1".into(),
            used_bytes: 8 << 20,
            exports: vec![ExportUsage {
                name: "alice".into(),
                size_bytes: 64 << 20,
                used_bytes: 8 << 20,
            }],
            ..Default::default()
        };
        let t = render("127.0.0.2:7070", &s);
        assert!(t.contains("draining (asked by 127.0.0.1)"), "{t}");
        assert!(
            t.lines()
                .any(|l| l.starts_with("used") && l.ends_with("8 MiB")),
            "{t}"
        );
        assert!(
            t.lines()
                .any(|l| l.starts_with("alice") && l.contains("64 MiB")),
            "{t}"
        );
    }

    #[test]
    fn drain_progress_line() {
        assert_eq!(
            drain_progress("a:1", 4 << 20, 1 << 20),
            "draining a:1: 1 MiB still held, 3 MiB moved away (75%)"
        );
        assert!(drain_progress("a:1", 0, 0).ends_with("(100%)"));
    }
}
