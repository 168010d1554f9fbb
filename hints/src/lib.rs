//! Application hint files: the blocks a job promises to read, in order.
//!
//! A hint file (PGMS's "hinted reference stream", docs/DESIGN.md "2.4
//! Prefetching with hints") names the file blocks a job will read, in the order
//! it will read them. prefetchd follows a job through this stream. Two
//! encodings exist, both specified in `hints/FORMAT.md`:
//!
//! - **text**, written by people: a `netpager-hints 1` line, a few header
//!   lines (`job`, `block-size`, `repeat`, `file`), a `records` line, then one
//!   `path offset length` record per line;
//! - **binary**, for large generated files: a magic prefix then a stream of
//!   length-delimited protobuf frames with path ids and delta-encoded offsets.
//!
//! Reading is streaming with bounded memory in both cases ([`HintReader`]):
//! only the header, the path table (distinct paths) and one line or frame are
//! held, so a 10 GB hint file is never loaded whole.
//!
//! ```no_run
//! # fn main() -> Result<(), hints::HintError> {
//! let reader = hints::HintReader::open(std::path::Path::new("render.hints"))?;
//! println!("job {} in blocks of {}", reader.header().job, reader.header().block_size);
//! for reference in reader.references() {
//!     let r = reference?;
//!     println!("pass {} #{}: {} {}+{}", r.pass, r.position, r.record.path, r.record.offset, r.record.length);
//! }
//! # Ok(()) }
//! ```
//!
//! Recordings of real runs ([`Recorder`]) become hint files, which
//! [`merge`] combines and [`distinct`] reduces to first uses.
//!
//! Besides reading and writing ([`HintWriter`]) the crate computes statistics
//! ([`Stats`]), detects hints made stale by changed files
//! ([`HintReader::check_against`]) and generates the reference workloads of
//! docs/DESIGN.md "3 Reference workloads" with verifiable file contents
//! ([`gen`], [`content`]).

#![warn(missing_docs)]

mod binary;
mod check;
pub mod content;
mod error;
pub mod gen;
mod input;
mod reader;
mod record;
mod stats;
mod text;
mod writer;

use std::ops::Range;

use serde::Serialize;

pub use check::{Stale, Staleness};
pub use error::{ErrorKind, HintError, Location};
pub use reader::{HintReader, Reference, References};
pub use record::{distinct, merge, Recorder};
pub use stats::Stats;
pub use writer::HintWriter;

/// The only format version so far (text `netpager-hints 1`, binary header
/// `version: 1`).
pub const FORMAT_VERSION: u32 = 1;
/// First line keyword of the text form.
pub const TEXT_MAGIC: &str = "netpager-hints";
/// First eight bytes of the binary form. 0x89 cannot start a UTF-8 text
/// file, so the two forms never overlap.
pub const BINARY_MAGIC: [u8; 8] = *b"\x89NPHINT\n";
/// Default block size (PGMS's 8 KB pages).
pub const DEFAULT_BLOCK_SIZE: u32 = 8192;
/// Smallest accepted block size (must also be a power of two).
pub const MIN_BLOCK_SIZE: u32 = 512;
/// Largest accepted block size.
pub const MAX_BLOCK_SIZE: u32 = 16 << 20;
/// Largest accepted repeat count.
pub const MAX_REPEAT: u32 = 1_000_000;
/// Largest record length: a longer read must be split into several records.
pub const MAX_RECORD_LENGTH: u64 = 1 << 30;
/// Records must end at or before this offset (files cannot be larger).
pub const MAX_END_OFFSET: u64 = i64::MAX as u64;
/// Longest path, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest job name, in bytes.
pub const MAX_JOB_BYTES: usize = 1024;
/// Most distinct paths in one hint file (declared files plus paths first
/// seen in records); bounds the reader's path table.
pub const MAX_PATHS: usize = 1 << 20;
/// Longest text line, in bytes.
pub const MAX_LINE_BYTES: usize = 32 * 1024;
/// Largest binary frame other than the header.
pub const MAX_FRAME_BYTES: usize = 64 * 1024;
/// Largest binary header frame (it carries the declared files).
pub const MAX_HEADER_FRAME_BYTES: usize = 64 << 20;

/// Which of the two encodings a hint file uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// Line-oriented text for people.
    Text,
    /// Magic prefix plus length-delimited protobuf frames.
    Binary,
}

impl Format {
    /// `"text"` or `"binary"`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Binary => "binary",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Format::Text),
            "binary" => Ok(Format::Binary),
            _ => Err(format!("unknown hint format {s:?} (text or binary)")),
        }
    }
}

/// Everything before the records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HintHeader {
    /// Format version; always [`FORMAT_VERSION`] once read.
    pub version: u32,
    /// Name of the job the hints belong to (non-empty).
    pub job: String,
    /// Block size in bytes: a power of two in
    /// [`MIN_BLOCK_SIZE`]..=[`MAX_BLOCK_SIZE`]. Offsets and lengths are in
    /// bytes and need not be aligned; consumers work in these blocks.
    pub block_size: u32,
    /// How many times the job reads the whole record stream (1 = once;
    /// cyclic workloads use 3).
    pub repeat: u32,
    /// Files the hint writer declared, with their size and mtime at the
    /// time, so [`HintReader::check_against`] can spot changed files.
    /// Optional: records may name files not declared here.
    pub files: Vec<FileDecl>,
}

impl HintHeader {
    /// A version-1 header with one pass and no declared files.
    pub fn new(job: impl Into<String>, block_size: u32) -> HintHeader {
        HintHeader {
            version: FORMAT_VERSION,
            job: job.into(),
            block_size,
            repeat: 1,
            files: Vec::new(),
        }
    }

    /// Checks every header rule of FORMAT.md (the readers apply the same).
    pub fn validate(&self) -> Result<(), ErrorKind> {
        if self.version == 0 {
            return Err(ErrorKind::MissingVersion);
        }
        if self.version != FORMAT_VERSION {
            return Err(ErrorKind::UnsupportedVersion(u64::from(self.version)));
        }
        validate_job(&self.job)?;
        validate_block_size(u64::from(self.block_size))?;
        validate_repeat(u64::from(self.repeat))?;
        if self.files.len() > MAX_PATHS {
            return Err(ErrorKind::TooManyPaths);
        }
        let mut seen = std::collections::HashSet::with_capacity(self.files.len());
        for f in &self.files {
            validate_path("path", &f.path)?;
            if !seen.insert(f.path.as_str()) {
                return Err(ErrorKind::DuplicateFile(f.path.clone()));
            }
        }
        Ok(())
    }
}

/// A file declared in the header: its size and modification time when the
/// hints were written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileDecl {
    /// Path relative to the data set root (same rules as record paths).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time in nanoseconds since the Unix epoch, if recorded.
    pub mtime_ns: Option<i64>,
}

/// One hinted read: `length` bytes of `path` starting at `offset`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct HintRecord {
    /// Path relative to the data set root: non-empty, no leading `/`, no
    /// empty, `.` or `..` components, no NUL, at most [`MAX_PATH_BYTES`].
    pub path: String,
    /// Byte offset in the file.
    pub offset: u64,
    /// Byte count, 1..=[`MAX_RECORD_LENGTH`]; `offset + length` stays at or
    /// below [`MAX_END_OFFSET`].
    pub length: u64,
}

impl HintRecord {
    /// A record; not validated (see [`HintRecord::validate`]).
    pub fn new(path: impl Into<String>, offset: u64, length: u64) -> HintRecord {
        HintRecord {
            path: path.into(),
            offset,
            length,
        }
    }

    /// One past the last byte read.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.length)
    }

    /// Indexes of the blocks of `block_size` bytes the record touches.
    pub fn blocks(&self, block_size: u32) -> Range<u64> {
        let bs = u64::from(block_size.max(1));
        let first = self.offset / bs;
        if self.length == 0 {
            return first..first;
        }
        first..(self.end() - 1) / bs + 1
    }

    /// Checks the record rules of FORMAT.md (the readers apply the same).
    pub fn validate(&self) -> Result<(), ErrorKind> {
        validate_path("path", &self.path)?;
        validate_extent(self.offset, self.length)
    }
}

pub(crate) fn validate_extent(offset: u64, length: u64) -> Result<(), ErrorKind> {
    if length == 0 {
        return Err(ErrorKind::ZeroLength);
    }
    if length > MAX_RECORD_LENGTH {
        return Err(ErrorKind::OutOfRange {
            field: "length",
            value: length,
            rule: "at most 1 GiB (MAX_RECORD_LENGTH); split longer reads",
        });
    }
    match offset.checked_add(length) {
        Some(end) if end <= MAX_END_OFFSET => Ok(()),
        _ => Err(ErrorKind::OffsetOverflow { offset, length }),
    }
}

pub(crate) fn validate_job(job: &str) -> Result<(), ErrorKind> {
    if job.is_empty() {
        return Err(ErrorKind::MissingHeaderField("job"));
    }
    if job.len() > MAX_JOB_BYTES {
        return Err(ErrorKind::OutOfRange {
            field: "job",
            value: job.len() as u64,
            rule: "job name at most 1024 bytes",
        });
    }
    Ok(())
}

pub(crate) fn validate_block_size(v: u64) -> Result<(), ErrorKind> {
    if v == 0 {
        return Err(ErrorKind::MissingHeaderField("block-size"));
    }
    if !v.is_power_of_two() || v < u64::from(MIN_BLOCK_SIZE) || v > u64::from(MAX_BLOCK_SIZE) {
        return Err(ErrorKind::OutOfRange {
            field: "block-size",
            value: v,
            rule: "a power of two from 512 bytes to 16 MiB",
        });
    }
    Ok(())
}

pub(crate) fn validate_repeat(v: u64) -> Result<(), ErrorKind> {
    if v == 0 || v > u64::from(MAX_REPEAT) {
        return Err(ErrorKind::OutOfRange {
            field: "repeat",
            value: v,
            rule: "1 to 1000000",
        });
    }
    Ok(())
}

/// Checks that `path` is a normalised relative path (see [`HintRecord::path`]);
/// `field` names it in the error.
pub fn validate_path(field: &'static str, path: &str) -> Result<(), ErrorKind> {
    let bad = |reason: &'static str| ErrorKind::BadPath {
        field,
        path: path.to_owned(),
        reason,
    };
    if path.is_empty() {
        return Err(bad("empty path"));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(ErrorKind::OutOfRange {
            field,
            value: path.len() as u64,
            rule: "path at most 4096 bytes",
        });
    }
    if path.contains('\0') {
        return Err(bad("NUL byte in path"));
    }
    if path.starts_with('/') {
        return Err(bad(
            "absolute path; paths are relative to the data set root",
        ));
    }
    for component in path.split('/') {
        match component {
            "" => return Err(bad("empty path component")),
            "." => return Err(bad("'.' component; write paths normalised")),
            ".." => return Err(bad("'..' component would leave the data set root")),
            _ => {}
        }
    }
    Ok(())
}
