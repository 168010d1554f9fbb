//! `pagerctl top`: one screen of a client's state, redrawn from two looks
//! at `status.json` (rates and latencies are what happened between them).
//! Pure drawing on a ratatui [`Frame`]; the terminal loop is pagerctl's.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Row, Table};
use ratatui::Frame;

use netpager_util::format_size;
use pager_client::metrics::FrontendInfo;
use pager_client::status::{ClientStatus, Progress, RequestReport};

/// What the screen shows besides the status itself.
#[derive(Clone, Debug, Default)]
pub struct Context {
    pub frontend: FrontendInfo,
    /// The serving process runs.
    pub server_alive: bool,
    /// Seconds since the status was written.
    pub age_secs: f64,
}

/// A latency bucket bound as people read it.
pub fn format_secs(s: f64) -> String {
    if s.is_infinite() {
        ">1.3s".into()
    } else if s < 1e-3 {
        format!("{:.0}µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1}ms", s * 1e3)
    } else {
        format!("{s:.2}s")
    }
}

fn rate(n: u64, dt: f64) -> f64 {
    if dt > 0.0 {
        n as f64 / dt
    } else {
        0.0
    }
}

/// One row per kind of request: rate, throughput, latency bounds, errors,
/// over the interval between `prev` and `cur`.
pub fn request_rows(cur: &ClientStatus, prev: Option<&ClientStatus>, dt: f64) -> Vec<[String; 6]> {
    cur.requests
        .iter()
        .map(|r| {
            let d = match prev.and_then(|p| p.requests.iter().find(|q| q.op == r.op)) {
                Some(before) => r.since(before),
                None => RequestReport {
                    op: r.op.clone(),
                    ..Default::default()
                },
            };
            let h = d.histogram();
            let q = |x| h.quantile_bound(x).map_or("-".into(), format_secs);
            [
                r.op.clone(),
                format!("{:.0}", rate(d.count, dt)),
                format!("{}/s", format_size(rate(d.bytes, dt) as u64)),
                q(0.5),
                q(0.99),
                r.errors.to_string(),
            ]
        })
        .collect()
}

fn job_gauge<'a>(title: &'a str, p: &'a Progress) -> Gauge<'a> {
    let ratio = if p.total == 0 {
        0.0
    } else {
        (p.done as f64 / p.total as f64).clamp(0.0, 1.0)
    };
    let label = match (&p.stalled, p.active) {
        (Some(why), _) => format!("{}/{} stalled: {why}", p.done, p.total),
        (None, true) => format!("{}/{}", p.done, p.total),
        (None, false) => "idle".into(),
    };
    let color = if p.stalled.is_some() {
        Color::Red
    } else {
        Color::Green
    };
    Gauge::default()
        .block(Block::default().borders(Borders::ALL).title(title))
        .gauge_style(Style::default().fg(color))
        .ratio(ratio)
        .label(label)
}

/// Rows of the donors' and the requests' tables, borders included.
fn heights(cur: &ClientStatus) -> (u16, u16) {
    (
        cur.donors.len() as u16 + 3,
        cur.requests.len().max(1) as u16 + 3,
    )
}

/// Rows the whole screen takes (`pagerctl top --batch` prints that many).
pub fn screen_height(cur: &ClientStatus) -> u16 {
    let (donors, reqs) = heights(cur);
    1 + 1 + reqs + donors + 3
}

/// Draws the whole screen.
pub fn draw(
    f: &mut Frame,
    cur: &ClientStatus,
    prev: Option<&ClientStatus>,
    dt: f64,
    ctx: &Context,
) {
    let t = &cur.totals;
    let (donors_h, reqs_h) = heights(cur);
    let [head, health, reqs, donors, jobs, _] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(reqs_h),
        Constraint::Length(donors_h),
        Constraint::Length(3),
        Constraint::Min(0),
    ])
    .areas(f.area());
    let fe = &ctx.frontend;
    let transport = match (&fe.transport, &fe.fallback) {
        (Some(t), Some(_)) => format!(" ({t}, io_uring not used)"),
        (Some(t), None) if *t != fe.frontend => format!(" ({t})"),
        _ => String::new(),
    };
    let server = if ctx.server_alive {
        ""
    } else {
        " · SERVER NOT RUNNING"
    };
    f.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled("netpager top", Style::default().add_modifier(Modifier::BOLD)),
            Span::raw(format!(
                " · client {} · mode {} ({}) · {} · front end {}{transport} · status {:.1}s old{server} · q quits",
                cur.client_id,
                cur.mode,
                cur.code,
                format_size(cur.size_bytes),
                if fe.frontend.is_empty() { "?" } else { &fe.frontend },
                ctx.age_secs,
            )),
        ])),
        head,
    );
    let (word, color) = if t.lost > 0 {
        (format!("LOST {} units", t.lost), Color::Red)
    } else if t.degraded > 0 {
        (format!("DEGRADED {} units", t.degraded), Color::Yellow)
    } else {
        ("healthy".to_string(), Color::Green)
    };
    f.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled(
                word,
                Style::default().fg(color).add_modifier(Modifier::BOLD),
            ),
            Span::raw(format!(
                " · placed {}/{} units · survives {} more donor failures · fallback {} copies{}",
                t.units_placed,
                t.units,
                t.can_lose,
                t.on_fallback,
                if t.throttled { " · THROTTLED" } else { "" },
            )),
        ])),
        health,
    );
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let rows = request_rows(cur, prev, dt).into_iter().map(Row::new);
    f.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(12),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(8),
            ],
        )
        .header(Row::new(["op", "req/s", "rate", "p50 ≤", "p99 ≤", "errors"]).style(bold))
        .block(
            Block::default()
                .borders(Borders::ALL)
                .title("Requests (last interval)"),
        ),
        reqs,
    );
    let donor_rows = cur.donors.iter().map(|d| {
        let before = prev.and_then(|p| p.donors.iter().find(|x| x.name == d.name));
        let dr = before.map_or(0, |b| d.reads.saturating_sub(b.reads));
        let dw = before.map_or(0, |b| d.writes.saturating_sub(b.writes));
        let style = if d.failed {
            Style::default().fg(Color::Red)
        } else {
            Style::default()
        };
        Row::new([
            d.name.clone(),
            if d.failed {
                "FAILED".into()
            } else {
                d.state.clone()
            },
            d.extents_held.to_string(),
            format_size(d.used_bytes),
            format!("{:.3}", d.f),
            format!("{:.0}/{:.0}%", d.share * 100.0, d.target_share * 100.0),
            format!("{:.0}%", d.utilisation * 100.0),
            format!("{:.0}", rate(dr, dt)),
            format!("{:.0}", rate(dw, dt)),
            d.errors.to_string(),
        ])
        .style(style)
    });
    f.render_widget(
        Table::new(
            donor_rows,
            [
                Constraint::Length(12),
                Constraint::Length(12),
                Constraint::Length(8),
                Constraint::Length(10),
                Constraint::Length(7),
                Constraint::Length(12),
                Constraint::Length(6),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(7),
            ],
        )
        .header(
            Row::new([
                "donor",
                "state",
                "extents",
                "used",
                "f_i",
                "share/target",
                "util",
                "reads/s",
                "writes/s",
                "errors",
            ])
            .style(bold),
        )
        .block(Block::default().borders(Borders::ALL).title("Donors")),
        donors,
    );
    let [rebuild, drain, rebalance] =
        Layout::horizontal([Constraint::Ratio(1, 3); 3]).areas::<3>(jobs);
    f.render_widget(job_gauge("Rebuild", &t.rebuild), rebuild);
    f.render_widget(job_gauge("Drain", &t.drain), drain);
    let moved = format!("Rebalance · {} moved", format_size(t.rebalance.moved_bytes));
    f.render_widget(job_gauge(&moved, &t.rebalance.pass), rebalance);
}

/// The screen as text, for tests and `pagerctl top --batch`.
pub fn render_text(
    cur: &ClientStatus,
    prev: Option<&ClientStatus>,
    dt: f64,
    ctx: &Context,
    area: Rect,
) -> String {
    let mut term =
        ratatui::Terminal::new(ratatui::backend::TestBackend::new(area.width, area.height))
            .expect("the test backend cannot fail");
    term.draw(|f| draw(f, cur, prev, dt, ctx))
        .expect("the test backend cannot fail");
    let buf = term.backend().buffer();
    let mut out = String::new();
    for y in 0..area.height {
        let line: String = (0..area.width)
            .map(|x| buf[(x, y)].symbol().to_string())
            .collect();
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pager_client::metrics::{RequestKind, RequestStats};
    use pager_client::status::{DonorReport, Totals};
    use std::time::Duration;

    #[test]
    fn screen_shows_rates_latency_donors_and_jobs() {
        let stats = RequestStats::default();
        let mut status = ClientStatus {
            client_id: "c1".into(),
            mode: "mirror".into(),
            code: "1+1".into(),
            donors: vec![DonorReport {
                name: "d1".into(),
                state: "idle".into(),
                reads: 10,
                share: 0.5,
                target_share: 0.25,
                ..Default::default()
            }],
            totals: Totals {
                degraded: 2,
                rebuild: Progress {
                    done: 1,
                    total: 4,
                    active: true,
                    stalled: None,
                },
                rebalance: pager_client::status::RebalanceReport {
                    moved_bytes: 5 << 20,
                    ..Default::default()
                },
                ..Default::default()
            },
            requests: stats.reports(),
            ..Default::default()
        };
        let prev = status.clone();
        for _ in 0..20 {
            stats.record(
                RequestKind::Write,
                1 << 20,
                Duration::from_micros(300),
                true,
            );
        }
        status.requests = stats.reports();
        status.donors[0].reads = 30;
        let ctx = Context {
            frontend: FrontendInfo {
                frontend: "fuse".into(),
                transport: Some("fuse".into()),
                fallback: None,
            },
            server_alive: true,
            age_secs: 0.5,
        };
        let text = render_text(&status, Some(&prev), 2.0, &ctx, Rect::new(0, 0, 120, 30));
        for want in [
            "client c1 · mode mirror (1+1)",
            "front end fuse",
            "DEGRADED 2 units",
            // 20 writes of 1 MiB in 2 s, each within 320 µs.
            "│write    10       10 MiB/s     320µs    320µs    0",
            "d1",
            "Rebuild",
            "1/4",
            "Rebalance · 5 MiB moved",
            "50/25%",
        ] {
            assert!(text.contains(want), "{want:?} missing from\n{text}");
        }
        // The donor's 20 reads over 2 s.
        let d1 = text.lines().find(|l| l.contains("│d1")).unwrap();
        assert!(d1.contains(" 10 "), "{d1}");
    }

    #[test]
    fn latency_bounds_read_well() {
        assert_eq!(format_secs(4e-5), "40µs");
        assert_eq!(format_secs(0.00128), "1.3ms");
        assert_eq!(format_secs(1.31072), "1.31s");
        assert_eq!(format_secs(f64::INFINITY), ">1.3s");
    }
}
