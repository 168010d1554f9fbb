//! The journal's and snapshot's records: framing (length, CRC-32), encoding
//! and decoding.

use super::{
    CopyState, DonorEntry, Layout, Loc, Member, MemberRecord, MemberState, Redundancy, Unit,
};

const MAGIC: &[u8; 8] = b"NPMAP001";

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
pub(super) enum Record {
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
    /// Home group `group` may have a write in flight (`open`), or has had
    /// none since its last mark (the write intent, see `ExtentMap::mark_written`).
    Intent {
        group: u32,
        open: bool,
    },
    /// Pages `[first, first + count)` read as lost until written (`lost`),
    /// or not any more (see `unfound.rs`).
    Unfound {
        first: u64,
        count: u64,
        lost: bool,
    },
    /// Member `member` of unit `index`, journaled `Rebuilding` on its new
    /// location just before, is a copy being moved from `from`, which
    /// still holds its data until the unit's next record: a restart in
    /// between puts it back there (`ExtentMap::commit_move`).
    Moving {
        index: u32,
        member: u8,
        from: Loc,
    },
}

fn loc_into(p: &mut Vec<u8>, loc: Loc) {
    let (kind, donor, slot) = match loc {
        Loc::Donor { donor, slot } => (0u8, donor, slot),
        Loc::Fallback { slot } => (1u8, 0, slot),
    };
    p.push(kind);
    p.extend_from_slice(&donor.to_le_bytes());
    p.extend_from_slice(&slot.to_le_bytes());
}

/// Appends one framed record to `out`: length, CRC, then the payload that
/// `payload` writes.
pub(super) fn frame_into(out: &mut Vec<u8>, payload: impl FnOnce(&mut Vec<u8>)) {
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
pub(super) fn log_row_payload(
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

pub(super) fn encode(r: &Record) -> Vec<u8> {
    let mut v = Vec::new();
    encode_into(r, &mut v);
    v
}

pub(super) fn encode_into(r: &Record, out: &mut Vec<u8>) {
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
            // Optional tail: maps written before live membership end here.
            if let Some(m) = &entry.member {
                p.push(m.joined.code());
                p.push(match m.state {
                    MemberState::Member => 0,
                    MemberState::Leaving => 1,
                    MemberState::Gone => 2,
                    MemberState::Removed => 3,
                });
                p.extend_from_slice(&m.since_unix.to_le_bytes());
                p.extend_from_slice(&(m.config.len() as u32).to_le_bytes());
                p.extend_from_slice(m.config.as_bytes());
            }
        }
        Record::Unit { index, unit } => {
            p.push(3);
            p.extend_from_slice(&index.to_le_bytes());
            let members = unit.as_ref().map(|u| u.members.as_slice()).unwrap_or(&[]);
            p.push(members.len() as u8);
            for m in members {
                loc_into(p, m.loc);
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
        Record::Intent { group, open } => {
            p.push(7);
            p.extend_from_slice(&group.to_le_bytes());
            p.push(u8::from(*open));
        }
        Record::Unfound { first, count, lost } => {
            p.push(8);
            p.extend_from_slice(&first.to_le_bytes());
            p.extend_from_slice(&count.to_le_bytes());
            p.push(u8::from(*lost));
        }
        Record::Moving {
            index,
            member,
            from,
        } => {
            p.push(9);
            p.extend_from_slice(&index.to_le_bytes());
            p.push(*member);
            loc_into(p, *from);
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
    fn loc(&mut self) -> Result<Loc, String> {
        let kind = self.u8()?;
        let donor = self.u16()?;
        let slot = self.u32()?;
        match kind {
            0 => Ok(Loc::Donor { donor, slot }),
            1 => Ok(Loc::Fallback { slot }),
            k => Err(format!("unknown location kind {k}")),
        }
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
            let (m, arg) = (c.u8()?, c.u32()?);
            let mode = Redundancy::from_code(m, arg).ok_or_else(|| format!("unknown mode {m}"))?;
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
            let member = if c.0.is_empty() {
                None
            } else {
                let code = c.u8()?;
                let joined = netpager_membership::Joined::from_code(code)
                    .ok_or_else(|| format!("donor {name:?}: unknown way of joining {code}"))?;
                let state = match c.u8()? {
                    0 => MemberState::Member,
                    1 => MemberState::Leaving,
                    2 => MemberState::Gone,
                    3 => MemberState::Removed,
                    s => return Err(format!("donor {name:?}: unknown membership state {s}")),
                };
                let since_unix = c.u64()?;
                let n = c.u32()? as usize;
                let config = String::from_utf8(c.take(n)?.to_vec())
                    .map_err(|_| format!("donor {name:?}: its configuration is not UTF-8"))?;
                Some(MemberRecord {
                    joined,
                    since_unix,
                    state,
                    config,
                })
            };
            Record::Donor {
                id,
                entry: DonorEntry {
                    name,
                    label,
                    member,
                },
            }
        }
        3 => {
            let index = c.u32()?;
            let n = c.u8()? as usize;
            let mut members = Vec::with_capacity(n);
            for _ in 0..n {
                let loc = c.loc()?;
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
        7 => Record::Intent {
            group: c.u32()?,
            open: match c.u8()? {
                0 => false,
                1 => true,
                b => return Err(format!("write intent flag {b} is neither 0 nor 1")),
            },
        },
        8 => Record::Unfound {
            first: c.u64()?,
            count: c.u64()?,
            lost: match c.u8()? {
                0 => false,
                1 => true,
                b => return Err(format!("unfound flag {b} is neither 0 nor 1")),
            },
        },
        9 => Record::Moving {
            index: c.u32()?,
            member: c.u8()?,
            from: c.loc()?,
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
pub(super) fn parse_records(data: &[u8]) -> (Vec<Record>, usize, Option<String>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn unfound_records_round_trip() {
        for lost in [true, false] {
            let r = Record::Unfound {
                first: 1 << 40,
                count: 256,
                lost,
            };
            let (recs, _, err) = parse_records(&encode(&r));
            assert_eq!((recs, err), (vec![r], None));
        }
    }

    #[test]
    fn moving_records_round_trip() {
        for from in [Loc::Donor { donor: 7, slot: 9 }, Loc::Fallback { slot: 3 }] {
            let r = Record::Moving {
                index: 12,
                member: 2,
                from,
            };
            let (recs, _, err) = parse_records(&encode(&r));
            assert_eq!((recs, err), (vec![r], None));
        }
    }
}
