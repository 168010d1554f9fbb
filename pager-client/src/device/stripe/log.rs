//! Parity logging (DESIGN.md §2.2, RMP): in modes parity and ec a write
//! smaller than a whole group does not read-modify-write the group's parity
//! (reads, then writes). Its pages join a queue; a leader thread takes
//! the queued pages, from any writers, encodes their parity and writes
//! them as new rows of a log unit: `k` pages per row, no reads, and
//! one request per member for up to [`MAX_ROWS`] consecutive rows. The page table (see
//! [`crate::page_log`]) says which pages live in the log; their home copies
//! are stale until the page is written home again. A trimmed page leaves
//! the table (`Inner::trim_group`), so neither a read nor the cleaner nor
//! the idle drain sees its logged copy again.
//!
//! Locking: a writer holds its pages' home group write lock while it waits
//! for the row, so no one else reads or writes those pages meanwhile; a row
//! is written under its log unit's read lock (rebuild and drain move whole
//! members under the write lock). Order: home group, then log unit.
//!
//! The cleaner (maintenance thread) frees log units with no live pages
//! and, when few units are free, empties the one with the fewest live pages
//! by writing them again (into the log, or home if the log is full). Once
//! the device has been idle for `parity_log_idle_ms` it moves every logged
//! page home and frees the units: the log's memory is held while writes
//! come, and an idle device holds (K + R) / K donor bytes per byte.
//!
//! What the rest of the striped code calls: `log_pages` (a small write),
//! `read_log_slot` (a logged page read alone), `clean_parity_log` and
//! `drain_idle_log` (maintenance), and `journal`: the log owns the page
//! table, and everyone (this module too) reads and changes it through that
//! handle ([`LogJournal`]), which journals each change in the map. This
//! module reaches the map's log units only through the journal; it places
//! them with `place_group` and moves pages home with `write_pages_locked`.

use std::collections::{HashMap, VecDeque};
use std::ops::RangeInclusive;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, MutexGuard};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use netpager_util::{LockExt, RwLockExt};

use super::super::io::{batch, IoReq, MAX_BATCH};
use super::super::{DeviceError, Inner, Result};
use crate::erasure::MAX_SHARDS;
use crate::extent_map::Unit;
use crate::page_log::{LogGeometry, LogJournal, PageTable, Slot, PAGE};
use netpager_nbd::Op;

/// Tries a leader makes before giving its pages back to be written home.
const ROW_TRIES: usize = 3;
/// Longest pass of the idle drain.
const DRAIN_PASS: Duration = Duration::from_secs(1);
/// Rows one leader writes at once (one request of this many pages per
/// member): fewer, larger requests per page logged.
const MAX_ROWS: usize = 8;

/// A page waiting for its row.
struct Entry {
    ticket: u64,
    page: u64,
    buf: Box<[u8]>,
}

/// What became of one writer's pages.
struct Outcome {
    left: usize,
    home: bool,
    /// Unparked when its pages are done, or when it should lead. Each
    /// writer is woken alone: waking all of them for every row costs more
    /// context switches than the rows cost requests.
    writer: Thread,
}

/// What a leader works with, allocated once.
struct Leader {
    /// Every member's part of `MAX_ROWS` rows.
    parts: Box<[u8]>,
    /// The queued pages it writes (room for `MAX_ROWS` rows).
    batch: Vec<Entry>,
}

/// A log unit being placed, or rows are being added to.
struct OpenUnit {
    lu: u64,
    /// False while a leader places it: it takes no rows yet, and the
    /// cleaner must not take it for closed.
    placed: bool,
    next_row: u32,
    in_flight: u32,
    closed: bool,
}

struct LogState {
    queue: VecDeque<Entry>,
    /// Page buffers not in the queue (preallocated).
    spare: Vec<Box<[u8]>>,
    /// Writers waiting for spare buffers.
    short: Vec<Thread>,
    /// One scratch per leader (preallocated).
    scratch: Vec<Leader>,
    leaders: usize,
    outcomes: HashMap<u64, Outcome>,
    next_ticket: u64,
    /// A log unit's state is kept here once: *free* (in `free`), *open*
    /// (in `open`) or *closed*, in neither: placed, taking no more rows,
    /// and touched only by the cleaner, which alone frees one. Its live
    /// pages are counted by the page table alone.
    open: Vec<OpenUnit>,
    /// Log units with no placement (every unplaced one but those `open`
    /// holds while they are placed), a stack so that a leader takes one
    /// without a scan.
    free: Vec<u64>,
}

/// The parity log: its writer side and its page table.
pub(crate) struct ParityLog {
    pub(super) geo: LogGeometry,
    max_leaders: usize,
    st: Mutex<LogState>,
    /// Which pages are logged, reached only through [`Inner::journal`].
    table: Mutex<PageTable>,
}

impl ParityLog {
    /// A log owning `table` (as the map replayed it); `placed[lu]`: whether
    /// log unit `lu` holds a placement (from the map); a log unit has
    /// `members` members (data and parity).
    pub fn new(table: PageTable, members: usize, placed: &[bool], leaders: usize) -> ParityLog {
        let geo = table.geometry();
        let pages = (2 * geo.rows as usize).max(MAX_ROWS * geo.cols as usize * leaders);
        let page = || vec![0u8; PAGE as usize].into_boxed_slice();
        let span = members * MAX_ROWS * PAGE as usize;
        ParityLog {
            geo,
            table: Mutex::new(table),
            max_leaders: leaders,
            st: Mutex::new(LogState {
                queue: VecDeque::with_capacity(pages),
                spare: (0..pages).map(|_| page()).collect(),
                short: Vec::new(),
                scratch: (0..leaders)
                    .map(|_| Leader {
                        parts: vec![0u8; span].into_boxed_slice(),
                        batch: Vec::with_capacity(MAX_ROWS * geo.cols as usize),
                    })
                    .collect(),
                leaders: 0,
                outcomes: HashMap::with_capacity(pages),
                next_ticket: 0,
                open: Vec::with_capacity(leaders + 1),
                // A unit placed at start is closed: a torn row may lie in
                // its unused rows.
                free: (0..geo.units)
                    .rev()
                    .filter(|&u| !placed[u as usize])
                    .collect(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.st.lock_or_recover()
    }

    /// Sleeps until unparked (or spuriously: callers check again).
    fn wait<'a>(&'a self, g: MutexGuard<'a, LogState>) -> MutexGuard<'a, LogState> {
        drop(g);
        thread::park();
        self.lock()
    }

    /// How many units are free, and the closed ones: neither free nor
    /// open (maintenance only: it looks at every unit).
    fn free_and_closed(&self) -> (usize, Vec<u64>) {
        let st = self.lock();
        let mut closed = vec![true; self.geo.units as usize];
        for &lu in &st.free {
            closed[lu as usize] = false;
        }
        for o in &st.open {
            closed[o.lu as usize] = false;
        }
        let closed = (0..self.geo.units).filter(|&lu| closed[lu as usize]);
        (st.free.len(), closed.collect())
    }

    /// A part row only when no row is being written: under load rows fill
    /// up (less log space and fewer requests per page), when idle no page
    /// waits for company.
    fn row_ready(&self, st: &LogState) -> bool {
        st.queue.len() >= self.geo.cols as usize || (st.leaders == 0 && !st.queue.is_empty())
    }

    /// Closes the open units no row is being written to (and no leader
    /// places), so that an idle log can be emptied to its last unit.
    fn close_idle_units(&self) {
        self.lock().open.retain(|o| o.in_flight > 0 || !o.placed);
    }

    /// Log unit `lu` has no placement (again): free.
    fn release(&self, lu: u64) {
        let mut st = self.lock();
        st.open.retain(|o| o.lu != lu);
        st.free.push(lu);
    }

    /// Takes up to `want` consecutive rows of an open unit: `(unit, first
    /// row, rows)`; `Err(lu)` hands the caller a free unit to place (then
    /// [`ParityLog::opened`] or [`ParityLog::release`]); `Ok(None)`: the
    /// log is full.
    fn reserve(&self, want: u32) -> std::result::Result<Option<(u64, u32, u32)>, u64> {
        let mut st = self.lock();
        let rows = self.geo.rows;
        if let Some(o) = st
            .open
            .iter_mut()
            .find(|o| o.placed && !o.closed && o.next_row < rows)
        {
            let got = want.min(rows - o.next_row);
            o.next_row += got;
            o.in_flight += 1;
            return Ok(Some((o.lu, o.next_row - got, got)));
        }
        let Some(lu) = st.free.pop() else {
            return Ok(None);
        };
        st.open.push(OpenUnit {
            lu,
            placed: false,
            next_row: 0,
            in_flight: 0,
            closed: false,
        });
        Err(lu)
    }

    /// Log unit `lu`, handed out by [`ParityLog::reserve`], is placed: it
    /// takes rows.
    fn opened(&self, lu: u64) {
        if let Some(o) = self.lock().open.iter_mut().find(|o| o.lu == lu) {
            o.placed = true;
        }
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
    /// The parity log's journal handle: the page table (none without a
    /// log: every page at home) and the map behind it.
    pub(crate) fn journal(&self) -> LogJournal<'_> {
        LogJournal::new(self.parity_log().map(|l| &l.table), &self.map)
    }

    fn plog(&self) -> &ParityLog {
        self.parity_log().expect("the device has a parity log")
    }

    /// The map unit and member position holding data column `col` of log
    /// unit `lu`.
    fn log_member(&self, lu: u64, col: u32) -> (u64, usize) {
        let g = self.layout.log_unit(lu);
        (g, self.layout.member_of(g, col as usize))
    }

    /// Writes whole device pages `pages` (their 4096 bytes each from
    /// `data`) into the log; false if it had no room (the caller writes
    /// them home). Call with the pages' home groups write-locked.
    pub(super) fn log_pages<'d>(
        &self,
        pages: RangeInclusive<u64>,
        data: impl Fn(u64) -> &'d [u8],
    ) -> bool {
        let w = self.plog();
        let n = (pages.end() - pages.start() + 1) as usize;
        let mut st = w.lock();
        while st.spare.len() < n {
            st.short.push(thread::current());
            st = w.wait(st);
        }
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        for page in pages {
            let mut buf = st.spare.pop().expect("counted above");
            buf.copy_from_slice(data(page));
            st.queue.push_back(Entry { ticket, page, buf });
        }
        st.outcomes.insert(
            ticket,
            Outcome {
                left: n,
                home: false,
                writer: thread::current(),
            },
        );
        loop {
            if st.outcomes[&ticket].left == 0 {
                let o = st.outcomes.remove(&ticket).expect("checked above");
                return !o.home;
            }
            st = if w.row_ready(&st) && st.leaders < w.max_leaders {
                self.lead(st)
            } else {
                w.wait(st)
            };
        }
    }

    /// Writes rows from the queue's head (anyone's pages).
    fn lead<'a>(&'a self, mut st: MutexGuard<'a, LogState>) -> MutexGuard<'a, LogState> {
        let w = self.plog();
        st.leaders += 1;
        let n = st.queue.len().min(w.geo.cols as usize * MAX_ROWS);
        let mut work = st.scratch.pop().expect("a scratch per leader");
        work.batch.extend(st.queue.drain(..n));
        drop(st);
        let logged = self.write_rows(&work.batch, &mut work.parts);
        let mut st = w.lock();
        for e in work.batch.drain(..) {
            let o = st.outcomes.get_mut(&e.ticket).expect("its writer waits");
            o.left -= 1;
            o.home |= !logged;
            if o.left == 0 {
                o.writer.unpark();
            }
            st.spare.push(e.buf);
        }
        st.scratch.push(work);
        st.leaders -= 1;
        for t in st.short.drain(..) {
            t.unpark();
        }
        // The writer of the oldest queued page leads next.
        if w.row_ready(&st) {
            let head = st.queue.front().expect("a row is ready").ticket;
            st.outcomes[&head].writer.unpark();
        }
        st
    }

    /// Writes `batch` as new rows; false if the log could not take all of
    /// it (its writers then write it home).
    fn write_rows(&self, batch: &[Entry], scratch: &mut [u8]) -> bool {
        let cols = self.plog().geo.cols as usize;
        let mut rest = batch;
        let mut tries = 0;
        while !rest.is_empty() {
            if tries == ROW_TRIES {
                return false;
            }
            let (lu, row, got) = match self.plog().reserve(rest.len().div_ceil(cols) as u32) {
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
            let (chunk, more) = rest.split_at(rest.len().min(got as usize * cols));
            let ok = self.write_rows_at(lu, row, got, chunk, scratch);
            self.plog().row_done(lu, !ok);
            if ok {
                rest = more;
            } else {
                tries += 1;
            }
        }
        true
    }

    /// Writes `chunk` into rows `row..row + rows` of log unit `lu`: page `i`
    /// at row `row + i / cols`, column `i % cols`; one request per member.
    fn write_rows_at(
        &self,
        lu: u64,
        row: u32,
        rows: u32,
        chunk: &[Entry],
        scratch: &mut [u8],
    ) -> bool {
        let (g, _) = self.log_member(lu, 0);
        let journal = self.journal();
        let guard = journal.unit(lu).read_or_recover();
        let Some(unit) = guard.as_ref() else {
            return false;
        };
        // A degraded unit takes no new rows: new pages go where all their
        // copies can be written.
        if !unit.members.iter().all(|m| self.usable(m)) {
            return false;
        }
        let cols = self.plog().geo.cols;
        let span = (rows as u64 * PAGE) as usize;
        let page = PAGE as usize;
        let parts = &mut scratch[..unit.members.len() * span];
        // Columns no page fills stay zero, as the unit was placed.
        parts.fill(0);
        for (i, e) in chunk.iter().enumerate() {
            let (r, c) = (i / cols as usize, i as u32 % cols);
            let at = self.log_member(lu, c).1 * span + r * page;
            parts[at..at + page].copy_from_slice(&e.buf);
        }
        {
            let k = cols as usize;
            let mut d: [&[u8]; MAX_SHARDS] = [&[]; MAX_SHARDS];
            let mut p: [&mut [u8]; MAX_SHARDS] = Default::default();
            for (j, part) in parts.chunks_mut(span).enumerate() {
                match self.layout.shard_of(g, j) {
                    s if s < k => d[s] = part,
                    s => p[s - k] = part,
                }
            }
            let r = self.layout.parity_count();
            if let Err(e) = self.codec(|c| c.encode(&d[..k], &mut p[..r])) {
                tracing::error!("parity log unit {lu}: {e}");
                return false;
            }
        }
        let mut reqs = batch();
        for ((part, m), r) in parts.chunks(span).zip(&unit.members).zip(&mut reqs) {
            *r = Some(IoReq {
                loc: m.loc,
                off: row as u64 * PAGE,
                op: Op::Write(part),
            });
        }
        if self.exec(&mut reqs).iter().flatten().any(|r| r.is_err()) {
            return false;
        }
        let mut pages = [None; MAX_ROWS * (MAX_BATCH - 1)];
        let pages = &mut pages[..(rows * cols) as usize];
        for (p, e) in pages.iter_mut().zip(chunk) {
            *p = Some(e.page);
        }
        match journal.rows(lu, row, pages) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!("journaling parity log rows {row}.. of log unit {lu}: {e}");
                false
            }
        }
    }

    fn place_log_unit(&self, lu: u64) -> Result<()> {
        let g = self.layout.log_unit(lu);
        let mut guard = self.journal().unit(lu).write_or_recover();
        // Unused rows must read as zeros so every row's parity holds.
        self.place_group(g * self.layout.data_per_unit(), g, &mut guard, true)
    }

    /// Reads `buf.len()` bytes at `in_page` within log slot `slot`,
    /// rebuilding them from the row's other pages if their member is gone.
    pub(super) fn read_log_slot(&self, slot: Slot, in_page: u64, buf: &mut [u8]) -> Result<()> {
        let (lu, row, col) = self.plog().geo.place(slot);
        let (g, pos) = self.log_member(lu, col);
        let guard = self.journal().unit(lu).read_or_recover();
        let unit: &Unit = guard.as_ref().ok_or_else(|| DeviceError::Io {
            extent: g * self.layout.data_per_unit(),
            reason: format!("parity log unit {lu} holds live pages but has no placement"),
        })?;
        let m = unit.members[pos];
        let off = row as u64 * PAGE + in_page;
        if self.usable(&m) && self.exec1(m.loc, off, Op::Read(buf)).is_ok() {
            return Ok(());
        }
        let e = g * self.layout.data_per_unit();
        let mut bufs = self.bufs.take(1);
        self.reconstruct(e, unit, pos, off, buf, bufs.one(self.buf_bytes()), &[])
    }

    /// Frees closed log unit `lu` (no live page is left in it: a closed
    /// unit takes no new ones). Only the maintenance thread frees units,
    /// so `lu` stays closed until this releases it.
    fn free_log_unit(&self, lu: u64) -> Result<()> {
        let journal = self.journal();
        let mut guard = journal.unit(lu).write_or_recover();
        if let Some(unit) = guard.take() {
            for &m in &unit.members {
                self.release_slot(m);
            }
            // On failure its slots are given back already: it stays
            // closed, and the next pass journals it free again.
            journal.commit(lu, &guard)?;
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
        let mut guard = self.map.unit(g).write_or_recover();
        if self.journal().lookup(page) != Some(slot) {
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
        let Some(w) = self.parity_log() else {
            return;
        };
        let low_water = (w.geo.units as usize / 8).max(2);
        let per_unit = (w.geo.rows * w.geo.cols) as usize;
        for _ in 0..w.geo.units {
            let (free, closed) = w.free_and_closed();
            let (_, live) = self.journal().census();
            let mut freed = 0;
            for &lu in closed.iter().filter(|&&lu| live[lu as usize] == 0) {
                if let Err(e) = self.free_log_unit(lu) {
                    tracing::error!("freeing parity log unit {lu}: {e}");
                    return;
                }
                freed += 1;
            }
            if free + freed >= low_water || self.stop.load(Relaxed) {
                return;
            }
            let Some(&lu) = closed
                .iter()
                .filter(|&&lu| live[lu as usize] > 0)
                .min_by_key(|&&lu| live[lu as usize])
            else {
                return;
            };
            let pages = self.journal().live_in(lu);
            let home = free == 0 || 2 * pages.len() > per_unit;
            for (slot, page) in pages {
                if let Err(e) = self.relocate(page, slot, home) {
                    tracing::warn!("parity log cleaner: page {page}: {e}");
                    return;
                }
            }
        }
    }

    /// Moves every logged page home and frees the log's units once the
    /// device has served no request for `parity_log_idle_ms`. Stops at the
    /// first new request: a page moved holds its home group for one
    /// read-modify-write, so a request waits for one page at most. A pass
    /// lasts at most [`DRAIN_PASS`], so the maintenance thread's other
    /// duties (failed donors, rebuilds, status) never wait longer; the
    /// next pass goes on while the device stays idle.
    pub(crate) fn drain_idle_log(&self) {
        let Some(w) = self.parity_log() else {
            return;
        };
        let idle = Duration::from_millis(self.cfg.parity_log_idle_ms);
        if idle.is_zero() || self.idle_for() < idle {
            return;
        }
        w.close_idle_units();
        let (start, until) = (self.requests.load(Relaxed), Instant::now() + DRAIN_PASS);
        let enough = || {
            self.requests.load(Relaxed) != start
                || self.stop.load(Relaxed)
                || Instant::now() >= until
        };
        let (mut moved, mut freed) = (0u64, 0u64);
        'units: for lu in w.free_and_closed().1 {
            for (slot, page) in self.journal().live_in(lu) {
                if enough() {
                    break 'units;
                }
                if let Err(e) = self.relocate(page, slot, true) {
                    tracing::warn!("parity log drain: page {page}: {e}");
                    break 'units;
                }
                moved += 1;
            }
            if self.journal().live_in(lu).is_empty() {
                if let Err(e) = self.free_log_unit(lu) {
                    tracing::error!("freeing parity log unit {lu}: {e}");
                    break;
                }
                freed += 1;
            }
        }
        if moved + freed > 0 {
            let left = self.journal().census().0;
            tracing::debug!(
                "parity log, device idle: {moved} pages moved home, {freed} units freed, {left} pages left"
            );
            if left == 0 {
                tracing::info!("parity log empty: the idle device's pages are all home");
            }
        }
    }
}
