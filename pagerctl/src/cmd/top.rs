//! `pagerctl top`: a live view of one client, redrawn from status.json
//! every interval until q, Esc or Ctrl-C (drawing: `pagerctl::top`); with
//! `--batch`, the same screen printed as text, frame after frame.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use pager_client::status::ClientStatus;
use pagerctl::attach::record::{frontend_info, StateLayout};
use pagerctl::attach::AttachRecord;
use pagerctl::top::{self, draw, Context};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::Rect;
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
    /// Print each frame as text to standard output instead of drawing on
    /// the terminal (for scripts and ssh without a terminal), as top -b.
    #[arg(short, long)]
    batch: bool,
    /// With --batch: stop after this many frames (default: until killed).
    #[arg(short = 'n', long, value_name = "N", requires = "batch")]
    iterations: Option<u64>,
    /// With --batch: the width of a frame (default $COLUMNS, else 100).
    #[arg(long, value_name = "COLS", requires = "batch")]
    width: Option<u16>,
}

pub fn run(a: Args) -> Result<()> {
    let layout = StateLayout::new(&a.state_dir);
    if !layout.dir.is_dir() {
        bail!("state directory {} does not exist", layout.dir.display());
    }
    if a.batch {
        let width = a
            .width
            .or_else(|| std::env::var("COLUMNS").ok()?.parse().ok())
            .unwrap_or(100)
            .max(40);
        return batch(&layout, a.interval, a.iterations, width);
    }
    let mut term = ratatui::try_init().context("cannot set up the terminal")?;
    let r = watch(&mut term, &layout, a.interval);
    ratatui::restore();
    r
}

/// The latest two distinct versions of status.json: rates are taken
/// between them (the device rewrites it about once a second).
#[derive(Default)]
struct Feed {
    older: Option<ClientStatus>,
    latest: Option<ClientStatus>,
}

impl Feed {
    /// Reads status.json again; the error when there has never been one.
    fn refresh(&mut self, layout: &StateLayout) -> std::result::Result<(), String> {
        match ClientStatus::read(&layout.dir) {
            Ok(s) => {
                if self.latest.as_ref().map(|l| l.updated_unix_ms) != Some(s.updated_unix_ms) {
                    self.older = self.latest.replace(s);
                }
                Ok(())
            }
            Err(_) if self.latest.is_some() => Ok(()),
            Err(e) => Err(format!(
                "no device status yet ({}: {e})",
                layout.status_json().display()
            )),
        }
    }

    /// Seconds between the two versions (0 with only one).
    fn dt(&self) -> f64 {
        match (&self.older, &self.latest) {
            (Some(o), Some(c)) => {
                c.updated_unix_ms.saturating_sub(o.updated_unix_ms) as f64 / 1000.0
            }
            _ => 0.0,
        }
    }

    fn context(&self, layout: &StateLayout) -> Context {
        Context {
            frontend: frontend_info(layout),
            server_alive: server_alive(layout),
            age_secs: self.latest.as_ref().map_or(0.0, |c| {
                now_ms().saturating_sub(c.updated_unix_ms) as f64 / 1000.0
            }),
        }
    }
}

/// `--batch`: a frame of text every interval, each ending in a blank line.
fn batch(
    layout: &StateLayout,
    interval: Duration,
    iterations: Option<u64>,
    width: u16,
) -> Result<()> {
    let mut feed = Feed::default();
    let mut out = std::io::stdout().lock();
    let mut n = 0;
    loop {
        let frame = match feed.refresh(layout) {
            Err(e) => format!("{e}\n"),
            Ok(()) => {
                let cur = feed.latest.as_ref().expect("refreshed");
                let area = Rect::new(0, 0, width, top::screen_height(cur));
                top::render_text(
                    cur,
                    feed.older.as_ref(),
                    feed.dt(),
                    &feed.context(layout),
                    area,
                )
            }
        };
        writeln!(out, "{frame}")?;
        out.flush()?;
        n += 1;
        if iterations.is_some_and(|max| n >= max) {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
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
    let mut feed = Feed::default();
    loop {
        match feed.refresh(layout) {
            Ok(()) => {
                let cur = feed.latest.as_ref().expect("refreshed");
                let (older, dt, ctx) = (feed.older.as_ref(), feed.dt(), feed.context(layout));
                term.draw(|f| draw(f, cur, older, dt, &ctx))?;
            }
            Err(e) => {
                let msg = format!("{e}; q quits");
                term.draw(|f| f.render_widget(Paragraph::new(msg), f.area()))?;
            }
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
