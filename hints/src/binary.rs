//! The binary form: magic, then length-delimited protobuf frames (header,
//! path definitions, delta-encoded records, end).

use std::collections::HashMap;
use std::io::{self, Write};

use prost::Message;

use crate::error::{ErrorKind, HintError, Location};
use crate::input::Input;
use crate::{
    validate_extent, validate_path, FileDecl, HintHeader, HintRecord, BINARY_MAGIC, MAX_END_OFFSET,
    MAX_FRAME_BYTES, MAX_HEADER_FRAME_BYTES, MAX_PATHS,
};

/// Generated protobuf types (`hints/proto/hints.proto`).
pub(crate) mod pb {
    include!(concat!(env!("OUT_DIR"), "/netpager.hints.v1.rs"));
}

use pb::frame::Kind;

fn kind_name(k: &Kind) -> &'static str {
    match k {
        Kind::Header(_) => "header",
        Kind::Path(_) => "path",
        Kind::Record(_) => "record",
        Kind::End(_) => "end",
    }
}

/// Reading state of a binary hint file.
pub(crate) struct BinaryReader {
    frame: Vec<u8>,
    /// Path table: declared files first, then paths defined by PathDef frames.
    paths: Vec<String>,
    declared: usize,
    /// Per path id: end of the previous record on that path.
    cursors: Vec<u64>,
    prev_path: Option<usize>,
    prev_length: u64,
    records: u64,
    records_start: u64,
}

impl BinaryReader {
    /// Reads the header frame; the magic has been consumed already.
    pub(crate) fn read_header(
        input: &mut Input,
        origin: &str,
    ) -> Result<(BinaryReader, HintHeader), HintError> {
        let mut r = BinaryReader {
            frame: Vec::new(),
            paths: Vec::new(),
            declared: 0,
            cursors: Vec::new(),
            prev_path: None,
            prev_length: 0,
            records: 0,
            records_start: 0,
        };
        let (at, kind) = match r.read_frame(input, origin, MAX_HEADER_FRAME_BYTES)? {
            Some(f) => f,
            None => {
                let at = Location::Byte(input.position());
                return Err(HintError::new(
                    origin,
                    at,
                    ErrorKind::Truncated("the header"),
                ));
            }
        };
        let fail = |kind| HintError::new(origin, Location::Byte(at), kind);
        let h = match kind {
            Kind::Header(h) => h,
            Kind::Path(_) | Kind::Record(_) => {
                return Err(fail(ErrorKind::RecordBeforeHeader(
                    "the first frame must be the header",
                )))
            }
            other => return Err(fail(ErrorKind::UnexpectedFrame(kind_name(&other)))),
        };
        let header = HintHeader {
            version: h.version,
            job: h.job,
            block_size: h.block_size,
            repeat: h.repeat.max(1),
            files: h
                .files
                .into_iter()
                .map(|f| FileDecl {
                    path: f.path,
                    size: f.size,
                    mtime_ns: f.mtime_ns,
                })
                .collect(),
        };
        header.validate().map_err(fail)?;
        r.paths = header.files.iter().map(|f| f.path.clone()).collect();
        r.declared = r.paths.len();
        r.cursors = vec![0; r.declared];
        r.records_start = input.position();
        r.frame = Vec::with_capacity(256);
        Ok((r, header))
    }

    /// Reads one frame; `None` at a clean end of input. Returns the frame's
    /// byte offset with it.
    fn read_frame(
        &mut self,
        input: &mut Input,
        origin: &str,
        cap: usize,
    ) -> Result<Option<(u64, Kind)>, HintError> {
        let at = input.position();
        let fail = |kind| HintError::new(origin, Location::Byte(at), kind);
        let io_fail = |e: io::Error| HintError::io(origin, Location::Byte(at), e);
        let mut len: u64 = 0;
        let mut shift = 0;
        loop {
            let b = match input.read_byte().map_err(io_fail)? {
                Some(b) => b,
                None if shift == 0 => return Ok(None),
                None => return Err(fail(ErrorKind::Truncated("a frame length"))),
            };
            if shift == 63 && b > 1 {
                return Err(fail(ErrorKind::BadLengthPrefix));
            }
            len |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 63 {
                return Err(fail(ErrorKind::BadLengthPrefix));
            }
        }
        if len > cap as u64 {
            return Err(fail(ErrorKind::FrameTooLarge { len, cap }));
        }
        self.frame.resize(len as usize, 0);
        let got = input.read_full(&mut self.frame).map_err(io_fail)?;
        if got < self.frame.len() {
            return Err(fail(ErrorKind::Truncated("a frame")));
        }
        let frame =
            pb::Frame::decode(self.frame.as_slice()).map_err(|e| fail(ErrorKind::Decode(e)))?;
        match frame.kind {
            Some(k) => Ok(Some((at, k))),
            None => Err(fail(ErrorKind::EmptyFrame)),
        }
    }

    pub(crate) fn next_record(
        &mut self,
        input: &mut Input,
        origin: &str,
    ) -> Result<Option<HintRecord>, HintError> {
        loop {
            let Some((at, kind)) = self.read_frame(input, origin, MAX_FRAME_BYTES)? else {
                let at = Location::Byte(input.position());
                return Err(HintError::new(
                    origin,
                    at,
                    ErrorKind::MissingEnd(self.records),
                ));
            };
            let fail = |kind| HintError::new(origin, Location::Byte(at), kind);
            match kind {
                Kind::Path(p) => {
                    validate_path("path", &p.path).map_err(fail)?;
                    if self.paths.len() >= MAX_PATHS {
                        return Err(fail(ErrorKind::TooManyPaths));
                    }
                    self.paths.push(p.path);
                    self.cursors.push(0);
                }
                Kind::Record(r) => return self.decode_record(r).map(Some).map_err(fail),
                Kind::End(e) => {
                    if e.records != self.records {
                        return Err(fail(ErrorKind::RecordCountMismatch {
                            declared: e.records,
                            found: self.records,
                        }));
                    }
                    let after = input.position();
                    let at_eof = input
                        .at_eof()
                        .map_err(|e| HintError::io(origin, Location::Byte(after), e))?;
                    if !at_eof {
                        return Err(HintError::new(
                            origin,
                            Location::Byte(after),
                            ErrorKind::TrailingGarbage("bytes after the end frame".into()),
                        ));
                    }
                    return Ok(None);
                }
                Kind::Header(_) => return Err(fail(ErrorKind::UnexpectedFrame("header"))),
            }
        }
    }

    fn decode_record(&mut self, r: pb::Record) -> Result<HintRecord, ErrorKind> {
        let id = match r.path {
            0 => self.prev_path.ok_or(ErrorKind::NoPreviousRecord("path"))?,
            n => {
                let id = (n - 1) as usize;
                if id >= self.paths.len() {
                    return Err(ErrorKind::UnknownPathId(u64::from(n - 1)));
                }
                id
            }
        };
        let length = match r.length {
            0 => match self.prev_length {
                0 => return Err(ErrorKind::NoPreviousRecord("length")),
                l => l,
            },
            l => l,
        };
        let offset = i128::from(self.cursors[id]) + i128::from(r.offset_delta);
        if offset < 0 {
            return Err(ErrorKind::Negative {
                field: "offset",
                text: offset.to_string(),
            });
        }
        if offset > i128::from(MAX_END_OFFSET) {
            return Err(ErrorKind::OffsetOverflow {
                offset: u64::try_from(offset).unwrap_or(u64::MAX),
                length,
            });
        }
        let offset = offset as u64;
        validate_extent(offset, length)?;
        self.cursors[id] = offset + length;
        self.prev_path = Some(id);
        self.prev_length = length;
        self.records += 1;
        Ok(HintRecord {
            path: self.paths[id].clone(),
            offset,
            length,
        })
    }

    pub(crate) fn rewind(&mut self, input: &mut Input) -> io::Result<()> {
        input.seek_to(self.records_start)?;
        self.paths.truncate(self.declared);
        self.cursors.clear();
        self.cursors.resize(self.declared, 0);
        self.prev_path = None;
        self.prev_length = 0;
        self.records = 0;
        Ok(())
    }
}

/// Encoding state of a binary hint file being written.
pub(crate) struct BinaryWriter {
    ids: HashMap<String, u32>,
    cursors: Vec<u64>,
    prev_path: Option<u32>,
    prev_length: u64,
    records: u64,
    buf: Vec<u8>,
}

fn write_frame(w: &mut impl Write, buf: &mut Vec<u8>, kind: Kind) -> io::Result<()> {
    buf.clear();
    pb::Frame { kind: Some(kind) }
        .encode_length_delimited(buf)
        .expect("a Vec grows as needed");
    w.write_all(buf)
}

impl BinaryWriter {
    /// Writes the magic and the header frame (the header is valid).
    pub(crate) fn start(w: &mut impl Write, h: &HintHeader) -> io::Result<BinaryWriter> {
        let mut bw = BinaryWriter {
            ids: HashMap::with_capacity(h.files.len()),
            cursors: vec![0; h.files.len()],
            prev_path: None,
            prev_length: 0,
            records: 0,
            buf: Vec::with_capacity(256),
        };
        for (i, f) in h.files.iter().enumerate() {
            bw.ids.insert(f.path.clone(), i as u32);
        }
        w.write_all(&BINARY_MAGIC)?;
        let header = pb::Header {
            version: h.version,
            job: h.job.clone(),
            block_size: h.block_size,
            repeat: h.repeat,
            files: h
                .files
                .iter()
                .map(|f| pb::FileDecl {
                    path: f.path.clone(),
                    size: f.size,
                    mtime_ns: f.mtime_ns,
                })
                .collect(),
        };
        write_frame(w, &mut bw.buf, Kind::Header(header))?;
        Ok(bw)
    }

    /// Writes one (valid) record, defining its path first if it is new.
    pub(crate) fn write_record(
        &mut self,
        w: &mut impl Write,
        r: &HintRecord,
    ) -> Result<(), ErrorKind> {
        let id = match self.ids.get(r.path.as_str()) {
            Some(&id) => id,
            None => {
                if self.ids.len() >= MAX_PATHS {
                    return Err(ErrorKind::TooManyPaths);
                }
                let id = self.ids.len() as u32;
                write_frame(
                    w,
                    &mut self.buf,
                    Kind::Path(pb::PathDef {
                        path: r.path.clone(),
                    }),
                )
                .map_err(ErrorKind::Io)?;
                self.ids.insert(r.path.clone(), id);
                self.cursors.push(0);
                id
            }
        };
        let cursor = self.cursors[id as usize];
        let record = pb::Record {
            path: if self.prev_path == Some(id) {
                0
            } else {
                id + 1
            },
            // Both are at most MAX_END_OFFSET = i64::MAX, so the difference fits.
            offset_delta: r.offset as i64 - cursor as i64,
            length: if r.length == self.prev_length {
                0
            } else {
                r.length
            },
        };
        write_frame(w, &mut self.buf, Kind::Record(record)).map_err(ErrorKind::Io)?;
        self.cursors[id as usize] = r.end();
        self.prev_path = Some(id);
        self.prev_length = r.length;
        self.records += 1;
        Ok(())
    }

    pub(crate) fn finish(&mut self, w: &mut impl Write) -> io::Result<()> {
        write_frame(
            w,
            &mut self.buf,
            Kind::End(pb::End {
                records: self.records,
            }),
        )
    }
}
