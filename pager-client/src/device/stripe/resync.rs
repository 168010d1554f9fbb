//! Closing the write hole (modes parity and ec): a group's data and parity
//! members are written by separate requests, so a client killed between
//! them leaves parity that does not match the data, and a later donor
//! loss would decode garbage for the group's other extents. Every write at
//! home marks its group open in the map's journal first (see
//! [`crate::extent_map::ExtentMap::mark_written`]); at start the groups
//! still marked get their parity recomputed from their data members.
//!
//! Calls: `codec` (encode), `io`; called at open and by the maintenance
//! pass (through backend.rs), and by lost.rs after a group is re-placed.

use std::sync::atomic::Ordering;
use std::time::Instant;

use netpager_util::{LockExt, RwLockExt};

use super::super::io::{batch, IoReq, IoResult};
use super::super::{DeviceError, Inner, Result};
use crate::erasure::ALIGN;
use crate::extent_map::Unit;
use netpager_nbd::Op;

/// The first failed request of a batch: its index and why.
fn first_failure(res: &[Option<IoResult>]) -> Option<(usize, &str)> {
    res.iter().enumerate().find_map(|(i, r)| match r {
        Some(Err(f)) => Some((i, f.reason())),
        _ => None,
    })
}

/// Progress is logged every this many groups.
const LOG_EVERY: usize = 64;

impl Inner {
    /// Resyncs every group the journal says was open when the device last
    /// stopped, before anything reads it.
    pub(crate) fn resync_open_groups(&self) -> Result<()> {
        let open = self.map.open_intents();
        if open.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        tracing::info!(
            "resync: {} parity group(s) were open when the device stopped",
            open.len()
        );
        for (i, &g) in open.iter().enumerate() {
            let guard = self.map.unit(g).write_or_recover();
            match self.resync_group(g, guard.as_ref()) {
                Ok(true) => {
                    self.resynced.fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {}
                // A data member unreachable now may be back in a second
                // (a donor slow or restarting), with the data the parity
                // must be computed from; decoding from this parity
                // instead would return what the group held before its
                // last writes (zeros, for a fresh group).
                Err(e) => {
                    self.map.mark_unsynced(g);
                    tracing::error!(
                        "resync of parity group {g}: {e}; nothing is decoded from its parity until a resync succeeds (retried while the device serves), so a member it would rebuild reads as lost meanwhile"
                    );
                }
            }
            drop(guard);
            if (i + 1) % LOG_EVERY == 0 {
                tracing::info!("resync: {}/{} groups", i + 1, open.len());
            }
        }
        tracing::info!(
            "resync: {} of {} group(s) resynced in {:.1} s",
            self.resynced.load(Ordering::Relaxed),
            open.len(),
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Recomputes group `g`'s parity members from its data members and
    /// writes them (group write-locked, `unit` its placement), then closes
    /// its write intent; false if the group has no placement.
    pub(crate) fn resync_group(&self, g: u64, unit: Option<&Unit>) -> Result<bool> {
        let Some(unit) = unit else {
            self.map.clear_intent(g)?;
            return Ok(false);
        };
        let l = self.layout;
        let (k, r) = (l.data_per_unit() as usize, l.parity_count());
        let first = g * l.data_per_unit();
        if let Some(s) = (0..k).find(|&s| !self.usable(&unit.members[l.member_of(g, s)])) {
            return Err(DeviceError::Io {
                extent: first + s as u64,
                reason: format!(
                    "data member {} is unreachable, so the parity cannot be recomputed: {}",
                    l.member_of(g, s),
                    self.lost_reason(unit)
                ),
            });
        }
        let mut bufs = self.bufs.take(1);
        let shards = bufs.one(self.buf_bytes());
        let piece = (shards.len() / (k + r) / ALIGN * ALIGN) as u64;
        let mut at = 0;
        while at < l.extent {
            let n = piece.min(l.extent - at) as usize;
            let (dpart, ppart) = shards[..(k + r) * n].split_at_mut(k * n);
            let res = {
                let mut reqs = batch();
                for (s, (req, chunk)) in reqs.iter_mut().zip(dpart.chunks_mut(n)).enumerate() {
                    *req = Some(IoReq {
                        loc: unit.members[l.member_of(g, s)].loc,
                        off: at,
                        op: Op::Read(chunk),
                    });
                }
                self.exec(&mut reqs)
            };
            if let Some((s, f)) = first_failure(&res) {
                return Err(DeviceError::Io {
                    extent: first + s as u64,
                    reason: format!("reading data member {} at {at}: {f}", l.member_of(g, s)),
                });
            }
            self.encode_chunks(first, dpart, ppart, n)?;
            // A parity member that is gone is re-created from the data by
            // the rebuild anyway.
            let res = {
                let mut reqs = batch();
                for (i, (req, chunk)) in reqs.iter_mut().zip(ppart.chunks(n)).enumerate() {
                    let m = unit.members[l.member_of(g, k + i)];
                    *req = self.usable(&m).then_some(IoReq {
                        loc: m.loc,
                        off: at,
                        op: Op::Write(chunk),
                    });
                }
                self.exec(&mut reqs)
            };
            if let Some((i, f)) = first_failure(&res) {
                return Err(DeviceError::Io {
                    extent: first,
                    reason: format!(
                        "writing parity member {} at {at}: {f}",
                        l.member_of(g, k + i)
                    ),
                });
            }
            at += n as u64;
        }
        self.map.clear_intent(g)?;
        Ok(true)
    }

    /// Closes the write intent of groups quiet for `write_intent_quiet_ms`
    /// (runs on the maintenance thread).
    pub(crate) fn sweep_write_intents(&self) {
        let quiet = std::time::Duration::from_millis(self.cfg.write_intent_quiet_ms);
        {
            let mut last = self.intent_sweep.lock_or_recover();
            if last.elapsed() < quiet {
                return;
            }
            *last = Instant::now();
        }
        let untrusted = match self.map.sweep_intents() {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("closing parity groups' write intents: {e}");
                return;
            }
        };
        for g in untrusted {
            self.resync_untrusted(g);
        }
    }

    /// Group `g`'s data and parity may disagree: a request panicked while
    /// it held the group's lock, or its resync at start failed. Recompute
    /// the parity, and only then trust the group again (lock unpoisoned,
    /// intent closed).
    fn resync_untrusted(&self, g: u64) {
        let lock = self.map.unit(g);
        let guard = lock.write_or_recover();
        let unsynced = self.map.is_unsynced(g);
        let why = if unsynced {
            "its resync at start had failed"
        } else {
            "a request failed mid-write (panic)"
        };
        match self.resync_group(g, guard.as_ref()) {
            Ok(_) => {
                self.resynced.fetch_add(1, Ordering::Relaxed);
                lock.clear_poison();
                tracing::warn!("parity group {g}: {why}; parity recomputed");
            }
            // Left open: the next sweep, or the next start, tries again
            // (while a donor is away, every sweep: not logged each time).
            Err(e) if unsynced => tracing::debug!("resync of parity group {g} ({why}): {e}"),
            Err(e) => tracing::error!("resync of parity group {g} ({why}): {e}"),
        }
    }
}
