//! One donor as the device sees it: its connection pool, health, last
//! reported status and counters; attaching, labelling and reviving it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use netpager_proto::{DonorStatus, StatusClient};
use netpager_util::{LockExt, RwLockExt};

use super::{Inner, Result};
use crate::config::DonorConfig;
use crate::extent_map::{CopyState, SlotOwner};
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
    pub idx: usize,
    /// Its id in the extent map.
    pub id: u16,
    pub cfg: DonorConfig,
    pub pool: Pool,
    /// Reads the donor's status endpoint, signing with the lab key if any.
    pub status_client: StatusClient,
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
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    /// Serialises writing a new label.
    pub label_lock: Mutex<()>,
}

impl Donor {
    pub fn new(
        idx: usize,
        id: u16,
        cfg: DonorConfig,
        ep: Endpoint,
        timeouts: Timeouts,
        conns: usize,
        status_client: StatusClient,
    ) -> Donor {
        Donor {
            idx,
            id,
            cfg,
            pool: Pool::new(idx, ep, timeouts, conns),
            status_client,
            failed: AtomicBool::new(false),
            health: Mutex::new(Health::default()),
            draining: AtomicBool::new(false),
            full: AtomicBool::new(false),
            attached: AtomicBool::new(false),
            remote: Mutex::new(Remote::default()),
            errors: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            label_lock: Mutex::new(()),
        }
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock_or_recover()
    }

    pub fn remote(&self) -> std::sync::MutexGuard<'_, Remote> {
        self.remote.lock_or_recover()
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
    /// failed at once, a donor without our data is cleared.
    pub(crate) fn attach(&self, d: &Donor) {
        if let Err(reason) = self.try_attach(d) {
            self.fail_donor(d, &reason);
        }
    }

    fn try_attach(&self, d: &Donor) -> std::result::Result<(), String> {
        let mut lease = d.pool.checkout().map_err(|e| e.to_string())?;
        let size = lease.conn().size();
        let expected = self.map.donor_label(d.id);
        if expected != 0 {
            let mut b = vec![0u8; LABEL_BYTES];
            lease.run(0, Op::Read(&mut b)).map_err(|e| e.to_string())?;
            if decode_label(&b) != Some(expected) {
                drop(lease);
                return Err(format!(
                    "its export {:?} no longer holds our data (label mismatch: the donor restarted or lost its memory)",
                    d.pool.endpoint().export
                ));
            }
            drop(lease);
            self.set_capacity(d, size, false);
        } else {
            let cleared = clear_export(&mut lease, size).map_err(|e| e.to_string())?;
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
        if !d.is_failed() || !d.health().marked {
            return;
        }
        d.pool.reopen();
        let res = d
            .pool
            .checkout()
            .map_err(|e| e.to_string())
            .and_then(|mut lease| {
                let size = lease.conn().size();
                let cleared = clear_export(&mut lease, size).map_err(|e| e.to_string())?;
                Ok((size, cleared))
            });
        match res {
            Ok((size, cleared)) => {
                self.set_capacity(d, size, cleared);
                d.full.store(false, Ordering::Release);
                d.attached.store(true, Ordering::Release);
                d.health().failure = None;
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
