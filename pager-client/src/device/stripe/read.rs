//! The striped backend's reads: a page is read from the member that holds
//! it, or from the parity log when its newest copy is there; a gone
//! member's pages are decoded from any `k` members of its group
//! (`codec`). Takes the group's read lock, then the log units' (`log`).

use std::sync::RwLockReadGuard;

use super::super::io::{batch, IoReq};
use super::super::{Inner, Result};
use crate::extent_map::Unit;
use crate::page_log::PAGE;
use netpager_nbd::Op;
use netpager_util::RwLockExt;

/// Pages one batched read covers at most (stack arrays map them).
const BATCH_PAGES: usize = 128;
/// Log units whose placements one batched read holds at once.
const BATCH_LOG_UNITS: usize = 4;

/// A logged page of a batched read: where it sits in the log, and its
/// index in the read.
#[derive(Clone, Copy, Default)]
struct Logged {
    lu: u64,
    col: u32,
    row: u32,
    page: usize,
}

impl Inner {
    /// Reads `buf` at device offset `offset` group by group. The extents a
    /// read spans in one group, when all at home on live members, are read
    /// at once (a request per extent, in parallel): a read across a stripe
    /// then costs one round trip, not one per extent.
    pub(crate) fn read_striped(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let ext = self.layout.extent;
        let group_bytes = self.layout.data_per_unit() * ext;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let g = pos / group_bytes;
            let n = ((g + 1) * group_bytes - pos).min((buf.len() - done) as u64) as usize;
            let guard = self.map.unit(g).read_or_recover();
            let piece = &mut buf[done..done + n];
            if !self.read_group_direct(pos, piece, guard.as_ref()) {
                let chunk = BATCH_PAGES.min(self.buf_bytes() / PAGE as usize) * PAGE as usize;
                for (c, part) in piece.chunks_mut(chunk).enumerate() {
                    let cpos = pos + (c * chunk) as u64;
                    if self.read_logged_batch(cpos, part, guard.as_ref()) {
                        continue;
                    }
                    let mut at = 0usize;
                    while at < part.len() {
                        let p = cpos + at as u64;
                        let m = ((ext - p % ext) as usize).min(part.len() - at);
                        self.read_parity_locked(
                            p / ext,
                            p % ext,
                            &mut part[at..at + m],
                            guard.as_ref(),
                        )?;
                        at += m;
                    }
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Reads `buf` at `pos`, within one group placed as `unit` (locked), in
    /// one batch if it spans several extents, none with pages in the parity
    /// log and all on live members; false if it did not (or a read failed:
    /// the caller reads extent by extent, rebuilding what it must).
    fn read_group_direct(&self, pos: u64, buf: &mut [u8], unit: Option<&Unit>) -> bool {
        let ext = self.layout.extent;
        let end = pos + buf.len() as u64;
        let Some(unit) = unit else { return false };
        if pos / ext == (end - 1) / ext
            || self
                .map
                .log_any_in(pos / PAGE, (end - 1) / PAGE - pos / PAGE + 1)
        {
            return false;
        }
        let mut reqs = batch();
        let mut rest = buf;
        let mut p = pos;
        for req in reqs.iter_mut() {
            if rest.is_empty() {
                break;
            }
            let n = ((ext - p % ext) as usize).min(rest.len());
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            let m = unit.members[self.layout.locate(p / ext).1];
            if !self.usable(&m) {
                return false;
            }
            *req = Some(IoReq {
                loc: m.loc,
                off: p % ext,
                op: Op::Read(piece),
            });
            p += n as u64;
        }
        self.exec(&mut reqs).iter().flatten().all(|r| r.is_ok())
    }

    /// Reads page-aligned `buf` at `pos`, within one group placed as `unit`
    /// (locked), pages in the parity log or not, in one batch: a
    /// request per run of home pages, and one per run of logged pages in
    /// consecutive rows of one member (read into a pooled buffer, then
    /// copied to their places). So pages written together and read
    /// together (swap readahead, a large read of data the log took) cost
    /// one round trip, not one each. False when it cannot (a single page,
    /// too many log units, a member gone, a request failed): the caller
    /// then reads page by page, rebuilding what it must.
    fn read_logged_batch(&self, pos: u64, buf: &mut [u8], unit: Option<&Unit>) -> bool {
        let n = buf.len() / PAGE as usize;
        if !pos.is_multiple_of(PAGE)
            || !buf.len().is_multiple_of(PAGE as usize)
            || !(2..=BATCH_PAGES).contains(&n)
        {
            return false;
        }
        let Some(plog) = self.parity_log() else {
            return false;
        };
        let first = pos / PAGE;
        let geo = plog.geo;
        let mut logged = [Logged::default(); BATCH_PAGES];
        let mut in_log = [false; BATCH_PAGES];
        let mut nl = 0;
        let mut lus = [0u64; BATCH_LOG_UNITS];
        let mut nlu = 0;
        let mut slots = [None; BATCH_PAGES];
        self.map.log_lookup_run(first, &mut slots[..n]);
        for (i, (flag, slot)) in in_log.iter_mut().zip(slots).enumerate().take(n) {
            let Some(slot) = slot else {
                continue;
            };
            let (lu, row, col) = geo.place(slot);
            if !lus[..nlu].contains(&lu) {
                if nlu == BATCH_LOG_UNITS {
                    return false;
                }
                lus[nlu] = lu;
                nlu += 1;
            }
            logged[nl] = Logged {
                lu,
                col,
                row,
                page: i,
            };
            nl += 1;
            *flag = true;
        }
        if nl * PAGE as usize > self.buf_bytes() {
            return false;
        }
        // Lock order: the home group (the caller's), then log units in
        // ascending order; the placements stay put while their pages are read.
        lus[..nlu].sort_unstable();
        let guards: [Option<RwLockReadGuard<'_, Option<Unit>>>; BATCH_LOG_UNITS] =
            std::array::from_fn(|k| {
                (k < nlu).then(|| {
                    self.map
                        .unit(self.layout.log_unit(lus[k]))
                        .read_or_recover()
                })
            });
        let placed = |lu: u64| -> Option<&Unit> {
            let k = lus[..nlu].iter().position(|&u| u == lu)?;
            guards[k].as_ref()?.as_ref()
        };
        let logged = &mut logged[..nl];
        logged.sort_unstable_by_key(|l| (l.lu, l.col, l.row));
        // A pooled buffer only when there are logged pages to gather.
        let mut bufs = (nl > 0).then(|| self.bufs.take(1));
        let scratch: &mut [u8] = match bufs.as_mut() {
            Some(b) => b.one(nl * PAGE as usize),
            None => &mut [],
        };
        let ok = {
            let mut reqs: [Option<IoReq<'_>>; BATCH_PAGES] = std::array::from_fn(|_| None);
            let mut nr = 0;
            // Runs of logged pages, in `logged`'s order through `scratch`.
            let mut rest = &mut scratch[..];
            let mut i = 0;
            while i < nl {
                let l = logged[i];
                let mut j = i + 1;
                while j < nl
                    && (logged[j].lu, logged[j].col) == (l.lu, l.col)
                    && logged[j].row == l.row + (j - i) as u32
                {
                    j += 1;
                }
                let Some(u) = placed(l.lu) else { return false };
                let m = u.members[self
                    .layout
                    .member_of(self.layout.log_unit(l.lu), l.col as usize)];
                if !self.usable(&m) {
                    return false;
                }
                let (run, tail) = std::mem::take(&mut rest).split_at_mut((j - i) * PAGE as usize);
                rest = tail;
                reqs[nr] = Some(IoReq {
                    loc: m.loc,
                    off: l.row as u64 * PAGE,
                    op: Op::Read(run),
                });
                nr += 1;
                i = j;
            }
            // Runs of home pages, straight into `buf`; an extent boundary
            // ends a run (the next extent is on another member).
            let ext = self.layout.extent;
            let mut rest = &mut buf[..];
            let mut i = 0;
            while i < n {
                let mut j = i + 1;
                let p = pos + i as u64 * PAGE;
                while j < n && in_log[j] == in_log[i] && (pos + j as u64 * PAGE) / ext == p / ext {
                    j += 1;
                }
                let (run, tail) = std::mem::take(&mut rest).split_at_mut((j - i) * PAGE as usize);
                rest = tail;
                if !in_log[i] {
                    match unit {
                        None => run.fill(0),
                        Some(u) => {
                            let m = u.members[self.layout.locate(p / ext).1];
                            if !self.usable(&m) {
                                return false;
                            }
                            reqs[nr] = Some(IoReq {
                                loc: m.loc,
                                off: p % ext,
                                op: Op::Read(run),
                            });
                            nr += 1;
                        }
                    }
                }
                i = j;
            }
            self.exec(&mut reqs).iter().flatten().all(|r| r.is_ok())
        };
        if ok {
            for (k, l) in logged.iter().enumerate() {
                let at = l.page * PAGE as usize;
                buf[at..at + PAGE as usize]
                    .copy_from_slice(&scratch[k * PAGE as usize..(k + 1) * PAGE as usize]);
            }
        }
        ok
    }

    /// Reads extent `e`'s bytes with its group locked (`unit` is its
    /// placement): pages in the parity log from there, runs of the others
    /// from home.
    pub(crate) fn read_parity_locked(
        &self,
        e: u64,
        in_off: u64,
        buf: &mut [u8],
        unit: Option<&Unit>,
    ) -> Result<()> {
        let at = e * self.layout.extent + in_off;
        let (first, last) = (at / PAGE, (at + buf.len() as u64 - 1) / PAGE);
        if !self.map.log_any_in(first, last - first + 1) {
            return self.read_home(e, in_off, buf, unit);
        }
        // [home_from, done): a run of pages at home not read yet.
        let (mut home_from, mut done) = (0usize, 0usize);
        while done < buf.len() {
            let pos = at + done as u64;
            let n = ((PAGE - pos % PAGE) as usize).min(buf.len() - done);
            if let Some(slot) = self.map.log_lookup(pos / PAGE) {
                if home_from < done {
                    self.read_home(
                        e,
                        in_off + home_from as u64,
                        &mut buf[home_from..done],
                        unit,
                    )?;
                }
                self.read_log_slot(slot, pos % PAGE, &mut buf[done..done + n])?;
                home_from = done + n;
            }
            done += n;
        }
        if home_from < done {
            self.read_home(e, in_off + home_from as u64, &mut buf[home_from..], unit)?;
        }
        Ok(())
    }

    /// Reads extent `e`'s bytes from its home group (`unit`), rebuilding
    /// them from the rest of the group if their member is gone.
    fn read_home(&self, e: u64, in_off: u64, buf: &mut [u8], unit: Option<&Unit>) -> Result<()> {
        let Some(unit) = unit else {
            buf.fill(0);
            return Ok(());
        };
        let (_, pos) = self.layout.locate(e);
        let m = unit.members[pos];
        if self.usable(&m) && self.exec1(m.loc, in_off, Op::Read(buf)).is_ok() {
            return Ok(());
        }
        let mut bufs = self.bufs.take(1);
        self.reconstruct(e, unit, pos, in_off, buf, bufs.one(self.buf_bytes()))
    }
}
