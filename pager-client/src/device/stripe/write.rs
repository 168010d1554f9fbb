//! The striped backend's writes, zeroes and trims: whole groups at once
//! (full-stripe), smaller pieces into the parity log (`log`) or home by
//! read-modify-write under the group's write lock, so parity always
//! matches the data. Encodes and decodes through `codec`; places groups
//! through [`super`]; moves members through `maintenance`; a page written
//! home or trimmed leaves the log through its journal handle
//! (`Inner::journal`).

use std::sync::RwLockWriteGuard;

use super::super::io::{batch, xor_into, IoFail, IoReq, ZEROS};
use super::super::maintenance::MoveWhy;
use super::super::{DeviceError, Inner, Result};
use crate::erasure::{aligned, ALIGN};
use crate::extent_map::{Loc, Unit};
use crate::page_log::PAGE;
use netpager_nbd::Op;
use netpager_util::RwLockExt;

type GroupGuard<'a> = RwLockWriteGuard<'a, Option<Unit>>;

/// What members of a group refused for lack of room, while the others
/// took their part of the same write: (member, offset in it, bytes).
/// Copied off the shared buffers (the move takes its own), on a path
/// taken only when a donor refuses.
type Refusals = Vec<(usize, u64, Vec<u8>)>;

impl Inner {
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
            self.write_small(pos / ext, in_off, &data[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Writes `data` within extent `e`, less than its whole group.
    fn write_small(&self, e: u64, in_off: u64, data: &[u8]) -> Result<()> {
        let (g, _) = self.layout.locate(e);
        let mut guard = self.map.unit(g).write_or_recover();
        self.write_pages_locked(e, in_off, data, &mut guard, true)
    }

    /// Writes `data` within extent `e` with its group write-locked: with a
    /// parity log (and `to_log`), as whole pages into the log, partial
    /// pages merged with what they hold; otherwise, or when the log has no
    /// room, home by read-modify-write, dropping the pages' log entries.
    pub(crate) fn write_pages_locked(
        &self,
        e: u64,
        in_off: u64,
        data: &[u8],
        guard: &mut GroupGuard<'_>,
        to_log: bool,
    ) -> Result<()> {
        let at = e * self.layout.extent + in_off;
        let end = at + data.len() as u64;
        self.forget_zeros(at, end);
        if self.parity_log().is_none() {
            return self.write_parity_locked(e, in_off, data, guard);
        }
        let (first, last) = (at / PAGE, (end - 1) / PAGE);
        // The partial first and last pages, merged.
        let mut head = [0u8; PAGE as usize];
        let mut tail = [0u8; PAGE as usize];
        let head_partial = !at.is_multiple_of(PAGE) || end < (first + 1) * PAGE;
        let tail_partial = last != first && !end.is_multiple_of(PAGE);
        let ext = self.layout.extent;
        if head_partial {
            let page_off = first * PAGE - e * ext;
            self.read_parity_locked(e, page_off, &mut head, guard.as_ref())?;
            let from = (at % PAGE) as usize;
            let n = ((PAGE as usize) - from).min(data.len());
            head[from..from + n].copy_from_slice(&data[..n]);
        }
        if tail_partial {
            let page_off = last * PAGE - e * ext;
            self.read_parity_locked(e, page_off, &mut tail, guard.as_ref())?;
            let n = (end % PAGE) as usize;
            tail[..n].copy_from_slice(&data[data.len() - n..]);
        }
        let page_data = |p: u64| -> &[u8] {
            if p == first && head_partial {
                &head
            } else if p == last && tail_partial {
                &tail
            } else {
                let from = (p * PAGE - at) as usize;
                &data[from..from + PAGE as usize]
            }
        };
        if to_log && self.log_pages(first..=last, page_data) {
            return Ok(());
        }
        // Home, page-aligned, so no page keeps part of itself in the log:
        // the merged partial pages, and the whole pages between them
        // straight from `data`.
        let home = |p: u64| p * PAGE - e * ext;
        if head_partial {
            self.write_parity_locked(e, home(first), &head, guard)?;
        }
        let whole = (first + head_partial as u64)..(last + 1 - tail_partial as u64);
        if !whole.is_empty() {
            let from = (whole.start * PAGE - at) as usize;
            let bytes = &data[from..from + ((whole.end - whole.start) * PAGE) as usize];
            self.write_parity_locked(e, home(whole.start), bytes, guard)?;
        }
        if tail_partial {
            self.write_parity_locked(e, home(last), &tail, guard)?;
        }
        self.journal().drop_pages(first, last - first + 1)?;
        Ok(())
    }

    /// Full-stripe write of group `g` (`data` is all its data extents).
    fn write_full_group(&self, g: u64, data: &[u8]) -> Result<()> {
        let ext = self.layout.extent as usize;
        let first = g * self.layout.data_per_unit();
        let mut guard = self.map.unit(g).write_or_recover();
        let at = first * ext as u64;
        self.forget_zeros(at, at + data.len() as u64);
        if guard.is_none() {
            // Every member is written in full below: no zeroing.
            self.place_group(first, g, &mut guard, false)?;
        }
        self.map.mark_written(g)?;
        let refused = self.full_stripe_pass(g, data, guard.as_ref().expect("placed above"))?;
        // Every data member was written: what a failure leaves undefined
        // is this write's own range.
        self.settle_refusals(g, &mut guard, &refused)
            .map_err(|(e, _)| e)?;
        let pages = data.len() as u64 / PAGE;
        self.journal()
            .drop_pages(first * ext as u64 / PAGE, pages)?;
        Ok(())
    }

    /// Moves each member that was refused bytes of a write for lack of
    /// room, and gives it those bytes at its new place
    /// (`Inner::move_refused`). On failure, also the members that still
    /// hold their old bytes: the one that could not move, and those after
    /// it.
    fn settle_refusals(
        &self,
        g: u64,
        guard: &mut GroupGuard<'_>,
        refused: &Refusals,
    ) -> std::result::Result<(), (DeviceError, Vec<usize>)> {
        let mut members: Vec<usize> = refused.iter().map(|r| r.0).collect();
        members.sort_unstable();
        members.dedup();
        for (i, &j) in members.iter().enumerate() {
            let patches: Vec<(u64, &[u8])> = refused
                .iter()
                .filter(|r| r.0 == j)
                .map(|r| (r.1, &r.2[..]))
                .collect();
            if let Err(e) = self.move_refused(g, guard, j, &patches, &members[i + 1..]) {
                return Err((e, members[i..].to_vec()));
            }
        }
        Ok(())
    }

    /// The full-stripe write of group `g` placed as `unit`: what members
    /// refused for lack of room.
    fn full_stripe_pass(&self, g: u64, data: &[u8], unit: &Unit) -> Result<Refusals> {
        let ext = self.layout.extent as usize;
        let first = g * self.layout.data_per_unit();
        let (k, r) = (
            self.layout.data_per_unit() as usize,
            self.layout.parity_count(),
        );
        let mut bufs = self.bufs.take(1);
        let par = bufs.one(r * ext);
        self.encode_chunks(first, data, par, ext)?;
        let par: &[u8] = par;
        let mut reqs = batch();
        for (j, (m, req)) in unit.members.iter().zip(&mut reqs).enumerate() {
            let s = self.layout.shard_of(g, j);
            let bytes = if s < k {
                &data[s * ext..(s + 1) * ext]
            } else {
                &par[(s - k) * ext..(s - k + 1) * ext]
            };
            *req = self.usable(m).then_some(IoReq {
                loc: m.loc,
                off: 0,
                op: Op::Write(bytes),
            });
        }
        let missing = unit.members.len() - reqs.iter().flatten().count();
        if missing > r {
            return Err(DeviceError::Lost {
                extent: first,
                reason: self.lost_reason(unit),
            });
        }
        let res = self.exec(&mut reqs);
        let failed = res
            .iter()
            .filter(|r| matches!(r, Some(Err(IoFail::Failed(_)))))
            .count();
        if missing + failed > r {
            return Err(DeviceError::Io {
                extent: first,
                reason: format!(
                    "full-stripe write lost more than {r} members of the group: {}",
                    self.lost_reason(unit)
                ),
            });
        }
        let mut refused = Refusals::new();
        for (j, (r, req)) in res.iter().zip(&reqs).enumerate() {
            if let (
                Some(Err(IoFail::NoSpace(_))),
                Some(IoReq {
                    op: Op::Write(b), ..
                }),
            ) = (r, req)
            {
                refused.push((j, 0, b.to_vec()));
            }
        }
        Ok(refused)
    }

    /// Forgets that the pages `[at, end)` touches read as zeros: they are
    /// about to be written (their group write-locked).
    fn forget_zeros(&self, at: u64, end: u64) {
        self.stripe()
            .zero_pages
            .clear(at / PAGE, end.div_ceil(PAGE) - at / PAGE);
    }

    /// Group `g`, just placed with its members zeroed, reads as zeros but
    /// for its pages in the parity log.
    fn placed_zeroed(&self, g: u64) {
        let z = &self.stripe().zero_pages;
        let per = self.layout.data_per_unit() * self.layout.extent / PAGE;
        let first = g * per;
        let pages = per.min((self.layout.size / PAGE).saturating_sub(first));
        let mut slots = vec![None; pages as usize];
        self.journal().lookup_run(first, &mut slots);
        for (p, s) in (first..).zip(&slots) {
            if s.is_none() {
                z.mark(p, 1);
            }
        }
    }

    /// Writes `n` zero bytes at `in_off` in extent `e`, as a write.
    pub(crate) fn zero_parity(&self, e: u64, in_off: u64, n: u64) -> Result<()> {
        let (g, _) = self.layout.locate(e);
        let at = e * self.layout.extent + in_off;
        let (first, last) = (at / PAGE, (at + n - 1) / PAGE);
        let placed = self.map.unit(g).read_or_recover().is_some();
        // Never written: reads as zeros already.
        if !placed && !self.journal().any_in(first, last - first + 1) {
            return Ok(());
        }
        let mut done = 0;
        while done < n {
            let k = (n - done).min(ZEROS.len() as u64);
            self.write_small(e, in_off + done, &ZEROS[..k as usize])?;
            done += k;
        }
        Ok(())
    }

    /// Trims the whole pages of `[offset, offset + len)`, group by group
    /// under its write lock (the bytes of a partial page stay: trim is
    /// advisory, and swap frees whole pages). See [`Inner::trim_group`].
    pub(crate) fn trim_striped(&self, offset: u64, len: u64) -> Result<()> {
        let (first, end) = (offset.div_ceil(PAGE), (offset + len) / PAGE);
        let group_pages = self.layout.data_per_unit() * self.layout.extent / PAGE;
        let mut p = first;
        while p < end {
            let g = p / group_pages;
            let to = ((g + 1) * group_pages).min(end);
            self.trim_group(g, p, to)?;
            p = to;
        }
        Ok(())
    }

    /// Trims pages `first..end` of group `g`. Their copies in the parity
    /// log are dropped (journaled), so neither a read nor the idle drain
    /// ever sees them again. If every other data page of the group reads
    /// as zeros already, the group is freed: its members trimmed on their
    /// donors and their slots given back. Otherwise the pages not known to
    /// be zeros are zeroed at home by the usual read-modify-write (write
    /// intent and all), so the parity counts them as zeros, and then
    /// trimmed on their data member, whose donor frees them.
    fn trim_group(&self, g: u64, first: u64, end: u64) -> Result<()> {
        let zero = &self.stripe().zero_pages;
        let ext_pages = self.layout.extent / PAGE;
        let (g_first, g_end) = (
            g * self.layout.data_per_unit() * ext_pages,
            (g + 1) * self.layout.data_per_unit() * ext_pages,
        );
        let mut guard = self.map.unit(g).write_or_recover();
        self.journal().drop_pages(first, end - first)?;
        if guard.is_some() && zero.all(g_first, first - g_first) && zero.all(end, g_end - end) {
            self.free_unit_locked(g, &mut guard)?;
            tracing::debug!("parity group {g}: nothing left after a trim, members freed");
        }
        if guard.is_none() {
            // Reads as zeros: unplaced, and out of the log.
            zero.mark(first, end - first);
            return Ok(());
        }
        let mut p = first;
        while p < end {
            if zero.get(p) {
                p += 1;
                continue;
            }
            let e = p / ext_pages;
            let stop = ((e + 1) * ext_pages).min(end);
            let mut q = p + 1;
            while q < stop && !zero.get(q) {
                q += 1;
            }
            self.trim_home_locked(e, (p - e * ext_pages) * PAGE, (q - p) * PAGE, &mut guard)?;
            zero.mark(p, q - p);
            p = q;
        }
        Ok(())
    }

    /// Zeroes `len` bytes at `in_off` in extent `e` at home, parity
    /// updated, then trims them on the data member (group placed and
    /// write-locked).
    fn trim_home_locked(
        &self,
        e: u64,
        in_off: u64,
        len: u64,
        guard: &mut GroupGuard<'_>,
    ) -> Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(ZEROS.len() as u64);
            self.write_parity_locked(e, in_off + done, &ZEROS[..n as usize], guard)?;
            done += n;
        }
        let (_, pos) = self.layout.locate(e);
        let m = guard.as_ref().expect("placed by the caller").members[pos];
        // It reads as zeros whether or not the donor frees the pages.
        if self.usable(&m) {
            if let Err(f) = self.exec1(m.loc, in_off, Op::Trim(len)) {
                tracing::debug!("trim of extent {e} at {in_off}: {}", f.reason());
            }
        }
        Ok(())
    }

    /// Read-modify-write of `data` at home, group `g` write-locked.
    fn write_parity_locked(
        &self,
        e: u64,
        in_off: u64,
        data: &[u8],
        guard: &mut GroupGuard<'_>,
    ) -> Result<()> {
        let (g, pos) = self.layout.locate(e);
        if guard.is_none() {
            self.place_group(e, g, guard, true)?;
            self.placed_zeroed(g);
        }
        let at = e * self.layout.extent + in_off;
        self.forget_zeros(at, at + data.len() as u64);
        self.map.mark_written(g)?;
        if self.layout.parity_count() > 1 {
            return self.write_stripe_locked(at, data, guard);
        }
        let pp = self.layout.parity_member(g);
        let len = data.len();
        let double = |unit: &Unit| DeviceError::Lost {
            extent: e,
            reason: self.lost_reason(unit),
        };
        for _ in 0..=self.layout.members() {
            let (dm, pm) = {
                let unit = guard.as_ref().expect("placed above");
                (unit.members[pos], unit.members[pp])
            };
            match (self.usable(&dm), self.usable(&pm)) {
                (true, true) => {
                    // Up to a page (the swap path's size) the scratch is on
                    // the stack, so concurrent small writes never wait for
                    // the shared extent buffers.
                    let mut stack = [[0u8; PAGE as usize]; 2];
                    let mut pooled = (len > PAGE as usize).then(|| self.bufs.take(2));
                    let (old_d, par) = match pooled.as_mut() {
                        Some(b) => b.two(len),
                        None => {
                            let [a, b] = &mut stack;
                            (&mut a[..len], &mut b[..len])
                        }
                    };
                    let Some([dw, pw]) = self.update_pair(dm.loc, pm.loc, in_off, data, old_d, par)
                    else {
                        // A donor just failed (and is marked): go degraded.
                        continue;
                    };
                    match (dw, pw) {
                        (Ok(()), Ok(())) => return Ok(()),
                        // The other took its part: the refused member
                        // moves and is given its part there. Failing that,
                        // the other gets its old bytes back, so the pair
                        // still matches and only this write fails.
                        // Copied off the shared buffers: the move takes
                        // its own.
                        (Err(IoFail::NoSpace(_)), Ok(())) => {
                            let mut old_p = par.to_vec();
                            xor_into(&mut old_p, old_d);
                            xor_into(&mut old_p, data);
                            drop(pooled);
                            let res = self.move_refused(g, guard, pos, &[(in_off, data)], &[]);
                            return self.undo_on_error(res, pm.loc, in_off, &old_p);
                        }
                        (Ok(()), Err(IoFail::NoSpace(_))) => {
                            let (par, old_d) = (par.to_vec(), old_d.to_vec());
                            drop(pooled);
                            let res = self.move_refused(g, guard, pp, &[(in_off, &par)], &[]);
                            return self.undo_on_error(res, dm.loc, in_off, &old_d);
                        }
                        // One member's donor died mid-write: the other holds
                        // what is needed to rebuild it.
                        (Err(IoFail::Failed(_)), Ok(())) | (Ok(()), Err(IoFail::Failed(_))) => {
                            return Ok(())
                        }
                        // Both refused, neither changed: move the data
                        // member where there is room, then write again.
                        (Err(IoFail::NoSpace(_)), Err(IoFail::NoSpace(_))) => {
                            self.move_member(g, guard, pos, MoveWhy::Full)?
                        }
                        _ => continue,
                    }
                }
                (false, true) => {
                    // Degraded write: parity = new data ^ the other data
                    // members, so the lost member reads back as `data`.
                    let unit = guard.as_ref().expect("placed above");
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
                            return Err(double(unit));
                        }
                        self.exec1(m.loc, in_off, Op::Read(scratch)).map_err(|f| {
                            DeviceError::Lost {
                                extent: e,
                                reason: format!("degraded write: member {k}: {}", f.reason()),
                            }
                        })?;
                        xor_into(acc, scratch);
                    }
                    let res = self.exec1(pm.loc, in_off, Op::Write(acc));
                    drop(bufs); // the move takes its own
                    match res {
                        Ok(()) => return Ok(()),
                        // Refused for room (its donor full or draining),
                        // nothing changed: the parity member moves with
                        // its own bytes and the write goes again. It gave
                        // the application ENOSPC while other donors had
                        // room (the nemesis, parity, seeds 11300009 and
                        // 11300017: a drain while a data member was lost).
                        Err(IoFail::NoSpace(_)) => self.move_member(g, guard, pp, MoveWhy::Full)?,
                        Err(IoFail::Failed(_)) => continue,
                    }
                }
                (true, false) => match self.exec1(dm.loc, in_off, Op::Write(data)) {
                    Ok(()) => return Ok(()),
                    Err(IoFail::NoSpace(_)) => self.move_member(g, guard, pos, MoveWhy::Full)?,
                    Err(IoFail::Failed(_)) => continue,
                },
                (false, false) => return Err(double(guard.as_ref().expect("placed above"))),
            }
        }
        Err(DeviceError::Io {
            extent: e,
            reason: "the parity update kept failing".into(),
        })
    }

    /// Mode ec's write at home (group placed and write-locked): the other
    /// data members' bytes over the range are read (decoded where their
    /// member is gone), the parity encoded afresh and the data and parity
    /// members written. Parity's delta update reads two members whatever
    /// the width; with several Reed-Solomon parities it would read `1 + r`,
    /// no fewer than the `k - 1` read here at the usual 4+2, and would need
    /// the code's coefficients.
    fn write_stripe_locked(&self, off: u64, data: &[u8], guard: &mut GroupGuard<'_>) -> Result<()> {
        let e = off / self.layout.extent;
        let (g, _) = self.layout.locate(e);
        let refused = self.stripe_pass(off, data, guard.as_ref().expect("placed by the caller"))?;
        self.settle_refusals(g, guard, &refused)
            .map_err(|(err, stale)| {
                self.put_back_stripe(e, guard.as_ref().expect("placed"), &refused, &stale);
                err
            })
    }

    /// A write at home to extent `e` failed with members `stale` still
    /// holding their old bytes where they were `refused` them: on each
    /// such piece, the members that took the new bytes get their old ones
    /// back, decoded from the stale members and those the write did not
    /// touch, so that the group decodes its other extents right. Left
    /// new, they decoded with the stale ones into wrong bytes of a lost
    /// member's extent.
    fn put_back_stripe(&self, e: u64, unit: &Unit, refused: &Refusals, stale: &[usize]) {
        let l = self.layout;
        let (g, pos) = l.locate(e);
        let (k, me) = (l.data_per_unit() as usize, l.shard_of(g, pos));
        let mut bufs = self.bufs.take(2);
        let (out, scratch) = bufs.two(self.buf_bytes());
        let mut pieces: Vec<(u64, usize)> = refused
            .iter()
            .filter(|r| stale.contains(&r.0))
            .map(|r| (r.1, r.2.len()))
            .collect();
        pieces.sort_unstable();
        pieces.dedup();
        for (at, n) in pieces {
            let old_here = |j: usize| {
                refused
                    .iter()
                    .any(|r| r.0 == j && r.1 == at && stale.contains(&j))
            };
            let took: Vec<usize> = (0..unit.members.len())
                .filter(|&j| {
                    let s = l.shard_of(g, j);
                    (s == me || s >= k) && self.usable(&unit.members[j]) && !old_here(j)
                })
                .collect();
            for &w in &took {
                let old = &mut out[..n];
                let res = self
                    .reconstruct(e, unit, w, at, old, scratch, &took)
                    .and_then(|()| {
                        self.exec1(unit.members[w].loc, at, Op::Write(old))
                            .map_err(|f| DeviceError::Io {
                                extent: e,
                                reason: f.reason().to_string(),
                            })
                    });
                if let Err(err) = res {
                    tracing::error!("unit {g}: putting back member {w}'s old bytes: {err}");
                }
            }
        }
    }

    /// [`Self::write_stripe_locked`]'s writes to group members `unit`:
    /// what members refused for lack of room.
    fn stripe_pass(&self, off: u64, data: &[u8], unit: &Unit) -> Result<Refusals> {
        let l = self.layout;
        let (e, in_off) = (off / l.extent, off % l.extent);
        let (g, pos) = l.locate(e);
        let (k, r) = (l.data_per_unit() as usize, l.parity_count());
        let me = l.shard_of(g, pos);
        let end = in_off + data.len() as u64;
        let (a_off, a_len) = aligned(in_off, data.len() as u64);
        let mut bufs = self.bufs.take(2);
        let (shards, scratch) = bufs.two(self.buf_bytes());
        let piece = (shards.len() / (k + r) / ALIGN * ALIGN) as u64;
        let mut refused = Refusals::new();
        let mut at = a_off;
        while at < a_off + a_len {
            let n = piece.min(a_off + a_len - at) as usize;
            let (dpart, ppart) = shards[..(k + r) * n].split_at_mut(k * n);
            // The data shards as they are: read in one batch, decoded
            // where a member is gone or its read failed.
            let covered = |i: usize| i == me && at >= in_off && at + n as u64 <= end;
            let res = {
                let mut reqs = batch();
                for (i, (req, chunk)) in reqs.iter_mut().zip(dpart.chunks_mut(n)).enumerate() {
                    let m = unit.members[l.member_of(g, i)];
                    if !covered(i) && self.usable(&m) {
                        *req = Some(IoReq {
                            loc: m.loc,
                            off: at,
                            op: Op::Read(chunk),
                        });
                    }
                }
                self.exec(&mut reqs)
            };
            for (i, chunk) in dpart.chunks_mut(n).enumerate() {
                if covered(i) || matches!(res[i], Some(Ok(()))) {
                    continue;
                }
                let j = l.member_of(g, i);
                let ei = l.extent_of(g, j).unwrap_or(e);
                self.reconstruct(ei, unit, j, at, chunk, scratch, &[])?;
            }
            // The new bytes over the target's shard.
            let from = at.max(in_off);
            let to = (at + n as u64).min(end);
            let mine = &mut dpart[me * n..(me + 1) * n];
            mine[(from - at) as usize..(to - at) as usize]
                .copy_from_slice(&data[(from - in_off) as usize..(to - in_off) as usize]);
            self.encode_chunks(e, dpart, ppart, n)?;
            let (dpart, ppart) = (&*dpart, &*ppart);
            let mut reqs = batch();
            let res = {
                for (j, req) in reqs.iter_mut().enumerate().take(k + r) {
                    let s = l.shard_of(g, j);
                    let m = unit.members[j];
                    if (s == me || s >= k) && self.usable(&m) {
                        let bytes = if s < k {
                            &dpart[s * n..(s + 1) * n]
                        } else {
                            &ppart[(s - k) * n..(s - k + 1) * n]
                        };
                        *req = Some(IoReq {
                            loc: m.loc,
                            off: at,
                            op: Op::Write(bytes),
                        });
                    }
                }
                self.exec(&mut reqs)
            };
            // Members that hold this piece of the new stripe: the data
            // members not written, and the written ones that took it.
            let mut current = 0;
            for (j, m) in unit.members.iter().enumerate() {
                let s = l.shard_of(g, j);
                match (&res[j], &reqs[j]) {
                    (Some(Ok(())), _) => current += 1,
                    (
                        Some(Err(IoFail::NoSpace(_))),
                        Some(IoReq {
                            op: Op::Write(b), ..
                        }),
                    ) => {
                        // Moved, and given these bytes, by the caller.
                        refused.push((j, at, b.to_vec()));
                        current += 1;
                    }
                    (Some(Err(_)), _) => {}
                    (None, _) => current += usize::from(s < k && s != me && self.usable(m)),
                }
            }
            if current < k {
                return Err(DeviceError::Io {
                    extent: e,
                    reason: format!(
                        "write left {current} of the group's {} members current, {k} are needed: {}",
                        k + r,
                        self.lost_reason(unit)
                    ),
                });
            }
            at += n as u64;
        }
        Ok(refused)
    }

    /// `res`, the outcome of a write, after writing `old` back at `off` of
    /// `loc` if it failed: the bytes a member took of a write that could
    /// not be completed.
    fn undo_on_error(&self, res: Result<()>, loc: Loc, off: u64, old: &[u8]) -> Result<()> {
        if res.is_err() {
            if let Err(f) = self.exec1(loc, off, Op::Write(old)) {
                tracing::error!("putting back what a failed write changed: {}", f.reason());
            }
        }
        res
    }

    /// Read-modify-write of data member `dm` and parity member `pm` at
    /// `in_off`: the results of writing `data` and the new parity (left in
    /// `par`), or `None` if reading the old ones (into `old_d` and `par`)
    /// failed.
    fn update_pair(
        &self,
        dm: Loc,
        pm: Loc,
        in_off: u64,
        data: &[u8],
        old_d: &mut [u8],
        par: &mut [u8],
    ) -> Option<[std::result::Result<(), IoFail>; 2]> {
        let reads = self.exec(&mut [
            Some(IoReq {
                loc: dm,
                off: in_off,
                op: Op::Read(old_d),
            }),
            Some(IoReq {
                loc: pm,
                off: in_off,
                op: Op::Read(par),
            }),
        ]);
        if reads.iter().any(|r| !matches!(r, Some(Ok(())))) {
            return None;
        }
        xor_into(par, old_d);
        xor_into(par, data);
        let [dw, pw] = self.exec(&mut [
            Some(IoReq {
                loc: dm,
                off: in_off,
                op: Op::Write(data),
            }),
            Some(IoReq {
                loc: pm,
                off: in_off,
                op: Op::Write(par),
            }),
        ]);
        Some([
            dw.expect("a result per request"),
            pw.expect("a result per request"),
        ])
    }
}
