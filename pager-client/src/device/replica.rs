//! The replicated backend's code (modes none, mirror, disk): every member
//! of an extent is a full copy, so a read takes any live one (in turn) and
//! a write goes to all of them at once; mode disk also queues it for the
//! write-through file. Calls `io` for requests (and to free a unit),
//! `placement` for new slots, `maintenance` to move a copy off a full donor
//! and `lost` to say why a unit's data is gone.

use std::sync::atomic::Ordering;

use netpager_util::RwLockExt;

use super::backend::ReplicatedBackend;
use super::io::{batch, IoFail, IoReq};
use super::maintenance::{MoveWhy, Moving};
use super::{DeviceError, Inner, Payload, Result};
use crate::extent_map::{CopyState, Member, Unit};
use netpager_nbd::Op;

fn op_of<'a>(p: &Payload<'a>) -> Op<'a> {
    match *p {
        Payload::Data(d) => Op::Write(d),
        Payload::Zero(n) => Op::Zero(n),
        Payload::Trim(n) => Op::Trim(n),
    }
}

impl Inner {
    pub(crate) fn read_replica(
        &self,
        rb: &ReplicatedBackend,
        e: u64,
        in_off: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let g = self.map.unit(e).read_or_recover();
        let Some(unit) = g.as_ref() else {
            buf.fill(0);
            return Ok(());
        };
        let n = unit.members.len();
        let start = rb.read_turn.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let m = unit.members[(start + k) % n];
            if self.usable(&m) && self.exec1(m.loc, in_off, Op::Read(buf)).is_ok() {
                return Ok(());
            }
        }
        if let Some(wt) = &rb.wt {
            return wt
                .read(e * self.layout.extent + in_off, buf)
                .map_err(|reason| DeviceError::Io { extent: e, reason });
        }
        Err(DeviceError::Lost {
            extent: e,
            reason: self.lost_reason(unit),
        })
    }

    fn wt_apply(&self, rb: &ReplicatedBackend, e: u64, in_off: u64, p: &Payload<'_>) {
        if let Some(wt) = &rb.wt {
            let off = e * self.layout.extent + in_off;
            match *p {
                Payload::Data(d) => wt.enqueue_write(off, d),
                Payload::Zero(n) | Payload::Trim(n) => wt.enqueue_zero(off, n),
            }
        }
    }

    pub(crate) fn modify_replica(
        &self,
        rb: &ReplicatedBackend,
        e: u64,
        in_off: u64,
        p: Payload<'_>,
    ) -> Result<()> {
        let full = in_off == 0 && p.len() == self.extent_len(e);
        if full && !matches!(p, Payload::Data(_)) {
            return self.free_unit(rb, e);
        }
        for _ in 0..8 {
            let mut relocate = Vec::new();
            {
                let g = self.map.unit(e).read_or_recover();
                match g.as_ref() {
                    None if !matches!(p, Payload::Data(_)) => return Ok(()),
                    None => {}
                    Some(unit) => {
                        let mut reqs = batch();
                        for (m, r) in unit.members.iter().zip(&mut reqs) {
                            *r = self.usable(m).then(|| IoReq {
                                loc: m.loc,
                                off: in_off,
                                op: op_of(&p),
                            });
                        }
                        if reqs.iter().all(Option::is_none) {
                            if matches!(p, Payload::Trim(_)) {
                                // Advisory, and there is nothing left to discard.
                                return Ok(());
                            }
                            if rb.wt.is_some() {
                                // The file holds the data; rebuild re-creates the copy.
                                self.wt_apply(rb, e, in_off, &p);
                                return Ok(());
                            }
                            if !(full && matches!(p, Payload::Data(_))) {
                                return Err(DeviceError::Lost {
                                    extent: e,
                                    reason: self.lost_reason(unit),
                                });
                            }
                        } else {
                            let res = self.exec(&mut reqs);
                            let ok = res.iter().flatten().filter(|r| r.is_ok()).count();
                            // Empty (no allocation) unless a donor is full.
                            relocate = res
                                .iter()
                                .enumerate()
                                .filter(|(_, r)| matches!(r, Some(Err(IoFail::NoSpace(_)))))
                                .map(|(j, _)| (j, unit.members[j].loc))
                                .collect();
                            if relocate.is_empty() {
                                if ok > 0 || rb.wt.is_some() {
                                    self.wt_apply(rb, e, in_off, &p);
                                    return Ok(());
                                }
                                // Every copy failed; their donors are marked
                                // failed now, so look again.
                                continue;
                            }
                        }
                    }
                }
            }
            let mut g = self.map.unit(e).write_or_recover();
            let none_left = g
                .as_ref()
                .is_some_and(|u| !u.members.iter().any(|m| self.usable(m)));
            if g.is_none() || (none_left && rb.wt.is_none()) {
                let Payload::Data(d) = p else { return Ok(()) };
                if g.is_none() || full {
                    self.place_replica(e, &mut g, in_off, d)?;
                    self.wt_apply(rb, e, in_off, &p);
                    return Ok(());
                }
                continue;
            }
            for (j, loc) in relocate {
                let Some(unit) = g.as_ref() else { break };
                if unit.members.get(j).map(|m| m.loc) != Some(loc) {
                    continue;
                }
                match self.move_member(e, &mut g, j, MoveWhy::Full) {
                    Ok(()) => {}
                    Err(DeviceError::NoSpace { .. } | DeviceError::Io { .. })
                        if g.as_ref().is_some_and(|u| {
                            u.members
                                .iter()
                                .enumerate()
                                .any(|(k, m)| k != j && self.usable(m))
                        }) =>
                    {
                        // Another copy takes the write: keep that one, rebuild
                        // this one when room appears, or when its new place
                        // answers (a move to a stopped donor timed out: the
                        // nemesis, mirror, seed 658104340, gave the
                        // application EIO).
                        self.drop_member(e, &mut g, j)?;
                    }
                    Err(err) => return Err(err),
                }
            }
        }
        Err(DeviceError::Io {
            extent: e,
            reason: "the write kept failing on every copy".into(),
        })
    }

    /// What member `j` of extent `u` should hold: another copy (the member
    /// itself first when it is leaving, last when its donor refused a
    /// write), or the write-through file.
    pub(crate) fn replica_member_content(
        &self,
        rb: &ReplicatedBackend,
        mv: &Moving<'_>,
        out: &mut [u8],
    ) -> Result<()> {
        let Moving { u, unit, j, why } = *mv;
        let mut order: Vec<usize> = (0..unit.members.len()).filter(|&k| k != j).collect();
        match why {
            MoveWhy::Drain | MoveWhy::OffFallback | MoveWhy::Rebalance => order.insert(0, j),
            MoveWhy::Full => order.push(j),
            MoveWhy::Rebuild => {}
        }
        for k in order {
            let m = unit.members[k];
            if self.usable(&m) && self.exec1(m.loc, 0, Op::Read(&mut *out)).is_ok() {
                return Ok(());
            }
        }
        if let Some(wt) = &rb.wt {
            let n = self.extent_len(u) as usize;
            out[n..].fill(0);
            return wt
                .read(u * self.layout.extent, &mut out[..n])
                .map_err(|reason| DeviceError::Io { extent: u, reason });
        }
        Err(DeviceError::Lost {
            extent: u,
            reason: self.lost_reason(unit),
        })
    }

    /// First write to extent `e`: choose its copies, write them, journal.
    fn place_replica(&self, e: u64, g: &mut Option<Unit>, in_off: u64, data: &[u8]) -> Result<()> {
        let full = in_off == 0 && data.len() as u64 == self.extent_len(e);
        let ext = self.layout.extent;
        // Each failed try rules out a donor (now full or failed).
        for _ in 0..self.members.len() + 2 {
            let locs = self.allocate(self.layout.members(), &[], e)?;
            let mut good = vec![true; locs.len()];
            if !full {
                let mut reqs = batch();
                for (&(loc, clean), r) in locs.iter().zip(&mut reqs) {
                    *r = (!clean).then_some(IoReq {
                        loc,
                        off: 0,
                        op: Op::Zero(ext),
                    });
                }
                for (ok, r) in good.iter_mut().zip(self.exec(&mut reqs)) {
                    *ok = r.is_none_or(|r| r.is_ok());
                }
            }
            let mut reqs = batch();
            for ((&(loc, _), &ok), r) in locs.iter().zip(&good).zip(&mut reqs) {
                *r = ok.then_some(IoReq {
                    loc,
                    off: in_off,
                    op: Op::Write(data),
                });
            }
            for (ok, r) in good.iter_mut().zip(self.exec(&mut reqs)) {
                *ok = r.is_some_and(|r| r.is_ok());
            }
            for (i, (loc, _)) in locs.iter().enumerate() {
                if !good[i] {
                    self.map.free(*loc);
                }
            }
            if !good.iter().any(|&x| x) {
                continue;
            }
            let members = locs
                .iter()
                .zip(&good)
                .map(|(&(loc, _), &ok)| Member {
                    loc,
                    state: if ok { CopyState::Ok } else { CopyState::Lost },
                })
                .collect();
            // Slots of a lost unit being overwritten were already given back.
            *g = Some(Unit { members });
            self.map.commit(e, g)?;
            if !good.iter().all(|&x| x) {
                self.maint_wake.notify();
            }
            return Ok(());
        }
        Err(DeviceError::Io {
            extent: e,
            reason: "every donor chosen for it failed".into(),
        })
    }

    /// Whole-extent zero or trim: the extent becomes unwritten again.
    fn free_unit(&self, rb: &ReplicatedBackend, u: u64) -> Result<()> {
        let mut g = self.map.unit(u).write_or_recover();
        if let Some(wt) = &rb.wt {
            // In disk mode a unit is one extent.
            wt.enqueue_zero(u * self.layout.extent, self.extent_len(u));
        }
        self.free_unit_locked(u, &mut g)
    }
}
