//! The striped backend's codec helpers, used by reads and writes alike:
//! the pooled codecs ([`super::super::io::CodecPool`]) encode a group's
//! parity and decode a gone member from any `k` others. Reads members
//! through `io`; the map is not touched here.

use super::super::io::{batch, IoReq};
use super::super::{DeviceError, Inner, Result};
use crate::erasure::{aligned, CodeError, ALIGN, MAX_SHARDS};
use crate::extent_map::Unit;
use netpager_nbd::Op;

impl Inner {
    /// Bytes of one pooled buffer: an extent per parity member.
    pub(super) fn buf_bytes(&self) -> usize {
        self.layout.extent as usize * self.layout.parity_count().max(1)
    }

    pub(super) fn code_error(&self, e: u64, source: CodeError) -> DeviceError {
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

    pub(super) fn codec<T>(&self, f: impl FnOnce(&mut crate::erasure::Codec) -> T) -> T {
        self.stripe().codecs.with(f)
    }

    /// Encodes a group's `r` parity chunks into `parity` from its `k`
    /// data chunks in `data`, every chunk `n` bytes (`e`: the group's
    /// first extent, for errors).
    pub(super) fn encode_chunks(
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

    /// Member `pos`'s bytes `[in_off, in_off + out.len())` decoded from `k`
    /// other members (degraded read, rebuild), read in parallel piece by
    /// piece into `scratch` (any size from `(k + 1) * 64` bytes), none of
    /// them in `not_from`. A member whose read fails is left out and
    /// another one read instead.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reconstruct(
        &self,
        e: u64,
        unit: &Unit,
        pos: usize,
        in_off: u64,
        out: &mut [u8],
        scratch: &mut [u8],
        not_from: &[usize],
    ) -> Result<()> {
        let l = &self.layout;
        let g = e / l.data_per_unit();
        let (k, r) = (l.data_per_unit() as usize, l.parity_count());
        if self.map.is_unsynced(g) {
            return Err(DeviceError::Lost {
                extent: e,
                reason: format!(
                    "group {g}'s parity was not resynced since the device last stopped, so it may not match its data: {}",
                    self.lost_reason(unit)
                ),
            });
        }
        let want = l.shard_of(g, pos);
        let mut gone = [false; MAX_SHARDS];
        gone[pos] = true;
        for (j, m) in unit.members.iter().enumerate() {
            gone[j] |= !self.usable(m) || not_from.contains(&j);
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
