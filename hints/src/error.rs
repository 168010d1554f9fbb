//! Errors that name the file, the place in it and what was wrong there.

use std::fmt;
use std::io;

/// Where in a hint file an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// Nowhere in particular (opening the file, a missing `records` line at
    /// end of file is reported at its line instead).
    File,
    /// Text form: 1-based line number.
    Line(u64),
    /// Binary form: byte offset of the frame (or magic) at fault.
    Byte(u64),
    /// Writing: 0-based index of the record being written.
    Record(u64),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::File => Ok(()),
            Location::Line(n) => write!(f, ":{n}"),
            Location::Byte(n) => write!(f, ": byte {n}"),
            Location::Record(n) => write!(f, ": record {n}"),
        }
    }
}

/// An error reading or writing a hint file, e.g.
/// `hints.txt:17: field 'offset': invalid number "12x"`.
#[derive(Debug, thiserror::Error)]
#[error("{origin}{location}: {kind}")]
pub struct HintError {
    /// The file (or the name given to [`crate::HintReader::from_reader`]).
    pub origin: String,
    /// Line, byte offset or record index.
    pub location: Location,
    /// What was wrong.
    pub kind: ErrorKind,
}

impl HintError {
    pub(crate) fn new(origin: &str, location: Location, kind: ErrorKind) -> HintError {
        HintError {
            origin: origin.to_owned(),
            location,
            kind,
        }
    }

    pub(crate) fn io(origin: &str, location: Location, e: io::Error) -> HintError {
        HintError::new(origin, location, ErrorKind::Io(e))
    }
}

/// What was wrong. Field names are those of FORMAT.md (`offset`, `length`,
/// `path`, `block-size`, ...).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Reading or writing failed.
    #[error("i/o error: {0}")]
    Io(io::Error),
    /// Neither form: binary junk, or 0x89 followed by the wrong magic.
    #[error("bad magic: neither a text hint file (first line 'netpager-hints VERSION') nor a binary one")]
    BadMagic,
    /// No `netpager-hints VERSION` line (text), version 0 (binary).
    #[error("missing version: the first line must be 'netpager-hints VERSION'")]
    MissingVersion,
    /// A version other than [`crate::FORMAT_VERSION`].
    #[error("unsupported version {0} (this reader knows version 1)")]
    UnsupportedVersion(u64),
    /// `job` or `block-size` absent.
    #[error("header field '{0}' missing")]
    MissingHeaderField(&'static str),
    /// A header key given twice.
    #[error("header field '{0}' given twice")]
    DuplicateHeaderField(&'static str),
    /// A text header line with an unknown key.
    #[error("unknown header key {0:?}")]
    UnknownHeaderKey(String),
    /// The text ended inside the header.
    #[error("end of file inside the header: no 'records' line")]
    MissingRecordsLine,
    /// A record (or path definition) where the header should be.
    #[error("record before header: {0}")]
    RecordBeforeHeader(&'static str),
    /// Not a number.
    #[error("field '{field}': invalid number {text:?}")]
    InvalidNumber {
        /// Field name.
        field: &'static str,
        /// The text found.
        text: String,
    },
    /// A negative number (text) or offset (binary delta).
    #[error("field '{field}': negative number {text:?} not allowed")]
    Negative {
        /// Field name.
        field: &'static str,
        /// The number as text.
        text: String,
    },
    /// A number above 2^64 - 1 (or an mtime beyond i64 nanoseconds).
    #[error("field '{field}': number {text:?} does not fit in 64 bits")]
    Overflow {
        /// Field name.
        field: &'static str,
        /// The text found.
        text: String,
    },
    /// A value outside its allowed range.
    #[error("field '{field}': {value} out of range: {rule}")]
    OutOfRange {
        /// Field name.
        field: &'static str,
        /// The value found.
        value: u64,
        /// The allowed range.
        rule: &'static str,
    },
    /// A record of length 0.
    #[error("field 'length': zero length")]
    ZeroLength,
    /// `offset + length` beyond 2^63 - 1.
    #[error(
        "field 'length': offset {offset} + length {length} overflows (records must end below 2^63)"
    )]
    OffsetOverflow {
        /// The record's offset.
        offset: u64,
        /// The record's length.
        length: u64,
    },
    /// A path breaking the path rules.
    #[error("field '{field}': {reason}: {path:?}")]
    BadPath {
        /// Field name.
        field: &'static str,
        /// The path found.
        path: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A line with too few fields.
    #[error("field '{0}': missing")]
    MissingField(&'static str),
    /// Extra fields on a line, text glued to a closing quote, or bytes
    /// after the binary end frame.
    #[error("trailing garbage {0:?}")]
    TrailingGarbage(String),
    /// Bad quoting or escapes.
    #[error("syntax: {0}")]
    Syntax(String),
    /// A text line over [`crate::MAX_LINE_BYTES`].
    #[error("line longer than {} bytes", crate::MAX_LINE_BYTES)]
    LineTooLong,
    /// A text line that is not UTF-8.
    #[error("line is not valid UTF-8")]
    NotUtf8,
    /// A file declared twice in the header.
    #[error("file {0:?} declared twice")]
    DuplicateFile(String),
    /// More than [`crate::MAX_PATHS`] distinct paths.
    #[error("more than {} distinct paths", crate::MAX_PATHS)]
    TooManyPaths,
    /// Binary input ended inside the named item.
    #[error("truncated: end of file inside {0}")]
    Truncated(&'static str),
    /// Binary input ended (after this many records) without an end frame.
    #[error(
        "missing end frame: the stream stops after {0} records without its end frame (truncated?)"
    )]
    MissingEnd(u64),
    /// A frame length varint longer than 64 bits.
    #[error("frame length prefix is not a valid varint")]
    BadLengthPrefix,
    /// A frame longer than its cap ([`crate::MAX_FRAME_BYTES`],
    /// [`crate::MAX_HEADER_FRAME_BYTES`] for the header).
    #[error("frame of {len} bytes exceeds the cap of {cap} bytes")]
    FrameTooLarge {
        /// Announced length.
        len: u64,
        /// The cap.
        cap: usize,
    },
    /// A frame protobuf cannot decode.
    #[error("malformed protobuf frame: {0}")]
    Decode(prost::DecodeError),
    /// A frame with no kind set.
    #[error("frame without content")]
    EmptyFrame,
    /// A frame kind out of place (a second header, an end first).
    #[error("unexpected {0} frame")]
    UnexpectedFrame(&'static str),
    /// A record naming an undefined path id.
    #[error("field 'path': unknown path id {0}")]
    UnknownPathId(u64),
    /// The first record omits its path or length.
    #[error("field '{0}': 0 means 'as the previous record' but there is none")]
    NoPreviousRecord(&'static str),
    /// The end frame's count differs from the records read.
    #[error("end frame counts {declared} records but {found} were read")]
    RecordCountMismatch {
        /// Count in the end frame.
        declared: u64,
        /// Records read.
        found: u64,
    },
    /// A second pass was asked of a stream that cannot rewind.
    #[error("the source is not seekable: cannot read another pass (open the file by path or use from_seekable)")]
    NotSeekable,
    /// Hint files to combine use different block sizes.
    #[error("field 'block-size': {found} differs from {expected} of the first input")]
    BlockSizeMismatch {
        /// The first input's block size.
        expected: u32,
        /// This input's.
        found: u32,
    },
    /// Hint files to combine declare one file differently (it changed
    /// between the recordings).
    #[error("field 'file': {0:?} declared with another size or mtime by an earlier input")]
    ConflictingDeclaration(String),
}
