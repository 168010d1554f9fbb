//! The rebalancer: memory follows idleness (DESIGN.md §2.3a). Each
//! maintenance pass compares every donor's share of the device's placed
//! members with its selection frequency f_i and moves members from donors
//! above their share to donors below it, coldest first, as the pure
//! policy (`policy::rebalance`) plans; one member at a time under its
//! unit's write lock, copy then switch, as drain does (`move_member_to`,
//! journaled so a restart finds the member where its data is), within
//! `rebalance_rate` bytes a second (`rebalance_busy_rate` while the device
//! served requests since the last pass, as md's resync slows to its
//! minimum while the array has other I/O), paused while a rebuild, drain,
//! move off the fallback or a silent donor needs the maintenance thread.
//!
//! Recency: the epoch of each home unit's last access, one relaxed load
//! (and a store once an epoch) per unit a request touches.
//!
//! Calls: the policy's plan, `move_member_to` (maintenance.rs); called by
//! the maintenance thread, the request entry points (`touch`), the epoch
//! thread (`next_epoch`) and status.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};
use std::time::Instant;

use netpager_util::{LockExt, RwLockExt};

use super::maintenance::MoveWhy;
use super::report::Job;
use super::Inner;
use crate::extent_map::{CopyState, Layout, SlotOwner};
use crate::policy::rebalance::{self, Candidate, DonorShare, Move, RebalanceParams};

/// The epoch of each home unit's last access.
pub(crate) struct Recency {
    touched: Box<[AtomicU32]>,
    /// The epoch now; starts at 1, so 0 means "not since open".
    epoch: AtomicU32,
}

impl Recency {
    fn new(units: u64) -> Recency {
        Recency {
            touched: (0..units).map(|_| AtomicU32::new(0)).collect(),
            epoch: AtomicU32::new(1),
        }
    }

    fn now(&self) -> u32 {
        self.epoch.load(Ordering::Relaxed)
    }

    fn last(&self, u: u64) -> u32 {
        self.touched
            .get(u as usize)
            .map_or(0, |t| t.load(Ordering::Relaxed))
    }

    fn touch(&self, u: u64, now: u32) {
        if let Some(t) = self.touched.get(u as usize) {
            // A store only once an epoch per unit: no cache line bouncing
            // between request threads on a hot unit.
            if t.load(Ordering::Relaxed) != now {
                t.store(now, Ordering::Relaxed);
            }
        }
    }
}

/// What the rebalancer has done, for status.
#[derive(Debug, Default, Clone)]
pub(crate) struct Moved {
    pub bytes: u64,
    pub members: u64,
    /// Why it is not moving now, if it is not.
    pub paused: Option<String>,
    /// Each donor entry's share of the placed members and its target
    /// share, as of the last pass.
    pub shares: Vec<(f64, f64)>,
    /// The device served requests between the last two passes: the last
    /// one ran at the busy rate.
    pub busy: bool,
}

#[derive(Default)]
struct Budget {
    /// Bytes it may move now (a token bucket of one second's rate).
    tokens: f64,
    last: Option<Instant>,
}

pub(crate) struct Rebalancer {
    pub(crate) recency: Recency,
    budget: Mutex<Budget>,
    moved: Mutex<Moved>,
    /// The device's request count at the last pass: more now means busy.
    requests_seen: AtomicU64,
}

impl Rebalancer {
    pub(crate) fn new(layout: &Layout) -> Rebalancer {
        Rebalancer {
            recency: Recency::new(layout.home_units()),
            budget: Mutex::new(Budget::default()),
            moved: Mutex::new(Moved::default()),
            requests_seen: AtomicU64::new(0),
        }
    }

    /// A new epoch begins (the epoch thread).
    pub(crate) fn next_epoch(&self) {
        self.recency.epoch.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn moved(&self) -> Moved {
        self.moved.lock_or_recover().clone()
    }
}

impl Inner {
    /// Notes an access to `[offset, offset + len)`: its units' recency.
    pub(crate) fn touch(&self, offset: u64, len: u64) {
        let r = &self.rebalancer.recency;
        let now = r.now();
        let ext = self.layout.extent;
        let per = self.layout.data_per_unit();
        let first = offset / ext / per;
        let last = (offset + len.max(1) - 1) / ext / per;
        for u in first..=last {
            r.touch(u, now);
        }
    }

    /// Whether donor `d` has a share of the device to keep: in the set,
    /// connected, answering, not draining or leaving (the drain empties
    /// those).
    pub(crate) fn holds_share(&self, d: &super::donor::Donor) -> bool {
        !d.is_retired()
            && !d.is_failed()
            && !d.is_suspect()
            && d.attached.load(Ordering::Acquire)
            && !d.is_leaving()
            && !d.draining.load(Ordering::Acquire)
    }

    /// Each donor entry as the policy sees it (its target the epoch's
    /// `targets`: the rule counting what this device holds there), and
    /// the members that may move (on donors that may give).
    fn rebalance_view(&self) -> (Vec<DonorShare>, Vec<Candidate>) {
        let n = self.members.len();
        let (f, capped) = {
            let pl = self.placement.lock_or_recover();
            (pl.targets.f.clone(), pl.freqs.capped.clone())
        };
        let mut shares: Vec<DonorShare> = (0..n)
            .map(|i| {
                let d = &self.members[i];
                DonorShare {
                    held: 0,
                    f: f.get(i).copied().unwrap_or(0.0),
                    may_give: self.holds_share(d),
                    may_take: self.ineligible_reason(i).is_none(),
                    room: u64::from(self.map.slot_usage(SlotOwner::Donor(d.id)).1),
                    over_bound: capped.get(i).copied().unwrap_or(false),
                }
            })
            .collect();
        let mut cands = Vec::new();
        for u in 0..self.layout.home_units() {
            let g = self.map.unit(u).read_or_recover();
            let Some(unit) = g.as_ref() else { continue };
            let on: Vec<Option<usize>> = unit
                .members
                .iter()
                .map(|m| {
                    (m.state != CopyState::Lost)
                        .then(|| self.loc_donor(m.loc))
                        .flatten()
                        .filter(|&i| i < n)
                })
                .collect();
            for (j, m) in unit.members.iter().enumerate() {
                let Some(i) = on[j].filter(|_| m.state == CopyState::Ok) else {
                    continue;
                };
                shares[i].held += 1;
                if shares[i].may_give {
                    cands.push(Candidate {
                        unit: u,
                        member: j,
                        donor: i,
                        last_access: self.rebalancer.recency.last(u),
                        others: (0..on.len())
                            .filter(|&k| k != j)
                            .filter_map(|k| on[k])
                            .collect(),
                    });
                }
            }
        }
        (shares, cands)
    }

    /// Why the rebalancer waits this pass, if it does: a rebuild, drain or
    /// move off the fallback making progress, or a silent donor.
    fn rebalance_blocked(&self) -> Option<String> {
        {
            let j = self.jobs.lock_or_recover();
            for (job, p) in [
                (Job::Rebuild, &j.rebuild),
                (Job::Drain, &j.drain),
                (Job::OffFallback, &j.off_fallback),
            ] {
                // A stalled job (no donor can take its copies) may wait
                // long: the rebalancer goes on meanwhile.
                if p.active && p.stalled.is_none() {
                    return Some(format!("waiting for {}", job.name()));
                }
            }
        }
        self.members
            .iter()
            .find(|d| d.is_suspect())
            .map(|d| format!("waiting for donor {}, which is not answering", d.cfg.name))
    }

    /// Whole members the budget allows now, after adding what the time
    /// since the last pass earned.
    fn rebalance_budget(&self, rate: u64) -> usize {
        let ext = self.layout.extent as f64;
        let mut b = self.rebalancer.budget.lock_or_recover();
        let now = Instant::now();
        let earned = b
            .last
            .map_or(0.0, |t| (now - t).as_secs_f64() * rate as f64);
        b.last = Some(now);
        // At most a second's worth (and one member) saved up.
        b.tokens = (b.tokens + earned).min((rate as f64).max(ext));
        (b.tokens / ext) as usize
    }

    /// One pass of the rebalancer (maintenance thread).
    pub(crate) fn rebalance_pass(&self) {
        let requests = self.requests.load(Ordering::Relaxed);
        let busy = self
            .rebalancer
            .requests_seen
            .swap(requests, Ordering::Relaxed)
            != requests;
        let rate = rebalance::rate_now(
            self.cfg.rebalance_rate.0,
            self.cfg.rebalance_busy_rate.0,
            busy,
        );
        let (donors, cands) = self.rebalance_view();
        let mut p = RebalanceParams {
            now: self.rebalancer.recency.now(),
            hot_epochs: self.cfg.rebalance_hot_epochs,
            ..Default::default()
        };
        let shares = match rebalance::targets(&donors, &p) {
            Some((target, _, total)) => donors
                .iter()
                .zip(target)
                .map(|(d, t)| (d.held as f64 / total as f64, t / total as f64))
                .collect(),
            None => Vec::new(),
        };
        let paused = if self.cfg.rebalance_rate.0 == 0 {
            Some("off (rebalance rate 0)".to_string())
        } else if rate == 0 {
            Some("the device is busy (rebalance busy rate 0)".to_string())
        } else {
            self.rebalance_blocked()
        };
        let budget = self.rebalance_budget(rate);
        {
            let mut m = self.rebalancer.moved.lock_or_recover();
            m.shares = shares;
            m.busy = busy;
            m.paused.clone_from(&paused);
        }
        if paused.is_some() || budget == 0 {
            return;
        }
        p.budget = budget;
        let moves = rebalance::plan(&donors, &cands, &p);
        self.set_rebalance_job(|j| {
            j.active = !moves.is_empty();
            j.done = 0;
            j.total = moves.len() as u64;
            j.stalled = None;
        });
        for mv in moves {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            match self.rebalance_one(&mv, &donors, p) {
                Ok(true) => {
                    let ext = self.layout.extent;
                    self.rebalancer.budget.lock_or_recover().tokens -= ext as f64;
                    let mut m = self.rebalancer.moved.lock_or_recover();
                    m.bytes += ext;
                    m.members += 1;
                    drop(m);
                    self.set_rebalance_job(|j| j.done += 1);
                }
                Ok(false) => self.set_rebalance_job(|j| j.total -= 1),
                Err(e) => {
                    // The target filled up, failed or left since the plan:
                    // the next pass plans again.
                    tracing::debug!("rebalance of unit {}: {e}", mv.unit);
                    self.set_rebalance_job(|j| j.stalled = Some(e.to_string()));
                    return;
                }
            }
            self.maybe_write_status();
        }
        self.set_rebalance_job(|j| j.active = false);
    }

    fn set_rebalance_job(&self, f: impl FnOnce(&mut crate::status::Progress)) {
        f(self.jobs.lock_or_recover().of(Job::Rebalance));
    }

    /// Makes move `mv` if it still stands: the unit's lock free now (a
    /// request holding it goes first: the move waits for a later pass),
    /// the member where the plan saw it and not accessed since, unless its
    /// donor is over its bound. `Ok(false)`: passed by.
    fn rebalance_one(
        &self,
        mv: &Move,
        donors: &[DonorShare],
        p: RebalanceParams,
    ) -> super::Result<bool> {
        let mut g = match self.map.unit(mv.unit).try_write() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) | Err(TryLockError::Poisoned(_)) => return Ok(false),
        };
        let still = g
            .as_ref()
            .and_then(|u| u.members.get(mv.member))
            .is_some_and(|m| m.state == CopyState::Ok && self.loc_donor(m.loc) == Some(mv.from));
        let hot = p.now.saturating_sub(self.rebalancer.recency.last(mv.unit)) < p.hot_epochs;
        if !still || (hot && !donors[mv.from].over_bound) {
            return Ok(false);
        }
        self.move_member_to(mv.unit, &mut g, mv.member, MoveWhy::Rebalance, Some(mv.to))?;
        Ok(true)
    }
}
