//! Helpers shared by the integration tests: a hand-written encoder of the
//! binary wire format (independent of the crate's, so tests check the
//! format as FORMAT.md documents it) and small file utilities.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::Cursor;

use hints::{Format, HintError, HintHeader, HintReader, HintRecord, HintWriter};

pub const MAGIC: &[u8] = b"\x89NPHINT\n";

pub fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return out;
        }
        out.push(b | 0x80);
    }
}

pub fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

/// Varint field (wire type 0).
pub fn fv(field: u32, v: u64) -> Vec<u8> {
    let mut out = varint(u64::from(field) << 3);
    out.extend(varint(v));
    out
}

/// Length-delimited field (wire type 2).
pub fn fb(field: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = varint((u64::from(field) << 3) | 2);
    out.extend(varint(bytes.len() as u64));
    out.extend_from_slice(bytes);
    out
}

pub fn header_msg(version: u32, job: &str, block_size: u32, repeat: u32) -> Vec<u8> {
    let mut m = Vec::new();
    if version != 0 {
        m.extend(fv(1, version.into()));
    }
    if !job.is_empty() {
        m.extend(fb(2, job.as_bytes()));
    }
    if block_size != 0 {
        m.extend(fv(3, block_size.into()));
    }
    if repeat != 0 {
        m.extend(fv(4, repeat.into()));
    }
    m
}

pub fn file_decl(path: &str, size: u64, mtime_ns: Option<i64>) -> Vec<u8> {
    let mut m = fb(1, path.as_bytes());
    m.extend(fv(2, size));
    if let Some(t) = mtime_ns {
        m.extend(fv(3, zigzag(t)));
    }
    m
}

pub fn record_msg(path: u32, offset_delta: i64, length: u64) -> Vec<u8> {
    let mut m = Vec::new();
    if path != 0 {
        m.extend(fv(1, path.into()));
    }
    if offset_delta != 0 {
        m.extend(fv(2, zigzag(offset_delta)));
    }
    if length != 0 {
        m.extend(fv(3, length));
    }
    m
}

/// A delimited frame whose oneof field `kind` (1 header, 2 path, 3 record,
/// 4 end) holds `msg`.
pub fn frame(kind: u32, msg: &[u8]) -> Vec<u8> {
    let body = fb(kind, msg);
    let mut out = varint(body.len() as u64);
    out.extend(body);
    out
}

pub fn header_frame(job: &str, block_size: u32) -> Vec<u8> {
    frame(1, &header_msg(1, job, block_size, 1))
}

pub fn path_frame(path: &str) -> Vec<u8> {
    frame(2, &fb(1, path.as_bytes()))
}

pub fn record_frame(path: u32, offset_delta: i64, length: u64) -> Vec<u8> {
    frame(3, &record_msg(path, offset_delta, length))
}

pub fn end_frame(records: u64) -> Vec<u8> {
    frame(
        4,
        &if records == 0 {
            Vec::new()
        } else {
            fv(1, records)
        },
    )
}

pub fn concat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// Reads a whole in-memory hint file (one pass).
pub fn read_all(bytes: &[u8], origin: &str) -> Result<(HintHeader, Vec<HintRecord>), HintError> {
    let reader = HintReader::from_reader(Cursor::new(bytes.to_vec()), origin)?;
    let header = reader.header().clone();
    let records = reader.collect::<Result<Vec<_>, _>>()?;
    Ok((header, records))
}

/// The error reading `bytes` fails with (panics if it reads fine).
pub fn read_err(bytes: &[u8], origin: &str) -> HintError {
    match read_all(bytes, origin) {
        Ok((h, r)) => panic!("expected an error, read {h:?} and {} records", r.len()),
        Err(e) => e,
    }
}

pub fn encode(format: Format, header: &HintHeader, records: &[HintRecord]) -> Vec<u8> {
    let mut w = HintWriter::new(Vec::new(), format, header, "memory").unwrap();
    for r in records {
        w.write(r).unwrap();
    }
    w.finish().unwrap()
}
