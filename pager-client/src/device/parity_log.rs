//! Parity logging (DESIGN.md §2.2, RMP): in mode parity a write smaller
//! than a whole group does not read-modify-write the group's parity (two
//! reads, then two writes). Its pages join a queue; a leader thread takes
//! up to `width - 1` queued pages, from any writers, computes their parity
//! and writes them as one new row of a log unit: `width - 1` pages cost
//! `width` writes and no reads. The page table (see
//! [`crate::page_log`]) says which pages live in the log; their home copies
//! are stale until the page is written home again.
//!
//! Locking: a writer holds its pages' home group write lock while it waits
//! for the row, so no one else reads or writes those pages meanwhile; a row
//! is written under its log unit's read lock (rebuild and drain move whole
//! members under the write lock). Order: home group, then log unit.
//!
//! The cleaner (maintenance thread) frees log units with no live pages
//! and, when few units are free, empties the one with the fewest live pages
//! by writing them again (into the log, or home if the log is full).

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::io::{xor_into, IoReq};
use super::{DeviceError, Inner, Result};
use crate::extent_map::{CopyState, Unit};
use crate::nbd::Op;
use crate::page_log::{LogGeometry, Slot, PAGE};

/// Rows a leader tries before giving its pages back to be written home.
const ROW_TRIES: usize = 3;

/// A page waiting for its row.
struct Entry {
    ticket: u64,
    page: u64,
    buf: Box<[u8]>,
}

/// What became of one writer's pages.
#[derive(Clone, Copy)]
struct Outcome {
    left: usize,
    home: bool,
}

/// A log unit rows are being added to.
struct OpenUnit {
    lu: u64,
    next_row: u32,
    in_flight: u32,
    closed: bool,
}

struct LogState {
    queue: VecDeque<Entry>,
    /// Page buffers not in the queue (preallocated).
    spare: Vec<Box<[u8]>>,
    /// One parity page per leader.
    parity: Vec<Box<[u8]>>,
    leaders: usize,
    outcomes: HashMap<u64, Outcome>,
    next_ticket: u64,
    open: Vec<OpenUnit>,
    /// Log units with no placement.
    free: Vec<u64>,
}

/// The parity log's writer side.
pub(crate) struct ParityLog {
    pub geo: LogGeometry,
    max_leaders: usize,
    st: Mutex<LogState>,
    cv: Condvar,
}

impl ParityLog {
    /// `placed[lu]`: whether log unit `lu` holds a placement (from the map).
    pub fn new(geo: LogGeometry, placed: &[bool], leaders: usize) -> ParityLog {
        let pages = (2 * geo.rows as usize).max(256);
        let page = || vec![0u8; PAGE as usize].into_boxed_slice();
        ParityLog {
            geo,
            max_leaders: leaders,
            st: Mutex::new(LogState {
                queue: VecDeque::with_capacity(pages),
                spare: (0..pages).map(|_| page()).collect(),
                parity: (0..leaders).map(|_| page()).collect(),
                leaders: 0,
                outcomes: HashMap::with_capacity(pages),
                next_ticket: 0,
                open: Vec::with_capacity(leaders + 1),
                free: (0..geo.units)
                    .rev()
                    .filter(|&u| !placed[u as usize])
                    .collect(),
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, LogState>) -> MutexGuard<'a, LogState> {
        self.cv.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    /// Log units with no placement, and units rows are being added to.
    pub fn free_and_open(&self) -> (usize, Vec<u64>) {
        let st = self.lock();
        (st.free.len(), st.open.iter().map(|o| o.lu).collect())
    }

    fn release(&self, lu: u64) {
        self.lock().free.push(lu);
    }

    /// Takes the next row of an open unit; `Err(lu)` hands the caller a
    /// free unit to place; `Ok(None)`: the log is full.
    fn reserve(&self) -> std::result::Result<Option<(u64, u32)>, u64> {
        let mut st = self.lock();
        let rows = self.geo.rows;
        if let Some(o) = st.open.iter_mut().find(|o| !o.closed && o.next_row < rows) {
            o.next_row += 1;
            o.in_flight += 1;
            return Ok(Some((o.lu, o.next_row - 1)));
        }
        st.free.pop().map_or(Ok(None), Err)
    }

    fn opened(&self, lu: u64) {
        self.lock().open.push(OpenUnit {
            lu,
            next_row: 0,
            in_flight: 0,
            closed: false,
        });
    }

    /// A row of `lu` is done; `close` stops further rows there (a member
    /// failed or is missing). A full or closed unit leaves the open list
    /// once its last row is done: from then on the cleaner may free it.
    fn row_done(&self, lu: u64, close: bool) {
        let mut st = self.lock();
        let rows = self.geo.rows;
        if let Some(i) = st.open.iter().position(|o| o.lu == lu) {
            let o = &mut st.open[i];
            o.in_flight -= 1;
            o.closed |= close;
            if (o.closed || o.next_row == rows) && o.in_flight == 0 {
                st.open.swap_remove(i);
            }
        }
    }
}

impl Inner {
    fn plog(&self) -> &ParityLog {
        self.plog.as_ref().expect("the device has a parity log")
    }

    /// The map unit and member position holding data column `col` of log
    /// unit `lu`.
    fn log_member(&self, lu: u64, col: u32) -> (u64, usize) {
        let g = self.layout.log_unit(lu);
        let pp = self.layout.parity_member(g);
        let c = col as usize;
        (g, if c < pp { c } else { c + 1 })
    }

    /// Writes whole pages (`(device page, 4096 bytes)`) into the log;
    /// false if it had no room (the caller writes them home). Call with the
    /// pages' home groups write-locked.
    pub(crate) fn log_pages(&self, items: &[(u64, &[u8])]) -> bool {
        let w = self.plog();
        let mut st = w.lock();
        while st.spare.len() < items.len() {
            st = w.wait(st);
        }
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        for &(page, data) in items {
            let mut buf = st.spare.pop().expect("counted above");
            buf.copy_from_slice(data);
            st.queue.push_back(Entry { ticket, page, buf });
        }
        st.outcomes.insert(
            ticket,
            Outcome {
                left: items.len(),
                home: false,
            },
        );
        loop {
            let o = st.outcomes[&ticket];
            if o.left == 0 {
                st.outcomes.remove(&ticket);
                return !o.home;
            }
            // A part row only when no row is being written: under load
            // rows fill up (less log space per page), when idle no page
            // waits for company.
            let row_ready =
                st.queue.len() >= w.geo.cols as usize || (st.leaders == 0 && !st.queue.is_empty());
            st = if row_ready && st.leaders < w.max_leaders {
                self.lead(st)
            } else {
                w.wait(st)
            };
        }
    }

    /// Writes one row from the queue's head (anyone's pages).
    fn lead<'a>(&'a self, mut st: MutexGuard<'a, LogState>) -> MutexGuard<'a, LogState> {
        let w = self.plog();
        st.leaders += 1;
        let n = st.queue.len().min(w.geo.cols as usize);
        let batch: Vec<Entry> = st.queue.drain(..n).collect();
        let mut par = st.parity.pop().expect("a parity page per leader");
        drop(st);
        let logged = self.write_row(&batch, &mut par);
        let mut st = w.lock();
        for e in batch {
            let o = st.outcomes.get_mut(&e.ticket).expect("its writer waits");
            o.left -= 1;
            o.home |= !logged;
            st.spare.push(e.buf);
        }
        st.parity.push(par);
        st.leaders -= 1;
        w.cv.notify_all();
        st
    }

    /// Writes `batch` as a new row; false if no row could take it.
    fn write_row(&self, batch: &[Entry], par: &mut [u8]) -> bool {
        par.copy_from_slice(&batch[0].buf);
        for e in &batch[1..] {
            xor_into(par, &e.buf);
        }
        for _ in 0..ROW_TRIES {
            let (lu, row) = match self.plog().reserve() {
                Ok(Some(r)) => r,
                Ok(None) => {
                    // Full: the cleaner makes room; meanwhile pages go home.
                    self.maint_wake.notify();
                    return false;
                }
                Err(lu) => {
                    if let Err(e) = self.place_log_unit(lu) {
                        tracing::debug!("parity log unit {lu}: {e}");
                        self.plog().release(lu);
                        return false;
                    }
                    self.plog().opened(lu);
                    continue;
                }
            };
            let ok = self.write_row_at(lu, row, batch, par);
            self.plog().row_done(lu, !ok);
            if ok {
                return true;
            }
        }
        false
    }

    fn write_row_at(&self, lu: u64, row: u32, batch: &[Entry], par: &[u8]) -> bool {
        let (g, _) = self.log_member(lu, 0);
        let guard = self.map.unit(g).read().unwrap_or_else(|p| p.into_inner());
        let Some(unit) = guard.as_ref() else {
            return false;
        };
        // A degraded unit takes no new rows: new pages go where all their
        // copies can be written.
        if unit
            .members
            .iter()
            .any(|m| m.state != CopyState::Ok || !self.loc_available(m.loc))
        {
            return false;
        }
        let off = row as u64 * PAGE;
        let pp = self.layout.parity_member(g);
        let mut reqs: Vec<IoReq<'_>> = batch
            .iter()
            .enumerate()
            .map(|(col, e)| IoReq {
                loc: unit.members[self.log_member(lu, col as u32).1].loc,
                off,
                op: Op::Write(&e.buf),
            })
            .collect();
        reqs.push(IoReq {
            loc: unit.members[pp].loc,
            off,
            op: Op::Write(par),
        });
        if self.exec(reqs).iter().any(|r| r.is_err()) {
            return false;
        }
        let mut pages = vec![None; self.plog().geo.cols as usize];
        for (col, e) in batch.iter().enumerate() {
            pages[col] = Some(e.page);
        }
        match self.map.log_row(lu, row, &pages) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!("journaling parity log row {row} of log unit {lu}: {e}");
                false
            }
        }
    }

    fn place_log_unit(&self, lu: u64) -> Result<()> {
        let g = self.layout.log_unit(lu);
        let mut guard = self.map.unit(g).write().unwrap_or_else(|p| p.into_inner());
        // Unused rows must read as zeros so every row's parity holds.
        self.place_group(g * self.layout.data_per_unit(), g, &mut guard, true)
    }

    /// Reads `buf.len()` bytes at `in_page` within log slot `slot`,
    /// rebuilding them from the row's other pages if their member is gone.
    pub(crate) fn read_log_slot(&self, slot: Slot, in_page: u64, buf: &mut [u8]) -> Result<()> {
        let (lu, row, col) = self.plog().geo.place(slot);
        let (g, pos) = self.log_member(lu, col);
        let guard = self.map.unit(g).read().unwrap_or_else(|p| p.into_inner());
        let unit: &Unit = guard.as_ref().ok_or_else(|| DeviceError::Io {
            extent: g * self.layout.data_per_unit(),
            reason: format!("parity log unit {lu} holds live pages but has no placement"),
        })?;
        let m = unit.members[pos];
        let off = row as u64 * PAGE + in_page;
        if m.state == CopyState::Ok
            && self.loc_available(m.loc)
            && self.exec1(m.loc, off, Op::Read(buf)).is_ok()
        {
            return Ok(());
        }
        let mut scratch = [0u8; PAGE as usize];
        let e = g * self.layout.data_per_unit();
        self.reconstruct(e, unit, pos, off, buf, &mut scratch[..buf.len()])
    }

    /// Frees log unit `lu` if no live page is left in it.
    fn free_log_unit(&self, lu: u64) -> Result<()> {
        let g = self.layout.log_unit(lu);
        let mut guard = self.map.unit(g).write().unwrap_or_else(|p| p.into_inner());
        if self.map.log_census().1[lu as usize] != 0 {
            return Ok(());
        }
        if let Some(unit) = guard.take() {
            for m in unit.members.iter().filter(|m| m.state == CopyState::Ok) {
                if self.loc_available(m.loc) {
                    let _ = self.exec1(m.loc, 0, Op::Trim(self.layout.extent));
                }
                self.map.free(m.loc);
            }
            self.map.commit(g, &guard)?;
        }
        self.plog().release(lu);
        Ok(())
    }

    /// Writes log page `page` (now in `slot`) again: into the log, or home
    /// with `home`.
    fn relocate(&self, page: u64, slot: Slot, home: bool) -> Result<()> {
        let at = page * PAGE;
        let (e, in_off) = (at / self.layout.extent, at % self.layout.extent);
        let (g, _) = self.layout.locate(e);
        let mut guard = self.map.unit(g).write().unwrap_or_else(|p| p.into_inner());
        if self.map.log_lookup(page) != Some(slot) {
            return Ok(());
        }
        let mut buf = [0u8; PAGE as usize];
        self.read_log_slot(slot, 0, &mut buf)?;
        self.write_pages_locked(e, in_off, &buf, &mut guard, !home)
    }

    /// The cleaner: frees empty log units and, while fewer than an eighth
    /// of the log's units are free, empties the one with the most garbage.
    /// Its live pages go back into the log when at most half of it is
    /// live (each pass then gains at least half a unit), home otherwise.
    pub(crate) fn clean_parity_log(&self) {
        let Some(w) = self.plog.as_ref() else {
            return;
        };
        let low_water = (w.geo.units as usize / 8).max(2);
        let per_unit = (w.geo.rows * w.geo.cols) as usize;
        for _ in 0..w.geo.units {
            let (free, open) = w.free_and_open();
            let (_, live) = self.map.log_census();
            let closed: Vec<u64> = (0..w.geo.units)
                .filter(|lu| !open.contains(lu))
                .filter(|&lu| {
                    self.map
                        .unit(self.layout.log_unit(lu))
                        .read()
                        .unwrap_or_else(|p| p.into_inner())
                        .is_some()
                })
                .collect();
            let mut freed = 0;
            for &lu in closed.iter().filter(|&&lu| live[lu as usize] == 0) {
                if let Err(e) = self.free_log_unit(lu) {
                    tracing::error!("freeing parity log unit {lu}: {e}");
                    return;
                }
                freed += 1;
            }
            if free + freed >= low_water || self.stop.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            let Some(&lu) = closed
                .iter()
                .filter(|&&lu| live[lu as usize] > 0)
                .min_by_key(|&&lu| live[lu as usize])
            else {
                return;
            };
            let pages = self.map.log_live_in(lu);
            let home = free == 0 || 2 * pages.len() > per_unit;
            for (slot, page) in pages {
                if let Err(e) = self.relocate(page, slot, home) {
                    tracing::warn!("parity log cleaner: page {page}: {e}");
                    return;
                }
            }
        }
    }
}
