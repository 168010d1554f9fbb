//! Live membership: the device's donor set changes while it stays attached
//! (DESIGN.md §2.3a). [`Membership`] owns the set. It alone adds a donor,
//! marks one leaving, retires one and forgets one, each under its one lock
//! ([`Membership::change`]), which placement also holds from choosing donors
//! to taking their slots: a donor can never retire between being chosen
//! and being given a slot. Everyone else gets views: the donors in the set,
//! an entry by index or map id, lock-free, for the request path.
//!
//! A donor is known by what it is, not how it was reached: as it joins,
//! its export's label is read (donor.rs, label.rs), and an export that
//! holds a member's label is that member under another address, refused.
//!
//! Donors join from the configuration at open, by
//! [`Device::add_donor`](super::Device::add_donor) (`pagerctl donor-add`),
//! from the donors file, or by discovery (follow.rs); they leave by
//! [`Device::remove_donor`](super::Device::remove_donor) (drained first), by
//! a line taken out of the donors file, or by being forgotten after
//! `forget_after` dead. Every change is journaled with the extent map, so
//! a restart finds the same set.
//!
//! Calls: the extent map (member records, slots), `try_attach`/`drop_label`
//! (donor.rs); called by `Device`, the epoch thread (follow.rs), the
//! maintenance thread (removals, forgetting) and placement (the lock).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use netpager_membership::{DonorSpec, Joined};
use netpager_nbd::Pool;
use netpager_util::LockExt;

use super::donor::{AttachFail, Donor};
use super::{DeviceError, Inner, Result};
use crate::config::DonorConfig;
use crate::extent_map::{MemberRecord, MemberState, SlotOwner};
use crate::status::LeftDonor;

/// Departures kept for status (`pagerctl donor-remove --wait` looks there).
const LEFT_KEPT: usize = 32;
/// Donor entries one serving process can hold over its life (a donor that
/// is removed and joins again takes a new one).
pub(crate) const MAX_DONOR_ENTRIES: usize = 4096;
/// Map donor ids are `u16`.
const MAP_IDS: usize = 1 << 16;

/// Where a donor stands in the set. Read by anyone; changed only here,
/// under the set's lock.
#[derive(Default)]
pub(crate) struct Standing {
    /// Being removed: its extents move off, nothing new goes there.
    leaving: AtomicBool,
    /// Out of the set: removed or forgotten. Its entry stays (requests may
    /// still hold a reference), closed.
    retired: AtomicBool,
}

impl Standing {
    pub fn leaving(&self) -> bool {
        self.leaving.load(Ordering::Acquire)
    }

    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }
}

/// Membership's bookkeeping beside the set: what follows the lab (the
/// donors file, discovery) and recent departures, for status.
#[derive(Default)]
pub(crate) struct Book {
    /// The donors file as last parsed: its text, and each donor with its
    /// line.
    pub file: Option<(String, Vec<(usize, DonorSpec)>)>,
    /// A text of the donors file other than the one last parsed, read at
    /// the last epoch: taken if the next epoch reads it again.
    pub file_changing: Option<String>,
    /// Why the donors file was not taken, if it was not.
    pub file_error: Option<String>,
    /// Why a change it asks for could not be made yet (retried each epoch).
    pub file_pending: Option<String>,
    /// The latest departures, newest last.
    pub left: Vec<LeftDonor>,
    /// Announced donors not in the set, by node id, and why not.
    pub not_admitted: BTreeMap<String, String>,
    /// Announced donors whose records are past their lease, by node id.
    pub expired: BTreeMap<String, String>,
    /// Why discovery is not running, if it was asked for and is not.
    pub discovery_error: Option<String>,
}

/// Every donor the running device knows, in entries that never move or get
/// reused: a request borrows a donor without taking a lock while the set
/// changes (a join appends an entry, a retirement closes one).
struct DonorTable {
    entries: Box<[OnceLock<Box<Donor>>]>,
    len: AtomicUsize,
    /// Map donor id -> entry + 1 of the donor in the set under that id (0:
    /// none).
    by_id: Box<[AtomicU32]>,
}

/// The device's donor set; see the module documentation.
pub(crate) struct Membership {
    table: DonorTable,
    /// Held by every change of the set, and by placement from its choice
    /// to its slots.
    set: Mutex<()>,
    book: Mutex<Book>,
}

/// The set's lock, held: what changes it, and what placement holds while
/// it chooses donors and takes their slots.
pub(crate) struct Change<'a> {
    _held: MutexGuard<'a, ()>,
    table: &'a DonorTable,
}

impl Membership {
    pub fn new(book: Book) -> Membership {
        Membership {
            table: DonorTable {
                entries: (0..MAX_DONOR_ENTRIES).map(|_| OnceLock::new()).collect(),
                len: AtomicUsize::new(0),
                by_id: (0..MAP_IDS).map(|_| AtomicU32::new(0)).collect(),
            },
            set: Mutex::new(()),
            book: Mutex::new(book),
        }
    }

    /// Takes the set's lock. Never held across network I/O: a join
    /// connects and checks the donor's export between two holds.
    pub fn change(&self) -> Change<'_> {
        Change {
            _held: self.set.lock_or_recover(),
            table: &self.table,
        }
    }

    pub fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock_or_recover()
    }

    /// Entries so far, retired ones included (frequencies are indexed by
    /// entry).
    pub fn len(&self) -> usize {
        self.table.len.load(Ordering::Acquire)
    }

    /// Every entry, retired ones included.
    pub fn all(&self) -> impl Iterator<Item = &Donor> {
        (0..self.len()).map(|i| &self[i])
    }

    /// The donors in the set (not retired).
    pub fn iter(&self) -> impl Iterator<Item = &Donor> {
        self.all().filter(|d| !d.is_retired())
    }

    /// The entry of the donor in the set under map id `id`.
    pub fn by_id(&self, id: u16) -> Option<usize> {
        match self.table.by_id[id as usize].load(Ordering::Acquire) {
            0 => None,
            i => Some(i as usize - 1),
        }
    }

    /// The donor in the set named `key`, or at address `key`.
    pub fn find(&self, key: &str) -> Option<&Donor> {
        self.iter()
            .find(|d| d.cfg.name == key)
            .or_else(|| self.iter().find(|d| d.cfg.address == key))
    }
}

impl std::ops::Index<usize> for Membership {
    type Output = Donor;

    fn index(&self, i: usize) -> &Donor {
        self.table.entries[i].get().expect("an entry below len")
    }
}

impl<'a> Change<'a> {
    /// Appends the donor `make` builds for the next entry; `None` when the
    /// table is full.
    fn push(&mut self, make: impl FnOnce(usize) -> Donor) -> Option<&'a Donor> {
        let t = self.table;
        let i = t.len.load(Ordering::Acquire);
        let d = t.entries.get(i)?.get_or_init(|| Box::new(make(i)));
        t.by_id[d.id as usize].store(i as u32 + 1, Ordering::Release);
        t.len.store(i + 1, Ordering::Release);
        Some(d)
    }

    fn set_leaving(&mut self, d: &Donor) {
        d.standing.leaving.store(true, Ordering::Release);
    }

    /// Takes `d` out of the set: nothing finds it by its map id any more.
    fn retire(&mut self, d: &Donor) {
        d.standing.retired.store(true, Ordering::Release);
        let _ = self.table.by_id[d.id as usize].compare_exchange(
            d.idx as u32 + 1,
            0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        d.pool.close();
    }
}

pub(crate) fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

pub(crate) fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn refuse(reason: String) -> DeviceError {
    DeviceError::Membership(reason)
}

impl Inner {
    fn record(
        &self,
        joined: Joined,
        since_unix: u64,
        state: MemberState,
        c: &DonorConfig,
    ) -> MemberRecord {
        MemberRecord {
            joined,
            since_unix,
            state,
            config: serde_json::to_string(c).expect("a donor configuration encodes"),
        }
    }

    /// Builds donor `c`'s entry in the set (not yet connected).
    fn push_donor<'a>(
        &'a self,
        set: &mut Change<'a>,
        c: DonorConfig,
        id: u16,
        joined: (Joined, u64),
    ) -> Result<&'a Donor> {
        // The TLS key file doubles as the status endpoint's key: donors
        // started with psk= answer only signed requests.
        let key = c
            .tls_psk_file
            .as_deref()
            .map(|f| netpager_proto::LabKey::from_psk_file(f, None))
            .transpose()
            .map_err(|source| DeviceError::StatusKey {
                donor: c.name.clone(),
                source,
            })?;
        let status_client = netpager_proto::StatusClient {
            timeout: Duration::from_millis(self.cfg.timeouts.connect_ms),
            key,
        };
        let ep = self.cfg.endpoint(&c, self.session.number);
        let (timeouts, conns) = (
            self.cfg.nbd_timeouts(),
            self.cfg.connections_per_donor as usize,
        );
        // A device's exports carry its session: each round of connections
        // gets a number too, so the donor refuses what is left queued on
        // connections this process gave up on.
        let rounds = self.cfg.device_id.is_some().then(|| self.rounds.clone());
        let expected_label = Arc::new(Mutex::new(self.map.donor_label(id)));
        let check = super::transient::label_check(expected_label.clone());
        set.push(|idx| {
            let pool = Pool::new(idx, ep, timeouts, conns).verified(check);
            let pool = match rounds {
                Some(r) => pool.numbered(r),
                None => pool,
            };
            Donor::new(idx, id, c, joined, pool, expected_label, status_client)
        })
            .ok_or_else(|| {
                refuse(format!(
                    "this serving process has known {MAX_DONOR_ENTRIES} donors since it started, its most: restart it (pagerctl detach and attach) to add more"
                ))
            })
    }

    /// At open: the configuration's donors (joined at attach) and the
    /// donors the journal says joined later, less those it says left.
    pub(crate) fn join_initial_donors(&self) -> Result<()> {
        let before = self.map.donor_entries();
        let now = unix_now();
        let mut set = self.members.change();
        for c in &self.cfg.donors {
            let id = self.map.donor_id(&c.name)?;
            let member = before.get(id as usize).and_then(|e| e.member.clone());
            let joined = match &member {
                Some(m) if m.state.left() => {
                    tracing::warn!(
                        "donor {} is in device.toml but left the set ({} at {}): not used; `pagerctl donor-add` brings it back",
                        c.name,
                        m.joined,
                        m.since_unix
                    );
                    continue;
                }
                Some(m) => (m.joined, m.since_unix),
                None => {
                    self.map.set_donor_member(
                        id,
                        self.record(Joined::Attach, now, MemberState::Member, c),
                    )?;
                    (Joined::Attach, now)
                }
            };
            let d = self.push_donor(&mut set, c.clone(), id, joined)?;
            if member.is_some_and(|m| m.state == MemberState::Leaving) {
                set.set_leaving(d);
            }
        }
        for (id, e) in before.iter().enumerate() {
            let Some(m) = &e.member else { continue };
            if m.state.left() || self.cfg.donors.iter().any(|c| c.name == e.name) {
                continue;
            }
            let id = id as u16;
            if m.joined == Joined::Attach {
                // Re-attached with another donor list: its copies are lost
                // (forget_unconfigured_donors), as before live membership.
                tracing::warn!(
                    "donor {} is no longer in device.toml: its copies are lost",
                    e.name
                );
                let mut gone = m.clone();
                gone.state = MemberState::Gone;
                gone.since_unix = now;
                self.map.set_donor_member(id, gone)?;
                continue;
            }
            let c: DonorConfig = match serde_json::from_str(&m.config) {
                Ok(c) => c,
                Err(err) => {
                    tracing::error!(
                        "donor {}: its journaled configuration does not parse ({err}); not used, its copies are lost",
                        e.name
                    );
                    continue;
                }
            };
            let d = self.push_donor(&mut set, c, id, (m.joined, m.since_unix))?;
            if m.state == MemberState::Leaving {
                set.set_leaving(d);
            }
        }
        Ok(())
    }

    /// Adds donor `c` to the set: its export checked (a member's under
    /// another address, or another device's, is refused), journaled,
    /// polled from the next epoch (run at once). With `reachable`, a donor
    /// that cannot be reached is not added.
    pub(crate) fn add_member(
        &self,
        c: DonorConfig,
        how: Joined,
        reachable: bool,
    ) -> Result<&Donor> {
        let (d, id, now) = {
            let mut set = self.members.change();
            if let Some(d) = self.members.find(&c.name) {
                return Err(refuse(format!(
                    "donor {} is already a member ({} since {})",
                    c.name, d.joined, d.joined_unix
                )));
            }
            if let Some(d) = self.members.iter().find(|d| d.cfg.address == c.address) {
                return Err(refuse(format!(
                    "{} is already a member as donor {}",
                    c.address, d.cfg.name
                )));
            }
            netpager_util::HostPort::parse(&c.address)
                .map_err(|e| refuse(format!("donor {}: address {}: {e}", c.name, c.address)))?;
            let id = self.map.donor_id(&c.name)?;
            let now = unix_now();
            // In the set from now on (so a second join of its name is
            // refused), but not connected: placement passes it by.
            (self.push_donor(&mut set, c, id, (how, now))?, id, now)
        };
        // Connected and its export checked without the lock: that may wait
        // out a timeout.
        let attached = self.try_attach(d);
        // Why, in words an admin acts on (status shows it too); probed
        // before the set lock is taken, since that may wait out a timeout.
        let words = match &attached {
            Err(AttachFail::Unreachable(_)) => match crate::probe::check(&self.cfg, &d.cfg) {
                Err(p @ crate::probe::Problem::Unreachable(_)) => Some(p.to_string()),
                _ => None,
            },
            _ => None,
        };
        let mut set = self.members.change();
        match attached {
            Ok(()) => {}
            Err(AttachFail::Moved(i)) => {
                // A member failed away at its old address, found here with
                // our data: it moves, keeping its name and copies.
                set.retire(d);
                let old = &self.members[i];
                let mut moved = old.cfg.clone();
                moved.address.clone_from(&d.cfg.address);
                moved.status.clone_from(&d.cfg.status);
                let m = self.push_donor(&mut set, moved, old.id, (old.joined, old.joined_unix))?;
                self.map.set_donor_member(
                    old.id,
                    self.record(old.joined, old.joined_unix, MemberState::Member, &m.cfg),
                )?;
                self.succeed(old, m);
                set.retire(old);
                drop(set);
                tracing::warn!(
                    "donor {} moved from {} to {}: taking it back there",
                    m.cfg.name,
                    old.cfg.address,
                    m.cfg.address
                );
                self.revive(m);
                self.write_status();
                return Ok(m);
            }
            Err(AttachFail::Refused(why)) => {
                set.retire(d);
                return Err(refuse(format!("donor {} not added: {why}", d.cfg.name)));
            }
            Err(f) if reachable => {
                set.retire(d);
                return Err(refuse(format!(
                    "donor {} cannot be used: {}",
                    d.cfg.name,
                    words.as_deref().unwrap_or(f.reason())
                )));
            }
            Err(AttachFail::Unlabelled(why)) => self.wait_for_label(d, why),
            Err(f) => self.fail_donor(d, words.as_deref().unwrap_or(f.reason())),
        }
        self.map
            .set_donor_member(id, self.record(how, now, MemberState::Member, &d.cfg))?;
        drop(set);
        tracing::info!(
            "donor {} ({}) joined ({how}){}",
            d.cfg.name,
            d.cfg.address,
            if d.is_failed() {
                "; not reachable yet, retried every epoch"
            } else {
                ""
            }
        );
        self.epoch_wake.notify();
        // Status shows it at once, not at the next maintenance pass.
        self.write_status();
        Ok(d)
    }

    /// Starts removing donor `key` (name or address): nothing new goes
    /// there, the maintenance thread moves its extents off, then it leaves
    /// the set. Refused when the mode could not place a unit without it.
    pub(crate) fn remove_member(&self, key: &str) -> Result<&Donor> {
        let mut set = self.members.change();
        let d = self.members.find(key).ok_or_else(|| {
            let names: Vec<&str> = self.members.iter().map(|d| d.cfg.name.as_str()).collect();
            refuse(format!(
                "no donor named or at {key:?} (members: {})",
                names.join(", ")
            ))
        })?;
        if d.is_leaving() {
            return Ok(d);
        }
        let healthy_others = self
            .members
            .iter()
            .filter(|o| o.idx != d.idx && !o.is_failed() && !o.is_leaving())
            .count();
        let need = self.layout.members();
        // A dead donor's pages are rebuilt elsewhere anyway: letting it go
        // costs nothing.
        if !d.is_failed() && healthy_others < need {
            return Err(refuse(format!(
                "mode {} keeps each {} on {need} distinct donors; without {} only {healthy_others} healthy donors are left: add one first (pagerctl donor-add)",
                self.cfg.mode.word(),
                if self.layout.mode.striped() { "group" } else { "extent's copies" },
                d.cfg.name
            )));
        }
        self.map.set_donor_member(
            d.id,
            self.record(d.joined, d.joined_unix, MemberState::Leaving, &d.cfg),
        )?;
        set.set_leaving(d);
        drop(set);
        tracing::info!(
            "donor {} is leaving: moving its extents to the other donors",
            d.cfg.name
        );
        self.maint_wake.notify();
        self.write_status();
        Ok(d)
    }

    /// Takes donor `d` out of the set for good, journaled, and says so;
    /// `set` is the set's lock, held.
    fn let_go(&self, set: &mut Change<'_>, d: &Donor, why: &str) {
        let state = if why == "removed" {
            MemberState::Removed
        } else {
            MemberState::Gone
        };
        let m = self.record(d.joined, unix_now(), state, &d.cfg);
        if let Err(e) = self.map.set_donor_member(d.id, m) {
            tracing::error!("journaling donor {}'s departure: {e}", d.cfg.name);
            return;
        }
        set.retire(d);
        self.map.forget_donor_slots(d.id);
        let mut book = self.members.book();
        book.left.push(LeftDonor {
            name: d.cfg.name.clone(),
            address: d.cfg.address.clone(),
            joined: d.joined,
            left_unix: unix_now(),
            why: why.to_string(),
        });
        let excess = book.left.len().saturating_sub(LEFT_KEPT);
        book.left.drain(..excess);
    }

    /// Maintenance: leaving donors that hold nothing any more leave the
    /// set; donors dead longer than `forget_after` are forgotten.
    pub(crate) fn settle_membership(&self) {
        let mut changed = false;
        let held = |d: &Donor| self.map.slot_usage(SlotOwner::Donor(d.id)).0;
        for d in self.members.iter() {
            if held(d) != 0 {
                continue;
            }
            if d.is_leaving() {
                // Its label goes first, outside the lock (a round trip);
                // a leaving donor is never given a slot, so it stays empty.
                if !d.is_failed() {
                    if let Err(e) = self.drop_label(d) {
                        tracing::warn!("donor {}: {e}", d.cfg.name);
                    }
                }
                let mut set = self.members.change();
                if held(d) != 0 || d.is_retired() {
                    continue;
                }
                tracing::info!(
                    "donor {} removed: nothing of ours is left on it",
                    d.cfg.name
                );
                let why = if d.joined == Joined::File {
                    "file"
                } else {
                    "removed"
                };
                self.let_go(&mut set, d, why);
                changed = true;
                continue;
            }
            let forget_after = Duration::from_millis(self.cfg.forget_after_ms);
            let dead_for = {
                let h = d.health();
                h.marked
                    .then_some(h.failed_at)
                    .flatten()
                    .map(|t| t.elapsed())
            };
            if self.cfg.forget_after_ms > 0
                && d.is_failed()
                && dead_for.is_some_and(|t| t >= forget_after)
            {
                tracing::warn!(
                    "donor {} forgotten: dead for {}s ({})",
                    d.cfg.name,
                    dead_for.unwrap_or_default().as_secs(),
                    d.health().failure.clone().unwrap_or_default()
                );
                let mut set = self.members.change();
                if held(d) == 0 && !d.is_retired() {
                    self.let_go(&mut set, d, "forgotten");
                    changed = true;
                }
            }
        }
        if changed {
            self.write_status();
        }
    }
}
