//! Choosing where a new unit (or a moved copy) goes: the epoch's selection
//! frequencies through the policy's [`Selector`], then slots on those
//! donors, all with the donor set's lock held (membership.rs); the local
//! fallback when no donor can take it.
//!
//! Calls: the policy's selector, the map's slots; called by both backends
//! (first writes), maintenance and lost.rs (new slots).

use std::sync::atomic::Ordering;
use std::time::Instant;

use netpager_util::LockExt;

use super::{DeviceError, Inner, Result};
use crate::extent_map::{Loc, Member, SlotOwner};
use crate::policy::{Frequencies, Selector};

/// Whether a placement may use the local fallback when donors cannot
/// take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spill {
    Allowed,
    /// Moving off the fallback: a donor or nothing.
    DonorsOnly,
}

/// The donors (by map id) `members` are on, sorted, each once: what a new
/// member of their unit must not share.
pub(crate) fn donor_ids<'a>(members: impl Iterator<Item = &'a Member>) -> Vec<u16> {
    let mut ids: Vec<u16> = members
        .filter_map(|m| match m.loc {
            Loc::Donor { donor, .. } => Some(donor),
            Loc::Fallback { .. } => None,
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

pub(crate) struct Placement {
    selector: Selector,
    /// This epoch's frequencies, indexed like the configured donors.
    pub freqs: Frequencies,
    /// The same rule with what this device holds on each donor counted as
    /// its to give: the shares the rebalancer moves toward (epoch.rs).
    pub targets: Frequencies,
    /// Why the last placement could not use donors only, if it could not.
    pub note: Option<String>,
    note_kind: &'static str,
    /// Set while every donor is capped by its load bound.
    pub throttle: Option<String>,
}

impl Placement {
    pub fn new(n: usize) -> Placement {
        Placement {
            selector: Selector::new(n),
            freqs: Frequencies::default(),
            targets: Frequencies::default(),
            note: None,
            note_kind: "",
            throttle: None,
        }
    }
}

impl Inner {
    /// Why donor `i` cannot take a new extent now, or `None` if it can.
    pub(crate) fn ineligible_reason(&self, i: usize) -> Option<&'static str> {
        let d = &self.members[i];
        if d.is_retired() {
            Some("left the set")
        } else if d.is_failed() {
            Some("failed")
        } else if d.is_suspect() {
            Some("not answering")
        } else if !d.attached.load(Ordering::Acquire) {
            Some("not connected")
        } else if d.is_leaving() {
            Some("leaving")
        } else if d.draining.load(Ordering::Acquire) {
            Some("draining")
        } else if d.full.load(Ordering::Acquire) {
            Some("full")
        } else if self.map.slot_usage(SlotOwner::Donor(d.id)).1 == 0 {
            Some("export full")
        } else {
            None
        }
    }

    fn why_no_donor(&self, exclude: &[u16], f: &[f64]) -> String {
        let parts: Vec<String> = self
            .members
            .iter()
            .map(|d| {
                // A full or failed donor says so first: that is what an
                // admin acts on, whether or not it also holds a copy.
                let why = if let Some(r) = self.ineligible_reason(d.idx) {
                    match r {
                        "full" => "full (its budget is spent: raise its budget= or add a donor)",
                        "export full" => "our export on it is full",
                        r => r,
                    }
                } else if exclude.contains(&d.id) {
                    "holds another copy of this unit"
                } else if f.get(d.idx).copied().unwrap_or(0.0) <= 0.0 {
                    "selection frequency 0"
                } else {
                    "available"
                };
                format!("{}: {why}", d.cfg.name)
            })
            .collect();
        parts.join(", ")
    }

    /// `k` locations on distinct donors (none of them in `exclude`) for
    /// something in `extent`, with whether each is known to read as zeros.
    /// The fallback fills in for missing donors when configured (replica
    /// modes keep at most one copy there); otherwise
    /// [`DeviceError::NoSpace`].
    pub(crate) fn allocate(
        &self,
        k: usize,
        exclude: &[u16],
        extent: u64,
    ) -> Result<Vec<(Loc, bool)>> {
        self.allocate_where(k, exclude, extent, Spill::Allowed)
    }

    /// [`Self::allocate`], with `spill` saying whether the fallback may
    /// fill in for donors.
    pub(crate) fn allocate_where(
        &self,
        k: usize,
        exclude: &[u16],
        extent: u64,
        spill: Spill,
    ) -> Result<Vec<(Loc, bool)>> {
        let mut refreshed = false;
        // Each failed try rules out a donor (now full or failed).
        for _ in 0..self.members.len() + 2 {
            // The set's lock, from the choice to the slots: a chosen donor
            // cannot retire (nor start leaving) before it has its slot.
            let set = self.members.change();
            let (picked, why) = self.pick_donors(k, exclude);
            if k > picked.len() && self.fallback.is_none() && !refreshed {
                // ENOSPC next, perhaps on an old view of the donors: look
                // at those that refuse, then choose again.
                drop(set);
                refreshed = true;
                self.refresh_refusing(Instant::now());
                continue;
            }
            let replica = !self.layout.mode.striped();
            let missing = k - picked.len();
            let n_fallback = if replica && picked.is_empty() {
                1
            } else {
                missing
            };
            if missing > 0 && spill == Spill::DonorsOnly {
                return Err(DeviceError::NoSpace {
                    extent,
                    reason: format!("no donor has room ({why})"),
                });
            }
            if missing > 0 && self.fallback.is_none() {
                let reason = format!(
                    "no {k} distinct donors can take it ({why}) and no fallback is configured"
                );
                self.note_placement("enospc", format!("extent {extent}: ENOSPC: {reason}"));
                return Err(DeviceError::NoSpace { extent, reason });
            }
            let mut out = Vec::with_capacity(k);
            let mut retry = false;
            let mut unlabelled = None;
            for &i in &picked {
                let d = &self.members[i];
                if self.map.donor_label(d.id) == 0 {
                    // Labelled at join unless that failed: label it now,
                    // without the lock (a round trip), and choose again.
                    unlabelled = Some(i);
                    retry = true;
                    break;
                }
                match self.map.alloc(SlotOwner::Donor(d.id)) {
                    Some(x) => out.push(x),
                    None => {
                        d.full.store(true, Ordering::Release);
                        retry = true;
                        break;
                    }
                }
            }
            if !retry && missing > 0 {
                for _ in 0..n_fallback {
                    match self.map.alloc(SlotOwner::Fallback) {
                        Some(x) => out.push(x),
                        None => {
                            for (l, _) in out {
                                self.map.free(l);
                            }
                            let reason =
                                format!("no donor can take it ({why}) and the fallback is full");
                            self.note_placement(
                                "enospc",
                                format!("extent {extent}: ENOSPC: {reason}"),
                            );
                            return Err(DeviceError::NoSpace { extent, reason });
                        }
                    }
                }
                self.note_placement(
                    "fallback",
                    format!("extent {extent} placed on the local fallback: {why}"),
                );
            }
            drop(set);
            if retry {
                for (l, _) in out {
                    self.map.free(l);
                }
                if let Some(i) = unlabelled {
                    // A donor that cannot be labelled is failed or full now.
                    let _ = self.ensure_label(&self.members[i]);
                }
                continue;
            }
            if missing == 0 {
                // Donors take units again: an old ENOSPC note is stale.
                self.clear_placement_note();
            }
            return Ok(out);
        }
        Err(DeviceError::NoSpace {
            extent,
            reason: "donors kept running out of room while placing it".into(),
        })
    }

    /// A slot on donor entry `i` for something in `extent`, if it may take
    /// one now (eligible, labelled, not in `exclude`): where the
    /// rebalancer sends a member.
    pub(crate) fn allocate_on(&self, i: usize, exclude: &[u16], extent: u64) -> Result<Loc> {
        let _set = self.members.change();
        let d = &self.members[i];
        let why = if exclude.contains(&d.id) {
            Some("holds another member of its unit")
        } else if self.map.donor_label(d.id) == 0 {
            Some("not labelled")
        } else {
            self.ineligible_reason(i)
        };
        if let Some(why) = why {
            return Err(DeviceError::NoSpace {
                extent,
                reason: format!("donor {}: {why}", d.cfg.name),
            });
        }
        match self.map.alloc(SlotOwner::Donor(d.id)) {
            Some((loc, _)) => Ok(loc),
            None => {
                d.full.store(true, Ordering::Release);
                Err(DeviceError::NoSpace {
                    extent,
                    reason: format!("donor {}: export full", d.cfg.name),
                })
            }
        }
    }

    /// Up to `k` distinct eligible donors by the selector; fewer only when
    /// fewer qualify (all of them then, or none if everything is capped and
    /// a fallback exists). Also says why donors were left out.
    fn pick_donors(&self, k: usize, exclude: &[u16]) -> (Vec<usize>, String) {
        let mut pl = self.placement.lock_or_recover();
        let n = self.members.len();
        // A donor that joined since the epoch gets nothing until the next
        // one has polled it (and runs at once after a join).
        let f: Vec<f64> = if pl.freqs.f.len() <= n && pl.freqs.f.iter().any(|&x| x > 0.0) {
            let mut f = pl.freqs.f.clone();
            f.resize(n, 0.0);
            f
        } else {
            vec![1.0; n]
        };
        let eligible = |i: usize| {
            !exclude.contains(&self.members[i].id) && self.ineligible_reason(i).is_none()
        };
        if pl.freqs.all_capped && self.fallback.is_some() {
            return (Vec::new(), "every donor is capped by its load bound".into());
        }
        // With no fallback, the only other way out is ENOSPC to the
        // application: eligible donors at f = 0 fill in (the nemesis, ec,
        // seed 2485690532: a donor undrained an epoch ago, held up by a
        // donor that did not answer, still had f = 0 while every other
        // donor was draining, failed or held the unit's other members).
        let picked = if self.fallback.is_none() {
            pl.selector.pick_distinct_or_fill(&f, k, eligible)
        } else {
            pl.selector.pick_distinct(&f, k, eligible)
        };
        if let Some(v) = picked {
            return (v, String::new());
        }
        let qualifying = (0..n).filter(|&i| f[i] > 0.0 && eligible(i)).count();
        let why = self.why_no_donor(exclude, &f);
        let picked = if qualifying > 0 && self.fallback.is_some() {
            pl.selector
                .pick_distinct(&f, qualifying.min(k), eligible)
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        (picked, why)
    }

    fn clear_placement_note(&self) {
        let mut pl = self.placement.lock_or_recover();
        if pl.note.take().is_some() {
            tracing::info!("placements go to donors again");
            pl.note_kind = "";
        }
    }

    /// Records (and logs, once per change of kind) why a placement left
    /// the donors.
    fn note_placement(&self, kind: &'static str, note: String) {
        let mut pl = self.placement.lock_or_recover();
        if pl.note_kind != kind {
            tracing::warn!("{note}");
            pl.note_kind = kind;
        }
        pl.note = Some(note);
    }
}
