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

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, RwLock};

use crate::config::{DeviceConfig, Mode};
use crate::page_log::{LogGeometry, PageTable, Slot, PAGE};

pub const SNAPSHOT_FILE: &str = "map.snap";
pub const JOURNAL_FILE: &str = "map.journal";
const MAGIC: &[u8; 8] = b"NPMAP001";
/// Initial size of the journal's record buffer: a parity log leader's
/// records (8 rows of up to 31 pages) fit.
const JOURNAL_SCRATCH: usize = 4096;
/// The journal is compacted into a snapshot once it grows past this.
pub const COMPACT_AFTER_BYTES: u64 = 4 << 20;

/// Redundancy of the map's units (the config's mode without its paths).
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
    fn code(self) -> (u8, u32) {
        match self {
            Redundancy::None => (0, 1),
            Redundancy::Mirror => (1, 2),
            Redundancy::Parity { width } => (2, width),
            Redundancy::Disk => (3, 1),
            Redundancy::Ec { data, parity } => (4, data | parity << 16),
        }
    }

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
        let mode = match cfg.mode {
            Mode::None => Redundancy::None,
            Mode::Mirror => Redundancy::Mirror,
            Mode::Parity { width } => Redundancy::Parity { width },
            Mode::Disk { .. } => Redundancy::Disk,
            Mode::Ec { data, parity } => Redundancy::Ec { data, parity },
        };
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
        match self.mode {
            Redundancy::Parity { width } => width as u64 - 1,
            Redundancy::Ec { data, .. } => data as u64,
            _ => 1,
        }
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
        match self.mode {
            Redundancy::None | Redundancy::Disk => 1,
            Redundancy::Mirror => 2,
            Redundancy::Parity { width } => width as usize,
            Redundancy::Ec { data, parity } => (data + parity) as usize,
        }
    }

    /// Parity extents per group (0 when not striped).
    pub fn parity_count(&self) -> usize {
        match self.mode {
            Redundancy::Parity { .. } => 1,
            Redundancy::Ec { parity, .. } => parity as usize,
            _ => 0,
        }
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

/// A donor as the map knows it: ids are stable across restarts and config
/// changes, the label says which incarnation of our export holds our data
/// (0: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DonorEntry {
    pub name: String,
    pub label: u128,
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

// ---- record encoding -------------------------------------------------------

const CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// CRC-32 (IEEE 802.3).
pub fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

#[derive(Debug, Clone, PartialEq)]
enum Record {
    Header {
        generation: u64,
        layout: Layout,
    },
    Donor {
        id: u16,
        entry: DonorEntry,
    },
    Unit {
        index: u32,
        unit: Option<Unit>,
    },
    End {
        units: u64,
    },
    /// Row `row` of log unit `unit` holds these pages (page + 1 per data
    /// column, 0 for an unused column).
    LogRow {
        unit: u32,
        row: u32,
        pages: Vec<u64>,
    },
    /// Pages `[first, first + count)` are at home again.
    LogDrop {
        first: u64,
        count: u64,
    },
}

/// Appends one framed record to `out`: length, CRC, then the payload that
/// `payload` writes.
fn frame_into(out: &mut Vec<u8>, payload: impl FnOnce(&mut Vec<u8>)) {
    let at = out.len();
    out.extend_from_slice(&[0; 8]);
    payload(out);
    let len = (out.len() - at - 8) as u32;
    let crc = crc32(&out[at + 8..]);
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    out[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
}

/// A `Record::LogRow` payload; the journal writes it straight from a row's
/// page list, without building the record's vector.
fn log_row_payload(
    p: &mut Vec<u8>,
    unit: u32,
    row: u32,
    pages: impl ExactSizeIterator<Item = u64>,
) {
    p.push(5);
    p.extend_from_slice(&unit.to_le_bytes());
    p.extend_from_slice(&row.to_le_bytes());
    p.push(pages.len() as u8);
    for pg in pages {
        p.extend_from_slice(&pg.to_le_bytes());
    }
}

fn encode(r: &Record) -> Vec<u8> {
    let mut v = Vec::new();
    encode_into(r, &mut v);
    v
}

fn encode_into(r: &Record, out: &mut Vec<u8>) {
    frame_into(out, |p| encode_payload(r, p));
}

fn encode_payload(r: &Record, p: &mut Vec<u8>) {
    match r {
        Record::Header { generation, layout } => {
            let (m, w) = layout.mode.code();
            p.push(1);
            p.extend_from_slice(MAGIC);
            p.extend_from_slice(&generation.to_le_bytes());
            p.extend_from_slice(&layout.size.to_le_bytes());
            p.extend_from_slice(&layout.extent.to_le_bytes());
            p.push(m);
            p.extend_from_slice(&w.to_le_bytes());
            p.extend_from_slice(&layout.log_units.to_le_bytes());
        }
        Record::Donor { id, entry } => {
            p.push(2);
            p.extend_from_slice(&id.to_le_bytes());
            p.extend_from_slice(&entry.label.to_le_bytes());
            p.extend_from_slice(&(entry.name.len() as u16).to_le_bytes());
            p.extend_from_slice(entry.name.as_bytes());
        }
        Record::Unit { index, unit } => {
            p.push(3);
            p.extend_from_slice(&index.to_le_bytes());
            let members = unit.as_ref().map(|u| u.members.as_slice()).unwrap_or(&[]);
            p.push(members.len() as u8);
            for m in members {
                let (kind, donor, slot) = match m.loc {
                    Loc::Donor { donor, slot } => (0u8, donor, slot),
                    Loc::Fallback { slot } => (1u8, 0, slot),
                };
                p.push(kind);
                p.extend_from_slice(&donor.to_le_bytes());
                p.extend_from_slice(&slot.to_le_bytes());
                p.push(match m.state {
                    CopyState::Ok => 0,
                    CopyState::Lost => 1,
                    CopyState::Rebuilding => 2,
                });
            }
        }
        Record::End { units } => {
            p.push(4);
            p.extend_from_slice(&units.to_le_bytes());
        }
        Record::LogRow { unit, row, pages } => {
            log_row_payload(p, *unit, *row, pages.iter().copied());
        }
        Record::LogDrop { first, count } => {
            p.push(6);
            p.extend_from_slice(&first.to_le_bytes());
            p.extend_from_slice(&count.to_le_bytes());
        }
    }
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("record too short".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn u128(&mut self) -> Result<u128, String> {
        Ok(u128::from_le_bytes(
            self.take(16)?.try_into().expect("16 bytes"),
        ))
    }
}

fn decode(payload: &[u8]) -> Result<Record, String> {
    let mut c = Cursor(payload);
    let r = match c.u8()? {
        1 => {
            if c.take(8)? != MAGIC {
                return Err("bad magic".into());
            }
            let generation = c.u64()?;
            let size = c.u64()?;
            let extent = c.u64()?;
            let mode = match (c.u8()?, c.u32()?) {
                (0, _) => Redundancy::None,
                (1, _) => Redundancy::Mirror,
                (2, width) => Redundancy::Parity { width },
                (3, _) => Redundancy::Disk,
                (4, w) => Redundancy::Ec {
                    data: w & 0xffff,
                    parity: w >> 16,
                },
                (m, _) => return Err(format!("unknown mode {m}")),
            };
            // Maps written before the parity log have no log units.
            let log_units = if c.0.is_empty() { 0 } else { c.u64()? };
            Record::Header {
                generation,
                layout: Layout {
                    size,
                    extent,
                    mode,
                    log_units,
                },
            }
        }
        2 => {
            let id = c.u16()?;
            let label = c.u128()?;
            let n = c.u16()? as usize;
            let name = String::from_utf8(c.take(n)?.to_vec())
                .map_err(|_| "donor name is not UTF-8".to_string())?;
            Record::Donor {
                id,
                entry: DonorEntry { name, label },
            }
        }
        3 => {
            let index = c.u32()?;
            let n = c.u8()? as usize;
            let mut members = Vec::with_capacity(n);
            for _ in 0..n {
                let kind = c.u8()?;
                let donor = c.u16()?;
                let slot = c.u32()?;
                let loc = match kind {
                    0 => Loc::Donor { donor, slot },
                    1 => Loc::Fallback { slot },
                    k => return Err(format!("unknown location kind {k}")),
                };
                let state = match c.u8()? {
                    0 => CopyState::Ok,
                    1 => CopyState::Lost,
                    2 => CopyState::Rebuilding,
                    s => return Err(format!("unknown copy state {s}")),
                };
                members.push(Member { loc, state });
            }
            Record::Unit {
                index,
                unit: (n > 0).then_some(Unit { members }),
            }
        }
        4 => Record::End { units: c.u64()? },
        5 => {
            let unit = c.u32()?;
            let row = c.u32()?;
            let n = c.u8()? as usize;
            let pages = (0..n).map(|_| c.u64()).collect::<Result<_, _>>()?;
            Record::LogRow { unit, row, pages }
        }
        6 => Record::LogDrop {
            first: c.u64()?,
            count: c.u64()?,
        },
        t => return Err(format!("unknown record type {t}")),
    };
    if !c.0.is_empty() {
        return Err("trailing bytes in record".into());
    }
    Ok(r)
}

/// Splits a file into records; stops at the first torn or corrupt one and
/// returns the byte offset where the valid prefix ends with the reason.
fn parse_records(data: &[u8]) -> (Vec<Record>, usize, Option<String>) {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < data.len() {
        if data.len() - off < 8 {
            return (out, off, Some("truncated record header".into()));
        }
        let len = u32::from_le_bytes(data[off..off + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(data[off + 4..off + 8].try_into().expect("4 bytes"));
        let Some(payload) = data.get(off + 8..off + 8 + len) else {
            return (
                out,
                off,
                Some(format!(
                    "record of {len} bytes runs past the end of the file"
                )),
            );
        };
        if crc32(payload) != crc {
            return (out, off, Some("checksum mismatch".into()));
        }
        match decode(payload) {
            Ok(r) => out.push(r),
            Err(e) => return (out, off, Some(e)),
        }
        off += 8 + len;
    }
    (out, off, None)
}

// ---- slots -----------------------------------------------------------------

/// Used slots of one export (or of the fallback file).
#[derive(Debug, Clone, Default)]
struct SlotSet {
    bits: Vec<u64>,
    capacity: u32,
    used: u32,
    /// Slots below this are reserved (slot 0 of a donor export holds the
    /// donor label).
    reserved: u32,
    /// Every slot below `hint` is used.
    hint: u32,
    /// Slots from here up have not been written since the export (or file)
    /// was last cleared, so they read as zeros.
    clean_from: u32,
}

impl SlotSet {
    fn new(reserved: u32) -> SlotSet {
        SlotSet {
            reserved,
            clean_from: u32::MAX,
            ..Default::default()
        }
    }

    fn is_used(&self, s: u32) -> bool {
        self.bits
            .get((s / 64) as usize)
            .is_some_and(|w| w & (1 << (s % 64)) != 0)
    }

    fn mark(&mut self, s: u32) -> bool {
        let w = (s / 64) as usize;
        if self.bits.len() <= w {
            self.bits.resize(w + 1, 0);
        }
        if self.is_used(s) {
            return false;
        }
        self.bits[w] |= 1 << (s % 64);
        self.used += 1;
        true
    }

    fn free(&mut self, s: u32) {
        if self.is_used(s) {
            self.bits[(s / 64) as usize] &= !(1 << (s % 64));
            self.used -= 1;
            self.hint = self.hint.min(s);
        }
    }

    /// The lowest free slot, and whether it is known to read as zeros.
    fn alloc(&mut self) -> Option<(u32, bool)> {
        let start = self.hint.max(self.reserved);
        let s = (start..self.capacity).find(|&s| !self.is_used(s))?;
        self.mark(s);
        self.hint = s + 1;
        let clean = s >= self.clean_from;
        if clean {
            self.clean_from = s + 1;
        }
        Some((s, clean))
    }

    fn mark_free_clean(&mut self) {
        let top = (0..self.bits.len() as u32 * 64)
            .rev()
            .find(|&s| self.is_used(s))
            .map_or(0, |s| s + 1);
        self.clean_from = top.max(self.reserved);
    }

    fn available(&self) -> u32 {
        let in_range = (self.reserved..self.capacity)
            .filter(|&s| self.is_used(s))
            .count() as u32;
        self.capacity
            .saturating_sub(self.reserved)
            .saturating_sub(in_range)
    }

    fn clear(&mut self) {
        self.bits.clear();
        self.used = 0;
        self.hint = 0;
        self.clean_from = u32::MAX;
    }
}

struct Slots {
    donors: Vec<SlotSet>,
    fallback: SlotSet,
}

/// Where to allocate a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotOwner {
    Donor(u16),
    Fallback,
}

// ---- the map ---------------------------------------------------------------

struct Persist {
    journal: File,
    journal_bytes: u64,
    generation: u64,
    mirror: Vec<Option<Unit>>,
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
    persist: Mutex<Persist>,
    slots: Mutex<Slots>,
    /// The parity log's page table. Changes update it, release it, then
    /// append to the journal; only compaction holds both (`persist` first).
    log: Option<Mutex<PageTable>>,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Replay {
    units: Vec<Option<Unit>>,
    donors: Vec<DonorEntry>,
    log: Option<PageTable>,
}

impl Replay {
    fn apply(&mut self, r: Record, layout: &Layout) -> Result<(), String> {
        match r {
            Record::Header { .. } | Record::End { .. } => {
                Err("unexpected header or end record".into())
            }
            Record::Donor { id, entry } => {
                let id = id as usize;
                if id > self.donors.len() {
                    return Err(format!("donor id {id} skips ids"));
                }
                if id == self.donors.len() {
                    self.donors.push(entry);
                } else {
                    self.donors[id] = entry;
                }
                Ok(())
            }
            Record::Unit { index, unit } => {
                let slot = self.units.get_mut(index as usize).ok_or_else(|| {
                    format!("unit {index} is beyond the map's {} units", layout.units())
                })?;
                if let Some(u) = &unit {
                    if u.members.len() > layout.members() {
                        return Err(format!("unit {index} has {} members", u.members.len()));
                    }
                    for m in &u.members {
                        if let Loc::Donor { donor, .. } = m.loc {
                            if donor as usize >= self.donors.len() {
                                return Err(format!("unit {index} names unknown donor id {donor}"));
                            }
                        }
                    }
                }
                let freed_log_unit = unit.is_none() && index as u64 >= layout.home_units();
                *slot = unit;
                if let (true, Some(t)) = (freed_log_unit, self.log.as_mut()) {
                    t.clear_unit(index as u64 - layout.home_units());
                }
                Ok(())
            }
            Record::LogRow { unit, row, pages } => {
                let t = self
                    .log
                    .as_mut()
                    .ok_or("a parity log row, but the map has no parity log")?;
                let geo = t.geometry();
                if unit as u64 >= geo.units || row >= geo.rows || pages.len() != geo.cols as usize {
                    return Err(format!(
                        "log row {row} of log unit {unit} with {} columns does not fit the log ({} units of {} rows of {} columns)",
                        pages.len(),
                        geo.units,
                        geo.rows,
                        geo.cols
                    ));
                }
                for (col, &p) in pages.iter().enumerate() {
                    if p == 0 {
                        continue;
                    }
                    if p > t.pages() {
                        return Err(format!("log row names page {} of {}", p - 1, t.pages()));
                    }
                    t.set(p - 1, geo.slot(unit as u64, row, col as u32));
                }
                Ok(())
            }
            Record::LogDrop { first, count } => {
                let t = self
                    .log
                    .as_mut()
                    .ok_or("a parity log drop, but the map has no parity log")?;
                if first.checked_add(count).is_none_or(|end| end > t.pages()) {
                    return Err(format!(
                        "log drop of pages {first}+{count} is past the device's {} pages",
                        t.pages()
                    ));
                }
                for p in first..first + count {
                    t.unset(p);
                }
                Ok(())
            }
        }
    }
}

fn check_layout(path: &Path, stored: &Layout, want: &Layout) -> Result<(), MapError> {
    let mm = |field, s: String, c: String| {
        Err(MapError::Mismatch {
            path: path.to_path_buf(),
            field,
            stored: s,
            configured: c,
        })
    };
    if stored.size != want.size {
        return mm("size", stored.size.to_string(), want.size.to_string());
    }
    if stored.extent != want.extent {
        return mm(
            "extent_size",
            stored.extent.to_string(),
            want.extent.to_string(),
        );
    }
    if stored.mode != want.mode {
        return mm(
            "mode",
            format!("{:?}", stored.mode),
            format!("{:?}", want.mode),
        );
    }
    if stored.log_units != want.log_units {
        let bytes = |l: &Layout| (l.log_units * l.extent * l.data_per_unit()).to_string();
        return mm("parity_log", bytes(stored), bytes(want));
    }
    Ok(())
}

impl ExtentMap {
    /// Opens (or creates) the map in `dir` for `layout`, recovering from
    /// the snapshot and the journal's valid prefix.
    pub fn open(dir: &Path, layout: Layout) -> Result<ExtentMap, MapError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let snap_path = dir.join(SNAPSHOT_FILE);
        let jpath = dir.join(JOURNAL_FILE);
        let pages = layout.size / PAGE;
        let mut st = Replay {
            units: vec![None; layout.units() as usize],
            donors: Vec::new(),
            log: layout.log_geometry().and_then(|g| PageTable::new(g, pages)),
        };

        let mut generation = 0u64;
        match fs::read(&snap_path) {
            Ok(data) => {
                let (recs, end, err) = parse_records(&data);
                let corrupt = |offset: usize, reason: String| MapError::Corrupt {
                    path: snap_path.clone(),
                    offset: offset as u64,
                    reason,
                };
                if let Some(reason) = err {
                    return Err(corrupt(end, reason));
                }
                let mut it = recs.into_iter();
                match it.next() {
                    Some(Record::Header {
                        generation: g,
                        layout: l,
                    }) => {
                        check_layout(&snap_path, &l, &layout)?;
                        generation = g;
                    }
                    _ => return Err(corrupt(0, "snapshot does not start with a header".into())),
                }
                let mut ended = false;
                let mut seen = 0u64;
                for r in it {
                    if ended {
                        return Err(corrupt(end, "records after the end record".into()));
                    }
                    match r {
                        Record::End { units } => {
                            if units != seen {
                                return Err(corrupt(
                                    end,
                                    format!("end record counts {units} units, found {seen}"),
                                ));
                            }
                            ended = true;
                        }
                        r => {
                            if matches!(r, Record::Unit { .. }) {
                                seen += 1;
                            }
                            st.apply(r, &layout).map_err(|e| corrupt(end, e))?;
                        }
                    }
                }
                if !ended {
                    return Err(corrupt(end, "snapshot has no end record".into()));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&snap_path)(e)),
        }

        let mut fresh_journal = true;
        match fs::read(&jpath) {
            Ok(data) => {
                let (recs, end, err) = parse_records(&data);
                let mut it = recs.into_iter();
                match it.next() {
                    Some(Record::Header {
                        generation: g,
                        layout: l,
                    }) if g == generation => {
                        check_layout(&jpath, &l, &layout)?;
                        let mut offset = encode(&Record::Header {
                            generation: g,
                            layout: l,
                        })
                        .len();
                        let mut kept = 0usize;
                        for r in it {
                            let len = encode(&r).len();
                            if let Err(reason) = st.apply(r, &layout) {
                                return Err(MapError::Corrupt {
                                    path: jpath.clone(),
                                    offset: offset as u64,
                                    reason,
                                });
                            }
                            offset += len;
                            kept += 1;
                        }
                        if let Some(reason) = err {
                            tracing::warn!(
                                "{}: discarding torn tail at byte {end} of {} ({reason}); the map keeps the {kept} records before it",
                                jpath.display(),
                                data.len(),
                            );
                        }
                        let f = OpenOptions::new()
                            .write(true)
                            .open(&jpath)
                            .map_err(io_err(&jpath))?;
                        f.set_len(end as u64)
                            .and_then(|_| f.sync_all())
                            .map_err(io_err(&jpath))?;
                        fresh_journal = false;
                    }
                    Some(Record::Header { generation: g, .. }) if g < generation => {
                        tracing::info!(
                            "{}: generation {g} is already folded into snapshot generation {generation}; starting a new journal",
                            jpath.display()
                        );
                    }
                    Some(Record::Header { generation: g, .. }) => {
                        return Err(MapError::Corrupt {
                            path: jpath.clone(),
                            offset: 0,
                            reason: format!(
                                "journal generation {g} is newer than the snapshot's {generation}"
                            ),
                        });
                    }
                    _ => {
                        tracing::warn!(
                            "{}: no valid header; starting a new journal",
                            jpath.display()
                        );
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&jpath)(e)),
        }
        if fresh_journal {
            write_journal_header(dir, generation, &layout)?;
        }
        let journal = OpenOptions::new()
            .append(true)
            .open(&jpath)
            .map_err(io_err(&jpath))?;
        let journal_bytes = journal.metadata().map_err(io_err(&jpath))?.len();

        // A copy that was being rebuilt when we stopped is incomplete.
        for u in st.units.iter_mut().flatten() {
            for m in &mut u.members {
                if m.state == CopyState::Rebuilding {
                    m.state = CopyState::Lost;
                }
            }
        }
        let mut slots = Slots {
            donors: vec![SlotSet::new(1); st.donors.len()],
            fallback: SlotSet::new(0),
        };
        for (i, u) in st.units.iter().enumerate() {
            for m in u
                .iter()
                .flat_map(|u| &u.members)
                .filter(|m| m.state == CopyState::Ok)
            {
                let fresh = match m.loc {
                    Loc::Donor { donor, slot } => slots.donors[donor as usize].mark(slot),
                    Loc::Fallback { slot } => slots.fallback.mark(slot),
                };
                if !fresh {
                    tracing::warn!("extent map: unit {i} shares {:?} with another unit", m.loc);
                }
            }
        }
        Ok(ExtentMap {
            layout,
            dir: dir.to_path_buf(),
            units: st.units.iter().cloned().map(RwLock::new).collect(),
            persist: Mutex::new(Persist {
                journal,
                journal_bytes,
                generation,
                mirror: st.units,
                donors: st.donors,
                scratch: Vec::with_capacity(JOURNAL_SCRATCH),
            }),
            slots: Mutex::new(slots),
            log: st.log.map(Mutex::new),
        })
    }

    /// The lock guarding unit `u`'s placement. Hold it (read) during I/O on
    /// the unit and (write) while changing its placement.
    pub fn unit(&self, u: u64) -> &RwLock<Option<Unit>> {
        &self.units[u as usize]
    }

    /// Journals unit `u`'s new placement. Call with `u`'s write lock held,
    /// after the data is where the placement says.
    pub fn commit(&self, u: u64, unit: &Option<Unit>) -> Result<(), MapError> {
        let rec = encode(&Record::Unit {
            index: u as u32,
            unit: unit.clone(),
        });
        let mut p = lock(&self.persist);
        let path = self.dir.join(JOURNAL_FILE);
        p.journal.write_all(&rec).map_err(io_err(&path))?;
        p.journal_bytes += rec.len() as u64;
        p.mirror[u as usize] = unit.clone();
        Ok(())
    }

    /// Makes every committed change durable.
    pub fn sync(&self) -> Result<(), MapError> {
        let p = lock(&self.persist);
        p.journal
            .sync_data()
            .map_err(io_err(&self.dir.join(JOURNAL_FILE)))
    }

    pub fn needs_compaction(&self) -> bool {
        lock(&self.persist).journal_bytes > COMPACT_AFTER_BYTES
    }

    /// Folds the journal into a new snapshot and starts a new journal.
    pub fn compact(&self) -> Result<(), MapError> {
        // The table is copied with the journal held: a change made after
        // the copy is appended to the new journal (replaying it twice is
        // harmless), never to the old one.
        let mut p = lock(&self.persist);
        let table = self.log.as_ref().map(|t| lock(t).clone());
        let g = p.generation + 1;
        self.write_snapshot(&p, table.as_ref(), g)?;
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
        data.extend(encode(&Record::End { units: n }));
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&data)
            .and_then(|_| f.sync_all())
            .map_err(io_err(&tmp))?;
        fs::rename(&tmp, self.dir.join(SNAPSHOT_FILE)).map_err(io_err(&tmp))?;
        fsync_dir(&self.dir)
    }

    // ---- parity log ----

    fn table(&self) -> Option<MutexGuard<'_, PageTable>> {
        self.log.as_ref().map(lock)
    }

    /// The parity log's shape, if the map has one.
    pub fn log_geometry(&self) -> Option<LogGeometry> {
        self.table().map(|t| t.geometry())
    }

    /// Where `page` lives in the log, if it does.
    pub fn log_lookup(&self, page: u64) -> Option<Slot> {
        self.table().and_then(|t| t.lookup(page))
    }

    /// Whether any page of `[first, first + count)` is in the log.
    pub fn log_any_in(&self, first: u64, count: u64) -> bool {
        self.table().is_some_and(|t| t.any_in(first, count))
    }

    /// Pages in the log, and live pages of each log unit.
    pub fn log_census(&self) -> (u64, Vec<u32>) {
        match self.table() {
            Some(t) => (
                t.logged(),
                (0..t.geometry().units).map(|u| t.live(u)).collect(),
            ),
            None => (0, Vec::new()),
        }
    }

    /// Live `(slot, page)` pairs of log unit `lu`.
    pub fn log_live_in(&self, lu: u64) -> Vec<(Slot, u64)> {
        self.table().map(|t| t.live_in(lu)).unwrap_or_default()
    }

    /// Journals that rows `row..` of log unit `lu` now hold `pages` (one
    /// per data column, row after row; `None` for unused columns). Call
    /// with the home groups of those pages write-locked, after the rows are
    /// on the donors.
    pub fn log_rows(&self, lu: u64, row: u32, pages: &[Option<u64>]) -> Result<(), MapError> {
        let Some(t) = self.log.as_ref() else {
            return Ok(());
        };
        let cols = {
            let mut t = lock(t);
            let geo = t.geometry();
            for (r, cols) in (row..).zip(pages.chunks(geo.cols as usize)) {
                for (col, p) in cols.iter().enumerate() {
                    if let Some(p) = p {
                        t.set(*p, geo.slot(lu, r, col as u32));
                    }
                }
            }
            geo.cols as usize
        };
        self.append_with(&mut lock(&self.persist), |out| {
            for (r, cols) in (row..).zip(pages.chunks(cols)) {
                frame_into(out, |p| {
                    let pages = cols.iter().map(|p| p.map_or(0, |p| p + 1));
                    log_row_payload(p, lu as u32, r, pages)
                });
            }
        })
    }

    /// Journals that pages `[first, first + count)` are at home again (they
    /// were just written there). Call with their home group write-locked.
    pub fn log_drop(&self, first: u64, count: u64) -> Result<(), MapError> {
        let Some(t) = self.log.as_ref() else {
            return Ok(());
        };
        {
            let mut t = lock(t);
            if !t.any_in(first, count) {
                return Ok(());
            }
            for p in first..first + count {
                t.unset(p);
            }
        }
        self.append(&mut lock(&self.persist), &Record::LogDrop { first, count })
    }

    // ---- donors ----

    /// The map id of donor `name`, registering (and journaling) it if new.
    pub fn donor_id(&self, name: &str) -> Result<u16, MapError> {
        let mut p = lock(&self.persist);
        if let Some(i) = p.donors.iter().position(|d| d.name == name) {
            return Ok(i as u16);
        }
        let id = u16::try_from(p.donors.len()).map_err(|_| MapError::TooManyDonors)?;
        let entry = DonorEntry {
            name: name.to_string(),
            label: 0,
        };
        self.append(
            &mut p,
            &Record::Donor {
                id,
                entry: entry.clone(),
            },
        )?;
        p.donors.push(entry);
        lock(&self.slots).donors.push(SlotSet::new(1));
        Ok(id)
    }

    pub fn donor_label(&self, id: u16) -> u128 {
        lock(&self.persist).donors[id as usize].label
    }

    /// Records which incarnation of donor `id`'s export holds our data.
    pub fn set_donor_label(&self, id: u16, label: u128) -> Result<(), MapError> {
        let mut p = lock(&self.persist);
        let mut entry = p.donors[id as usize].clone();
        entry.label = label;
        self.append(
            &mut p,
            &Record::Donor {
                id,
                entry: entry.clone(),
            },
        )?;
        p.donors[id as usize] = entry;
        Ok(())
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

    // ---- slots ----

    /// Sets how many extent slots donor `id`'s export (or, with `None`, the
    /// fallback file) has.
    pub fn set_capacity(&self, owner: SlotOwner, slots: u32) {
        let mut s = lock(&self.slots);
        match owner {
            SlotOwner::Donor(id) => s.donors[id as usize].capacity = slots,
            SlotOwner::Fallback => s.fallback.capacity = slots,
        }
    }

    /// Takes a free slot, or `None` when the export or file is full; the
    /// flag says whether the slot is known to read as zeros.
    pub fn alloc(&self, owner: SlotOwner) -> Option<(Loc, bool)> {
        let mut s = lock(&self.slots);
        match owner {
            SlotOwner::Donor(donor) => s.donors[donor as usize]
                .alloc()
                .map(|(slot, clean)| (Loc::Donor { donor, slot }, clean)),
            SlotOwner::Fallback => s
                .fallback
                .alloc()
                .map(|(slot, clean)| (Loc::Fallback { slot }, clean)),
        }
    }

    /// Declares every free slot of `owner` clean: its export (or file) was
    /// just cleared.
    pub fn mark_free_slots_clean(&self, owner: SlotOwner) {
        let mut s = lock(&self.slots);
        match owner {
            SlotOwner::Donor(id) => s.donors[id as usize].mark_free_clean(),
            SlotOwner::Fallback => s.fallback.mark_free_clean(),
        }
    }

    /// Returns a slot (its old contents must be zeroed or trimmed before
    /// partial reuse; the device zeroes at allocation).
    pub fn free(&self, loc: Loc) {
        let mut s = lock(&self.slots);
        match loc {
            Loc::Donor { donor, slot } => s.donors[donor as usize].free(slot),
            Loc::Fallback { slot } => s.fallback.free(slot),
        }
    }

    /// Forgets every slot of donor `id` (it died: all its members are Lost,
    /// and if it comes back it is a new donor).
    pub fn forget_donor_slots(&self, id: u16) {
        lock(&self.slots).donors[id as usize].clear();
    }

    /// Slots in use and slots still free.
    pub fn slot_usage(&self, owner: SlotOwner) -> (u32, u32) {
        let s = lock(&self.slots);
        let set = match owner {
            SlotOwner::Donor(id) => &s.donors[id as usize],
            SlotOwner::Fallback => &s.fallback,
        };
        (set.used, set.available())
    }
}

fn write_journal_header(dir: &Path, generation: u64, layout: &Layout) -> Result<(), MapError> {
    let jpath = dir.join(JOURNAL_FILE);
    let tmp = dir.join(format!("{JOURNAL_FILE}.tmp"));
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(&encode(&Record::Header {
        generation,
        layout: *layout,
    }))
    .and_then(|_| f.sync_all())
    .map_err(io_err(&tmp))?;
    fs::rename(&tmp, &jpath).map_err(io_err(&tmp))?;
    fsync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            size: 16 << 20,
            extent: 1 << 20,
            mode: Redundancy::Mirror,
            log_units: 0,
        }
    }

    fn unit(d0: u16, s0: u32, d1: u16, s1: u32) -> Option<Unit> {
        Some(Unit {
            members: vec![
                Member {
                    loc: Loc::Donor {
                        donor: d0,
                        slot: s0,
                    },
                    state: CopyState::Ok,
                },
                Member {
                    loc: Loc::Donor {
                        donor: d1,
                        slot: s1,
                    },
                    state: CopyState::Ok,
                },
            ],
        })
    }

    fn get(m: &ExtentMap, u: u64) -> Option<Unit> {
        m.unit(u).read().unwrap().clone()
    }

    #[test]
    fn crc_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

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

    #[test]
    fn journal_survives_reopen_and_rebuilds_slots() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = ExtentMap::open(dir.path(), layout()).unwrap();
            let a = m.donor_id("a").unwrap();
            let b = m.donor_id("b").unwrap();
            m.set_capacity(SlotOwner::Donor(a), 8);
            m.set_capacity(SlotOwner::Donor(b), 8);
            assert_eq!(
                m.alloc(SlotOwner::Donor(a)),
                Some((Loc::Donor { donor: a, slot: 1 }, false))
            );
            m.commit(3, &unit(a, 1, b, 5)).unwrap();
            m.set_donor_label(a, 77).unwrap();
        }
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 3), unit(0, 1, 1, 5));
        assert_eq!(m.donor_label(0), 77);
        assert_eq!(m.donor_id("b").unwrap(), 1);
        m.set_capacity(SlotOwner::Donor(0), 8);
        // slot 0 is the label, slot 1 is taken by unit 3.
        assert_eq!(
            m.alloc(SlotOwner::Donor(0)).unwrap().0,
            Loc::Donor { donor: 0, slot: 2 }
        );
        assert_eq!(m.slot_usage(SlotOwner::Donor(1)).0, 1);
    }

    #[test]
    fn torn_journal_tail_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = ExtentMap::open(dir.path(), layout()).unwrap();
            m.donor_id("a").unwrap();
            m.donor_id("b").unwrap();
            m.commit(1, &unit(0, 1, 1, 1)).unwrap();
            m.commit(2, &unit(0, 2, 1, 2)).unwrap();
        }
        let jpath = dir.path().join(JOURNAL_FILE);
        let len = fs::metadata(&jpath).unwrap().len();
        // Tear the last record in half.
        OpenOptions::new()
            .write(true)
            .open(&jpath)
            .unwrap()
            .set_len(len - 7)
            .unwrap();
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 1), unit(0, 1, 1, 1));
        assert_eq!(get(&m, 2), None);
        // The tail was cut, so new records follow the valid prefix.
        m.commit(4, &unit(1, 3, 0, 3)).unwrap();
        drop(m);
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 4), unit(1, 3, 0, 3));
        assert_eq!(get(&m, 1), unit(0, 1, 1, 1));
    }

    #[test]
    fn corrupt_record_in_the_middle_keeps_the_prefix() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = ExtentMap::open(dir.path(), layout()).unwrap();
            m.donor_id("a").unwrap();
            m.donor_id("b").unwrap();
            m.commit(1, &unit(0, 1, 1, 1)).unwrap();
            m.commit(2, &unit(0, 2, 1, 2)).unwrap();
        }
        let jpath = dir.path().join(JOURNAL_FILE);
        let mut data = fs::read(&jpath).unwrap();
        let n = data.len();
        data[n - 3] ^= 0xff;
        fs::write(&jpath, &data).unwrap();
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 1), unit(0, 1, 1, 1));
        assert_eq!(get(&m, 2), None);
    }

    #[test]
    fn compaction_and_a_crash_between_snapshot_and_journal_reset() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = ExtentMap::open(dir.path(), layout()).unwrap();
            m.donor_id("a").unwrap();
            m.donor_id("b").unwrap();
            m.commit(1, &unit(0, 1, 1, 1)).unwrap();
            m.compact().unwrap();
            m.commit(2, &unit(0, 2, 1, 2)).unwrap();
            m.commit(1, &None).unwrap();
            // Crash in the middle of the next compaction: the new snapshot
            // is in place, the old journal (already folded in) is not reset.
            let p = lock(&m.persist);
            m.write_snapshot(&p, None, p.generation + 1).unwrap();
        }
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 1), None);
        assert_eq!(get(&m, 2), unit(0, 2, 1, 2));
        // After recovery new records land in a journal of the new generation.
        m.commit(5, &unit(1, 4, 0, 4)).unwrap();
        drop(m);
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 5), unit(1, 4, 0, 4));
        assert_eq!(get(&m, 2), unit(0, 2, 1, 2));
    }

    /// Parity width 3, 1 MiB extents of 256 pages, 2 log units.
    fn log_layout() -> Layout {
        Layout {
            size: 8 << 20,
            extent: 1 << 20,
            mode: Redundancy::Parity { width: 3 },
            log_units: 2,
        }
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
            m.donor_id("a").unwrap();
            m.commit(l.log_unit(0), &parity_unit()).unwrap();
            m.log_rows(0, 0, &[Some(10), Some(11)]).unwrap();
            m.log_rows(0, 1, &[Some(12), None]).unwrap();
            // Page 10 written again: its first copy is garbage.
            m.log_rows(0, 2, &[Some(10), None]).unwrap();
            m.log_drop(11, 1).unwrap();
            m.compact().unwrap();
            m.log_rows(0, 3, &[Some(2000), Some(13)]).unwrap();
            // Two rows in one call.
            m.log_rows(0, 4, &[Some(20), Some(21), Some(22), None])
                .unwrap();
        }
        let m = ExtentMap::open(dir.path(), l).unwrap();
        assert_eq!(m.log_lookup(10), Some(geo.slot(0, 2, 0)));
        assert_eq!(m.log_lookup(11), None);
        assert_eq!(m.log_lookup(12), Some(geo.slot(0, 1, 0)));
        assert_eq!(m.log_lookup(2000), Some(geo.slot(0, 3, 0)));
        assert_eq!(m.log_lookup(13), Some(geo.slot(0, 3, 1)));
        assert_eq!(m.log_lookup(22), Some(geo.slot(0, 5, 0)));
        assert_eq!(m.log_lookup(21), Some(geo.slot(0, 4, 1)));
        assert_eq!(m.log_census(), (7, vec![7, 0]));
        // Freeing a log unit sends whatever it still named home.
        m.commit(l.log_unit(0), &None).unwrap();
        drop(m);
        let m = ExtentMap::open(dir.path(), l).unwrap();
        assert_eq!(m.log_census(), (0, vec![0, 0]));
    }

    #[test]
    fn a_log_row_outside_the_log_is_refused_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let l = log_layout();
        {
            let m = ExtentMap::open(dir.path(), l).unwrap();
            m.donor_id("a").unwrap();
            m.log_rows(0, 0, &[Some(1), None]).unwrap();
        }
        let jpath = dir.path().join(JOURNAL_FILE);
        let good = fs::metadata(&jpath).unwrap().len();
        let mut f = OpenOptions::new().append(true).open(&jpath).unwrap();
        f.write_all(&encode(&Record::LogRow {
            unit: 5,
            row: 0,
            pages: vec![1, 0],
        }))
        .unwrap();
        drop(f);
        let e = ExtentMap::open(dir.path(), l).err().unwrap().to_string();
        assert!(e.contains(&format!("corrupt record at byte {good}")), "{e}");
        assert!(e.contains("log unit 5"), "{e}");
    }

    #[test]
    fn a_changed_parity_log_size_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        drop(ExtentMap::open(dir.path(), log_layout()).unwrap());
        let e = ExtentMap::open(
            dir.path(),
            Layout {
                log_units: 1,
                ..log_layout()
            },
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("parity_log"), "{e}");
    }

    #[test]
    fn crash_after_journal_append_before_any_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = ExtentMap::open(dir.path(), layout()).unwrap();
            m.donor_id("a").unwrap();
            m.donor_id("b").unwrap();
            m.commit(7, &unit(1, 9, 0, 9)).unwrap();
            // Dropped without sync or compaction: the records are in the file.
        }
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 7), unit(1, 9, 0, 9));
        assert!(!dir.path().join(SNAPSHOT_FILE).exists());
    }

    #[test]
    fn rebuilding_copies_come_back_lost_and_free() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = ExtentMap::open(dir.path(), layout()).unwrap();
            m.donor_id("a").unwrap();
            m.donor_id("b").unwrap();
            let mut u = unit(0, 1, 1, 1).unwrap();
            u.members[1].state = CopyState::Rebuilding;
            m.commit(0, &Some(u)).unwrap();
        }
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        assert_eq!(get(&m, 0).unwrap().members[1].state, CopyState::Lost);
        assert_eq!(m.slot_usage(SlotOwner::Donor(1)).0, 0);
    }

    #[test]
    fn layout_change_is_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        ExtentMap::open(dir.path(), layout()).unwrap();
        let mut other = layout();
        other.extent = 2 << 20;
        let e = ExtentMap::open(dir.path(), other)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("extent_size") && e.contains("map.journal"),
            "{e}"
        );
    }

    #[test]
    fn slots_fill_up_and_freed_slots_are_reused() {
        let dir = tempfile::tempdir().unwrap();
        let m = ExtentMap::open(dir.path(), layout()).unwrap();
        let a = m.donor_id("a").unwrap();
        m.set_capacity(SlotOwner::Donor(a), 3);
        m.mark_free_slots_clean(SlotOwner::Donor(a));
        let (s1, clean1) = m.alloc(SlotOwner::Donor(a)).unwrap();
        let (s2, clean2) = m.alloc(SlotOwner::Donor(a)).unwrap();
        assert!(clean1 && clean2);
        assert_eq!(m.alloc(SlotOwner::Donor(a)), None);
        m.free(s1);
        // A freed slot comes back dirty: it must be zeroed before partial use.
        assert_eq!(m.alloc(SlotOwner::Donor(a)), Some((s1, false)));
        assert_ne!(s1, s2);
        m.forget_donor_slots(a);
        assert_eq!(m.slot_usage(SlotOwner::Donor(a)), (0, 2));
        assert!(!m.alloc(SlotOwner::Donor(a)).unwrap().1);
    }
}
