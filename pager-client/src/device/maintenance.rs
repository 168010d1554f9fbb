//! Background repair: copies of failed donors are re-created elsewhere
//! (rebuild), extents leave draining donors (drain), a copy whose donor
//! ran out of room moves (relocation), and copies spilled to the local
//! fallback move to donors that have room again (off the fallback). All
//! four move one member of one unit at a time under that unit's write lock.
//!
//! Calls: the backend for what a moved member should hold
//! (`Inner::member_content`, backend.rs), placement for its new slot, and
//! the backend's own maintenance (parity log cleaner, idle drain, write
//! intents) once a pass.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use netpager_util::{LockExt, RwLockExt};

use super::placement::{donor_ids, Spill};
use super::report::Job;
use super::{DeviceError, Inner, Result};
use crate::extent_map::{CopyState, Loc, Member, Redundancy, SlotOwner, Unit};
use crate::status::Progress;
use netpager_nbd::Op;

/// Why a member moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MoveWhy {
    /// It is lost: re-create it from the others (or the write-through file).
    Rebuild,
    /// Its donor is draining: copy it away, then trim the old slot.
    Drain,
    /// Its donor refused a write for lack of room, which is written again
    /// at its new place: the member itself (current but for the refused
    /// bytes) or the other members have the data that belongs there.
    Full,
    /// It is on the local fallback and a donor has room: copy it there.
    OffFallback,
    /// Its donor holds more than its share: copy it to one below its share
    /// (rebalance.rs).
    Rebalance,
}

impl MoveWhy {
    /// The member being moved holds the data itself (read it first).
    pub(crate) fn reads_itself_first(self) -> bool {
        matches!(
            self,
            MoveWhy::Drain | MoveWhy::OffFallback | MoveWhy::Rebalance
        )
    }

    fn job(self) -> Job {
        match self {
            MoveWhy::Rebuild | MoveWhy::Full => Job::Rebuild,
            MoveWhy::Drain => Job::Drain,
            MoveWhy::OffFallback => Job::OffFallback,
            MoveWhy::Rebalance => Job::Rebalance,
        }
    }
}

/// How a pass of moves ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    Done,
    /// Its time is up; the next pass goes on.
    OutOfTime,
    /// Why it cannot go on now.
    Stalled(String),
}

/// How long one pass off the fallback may run: rebuilds, drains and status
/// wait behind it.
const OFF_FALLBACK_PASS: Duration = Duration::from_secs(1);

/// A member about to move: member `j` of unit `u`, placed as `unit`.
pub(crate) struct Moving<'a> {
    pub(crate) u: u64,
    pub(crate) unit: &'a Unit,
    pub(crate) j: usize,
    pub(crate) why: MoveWhy,
}

impl Inner {
    /// Moves member `j` of unit `u` (write lock held, `g` is the locked
    /// placement) to a new slot on a donor that holds no other member.
    pub(crate) fn move_member(
        &self,
        u: u64,
        g: &mut Option<Unit>,
        j: usize,
        why: MoveWhy,
    ) -> Result<()> {
        self.move_member_to(u, g, j, why, None)
    }

    /// [`Self::move_member`] to donor entry `to` if given, else to one the
    /// selector picks. A member that still holds its data (drain, off the
    /// fallback, rebalance) is journaled as moving from its old place,
    /// which is given back only after the switch: a restart in between
    /// finds it there (`ExtentMap::commit_move`).
    pub(crate) fn move_member_to(
        &self,
        u: u64,
        g: &mut Option<Unit>,
        j: usize,
        why: MoveWhy,
        to: Option<usize>,
    ) -> Result<()> {
        let ext = self.layout.extent as usize;
        let unit = g.as_ref().expect("a placed unit").clone();
        let old = unit.members[j];
        let mut bufs = self.bufs.take(2);
        let (content, scratch) = bufs.two(ext);
        let mv = Moving {
            u,
            unit: &unit,
            j,
            why,
        };
        self.member_content(&mv, content, scratch)?;
        // Distinct donors: not where another live member is, and not back
        // where this one is leaving from (a lost member's donor may have
        // come back as a new donor: that one is fine).
        let mut exclude = donor_ids(unit.members.iter().enumerate().filter_map(|(k, m)| {
            ((k != j && m.state != CopyState::Lost) || (k == j && why != MoveWhy::Rebuild))
                .then_some(m)
        }));
        let first_extent = u * self.layout.data_per_unit();
        let spill = if why == MoveWhy::OffFallback {
            Spill::DonorsOnly
        } else {
            Spill::Allowed
        };
        let mut next = unit.clone();
        let dest = loop {
            let dest = match to {
                Some(i) => self.allocate_on(i, &exclude, first_extent)?,
                None => {
                    self.allocate_where(1, &exclude, first_extent, spill)?
                        .remove(0)
                        .0
                }
            };
            next.members[j] = Member {
                loc: dest,
                state: CopyState::Rebuilding,
            };
            *g = Some(next.clone());
            if why.reads_itself_first() && old.state == CopyState::Ok {
                self.map.commit_move(u, g, j, old.loc)?;
            } else {
                self.map.commit(u, g)?;
            }
            let Err(f) = self.exec1(dest, 0, Op::Write(content)) else {
                break dest;
            };
            self.map.free(dest);
            next.members[j] = old;
            *g = Some(next.clone());
            self.map.commit(u, g)?;
            let reason = format!("copying to its new place: {}", f.reason());
            match (f, dest, to) {
                // Full since the last epoch (another device filled its
                // budget), it is marked so now: another donor may take it
                // (the `make test` slice, mode none, seed 2802978135, gave
                // the application ENOSPC). Each try excludes one more.
                (super::io::IoFail::NoSpace(_), Loc::Donor { donor, .. }, None) => {
                    exclude.push(donor);
                    tracing::debug!("unit {u}: member {j}: {reason}; trying another donor");
                }
                (super::io::IoFail::NoSpace(_), ..) => {
                    return Err(DeviceError::NoSpace {
                        extent: first_extent,
                        reason,
                    })
                }
                (super::io::IoFail::Failed(_), ..) => {
                    return Err(DeviceError::Io {
                        extent: first_extent,
                        reason,
                    })
                }
            }
        };
        next.members[j] = Member {
            loc: dest,
            state: CopyState::Ok,
        };
        *g = Some(next);
        self.map.commit(u, g)?;
        self.release_slot(old);
        Ok(())
    }

    /// Member `j` of striped unit `u` was refused a write for lack of room
    /// while the unit's other members took their part of it: it moves
    /// (read from itself, or re-created from the others where it cannot
    /// be read) and the bytes it was refused, `patches` (offset, bytes),
    /// are written at its new place. With no room anywhere it is marked
    /// lost instead, so nothing reads its stale bytes (rebuild re-creates
    /// it once there is room), if the others can still be read without it.
    /// Kept as it was, it read back stale and, once another member was
    /// lost, decoded into the other extents of its group (the nemesis, ec,
    /// seed 2485690532). If they cannot, it stays and this fails: the
    /// caller puts back what the others took where it can. `stale`: other
    /// members refused the same write and not yet settled, which hold old
    /// bytes, so they do not count among those that can be read.
    pub(crate) fn move_refused(
        &self,
        u: u64,
        g: &mut Option<Unit>,
        j: usize,
        patches: &[(u64, &[u8])],
        stale: &[usize],
    ) -> Result<()> {
        let err = match self.move_member(u, g, j, MoveWhy::Full) {
            Ok(()) => {
                let m = g.as_ref().expect("a placed unit").members[j];
                let failed = patches
                    .iter()
                    .find_map(|&(off, bytes)| self.exec1(m.loc, off, Op::Write(bytes)).err());
                let Some(f) = failed else {
                    return Ok(());
                };
                DeviceError::Io {
                    extent: u * self.layout.data_per_unit(),
                    reason: format!("writing the refused bytes at its new place: {}", f.reason()),
                }
            }
            Err(
                e @ (DeviceError::NoSpace { .. }
                | DeviceError::Io { .. }
                | DeviceError::Lost { .. }),
            ) => e,
            Err(e) => return Err(e),
        };
        let unit = g.as_ref().expect("a placed unit");
        let others = (unit.members.iter().enumerate())
            .filter(|&(k, m)| k != j && !stale.contains(&k) && self.usable(m))
            .count();
        // Dropped, it would take the whole unit with it (the nemesis,
        // parity, drains-overlapping: a second refusal in one group).
        if others < self.layout.data_per_unit() as usize {
            return Err(err);
        }
        self.drop_member(u, g, j)?;
        tracing::warn!("unit {u}: member {j} lost until there is room for it ({err})");
        Ok(())
    }

    /// Marks member `j` of unit `u` lost and gives back its slot.
    pub(crate) fn drop_member(&self, u: u64, g: &mut Option<Unit>, j: usize) -> Result<()> {
        let Some(unit) = g.as_mut() else {
            return Ok(());
        };
        let old = unit.members[j];
        unit.members[j].state = CopyState::Lost;
        self.map.commit(u, g)?;
        self.release_slot(old);
        Ok(())
    }

    /// At open: copies on donors no longer in the configuration are lost.
    pub(crate) fn forget_unconfigured_donors(&self) -> Result<()> {
        for u in 0..self.layout.units() {
            let mut g = self.map.unit(u).write_or_recover();
            let Some(unit) = g.as_mut() else { continue };
            let mut changed = false;
            for m in unit.members.iter_mut() {
                if matches!(m.loc, Loc::Donor { .. })
                    && self.loc_donor(m.loc).is_none()
                    && m.state != CopyState::Lost
                {
                    m.state = CopyState::Lost;
                    changed = true;
                }
            }
            if changed {
                self.map.commit(u, &g)?;
            }
        }
        Ok(())
    }

    /// At open: copies on a donor whose label the journal dropped are
    /// lost. The label goes as the donor fails, before any write skips its
    /// copies; a serving process that died before marking them lost left
    /// them looking whole.
    pub(crate) fn distrust_unlabelled(&self) -> Result<()> {
        for u in 0..self.layout.units() {
            let mut g = self.map.unit(u).write_or_recover();
            let Some(unit) = g.as_mut() else { continue };
            let mut changed = false;
            for m in unit.members.iter_mut() {
                if let Loc::Donor { donor, .. } = m.loc {
                    if m.state == CopyState::Ok && self.map.donor_label(donor) == 0 {
                        m.state = CopyState::Lost;
                        self.map.free(m.loc);
                        changed = true;
                    }
                }
            }
            if changed {
                self.map.commit(u, &g)?;
            }
        }
        Ok(())
    }

    fn set_job(&self, job: Job, f: impl FnOnce(&mut Progress)) {
        f(self.jobs.lock_or_recover().of(job));
    }

    /// Members to move: (unit, member) pairs matching `want`.
    fn scan(&self, want: impl Fn(&Member) -> bool) -> Vec<(u64, usize)> {
        let mut out = Vec::new();
        for u in 0..self.layout.units() {
            let g = self.map.unit(u).read_or_recover();
            if let Some(unit) = g.as_ref() {
                out.extend(
                    unit.members
                        .iter()
                        .enumerate()
                        .filter(|(_, m)| want(m))
                        .map(|(j, _)| (u, j)),
                );
            }
        }
        out
    }

    /// Moves the listed members, until `until` if given. Off the fallback,
    /// a copy no donor can take now stays where it is and the rest go on.
    fn move_all(
        &self,
        work: Vec<(u64, usize)>,
        why: MoveWhy,
        still: impl Fn(&Member) -> bool,
        until: Option<Instant>,
    ) -> Ended {
        let job = why.job();
        let mut stays = None;
        for (u, j) in work {
            if self.stop.load(Ordering::Relaxed) {
                return Ended::Stalled("device stopping".into());
            }
            if until.is_some_and(|t| Instant::now() >= t) {
                return Ended::OutOfTime;
            }
            let mut g = self.map.unit(u).write_or_recover();
            if !g
                .as_ref()
                .and_then(|unit| unit.members.get(j))
                .is_some_and(&still)
            {
                continue;
            }
            match self.move_member(u, &mut g, j, why) {
                Ok(()) => self.set_job(job, |p| p.done += 1),
                Err(DeviceError::Lost { extent, reason }) => {
                    // Nothing to copy from: counted as lost in the status.
                    tracing::debug!("cannot re-create a copy of extent {extent}: {reason}");
                    self.set_job(job, |p| p.total = p.total.saturating_sub(1));
                }
                Err(e @ DeviceError::NoSpace { .. }) if why == MoveWhy::OffFallback => {
                    self.set_job(job, |p| p.total = p.total.saturating_sub(1));
                    stays = Some(e.to_string());
                }
                Err(e) => return Ended::Stalled(e.to_string()),
            }
            drop(g);
            self.maybe_write_status();
        }
        match stays {
            Some(why) => Ended::Stalled(why),
            None => Ended::Done,
        }
    }

    fn run_job(&self, why: MoveWhy, want: impl Fn(&Member) -> bool + Copy, until: Option<Instant>) {
        let job = why.job();
        let warned = self.jobs.lock_or_recover().of(job).stalled.clone();
        let work = self.scan(want);
        if work.is_empty() {
            // Keep the last pass's numbers on show.
            self.set_job(job, |p| {
                p.active = false;
                p.stalled = None;
            });
            return;
        }
        self.set_job(job, |p| {
            if !p.active {
                p.done = 0;
            }
            p.total = p.done + work.len() as u64;
            p.active = true;
            p.stalled = None;
        });
        let ended = self.move_all(work, why, want, until);
        self.set_job(job, |p| {
            p.active = ended != Ended::Done;
            let stalled = match ended {
                Ended::Stalled(s) => Some(s),
                Ended::Done | Ended::OutOfTime => None,
            };
            // Once per reason, not once a pass.
            if let Some(s) = stalled.as_ref().filter(|&s| warned.as_ref() != Some(s)) {
                tracing::warn!("{} stalled: {s}", job.name());
            }
            p.stalled = stalled;
        });
    }

    fn rebuild_pass(&self) {
        if self.layout.mode == Redundancy::None {
            return;
        }
        self.run_job(
            MoveWhy::Rebuild,
            |m| m.state == CopyState::Lost && !self.rebuild_held(m),
            None,
        );
    }

    /// Moves extents off donors that are draining (their owner wants the
    /// memory back) or leaving the set.
    fn drain_pass(&self) {
        let draining: Vec<u16> = self
            .members
            .iter()
            .filter(|d| (d.draining.load(Ordering::Acquire) || d.is_leaving()) && !d.is_failed())
            .map(|d| d.id)
            .collect();
        let on_draining = |m: &Member| {
            m.state == CopyState::Ok
                && matches!(m.loc, Loc::Donor { donor, .. } if draining.contains(&donor))
        };
        self.run_job(MoveWhy::Drain, on_draining, None);
        for d in self.members.iter().filter(|d| draining.contains(&d.id)) {
            let (held, _) = self.map.slot_usage(SlotOwner::Donor(d.id));
            if held == 0 && self.map.donor_label(d.id) != 0 {
                tracing::info!(
                    "donor {} drained: nothing of ours is left on it",
                    d.cfg.name
                );
                if let Err(e) = self.drop_label(d) {
                    tracing::error!("donor {}: {e}", d.cfg.name);
                }
            }
        }
    }

    /// Moves copies spilled to the local fallback onto donors that have
    /// room again (a donor joined, one stopped draining, a job freed its
    /// pages): the fallback is for when the lab has no memory to give, not
    /// where pages stay once it has. Donors are picked by the same
    /// weighted age/load rule as new extents, so a capped or busy donor
    /// gets nothing; each pass runs for at most [`OFF_FALLBACK_PASS`].
    fn off_fallback_pass(&self) {
        if self.fallback.is_none() || self.map.slot_usage(SlotOwner::Fallback).0 == 0 {
            self.set_job(Job::OffFallback, |p| p.active = false);
            return;
        }
        let room = self
            .members
            .iter()
            .any(|d| self.ineligible_reason(d.idx).is_none());
        if !room || self.placement.lock_or_recover().freqs.all_capped {
            self.set_job(Job::OffFallback, |p| {
                p.active = false;
                p.stalled = None;
            });
            return;
        }
        let on_fallback =
            |m: &Member| m.state == CopyState::Ok && matches!(m.loc, Loc::Fallback { .. });
        self.run_job(
            MoveWhy::OffFallback,
            on_fallback,
            Some(Instant::now() + OFF_FALLBACK_PASS),
        );
    }

    pub(crate) fn maintenance_loop(&self) {
        while self.maint_wake.wait(Duration::from_secs(1), &self.stop) {
            if self.fenced.get().is_some() {
                // Replaced: the newer process keeps the map and the donors.
                self.write_status();
                continue;
            }
            self.mark_failed_donors();
            self.rebuild_pass();
            self.drain_pass();
            self.off_fallback_pass();
            self.rebalance_pass();
            self.settle_membership();
            self.maintain_backend();
            self.write_status();
            if self.map.needs_compaction() {
                if let Err(e) = self.journal().compact() {
                    tracing::error!("compacting the extent map: {e}");
                }
            }
        }
    }

    /// How long the device has served no request, as the maintenance
    /// thread has seen it (to within one of its passes).
    pub(crate) fn idle_for(&self) -> Duration {
        let now = self.requests.load(Ordering::Relaxed);
        let mut last = self.last_request.lock_or_recover();
        if last.0 != now {
            *last = (now, Instant::now());
        }
        last.1.elapsed()
    }

    /// Writes `status.json` if the last write is more than a second old.
    pub(crate) fn maybe_write_status(&self) {
        let due = {
            let j = self.jobs.lock_or_recover();
            j.last_status
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        };
        if due {
            self.write_status();
        }
    }

    pub(crate) fn write_status(&self) {
        // Several threads write it (maintenance, membership changes): one
        // at a time, or their temporary files tear each other.
        let _one = self.status_write.lock_or_recover();
        let s = self.build_status();
        self.jobs.lock_or_recover().last_status = Some(Instant::now());
        if let Err(e) = s.write_atomic(&self.state_dir) {
            tracing::warn!("writing {}/status.json: {e}", self.state_dir.display());
        }
    }
}
