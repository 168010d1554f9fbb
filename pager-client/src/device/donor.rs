//! One donor as the device sees it: its connection pool, health, last
//! reported status and counters; attaching, labelling and reviving it; and
//! the table of every donor the running device knows.
//!
//! Calls: the NBD pools (`netpager-nbd`), the donors' status endpoints;
//! called by `open`, the epoch thread and membership.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use netpager_proto::{DonorStatus, StatusClient, StatusSession};
use netpager_util::{LockExt, RwLockExt};

use super::{Inner, Result};
use crate::config::DonorConfig;
use crate::extent_map::{CopyState, SlotOwner};
use netpager_membership::Joined;
use netpager_nbd::{Endpoint, Op, Pool, Timeouts};

/// Bytes at the start of slot 0 that name the incarnation of our export.
pub(crate) const LABEL_BYTES: usize = 4096;
const LABEL_MAGIC: &[u8; 16] = b"NETPAGER-LABEL01";

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
    /// Being removed: its extents move off, nothing new goes there.
    pub leaving: AtomicBool,
    /// Out of the set: removed or forgotten. Its entry stays (requests may
    /// still hold a reference), closed.
    pub retired: AtomicBool,
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
}

impl Donor {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        idx: usize,
        id: u16,
        cfg: DonorConfig,
        (joined, joined_unix): (Joined, u64),
        ep: Endpoint,
        timeouts: Timeouts,
        conns: usize,
        status_client: StatusClient,
    ) -> Donor {
        Donor {
            idx,
            id,
            cfg,
            joined,
            joined_unix,
            leaving: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            // Entries are never reused, so no two pools share an order.
            pool: Pool::new(idx, ep, timeouts, conns),
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
        }
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub fn is_leaving(&self) -> bool {
        self.leaving.load(Ordering::Acquire)
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
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

/// Donor entries one serving process can hold over its life (a donor that
/// is removed and joins again takes a new one).
pub(crate) const MAX_DONOR_ENTRIES: usize = 4096;
/// Map donor ids are `u16`.
const MAP_IDS: usize = 1 << 16;

/// Every donor the running device knows, in entries that never move or get
/// reused: a request borrows a donor without taking a lock, while the set
/// changes (a join appends an entry, a removal retires one).
pub(crate) struct DonorTable {
    entries: Box<[OnceLock<Box<Donor>>]>,
    len: AtomicUsize,
    /// Map donor id -> entry + 1 of the donor in the set under that id (0:
    /// none).
    by_id: Box<[AtomicU32]>,
    /// Serialises appends.
    grow: Mutex<()>,
}

impl DonorTable {
    pub fn new() -> DonorTable {
        DonorTable {
            entries: (0..MAX_DONOR_ENTRIES).map(|_| OnceLock::new()).collect(),
            len: AtomicUsize::new(0),
            by_id: (0..MAP_IDS).map(|_| AtomicU32::new(0)).collect(),
            grow: Mutex::new(()),
        }
    }

    /// Entries so far, retired ones included (frequencies are indexed by
    /// entry).
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
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
        match self.by_id[id as usize].load(Ordering::Acquire) {
            0 => None,
            i => Some(i as usize - 1),
        }
    }

    /// Appends the donor `make` builds for the next entry; `None` when the
    /// table is full.
    pub fn push(&self, make: impl FnOnce(usize) -> Donor) -> Option<&Donor> {
        let _g = self.grow.lock_or_recover();
        let i = self.len();
        let slot = self.entries.get(i)?;
        let d = slot.get_or_init(|| Box::new(make(i)));
        self.by_id[d.id as usize].store(i as u32 + 1, Ordering::Release);
        self.len.store(i + 1, Ordering::Release);
        Some(d)
    }

    /// Takes `d` out of the set: nothing finds it by its map id any more.
    pub fn retire(&self, d: &Donor) {
        d.retired.store(true, Ordering::Release);
        let _ = self.by_id[d.id as usize].compare_exchange(
            d.idx as u32 + 1,
            0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        d.pool.close();
    }
}

impl std::ops::Index<usize> for DonorTable {
    type Output = Donor;

    fn index(&self, i: usize) -> &Donor {
        self.entries[i].get().expect("an entry below len")
    }
}

fn encode_label(label: u128) -> Vec<u8> {
    let mut b = vec![0u8; LABEL_BYTES];
    b[..16].copy_from_slice(LABEL_MAGIC);
    b[16..32].copy_from_slice(&label.to_le_bytes());
    let crc = crate::extent_map::crc32(&b[..32]);
    b[32..36].copy_from_slice(&crc.to_le_bytes());
    b
}

fn decode_label(b: &[u8]) -> Option<u128> {
    if &b[..16] != LABEL_MAGIC || crate::extent_map::crc32(&b[..32]).to_le_bytes() != b[32..36] {
        return None;
    }
    Some(u128::from_le_bytes(b[16..32].try_into().ok()?))
}

/// A random, non-zero label.
fn new_label() -> u128 {
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(1);
    (u128::from_le_bytes(b) ^ t ^ u128::from(std::process::id())).max(1)
}

impl Inner {
    /// Marks donor `d` failed: no more requests go to it, the maintenance
    /// thread marks its copies lost and rebuilds them elsewhere.
    pub(crate) fn fail_donor(&self, d: &Donor, reason: &str) {
        d.errors.fetch_add(1, Ordering::Relaxed);
        if d.failed.swap(true, Ordering::AcqRel) {
            return;
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

    /// Connects to donor `d` at startup and checks that its export still
    /// holds our data (its label matches the map); a donor that lost it is
    /// failed at once, a donor without our data is cleared. True when the
    /// donor answered but lost our data (it restarted).
    pub(crate) fn attach(&self, d: &Donor) -> bool {
        match self.try_attach(d) {
            Ok(()) => false,
            Err((reason, answered)) => {
                self.fail_donor(d, &reason);
                answered
            }
        }
    }

    /// Attaches `d`; on failure, why and whether the donor answered.
    fn try_attach(&self, d: &Donor) -> std::result::Result<(), (String, bool)> {
        let unreachable = |e: netpager_nbd::NbdError| (e.to_string(), false);
        let mut lease = d.pool.checkout().map_err(unreachable)?;
        let size = lease.size();
        let expected = self.map.donor_label(d.id);
        if expected != 0 {
            let mut b = vec![0u8; LABEL_BYTES];
            lease.run(0, Op::Read(&mut b)).map_err(unreachable)?;
            if decode_label(&b) != Some(expected) {
                drop(lease);
                return Err((
                    format!(
                        "its export {:?} no longer holds our data (label mismatch: the donor restarted or lost its memory)",
                        d.pool.endpoint().export
                    ),
                    true,
                ));
            }
            drop(lease);
            self.set_capacity(d, size, false);
        } else {
            let cleared = clear_export(&mut lease, size).map_err(unreachable)?;
            drop(lease);
            self.set_capacity(d, size, cleared);
        }
        d.attached.store(true, Ordering::Release);
        Ok(())
    }

    fn set_capacity(&self, d: &Donor, size: u64, cleared: bool) {
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

    /// After its copies were marked lost: reconnect a failed donor as a new
    /// one (its export is cleared, its old pages never trusted).
    pub(crate) fn revive(&self, d: &Donor) {
        if d.is_retired() || !d.is_failed() || !d.health().marked {
            return;
        }
        d.pool.reopen();
        let res = d
            .pool
            .checkout()
            .map_err(|e| e.to_string())
            .and_then(|mut lease| {
                let size = lease.size();
                let cleared = clear_export(&mut lease, size).map_err(|e| e.to_string())?;
                Ok((size, cleared))
            });
        match res {
            Ok((size, cleared)) => {
                self.set_capacity(d, size, cleared);
                d.full.store(false, Ordering::Release);
                d.attached.store(true, Ordering::Release);
                {
                    let mut h = d.health();
                    h.failure = None;
                    h.failed_at = None;
                }
                d.failed.store(false, Ordering::Release);
                tracing::info!(
                    "donor {} ({}) is back; using it as a new donor",
                    d.cfg.name,
                    d.cfg.address
                );
            }
            Err(e) => {
                d.pool.close();
                tracing::debug!("donor {} still unreachable: {e}", d.cfg.name);
            }
        }
    }

    /// Marks every copy on failed donors lost, forgets their slots and
    /// labels. Runs on the maintenance thread (and once at open).
    pub(crate) fn mark_failed_donors(&self) {
        for d in self
            .donors
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
            self.map.forget_donor_slots(d.id);
            if self.map.donor_label(d.id) != 0 {
                if let Err(e) = self.map.set_donor_label(d.id, 0) {
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

    /// Writes a new label on donor `d` before its first extent.
    pub(crate) fn ensure_label(&self, d: &Donor) -> Result<()> {
        // Labelled already (the usual case): no need to wait behind a
        // labelling round trip.
        if self.map.donor_label(d.id) != 0 {
            return Ok(());
        }
        let _g = d.label_lock.lock_or_recover();
        if self.map.donor_label(d.id) != 0 {
            return Ok(());
        }
        let label = new_label();
        let b = encode_label(label);
        let res = d.pool.checkout().and_then(|mut l| l.run(0, Op::Write(&b)));
        match res {
            Ok(()) => {
                self.map.set_donor_label(d.id, label)?;
                Ok(())
            }
            Err(e) => {
                if e.is_no_space() {
                    d.full.store(true, Ordering::Release);
                } else {
                    self.fail_donor(d, &e.to_string());
                }
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
        let _g = d.label_lock.lock_or_recover();
        if self.map.donor_label(d.id) == 0 {
            return Ok(());
        }
        self.map.set_donor_label(d.id, 0)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip_and_reject_garbage() {
        let l = new_label();
        assert_ne!(l, 0);
        assert_eq!(decode_label(&encode_label(l)), Some(l));
        assert_eq!(decode_label(&vec![0u8; LABEL_BYTES]), None);
        let mut b = encode_label(l);
        b[20] ^= 1;
        assert_eq!(decode_label(&b), None);
    }
}
