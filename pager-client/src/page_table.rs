//! The parity log's page table (docs/DESIGN.md "2.2 Keeping remote pages
//! safe", parity logging): which device pages live in the log instead of at
//! home in their group, and where. Pure bookkeeping with no imports from the
//! rest of the crate: the extent map replays it at open and writes it into
//! each snapshot, the device's parity log (`device/stripe/log.rs`) owns it,
//! and everyone changes it through [`crate::page_log::LogJournal`].
//!
//! The log is a run of log units after the home groups. A log unit is laid
//! out like a home group of the device's mode (`cols` = `k` data members
//! plus `r` parity members, on distinct donors: `r` = 1 and XOR in mode
//! parity, Reed-Solomon in mode ec), but it is filled row by row: row `r`
//! is page `r` of every member, its parity pages encoded from its data
//! pages. A row holds up to `cols` pages of any part of the device,
//! written at once with their parity and no reads. A slot is one data page
//! of one row.

/// Bytes per page: the unit of logging.
pub const PAGE: u64 = 4096;

/// A data page of the log: `(log unit, row, column)` numbered densely.
pub type Slot = u32;

/// Shape of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogGeometry {
    /// Log units (0: no log).
    pub units: u64,
    /// Rows per log unit (pages per member).
    pub rows: u32,
    /// Data pages per row (`k`: the group's data members).
    pub cols: u32,
}

impl LogGeometry {
    pub fn slots(&self) -> u64 {
        self.units * self.rows as u64 * self.cols as u64
    }

    pub fn slot(&self, unit: u64, row: u32, col: u32) -> Slot {
        ((unit * self.rows as u64 + row as u64) * self.cols as u64 + col as u64) as Slot
    }

    /// `(log unit, row, column)` of a slot.
    pub fn place(&self, s: Slot) -> (u64, u32, u32) {
        let s = s as u64;
        let cols = self.cols as u64;
        let per_unit = self.rows as u64 * cols;
        (
            s / per_unit,
            ((s % per_unit) / cols) as u32,
            (s % cols) as u32,
        )
    }
}

/// Device page -> log slot, with the reverse map and live pages per unit.
/// Preallocated at open: nothing on the write path allocates.
#[derive(Debug, Clone)]
pub struct PageTable {
    geo: LogGeometry,
    /// Per device page: slot + 1, or 0 (the page is at home).
    fwd: Vec<u32>,
    /// Per slot: device page + 1, or 0 (free or garbage).
    rev: Vec<u32>,
    /// Live slots per log unit.
    live: Vec<u32>,
    logged: u64,
}

impl PageTable {
    /// A table for `pages` device pages; `None` if the log is empty or the
    /// numbers do not fit its 32-bit entries.
    pub fn new(geo: LogGeometry, pages: u64) -> Option<PageTable> {
        if geo.units == 0 || geo.slots() >= u32::MAX as u64 || pages >= u32::MAX as u64 {
            return None;
        }
        Some(PageTable {
            geo,
            fwd: vec![0; pages as usize],
            rev: vec![0; geo.slots() as usize],
            live: vec![0; geo.units as usize],
            logged: 0,
        })
    }

    pub fn geometry(&self) -> LogGeometry {
        self.geo
    }

    pub fn pages(&self) -> u64 {
        self.fwd.len() as u64
    }

    /// Pages currently in the log.
    pub fn logged(&self) -> u64 {
        self.logged
    }

    pub fn lookup(&self, page: u64) -> Option<Slot> {
        self.fwd[page as usize].checked_sub(1)
    }

    /// Live pages in log unit `unit`.
    pub fn live(&self, unit: u64) -> u32 {
        self.live[unit as usize]
    }

    /// Whether any page of `[first, first + count)` is in the log.
    pub fn any_in(&self, first: u64, count: u64) -> bool {
        self.logged > 0
            && self.fwd[first as usize..(first + count) as usize]
                .iter()
                .any(|&s| s != 0)
    }

    /// Records that `page` now lives in `slot`.
    pub fn set(&mut self, page: u64, slot: Slot) {
        self.unset(page);
        self.fwd[page as usize] = slot + 1;
        self.rev[slot as usize] = page as u32 + 1;
        self.live[self.geo.place(slot).0 as usize] += 1;
        self.logged += 1;
    }

    /// Records that `page` lives at home again; true if it was in the log.
    pub fn unset(&mut self, page: u64) -> bool {
        let Some(old) = self.lookup(page) else {
            return false;
        };
        self.fwd[page as usize] = 0;
        self.rev[old as usize] = 0;
        self.live[self.geo.place(old).0 as usize] -= 1;
        self.logged -= 1;
        true
    }

    /// Every live `(slot, page)` of log unit `unit`, in slot order.
    pub fn live_in(&self, unit: u64) -> Vec<(Slot, u64)> {
        let per = self.geo.rows as u64 * self.geo.cols as u64;
        let first = (unit * per) as usize;
        self.rev[first..first + per as usize]
            .iter()
            .enumerate()
            .filter(|(_, &p)| p != 0)
            .map(|(i, &p)| ((first + i) as Slot, p as u64 - 1))
            .collect()
    }

    /// Forgets every page of log unit `unit` (it was freed).
    pub fn clear_unit(&mut self, unit: u64) {
        for (_, page) in self.live_in(unit) {
            self.unset(page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GEO: LogGeometry = LogGeometry {
        units: 3,
        rows: 4,
        cols: 2,
    };

    #[test]
    fn slots_number_units_rows_and_columns_densely() {
        let mut seen = Vec::new();
        for u in 0..GEO.units {
            for r in 0..GEO.rows {
                for c in 0..GEO.cols {
                    let s = GEO.slot(u, r, c);
                    assert_eq!(GEO.place(s), (u, r, c));
                    seen.push(s);
                }
            }
        }
        assert_eq!(seen, (0..GEO.slots() as Slot).collect::<Vec<_>>());
    }

    #[test]
    fn relogging_a_page_moves_its_live_count() {
        let mut t = PageTable::new(GEO, 100).unwrap();
        t.set(7, GEO.slot(0, 1, 1));
        assert_eq!((t.live(0), t.logged()), (1, 1));
        t.set(7, GEO.slot(2, 0, 0));
        assert_eq!((t.live(0), t.live(2), t.logged()), (0, 1, 1));
        assert_eq!(t.lookup(7), Some(GEO.slot(2, 0, 0)));
        assert!(t.live_in(0).is_empty());
        assert_eq!(t.live_in(2), [(GEO.slot(2, 0, 0), 7)]);
        assert!(t.unset(7));
        assert!(!t.unset(7));
        assert_eq!((t.live(2), t.logged(), t.lookup(7)), (0, 0, None));
    }

    #[test]
    fn clearing_a_unit_sends_its_pages_home() {
        let mut t = PageTable::new(GEO, 100).unwrap();
        t.set(1, GEO.slot(1, 0, 0));
        t.set(2, GEO.slot(1, 3, 1));
        t.set(3, GEO.slot(0, 0, 0));
        assert!(t.any_in(0, 3));
        t.clear_unit(1);
        assert_eq!((t.lookup(1), t.lookup(2), t.live(1)), (None, None, 0));
        assert_eq!(t.lookup(3), Some(GEO.slot(0, 0, 0)));
        assert!(!t.any_in(0, 3));
        assert!(t.any_in(3, 1));
    }

    #[test]
    fn an_empty_or_oversized_log_has_no_table() {
        assert!(PageTable::new(LogGeometry { units: 0, ..GEO }, 10).is_none());
        assert!(PageTable::new(GEO, u32::MAX as u64).is_none());
    }

    proptest! {
        /// After any sequence of sets and unsets, forward and reverse maps
        /// agree and the live counts are the reverse map's census.
        #[test]
        fn forward_reverse_and_live_counts_agree(
            ops in proptest::collection::vec((0u64..20, 0u32..24, any::<bool>()), 0..200)
        ) {
            let mut t = PageTable::new(GEO, 20).unwrap();
            for (page, slot, set) in ops {
                if set {
                    // A slot is written once before its unit is freed.
                    if t.rev[slot as usize] == 0 {
                        t.set(page, slot);
                    }
                } else {
                    t.unset(page);
                }
            }
            let mut live = vec![0u32; GEO.units as usize];
            let mut logged = 0;
            for page in 0..20 {
                if let Some(s) = t.lookup(page) {
                    prop_assert_eq!(t.rev[s as usize], page as u32 + 1);
                    live[GEO.place(s).0 as usize] += 1;
                    logged += 1;
                }
            }
            for u in 0..GEO.units {
                prop_assert_eq!(t.live(u), live[u as usize]);
                prop_assert_eq!(t.live_in(u).len() as u32, live[u as usize]);
            }
            prop_assert_eq!(t.logged(), logged);
        }
    }
}
