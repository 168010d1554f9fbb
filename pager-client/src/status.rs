//! The client device's status: `status.json` in the state directory,
//! rewritten atomically about once a second by the device, read by
//! `pagerctl status [--json]` and rendered with [`render_table`].

use std::fmt::Write as _;
use std::path::Path;

use netpager_metrics::{HistogramSnapshot, BUCKET_BOUNDS_NS};
use netpager_util::format_size;
use serde::{Deserialize, Serialize};

/// File name inside the state directory.
pub const FILE_NAME: &str = "status.json";

/// Progress of a background job (rebuild, drain, off the fallback).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Extent copies (members) moved or re-created so far in this pass.
    pub done: u64,
    /// Copies that needed it when the pass started.
    pub total: u64,
    /// The job has work left.
    pub active: bool,
    /// Why it is waiting, if it is (e.g. no donor has room).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stalled: Option<String>,
}

/// One donor as this client sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DonorReport {
    pub name: String,
    /// NBD address `host:port`.
    pub address: String,
    pub export: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_address: Option<String>,
    /// From its status endpoint: idle, busy or draining; "unknown" without
    /// an endpoint, "unreachable" when the last query failed.
    pub state: String,
    /// Marked failed by this client (errors or timeouts); its copies are
    /// being re-created elsewhere.
    pub failed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Not failed but silent this long (ms): its requests wait for it, up
    /// to the device's grace (`grace_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silent_ms: Option<u64>,
    /// Extent copies taken back as they were when it came back from a
    /// failure with its label (the rest written meanwhile were re-created).
    #[serde(default)]
    pub taken_back: u64,
    /// Bytes of our export the donor holds (its report, else extents held
    /// times the extent size).
    pub used_bytes: u64,
    /// Extent copies (slots) we keep there.
    pub extents_held: u64,
    /// Slots our export still has free.
    pub slots_free: u64,
    /// Donor-wide free bytes it reported (its budget left).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
    pub age_weight: f64,
    pub target_weight: f64,
    /// Selection frequency f_i this epoch.
    pub f: f64,
    pub bound: f64,
    pub capped: bool,
    /// The donor's reported utilisation by remote requests (0..1).
    pub utilisation: f64,
    /// Request errors and timeouts seen since the device started.
    pub errors: u64,
    /// Requests sent once more after a fast failure (a reset connection)
    /// rather than failing the donor.
    #[serde(default)]
    pub retries: u64,
    pub reads: u64,
    pub writes: u64,
    /// How it joined the set: attach, added, file or discovered.
    #[serde(default)]
    pub joined: netpager_membership::Joined,
    /// When it joined, seconds since the Unix epoch.
    #[serde(default)]
    pub joined_unix: u64,
    /// Being removed: its extents are moving to the other donors.
    #[serde(default)]
    pub leaving: bool,
    /// Its share of the device's placed members (home units), 0..1.
    #[serde(default)]
    pub share: f64,
    /// The share the rebalancer moves it toward: f_i normalised over the
    /// donors that may give or take members.
    #[serde(default)]
    pub target_share: f64,
}

/// The rebalancer: members moved so each donor's share follows its f_i.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceReport {
    /// Bytes a second it may move (0: off).
    pub rate_bytes: u64,
    /// Bytes a second it may move while the device serves requests.
    #[serde(default)]
    pub busy_rate_bytes: u64,
    /// The device served requests during its last pass: the busy rate
    /// applied.
    #[serde(default)]
    pub busy: bool,
    /// Bytes moved since the device opened.
    pub moved_bytes: u64,
    /// Members moved since the device opened.
    pub moves: u64,
    /// The moves of its last pass.
    pub pass: Progress,
    /// Why it is not moving now, if it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<String>,
}

/// A donor that left the set, as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeftDonor {
    pub name: String,
    pub address: String,
    pub joined: netpager_membership::Joined,
    /// When it left, seconds since the Unix epoch.
    pub left_unix: u64,
    /// removed (drained, then let go), forgotten (dead too long) or file
    /// (its line left the donors file, then drained).
    pub why: String,
}

/// Totals over the device.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    /// Units of placement: extents (parity: groups).
    pub units: u64,
    pub units_placed: u64,
    /// Members (copies) on the local fallback file.
    pub on_fallback: u64,
    /// Extents whose data is gone (every copy lost).
    pub lost: u64,
    /// The first lost extents (up to 1000), by extent number.
    pub lost_extents: Vec<u64>,
    /// Pages of lost extents that were placed again (a write went there)
    /// and have not been written since: they read as I/O errors until
    /// written, or until `pagerctl forget-lost` makes them zeros.
    #[serde(default)]
    pub unfound_pages: u64,
    /// The first extents holding unfound pages (up to 1000).
    #[serde(default)]
    pub unfound_extents: Vec<u64>,
    /// Units missing a copy that can still be re-created.
    pub degraded: u64,
    pub rebuild: Progress,
    pub drain: Progress,
    /// Copies moving from the local fallback to donors with room again.
    #[serde(default)]
    pub off_fallback: Progress,
    #[serde(default)]
    pub rebalance: RebalanceReport,
    /// Every donor is capped by its load bound: the client is throttled.
    pub all_capped: bool,
    pub throttled: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle_reason: Option<String>,
    /// Why the last placement went to the fallback or failed with ENOSPC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement_note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_path: Option<String>,
    pub fallback_used_bytes: u64,
    pub fallback_size_bytes: u64,
    /// Bytes queued for the write-through file (mode disk).
    pub writethrough_queued_bytes: u64,
    /// Why the write-through copy stopped being kept, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writethrough_error: Option<String>,
    pub requests: u64,
    /// Mode parity: data the parity log can hold (0: no log).
    #[serde(default)]
    pub parity_log_bytes: u64,
    /// Pages in the log that are the current copy of their page.
    #[serde(default)]
    pub parity_log_live_bytes: u64,
    /// Data room of the log units that hold a placement (live or garbage).
    #[serde(default)]
    pub parity_log_used_bytes: u64,
    /// How many more donor failures every placed unit survives right now
    /// (the minimum over units; lost units count as 0).
    #[serde(default)]
    pub can_lose: u32,
    /// Placed units by how many more failures each survives: entry `i`
    /// counts those that survive `i` more.
    #[serde(default)]
    pub can_lose_units: Vec<u64>,
    /// Modes parity and ec: groups whose write intent is open (written
    /// lately; a crash now would resync them at the next start).
    #[serde(default)]
    pub groups_open: u64,
    /// Groups whose parity was recomputed at start because the last run
    /// left them open.
    #[serde(default)]
    pub groups_resynced: u64,
    /// The stride prefetcher (`prefetch_pages` > 0): pages read ahead,
    /// reads served from its cache, pages that left it unread, the bytes
    /// it holds now, and the pages predicted that are not there yet.
    #[serde(default)]
    pub prefetch_pages: u32,
    #[serde(default)]
    pub prefetch_issued: u64,
    #[serde(default)]
    pub prefetch_hits: u64,
    #[serde(default)]
    pub prefetch_wasted: u64,
    #[serde(default)]
    pub prefetch_cache_bytes: u64,
    #[serde(default)]
    pub prefetch_pending: u64,
}

/// Requests of one kind the device served since it started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestReport {
    /// read, write, zero, trim or flush.
    pub op: String,
    pub count: u64,
    /// Bytes of the requests that succeeded.
    pub bytes: u64,
    pub errors: u64,
    /// Time spent serving them.
    pub seconds: f64,
    /// Cumulative counts of requests served within each bound of
    /// `netpager_metrics::BUCKET_BOUNDS_NS`, then of all.
    pub buckets: Vec<u64>,
}

impl RequestReport {
    /// The latency histogram, as `/metrics` shows it.
    pub fn histogram(&self) -> HistogramSnapshot {
        HistogramSnapshot::from_counts(&BUCKET_BOUNDS_NS, self.seconds, self.count, &self.buckets)
    }

    /// What happened between `before` and `self` (same kind, a later look).
    pub fn since(&self, before: &RequestReport) -> RequestReport {
        RequestReport {
            op: self.op.clone(),
            count: self.count.saturating_sub(before.count),
            bytes: self.bytes.saturating_sub(before.bytes),
            errors: self.errors.saturating_sub(before.errors),
            seconds: (self.seconds - before.seconds).max(0.0),
            buckets: self
                .buckets
                .iter()
                .zip(before.buckets.iter().chain(std::iter::repeat(&0)))
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
        }
    }
}

/// Everything `status.json` holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientStatus {
    pub client_id: String,
    pub mode: String,
    /// Parity group width (mode parity), else 0.
    pub width: u32,
    /// The code: `K+R` (data and parity extents of a group) in modes
    /// parity and ec, the copies (`1+1`, `1+0`) otherwise.
    #[serde(default)]
    pub code: String,
    /// Remote memory per byte stored: `(K + R) / K`.
    #[serde(default)]
    pub memory_overhead: f64,
    pub size_bytes: u64,
    pub extent_bytes: u64,
    /// Milliseconds since the Unix epoch when this was written.
    pub updated_unix_ms: u64,
    pub epoch_ms: u64,
    /// How long requests wait for a silent donor before it is failed where
    /// failing it would lose data (`attach --grace`).
    #[serde(default)]
    pub grace_ms: u64,
    pub b: f64,
    pub donors: Vec<DonorReport>,
    /// The latest epochs (up to 64): start in ms since the Unix epoch, and
    /// wall time in us (status polls, heartbeats, frequencies).
    #[serde(default)]
    pub epochs: Vec<(u64, u64)>,
    /// Donors that left the set lately (removed, forgotten), newest last.
    #[serde(default)]
    pub left: Vec<LeftDonor>,
    /// The donors file the set follows, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub donors_file: Option<String>,
    /// Why the donors file was not taken (it changes nothing then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub donors_file_error: Option<String>,
    /// Changes the donors file asks for that could not be made yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub donors_file_pending: Option<String>,
    /// The device adds donors announced on the lab's network.
    #[serde(default)]
    pub discover: bool,
    /// DNS domains it browses for announced donors (wide-area DNS-SD).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub discover_domain: Vec<String>,
    /// Why discovery is not running although asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery_error: Option<String>,
    /// Announced donors not in the set, by node id, and why.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub not_admitted: std::collections::BTreeMap<String, String>,
    /// Announced donors whose records are past their lease (not used).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub expired: std::collections::BTreeMap<String, String>,
    /// Why this serving process stopped serving: a newer session of the
    /// device owns its exports (the donors said so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced: Option<String>,
    pub totals: Totals,
    /// Requests served, by kind (files from before have none).
    #[serde(default)]
    pub requests: Vec<RequestReport>,
    /// Where the serving process's requests spent their time, by kind and
    /// stage (none when no front end counts them: the nbd front end).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<crate::stages::StageReport>,
    /// The serving process's write-back buffer, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writeback: Option<crate::writeback::WriteBackReport>,
}

impl ClientStatus {
    /// Writes `DIR/status.json` atomically (temporary file, rename). The
    /// text is built in memory and written once: serde writes a token at a
    /// time, which straight to a file was a write(2) each, thousands per
    /// status with many donors.
    pub fn write_atomic(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join(format!("{FILE_NAME}.tmp"));
        let mut text = serde_json::to_vec_pretty(self)?;
        text.push(b'\n');
        std::fs::write(&tmp, &text)?;
        std::fs::rename(&tmp, dir.join(FILE_NAME))
    }

    /// Reads `DIR/status.json`.
    pub fn read(dir: &Path) -> std::io::Result<ClientStatus> {
        let path = dir.join(FILE_NAME);
        let text = std::fs::read_to_string(&path)?;
        serde_json::from_str(&text).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        })
    }
}

impl DonorReport {
    /// Why a new extent cannot go to this donor now, if it cannot.
    pub fn no_pages_because(&self, extent_bytes: u64) -> Option<String> {
        if self.failed {
            Some(format!(
                "failed ({})",
                self.failure.as_deref().unwrap_or("no reason recorded")
            ))
        } else if self.leaving {
            Some("leaving".into())
        } else if self.state == "draining" {
            Some("draining".into())
        } else if self.slots_free == 0 || self.free_bytes.is_some_and(|f| f < extent_bytes) {
            Some("full".into())
        } else {
            None
        }
    }
}

impl ClientStatus {
    /// Distinct donors a unit is placed on (K+R of the code).
    pub fn donors_per_unit(&self) -> usize {
        self.code
            .split('+')
            .map(|n| n.parse::<usize>().unwrap_or(0))
            .sum::<usize>()
            .max(1)
    }

    /// Why the device cannot place a new unit now, if it cannot: fewer
    /// donors take pages than a unit needs, and no fallback file takes
    /// the rest. Writes to unplaced extents then fail (ENOSPC).
    pub fn cannot_place(&self) -> Option<String> {
        if self.totals.fallback_path.is_some() {
            return None;
        }
        let needed = self.donors_per_unit();
        let why: Vec<String> = self
            .donors
            .iter()
            .filter_map(|d| {
                d.no_pages_because(self.extent_bytes)
                    .map(|w| format!("{}: {w}", d.name))
            })
            .collect();
        let usable = self.donors.len() - why.len();
        (usable < needed).then(|| {
            let detail = if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join("; "))
            };
            format!(
                "mode {} places each unit on {needed} distinct donors, and {usable} of {} take pages now{detail}",
                self.mode,
                self.donors.len()
            )
        })
    }
}

/// Sorted numbers as inclusive ranges: `0..15, 20, 22..23`.
pub fn format_ranges(sorted: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}..{end}")
        });
        i += 1;
    }
    out.join(", ")
}

fn progress(p: &Progress) -> String {
    let mut s = if p.total == 0 && !p.active {
        "idle".to_string()
    } else {
        format!("{}/{}", p.done, p.total)
    };
    if let Some(why) = &p.stalled {
        write!(s, " (stalled: {why})").expect("writing to a String");
    }
    s
}

/// A readable table of the status.
pub fn render_table(s: &ClientStatus) -> String {
    let mut out = String::new();
    let mode = match s.mode.as_str() {
        "parity" => format!("parity (width {}, code {})", s.width, s.code),
        "ec" => format!("ec (code {})", s.code),
        _ => s.mode.clone(),
    };
    let t = &s.totals;
    let w = |out: &mut String, line: String| out.push_str(&(line + "\n"));
    if let Some(f) = &s.fenced {
        w(
            &mut out,
            format!("FENCED: {f}: a newer serving process of this device owns its exports; this one serves nothing"),
        );
    }
    w(
        &mut out,
        format!(
            "device {}: {} in {} extents of {}, mode {mode}, b = {}",
            s.client_id,
            format_size(s.size_bytes),
            s.size_bytes.div_ceil(s.extent_bytes.max(1)),
            format_size(s.extent_bytes),
            s.b
        ),
    );
    w(
        &mut out,
        format!(
            "placed {}/{} units, degraded {}, lost {}, on fallback {}, requests {}",
            t.units_placed, t.units, t.degraded, t.lost, t.on_fallback, t.requests
        ),
    );
    let levels: Vec<String> = t
        .can_lose_units
        .iter()
        .enumerate()
        .filter(|(_, &n)| n > 0)
        .map(|(i, n)| format!("{n} can lose {i}"))
        .collect();
    w(
        &mut out,
        format!(
            "memory {:.2}x per byte stored; failures survivable now: {} (units: {})",
            s.memory_overhead,
            t.can_lose,
            if levels.is_empty() {
                "none placed".to_string()
            } else {
                levels.join(", ")
            }
        ),
    );
    w(
        &mut out,
        format!(
            "rebuild {}, drain {}, off the fallback {}",
            progress(&t.rebuild),
            progress(&t.drain),
            progress(&t.off_fallback)
        ),
    );
    let r = &t.rebalance;
    w(
        &mut out,
        format!(
            "rebalance {}: {} moved ({} members) at up to {}/s ({}/s while busy{}){}",
            progress(&r.pass),
            format_size(r.moved_bytes),
            r.moves,
            format_size(r.rate_bytes),
            format_size(r.busy_rate_bytes.min(r.rate_bytes)),
            if r.busy { ", busy now" } else { "" },
            r.paused
                .as_ref()
                .map(|p| format!(", paused: {p}"))
                .unwrap_or_default()
        ),
    );
    if t.throttled || t.all_capped {
        w(
            &mut out,
            format!(
                "THROTTLED: {}",
                t.throttle_reason
                    .clone()
                    .unwrap_or_else(|| "all donors capped".into())
            ),
        );
    }
    if s.mode == "parity" || s.mode == "ec" {
        w(
            &mut out,
            format!(
                "write intent: {} group(s) open, {} resynced at start",
                t.groups_open, t.groups_resynced
            ),
        );
    }
    if t.prefetch_pages > 0 {
        w(
            &mut out,
            format!(
                "prefetch: {} pages ahead, {} issued, {} hits, {} wasted, {} cached, {} pending",
                t.prefetch_pages,
                t.prefetch_issued,
                t.prefetch_hits,
                t.prefetch_wasted,
                format_size(t.prefetch_cache_bytes),
                t.prefetch_pending
            ),
        );
    }
    if t.parity_log_bytes > 0 {
        w(
            &mut out,
            format!(
                "parity log: {} live in {} of units placed, {} room",
                format_size(t.parity_log_live_bytes),
                format_size(t.parity_log_used_bytes),
                format_size(t.parity_log_bytes)
            ),
        );
    }
    if let Some(p) = &t.fallback_path {
        w(
            &mut out,
            format!(
                "fallback {p}: {} of {} used",
                format_size(t.fallback_used_bytes),
                format_size(t.fallback_size_bytes)
            ),
        );
    }
    if let Some(why) = s.cannot_place() {
        w(
            &mut out,
            format!("CANNOT PLACE new extents: {why}; writes to them fail until donors can take pages (pagerctl donor-add, or fix what the donors' lines say)"),
        );
    }
    if let Some(n) = &t.placement_note {
        w(&mut out, format!("placement: {n}"));
    }
    if let Some(e) = &t.writethrough_error {
        w(&mut out, format!("WRITE-THROUGH STOPPED: {e}"));
    }
    if t.writethrough_queued_bytes > 0 {
        w(
            &mut out,
            format!(
                "write-through queue: {}",
                format_size(t.writethrough_queued_bytes)
            ),
        );
    }
    if t.lost > 0 {
        let more = if (t.lost as usize) > t.lost_extents.len() {
            ", ..."
        } else {
            ""
        };
        w(
            &mut out,
            format!(
                "LOST extents: {}{more} (reads there fail; a write places its extent again, pagerctl forget-lost makes them read as zeros)",
                format_ranges(&t.lost_extents)
            ),
        );
    }
    if t.unfound_pages > 0 {
        w(
            &mut out,
            format!(
                "UNFOUND: {} pages in extents {} were lost and not written since; they read as I/O errors until written (pagerctl forget-lost makes them zeros)",
                t.unfound_pages,
                format_ranges(&t.unfound_extents)
            ),
        );
    }
    w(&mut out, String::new());
    let header = [
        "donor",
        "address",
        "state",
        "used",
        "extents",
        "free slots",
        "w",
        "a",
        "f",
        "share/target",
        "capped",
        "util",
        "errors",
        "joined",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for d in &s.donors {
        let state = match (d.failed, d.leaving) {
            (true, _) => format!("FAILED ({})", d.state),
            (false, true) => format!("LEAVING ({})", d.state),
            (false, false) => d.state.clone(),
        };
        rows.push(vec![
            d.name.clone(),
            d.address.clone(),
            state,
            format_size(d.used_bytes),
            d.extents_held.to_string(),
            d.slots_free.to_string(),
            format!("{:.3}", d.target_weight),
            format!("{:.3}", d.age_weight),
            format!("{:.3}", d.f),
            format!("{:.3}/{:.3}", d.share, d.target_share),
            if d.capped { "yes".into() } else { "no".into() },
            format!("{:.2}", d.utilisation),
            d.errors.to_string(),
            format!(
                "{} {}",
                d.joined,
                ago(s.updated_unix_ms / 1000, d.joined_unix)
            ),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        w(&mut out, line.join("  ").trim_end().to_string());
    }
    for d in s.donors.iter().filter(|d| d.failure.is_some()) {
        w(
            &mut out,
            format!("{}: {}", d.name, d.failure.as_deref().unwrap_or_default()),
        );
    }
    for d in &s.donors {
        if let Some(ms) = d.silent_ms {
            w(
                &mut out,
                format!(
                    "{}: not answering for {:.1} s; its requests wait, failed after {:.0} s (grace)",
                    d.name,
                    ms as f64 / 1000.0,
                    s.grace_ms as f64 / 1000.0
                ),
            );
        }
    }
    if let Some(f) = &s.donors_file {
        w(&mut out, format!("donors file {f}"));
    }
    for note in [&s.donors_file_error, &s.donors_file_pending]
        .into_iter()
        .flatten()
    {
        w(&mut out, format!("  {note}"));
    }
    let local = s.discover.then(|| "the local segment".to_string());
    let what: Vec<String> = local
        .into_iter()
        .chain(s.discover_domain.iter().map(|d| format!("domain {d}")))
        .collect();
    if !what.is_empty() {
        let error = s.discovery_error.as_deref().map(|e| format!("; {e}"));
        let line = format!("browsing _netpager._tcp on {}", what.join(", "));
        w(
            &mut out,
            format!("discovery: {line}{}", error.unwrap_or_default()),
        );
    }
    for (node, why) in &s.not_admitted {
        w(&mut out, format!("  announced {node}, not used: {why}"));
    }
    for (node, why) in &s.expired {
        w(&mut out, format!("  announced {node}, {why}"));
    }
    for l in &s.left {
        w(
            &mut out,
            format!(
                "left: {} ({}, joined {}) {} {}",
                l.name,
                l.address,
                l.joined,
                l.why,
                ago(s.updated_unix_ms / 1000, l.left_unix)
            ),
        );
    }
    out
}

/// "5m ago" for a time `then` seen at `now` (seconds since the Unix epoch).
fn ago(now: u64, then: u64) -> String {
    let d = now.saturating_sub(then);
    match d {
        0..=119 => format!("{d}s ago"),
        120..=7199 => format!("{}m ago", d / 60),
        7200..=172_799 => format!("{}h ago", d / 3600),
        _ => format!("{}d ago", d / 86400),
    }
}

#[cfg(test)]
mod tests;
