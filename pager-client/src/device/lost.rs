//! Lost extents made usable again. An extent is lost when every copy is
//! gone (modes none, mirror) or its group misses more members than its
//! code survives (parity, ec), say after its donors restarted while the
//! client was away. Until something is done, every read there and every
//! write that needs the old data fails.
//!
//! - A write into a lost extent re-places its unit first: the gone members
//!   get fresh, zeroed slots on live donors (a group keeps its live
//!   members and has its parity recomputed), and the lost extents' pages
//!   are journaled *unfound* (`extent_map/unfound.rs`): they read as I/O
//!   errors until written, so no one reads zeros where data was lost (as
//!   Ceph's unfound objects until `mark_unfound_lost`).
//! - `forget-lost` does the same for a range of extents, but leaves their
//!   pages reading as zeros.
//!
//! A logged page (parity log) whose log unit is lost is lost too: it is
//! dropped from the log and zeroed at home, and is unfound unless
//! forgotten. Pages whose log copy lives are not lost and stay in the log.
//!
//! Also why a unit's data is gone, in words (`Inner::lost_reason`), for
//! both backends' errors.
//!
//! Calls: `allocate` (placement.rs), `resync_group` (stripe/resync.rs),
//! `write_pages_locked` (stripe/write.rs, to zero a page at home). Lock order as
//! everywhere: home unit, then log unit.

use std::ops::RangeInclusive;
use std::sync::RwLockWriteGuard;

use netpager_util::RwLockExt;

use super::io::{batch, IoReq, ZEROS};
use super::placement::donor_ids;
use super::{DeviceError, Inner, Result};
use crate::extent_map::{CopyState, Loc, Member, Redundancy, Unit};
use crate::page_log::{Slot, PAGE};
use netpager_nbd::Op;

/// What recovering one unit did.
#[derive(Debug, Default)]
pub(crate) struct Recovered {
    /// Lost extents given fresh members.
    pub extents: Vec<u64>,
    /// Logged pages dropped because their log unit is lost.
    pub log_pages: Vec<u64>,
}

impl Recovered {
    fn any(&self) -> bool {
        !self.extents.is_empty() || !self.log_pages.is_empty()
    }
}

/// What `forget-lost` did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Forgotten {
    /// Lost extents placed again, reading as zeros now.
    pub extents: Vec<u64>,
    /// Pages of the other extents in the range that read as lost
    /// (unfound, or logged in a lost log unit) and read as zeros now.
    pub pages: u64,
}

impl Inner {
    /// Why extent `e`'s data is gone, in words: every copy's donor; in a
    /// group (modes parity, ec) the members that are gone, since the others
    /// still hold their own extents.
    pub(crate) fn lost_reason(&self, unit: &Unit) -> String {
        let striped = self.layout.mode.striped();
        let names: Vec<String> = unit
            .members
            .iter()
            .filter(|m| !striped || !self.usable(m))
            .map(|m| match self.loc_donor(m.loc) {
                Some(i) => {
                    let d = &self.members[i];
                    let why = d
                        .health()
                        .failure
                        .clone()
                        .unwrap_or_else(|| "copy lost".into());
                    format!("donor {} ({why})", d.cfg.name)
                }
                None => format!("{:?}", m.loc),
            })
            .collect();
        if striped {
            format!("members gone: {}", names.join("; "))
        } else {
            format!("no copy left: {}", names.join("; "))
        }
    }

    /// Whether unit `u` (placement `unit`) can no longer be read: a group
    /// missing more members than its code survives, or a data member while
    /// its parity is not trusted; a copy set with no copy left. Never in
    /// mode disk, whose file holds every page.
    pub(crate) fn unit_lost(&self, u: u64, unit: &Unit) -> bool {
        let bad: Vec<usize> = (0..unit.members.len())
            .filter(|&j| !self.usable(&unit.members[j]))
            .collect();
        match self.layout.mode {
            Redundancy::Disk => false,
            m if m.striped() => self.group_lost(u, &bad),
            _ => bad.len() == unit.members.len(),
        }
    }

    /// Whether group `u` whose members `bad` are gone can no longer be
    /// read there: more are gone than its code survives, or a data member
    /// while its parity may not match its data (`ExtentMap::is_unsynced`).
    pub(crate) fn group_lost(&self, u: u64, bad: &[usize]) -> bool {
        bad.len() > self.layout.parity_count()
            || (self.map.is_unsynced(u)
                && bad.iter().any(|&j| self.layout.extent_of(u, j).is_some()))
    }

    /// The home units a request of `len` bytes at `offset` touches.
    fn units_of(&self, offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
        let ext = self.layout.extent;
        let last = (offset + len.max(1) - 1) / ext;
        self.layout.locate(offset / ext).0..=self.layout.locate(last).0
    }

    /// Before a write of `len` bytes at `offset`, while the status shows
    /// lost extents: recovers every home unit it touches (a lost unit gets
    /// fresh members, its pages lost in the parity log are dropped), so the
    /// write has somewhere to go and what it did not write reads as lost.
    pub(crate) fn replace_lost_for_write(&self, offset: u64, len: u64) -> Result<()> {
        if self.lost_seen.load(std::sync::atomic::Ordering::Relaxed) {
            self.recover_range_for_write(offset, len)?;
        }
        Ok(())
    }

    /// After a write of `len` bytes at `offset` failed as lost (a logged
    /// page it had to merge with is lost, or a unit was lost meanwhile):
    /// recovers the units it touches; false if there was nothing to
    /// recover (the write then fails).
    pub(crate) fn recover_range_for_write(&self, offset: u64, len: u64) -> Result<bool> {
        let mut any = false;
        for u in self.units_of(offset, len) {
            any |= self.recover_for_write(u)?;
        }
        Ok(any)
    }

    /// Recovers home unit `u` for a write; false if nothing was lost.
    fn recover_for_write(&self, u: u64) -> Result<bool> {
        let mut g = self.map.unit(u).write_or_recover();
        let r = self.recover_unit(u, &mut g, &|_| false)?;
        drop(g);
        if !r.extents.is_empty() {
            tracing::warn!(
                "extents {} were lost and are placed again for a write; their pages read as I/O errors until written (pagerctl forget-lost makes them zeros)",
                crate::status::format_ranges(&r.extents)
            );
        }
        if !r.log_pages.is_empty() {
            tracing::warn!(
                "{} logged pages of unit {u} were lost with their parity log unit; they read as I/O errors until written",
                r.log_pages.len()
            );
        }
        if r.any() {
            self.maint_wake.notify();
        }
        Ok(r.any())
    }

    /// Re-places home unit `u` (write-locked, placement `guard`) if it is
    /// lost, and drops its logged pages whose log unit is lost. Pages lost
    /// in extents where `forget` holds read as zeros afterwards; the others
    /// are unfound.
    fn recover_unit(
        &self,
        u: u64,
        guard: &mut RwLockWriteGuard<'_, Option<Unit>>,
        forget: &dyn Fn(u64) -> bool,
    ) -> Result<Recovered> {
        let mut r = Recovered {
            extents: self.replace_unit(u, guard, forget)?,
            log_pages: Vec::new(),
        };
        if self.parity_log().is_some() {
            r.log_pages = self.drop_lost_log_pages(u, guard, forget)?;
        }
        Ok(r)
    }

    /// Gives lost unit `u` fresh members where its members are gone;
    /// returns its lost extents (none if it was not lost).
    fn replace_unit(
        &self,
        u: u64,
        guard: &mut Option<Unit>,
        forget: &dyn Fn(u64) -> bool,
    ) -> Result<Vec<u64>> {
        let Some(unit) = guard.as_ref().filter(|unit| self.unit_lost(u, unit)) else {
            return Ok(Vec::new());
        };
        let striped = self.layout.mode.striped();
        let gone: Vec<usize> = (0..unit.members.len())
            .filter(|&j| !self.usable(&unit.members[j]))
            .collect();
        let lost: Vec<u64> = if striped {
            gone.iter()
                .filter_map(|&j| self.layout.extent_of(u, j))
                .collect()
        } else {
            vec![u]
        };
        // Unfound first: should the client die before the new placement is
        // journaled, the unit is still lost, which reads as errors too.
        for &e in lost.iter().filter(|&&e| !forget(e)) {
            self.mark_extent_unfound(e)?;
        }
        let exclude = donor_ids(unit.members.iter().filter(|m| self.usable(m)));
        let first = u * self.layout.data_per_unit();
        let locs = self.allocate(gone.len(), &exclude, first)?;
        let mut next = unit.clone();
        for (&j, &(loc, _)) in gone.iter().zip(&locs) {
            next.members[j] = Member {
                loc,
                state: CopyState::Ok,
            };
        }
        let placed = self.fill_replaced(u, &next, &locs);
        if let Err(e) = placed {
            for &(loc, _) in &locs {
                self.map.free(loc);
            }
            return Err(e);
        }
        // The gone members' slots were given back when they were marked
        // lost (or will be when their donor is).
        *guard = Some(next);
        self.map.commit(u, guard)?;
        Ok(lost)
    }

    /// Zeroes the fresh slots `locs` of unit `u` (placement `next`) that
    /// may hold old data, and recomputes a group's parity from its data
    /// members (the fresh ones being zeros).
    fn fill_replaced(&self, u: u64, next: &Unit, locs: &[(Loc, bool)]) -> Result<()> {
        let mut reqs = batch();
        for (&(loc, clean), r) in locs.iter().zip(&mut reqs) {
            *r = (!clean).then_some(IoReq {
                loc,
                off: 0,
                op: Op::Zero(self.layout.extent),
            });
        }
        let first = u * self.layout.data_per_unit();
        if let Some(f) = self
            .exec(&mut reqs)
            .iter()
            .flatten()
            .find_map(|r| r.as_ref().err())
        {
            return Err(DeviceError::Io {
                extent: first,
                reason: format!("zeroing the lost extent's new place: {}", f.reason()),
            });
        }
        if self.layout.mode.striped() {
            // Parity is written apart from the data: the write hole's mark.
            self.map.mark_written(u)?;
            self.resync_group(u, Some(next))?;
        }
        Ok(())
    }

    /// Journals the pages of extent `e` that have no copy in the parity
    /// log as unfound (a logged page is judged by its log unit).
    fn mark_extent_unfound(&self, e: u64) -> Result<()> {
        let first = e * self.layout.extent / PAGE;
        let count = self.extent_len(e).div_ceil(PAGE);
        let mut slots: Vec<Option<Slot>> = vec![None; count as usize];
        self.journal().lookup_run(first, &mut slots);
        let mut p = 0;
        while p < count {
            if slots[p as usize].is_some() {
                p += 1;
                continue;
            }
            let run = slots[p as usize..]
                .iter()
                .take_while(|s| s.is_none())
                .count() as u64;
            self.map.set_unfound(first + p, run, true)?;
            p += run;
        }
        Ok(())
    }

    /// Whether log slot `slot` can no longer be read: its log unit lost
    /// and its own member gone.
    fn log_slot_lost(&self, slot: Slot) -> bool {
        let journal = self.journal();
        let Some(geo) = journal.geometry() else {
            return false;
        };
        let (lu, _, col) = geo.place(slot);
        let pos = self
            .layout
            .member_of(self.layout.log_unit(lu), col as usize);
        journal
            .unit(lu)
            .read_or_recover()
            .as_ref()
            .is_none_or(|unit| {
                self.unit_lost(self.layout.log_unit(lu), unit) && !self.usable(&unit.members[pos])
            })
    }

    /// Drops home group `g`'s logged pages whose log copy is lost: zeroed
    /// at home (where an older copy may be), unfound unless forgotten.
    /// Returns them.
    fn drop_lost_log_pages(
        &self,
        g: u64,
        guard: &mut RwLockWriteGuard<'_, Option<Unit>>,
        forget: &dyn Fn(u64) -> bool,
    ) -> Result<Vec<u64>> {
        let k = self.layout.data_per_unit();
        let extents = (g * k..(g + 1) * k).filter(|&e| e < self.layout.extents());
        let mut dropped = Vec::new();
        for e in extents {
            let first = e * self.layout.extent / PAGE;
            let count = self.extent_len(e).div_ceil(PAGE);
            if !self.journal().any_in(first, count) {
                continue;
            }
            let mut slots: Vec<Option<Slot>> = vec![None; count as usize];
            self.journal().lookup_run(first, &mut slots);
            for (i, slot) in slots.iter().enumerate() {
                let Some(slot) = *slot else { continue };
                if !self.log_slot_lost(slot) {
                    continue;
                }
                let page = first + i as u64;
                if !forget(e) {
                    self.map.set_unfound(page, 1, true)?;
                }
                let in_off = page * PAGE - e * self.layout.extent;
                self.write_pages_locked(e, in_off, &ZEROS[..PAGE as usize], guard, false)?;
                dropped.push(page);
            }
        }
        Ok(dropped)
    }

    /// `pagerctl forget-lost`: every lost extent in `extents` (all when
    /// `None`) is placed again and reads as zeros, as do the pages there
    /// that read as lost. Lost extents outside the range that share a
    /// group with one inside get fresh members too, but their pages stay
    /// unfound.
    pub(crate) fn forget_lost(&self, extents: Option<RangeInclusive<u64>>) -> Result<Forgotten> {
        let n = self.layout.extents();
        let range = extents.unwrap_or(0..=n.saturating_sub(1));
        if range.is_empty() || *range.end() >= n {
            return Err(DeviceError::NoSuchExtents {
                first: *range.start(),
                last: *range.end(),
                extents: n,
            });
        }
        let inside = |e: u64| range.contains(&e);
        let (first_unit, last_unit) = (
            self.layout.locate(*range.start()).0,
            self.layout.locate(*range.end()).0,
        );
        let mut out = Forgotten::default();
        for u in first_unit..=last_unit {
            let mut g = self.map.unit(u).write_or_recover();
            let r = self.recover_unit(u, &mut g, &inside)?;
            let page_extent = |p: u64| p * PAGE / self.layout.extent;
            out.pages += r
                .log_pages
                .iter()
                .map(|&p| page_extent(p))
                .filter(|e| inside(*e) && !r.extents.contains(e))
                .count() as u64;
            out.extents.extend(r.extents.iter().filter(|&&e| inside(e)));
        }
        // Unfound pages were zeroed when their extent was placed again (or
        // written whole since): forgetting them is a journal record.
        let ext = self.layout.extent;
        let first_page = *range.start() * ext / PAGE;
        let end_page = ((*range.end() + 1) * ext)
            .min(self.layout.size)
            .div_ceil(PAGE);
        out.pages += self
            .map
            .set_unfound(first_page, end_page - first_page, false)?;
        if out.extents.is_empty() && out.pages == 0 {
            return Err(DeviceError::NothingLost {
                first: *range.start(),
                last: *range.end(),
            });
        }
        tracing::warn!(
            "forget-lost: extents {} placed again and {} lost pages forgotten; they read as zeros now",
            if out.extents.is_empty() {
                "none".to_string()
            } else {
                crate::status::format_ranges(&out.extents)
            },
            out.pages
        );
        self.maint_wake.notify();
        self.write_status();
        Ok(out)
    }

    /// Fails a read of `len` bytes at `offset` that covers an unfound page.
    pub(crate) fn check_found(&self, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (first, last) = (offset / PAGE, (offset + len - 1) / PAGE);
        let Some(page) = self.map.first_unfound_in(first, last - first + 1) else {
            return Ok(());
        };
        Err(DeviceError::Lost {
            extent: page * PAGE / self.layout.extent,
            reason: format!(
                "page {page} was lost with its donors and has not been written since its extent was placed again (pagerctl forget-lost makes it read as zeros)"
            ),
        })
    }
}
