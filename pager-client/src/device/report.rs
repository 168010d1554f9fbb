//! Building [`ClientStatus`] from the device's state.
//! Reads the map, the donors and the backend's state (write-through
//! queue, parity log) without taking a unit's write lock; also serves
//! `/metrics` from the same status.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use netpager_metrics::{Bound, EndpointConfig, Exposition};
use netpager_util::{LockExt, RwLockExt};

use super::Inner;
use crate::config::MetricsConfig;
use crate::extent_map::{CopyState, Loc, Redundancy, SlotOwner};
use crate::metrics::exposition;
use crate::status::{ClientStatus, DonorReport, Progress, Totals};

/// At most this many lost extents are listed by number.
const LOST_LISTED: usize = 1000;

/// Progress of the background jobs.
#[derive(Debug, Default)]
pub(crate) struct Jobs {
    pub rebuild: Progress,
    pub drain: Progress,
    pub off_fallback: Progress,
    pub rebalance: Progress,
    pub last_status: Option<Instant>,
    /// The latest epochs: when each started (ms since the Unix epoch) and
    /// how long it took (us), oldest first.
    pub epochs: std::collections::VecDeque<(u64, u64)>,
}

/// The background jobs whose progress status shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Job {
    Rebuild,
    Drain,
    OffFallback,
    Rebalance,
}

impl Job {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Job::Rebuild => "rebuild",
            Job::Drain => "drain",
            Job::OffFallback => "the move off the fallback",
            Job::Rebalance => "the rebalancer",
        }
    }
}

impl Jobs {
    pub(crate) fn of(&mut self, job: Job) -> &mut Progress {
        match job {
            Job::Rebuild => &mut self.rebuild,
            Job::Drain => &mut self.drain,
            Job::OffFallback => &mut self.off_fallback,
            Job::Rebalance => &mut self.rebalance,
        }
    }
}

/// Starts `/metrics` (`[metrics]` of device.toml). The endpoint holds the
/// device weakly: once the device is dropped it answers with no families.
pub(crate) fn serve_metrics(inner: &Arc<Inner>, m: &MetricsConfig) -> super::Result<()> {
    let bound = Bound::new(&EndpointConfig {
        param: "metrics.listen",
        addr: m.listen.clone(),
        key_file: m.psk.clone(),
        insecure: m.insecure,
    })?;
    let weak = Arc::downgrade(inner);
    bound
        .spawn(move || match weak.upgrade() {
            Some(i) => {
                let fe = i.frontend.lock_or_recover().clone();
                exposition(&i.build_status(), &fe)
            }
            None => Exposition::new(),
        })
        .map_err(|source| super::DeviceError::File {
            path: "<metrics thread>".into(),
            source,
        })
}

impl Inner {
    pub(crate) fn build_status(&self) -> ClientStatus {
        let layout = &self.layout;
        let mut t = Totals {
            units: layout.home_units(),
            ..Default::default()
        };
        let geo = self.journal().geometry();
        let log_unit_bytes = geo.map_or(0, |g| (g.rows * g.cols) as u64 * crate::page_log::PAGE);
        // Members a unit needs to be read: k of a group, one copy else.
        let needed = if layout.mode.striped() {
            layout.data_per_unit() as usize
        } else {
            1
        };
        let spare = layout.members() - needed;
        let mut levels = vec![0u64; spare + 1];
        let mut lost: Vec<u64> = Vec::new();
        for u in 0..layout.units() {
            let g = self.map.unit(u).read_or_recover();
            let Some(unit) = g.as_ref() else { continue };
            let log_unit = u.checked_sub(layout.home_units());
            match log_unit {
                Some(_) => t.parity_log_used_bytes += log_unit_bytes,
                None => t.units_placed += 1,
            }
            t.on_fallback += unit
                .members
                .iter()
                .filter(|m| m.state == CopyState::Ok && matches!(m.loc, Loc::Fallback { .. }))
                .count() as u64;
            let bad: Vec<usize> = (0..unit.members.len())
                .filter(|&k| !self.usable(&unit.members[k]))
                .collect();
            levels[spare.saturating_sub(bad.len())] += 1;
            if bad.is_empty() {
                continue;
            }
            match layout.mode {
                // Past what the code survives, the extents on gone members
                // are lost; those on live members still read directly.
                m if m.striped() && self.group_lost(u, &bad) => match (log_unit, geo) {
                    // The extents whose current pages were on gone members.
                    (Some(lu), Some(geo)) => lost.extend(
                        self.journal()
                            .live_in(lu)
                            .iter()
                            .filter(|&&(slot, _)| {
                                let col = geo.place(slot).2 as usize;
                                bad.contains(&layout.member_of(u, col))
                            })
                            .map(|&(_, page)| page * crate::page_log::PAGE / layout.extent),
                    ),
                    _ => lost.extend(bad.iter().filter_map(|&k| layout.extent_of(u, k))),
                },
                m if m.striped() => t.degraded += 1,
                Redundancy::Disk => t.degraded += 1,
                _ if bad.len() == unit.members.len() => lost.push(u),
                _ => t.degraded += 1,
            }
        }
        // An extent may be lost both at home and in the parity log.
        lost.sort_unstable();
        lost.dedup();
        t.lost = lost.len() as u64;
        self.lost_seen.store(t.lost > 0, Ordering::Relaxed);
        lost.truncate(LOST_LISTED);
        t.lost_extents = lost;
        let unfound = self.map.unfound();
        t.unfound_pages = unfound.pages();
        let page_extent = |p: u64| p * crate::page_log::PAGE / layout.extent;
        for r in unfound.ranges() {
            let (a, b) = (page_extent(r.start), page_extent(r.end - 1));
            let last = t.unfound_extents.last().copied();
            let from = last.map_or(a, |l| a.max(l + 1));
            t.unfound_extents.extend(from..=b);
            if t.unfound_extents.len() >= LOST_LISTED {
                t.unfound_extents.truncate(LOST_LISTED);
                break;
            }
        }
        t.can_lose = levels.iter().position(|&n| n > 0).unwrap_or(spare) as u32;
        t.can_lose_units = levels;
        {
            let j = self.jobs.lock_or_recover();
            t.rebuild = j.rebuild.clone();
            t.drain = j.drain.clone();
            t.off_fallback = j.off_fallback.clone();
            t.rebalance.pass = j.rebalance.clone();
        }
        let moved = self.rebalancer.moved();
        t.rebalance.rate_bytes = self.cfg.rebalance_rate.0;
        t.rebalance.busy_rate_bytes = self.cfg.rebalance_busy_rate.0;
        t.rebalance.busy = moved.busy;
        t.rebalance.moved_bytes = moved.bytes;
        t.rebalance.moves = moved.members;
        t.rebalance.paused = moved.paused;
        let pl = self.placement.lock_or_recover();
        t.all_capped = pl.freqs.all_capped;
        t.throttled = pl.throttle.is_some();
        t.throttle_reason = pl.throttle.clone();
        t.placement_note = pl.note.clone();
        if let Some(fb) = &self.fallback {
            t.fallback_path = Some(fb.path.display().to_string());
            t.fallback_size_bytes = fb.size;
            t.fallback_used_bytes =
                self.map.slot_usage(SlotOwner::Fallback).0 as u64 * layout.extent;
        }
        if let Some(wt) = self.wt() {
            let (queued, err) = wt.state();
            t.writethrough_queued_bytes = queued;
            t.writethrough_error = err;
        }
        t.requests = self.requests.load(Ordering::Relaxed);
        if let Some(geo) = geo {
            t.parity_log_bytes = geo.units * log_unit_bytes;
            t.parity_log_live_bytes = self.journal().census().0 * crate::page_log::PAGE;
        }
        if let Some(pf) = &self.prefetch {
            let n = pf.cache.counters();
            t.prefetch_pages = self.cfg.prefetch_pages;
            t.prefetch_issued = n.issued;
            t.prefetch_hits = n.hits;
            t.prefetch_wasted = n.wasted;
            t.prefetch_cache_bytes = pf.cache.ready_bytes();
            t.prefetch_pending = pf.cache.pending() as u64;
        }
        if layout.mode.striped() {
            t.groups_open = self.map.open_intents().len() as u64;
            t.groups_resynced = self.resynced.load(Ordering::Relaxed);
        }
        let at = |v: &Vec<f64>, i: usize| v.get(i).copied().unwrap_or(0.0);
        let donors = self
            .members
            .iter()
            .map(|d| {
                let r = d.remote();
                let (held, free) = self.map.slot_usage(SlotOwner::Donor(d.id));
                let export = d.pool.endpoint().export.clone();
                // Donors list exports by store name.
                let base = self.cfg.store_name(&d.cfg);
                let reported_use = r.status.as_ref().and_then(|s| {
                    s.exports
                        .iter()
                        .find(|x| x.name == base)
                        .map(|x| x.used_bytes)
                });
                let state = match (&d.cfg.status, &r.status, &r.error) {
                    (None, _, _) => "unknown".to_string(),
                    (Some(_), _, Some(_)) | (Some(_), None, None) => "unreachable".to_string(),
                    (Some(_), Some(s), None) => s.state().word().to_string(),
                };
                DonorReport {
                    name: d.cfg.name.clone(),
                    address: d.cfg.address.clone(),
                    export,
                    status_address: d.cfg.status.clone(),
                    state,
                    failed: d.is_failed(),
                    failure: {
                        let h = d.health();
                        h.refused
                            .clone()
                            .or_else(|| h.failure.clone())
                            .or_else(|| h.unlabelled.clone())
                    },
                    silent_ms: d.suspect_at().map(|t| t.elapsed().as_millis() as u64),
                    taken_back: d.taken_back.load(Ordering::Relaxed),
                    used_bytes: reported_use.unwrap_or(held as u64 * layout.extent),
                    extents_held: held as u64,
                    slots_free: free as u64,
                    free_bytes: r.status.as_ref().map(|s| s.free_bytes),
                    age_weight: at(&pl.freqs.age_weight, d.idx),
                    target_weight: at(&pl.freqs.target_weight, d.idx),
                    f: at(&pl.freqs.f, d.idx),
                    bound: at(&pl.freqs.bound, d.idx),
                    capped: pl.freqs.capped.get(d.idx).copied().unwrap_or(false),
                    utilisation: r.status.as_ref().map_or(0.0, |s| s.utilisation),
                    errors: d.errors.load(Ordering::Relaxed),
                    retries: d.retries.load(Ordering::Relaxed),
                    reads: d.reads.load(Ordering::Relaxed),
                    writes: d.writes.load(Ordering::Relaxed),
                    joined: d.joined,
                    joined_unix: d.joined_unix,
                    leaving: d.is_leaving(),
                    share: moved.shares.get(d.idx).map_or(0.0, |s| s.0),
                    target_share: moved.shares.get(d.idx).map_or(0.0, |s| s.1),
                }
            })
            .collect();
        let book = self.members.book();
        let (width, b, epoch_ms) = (
            match layout.mode {
                Redundancy::Parity { width } => width,
                _ => 0,
            },
            self.cfg.policy.b,
            self.cfg.policy.epoch_ms,
        );
        ClientStatus {
            fenced: self.fenced.get().cloned(),
            client_id: self.cfg.client_id.clone(),
            mode: layout.mode.word().to_string(),
            width,
            code: format!("{needed}+{spare}"),
            memory_overhead: layout.members() as f64 / needed as f64,
            size_bytes: layout.size,
            extent_bytes: layout.extent,
            updated_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            epoch_ms,
            grace_ms: self.cfg.grace_ms,
            b,
            donors,
            epochs: self.jobs.lock_or_recover().epochs.iter().copied().collect(),
            left: book.left.clone(),
            donors_file: self
                .cfg
                .donors_file
                .as_ref()
                .map(|p| p.display().to_string()),
            donors_file_error: book.file_error.clone(),
            donors_file_pending: book.file_pending.clone(),
            discover: self.cfg.discover,
            discover_domain: self.cfg.discover_domain.clone(),
            discovery_error: book.discovery_error.clone(),
            not_admitted: book.not_admitted.clone(),
            expired: book.expired.clone(),
            totals: t,
            requests: self.stats.reports(),
            stages: self.stats.stages.reports(),
            writeback: Some(self.stats.writeback.report()).filter(|w| w.capacity_bytes > 0),
        }
    }
}
