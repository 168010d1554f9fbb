//! The map's geometry: how the device's extents group into units, and
//! where each member of a unit lives.

use crate::config::DeviceConfig;
use crate::page_table::{LogGeometry, PAGE};

/// Redundancy of the map's units: the config's mode without its paths
/// ([`Mode::redundancy`]). Every property of a mode that does not depend
/// on a path (its word, its widths, the donors it needs) is asked here, so
/// a new mode is one arm in [`Mode::redundancy`] and one in each match
/// below.
///
/// [`Mode::redundancy`]: crate::config::Mode::redundancy
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redundancy {
    None,
    Mirror,
    Parity {
        width: u32,
    },
    Disk,
    /// Reed-Solomon stripes of `data` data and `parity` parity extents.
    Ec {
        data: u32,
        parity: u32,
    },
}

impl Redundancy {
    /// The map header's encoding (`record.rs`): fixed, maps on disk use it.
    pub(super) fn code(self) -> (u8, u32) {
        match self {
            Redundancy::None => (0, 1),
            Redundancy::Mirror => (1, 2),
            Redundancy::Parity { width } => (2, width),
            Redundancy::Disk => (3, 1),
            Redundancy::Ec { data, parity } => (4, data | parity << 16),
        }
    }

    /// The inverse of [`Redundancy::code`]; `None` for an unknown mode.
    pub(super) fn from_code(mode: u8, arg: u32) -> Option<Redundancy> {
        Some(match mode {
            0 => Redundancy::None,
            1 => Redundancy::Mirror,
            2 => Redundancy::Parity { width: arg },
            3 => Redundancy::Disk,
            4 => Redundancy::Ec {
                data: arg & 0xffff,
                parity: arg >> 16,
            },
            _ => return None,
        })
    }

    /// The word used in status and logs.
    pub fn word(self) -> &'static str {
        match self {
            Redundancy::None => "none",
            Redundancy::Mirror => "mirror",
            Redundancy::Parity { .. } => "parity",
            Redundancy::Disk => "disk",
            Redundancy::Ec { .. } => "ec",
        }
    }

    /// Striped into groups of data and parity extents (parity, ec).
    pub fn striped(self) -> bool {
        matches!(self, Redundancy::Parity { .. } | Redundancy::Ec { .. })
    }

    /// Data extents per unit: a group's `k`, else 1.
    pub fn data_members(self) -> u64 {
        match self {
            Redundancy::Parity { width } => u64::from(width.saturating_sub(1)),
            Redundancy::Ec { data, .. } => u64::from(data),
            Redundancy::None | Redundancy::Mirror | Redundancy::Disk => 1,
        }
    }

    /// Parity extents per group (0 when not striped).
    pub fn parity_members(self) -> usize {
        match self {
            Redundancy::Parity { .. } => 1,
            Redundancy::Ec { parity, .. } => parity as usize,
            Redundancy::None | Redundancy::Mirror | Redundancy::Disk => 0,
        }
    }

    /// Members a fully placed unit has: distinct donors it needs.
    pub fn members(self) -> usize {
        match self {
            Redundancy::None | Redundancy::Disk => 1,
            Redundancy::Mirror => 2,
            Redundancy::Parity { width } => width as usize,
            Redundancy::Ec { data, parity } => (data + parity) as usize,
        }
    }
}

/// Geometry of the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub size: u64,
    pub extent: u64,
    pub mode: Redundancy,
    /// Parity log units after the home groups (0: no parity log).
    pub log_units: u64,
}

impl Layout {
    pub fn from_config(cfg: &DeviceConfig) -> Layout {
        let mode = cfg.mode.redundancy();
        let mut layout = Layout {
            size: cfg.size.0,
            extent: cfg.extent_size.0,
            mode,
            log_units: 0,
        };
        let per_log_unit = layout.extent * layout.data_per_unit();
        if mode.striped() {
            layout.log_units = cfg.parity_log_bytes().div_ceil(per_log_unit);
        }
        layout
    }

    pub fn extents(&self) -> u64 {
        self.size.div_ceil(self.extent)
    }

    /// Data extents per unit.
    pub fn data_per_unit(&self) -> u64 {
        self.mode.data_members()
    }

    /// Units holding the device's extents (groups in modes parity and ec).
    pub fn home_units(&self) -> u64 {
        self.extents().div_ceil(self.data_per_unit())
    }

    /// Every unit: the home units, then the parity log's units.
    pub fn units(&self) -> u64 {
        self.home_units() + self.log_units
    }

    /// The parity log's shape, if there is one.
    pub fn log_geometry(&self) -> Option<LogGeometry> {
        (self.log_units > 0).then(|| LogGeometry {
            units: self.log_units,
            rows: (self.extent / PAGE) as u32,
            cols: self.data_per_unit() as u32,
        })
    }

    /// The map unit of log unit `lu`.
    pub fn log_unit(&self, lu: u64) -> u64 {
        self.home_units() + lu
    }

    /// Members a fully placed unit has.
    pub fn members(&self) -> usize {
        self.mode.members()
    }

    /// Parity extents per group (0 when not striped).
    pub fn parity_count(&self) -> usize {
        self.mode.parity_members()
    }

    /// Position of group `unit`'s first parity extent; the others follow
    /// it, wrapping (RAID-5/6 rotation, so parity work spreads over the
    /// donors).
    pub fn parity_member(&self, unit: u64) -> usize {
        if self.mode.striped() {
            (unit % self.members() as u64) as usize
        } else {
            usize::MAX
        }
    }

    /// The code's shard index of member `pos` of group `unit`: data
    /// extents `0..k` in device order, then the parity extents `k..k + r`.
    pub fn shard_of(&self, unit: u64, pos: usize) -> usize {
        let (w, p) = (self.members(), self.parity_member(unit));
        let after_p = (pos + w - p) % w;
        let r = self.parity_count();
        if after_p < r {
            self.data_per_unit() as usize + after_p
        } else if pos < p {
            pos - (p + r).saturating_sub(w)
        } else {
            pos - r
        }
    }

    /// The member position of shard `shard` of group `unit` (inverse of
    /// [`Layout::shard_of`]).
    pub fn member_of(&self, unit: u64, shard: usize) -> usize {
        let (w, p) = (self.members(), self.parity_member(unit));
        let (k, r) = (self.data_per_unit() as usize, self.parity_count());
        if shard >= k {
            return (p + shard - k) % w;
        }
        // Data fills the positions not taken by parity, in order: those
        // before `p` (none wrapped there unless parity wraps), then after.
        let wrapped = (p + r).saturating_sub(w);
        let pos = wrapped + shard;
        if pos < p {
            pos
        } else {
            pos + r
        }
    }

    /// The unit holding `extent` and, when striped, the member position of
    /// that extent in its group (0 otherwise).
    pub fn locate(&self, extent: u64) -> (u64, usize) {
        let d = self.data_per_unit();
        let unit = extent / d;
        if self.mode.striped() {
            (unit, self.member_of(unit, (extent % d) as usize))
        } else {
            (unit, 0)
        }
    }

    /// The extent at member position `member` of group `unit`, or `None`
    /// for a parity member or past the device's end.
    pub fn extent_of(&self, unit: u64, member: usize) -> Option<u64> {
        let k = self.shard_of(unit, member);
        if k >= self.data_per_unit() as usize {
            return None;
        }
        let e = unit * self.data_per_unit() + k as u64;
        (unit < self.home_units() && e < self.extents()).then_some(e)
    }
}

/// Where one member lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Loc {
    /// Slot `slot` (byte offset `slot * extent`) of our export on map donor
    /// `donor`.
    Donor { donor: u16, slot: u32 },
    /// Slot `slot` of the local fallback file.
    Fallback { slot: u32 },
}

/// State of one member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyState {
    Ok,
    /// Its donor died or its data could not be kept; must be re-created.
    Lost,
    /// Being re-created at `loc`; not yet readable.
    Rebuilding,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Member {
    pub loc: Loc,
    pub state: CopyState,
}

/// Placement of one unit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Unit {
    pub members: Vec<Member>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ec_layout_rotates_parity_and_maps_shards_both_ways() {
        for (k, r) in [(4u32, 2u32), (2, 3), (1, 1), (6, 3)] {
            let l = Layout {
                size: 1 << 30,
                extent: 1 << 20,
                mode: Redundancy::Ec { data: k, parity: r },
                log_units: 0,
            };
            let w = (k + r) as usize;
            for u in 0..2 * w as u64 {
                let mut seen = vec![false; w];
                for pos in 0..w {
                    let sh = l.shard_of(u, pos);
                    assert!(!seen[sh], "{k}+{r} unit {u}: shard {sh} twice");
                    seen[sh] = true;
                    assert_eq!(l.member_of(u, sh), pos, "{k}+{r} unit {u} pos {pos}");
                }
                // Parity starts at the rotating position and runs on.
                for i in 0..r as usize {
                    assert_eq!(l.member_of(u, k as usize + i), (u as usize + i) % w);
                }
                for d in 0..k as u64 {
                    let e = u * k as u64 + d;
                    assert_eq!(l.extent_of(u, l.locate(e).1), Some(e));
                }
            }
        }
        // Mode parity keeps the placement older maps were written with.
        let l = Layout {
            size: 64 << 20,
            extent: 1 << 20,
            mode: Redundancy::Parity { width: 4 },
            log_units: 0,
        };
        for e in 0..60 {
            let (u, pos) = l.locate(e);
            let (k, p) = ((e % 3) as usize, (u % 4) as usize);
            assert_eq!(pos, if k < p { k } else { k + 1 });
        }
    }

    #[test]
    fn parity_layout_rotates_parity_and_maps_every_extent_once() {
        let l = Layout {
            size: 10 << 20,
            extent: 1 << 20,
            mode: Redundancy::Parity { width: 3 },
            log_units: 0,
        };
        assert_eq!(l.units(), 5);
        let mut seen = [false; 10];
        for u in 0..l.units() {
            let p = l.parity_member(u);
            assert_eq!(p, (u % 3) as usize);
            assert_eq!(l.extent_of(u, p), None);
            for m in (0..3).filter(|&m| m != p) {
                let e = l.extent_of(u, m).unwrap();
                assert_eq!(l.locate(e), (u, m));
                assert!(!seen[e as usize]);
                seen[e as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }
}
