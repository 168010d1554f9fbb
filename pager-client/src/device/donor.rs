//! One donor as the device sees it: its connection pool, health, last
//! reported status and counters; attaching, labelling and reviving it; and
//! the table of every donor the running device knows.
//!
//! Calls: the NBD pools (`netpager-nbd`), the donors' status endpoints;
//! called by `open`, the epoch thread and membership.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use netpager_proto::{DonorStatus, StatusClient, StatusSession};
use netpager_util::{LockExt, RwLockExt};

use super::label::{self, Owner, LABEL_BYTES};
use super::membership::Standing;
use super::transient::Away;
use super::{Inner, Result};
use crate::config::DonorConfig;
use crate::extent_map::{CopyState, SlotOwner};
use netpager_membership::Joined;
use netpager_nbd::{Op, Pool};

/// Largest single trim sent when clearing a whole export.
const TRIM_CHUNK: u64 = 1 << 30;

#[derive(Debug, Default)]
pub(crate) struct Health {
    /// Why the donor was marked failed.
    pub failure: Option<String>,
    /// Since when (for `forget_after`).
    pub failed_at: Option<Instant>,
    /// Its copies have been marked lost and its slots forgotten, so it may
    /// come back as a new donor.
    pub marked: bool,
    /// Why it is not ours to use (its export is another device's, or a
    /// member's of ours reached another way), if it is not.
    pub refused: Option<String>,
    /// Why it answers but is not attached yet: it took no label (it
    /// refuses new pages); tried again each epoch it takes pages.
    pub unlabelled: Option<String>,
}

/// Reads of a donor's first page, each on a new round of connections, while
/// the donor refuses its round ([`Inner::read_on_a_live_round`]).
const STALE_READS: usize = 3;

/// Why a donor could not be attached.
#[derive(Debug)]
pub(crate) enum AttachFail {
    /// It did not answer.
    Unreachable(String),
    /// It answered, but our data on it is gone (it restarted).
    Lost(String),
    /// Its export is not ours to use.
    Refused(String),
    /// It is member `.0` (entry), failed away and now at this address.
    Moved(usize),
    /// It took no label (it refuses new pages: draining or full), so it
    /// cannot be told apart from an unlabelled member reached another way:
    /// not used until it can be labelled.
    Unlabelled(String),
}

impl AttachFail {
    pub fn reason(&self) -> &str {
        match self {
            AttachFail::Unreachable(r)
            | AttachFail::Lost(r)
            | AttachFail::Refused(r)
            | AttachFail::Unlabelled(r) => r,
            AttachFail::Moved(_) => "a member at a new address",
        }
    }
}

/// What the donor's status endpoint said last.
#[derive(Debug, Default, Clone)]
pub(crate) struct Remote {
    pub status: Option<DonorStatus>,
    pub error: Option<String>,
    /// Its age-x differs from the configured one and that was logged.
    pub age_x_warned: bool,
}

pub(crate) struct Donor {
    /// Its entry in the [`DonorTable`], never reused.
    pub idx: usize,
    /// Its id in the extent map.
    pub id: u16,
    pub cfg: DonorConfig,
    /// How and when (seconds since the Unix epoch) it joined the set.
    pub joined: Joined,
    pub joined_unix: u64,
    /// Where it stands in the set (membership.rs changes it).
    pub standing: Standing,
    pub pool: Pool,
    /// Reads the donor's status endpoint, signing with the lab key if any,
    /// on a connection kept from one epoch to the next.
    pub status: Mutex<StatusSession>,
    pub failed: AtomicBool,
    pub health: Mutex<Health>,
    pub draining: AtomicBool,
    /// No room for another extent (reported, or an ENOSPC since the last
    /// epoch).
    pub full: AtomicBool,
    /// Connected at least once since it was (re)attached: capacity known.
    pub attached: AtomicBool,
    pub remote: Mutex<Remote>,
    pub errors: AtomicU64,
    /// Requests sent a second time after a fast failure (a reset
    /// connection) instead of failing the donor.
    pub retries: AtomicU64,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    /// Requests it answered (ENOSPC included): a donor that answered since
    /// the last epoch is alive and needs no heartbeat.
    pub answered: AtomicU64,
    /// `answered` when the epoch last looked.
    answered_seen: AtomicU64,
    /// Serialises writing a new label.
    pub label_lock: Mutex<()>,
    /// The label its export carries as far as the device knows (0: none,
    /// or not known to be there): each connection its pool opens after
    /// the first reads it back before it carries a request
    /// ([`label_check`](super::transient::label_check)). Set through [`Inner::set_label`] only.
    pub expected_label: Arc<Mutex<u128>>,
    /// Since when it has not answered, while it is only suspect (not yet
    /// failed: transient.rs).
    suspect: Mutex<Option<Instant>>,
    /// One probe of a suspect donor at a time.
    pub probing: Mutex<()>,
    /// Failed with our data on it: the label to take it back by.
    pub away: Mutex<Option<Away>>,
    /// Extent copies taken back as they were when it returned (re-add).
    pub taken_back: AtomicU64,
    /// The slots it held when its copies were marked lost, and those given
    /// back untrimmed while it was failed: if it is taken back, those no
    /// member takes back are trimmed (their members were rebuilt
    /// elsewhere, written meanwhile, or freed), or the donor keeps their
    /// pages for nobody.
    pub left_behind: Mutex<Vec<u32>>,
}

impl Donor {
    /// `pool`'s order must be `idx` (entries are never reused, so no two
    /// pools share an order).
    pub fn new(
        idx: usize,
        id: u16,
        cfg: DonorConfig,
        (joined, joined_unix): (Joined, u64),
        pool: Pool,
        expected_label: Arc<Mutex<u128>>,
        status_client: StatusClient,
    ) -> Donor {
        Donor {
            idx,
            id,
            cfg,
            joined,
            joined_unix,
            standing: Standing::default(),
            pool,
            status: Mutex::new(StatusSession::new(status_client)),
            failed: AtomicBool::new(false),
            health: Mutex::new(Health::default()),
            draining: AtomicBool::new(false),
            full: AtomicBool::new(false),
            attached: AtomicBool::new(false),
            remote: Mutex::new(Remote::default()),
            errors: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            answered_seen: AtomicU64::new(0),
            label_lock: Mutex::new(()),
            expected_label,
            suspect: Mutex::new(None),
            probing: Mutex::new(()),
            away: Mutex::new(None),
            taken_back: AtomicU64::new(0),
            left_behind: Mutex::new(Vec::new()),
        }
    }

    /// Since when it has been silent; starts the count (and says so) if
    /// it was not suspect yet.
    pub fn suspect_since(&self, e: &netpager_nbd::NbdError) -> Instant {
        *self.suspect.lock_or_recover().get_or_insert_with(|| {
            tracing::warn!(
                "donor {} ({}) does not answer ({e}); its requests wait for it",
                self.cfg.name,
                self.cfg.address
            );
            Instant::now()
        })
    }

    pub fn suspect_at(&self) -> Option<Instant> {
        *self.suspect.lock_or_recover()
    }

    pub fn is_suspect(&self) -> bool {
        self.suspect_at().is_some()
    }

    pub fn clear_suspect(&self) {
        *self.suspect.lock_or_recover() = None;
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub fn is_leaving(&self) -> bool {
        self.standing.leaving()
    }

    pub fn is_retired(&self) -> bool {
        self.standing.retired()
    }

    /// It answered no request since the last call (the epoch's look).
    pub fn quiet_since_last_look(&self) -> bool {
        let now = self.answered.load(Ordering::Relaxed);
        self.answered_seen.swap(now, Ordering::Relaxed) == now
    }

    pub fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock_or_recover()
    }

    pub fn remote(&self) -> std::sync::MutexGuard<'_, Remote> {
        self.remote.lock_or_recover()
    }
}

impl Inner {
    /// Marks donor `d` failed: no more requests go to it, the maintenance
    /// thread marks its copies lost and rebuilds them elsewhere.
    pub(crate) fn fail_donor(&self, d: &Donor, reason: &str) {
        self.fail_donor_as(d, reason, true);
    }

    /// [`Inner::fail_donor`]; with `hold`, its copies wait out the grace
    /// before they are rebuilt (it may come back with them: transient.rs).
    pub(crate) fn fail_donor_as(&self, d: &Donor, reason: &str, hold: bool) {
        d.errors.fetch_add(1, Ordering::Relaxed);
        if d.is_failed() {
            return;
        }
        // Before anyone sees it failed: from now on written slots are
        // noted, so it can be taken back for what did not change.
        self.note_away(d, hold);
        if d.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        d.clear_suspect();
        // Journaled at once: a serving process that crashes before the
        // maintenance thread marks its copies lost must not find them
        // trusted at the next open (writes from now on skip them).
        if self.map.donor_label(d.id) != 0 {
            if let Err(e) = self.set_label(d, 0) {
                tracing::error!("journaling donor {}'s label: {e}", d.cfg.name);
            }
        }
        {
            let mut h = d.health();
            h.failure = Some(reason.to_string());
            h.failed_at = Some(Instant::now());
            h.marked = false;
        }
        d.pool.close();
        tracing::error!(
            "donor {} ({}) marked failed: {reason}; its extent copies will be {}",
            d.cfg.name,
            d.cfg.address,
            if self.layout.mode == crate::extent_map::Redundancy::None {
                "LOST"
            } else {
                "rebuilt elsewhere"
            }
        );
        self.maint_wake.notify();
    }

    /// Connects to donor `d` (at open, or as it joins) and checks that its
    /// export is ours to use: one that holds our data still holds its
    /// label; a new one is cleared and labelled at once, unless its label
    /// says it is another device's, or a member's of ours reached another
    /// way. True when the donor answered but lost our data (it
    /// restarted).
    pub(crate) fn attach(&self, d: &Donor) -> bool {
        match self.try_attach(d) {
            Ok(()) => false,
            Err(AttachFail::Unreachable(reason)) => {
                self.fail_donor(d, &reason);
                false
            }
            Err(AttachFail::Unlabelled(reason)) => {
                self.wait_for_label(d, reason);
                false
            }
            Err(AttachFail::Lost(reason)) => {
                self.fail_donor_gone(d, &reason);
                true
            }
            Err(AttachFail::Refused(reason)) => {
                self.refuse_donor(d, reason);
                false
            }
            Err(AttachFail::Moved(i)) => {
                self.refuse_donor(d, self.moved_here(i));
                false
            }
        }
    }

    /// Why a donor that is failed member `i` under another name is not
    /// taken as such here (only `donor-add` moves a member).
    fn moved_here(&self, i: usize) -> String {
        format!(
            "it serves member {}'s export, and {} is failed at its address {}: pagerctl donor-add this address to move {} here",
            self.members[i].cfg.name,
            self.members[i].cfg.name,
            self.members[i].cfg.address,
            self.members[i].cfg.name
        )
    }

    /// Attaches `d`, or says why not.
    pub(crate) fn try_attach(&self, d: &Donor) -> std::result::Result<(), AttachFail> {
        let unreachable = |e: netpager_nbd::NbdError| {
            if e.is_restarted() {
                AttachFail::Lost(e.to_string())
            } else if e.is_fenced() {
                // Its connection is this session's newest but one: another
                // entry of this device connected to the same export since.
                AttachFail::Refused(format!(
                    "{} serves the same export as a member (a member's connection to it took it over while it was checked): one donor reached two ways",
                    d.cfg.address
                ))
            } else {
                AttachFail::Unreachable(e.to_string())
            }
        };
        let mut lease = d.pool.checkout().map_err(unreachable)?;
        let size = lease.size();
        // Connected first (that may wait out a timeout), then one export at
        // a time from reading its label to writing ours: two addresses of
        // one export must not both find it unlabelled.
        let _one = self.labelling.lock_or_recover();
        let mut b = vec![0u8; LABEL_BYTES];
        lease.run(0, Op::Read(&mut b)).map_err(unreachable)?;
        let found = label::decode(&b);
        let expected = self.map.donor_label(d.id);
        if expected != 0 && found.value() == Some(expected) {
            drop(lease);
            self.set_capacity(d, size, false);
            d.attached.store(true, Ordering::Release);
            return Ok(());
        }
        // Each member's label: the journaled one, or for a member that
        // failed away, the one it should come back with.
        let others: Vec<(&str, u128)> = self
            .members
            .iter()
            .filter(|o| o.idx != d.idx)
            .map(|o| {
                let away = o.away.lock_or_recover().map(|a| a.label);
                (
                    o.cfg.name.as_str(),
                    away.unwrap_or(self.map.donor_label(o.id)),
                )
            })
            .filter(|(_, l)| *l != 0)
            .collect();
        let export = &d.pool.endpoint().export;
        match label::whose(&found, &self.label_owner(), others) {
            label::Whose::Member(m) => {
                let member = self.members.find(m).expect("a member");
                if member.is_failed() && member.away.lock_or_recover().is_some() {
                    // The member it is failed away, its data here: it moved.
                    return Err(AttachFail::Moved(member.idx));
                }
                return Err(AttachFail::Refused(format!(
                    "{} serves the same export as member {m} (its label is {m}'s): one donor reached two ways",
                    d.cfg.address
                )));
            }
            label::Whose::Other(owner) => {
                return Err(AttachFail::Refused(format!(
                    "its export {export:?} holds the pages of {owner}: not cleared, not used (detach that device first, or give this one another export)"
                )))
            }
            label::Whose::Free if expected != 0 => {
                return Err(AttachFail::Lost(format!(
                    "its export {export:?} no longer holds our data (label mismatch: the donor restarted or lost its memory)"
                )))
            }
            label::Whose::Free => {}
        }
        let cleared = clear_export(&mut lease, size).map_err(unreachable)?;
        drop(lease);
        self.set_capacity(d, size, cleared);
        d.attached.store(true, Ordering::Release);
        // Labelled now, not at its first extent: a second address of this
        // export that joins later finds the label and is refused.
        if let Err(e) = self.write_label(d) {
            d.attached.store(false, Ordering::Release);
            return Err(AttachFail::Unlabelled(format!(
                "it takes no label now ({e}): a donor that refuses new pages (draining or full) cannot be told apart from a member reached another way"
            )));
        }
        // A member that holds nothing of ours (drained, or not yet given an
        // extent) has no label, so the export's own read found none: ask
        // each such member whether it now reads the label just written.
        if let Some(m) = self.unlabelled_member_reading(d) {
            d.attached.store(false, Ordering::Release);
            // Taken off again through the member (its round is the newest
            // now), so the export holds nothing of ours, as before.
            if let Err(e) = self.set_label(d, 0) {
                tracing::error!("journaling donor {}'s label: {e}", d.cfg.name);
            }
            let trim = m
                .pool
                .checkout()
                .and_then(|mut l| l.run(0, Op::Trim(self.layout.extent)));
            if let Err(e) = trim {
                tracing::warn!("trimming the label written through {}: {e}", d.cfg.name);
            }
            return Err(AttachFail::Refused(format!(
                "{} serves the same export as member {} (it reads the label just written here): one donor reached two ways",
                d.cfg.address, m.cfg.name
            )));
        }
        Ok(())
    }

    /// The unlabelled member (other than `d`) whose export reads `d`'s
    /// label: the same export reached another way. The caller holds
    /// `labelling`, so no member labels itself meanwhile.
    fn unlabelled_member_reading(&self, d: &Donor) -> Option<&Donor> {
        let ours = self.map.donor_label(d.id);
        self.members
            .iter()
            // Attached: one not attached yet checks itself when it is.
            .filter(|o| o.idx != d.idx && !o.is_retired() && !o.is_failed())
            .filter(|o| o.attached.load(Ordering::Acquire) && self.map.donor_label(o.id) == 0)
            .find(|o| {
                // Its connections' round may be older than the one `d`
                // just opened on the same export: that is the answer, but
                // it is read on a new round to be sure.
                let mut b = vec![0u8; LABEL_BYTES];
                self.read_on_a_live_round(o, &mut b).is_ok()
                    && label::decode(&b).value() == Some(ours)
            })
    }

    /// Reads the start of `d`'s export on a round of connections the donor
    /// still takes. It refuses an older round's requests once a newer
    /// round of this device's connects to the same export (another pool:
    /// a second name being checked). A new round is opened only if the
    /// current one is refused, once per refused generation (each new round
    /// fences the one before, so threads renewing at once fenced each
    /// other, and the device took that for a newer session and stopped),
    /// and never through `close`: a checkout between it and `reopen` was
    /// refused, and that failed the donor (the nemesis, mirror, seed
    /// 658104338: "add-alias d2" failed d2).
    pub(crate) fn read_on_a_live_round(
        &self,
        d: &Donor,
        b: &mut [u8],
    ) -> std::result::Result<(), netpager_nbd::NbdError> {
        let read = |b: &mut [u8]| {
            let generation = d.pool.generation();
            let r = d.pool.checkout().and_then(|mut l| l.run(0, Op::Read(b)));
            (generation, r)
        };
        let mut r = read(b);
        for _ in 0..STALE_READS {
            match r {
                (generation, Err(e)) if e.is_fenced() => {
                    d.pool.renew_from(generation);
                    r = read(b);
                }
                _ => break,
            }
        }
        r.1
    }

    pub(super) fn set_capacity(&self, d: &Donor, size: u64, cleared: bool) {
        let slots = (size / self.layout.extent).min(u32::MAX as u64) as u32;
        self.map.set_capacity(SlotOwner::Donor(d.id), slots);
        if cleared {
            self.map.mark_free_slots_clean(SlotOwner::Donor(d.id));
        }
        if slots < 2 {
            tracing::warn!(
                "donor {}: export of {size} bytes holds no extent of {} bytes",
                d.cfg.name,
                self.layout.extent
            );
        }
    }

    /// Donor `d` answers again: no longer failed, nor full until it says
    /// so; waiting for its label if `unlabelled` says why.
    pub(super) fn is_back(d: &Donor, unlabelled: Option<String>) {
        d.full.store(false, Ordering::Release);
        {
            let mut h = d.health();
            h.failure = None;
            h.failed_at = None;
            if unlabelled.is_some() {
                h.unlabelled = unlabelled;
            }
        }
        d.failed.store(false, Ordering::Release);
    }

    /// After its copies were marked lost: take a failed donor back, with
    /// what it still holds if it kept our label (re-add, transient.rs), or
    /// as a new one (its export is cleared, its old pages never trusted).
    pub(crate) fn revive(&self, d: &Donor) {
        if d.is_retired() || !d.is_failed() || !d.health().marked {
            return;
        }
        d.pool.reopen();
        let taken_back = self.take_back(d);
        if let Some((back, rebuild)) = taken_back {
            tracing::warn!(
                "donor {} ({}) is back with our data: {back} extent copies taken back as they were, {rebuild} re-created (written while it was away)",
                d.cfg.name,
                d.cfg.address
            );
            self.maint_wake.notify();
            return;
        }
        match self.try_attach(d) {
            Ok(()) => {
                self.end_away(d);
                Self::is_back(d, None);
                tracing::info!(
                    "donor {} ({}) is back; using it as a new donor",
                    d.cfg.name,
                    d.cfg.address
                );
            }
            Err(AttachFail::Refused(why)) => {
                self.end_away(d);
                self.refuse_donor(d, why)
            }
            Err(AttachFail::Moved(i)) => {
                self.end_away(d);
                self.refuse_donor(d, self.moved_here(i))
            }
            Err(AttachFail::Unlabelled(why)) => {
                // Back, but refusing new pages (a drained member still
                // draining): as a newcomer does, it waits for its label
                // (`retry_label`, each epoch). Kept failed, it stayed so
                // until it stopped draining (the nemesis, parity, seed
                // 1931941111: the swap device never settled).
                self.end_away(d);
                d.pool.close();
                Self::is_back(d, Some(why));
                tracing::info!(
                    "donor {} ({}) is back; it takes no label yet, so nothing new goes there",
                    d.cfg.name,
                    d.cfg.address
                );
            }
            Err(AttachFail::Unreachable(e) | AttachFail::Lost(e)) => {
                d.pool.close();
                tracing::debug!("donor {} not back yet: {e}", d.cfg.name);
            }
        }
    }

    /// Donor `d` is not ours to use (another device's export, or a member
    /// reached another way): it stays failed with the reason, and is never
    /// cleared.
    pub(crate) fn refuse_donor(&self, d: &Donor, reason: String) {
        tracing::error!(
            "donor {} ({}) not used: {reason}",
            d.cfg.name,
            d.cfg.address
        );
        d.pool.close();
        let mut h = d.health();
        h.refused = Some(reason);
    }

    /// Donor `d` answers but took no label: it waits, not attached and not
    /// failed (it holds nothing of ours), until it takes pages.
    pub(crate) fn wait_for_label(&self, d: &Donor, reason: String) {
        tracing::warn!(
            "donor {} ({}) not used yet: {reason}",
            d.cfg.name,
            d.cfg.address
        );
        d.pool.close();
        d.health().unlabelled = Some(reason);
    }

    /// Each epoch, for a donor waiting to be labelled that may take pages
    /// now (its status no longer says draining, or did not answer):
    /// attaches it, or says why not.
    pub(crate) fn retry_label(&self, d: &Donor) {
        // Still draining, as its status said just now: no label yet. A
        // status that did not answer says nothing, and the try finds out
        // whether the donor died (it waited for ever, never failed: the
        // nemesis slice, mirror, seed 3339075913).
        if d.draining.load(Ordering::Acquire) && d.remote().error.is_none() {
            return;
        }
        // Its connections were closed as it began to wait: tried on a
        // closed pool it was failed ("no new connections"), and failed it
        // was left out of the second-name check, so a second name of it
        // was accepted (the nemesis, mode none, seed 28889084).
        d.pool.reopen();
        let res = self.try_attach(d);
        d.health().unlabelled = None;
        match res {
            Ok(()) => tracing::info!("donor {} ({}) labelled: in use", d.cfg.name, d.cfg.address),
            Err(AttachFail::Unlabelled(r)) => {
                d.pool.close();
                d.health().unlabelled = Some(r);
            }
            Err(AttachFail::Refused(why)) => self.refuse_donor(d, why),
            Err(AttachFail::Moved(i)) => self.refuse_donor(d, self.moved_here(i)),
            Err(AttachFail::Unreachable(r)) => self.fail_donor(d, &r),
            Err(AttachFail::Lost(r)) => self.fail_donor_gone(d, &r),
        }
    }

    /// Marks every copy on failed donors lost, forgets their slots and
    /// labels. Runs on the maintenance thread (and once at open).
    pub(crate) fn mark_failed_donors(&self) {
        for d in self
            .members
            .iter()
            .filter(|d| d.is_failed() && !d.health().marked)
        {
            let mut marked = 0u64;
            for u in 0..self.layout.units() {
                let mut g = self.map.unit(u).write_or_recover();
                let Some(unit) = g.as_mut() else { continue };
                let mut changed = false;
                for m in unit.members.iter_mut() {
                    if m.state != CopyState::Lost && self.loc_donor(m.loc) == Some(d.idx) {
                        m.state = CopyState::Lost;
                        changed = true;
                        marked += 1;
                    }
                }
                if changed {
                    if let Err(e) = self.map.commit(u, &g) {
                        tracing::error!("journaling lost copies of unit {u}: {e}");
                    }
                }
            }
            // With the slots given back untrimmed while it was failed.
            d.left_behind
                .lock_or_recover()
                .extend(self.map.forget_donor_slots(d.id));
            if self.map.donor_label(d.id) != 0 {
                if let Err(e) = self.set_label(d, 0) {
                    tracing::error!("journaling donor {}'s label: {e}", d.cfg.name);
                }
            }
            d.attached.store(false, Ordering::Release);
            d.health().marked = true;
            if marked > 0 {
                tracing::warn!("donor {}: {marked} extent copies marked lost", d.cfg.name);
            }
        }
    }

    /// Who this device is, as its labels say.
    /// Journals donor `d`'s label, and sets what its new connections
    /// check: a label dropped is no longer checked before it goes from the
    /// donor (`unlabel` trims it after), and a new one is checked once it
    /// is on the donor (callers write it first).
    pub(crate) fn set_label(&self, d: &Donor, label: u128) -> Result<()> {
        if label == 0 {
            *d.expected_label.lock_or_recover() = 0;
        }
        self.map.set_donor_label(d.id, label)?;
        *d.expected_label.lock_or_recover() = label;
        Ok(())
    }

    fn label_owner(&self) -> Owner {
        Owner {
            device: self.cfg.device_id.clone().unwrap_or_default(),
            client: self.cfg.client_id.clone(),
            host: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
            dir: self.state_dir.display().to_string(),
        }
    }

    /// Writes a new label on donor `d` before its first extent.
    pub(crate) fn ensure_label(&self, d: &Donor) -> Result<()> {
        // Labelled already (the usual case): no need to wait behind a
        // labelling round trip.
        if self.map.donor_label(d.id) != 0 {
            return Ok(());
        }
        // One export at a time, as in `try_attach`, whose check of an
        // unlabelled member must not race that member's labelling.
        let _one = self.labelling.lock_or_recover();
        self.write_label(d)
    }

    /// [`Inner::ensure_label`] with `labelling` held.
    fn write_label(&self, d: &Donor) -> Result<()> {
        let _g = d.label_lock.lock_or_recover();
        if self.map.donor_label(d.id) != 0 {
            return Ok(());
        }
        let label = netpager_util::random_u128();
        let b = label::encode(label, &self.label_owner());
        let res = d.pool.checkout().and_then(|mut l| l.run(0, Op::Write(&b)));
        match res {
            Ok(()) => {
                self.set_label(d, label)?;
                Ok(())
            }
            Err(e) => {
                self.donor_error(d, &e);
                Err(super::DeviceError::Io {
                    extent: 0,
                    reason: format!("labelling donor {}: {e}", d.cfg.name),
                })
            }
        }
    }

    /// Removes the label of a donor that holds nothing of ours any more
    /// (so a drained donor ends empty).
    pub(crate) fn drop_label(&self, d: &Donor) -> Result<()> {
        // Not while `try_attach` checks unlabelled members against a label
        // it wrote (on a shared export this trim would erase it).
        let _one = self.labelling.lock_or_recover();
        self.unlabel(d)
    }

    /// [`Inner::drop_label`] with `labelling` held.
    fn unlabel(&self, d: &Donor) -> Result<()> {
        let _g = d.label_lock.lock_or_recover();
        if self.map.donor_label(d.id) == 0 {
            return Ok(());
        }
        self.set_label(d, 0)?;
        let res = d
            .pool
            .checkout()
            .and_then(|mut l| l.run(0, Op::Trim(self.layout.extent)));
        if let Err(e) = res {
            tracing::warn!("trimming donor {}'s label: {e}", d.cfg.name);
        }
        Ok(())
    }
}

/// Discards everything in an export (stale pages of an earlier
/// incarnation). False when the donor does not support trim: its slots are
/// then zeroed one by one before partial use.
fn clear_export(
    lease: &mut netpager_nbd::Lease<'_>,
    size: u64,
) -> std::result::Result<bool, netpager_nbd::NbdError> {
    let mut off = 0;
    while off < size {
        let n = (size - off).min(TRIM_CHUNK);
        match lease.run(off, Op::Trim(n)) {
            Ok(()) => {}
            Err(netpager_nbd::NbdError::Request { errno, .. })
                if errno == libc::EINVAL || errno == libc::EOPNOTSUPP || errno == libc::ENOTSUP =>
            {
                return Ok(false)
            }
            Err(e) => return Err(e),
        }
        off += n;
    }
    Ok(true)
}
