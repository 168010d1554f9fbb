//! Striped modes' reads: a page is read from the member that holds it;
//! a gone member's pages are decoded from any `k` members of its group
//! (see `parity` for the layout and the writes).

use std::sync::RwLockReadGuard;

use super::io::{batch, IoReq};
use super::{DeviceError, Inner, Result};
use crate::erasure::{aligned, CodeError, ALIGN, MAX_SHARDS};
use crate::extent_map::{CopyState, Member, Unit};
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
    pub(crate) fn usable(&self, m: &Member) -> bool {
        m.state == CopyState::Ok && self.loc_available(m.loc)
    }

    /// Bytes of one pooled buffer: an extent per parity member.
    pub(crate) fn buf_bytes(&self) -> usize {
        self.layout.extent as usize * self.layout.parity_count().max(1)
    }

    pub(crate) fn code_error(&self, e: u64, source: CodeError) -> DeviceError {
        match source {
            CodeError::TooFew { .. } => DeviceError::Lost {
                extent: e,
                reason: source.to_string(),
            },
            CodeError::Shape { .. } => DeviceError::Io {
                extent: e,
                reason: source.to_string(),
            },
        }
    }

    pub(crate) fn codec<T>(&self, f: impl FnOnce(&mut crate::erasure::Codec) -> T) -> T {
        self.codecs.as_ref().expect("a striped mode").with(f)
    }

    /// Encodes a group's `r` parity chunks into `parity` from its `k`
    /// data chunks in `data`, every chunk `n` bytes (`e`: the group's
    /// first extent, for errors).
    pub(crate) fn encode_chunks(
        &self,
        e: u64,
        data: &[u8],
        parity: &mut [u8],
        n: usize,
    ) -> Result<()> {
        let (k, r) = (data.len() / n, parity.len() / n);
        let mut d: [&[u8]; MAX_SHARDS] = [&[]; MAX_SHARDS];
        for (d, chunk) in d.iter_mut().zip(data.chunks(n)) {
            *d = chunk;
        }
        let mut p: [&mut [u8]; MAX_SHARDS] = Default::default();
        for (p, chunk) in p.iter_mut().zip(parity.chunks_mut(n)) {
            *p = chunk;
        }
        self.codec(|c| c.encode(&d[..k], &mut p[..r]))
            .map_err(|c| self.code_error(e, c))
    }

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
        let Some(plog) = self.plog.as_ref() else {
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

    /// Member `pos`'s bytes `[in_off, in_off + out.len())` decoded from `k`
    /// other members (degraded read, rebuild), read in parallel piece by
    /// piece into `scratch` (any size from `(k + 1) * 64` bytes). A member
    /// whose read fails is left out and another one read instead.
    pub(crate) fn reconstruct(
        &self,
        e: u64,
        unit: &Unit,
        pos: usize,
        in_off: u64,
        out: &mut [u8],
        scratch: &mut [u8],
    ) -> Result<()> {
        let l = &self.layout;
        let g = e / l.data_per_unit();
        let (k, r) = (l.data_per_unit() as usize, l.parity_count());
        let want = l.shard_of(g, pos);
        let mut gone = [false; MAX_SHARDS];
        gone[pos] = true;
        for (j, m) in unit.members.iter().enumerate() {
            gone[j] |= !self.usable(m);
        }
        let mut why = String::new();
        let (a_off, a_len) = aligned(in_off, out.len() as u64);
        let piece = (scratch.len() / (k + 1) / ALIGN * ALIGN) as u64;
        let mut at = a_off;
        while at < a_off + a_len {
            let n = piece.min(a_off + a_len - at) as usize;
            let mut src = [0usize; MAX_SHARDS];
            let mut found = 0;
            for j in (0..unit.members.len()).filter(|&j| !gone[j]).take(k) {
                src[found] = j;
                found += 1;
            }
            if found < k {
                let gone_n = gone[..unit.members.len()].iter().filter(|&&x| x).count();
                return Err(DeviceError::Lost {
                    extent: e,
                    reason: format!(
                        "{gone_n} of the group's {} members are gone and {k} are needed: {}{why}",
                        k + r,
                        self.lost_reason(unit)
                    ),
                });
            }
            let (pieces, rest) = scratch.split_at_mut(k * n);
            let dec = &mut rest[..n];
            let res = {
                let mut reqs = batch();
                for ((req, chunk), &j) in reqs.iter_mut().zip(pieces.chunks_mut(n)).zip(&src) {
                    *req = Some(IoReq {
                        loc: unit.members[j].loc,
                        off: at,
                        op: Op::Read(chunk),
                    });
                }
                self.exec(&mut reqs)
            };
            let mut failed = false;
            for (i, r) in res.iter().enumerate().take(k) {
                if let Some(Err(f)) = r {
                    gone[src[i]] = true;
                    why = format!("; member {}: {}", src[i], f.reason());
                    failed = true;
                }
            }
            if failed {
                continue;
            }
            let mut have: [Option<&[u8]>; MAX_SHARDS] = [None; MAX_SHARDS];
            for (chunk, &j) in pieces.chunks(n).zip(&src) {
                have[l.shard_of(g, j)] = Some(chunk);
            }
            self.codec(|c| c.recover(&have[..k + r], want, dec))
                .map_err(|c| self.code_error(e, c))?;
            // The part of this piece the caller asked for.
            let from = at.max(in_off);
            let to = (at + n as u64).min(in_off + out.len() as u64);
            out[(from - in_off) as usize..(to - in_off) as usize]
                .copy_from_slice(&dec[(from - at) as usize..(to - at) as usize]);
            at += n as u64;
        }
        Ok(())
    }
}
