//! One backend per mode family, chosen once when the device opens (as
//! Ceph's OSD picks `ReplicatedBackend` or `ECBackend` when a pool opens):
//! the replicated backend (modes none, mirror, disk: every member a full
//! copy; owns the write-through file and the mirror read turn, code in
//! `replica`) and the striped backend (modes parity, ec: groups with
//! parity; owns the parity log, the codecs and the zero-page set, code in
//! `stripe`). What every mode shares (map, donors, epoch, placement,
//! maintenance) stays in [`Inner`], which calls its backend here for
//! reads, modifications, a member's contents (rebuild, drain), resync and
//! the backend's share of maintenance.
//!
//! An enum, not a `dyn` trait: two arms known at compile time, dispatched
//! statically with no box and no vtable, so the request path stays free of
//! allocations and indirect calls.

use std::sync::atomic::AtomicUsize;

use super::io::CodecPool;
use super::maintenance::Moving;
use super::stripe::log::ParityLog;
use super::writethrough::WriteThrough;
use super::{DeviceError, Inner, Payload, Result};
use crate::config::{DeviceConfig, Mode};
use crate::extent_map::{ExtentMap, Layout, Redundancy};
use crate::page_log::PAGE;
use crate::zero_pages::ZeroPages;
use netpager_util::RwLockExt;

/// Modes none, mirror and disk.
pub(crate) struct ReplicatedBackend {
    /// Mode disk's local copy.
    pub(crate) wt: Option<WriteThrough>,
    /// Alternates mirror reads between copies.
    pub(crate) read_turn: AtomicUsize,
}

/// Modes parity and ec.
pub(crate) struct StripedBackend {
    /// The parity log, when the layout has one.
    pub(crate) plog: Option<ParityLog>,
    /// Codecs of the groups.
    pub(crate) codecs: CodecPool,
    /// Pages known to read as zeros, so a group trimmed piece by piece is
    /// freed once nothing in it is left.
    pub(crate) zero_pages: ZeroPages,
}

// One per device, in the `Arc`'d `Inner`: the replicated arm's unused
// bytes cost nothing, a box would cost every striped request a pointer.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Backend {
    Replicated(ReplicatedBackend),
    Striped(StripedBackend),
}

impl Backend {
    /// The backend of `cfg`'s mode, its state built from the map.
    pub(crate) fn open(cfg: &DeviceConfig, layout: Layout, map: &ExtentMap) -> Result<Backend> {
        if !layout.mode.striped() {
            let wt = match &cfg.mode {
                Mode::Disk { path, queue } => {
                    Some(WriteThrough::open(path, layout.size, queue.0 as usize)?)
                }
                _ => None,
            };
            return Ok(Backend::Replicated(ReplicatedBackend {
                wt,
                read_turn: AtomicUsize::new(0),
            }));
        }
        // The parity log owns the page table the map replayed.
        let plog = map.take_log_table().map(|table| {
            let placed: Vec<bool> = (0..table.geometry().units)
                .map(|lu| map.unit(layout.log_unit(lu)).read_or_recover().is_some())
                .collect();
            ParityLog::new(
                table,
                layout.members(),
                &placed,
                cfg.connections_per_donor as usize,
            )
        });
        let (k, r) = (layout.data_per_unit() as usize, layout.parity_count());
        // Log leaders, plus the threads that rebuild and read degraded.
        let n = cfg.connections_per_donor as usize + 2;
        let xor = matches!(layout.mode, Redundancy::Parity { .. });
        let codecs = CodecPool::new(n, k, r, xor).map_err(|source| DeviceError::Code {
            mode: cfg.mode.word(),
            source,
        })?;
        Ok(Backend::Striped(StripedBackend {
            plog,
            codecs,
            zero_pages: ZeroPages::new(layout.size.div_ceil(PAGE)),
        }))
    }
}

impl Inner {
    /// The striped backend's state; `None` in a replicated mode.
    pub(crate) fn striped(&self) -> Option<&StripedBackend> {
        match &self.backend {
            Backend::Striped(s) => Some(s),
            Backend::Replicated(_) => None,
        }
    }

    /// Mode disk's write-through file.
    pub(crate) fn wt(&self) -> Option<&WriteThrough> {
        match &self.backend {
            Backend::Replicated(r) => r.wt.as_ref(),
            Backend::Striped(_) => None,
        }
    }

    /// The parity log, if the device has one.
    pub(crate) fn parity_log(&self) -> Option<&ParityLog> {
        self.striped().and_then(|s| s.plog.as_ref())
    }

    /// A read from the donors (the prefetch thread's too).
    pub(crate) fn read_device(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match &self.backend {
            Backend::Striped(_) => self.read_striped(buf, offset),
            Backend::Replicated(rb) => self.pieces(offset, buf.len() as u64, |e, in_off, at, n| {
                self.read_replica(rb, e, in_off, &mut buf[at as usize..(at + n) as usize])
            }),
        }
    }

    /// A write, zero or trim, once the range is checked and lost units
    /// replaced.
    pub(crate) fn modify_device(&self, offset: u64, p: Payload<'_>) -> Result<()> {
        let rb = match &self.backend {
            Backend::Striped(_) => {
                return match p {
                    Payload::Data(d) => self.write_parity_range(offset, d),
                    // Group by group: a trim that covers a whole group
                    // frees it without zeroing its extents one by one first.
                    Payload::Trim(n) => self.trim_striped(offset, n),
                    Payload::Zero(n) => {
                        self.pieces(offset, n, |e, in_off, _, n| self.zero_parity(e, in_off, n))
                    }
                };
            }
            Backend::Replicated(rb) => rb,
        };
        self.pieces(offset, p.len(), |e, in_off, at, n| {
            let piece = match p {
                Payload::Data(d) => Payload::Data(&d[at as usize..(at + n) as usize]),
                Payload::Zero(_) => Payload::Zero(n),
                Payload::Trim(_) => Payload::Trim(n),
            };
            self.modify_replica(rb, e, in_off, piece)
        })
    }

    /// What member `j` of unit `u` should hold, into `out` (one extent):
    /// for a rebuild, a drain or a move off a full donor.
    pub(crate) fn member_content(&self, mv: &Moving, out: &mut [u8], tmp: &mut [u8]) -> Result<()> {
        match &self.backend {
            Backend::Striped(_) => self.stripe_member_content(mv, out, tmp),
            Backend::Replicated(rb) => self.replica_member_content(rb, mv, out),
        }
    }

    /// At open, before anything reads: groups a crash left open get their
    /// parity recomputed.
    pub(crate) fn resync_at_open(&self) -> Result<()> {
        match &self.backend {
            Backend::Striped(_) => self.resync_open_groups(),
            Backend::Replicated(_) => Ok(()),
        }
    }

    /// The backend's share of a maintenance pass: the parity log's cleaner
    /// and idle drain, and the write intents' sweep.
    pub(crate) fn maintain_backend(&self) {
        if let Backend::Striped(_) = &self.backend {
            self.clean_parity_log();
            self.drain_idle_log();
            self.sweep_write_intents();
        }
    }
}
