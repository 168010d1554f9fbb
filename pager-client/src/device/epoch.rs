//! Once per epoch: read every donor's status endpoint, send a heartbeat
//! request to every donor that is up (a hung donor is detected even when
//! idle), reconnect failed donors as new ones, and recompute the selection
//! frequencies (DESIGN.md §2.1).
//!
//! Calls: the donors (donor.rs), membership (donors file), the policy's
//! frequencies; runs on the epoch thread.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use netpager_proto::{DonorState, DonorStatus};
use netpager_util::LockExt;

use super::donor::Donor;
use super::Inner;
use crate::policy::{self, DonorView, PolicyParams};
use netpager_nbd::{self as nbd, Op};

/// `give_pages` of a donor without a status endpoint: all such donors weigh
/// the same (capacity unknown).
const UNKNOWN_GIVE_PAGES: u64 = 1 << 20;
const DEFAULT_SERVICE_US: f64 = 100.0;
/// Threads reading donors' status endpoints at once.
const POLLERS: usize = 8;
/// A status round trip on a kept connection slower than this ends the
/// epoch thread's turn-by-turn polling.
const SLOW_POLL: Duration = Duration::from_millis(100);
const POLLER_STACK: usize = 256 << 10;
/// Epochs kept for status (what they cost, and when they ran).
const EPOCHS_KEPT: usize = 64;

impl Inner {
    pub(crate) fn epoch_loop(&self) {
        if let Err(e) = netpager_util::process::background_thread() {
            tracing::debug!("epoch thread stays at its priority: {e}");
        }
        let period = Duration::from_millis(self.cfg.policy.epoch_ms);
        let mut last = Instant::now();
        while self.epoch_wake.wait(period, &self.stop) {
            let window = last.elapsed().max(Duration::from_millis(1));
            last = Instant::now();
            self.run_epoch(window);
        }
    }

    /// One epoch; `window` is the time since the previous one (for T_j).
    pub(crate) fn run_epoch(&self, window: Duration) {
        if self.fenced.get().is_some() {
            return;
        }
        let (t0, at) = (Instant::now(), super::membership::unix_now_ms());
        self.rebalancer.next_epoch();
        self.follow_donors_file();
        self.follow_discovery();
        self.poll_status();
        self.heartbeat();
        // A failed donor that hangs still takes connections (the kernel's
        // backlog) and answers no handshake: one connect timeout each.
        let failed: Vec<&Donor> = self.members.iter().filter(|d| d.is_failed()).collect();
        self.on_pollers(&failed, |d| self.revive(d));
        let waiting: Vec<&Donor> = self
            .members
            .iter()
            .filter(|d| !d.is_failed() && !d.is_retired() && d.health().unlabelled.is_some())
            .collect();
        self.on_pollers(&waiting, |d| self.retry_label(d));
        let suspect: Vec<&Donor> = self.members.iter().filter(|d| d.is_suspect()).collect();
        self.on_pollers(&suspect, |d| self.check_suspect(d));
        self.update_frequencies(window);
        let mut j = self.jobs.lock_or_recover();
        if j.epochs.len() == EPOCHS_KEPT {
            j.epochs.pop_front();
        }
        j.epochs.push_back((at, t0.elapsed().as_micros() as u64));
    }

    /// Reads every donor's status endpoint. A donor whose connection is
    /// kept from the last epoch costs one round trip, so those are read in
    /// turn on this thread; the others need a connect, which may wait out a
    /// timeout, so they are read up to [`POLLERS`] at once: one slow or
    /// unreachable donor must not stretch the epoch by the number of
    /// donors. The first kept one that answers slowly (a partition, a hung
    /// donor) sends the rest of them to the pollers too.
    fn poll_status(&self) {
        let (kept, mut fresh): (Vec<&Donor>, Vec<&Donor>) = self
            .members
            .iter()
            .partition(|d| d.status.lock_or_recover().is_connected());
        let mut kept = kept.into_iter();
        for d in kept.by_ref() {
            let t0 = Instant::now();
            self.poll_one(d);
            if t0.elapsed() > SLOW_POLL {
                break;
            }
        }
        fresh.extend(kept);
        self.on_pollers(&fresh, |d| self.poll_one(d));
    }

    /// Runs `f` on each of `donors`, on up to [`POLLERS`] threads at once:
    /// each call may wait out a timeout on a donor that does not answer.
    fn on_pollers(&self, donors: &[&Donor], f: impl Fn(&Donor) + Sync) {
        let per = donors.len().div_ceil(POLLERS).max(1);
        let f = &f;
        std::thread::scope(|s| {
            for chunk in donors.chunks(per) {
                let run = move || chunk.iter().for_each(|d| f(d));
                // Small stacks: the serving process locks every page it maps.
                let spawned = std::thread::Builder::new()
                    .name("pager-poll".into())
                    .stack_size(POLLER_STACK)
                    .spawn_scoped(s, run);
                if spawned.is_err() {
                    run();
                }
            }
        });
    }

    /// Before a placement fails for want of donors, re-reads now the
    /// status of those that refuse new extents only by what the last poll
    /// or a refused write said (draining or full): the epoch's view can be
    /// an epoch old, and a connect timeout older, while donors stop and
    /// start draining (the nemesis, parity, drains-overlapping: writes got
    /// ENOSPC while donors had room). Placements that fail together share
    /// one re-read: one that started after this placement `asked` found
    /// what there is.
    pub(crate) fn refresh_refusing(&self, asked: Instant) {
        let mut last = self.status_refresh.lock_or_recover();
        if last.is_some_and(|t| t >= asked) {
            return;
        }
        *last = Some(Instant::now());
        let refusing = |d: &&Donor| {
            !d.is_failed()
                && !d.is_retired()
                && (d.draining.load(Ordering::Acquire) || d.full.load(Ordering::Acquire))
        };
        for d in self.members.iter().filter(refusing) {
            self.poll_one(d);
        }
    }

    fn poll_one(&self, d: &Donor) {
        {
            let Some(addr) = &d.cfg.status else {
                // Only our own ENOSPC marks such a donor full: retry it.
                d.full.store(false, Ordering::Release);
                return;
            };
            let polled = d.status.lock_or_recover().query(addr);
            match polled {
                Ok(s) => {
                    let draining = s.state() == DonorState::Draining;
                    let was = d.draining.swap(draining, Ordering::AcqRel);
                    if draining != was {
                        if draining {
                            tracing::warn!(
                                "donor {} is draining ({}); moving our extents away",
                                d.cfg.name,
                                if s.state_reason.is_empty() {
                                    "no reason given"
                                } else {
                                    &s.state_reason
                                }
                            );
                            self.maint_wake.notify();
                        } else {
                            tracing::info!("donor {} stopped draining", d.cfg.name);
                        }
                    }
                    d.full
                        .store(s.free_bytes < self.layout.extent, Ordering::Release);
                    if let Some(x) = self.cfg.policy.age_x {
                        let mut r = d.remote();
                        if s.age_x != x && !r.age_x_warned {
                            tracing::warn!("donor {} reports the age of its {}-th oldest page, not the {x}-th configured", d.cfg.name, s.age_x);
                            r.age_x_warned = true;
                        }
                    }
                    let mut r = d.remote();
                    r.status = Some(s);
                    r.error = None;
                }
                Err(e) => {
                    let mut r = d.remote();
                    if r.error.is_none() {
                        tracing::warn!("donor {}: status endpoint {addr}: {e}", d.cfg.name);
                    }
                    r.error = Some(e.to_string());
                }
            }
        }
    }

    /// A small read (inside the label block) from every donor that is up
    /// and answered no request since the last epoch (one that did is
    /// alive, and a request of its that hangs fails it by its own
    /// deadline); one that does not answer in time is marked failed. A
    /// fast failure (a reset connection) is tried once more first, as for
    /// data requests.
    fn heartbeat(&self) {
        let up: Vec<&Donor> = self
            .members
            .iter()
            .filter(|d| !d.is_failed() && !d.is_suspect() && d.attached.load(Ordering::Acquire))
            .filter(|d| d.quiet_since_last_look())
            .collect();
        let mut failed: Vec<(&Donor, nbd::NbdError)> = up
            .iter()
            .zip(Self::read_labels(&up))
            .filter_map(|(d, r)| r.err().map(|e| (*d, e)))
            .collect();
        let again: Vec<&Donor> = failed
            .iter()
            .filter(|(d, e)| super::io::retry_once(d, e))
            .map(|(d, _)| *d)
            .collect();
        if !again.is_empty() {
            failed.retain(|(d, _)| !again.iter().any(|a| std::ptr::eq(*a, *d)));
            failed.extend(
                again
                    .iter()
                    .zip(Self::read_labels(&again))
                    .filter_map(|(d, r)| r.err().map(|e| (*d, e))),
            );
        }
        for (d, e) in failed {
            if e.is_fenced() {
                self.donor_error(d, &e);
            } else if e.is_refused() {
                self.fail_donor_gone(d, &format!("heartbeat: {e}"));
            } else if self.may_fail_now(d) || self.cfg.grace_ms == 0 {
                self.fail_donor(d, &format!("heartbeat: {e}"));
            } else {
                // Failing it would lose data: it gets the grace
                // (transient.rs), probed each epoch.
                d.suspect_since(&e);
            }
        }
    }

    /// Reads 512 bytes at offset 0 from each of `donors` in one batch.
    fn read_labels(donors: &[&Donor]) -> Vec<Result<(), nbd::NbdError>> {
        let mut bufs = vec![[0u8; 512]; donors.len()];
        let mut batch: Vec<nbd::Request<'_, '_>> = donors
            .iter()
            .zip(bufs.iter_mut())
            .map(|(d, b)| nbd::Request {
                pool: &d.pool,
                offset: 0,
                op: Op::Read(&mut b[..]),
            })
            .collect();
        nbd::run(&mut batch)
    }

    fn update_frequencies(&self, window: Duration) {
        let mut service = Vec::new();
        // Indexed by table entry: donors that left the set weigh nothing.
        // Each donor twice: for placement, and for the rebalancer's targets
        // (rebalance.rs), where G_i is what the donor would lend this
        // device in all (its offer less what others hold there, so what
        // this device holds counts) and a full donor still counts: its
        // share of the device, not whether it takes a new extent now.
        // Moving a member leaves those G_i as they were, so targets hold
        // still while members move.
        let (views, shares): (Vec<DonorView>, Vec<DonorView>) = self
            .members
            .all()
            .map(|d| {
                let eligible = self.ineligible_reason(d.idx).is_none();
                let holds = self.holds_share(d);
                let r = d.remote();
                match (&d.cfg.status, &r.status, &r.error) {
                    (None, _, _) => {
                        let v = DonorView {
                            give_pages: UNKNOWN_GIVE_PAGES,
                            age_x_ms: policy::FREE_PAGE_AGE_MS,
                            busy: false,
                            u_star: 1.0,
                            u_unused: 0.0,
                            eligible,
                        };
                        (
                            v,
                            DonorView {
                                eligible: holds,
                                ..v
                            },
                        )
                    }
                    (Some(_), Some(s), None) => {
                        if s.mean_service_us > 0.0 {
                            service.push(s.mean_service_us);
                        }
                        let page = if s.page_size > 0 { s.page_size } else { 4096 };
                        let give = offered_bytes(s) / page;
                        let store = self.cfg.store_name(&d.cfg);
                        let ours = s
                            .exports
                            .iter()
                            .find(|x| x.name == store)
                            .map_or(0, |x| x.used_bytes);
                        // What it lends in all less what others hold there
                        // (below what we hold when it wants pages back), at
                        // the compression ratio it offers; an older donor
                        // without offer_bytes: what it offers and ours.
                        let ratio = s.offered_ratio.clamp(1.0, MAX_OFFERED_RATIO as f64);
                        let lends = match s.offer_bytes {
                            Some(offer) => {
                                let others = s.used_bytes - ours.min(s.used_bytes);
                                (offer.saturating_sub(others) as f64 * ratio) as u64
                            }
                            None => offered_bytes(s) + (ours as f64 * ratio) as u64,
                        } / page;
                        let x = self.cfg.policy.age_x.unwrap_or(s.age_x).max(1);
                        let age = |give: u64| {
                            if give >= x {
                                policy::FREE_PAGE_AGE_MS
                            } else {
                                s.age_x_ms
                            }
                        };
                        let v = DonorView {
                            give_pages: give,
                            age_x_ms: age(give),
                            busy: s.state() == DonorState::Busy,
                            u_star: s.u_star.clamp(0.0, 1.0),
                            u_unused: s.u_unused.clamp(0.0, 1.0),
                            eligible,
                        };
                        let with_ours = DonorView {
                            give_pages: lends,
                            age_x_ms: age(lends),
                            eligible: holds,
                            ..v
                        };
                        (v, with_ours)
                    }
                    // Its status is unknown or stale: place nothing new there.
                    _ => {
                        let v = DonorView {
                            give_pages: 0,
                            age_x_ms: 0,
                            busy: true,
                            u_star: 0.0,
                            u_unused: 0.0,
                            eligible: false,
                        };
                        (v, v)
                    }
                }
            })
            .unzip();
        let s_us = self.cfg.policy.service_time_us.unwrap_or_else(|| {
            if service.is_empty() {
                DEFAULT_SERVICE_US
            } else {
                service.iter().sum::<f64>() / service.len() as f64
            }
        });
        let total = self.requests.load(Ordering::Relaxed);
        let requests = total - self.requests_at_epoch.swap(total, Ordering::Relaxed);
        let params = PolicyParams {
            b: self.cfg.policy.b,
            service_time_s: s_us / 1e6,
            interarrival_s: window.as_secs_f64() / requests.max(1) as f64,
            n_clients: self.cfg.policy.n_clients,
            borrowing: self.cfg.policy.borrowing,
        };
        let mut freqs = match policy::frequencies(&views, &params) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("selection frequencies: {e}; using equal weights");
                let n = views.iter().filter(|v| v.eligible).count().max(1) as f64;
                policy::Frequencies {
                    f: views
                        .iter()
                        .map(|v| if v.eligible { 1.0 / n } else { 0.0 })
                        .collect(),
                    ..Default::default()
                }
            }
        };
        // With no request in the window there is no T_j, so nothing to
        // bound: an idle device is never throttled (nor sent to its
        // fallback for it).
        if requests == 0 {
            freqs.all_capped = false;
        }
        let throttle = (freqs.all_capped && views.iter().any(|v| v.eligible)).then(|| {
            format!(
                "every donor is capped by its load bound (T_j = {:.1} us between requests, S = {s_us:.1} us, N_g = {})",
                params.interarrival_s * 1e6,
                params.n_clients
            )
        });
        // Bounds as for placement; without a valid rule, no targets.
        let targets = policy::frequencies(&shares, &params).unwrap_or_default();
        let mut pl = self.placement.lock_or_recover();
        if throttle.is_some() && pl.throttle.is_none() {
            tracing::warn!("{}", throttle.as_deref().unwrap_or_default());
        }
        pl.throttle = throttle;
        pl.freqs = freqs;
        pl.targets = targets;
    }
}

/// Most a donor's compression may multiply its free budget by in G_i.
const MAX_OFFERED_RATIO: u64 = 4;

/// G_i in bytes: what the donor can take at the compression ratio it
/// offers (`capacity_bytes`), at most [`MAX_OFFERED_RATIO`] times its free
/// budget (about what zram holds at best), so no donor calls every client
/// to it on a ratio without bound. A donor that reports no capacity
/// (older, or draining) offers its free bytes.
fn offered_bytes(s: &DonorStatus) -> u64 {
    match s.capacity_bytes {
        0 => s.free_bytes,
        c => c.min(s.free_bytes.saturating_mul(MAX_OFFERED_RATIO)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn g_i_is_the_capacity_offered_within_bounds() {
        let st = |free_bytes, capacity_bytes| DonorStatus {
            free_bytes,
            capacity_bytes,
            ..Default::default()
        };
        assert_eq!(
            offered_bytes(&st(100, 0)),
            100,
            "a donor without capacity: its free bytes"
        );
        assert_eq!(offered_bytes(&st(100, 250)), 250, "at the ratio it offers");
        assert_eq!(offered_bytes(&st(100, 10_000)), 400, "capped");
        assert_eq!(offered_bytes(&st(0, 0)), 0, "draining or full");
    }
}
