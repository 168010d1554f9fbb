//! Striped modes (parity, ec): a unit is a group of `k` data extents and
//! `r` parity extents on `k + r` distinct donors, the parity positions
//! rotating with the group number (see [`Layout::shard_of`]). Mode parity
//! is `k + 1` with XOR (RAID-5), mode ec `k + r` with Reed-Solomon (any `r`
//! members may be lost); both go through [`crate::erasure::Codec`].
//!
//! This module places a group on its donors; `read` and `write` serve
//! requests, `codec` encodes and decodes, `resync` closes the write hole,
//! and `log` is the parity log, which the writes call at one point
//! (`log_pages`) and the reads at one (`read_log_slot`). Which pages are
//! logged is asked, and a page leaves the log, only through the log's
//! journal handle (`Inner::journal`: [`crate::page_log::LogJournal`]).
//!
//! Outside `stripe/` the device calls only what `backend.rs` dispatches
//! (read, write, zero, trim, a member's contents, resync, the log's
//! maintenance) and, for lost extents, `write_pages_locked` and
//! `resync_group`; everything else here is `pub(super)`.
//!
//! [`Layout::shard_of`]: crate::extent_map::Layout::shard_of

mod codec;
pub(crate) mod log;
mod read;
mod resync;
mod write;

use super::backend::StripedBackend;
use super::io::{batch, IoReq};
use super::maintenance::{MoveWhy, Moving};
use super::{DeviceError, Inner, Result};
use crate::extent_map::{CopyState, Loc, Member, Unit};
use netpager_nbd::Op;

impl Inner {
    /// The striped backend's state: only its own code calls this, and
    /// only a striped device runs that.
    fn stripe(&self) -> &StripedBackend {
        self.striped().expect("a striped mode")
    }

    /// What member `j` of group `u` should hold: read from itself when it
    /// is leaving (drain), was refused a write (written again after), or
    /// another member is gone too, else decoded from the others.
    pub(crate) fn stripe_member_content(
        &self,
        mv: &Moving<'_>,
        out: &mut [u8],
        scratch: &mut [u8],
    ) -> Result<()> {
        let Moving { u, unit, j, why } = *mv;
        let me = unit.members[j];
        let others_ok = unit
            .members
            .iter()
            .enumerate()
            .all(|(k, m)| k == j || self.usable(m));
        let from_self =
            self.usable(&me) && (why.reads_itself_first() || why == MoveWhy::Full || !others_ok);
        if from_self && self.exec1(me.loc, 0, Op::Read(out)).is_ok() {
            return Ok(());
        }
        let e = self
            .layout
            .extent_of(u, j)
            .unwrap_or(u * self.layout.data_per_unit());
        self.reconstruct(e, unit, j, 0, out, scratch, &[])
    }

    /// Orders a new group's locations by member position: its parity
    /// positions get the donors that hold the fewest parity members now,
    /// the data positions the rest. Reads go to data
    /// members only, so this keeps every donor's share of reads even;
    /// taking positions in the selector's order instead lined its cycle up
    /// with the parity's rotation (ec 4+2 on 6 donors: one donor served 5x
    /// another's reads, and 1 MiB reads ran at 0.70x of mode none).
    fn assign_parity(&self, g: u64, locs: &mut [(Loc, bool)]) {
        let (w, r) = (self.layout.members(), self.layout.parity_count());
        if locs.len() != w || r == 0 {
            return;
        }
        let held = self.map.parity_held();
        let parity_of = |l: &(Loc, bool)| match l.0 {
            Loc::Donor { donor, .. } => held.get(donor as usize).copied().unwrap_or(0),
            // The local fallback holds data rather than parity: it reads fastest.
            Loc::Fallback { .. } => u64::MAX,
        };
        let mut by_parity = locs.to_vec();
        by_parity.sort_by_key(parity_of);
        let p = self.layout.parity_member(g);
        let (parity, data) = by_parity.split_at(r);
        let mut data = data.iter();
        for (pos, slot) in locs.iter_mut().enumerate() {
            let j = (pos + w - p) % w;
            *slot = if j < r {
                parity[j]
            } else {
                *data.next().expect("w - r data locations")
            };
        }
    }

    /// First write to a group: `width` slots on distinct donors, zeroed
    /// (if `zero`) where they may hold old data: all-zero members have zero
    /// parity.
    pub(super) fn place_group(
        &self,
        e: u64,
        g: u64,
        guard: &mut Option<Unit>,
        zero: bool,
    ) -> Result<()> {
        // Each failed try rules out a donor (now full or failed).
        for _ in 0..self.members.len() + 2 {
            let mut locs = self.allocate(self.layout.members(), &[], e)?;
            self.assign_parity(g, &mut locs);
            let mut reqs = batch();
            for (&(loc, clean), r) in locs.iter().zip(&mut reqs) {
                *r = (zero && !clean).then_some(IoReq {
                    loc,
                    off: 0,
                    op: Op::Zero(self.layout.extent),
                });
            }
            if self.exec(&mut reqs).iter().flatten().all(|r| r.is_ok()) {
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
