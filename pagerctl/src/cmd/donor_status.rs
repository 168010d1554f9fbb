//! `pagerctl donor-status`: donors' status endpoints, read through
//! `netpager_proto`, as tables or JSON.

use anyhow::Result;
use netpager_proto::{compression_ratio, DonorStatus, StatusClient};
use netpager_util::format_size;

use super::{query_donor, EndpointArgs};

#[derive(clap::Args)]
pub struct Args {
    /// Donors' status endpoints, HOST:PORT (one or more).
    #[arg(required = true, value_name = "ADDR")]
    addrs: Vec<String>,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    endpoint: EndpointArgs,
}

pub fn run(a: Args) -> Result<()> {
    let client = a.endpoint.client()?;
    status(&a.addrs, a.json, &client)
}

/// Prints the donors' status: tables one after the other, or JSON (an
/// object for one donor, an array of them for several).
fn status(addrs: &[String], json: bool, client: &StatusClient) -> Result<()> {
    let statuses = addrs
        .iter()
        .map(|a| query_donor(client, a))
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

/// A ratio as "2.50x", or "-" while nothing takes memory.
fn ratio(logical: u64, stored: u64) -> String {
    compression_ratio(logical, stored).map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
}

/// A donor's status as a two-column table, then its exports.
fn render(addr: &str, s: &DonorStatus) -> String {
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
        (
            "compress / ratio",
            format!(
                "{}: {} held in {} ({})",
                s.compress,
                format_size(s.logical_bytes),
                format_size(s.used_bytes),
                ratio(s.logical_bytes, s.used_bytes)
            ),
        ),
        (
            "recompress",
            if s.recompress.is_empty() {
                "off".to_string()
            } else {
                format!(
                    "{} once cold: {} pages repacked, {} saved",
                    s.recompress,
                    s.recompressed_pages,
                    format_size(s.recompress_saved_bytes)
                )
            },
        ),
        (
            "capacity",
            format!(
                "{} at {:.2}x (raw {})",
                format_size(s.capacity_bytes),
                s.offered_ratio,
                format_size(s.free_bytes)
            ),
        ),
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
        out.push(format!(
            "{:<nw$}  {:>12}  {:>12}  {:>12}  {:>7}  {:>7}",
            "export", "size", "logical", "used", "ratio", "clients"
        ));
        for e in &s.exports {
            out.push(format!(
                "{:<nw$}  {:>12}  {:>12}  {:>12}  {:>7}  {:>7}",
                e.name,
                format_size(e.size_bytes),
                format_size(e.logical_bytes),
                format_size(e.used_bytes),
                ratio(e.logical_bytes, e.used_bytes),
                e.clients
            ));
        }
        for e in s.exports.iter().filter(|e| !e.broken.is_empty()) {
            out.push(format!(
                "SHUT: {}: {}; its clients rebuild its pages elsewhere, restart the donor to free its memory",
                e.name, e.broken
            ));
        }
        let unclaimed = netpager_proto::unclaimed_exports(s);
        if !unclaimed.is_empty() {
            out.push(format!(
                "UNCLAIMED: no client is connected to {}: pages of a detached device (pagerctl release --state-dir DIR on its client frees them) or of a client that is gone",
                unclaimed.join(", ")
            ));
        }
    }
    out.join("\n")
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
            logical_bytes: 20 << 20,
            capacity_bytes: 30 << 20,
            offered_ratio: 2.5,
            free_bytes: 12 << 20,
            compress: "lz4".into(),
            exports: vec![
                ExportUsage {
                    name: "alice".into(),
                    size_bytes: 64 << 20,
                    used_bytes: 8 << 20,
                    logical_bytes: 20 << 20,
                    clients: 1,
                    ..Default::default()
                },
                ExportUsage {
                    name: "bob".into(),
                    size_bytes: 64 << 20,
                    used_bytes: 4 << 20,
                    logical_bytes: 4 << 20,
                    clients: 0,
                    broken: "index out of bounds".into(),
                },
            ],
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
            t.lines().any(|l| l.starts_with("alice")
                && l.contains("64 MiB")
                && l.ends_with("2.50x        1")),
            "{t}"
        );
        assert!(
            t.contains("lz4: 20 MiB held in 8 MiB (2.50x)")
                && t.contains("30 MiB at 2.50x (raw 12 MiB)"),
            "{t}"
        );
        // Pages nobody is connected to are named, with what frees them.
        let note = t.lines().last().unwrap();
        assert!(
            note.starts_with("UNCLAIMED")
                && note.contains("bob (4 MiB)")
                && !note.contains("alice"),
            "{t}"
        );
        // A shut export is named with why, and what it costs.
        assert!(
            t.lines()
                .any(|l| l.starts_with("SHUT: bob: index out of bounds;")),
            "{t}"
        );
    }
}
