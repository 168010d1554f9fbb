//! Transient faults cost only what changed.
//!
//! **Grace.** A donor that stops answering (a request or heartbeat timed
//! out, its connection was reset) is only *suspect* at first. Where failing
//! it would lose data (mode none, or a copy that is the last one left:
//! [`Inner::may_fail_now`]), requests to it wait, probing it now and then,
//! for up to `grace_ms` (`attach --grace`, default 30 s) before it is
//! failed and its copies declared lost: a donor back within the grace
//! loses nothing. Where another copy covers each of its members it is
//! failed at once, as before: reads go to the other copies.
//!
//! **Re-add** (md's `--re-add` with a write-intent bitmap). A failed
//! donor's label is remembered ([`Away`]), and while any donor is away
//! every slot the device writes is noted ([`Dirty`]). A donor that comes
//! back with that label intact (it was paused or cut off, not restarted)
//! takes back each of its members whose unit was not written meanwhile;
//! only the others are re-created (rebuilt), not its whole share. A donor
//! that comes back empty is a new donor, as before.
//!
//! Each round of connections to a donor is numbered in the export name
//! (`netpager_nbd::Pool::numbered`), so requests still queued on
//! connections the device gave up on are refused by the donor once a new
//! round connects: a retried write is never overtaken by its stale first
//! try.
//!
//! A donor killed and started again at once is no pause: its new process
//! accepts a connection to an empty export of the same name. So each
//! connection a pool opens after its first reads the label back first
//! ([`label_check`]); one without it counts as a donor that came back
//! empty.
//!
//! Calls: the donors' pools, labels (label.rs), the extent map; called by
//! `exec` (io.rs), `fail_donor`, `revive` (donor.rs) and the epoch.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use netpager_nbd::{NbdError, Op};
use netpager_util::{LockExt, RwLockExt};

use super::donor::Donor;
use super::label::{self, LABEL_BYTES};
use super::Inner;
use crate::extent_map::{CopyState, Loc, Redundancy};

/// What the device remembers of a donor that failed while it held our
/// data: the label its export should still carry if it comes back intact.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Away {
    pub label: u128,
    pub since: Instant,
    /// Its copies are not rebuilt elsewhere before this (it went silent,
    /// and may come back within the grace: Ceph's down-out interval), so
    /// that taking it back has something to take; `None` once its process
    /// is known gone.
    pub hold_until: Option<Instant>,
}

/// Slots written while some donor is away (the write-intent bitmap of
/// re-add): a unit with a member in one was written, so its member on the
/// returning donor is stale.
#[derive(Default)]
pub(crate) struct Dirty {
    /// Donors away now: the request path notes nothing while it is 0.
    away: AtomicUsize,
    slots: Mutex<HashSet<Loc>>,
}

impl Dirty {
    /// Notes the slots that write requests were sent to (whatever became
    /// of them): one relaxed load while no donor is away.
    pub(crate) fn note(&self, locs: impl Iterator<Item = Loc>) {
        if self.away.load(Ordering::Acquire) == 0 {
            return;
        }
        self.slots.lock_or_recover().extend(locs);
    }

    fn went_away(&self) {
        self.away.fetch_add(1, Ordering::AcqRel);
    }

    fn came_back(&self) {
        if self.away.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Nobody away: what was noted can no longer matter.
            self.slots.lock_or_recover().clear();
        }
    }
}

/// What a probe of a suspect donor found.
enum Probe {
    /// It answers, its label intact.
    Back,
    /// Its process is gone (the connection is refused), or it answers
    /// without our label (it restarted): our data on it is gone.
    Restarted(String),
    /// No answer (yet).
    Silent(String),
}

/// Longest pause between probes of a suspect donor.
const MAX_PAUSE: Duration = Duration::from_secs(1);

impl Inner {
    /// Whether failing donor `d` now keeps the mode's promise: every member
    /// it holds is still covered by others. Not in mode none, nor when as
    /// many other donors are failed already as a unit can lose.
    pub(crate) fn may_fail_now(&self, d: &Donor) -> bool {
        match self.layout.mode {
            Redundancy::None => false,
            // The write-through file holds every page.
            Redundancy::Disk => true,
            _ => {
                let spare = self.layout.members() - self.layout.mode.data_members() as usize;
                let failed_others = self
                    .members
                    .iter()
                    .filter(|o| o.idx != d.idx && o.is_failed())
                    .count();
                failed_others < spare
            }
        }
    }

    /// Remembers, as donor `d` fails, the label it should carry if it
    /// comes back intact; from now on written slots are noted. With
    /// `hold`, its copies wait out the grace before they are rebuilt.
    pub(crate) fn note_away(&self, d: &Donor, hold: bool) {
        let label = self.map.donor_label(d.id);
        if label == 0 || self.layout.mode == Redundancy::Disk {
            // Nothing of ours to take back (mode disk rebuilds from its file).
            return;
        }
        let mut a = d.away.lock_or_recover();
        if a.is_none() {
            let now = Instant::now();
            *a = Some(Away {
                label,
                since: now,
                hold_until: hold.then(|| now + Duration::from_millis(self.cfg.grace_ms)),
            });
            self.dirty.went_away();
        }
    }

    /// Entry `new` takes over from `old`, the same donor at another address:
    /// failed as it was, with the label to take it back by.
    pub(crate) fn succeed(&self, old: &Donor, new: &Donor) {
        *new.away.lock_or_recover() = old.away.lock_or_recover().take();
        // What it held when marked lost goes with it, to be trimmed if
        // not taken back (the same export, another address).
        *new.left_behind.lock_or_recover() =
            std::mem::take(&mut *old.left_behind.lock_or_recover());
        let (failure, failed_at, marked) = {
            let h = old.health();
            (h.failure.clone(), h.failed_at, h.marked)
        };
        {
            // Not marked yet: the maintenance thread marks its copies lost
            // under the new entry (they are found by its map id).
            let mut h = new.health();
            h.failure = failure;
            h.failed_at = failed_at;
            h.marked = marked;
        }
        new.pool.close();
        new.failed.store(true, Ordering::Release);
    }

    /// Donor `d` is known gone (its process ended, or it came back without
    /// our data): its copies are rebuilt now, nothing is held for it.
    pub(crate) fn fail_donor_gone(&self, d: &Donor, reason: &str) {
        self.fail_donor_as(d, reason, false);
        if let Some(a) = d.away.lock_or_recover().as_mut() {
            a.hold_until = None;
        }
    }

    /// Whether lost member `m`'s rebuild waits: its donor went silent
    /// within the grace and may come back with it.
    pub(crate) fn rebuild_held(&self, m: &crate::extent_map::Member) -> bool {
        let Some(i) = self.loc_donor(m.loc) else {
            return false;
        };
        let now = Instant::now();
        self.members[i]
            .away
            .lock_or_recover()
            .is_some_and(|a| a.hold_until.is_some_and(|t| now < t))
    }

    /// Forgets that `d` was away (it came back, or will never be taken
    /// back).
    pub(crate) fn end_away(&self, d: &Donor) -> Option<Away> {
        let a = d.away.lock_or_recover().take();
        if a.is_some() {
            self.dirty.came_back();
        }
        a
    }

    /// Donor `d` did not answer (`e`): waits, probing it, until it answers
    /// again with its label (true), or until the grace since it first went
    /// quiet is over, or it turns out to have restarted (false; the caller
    /// fails it).
    pub(crate) fn await_donor(&self, d: &Donor, e: &NbdError) -> bool {
        let grace = Duration::from_millis(self.cfg.grace_ms);
        let since = d.suspect_since(e);
        let mut pause = Duration::from_millis(20);
        loop {
            if d.is_failed() {
                return false;
            }
            if !d.is_suspect() {
                // Another waiter's probe found it back.
                return true;
            }
            if since.elapsed() >= grace || self.stop.load(Ordering::Relaxed) {
                return false;
            }
            // One prober at a time; the others wait for its verdict.
            if let Ok(_one) = d.probing.try_lock() {
                if !d.is_suspect() {
                    return true;
                }
                match self.probe(d) {
                    Probe::Back => {
                        self.cleared(d, since);
                        return true;
                    }
                    Probe::Restarted(why) => {
                        self.fail_donor_gone(d, &why);
                        return false;
                    }
                    Probe::Silent(why) => tracing::debug!(
                        "donor {} still silent after {} ms: {why}",
                        d.cfg.name,
                        since.elapsed().as_millis()
                    ),
                }
            }
            let left = grace.saturating_sub(since.elapsed());
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    /// Epoch: a suspect donor that nobody waits on (an idle device) is
    /// probed once; one silent past the grace is failed.
    pub(crate) fn check_suspect(&self, d: &Donor) {
        let Some(since) = d.suspect_at() else { return };
        if d.is_failed() {
            return;
        }
        let grace = Duration::from_millis(self.cfg.grace_ms);
        let Ok(_one) = d.probing.try_lock() else {
            return;
        };
        match self.probe(d) {
            Probe::Back => self.cleared(d, since),
            Probe::Restarted(why) => self.fail_donor_gone(d, &why),
            // It had its grace already: its copies are rebuilt at once.
            Probe::Silent(why) if since.elapsed() >= grace => self.fail_donor_gone(
                d,
                &format!(
                    "no answer for {} s, past the grace of {} s: {why}",
                    since.elapsed().as_secs(),
                    grace.as_secs()
                ),
            ),
            Probe::Silent(_) => {}
        }
    }

    fn cleared(&self, d: &Donor, since: Instant) {
        d.clear_suspect();
        tracing::warn!(
            "donor {} answers again after {} ms of silence: nothing lost",
            d.cfg.name,
            since.elapsed().as_millis()
        );
    }

    /// Drops `d`'s connections (a new round: what is queued on the old ones
    /// is refused by the donor) and reads its label on a fresh one.
    fn probe(&self, d: &Donor) -> Probe {
        d.pool.close();
        d.pool.reopen();
        let mut b = vec![0u8; LABEL_BYTES];
        let res = d
            .pool
            .checkout()
            .and_then(|mut l| l.run(0, Op::Read(&mut b)));
        match res {
            // Nothing listens there: its process, and our data, are gone.
            Err(e) if e.is_refused() || e.is_restarted() => return Probe::Restarted(e.to_string()),
            Err(e) => return Probe::Silent(e.to_string()),
            Ok(()) => {}
        }
        let expected = self.map.donor_label(d.id);
        let found = label::decode(&b).value();
        if expected == 0 || found == Some(expected) {
            d.answered.fetch_add(1, Ordering::Relaxed);
            Probe::Back
        } else {
            Probe::Restarted(
                "it answers again but without our label: it restarted, our data on it is gone"
                    .into(),
            )
        }
    }

    /// Re-add: `d` was away and still carries the label it had, so its
    /// members are taken back (below); `None` when it was not away,
    /// or came back without our data (then it is a new donor).
    pub(crate) fn take_back(&self, d: &Donor) -> Option<(u64, u64)> {
        let away = (*d.away.lock_or_recover())?;
        let mut lease = d.pool.checkout().ok()?;
        let size = lease.size();
        let mut b = vec![0u8; LABEL_BYTES];
        lease.run(0, Op::Read(&mut b)).ok()?;
        drop(lease);
        if label::decode(&b).value() != Some(away.label) {
            // It restarted: nothing to take back.
            self.end_away(d);
            return None;
        }
        tracing::info!(
            "donor {} answers with our label after {} s away: taking it back",
            d.cfg.name,
            away.since.elapsed().as_secs()
        );
        // Usable before any member is taken back: a member taken back on a
        // donor still failed was skipped by the next write to its group
        // (a degraded write), and read back stale once the donor was back
        // (the nemesis, parity, seed 28889085: d3 on a slow link, taken
        // back while its trims crawled). Not placed on before `attached`.
        Self::is_back(d, None);
        self.set_capacity(d, size, false);
        // Taken back while the slots written meanwhile are still noted.
        let r = self.readd(d, away);
        self.end_away(d);
        d.attached.store(true, Ordering::Release);
        Some(r)
    }

    /// Donor `d`, failed while away with label `away`, answers with that
    /// label: each of its members whose unit no write touched meanwhile is
    /// taken back as it is; the others stay lost and are re-created by
    /// rebuild (their stale slots are trimmed first, while nothing can be
    /// placed on `d`). Returns (taken back, left to rebuild).
    pub(crate) fn readd(&self, d: &Donor, away: Away) -> (u64, u64) {
        if let Err(e) = self.set_label(d, away.label) {
            tracing::error!("journaling donor {}'s label: {e}", d.cfg.name);
            return (0, 0);
        }
        // A copy, not taken: another donor back at the same epoch runs its
        // re-add at the same time (on another poller) and needs every slot
        // noted while it was away too. Taken, the set could be empty for
        // the second one, which would take back members written meanwhile
        // (seen in the code while tracing the nemesis's ec seed 3141592629,
        // where fio read wrong blocks after two donors came back at once).
        let dirty = self.dirty.slots.lock_or_recover().clone();
        let (mut back, mut stale) = (0u64, 0u64);
        for u in 0..self.layout.units() {
            let mut g = self.map.unit(u).write_or_recover();
            let Some(unit) = g.as_mut() else { continue };
            // Also what was noted since the noted set was taken: a write
            // that skipped this member (still lost) just before the lock.
            let written = {
                let now = self.dirty.slots.lock_or_recover();
                (unit.members.iter()).any(|m| dirty.contains(&m.loc) || now.contains(&m.loc))
            };
            let mut changed = false;
            for m in unit.members.iter_mut() {
                let on_d = matches!(m.loc, Loc::Donor { donor, .. } if donor == d.id);
                if !on_d || m.state != CopyState::Lost {
                    continue;
                }
                if !written && self.map.reclaim(m.loc) {
                    m.state = CopyState::Ok;
                    changed = true;
                    back += 1;
                    // Counted under the unit's lock: a status that sees
                    // the member no longer lost sees it counted too.
                    d.taken_back.fetch_add(1, Ordering::Relaxed);
                } else {
                    stale += 1;
                }
            }
            if changed {
                if let Err(e) = self.map.commit(u, &g) {
                    tracing::error!("journaling unit {u} taken back: {e}");
                }
            }
        }
        // Every slot it held that no member took back: stale members, and
        // members rebuilt elsewhere while it was away. Nothing else can be
        // placed on it before these trims: it is not attached yet.
        let left = std::mem::take(&mut *d.left_behind.lock_or_recover());
        for slot in left {
            if self.map.in_use(Loc::Donor { donor: d.id, slot }) {
                continue;
            }
            let at = u64::from(slot) * self.layout.extent;
            let res = d
                .pool
                .checkout()
                .and_then(|mut l| l.run(at, Op::Trim(self.layout.extent)));
            if let Err(e) = res {
                tracing::debug!("donor {}: trimming a slot left behind: {e}", d.cfg.name);
            }
        }
        (back, stale)
    }
}

/// The check of each connection a donor's pool opens after its first: the
/// export still carries `want`'s label. A donor killed and started again
/// at once accepts the connection to an empty export of the same name,
/// and a request sent again after its connection broke would have read
/// its zeros as our data (the nemesis, ec, seed 3141592607).
pub(crate) fn label_check(want: Arc<Mutex<u128>>) -> netpager_nbd::Check {
    Arc::new(move |lease| {
        let expected = *want.lock_or_recover();
        if expected == 0 {
            return Ok(());
        }
        let mut b = vec![0u8; LABEL_BYTES];
        lease.run(0, Op::Read(&mut b))?;
        // A label dropped meanwhile (unlabel clears `want` before its trim)
        // is no restart.
        if label::decode(&b).value() == Some(expected) || *want.lock_or_recover() != expected {
            return Ok(());
        }
        Err(netpager_nbd::NbdError::Restarted {
            addr: lease.addr().to_string(),
            message: "a new connection finds its export without our label: the donor restarted (or lost its memory), and what it holds now is not our data".into(),
        })
    })
}
