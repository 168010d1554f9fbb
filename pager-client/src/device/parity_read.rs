//! Striped modes' reads: a page is read from the member that holds it;
//! a gone member's pages are decoded from any `k` members of its group
//! (see `parity` for the layout and the writes).

use super::io::{batch, IoReq};
use super::{DeviceError, Inner, Result};
use crate::erasure::{aligned, CodeError, ALIGN, MAX_SHARDS};
use crate::extent_map::{CopyState, Member, Unit};
use crate::page_log::PAGE;
use netpager_nbd::Op;
use netpager_util::RwLockExt;

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
                let mut at = 0usize;
                while at < n {
                    let p = pos + at as u64;
                    let m = ((ext - p % ext) as usize).min(n - at);
                    self.read_parity_locked(
                        p / ext,
                        p % ext,
                        &mut piece[at..at + m],
                        guard.as_ref(),
                    )?;
                    at += m;
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
