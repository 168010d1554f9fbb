//! [`HintReader`]: streaming reader of both forms.

use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;

use crate::binary::BinaryReader;
use crate::error::{ErrorKind, HintError, Location};
use crate::input::Input;
use crate::text::TextReader;
use crate::{Format, HintHeader, HintRecord, BINARY_MAGIC};

enum Decoder {
    Text(TextReader),
    Binary(BinaryReader),
}

/// Streaming reader of a hint file, text or binary (told apart by the
/// magic).
///
/// Memory is bounded: the header, the path table (one entry per distinct
/// path, at most [`crate::MAX_PATHS`]), a 64 KiB buffer and one line or
/// frame. Iterating yields the records of **one pass**, in file order; the
/// header's [`HintHeader::repeat`] says how many passes the job makes.
/// [`HintReader::references`] expands the repeats lazily by rewinding the
/// source, which works for readers made by [`HintReader::open`] and
/// [`HintReader::from_seekable`]. After an error the iterator is finished.
/// A reader is `Send`, so it can be handed to another thread.
pub struct HintReader {
    origin: String,
    format: Format,
    header: HintHeader,
    input: Input,
    decoder: Decoder,
    records: u64,
    done: bool,
}

impl std::fmt::Debug for HintReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HintReader")
            .field("origin", &self.origin)
            .field("format", &self.format)
            .field("header", &self.header)
            .field("records", &self.records)
            .finish_non_exhaustive()
    }
}

impl HintReader {
    /// Opens a hint file and reads its header. Errors name `path`.
    pub fn open(path: &Path) -> Result<HintReader, HintError> {
        let origin = path.display().to_string();
        let file = File::open(path).map_err(|e| HintError::io(&origin, Location::File, e))?;
        let input = Input::seekable(Box::new(file))
            .map_err(|e| HintError::io(&origin, Location::File, e))?;
        HintReader::start(input, origin)
    }

    /// Reads a hint stream (a pipe, a socket, memory); `origin` names it in
    /// errors. Only one pass can be read: [`HintReader::rewind`] fails.
    pub fn from_reader(
        r: impl Read + Send + 'static,
        origin: &str,
    ) -> Result<HintReader, HintError> {
        HintReader::start(Input::stream(Box::new(r)), origin.to_owned())
    }

    /// Like [`HintReader::from_reader`] for a seekable source, which allows
    /// [`HintReader::rewind`]. The hint data starts at the source's current
    /// position.
    pub fn from_seekable(
        r: impl Read + Seek + Send + 'static,
        origin: &str,
    ) -> Result<HintReader, HintError> {
        let input =
            Input::seekable(Box::new(r)).map_err(|e| HintError::io(origin, Location::File, e))?;
        HintReader::start(input, origin.to_owned())
    }

    fn start(mut input: Input, origin: String) -> Result<HintReader, HintError> {
        let head = input
            .peek(BINARY_MAGIC.len())
            .map_err(|e| HintError::io(&origin, Location::Byte(0), e))?;
        let binary = head == BINARY_MAGIC;
        if !binary && (head.first() == Some(&BINARY_MAGIC[0]) || head.contains(&0)) {
            return Err(HintError::new(
                &origin,
                Location::Byte(0),
                ErrorKind::BadMagic,
            ));
        }
        let (format, decoder, header) = if binary {
            input
                .skip(BINARY_MAGIC.len())
                .map_err(|e| HintError::io(&origin, Location::Byte(0), e))?;
            let (d, h) = BinaryReader::read_header(&mut input, &origin)?;
            (Format::Binary, Decoder::Binary(d), h)
        } else {
            let (d, h) = TextReader::read_header(&mut input, &origin)?;
            (Format::Text, Decoder::Text(d), h)
        };
        Ok(HintReader {
            origin,
            format,
            header,
            input,
            decoder,
            records: 0,
            done: false,
        })
    }

    /// The header (read when the reader was made).
    pub fn header(&self) -> &HintHeader {
        &self.header
    }

    /// Text or binary.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The name errors use (the path for [`HintReader::open`]).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Records yielded so far in the current pass.
    pub fn records_read(&self) -> u64 {
        self.records
    }

    /// Whether [`HintReader::rewind`] can work.
    pub fn is_seekable(&self) -> bool {
        self.input.is_seekable()
    }

    /// Goes back to the first record, to read the stream again (the next
    /// pass of a repeating job, or a second look).
    pub fn rewind(&mut self) -> Result<(), HintError> {
        if !self.input.is_seekable() {
            return Err(HintError::new(
                &self.origin,
                Location::File,
                ErrorKind::NotSeekable,
            ));
        }
        let result = match &mut self.decoder {
            Decoder::Text(d) => d.rewind(&mut self.input),
            Decoder::Binary(d) => d.rewind(&mut self.input),
        };
        result.map_err(|e| HintError::io(&self.origin, Location::File, e))?;
        self.records = 0;
        self.done = false;
        Ok(())
    }

    /// The job's whole reference stream: every pass of
    /// [`HintHeader::repeat`], each record tagged with its pass and its
    /// position in the stream. Needs a seekable source when repeat > 1.
    pub fn references(self) -> References {
        References {
            reader: self,
            pass: 0,
            position: 0,
            done: false,
        }
    }

    fn next_record(&mut self) -> Result<Option<HintRecord>, HintError> {
        match &mut self.decoder {
            Decoder::Text(d) => d.next_record(&mut self.input, &self.origin),
            Decoder::Binary(d) => d.next_record(&mut self.input, &self.origin),
        }
    }
}

impl Iterator for HintReader {
    type Item = Result<HintRecord, HintError>;

    /// The next record of the current pass; `None` at its end.
    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.next_record() {
            Ok(Some(r)) => {
                self.records += 1;
                Some(Ok(r))
            }
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// One hinted read in the job's reference stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// 0-based pass (`0..repeat`).
    pub pass: u32,
    /// 0-based position in the whole stream, counting earlier passes: the
    /// hint position prefetchd compares with the job's progress.
    pub position: u64,
    /// The record.
    pub record: HintRecord,
}

/// Iterator over every pass of a hint file; see [`HintReader::references`].
#[derive(Debug)]
pub struct References {
    reader: HintReader,
    pass: u32,
    position: u64,
    done: bool,
}

impl References {
    /// The header of the underlying file.
    pub fn header(&self) -> &HintHeader {
        self.reader.header()
    }

    /// The pass being read (0-based).
    pub fn pass(&self) -> u32 {
        self.pass
    }

    /// Records yielded so far over all passes.
    pub fn position(&self) -> u64 {
        self.position
    }
}

impl Iterator for References {
    type Item = Result<Reference, HintError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            match self.reader.next() {
                Some(Ok(record)) => {
                    let r = Reference {
                        pass: self.pass,
                        position: self.position,
                        record,
                    };
                    self.position += 1;
                    return Some(Ok(r));
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                None if self.pass + 1 < self.reader.header.repeat => {
                    if let Err(e) = self.reader.rewind() {
                        self.done = true;
                        return Some(Err(e));
                    }
                    self.pass += 1;
                }
                None => self.done = true,
            }
        }
        None
    }
}
