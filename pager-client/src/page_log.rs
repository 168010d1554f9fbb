//! [`LogJournal`], the one way the device reads or changes the parity log's
//! page table ([`crate::page_table`], docs/DESIGN.md "2.2 Keeping remote
//! pages safe", parity logging). The table is owned by the device's parity
//! log (`device/stripe/log.rs`, which does the I/O); this handle keeps every
//! change in the extent map's journal, which replays the table at open and
//! writes it into each snapshot. The table's types are re-exported here so
//! that the device reaches the log through this one module.

use std::sync::{Mutex, MutexGuard, RwLock};

use netpager_util::LockExt;

use crate::extent_map::{ExtentMap, MapError, Unit};
pub use crate::page_table::{LogGeometry, PageTable, Slot, PAGE};

/// The parity log's journal handle (as Linux md's `raid5-log.h` is the
/// stripe code's interface to its journal): the page table, owned by the
/// parity log, with the extent map behind it. The striped code asks it
/// which pages are logged (a page, a run, any in a range, the live counts)
/// and tells it what changed (rows written, pages dropped); the parity log
/// reaches the map's log units only through it. Without a parity log
/// (`table` is `None`) every page is at home.
///
/// Locks: a change updates the table under its mutex, releases it, then
/// appends to the map's journal; only compaction holds both (the map's
/// journal first, with no unit lock held).
#[derive(Clone, Copy)]
pub struct LogJournal<'a> {
    table: Option<&'a Mutex<PageTable>>,
    map: &'a ExtentMap,
}

impl<'a> LogJournal<'a> {
    pub fn new(table: Option<&'a Mutex<PageTable>>, map: &'a ExtentMap) -> LogJournal<'a> {
        LogJournal { table, map }
    }

    fn table(&self) -> Option<MutexGuard<'a, PageTable>> {
        self.table.map(|t| t.lock_or_recover())
    }

    /// The log's shape, if there is a log.
    pub fn geometry(&self) -> Option<LogGeometry> {
        self.table().map(|t| t.geometry())
    }

    /// Where `page` lives in the log, if it does.
    pub fn lookup(&self, page: u64) -> Option<Slot> {
        self.table().and_then(|t| t.lookup(page))
    }

    /// The log slots of pages `first..first + out.len()` (`None`: at
    /// home), looked up under one lock.
    pub fn lookup_run(&self, first: u64, out: &mut [Option<Slot>]) {
        match self.table() {
            Some(t) => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = t.lookup(first + i as u64);
                }
            }
            None => out.fill(None),
        }
    }

    /// Whether any page of `[first, first + count)` is in the log.
    pub fn any_in(&self, first: u64, count: u64) -> bool {
        self.table().is_some_and(|t| t.any_in(first, count))
    }

    /// Pages in the log, and live pages of each log unit.
    pub fn census(&self) -> (u64, Vec<u32>) {
        match self.table() {
            Some(t) => (
                t.logged(),
                (0..t.geometry().units).map(|u| t.live(u)).collect(),
            ),
            None => (0, Vec::new()),
        }
    }

    /// Live `(slot, page)` pairs of log unit `lu`.
    pub fn live_in(&self, lu: u64) -> Vec<(Slot, u64)> {
        self.table().map(|t| t.live_in(lu)).unwrap_or_default()
    }

    /// Records (and journals) that rows `row..` of log unit `lu` now hold
    /// `pages` (one per data column, row after row; `None` for unused
    /// columns). Call with the home groups of those pages write-locked,
    /// after the rows are on the donors.
    pub fn rows(&self, lu: u64, row: u32, pages: &[Option<u64>]) -> Result<(), MapError> {
        let Some(cols) = self.table().map(|mut t| {
            let geo = t.geometry();
            for (r, cols) in (row..).zip(pages.chunks(geo.cols as usize)) {
                for (col, p) in cols.iter().enumerate() {
                    if let Some(p) = p {
                        t.set(*p, geo.slot(lu, r, col as u32));
                    }
                }
            }
            geo.cols as usize
        }) else {
            return Ok(());
        };
        self.map.journal_log_rows(lu, row, cols, pages)
    }

    /// Records (and journals) that pages `[first, first + count)` are at
    /// home again (written there, or trimmed). Call with their home group
    /// write-locked.
    pub fn drop_pages(&self, first: u64, count: u64) -> Result<(), MapError> {
        {
            let Some(mut t) = self.table() else {
                return Ok(());
            };
            if !t.any_in(first, count) {
                return Ok(());
            }
            for p in first..first + count {
                t.unset(p);
            }
        }
        self.map.journal_log_drop(first, count)
    }

    /// The lock of log unit `lu`'s placement.
    pub fn unit(&self, lu: u64) -> &'a RwLock<Option<Unit>> {
        self.map.unit(self.map.layout().log_unit(lu))
    }

    /// Journals log unit `lu`'s new placement (its lock held for writing).
    pub fn commit(&self, lu: u64, unit: &Option<Unit>) -> Result<(), MapError> {
        self.map.commit(self.map.layout().log_unit(lu), unit)
    }

    /// Folds the map's journal into a new snapshot, the table with it.
    pub fn compact(&self) -> Result<(), MapError> {
        self.map.compact(self.table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extent_map::tests::log_layout;
    use crate::extent_map::{CopyState, Loc, Member};

    /// The parity log's page table the map replayed, held as the device's
    /// parity log holds it.
    fn log_table(m: &ExtentMap) -> Mutex<PageTable> {
        Mutex::new(m.take_log_table().expect("a parity log"))
    }

    fn parity_unit() -> Option<Unit> {
        let m = |slot| Member {
            loc: Loc::Donor { donor: 0, slot },
            state: CopyState::Ok,
        };
        Some(Unit {
            members: vec![m(1), m(2), m(3)],
        })
    }

    #[test]
    fn parity_log_rows_and_drops_survive_reopen_and_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let l = log_layout();
        let geo = l.log_geometry().unwrap();
        assert_eq!((geo.units, geo.rows, geo.cols), (2, 256, 2));
        assert_eq!(l.units(), l.home_units() + 2);
        {
            let m = ExtentMap::open(dir.path(), l).unwrap();
            let t = log_table(&m);
            let j = LogJournal::new(Some(&t), &m);
            m.donor_id("a").unwrap();
            m.commit(l.log_unit(0), &parity_unit()).unwrap();
            j.rows(0, 0, &[Some(10), Some(11)]).unwrap();
            j.rows(0, 1, &[Some(12), None]).unwrap();
            // Page 10 written again: its first copy is garbage.
            j.rows(0, 2, &[Some(10), None]).unwrap();
            j.drop_pages(11, 1).unwrap();
            j.compact().unwrap();
            j.rows(0, 3, &[Some(2000), Some(13)]).unwrap();
            // Two rows in one call.
            j.rows(0, 4, &[Some(20), Some(21), Some(22), None]).unwrap();
        }
        let m = ExtentMap::open(dir.path(), l).unwrap();
        let t = log_table(&m);
        let j = LogJournal::new(Some(&t), &m);
        assert_eq!(j.lookup(10), Some(geo.slot(0, 2, 0)));
        assert_eq!(j.lookup(11), None);
        assert_eq!(j.lookup(12), Some(geo.slot(0, 1, 0)));
        assert_eq!(j.lookup(2000), Some(geo.slot(0, 3, 0)));
        assert_eq!(j.lookup(13), Some(geo.slot(0, 3, 1)));
        assert_eq!(j.lookup(22), Some(geo.slot(0, 5, 0)));
        assert_eq!(j.lookup(21), Some(geo.slot(0, 4, 1)));
        assert_eq!(j.census(), (7, vec![7, 0]));
        // Freeing a log unit sends whatever it still named home.
        m.commit(l.log_unit(0), &None).unwrap();
        drop(m);
        let m = ExtentMap::open(dir.path(), l).unwrap();
        let t = log_table(&m);
        assert_eq!(LogJournal::new(Some(&t), &m).census(), (0, vec![0, 0]));
    }
}
