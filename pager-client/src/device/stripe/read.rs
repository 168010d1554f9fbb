//! The striped backend's reads: a page is read from the member that holds
//! it, or from the parity log when its newest copy is there; a gone
//! member's pages are decoded from any `k` members of its group
//! (`codec`). One path: plan the runs, send one batch, fall back page by
//! page. Which pages are logged it asks the log's journal handle
//! (`Inner::journal`), once per group. Takes the group's read lock, then
//! the log units' (`log`).

use std::sync::RwLockReadGuard;

use super::super::io::{IoReq, MAX_BATCH};
use super::super::{Inner, Result};
use crate::extent_map::{Loc, Unit};
use crate::page_log::{Slot, PAGE};
use netpager_nbd::Op;
use netpager_util::RwLockExt;

/// Pages one batched read with logged pages in it covers at most (stack
/// arrays map them).
const BATCH_PAGES: usize = 128;
/// Log units whose placements one batched read holds at once.
const BATCH_LOG_UNITS: usize = 4;

/// A logged page of a batched read: where it sits in the log, and which
/// of the read's pages it is (counted from the one holding its first byte).
#[derive(Clone, Copy, Default)]
struct Logged {
    lu: u64,
    col: u32,
    row: u32,
    page: usize,
}

impl Inner {
    /// Reads `buf` at device offset `offset` group by group, each under
    /// its read lock.
    pub(crate) fn read_striped(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let group_bytes = self.layout.data_per_unit() * self.layout.extent;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let g = pos / group_bytes;
            let n = ((g + 1) * group_bytes - pos).min((buf.len() - done) as u64) as usize;
            let guard = self.map.unit(g).read_or_recover();
            self.read_group(pos, &mut buf[done..done + n], guard.as_ref())?;
            done += n;
        }
        Ok(())
    }

    /// Reads `buf` at `pos`, within one group placed as `unit` (locked):
    /// plans the runs (a request per run of home bytes within an extent,
    /// one per run of logged pages in consecutive rows of one member),
    /// sends them as one batch, and where that cannot be done (a member
    /// gone, a request failed, a logged page read in part) reads extent by
    /// extent, page by page from the log, rebuilding what it must. A read
    /// across a stripe, or of pages written together (swap readahead, a
    /// large write the log took), so costs one round trip, not one per
    /// extent or page.
    fn read_group(&self, pos: u64, buf: &mut [u8], unit: Option<&Unit>) -> Result<()> {
        let ext = self.layout.extent;
        let end = pos + buf.len() as u64;
        let (first, pages) = (pos / PAGE, ((end - 1) / PAGE - pos / PAGE + 1) as usize);
        // The page table once: a read of a few pages looks them up, a
        // larger one asks whether any of its pages is logged.
        let mut slots = [None; BATCH_PAGES];
        let looked_up = pages <= BATCH_PAGES;
        let logged = if looked_up {
            self.journal().lookup_run(first, &mut slots[..pages]);
            slots[..pages].iter().any(Option::is_some)
        } else {
            self.journal().any_in(first, pages as u64)
        };
        if !logged {
            // A request per extent, however large the read; the batch
            // sized to that.
            let ok = if pos / ext == (end - 1) / ext {
                self.read_batch::<1>(pos, buf, unit, &[])
            } else {
                self.read_batch::<MAX_BATCH>(pos, buf, unit, &[])
            };
            return if ok {
                Ok(())
            } else {
                self.read_pages(pos, buf, unit)
            };
        }
        // Windows whose logged pages fit the stack arrays and one pooled
        // buffer.
        let window = BATCH_PAGES.min(self.buf_bytes() / PAGE as usize) as u64 * PAGE;
        let mut more = [None; BATCH_PAGES];
        let mut at = pos;
        while at < end {
            let to = ((at / window + 1) * window).min(end);
            let part = &mut buf[(at - pos) as usize..(to - pos) as usize];
            let (wfirst, wpages) = (at / PAGE, ((to - 1) / PAGE - at / PAGE + 1) as usize);
            let wslots = if looked_up {
                &slots[(wfirst - first) as usize..][..wpages]
            } else {
                self.journal().lookup_run(wfirst, &mut more[..wpages]);
                &more[..wpages]
            };
            // A batch has at most a request per page: a swap-in of one
            // logged page builds no 128-request arrays.
            let ok = match wpages {
                1 => self.read_batch::<1>(at, part, unit, wslots),
                2..=MAX_BATCH => self.read_batch::<MAX_BATCH>(at, part, unit, wslots),
                _ => self.read_batch::<BATCH_PAGES>(at, part, unit, wslots),
            };
            if !ok {
                self.read_pages(at, part, unit)?;
            }
            at = to;
        }
        Ok(())
    }

    /// Reads `buf` at `pos` (within one group placed as `unit`, locked) in
    /// one batch of at most `N` requests; `slots` are the log slots of its
    /// pages (empty: none is logged). Logged pages go through a pooled
    /// buffer unless there is only one. False when it cannot (see
    /// [`Inner::read_group`]).
    fn read_batch<const N: usize>(
        &self,
        pos: u64,
        buf: &mut [u8],
        unit: Option<&Unit>,
        slots: &[Option<Slot>],
    ) -> bool {
        let ext = self.layout.extent;
        let end = pos + buf.len() as u64;
        let first = pos / PAGE;
        let in_log = |i: usize| slots.get(i).is_some_and(Option::is_some);
        let geo = self.parity_log().map(|l| l.geo);
        let mut logged = [Logged::default(); N];
        let mut nl = 0;
        let mut lus = [0u64; BATCH_LOG_UNITS];
        let mut nlu = 0;
        for (i, slot) in slots.iter().enumerate() {
            let Some(slot) = *slot else { continue };
            let p = first + i as u64;
            if p * PAGE < pos || (p + 1) * PAGE > end {
                return false;
            }
            let (lu, row, col) = geo.expect("a logged page, so a log").place(slot);
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
        // The member holding logged page `l`, if it can be read.
        let member = |l: &Logged| -> Option<Loc> {
            let k = lus[..nlu].iter().position(|&u| u == l.lu)?;
            let u = guards[k].as_ref()?.as_ref()?;
            let m = u.members[self
                .layout
                .member_of(self.layout.log_unit(l.lu), l.col as usize)];
            self.usable(&m).then_some(m.loc)
        };
        let logged = &mut logged[..nl];
        logged.sort_unstable_by_key(|l| (l.lu, l.col, l.row));
        // A lone logged page is read straight into its place.
        let gather = nl > 1;
        let mut bufs = gather.then(|| self.bufs.take(1));
        let scratch: &mut [u8] = match bufs.as_mut() {
            Some(b) => b.one(nl * PAGE as usize),
            None => &mut [],
        };
        let ok = {
            let mut reqs: [Option<IoReq<'_>>; N] = std::array::from_fn(|_| None);
            let mut nr = 0;
            // Runs of logged pages, in `logged`'s order through `scratch`.
            let mut rest = &mut scratch[..];
            let mut i = 0;
            while gather && i < nl {
                let l = logged[i];
                let mut j = i + 1;
                while j < nl
                    && (logged[j].lu, logged[j].col) == (l.lu, l.col)
                    && logged[j].row == l.row + (j - i) as u32
                {
                    j += 1;
                }
                let Some(loc) = member(&l) else { return false };
                let (run, tail) = std::mem::take(&mut rest).split_at_mut((j - i) * PAGE as usize);
                rest = tail;
                reqs[nr] = Some(IoReq {
                    loc,
                    off: l.row as u64 * PAGE,
                    op: Op::Read(run),
                });
                nr += 1;
                i = j;
            }
            // In the read's order: runs of home bytes, each within one
            // extent (the next one is on another member) and up to the
            // next logged page, straight into `buf`; and a lone logged page.
            let mut rest = &mut buf[..];
            let mut p = pos;
            while p < end {
                let i = (p / PAGE - first) as usize;
                if in_log(i) {
                    let (page, tail) = std::mem::take(&mut rest).split_at_mut(PAGE as usize);
                    rest = tail;
                    if !gather {
                        let l = logged[0];
                        let Some(loc) = member(&l) else { return false };
                        reqs[nr] = Some(IoReq {
                            loc,
                            off: l.row as u64 * PAGE,
                            op: Op::Read(page),
                        });
                        nr += 1;
                    }
                    p += PAGE;
                    continue;
                }
                let mut q = ((p / ext + 1) * ext).min(end);
                if !slots.is_empty() {
                    let mut j = i + 1;
                    while (first + j as u64) * PAGE < q && !in_log(j) {
                        j += 1;
                    }
                    q = q.min((first + j as u64) * PAGE);
                }
                let (run, tail) = std::mem::take(&mut rest).split_at_mut((q - p) as usize);
                rest = tail;
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
                p = q;
            }
            self.exec(&mut reqs).iter().flatten().all(|r| r.is_ok())
        };
        if ok && gather {
            for (k, l) in logged.iter().enumerate() {
                // `buf` starts at `pos`, which need not be page-aligned.
                let at = ((first + l.page as u64) * PAGE - pos) as usize;
                buf[at..at + PAGE as usize]
                    .copy_from_slice(&scratch[k * PAGE as usize..(k + 1) * PAGE as usize]);
            }
        }
        ok
    }

    /// The fallback of [`Inner::read_group`]: extent by extent, logged
    /// pages one by one, home runs rebuilt where their member is gone.
    fn read_pages(&self, pos: u64, buf: &mut [u8], unit: Option<&Unit>) -> Result<()> {
        let ext = self.layout.extent;
        let mut at = 0usize;
        while at < buf.len() {
            let p = pos + at as u64;
            let m = ((ext - p % ext) as usize).min(buf.len() - at);
            self.read_parity_locked(p / ext, p % ext, &mut buf[at..at + m], unit)?;
            at += m;
        }
        Ok(())
    }

    /// Reads extent `e`'s bytes with its group locked (`unit` is its
    /// placement): pages in the parity log from there, runs of the others
    /// from home.
    pub(super) fn read_parity_locked(
        &self,
        e: u64,
        in_off: u64,
        buf: &mut [u8],
        unit: Option<&Unit>,
    ) -> Result<()> {
        let at = e * self.layout.extent + in_off;
        let (first, last) = (at / PAGE, (at + buf.len() as u64 - 1) / PAGE);
        if !self.journal().any_in(first, last - first + 1) {
            return self.read_home(e, in_off, buf, unit);
        }
        // [home_from, done): a run of pages at home not read yet.
        let (mut home_from, mut done) = (0usize, 0usize);
        while done < buf.len() {
            let pos = at + done as u64;
            let n = ((PAGE - pos % PAGE) as usize).min(buf.len() - done);
            if let Some(slot) = self.journal().lookup(pos / PAGE) {
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
        self.reconstruct(e, unit, pos, in_off, buf, bufs.one(self.buf_bytes()), &[])
    }
}
