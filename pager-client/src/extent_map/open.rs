//! Opening the map: replaying the snapshot and the journal's valid prefix.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicU8};
use std::sync::{Mutex, RwLock};

use super::record::{encode, parse_records, Record};
use super::slots::{SlotSet, Slots};
use super::unfound::PageRanges;
use super::{
    count_parity, fsync_dir, io_err, CopyState, DonorEntry, ExtentMap, Layout, Loc, MapError,
    Persist, Unit, INTENT_OPEN, JOURNAL_FILE, JOURNAL_SCRATCH, SNAPSHOT_FILE,
};
use crate::page_table::{PageTable, PAGE};

struct Replay {
    units: Vec<Option<Unit>>,
    /// Home groups whose write intent is open.
    intents: Vec<bool>,
    donors: Vec<DonorEntry>,
    log: Option<PageTable>,
    unfound: PageRanges,
    /// Moves not finished: unit -> (member, where its data is).
    moving: BTreeMap<u32, (u8, Loc)>,
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
                self.moving.remove(&index);
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
            Record::Intent { group, open } => {
                let slot = self.intents.get_mut(group as usize).ok_or_else(|| {
                    format!(
                        "write intent of group {group}, but the map has {} home groups",
                        layout.home_units()
                    )
                })?;
                *slot = open;
                Ok(())
            }
            Record::Moving {
                index,
                member,
                from,
            } => {
                let placed = self.units.get(index as usize).and_then(|u| u.as_ref());
                if placed.is_none_or(|u| member as usize >= u.members.len()) {
                    return Err(format!(
                        "a move of member {member} of unit {index}, which has no such member"
                    ));
                }
                if let Loc::Donor { donor, .. } = from {
                    if donor as usize >= self.donors.len() {
                        return Err(format!(
                            "a move of unit {index} from unknown donor id {donor}"
                        ));
                    }
                }
                self.moving.insert(index, (member, from));
                Ok(())
            }
            Record::Unfound { first, count, lost } => {
                let pages = layout.size.div_ceil(PAGE);
                let end = first
                    .checked_add(count)
                    .filter(|&end| end <= pages)
                    .ok_or_else(|| {
                        format!("unfound pages {first}+{count} are past the device's {pages} pages")
                    })?;
                if lost {
                    self.unfound.insert(first..end);
                } else {
                    self.unfound.remove(first..end);
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
            intents: vec![false; layout.home_units() as usize],
            donors: Vec::new(),
            log: layout.log_geometry().and_then(|g| PageTable::new(g, pages)),
            unfound: PageRanges::default(),
            moving: BTreeMap::new(),
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

        // A copy being moved when we stopped is where it came from: that
        // place kept the data until the switch was journaled.
        for (&index, &(j, from)) in &st.moving {
            let Some(m) = st.units[index as usize]
                .as_mut()
                .and_then(|u| u.members.get_mut(j as usize))
                .filter(|m| m.state == CopyState::Rebuilding)
            else {
                continue;
            };
            tracing::info!(
                "extent map: unit {index}'s member {j} was moving from {from:?} to {:?}; it stays where it was",
                m.loc
            );
            *m = super::Member {
                loc: from,
                state: CopyState::Ok,
            };
        }
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
            intents: st
                .intents
                .iter()
                .map(|&open| AtomicU8::new(if open { INTENT_OPEN } else { 0 }))
                .collect(),
            persist: Mutex::new(Persist {
                journal,
                journal_bytes,
                generation,
                parity_held: {
                    let mut held = Vec::new();
                    for (u, unit) in st.units.iter().enumerate() {
                        count_parity(&layout, u as u64, unit.as_ref(), &mut held, true);
                    }
                    held
                },
                mirror: st.units,
                // Settled above: the next commit of each unit says the same.
                moving: BTreeMap::new(),
                donors: st.donors,
                scratch: Vec::with_capacity(JOURNAL_SCRATCH),
            }),
            slots: Mutex::new(slots),
            log_at_open: Mutex::new(st.log),
            unfound_pages: AtomicU64::new(st.unfound.pages()),
            unfound: Mutex::new(st.unfound),
        })
    }
}

pub(super) fn write_journal_header(
    dir: &Path,
    generation: u64,
    layout: &Layout,
) -> Result<(), MapError> {
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
