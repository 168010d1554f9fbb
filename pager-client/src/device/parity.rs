//! Mode parity (RAID-5): a unit is a group of `width - 1` data extents and
//! one parity extent on `width` distinct donors, the parity position
//! rotating with the group number. The group's write lock is held for every
//! write, so parity always matches the data.

use super::io::{xor_into, IoFail, IoReq, ZEROS};
use super::maintenance::MoveWhy;
use super::{DeviceError, Inner, Payload, Result};
use crate::extent_map::{CopyState, Member, Unit};
use crate::nbd::Op;

impl Inner {
    fn usable(&self, m: &Member) -> bool {
        m.state == CopyState::Ok && self.loc_available(m.loc)
    }

    pub(crate) fn read_parity(&self, e: u64, in_off: u64, buf: &mut [u8]) -> Result<()> {
        let (g, pos) = self.layout.locate(e);
        let guard = self.map.unit(g).read().unwrap_or_else(|p| p.into_inner());
        let Some(unit) = guard.as_ref() else {
            buf.fill(0);
            return Ok(());
        };
        let m = unit.members[pos];
        if self.usable(&m) && self.exec1(m.loc, in_off, Op::Read(buf)).is_ok() {
            return Ok(());
        }
        let mut bufs = self.bufs.take(1);
        self.reconstruct(e, unit, pos, in_off, buf, bufs.one(buf.len()))
    }

    /// Member `pos`'s bytes `[in_off, in_off + out.len())` as the XOR of
    /// every other member (degraded read, rebuild).
    pub(crate) fn reconstruct(
        &self,
        e: u64,
        unit: &Unit,
        pos: usize,
        in_off: u64,
        out: &mut [u8],
        scratch: &mut [u8],
    ) -> Result<()> {
        let lost = |why: String| DeviceError::Lost {
            extent: e,
            reason: format!("parity group lost two members: {why}"),
        };
        let mut first = true;
        for (k, m) in unit.members.iter().enumerate().filter(|(k, _)| *k != pos) {
            if !self.usable(m) {
                return Err(lost(self.lost_reason(unit)));
            }
            let target: &mut [u8] = if first { &mut *out } else { &mut *scratch };
            self.exec1(m.loc, in_off, Op::Read(target))
                .map_err(|f| lost(format!("member {k}: {}", f.reason())))?;
            if !first {
                xor_into(out, scratch);
            }
            first = false;
        }
        Ok(())
    }

    /// Writes `data` at device offset `offset`: whole groups at once (their
    /// parity computed from the new data alone, no reads), the rest extent
    /// by extent with read-modify-write.
    pub(crate) fn write_parity_range(&self, offset: u64, data: &[u8]) -> Result<()> {
        let ext = self.layout.extent;
        let per = self.layout.data_per_unit();
        let group_bytes = per * ext;
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let rest = (data.len() - done) as u64;
            let g = pos / group_bytes;
            let whole_group_inside = (g + 1) * per <= self.layout.extents();
            if pos.is_multiple_of(group_bytes) && rest >= group_bytes && whole_group_inside {
                self.write_full_group(g, &data[done..done + group_bytes as usize])?;
                done += group_bytes as usize;
                continue;
            }
            let in_off = pos % ext;
            let n = (ext - in_off).min(rest) as usize;
            self.write_parity(pos / ext, in_off, &data[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Full-stripe write of group `g` (`data` is all its data extents).
    fn write_full_group(&self, g: u64, data: &[u8]) -> Result<()> {
        let ext = self.layout.extent as usize;
        let first = g * self.layout.data_per_unit();
        let mut guard = self.map.unit(g).write().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            // Every member is written in full below: no zeroing.
            self.place_group(first, g, &mut guard, false)?;
        }
        let unit = guard.as_ref().expect("placed above").clone();
        let pp = self.layout.parity_member(g);
        let mut bufs = self.bufs.take(1);
        let par = bufs.one(ext);
        par.copy_from_slice(&data[..ext]);
        for chunk in data[ext..].chunks(ext) {
            xor_into(par, chunk);
        }
        let content = |k: usize| -> usize {
            if k < pp {
                k
            } else {
                k - 1
            }
        };
        let targets: Vec<usize> = (0..unit.members.len())
            .filter(|&k| self.usable(&unit.members[k]))
            .collect();
        let missing = unit.members.len() - targets.len();
        if missing >= 2 {
            return Err(DeviceError::Lost {
                extent: first,
                reason: self.lost_reason(&unit),
            });
        }
        let reqs = targets
            .iter()
            .map(|&k| {
                let bytes: &[u8] = if k == pp {
                    &*par
                } else {
                    &data[content(k) * ext..(content(k) + 1) * ext]
                };
                IoReq {
                    loc: unit.members[k].loc,
                    off: 0,
                    op: Op::Write(bytes),
                }
            })
            .collect();
        let res = self.exec(reqs);
        drop(bufs);
        let failed = res
            .iter()
            .filter(|r| matches!(r, Err(IoFail::Failed(_))))
            .count();
        if missing + failed >= 2 {
            return Err(DeviceError::Io {
                extent: first,
                reason: format!(
                    "full-stripe write lost two members of the group: {}",
                    self.lost_reason(&unit)
                ),
            });
        }
        // A member refused for lack of room is rebuilt elsewhere from the
        // others, which now hold the new stripe.
        for (&k, r) in targets.iter().zip(&res) {
            if matches!(r, Err(IoFail::NoSpace(_))) {
                self.move_member(g, &mut guard, k, MoveWhy::Full)?;
            }
        }
        Ok(())
    }

    pub(crate) fn modify_parity(&self, e: u64, in_off: u64, p: Payload<'_>) -> Result<()> {
        match p {
            Payload::Data(d) => self.write_parity_range(e * self.layout.extent + in_off, d),
            // Trim is advisory; freeing one extent of a group would need
            // its parity rewritten, which costs more than it saves.
            Payload::Trim(_) => Ok(()),
            Payload::Zero(n) => {
                let (g, _) = self.layout.locate(e);
                if self
                    .map
                    .unit(g)
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_none()
                {
                    return Ok(());
                }
                let mut done = 0;
                while done < n {
                    let k = (n - done).min(ZEROS.len() as u64);
                    self.write_parity(e, in_off + done, &ZEROS[..k as usize])?;
                    done += k;
                }
                Ok(())
            }
        }
    }

    fn write_parity(&self, e: u64, in_off: u64, data: &[u8]) -> Result<()> {
        let (g, pos) = self.layout.locate(e);
        let mut guard = self.map.unit(g).write().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            self.place_group(e, g, &mut guard, true)?;
        }
        let pp = self.layout.parity_member(g);
        let len = data.len();
        let double = |unit: &Unit| DeviceError::Lost {
            extent: e,
            reason: self.lost_reason(unit),
        };
        for _ in 0..=self.layout.members() {
            let unit = guard.as_ref().expect("placed above").clone();
            let (dm, pm) = (unit.members[pos], unit.members[pp]);
            match (self.usable(&dm), self.usable(&pm)) {
                (true, true) => {
                    let mut bufs = self.bufs.take(2);
                    let (old_d, par) = bufs.two(len);
                    let r = self.exec(vec![
                        IoReq {
                            loc: dm.loc,
                            off: in_off,
                            op: Op::Read(old_d),
                        },
                        IoReq {
                            loc: pm.loc,
                            off: in_off,
                            op: Op::Read(par),
                        },
                    ]);
                    if r.iter().any(|x| x.is_err()) {
                        // A donor just failed (and is marked): go degraded.
                        continue;
                    }
                    xor_into(par, old_d);
                    xor_into(par, data);
                    let r = self.exec(vec![
                        IoReq {
                            loc: dm.loc,
                            off: in_off,
                            op: Op::Write(data),
                        },
                        IoReq {
                            loc: pm.loc,
                            off: in_off,
                            op: Op::Write(par),
                        },
                    ]);
                    drop(bufs);
                    match (&r[0], &r[1]) {
                        (Ok(()), Ok(())) => return Ok(()),
                        // Parity has the new data folded in: rebuild the data
                        // member from it elsewhere.
                        (Err(IoFail::NoSpace(_)), Ok(())) => {
                            return self.move_member(g, &mut guard, pos, MoveWhy::Full)
                        }
                        (Ok(()), Err(IoFail::NoSpace(_))) => {
                            return self.move_member(g, &mut guard, pp, MoveWhy::Full)
                        }
                        // One member's donor died mid-write: the other holds
                        // what is needed to rebuild it.
                        (Err(IoFail::Failed(_)), Ok(())) | (Ok(()), Err(IoFail::Failed(_))) => {
                            return Ok(())
                        }
                        _ => continue,
                    }
                }
                (false, true) => {
                    // Degraded write: parity = new data ^ the other data
                    // members, so the lost member reads back as `data`.
                    let mut bufs = self.bufs.take(2);
                    let (acc, scratch) = bufs.two(len);
                    acc.copy_from_slice(data);
                    for (k, m) in unit
                        .members
                        .iter()
                        .enumerate()
                        .filter(|(k, _)| *k != pos && *k != pp)
                    {
                        if !self.usable(m) {
                            return Err(double(&unit));
                        }
                        self.exec1(m.loc, in_off, Op::Read(scratch)).map_err(|f| {
                            DeviceError::Lost {
                                extent: e,
                                reason: format!("degraded write: member {k}: {}", f.reason()),
                            }
                        })?;
                        xor_into(acc, scratch);
                    }
                    match self.exec1(pm.loc, in_off, Op::Write(acc)) {
                        Ok(()) => return Ok(()),
                        Err(IoFail::NoSpace(r)) => {
                            return Err(DeviceError::NoSpace {
                                extent: e,
                                reason: r,
                            })
                        }
                        Err(IoFail::Failed(_)) => continue,
                    }
                }
                (true, false) => match self.exec1(dm.loc, in_off, Op::Write(data)) {
                    Ok(()) => return Ok(()),
                    Err(IoFail::NoSpace(_)) => {
                        self.move_member(g, &mut guard, pos, MoveWhy::Full)?
                    }
                    Err(IoFail::Failed(_)) => continue,
                },
                (false, false) => return Err(double(&unit)),
            }
        }
        Err(DeviceError::Io {
            extent: e,
            reason: "the parity update kept failing".into(),
        })
    }

    /// First write to a group: `width` slots on distinct donors, zeroed
    /// (if `zero`) where they may hold old data: all-zero members have zero
    /// parity.
    fn place_group(&self, e: u64, g: u64, guard: &mut Option<Unit>, zero: bool) -> Result<()> {
        // Each failed try rules out a donor (now full or failed).
        for _ in 0..self.donors.len() + 2 {
            let locs = self.allocate(self.layout.members(), &[], e)?;
            let dirty: Vec<usize> = (0..locs.len()).filter(|&i| zero && !locs[i].1).collect();
            let reqs = dirty
                .iter()
                .map(|&i| IoReq {
                    loc: locs[i].0,
                    off: 0,
                    op: Op::Zero(self.layout.extent),
                })
                .collect();
            if self.exec(reqs).iter().all(|r| r.is_ok()) {
                let members = locs
                    .iter()
                    .map(|&(loc, _)| Member {
                        loc,
                        state: CopyState::Ok,
                    })
                    .collect();
                *guard = Some(Unit { members });
                self.map.commit(g, guard)?;
                return Ok(());
            }
            for (loc, _) in locs {
                self.map.free(loc);
            }
        }
        Err(DeviceError::Io {
            extent: e,
            reason: "could not prepare a parity group on the chosen donors".into(),
        })
    }
}
