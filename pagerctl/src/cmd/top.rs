//! `pagerctl top`: a live view of one client, redrawn from status.json
//! every interval until q, Esc or Ctrl-C (drawing: `pagerctl::top`).

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use pager_client::status::ClientStatus;
use pagerctl::attach::record::{frontend_info, StateLayout};
use pagerctl::attach::AttachRecord;
use pagerctl::top::{draw, Context};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::widgets::Paragraph;
use ratatui::DefaultTerminal;

use super::parse_secs;
use crate::procs;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Seconds between redraws.
    #[arg(long, default_value = "1", value_parser = parse_secs, value_name = "SECS")]
    interval: Duration,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    if !layout.dir.is_dir() {
        bail!("state directory {} does not exist", layout.dir.display());
    }
    let mut term = ratatui::try_init().context("cannot set up the terminal")?;
    let r = watch(&mut term, &layout, a.interval);
    ratatui::restore();
    r
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether the serving process (pagerctl serve or nbdkit) still runs.
fn server_alive(layout: &StateLayout) -> bool {
    AttachRecord::load(&layout.attach_json())
        .ok()
        .flatten()
        .and_then(|r| r.server_process())
        .is_some_and(|(pid, started)| procs::owned(pid, started))
}

fn watch(term: &mut DefaultTerminal, layout: &StateLayout, interval: Duration) -> Result<()> {
    // Rates are taken between the two latest distinct versions of
    // status.json, which the device rewrites about once a second.
    let mut older: Option<ClientStatus> = None;
    let mut latest: Option<ClientStatus> = None;
    loop {
        let read = ClientStatus::read(&layout.dir);
        if let Ok(s) = read.as_ref() {
            if latest.as_ref().map(|l| l.updated_unix_ms) != Some(s.updated_unix_ms) {
                older = latest.replace(s.clone());
            }
        }
        match (&latest, &read) {
            (Some(cur), _) => {
                let dt = older.as_ref().map_or(0.0, |o| {
                    cur.updated_unix_ms.saturating_sub(o.updated_unix_ms) as f64 / 1000.0
                });
                let ctx = Context {
                    frontend: frontend_info(layout),
                    server_alive: server_alive(layout),
                    age_secs: now_ms().saturating_sub(cur.updated_unix_ms) as f64 / 1000.0,
                };
                term.draw(|f| draw(f, cur, older.as_ref(), dt, &ctx))?;
            }
            (None, Err(e)) => {
                let msg = format!(
                    "no device status yet ({}: {e}); q quits",
                    layout.status_json().display()
                );
                term.draw(|f| f.render_widget(Paragraph::new(msg), f.area()))?;
            }
            (None, Ok(_)) => unreachable!("a status read is kept as the latest"),
        }
        let deadline = Instant::now() + interval;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !event::poll(left)? {
                break;
            }
            if let Event::Key(k) = event::read()? {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                if k.kind == KeyEventKind::Press
                    && (ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc))
                {
                    return Ok(());
                }
            }
        }
    }
}
