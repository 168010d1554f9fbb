//! The device's address space cut into extents, and where each one lives.
//!
//! A *unit* is what gets placed at its first write: one extent in modes
//! none, mirror and disk, a group of `k` data extents (and `r` parity
//! extents) in modes parity and ec. A unit has *members* (copies, or the group's data and parity
//! extents), each at a [`Loc`] (a slot of our export on a donor, or a slot
//! of the local fallback file) with a [`CopyState`].
//!
//! Crash safety: every placement change is appended to `map.journal` as a
//! CRC-checked record; [`ExtentMap::compact`] writes the whole map to
//! `map.snap.tmp`, fsyncs, renames it to `map.snap`, fsyncs the directory,
//! then starts a new journal the same way. Both files carry a generation:
//! a journal older than the snapshot was already folded into it. Recovery
//! replays the snapshot and the journal's valid prefix; a torn tail is
//! logged and cut off.
//!
//! Write intent (modes parity and ec, the md bitmap's idea): a home group's
//! data and parity members are written by separate requests, so a client
//! killed between them leaves a stripe whose parity does not match its
//! data (the write hole). Before the first write at home to a group not
//! already marked, [`ExtentMap::mark_written`] journals the group open and
//! syncs the journal; [`ExtentMap::sweep_intents`] journals it closed once
//! it has been quiet. The device resyncs every group still open at start
//! (`Device::open`). The parity log's rows need no intent: a row is
//! journaled (and its pages enter the page table) only after all its
//! members were written, rows are written only into a unit's unused rows,
//! and a unit found placed at start takes no more rows, so a torn row never
//! shares a stripe with a page anyone reads.
//!
//! The parts: `layout` (geometry: units, members, parity rotation),
//! `record` (the records' encoding), `slots` (free and used slots per
//! donor), `open` (replay at start-up); this file holds the map itself:
//! commits, compaction, the parity log's journal records and the donor
//! list. The parity log's page table is replayed here at open and handed
//! to the log ([`ExtentMap::take_log_table`]); the device changes it only
//! through [`crate::page_log::LogJournal`], which journals here.

mod layout;
mod open;
mod record;
mod slots;
#[cfg(test)]
pub(crate) mod tests;
mod unfound;

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, RwLock, TryLockError};

use netpager_util::LockExt;

use crate::page_table::PageTable;
pub use layout::{CopyState, Layout, Loc, Member, Redundancy, Unit};
use open::write_journal_header;
pub use record::crc32;
use record::{encode, encode_into, frame_into, log_row_payload, Record};
pub use slots::SlotOwner;
use slots::{SlotSet, Slots};
pub use unfound::PageRanges;

pub const SNAPSHOT_FILE: &str = "map.snap";
pub const JOURNAL_FILE: &str = "map.journal";
/// Initial size of the journal's record buffer: a parity log leader's
/// records (8 rows of up to 31 pages) fit.
const JOURNAL_SCRATCH: usize = 4096;
/// The journal is compacted into a snapshot once it grows past this.
pub const COMPACT_AFTER_BYTES: u64 = 4 << 20;
/// A group's write intent is journaled open.
pub(super) const INTENT_OPEN: u8 = 1;
/// The group was written at home since the last sweep.
const INTENT_TOUCHED: u8 = 2;
/// Open at start and its resync failed (a data member was unreachable):
/// its parity may not match its data, so nothing is decoded from it until
/// a resync succeeds. Not journaled: the open intent is, and the next
/// start resyncs the group again.
const INTENT_UNSYNCED: u8 = 4;

/// A donor as the map knows it: ids are stable across restarts and config
/// changes, the label says which incarnation of our export holds our data
/// (0: none), and `member` whether (and how) it belongs to the device's
/// donor set (`None` in maps written before live membership).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DonorEntry {
    pub name: String,
    pub label: u128,
    pub member: Option<MemberRecord>,
}

/// Where a donor stands in the device's set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    /// In the set: new extents may go to it.
    Member,
    /// Being removed: its extents are moving off, nothing new goes there.
    Leaving,
    /// Out of the set: forgotten after it died, or its line left the
    /// donors file.
    Gone,
    /// Removed by the admin (`donor-remove`): discovery never brings it
    /// back; `donor-add` does.
    Removed,
}

impl MemberState {
    /// Out of the set, however it left.
    pub fn left(self) -> bool {
        matches!(self, MemberState::Gone | MemberState::Removed)
    }

    pub fn word(self) -> &'static str {
        match self {
            MemberState::Member => "member",
            MemberState::Leaving => "leaving",
            MemberState::Gone => "gone",
            MemberState::Removed => "removed",
        }
    }
}

/// A donor's membership as the journal keeps it, so a restart (or a
/// re-attach) finds the same donor set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberRecord {
    pub joined: netpager_membership::Joined,
    /// When it joined (or left, for `Gone`), seconds since the Unix epoch.
    pub since_unix: u64,
    pub state: MemberState,
    /// How to reach it: its `device.toml` donor entry as JSON (donors that
    /// joined at run time are in no configuration file).
    pub config: String,
}

/// Errors of the extent map, naming the file and offset.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: corrupt record at byte {offset}: {reason}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("{path}: the map was made for {field} {stored}, the configuration says {configured}")]
    Mismatch {
        path: PathBuf,
        field: &'static str,
        stored: String,
        configured: String,
    },
    #[error("too many donors in the map (at most 65535)")]
    TooManyDonors,
}

/// The journal and what it has recorded, behind one lock.
struct Persist {
    journal: File,
    journal_bytes: u64,
    generation: u64,
    /// Every unit's placement as journaled, a second copy of `units`':
    /// compaction reads placements with the journal held and no unit lock,
    /// because a writer holds its unit's lock while it waits for the
    /// journal in `commit` (taking unit locks here would be the reverse
    /// order: a deadlock), and reading them before taking the journal
    /// could miss a commit appended to the old journal. Kept by `commit`.
    mirror: Vec<Option<Unit>>,
    /// Parity members each donor (by map id) holds, kept with `mirror`.
    parity_held: Vec<u64>,
    /// Units with a member being moved (`commit_move`): the member and
    /// where its data still is, until the unit's next commit.
    moving: std::collections::BTreeMap<u32, (u8, Loc)>,
    donors: Vec<DonorEntry>,
    /// Records being appended, kept so the parity log's journal records
    /// (one per small write) are encoded without allocating.
    scratch: Vec<u8>,
}

/// The extent map: in-memory placements behind per-unit locks, plus the
/// journal and snapshot that keep them across restarts.
pub struct ExtentMap {
    layout: Layout,
    dir: PathBuf,
    units: Vec<RwLock<Option<Unit>>>,
    /// Write intent of each home group ([`INTENT_OPEN`], [`INTENT_TOUCHED`],
    /// [`INTENT_UNSYNCED`]):
    /// changed with the group's write lock held, and the open bit only
    /// with `persist` held too, so a snapshot sees what the journal says.
    intents: Vec<AtomicU8>,
    persist: Mutex<Persist>,
    slots: Mutex<Slots>,
    /// The parity log's page table as replayed at open, until the parity
    /// log takes it: the table is the log's, the map journals its changes
    /// (`journal_log_*`) and writes it into snapshots.
    log_at_open: Mutex<Option<PageTable>>,
    /// Pages that read as lost until written (`unfound.rs`); changed like
    /// the page table: update, release, then append to the journal.
    unfound: Mutex<PageRanges>,
    /// Pages in `unfound`, so that reads and writes skip its lock while
    /// nothing is unfound (always, but after a loss).
    unfound_pages: AtomicU64,
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> MapError + '_ {
    move |source| MapError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn fsync_dir(dir: &Path) -> Result<(), MapError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

impl ExtentMap {
    /// The lock guarding unit `u`'s placement. Hold it (read) during I/O on
    /// the unit and (write) while changing its placement.
    pub fn unit(&self, u: u64) -> &RwLock<Option<Unit>> {
        &self.units[u as usize]
    }

    /// Journals unit `u`'s new placement. Call with `u`'s write lock held,
    /// after the data is where the placement says.
    pub fn commit(&self, u: u64, unit: &Option<Unit>) -> Result<(), MapError> {
        self.commit_records(u, unit, None)
    }

    /// Journals unit `u`'s placement with its member `j` on a new
    /// location (`Rebuilding`) that is being filled from `from`, which
    /// holds the member's data until the unit's next commit (the switch,
    /// or the way back): a restart before that puts the member back on
    /// `from` (open.rs), so a move cut short loses nothing.
    pub fn commit_move(
        &self,
        u: u64,
        unit: &Option<Unit>,
        j: usize,
        from: Loc,
    ) -> Result<(), MapError> {
        self.commit_records(u, unit, Some((j as u8, from)))
    }

    fn commit_records(
        &self,
        u: u64,
        unit: &Option<Unit>,
        moving: Option<(u8, Loc)>,
    ) -> Result<(), MapError> {
        let mut rec = encode(&Record::Unit {
            index: u as u32,
            unit: unit.clone(),
        });
        if let Some((member, from)) = moving {
            encode_into(
                &Record::Moving {
                    index: u as u32,
                    member,
                    from,
                },
                &mut rec,
            );
        }
        let mut p = self.persist.lock_or_recover();
        let path = self.dir.join(JOURNAL_FILE);
        p.journal.write_all(&rec).map_err(io_err(&path))?;
        p.journal_bytes += rec.len() as u64;
        let p = &mut *p;
        count_parity(
            &self.layout,
            u,
            p.mirror[u as usize].as_ref(),
            &mut p.parity_held,
            false,
        );
        count_parity(&self.layout, u, unit.as_ref(), &mut p.parity_held, true);
        p.mirror[u as usize] = unit.clone();
        match moving {
            Some(m) => p.moving.insert(u as u32, m),
            None => p.moving.remove(&(u as u32)),
        };
        Ok(())
    }

    /// Parity members each donor holds, by map donor id (modes parity and
    /// ec): placement gives a new group's parity positions to the donors
    /// holding the fewest, so reads (which go to data members) spread
    /// evenly.
    pub fn parity_held(&self) -> Vec<u64> {
        self.persist.lock_or_recover().parity_held.clone()
    }

    /// Makes every committed change durable.
    pub fn sync(&self) -> Result<(), MapError> {
        let p = self.persist.lock_or_recover();
        p.journal
            .sync_data()
            .map_err(io_err(&self.dir.join(JOURNAL_FILE)))
    }

    pub fn needs_compaction(&self) -> bool {
        self.persist.lock_or_recover().journal_bytes > COMPACT_AFTER_BYTES
    }

    /// The map's geometry.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Folds the journal into a new snapshot and starts a new journal;
    /// `log` is the parity log's page table (`None`: no page is logged).
    /// The device calls it through [`crate::page_log::LogJournal`].
    pub fn compact(&self, log: Option<&Mutex<PageTable>>) -> Result<(), MapError> {
        // The table is copied with the journal held: a change made after
        // the copy is appended to the new journal (replaying it twice is
        // harmless), never to the old one. Nobody holds the table's
        // mutex while waiting for the journal's.
        let mut p = self.persist.lock_or_recover();
        let table = log.map(|t| t.lock_or_recover().clone());
        let unfound = self.unfound.lock_or_recover().clone();
        let g = p.generation + 1;
        self.write_snapshot(&p, table.as_ref(), &unfound, g)?;
        write_journal_header(&self.dir, g, &self.layout)?;
        let jpath = self.dir.join(JOURNAL_FILE);
        p.journal = OpenOptions::new()
            .append(true)
            .open(&jpath)
            .map_err(io_err(&jpath))?;
        p.journal_bytes = p.journal.metadata().map_err(io_err(&jpath))?.len();
        p.generation = g;
        Ok(())
    }

    fn write_snapshot(
        &self,
        p: &Persist,
        table: Option<&PageTable>,
        unfound: &PageRanges,
        generation: u64,
    ) -> Result<(), MapError> {
        let tmp = self.dir.join(format!("{SNAPSHOT_FILE}.tmp"));
        let mut data = encode(&Record::Header {
            generation,
            layout: self.layout,
        });
        for (id, entry) in p.donors.iter().enumerate() {
            data.extend(encode(&Record::Donor {
                id: id as u16,
                entry: entry.clone(),
            }));
        }
        let mut n = 0u64;
        for (i, u) in p.mirror.iter().enumerate().filter(|(_, u)| u.is_some()) {
            data.extend(encode(&Record::Unit {
                index: i as u32,
                unit: u.clone(),
            }));
            n += 1;
        }
        for (&index, &(member, from)) in &p.moving {
            data.extend(encode(&Record::Moving {
                index,
                member,
                from,
            }));
        }
        for (g, i) in self.intents.iter().enumerate() {
            if i.load(Ordering::Relaxed) & INTENT_OPEN != 0 {
                data.extend(encode(&Record::Intent {
                    group: g as u32,
                    open: true,
                }));
            }
        }
        if let Some(t) = table {
            let geo = t.geometry();
            for lu in 0..geo.units {
                let mut row: Option<(u32, Vec<u64>)> = None;
                for (slot, page) in t.live_in(lu) {
                    let (_, r, col) = geo.place(slot);
                    if row.as_ref().is_some_and(|(at, _)| *at != r) {
                        let (at, pages) = row.take().expect("checked");
                        data.extend(encode(&Record::LogRow {
                            unit: lu as u32,
                            row: at,
                            pages,
                        }));
                    }
                    row.get_or_insert_with(|| (r, vec![0; geo.cols as usize])).1[col as usize] =
                        page + 1;
                }
                if let Some((at, pages)) = row {
                    data.extend(encode(&Record::LogRow {
                        unit: lu as u32,
                        row: at,
                        pages,
                    }));
                }
            }
        }
        for r in unfound.ranges() {
            data.extend(encode(&Record::Unfound {
                first: r.start,
                count: r.end - r.start,
                lost: true,
            }));
        }
        data.extend(encode(&Record::End { units: n }));
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&data)
            .and_then(|_| f.sync_all())
            .map_err(io_err(&tmp))?;
        fs::rename(&tmp, self.dir.join(SNAPSHOT_FILE)).map_err(io_err(&tmp))?;
        fsync_dir(&self.dir)
    }

    // ---- write intent ----

    /// Marks home group `g` as being written. Call with its write lock
    /// held, before writing any of its members at home. Only a group not
    /// already open costs a journal append and a sync (so the mark is on
    /// disk before the first member changes); the rest is one atomic load.
    pub fn mark_written(&self, g: u64) -> Result<(), MapError> {
        let i = &self.intents[g as usize];
        let v = i.load(Ordering::Relaxed);
        if v == INTENT_OPEN | INTENT_TOUCHED {
            return Ok(());
        }
        if v & INTENT_OPEN != 0 {
            i.fetch_or(INTENT_TOUCHED, Ordering::Relaxed);
            return Ok(());
        }
        let jpath = || self.dir.join(JOURNAL_FILE);
        let journal = {
            let mut p = self.persist.lock_or_recover();
            self.append(
                &mut p,
                &Record::Intent {
                    group: g as u32,
                    open: true,
                },
            )?;
            // Set with `persist` held: a compaction from here on carries
            // the mark into its snapshot.
            i.store(INTENT_OPEN | INTENT_TOUCHED, Ordering::Relaxed);
            p.journal.try_clone().map_err(io_err(&jpath()))?
        };
        // Synced without `persist`, which every parity log row's record
        // needs: the sync waits for the disk.
        journal.sync_data().map_err(io_err(&jpath()))
    }

    /// Journals group `g`'s write intent closed: its members agree. Call
    /// with its write lock held.
    pub fn clear_intent(&self, g: u64) -> Result<(), MapError> {
        let mut p = self.persist.lock_or_recover();
        self.append(
            &mut p,
            &Record::Intent {
                group: g as u32,
                open: false,
            },
        )?;
        // Not synced: a close that is lost only costs a resync.
        self.intents[g as usize].store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Closes the intent of every open group not written since the last
    /// sweep (taking its write lock, so no write is in flight; a group
    /// whose lock is busy waits for the next sweep). Returns the open
    /// groups whose parity may not match their data, which stay open until
    /// the caller has resynced them: those whose lock is poisoned (a
    /// request panicked mid-write there) and those marked unsynced.
    pub fn sweep_intents(&self) -> Result<Vec<u64>, MapError> {
        self.close_intents(false)
    }

    /// At a clean stop, every request answered: closes the intent of
    /// every open group whose members agree (as `sweep_intents`, written
    /// lately or not), so the next start has nothing to resync but what
    /// it returns.
    pub fn close_all_intents(&self) -> Result<Vec<u64>, MapError> {
        self.close_intents(true)
    }

    fn close_intents(&self, touched_too: bool) -> Result<Vec<u64>, MapError> {
        let mut untrusted = Vec::new();
        for (g, i) in self.intents.iter().enumerate() {
            if i.load(Ordering::Relaxed) & INTENT_OPEN == 0 {
                continue;
            }
            let guard = match self.units[g].try_write() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(_)) => {
                    untrusted.push(g as u64);
                    continue;
                }
                Err(TryLockError::WouldBlock) => continue,
            };
            let v = i.load(Ordering::Relaxed);
            if v & INTENT_UNSYNCED != 0 {
                untrusted.push(g as u64);
            } else if v & INTENT_TOUCHED != 0 && !touched_too {
                i.fetch_and(!INTENT_TOUCHED, Ordering::Relaxed);
            } else {
                self.clear_intent(g as u64)?;
            }
            drop(guard);
        }
        Ok(untrusted)
    }

    /// Marks open group `g` unsynced: its resync failed, so its parity may
    /// not match its data until one succeeds ([`Self::clear_intent`]).
    /// Call with its write lock held.
    pub fn mark_unsynced(&self, g: u64) {
        self.intents[g as usize].fetch_or(INTENT_UNSYNCED, Ordering::Relaxed);
    }

    /// Whether unit `u` is a home group whose parity may not match its
    /// data ([`Self::mark_unsynced`]).
    pub fn is_unsynced(&self, u: u64) -> bool {
        self.intents
            .get(u as usize)
            .is_some_and(|i| i.load(Ordering::Relaxed) & INTENT_UNSYNCED != 0)
    }

    /// Home groups whose write intent is open (at start: those a crash may
    /// have left with parity that does not match their data).
    pub fn open_intents(&self) -> Vec<u64> {
        (0..self.intents.len() as u64)
            .filter(|&g| self.intents[g as usize].load(Ordering::Relaxed) & INTENT_OPEN != 0)
            .collect()
    }

    // ---- parity log ----

    /// The page table replayed at open, for the parity log to own (`None`
    /// the second time, or without a log).
    pub fn take_log_table(&self) -> Option<PageTable> {
        self.log_at_open.lock_or_recover().take()
    }

    /// Journals that rows `row..` of log unit `lu` hold `pages`, `cols`
    /// per row (the page table is already changed: `LogJournal::rows`).
    pub(crate) fn journal_log_rows(
        &self,
        lu: u64,
        row: u32,
        cols: usize,
        pages: &[Option<u64>],
    ) -> Result<(), MapError> {
        self.append_with(&mut self.persist.lock_or_recover(), |out| {
            for (r, cols) in (row..).zip(pages.chunks(cols)) {
                frame_into(out, |p| {
                    let pages = cols.iter().map(|p| p.map_or(0, |p| p + 1));
                    log_row_payload(p, lu as u32, r, pages)
                });
            }
        })
    }

    /// Journals that pages `[first, first + count)` left the log
    /// (`LogJournal::drop_pages`).
    pub(crate) fn journal_log_drop(&self, first: u64, count: u64) -> Result<(), MapError> {
        self.append(
            &mut self.persist.lock_or_recover(),
            &Record::LogDrop { first, count },
        )
    }

    // ---- unfound pages ----

    /// Whether any page is unfound: one relaxed load, for the I/O path.
    pub fn any_unfound(&self) -> bool {
        self.unfound_pages.load(Ordering::Relaxed) > 0
    }

    /// The first unfound page of `[first, first + count)`.
    pub fn first_unfound_in(&self, first: u64, count: u64) -> Option<u64> {
        if !self.any_unfound() {
            return None;
        }
        self.unfound
            .lock_or_recover()
            .first_in(first..first + count)
    }

    /// The unfound pages.
    pub fn unfound(&self) -> PageRanges {
        self.unfound.lock_or_recover().clone()
    }

    /// Journals pages `[first, first + count)` as unfound (`lost`: they
    /// read as lost until written) or found again (written, or forgotten);
    /// returns how many pages changed. Only a change is journaled.
    pub fn set_unfound(&self, first: u64, count: u64, lost: bool) -> Result<u64, MapError> {
        let changed = {
            let mut u = self.unfound.lock_or_recover();
            let changed = if lost {
                u.insert(first..first + count)
            } else {
                u.remove(first..first + count)
            };
            if changed == 0 {
                return Ok(0);
            }
            self.unfound_pages.store(u.pages(), Ordering::Relaxed);
            changed
        };
        self.append(
            &mut self.persist.lock_or_recover(),
            &Record::Unfound { first, count, lost },
        )?;
        Ok(changed)
    }

    // ---- starting afresh ----

    /// Forgets every placement, write intent, logged page and unfound page
    /// of the map in `dir` (created if missing), keeping its donors and
    /// their membership; their labels are dropped, so the next open clears
    /// their exports (what was stored there is garbage now). For a swap
    /// attach: swap's contents never outlive a detach, so an old map's
    /// lost extents must not be carried into the new swap area.
    pub fn start_empty(dir: &Path, layout: Layout) -> Result<(), MapError> {
        let map = ExtentMap::open(dir, layout)?;
        {
            let mut p = map.persist.lock_or_recover();
            for u in &mut p.mirror {
                *u = None;
            }
            p.parity_held.clear();
            p.moving.clear();
            for d in &mut p.donors {
                d.label = 0;
            }
        }
        for i in &map.intents {
            i.store(0, Ordering::Relaxed);
        }
        *map.unfound.lock_or_recover() = PageRanges::default();
        map.unfound_pages.store(0, Ordering::Relaxed);
        // No page table: the snapshot logs no page.
        map.compact(None)
    }

    // ---- donors ----

    /// The map id of donor `name`, registering (and journaling) it if new.
    pub fn donor_id(&self, name: &str) -> Result<u16, MapError> {
        let mut p = self.persist.lock_or_recover();
        if let Some(i) = p.donors.iter().position(|d| d.name == name) {
            return Ok(i as u16);
        }
        let id = u16::try_from(p.donors.len()).map_err(|_| MapError::TooManyDonors)?;
        let entry = DonorEntry {
            name: name.to_string(),
            label: 0,
            member: None,
        };
        self.append_donor(&mut p, id, &entry)?;
        p.donors.push(entry);
        self.slots.lock_or_recover().donors.push(SlotSet::new(1));
        Ok(id)
    }

    pub fn donor_label(&self, id: u16) -> u128 {
        self.persist.lock_or_recover().donors[id as usize].label
    }

    /// Records which incarnation of donor `id`'s export holds our data.
    pub fn set_donor_label(&self, id: u16, label: u128) -> Result<(), MapError> {
        let mut p = self.persist.lock_or_recover();
        let mut entry = p.donors[id as usize].clone();
        entry.label = label;
        self.append_donor(&mut p, id, &entry)?;
        p.donors[id as usize] = entry;
        Ok(())
    }

    /// Journals donor `id`'s membership.
    pub fn set_donor_member(&self, id: u16, member: MemberRecord) -> Result<(), MapError> {
        let mut p = self.persist.lock_or_recover();
        let mut entry = p.donors[id as usize].clone();
        entry.member = Some(member);
        self.append_donor(&mut p, id, &entry)?;
        p.donors[id as usize] = entry;
        Ok(())
    }

    /// Every donor the map has recorded, by id.
    pub fn donor_entries(&self) -> Vec<DonorEntry> {
        self.persist.lock_or_recover().donors.clone()
    }

    fn append_donor(&self, p: &mut Persist, id: u16, entry: &DonorEntry) -> Result<(), MapError> {
        self.append(
            p,
            &Record::Donor {
                id,
                entry: entry.clone(),
            },
        )
    }

    fn append(&self, p: &mut Persist, r: &Record) -> Result<(), MapError> {
        self.append_with(p, |out| encode_into(r, out))
    }

    /// Appends the records `encode` writes, in one write, encoded in the
    /// journal's reused buffer.
    fn append_with(
        &self,
        p: &mut Persist,
        encode: impl FnOnce(&mut Vec<u8>),
    ) -> Result<(), MapError> {
        let mut buf = std::mem::take(&mut p.scratch);
        buf.clear();
        encode(&mut buf);
        // The path is built only for an error: this runs for every small
        // write to the parity log.
        let res = p
            .journal
            .write_all(&buf)
            .map_err(|e| io_err(&self.dir.join(JOURNAL_FILE))(e));
        if res.is_ok() {
            p.journal_bytes += buf.len() as u64;
        }
        p.scratch = buf;
        res
    }
}

/// Adds (or, with `add` false, takes away) unit `u`'s parity members on
/// donors to `held`, by donor id.
pub(super) fn count_parity(
    layout: &Layout,
    u: u64,
    unit: Option<&Unit>,
    held: &mut Vec<u64>,
    add: bool,
) {
    let Some(unit) = unit.filter(|_| layout.mode.striped()) else {
        return;
    };
    let (w, p) = (layout.members(), layout.parity_member(u));
    for j in 0..layout.parity_count() {
        let Some(Member {
            loc: Loc::Donor { donor, .. },
            ..
        }) = unit.members.get((p + j) % w)
        else {
            continue;
        };
        let i = *donor as usize;
        if held.len() <= i {
            held.resize(i + 1, 0);
        }
        held[i] = if add {
            held[i] + 1
        } else {
            held[i].saturating_sub(1)
        };
    }
}
