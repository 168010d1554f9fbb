//! [`HintWriter`]: writes either form from a header and a record stream.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::binary::BinaryWriter;
use crate::error::{ErrorKind, HintError, Location};
use crate::{text, Format, HintHeader, HintRecord};

enum Encoder {
    Text,
    Binary(BinaryWriter),
}

/// Writes a hint file: the header at creation, then records one by one,
/// then [`HintWriter::finish`] (required: the binary form ends with an end
/// frame that counts the records). Header and records are validated with
/// the rules the readers apply, so whatever is written reads back.
pub struct HintWriter<W: Write> {
    out: BufWriter<W>,
    origin: String,
    format: Format,
    encoder: Encoder,
    records: u64,
}

impl HintWriter<File> {
    /// Creates (truncates) `path` and writes the header.
    pub fn create(
        path: &Path,
        format: Format,
        header: &HintHeader,
    ) -> Result<HintWriter<File>, HintError> {
        let origin = path.display().to_string();
        let file = File::create(path).map_err(|e| HintError::io(&origin, Location::File, e))?;
        HintWriter::new(file, format, header, &origin)
    }
}

impl<W: Write> HintWriter<W> {
    /// Writes the header to `w` (buffered internally); `origin` names the
    /// output in errors.
    pub fn new(
        w: W,
        format: Format,
        header: &HintHeader,
        origin: &str,
    ) -> Result<HintWriter<W>, HintError> {
        header
            .validate()
            .map_err(|k| HintError::new(origin, Location::File, k))?;
        let mut out = BufWriter::with_capacity(64 * 1024, w);
        let io_err = |e| HintError::io(origin, Location::File, e);
        let encoder = match format {
            Format::Text => {
                text::write_header(&mut out, header).map_err(io_err)?;
                Encoder::Text
            }
            Format::Binary => {
                Encoder::Binary(BinaryWriter::start(&mut out, header).map_err(io_err)?)
            }
        };
        Ok(HintWriter {
            out,
            origin: origin.to_owned(),
            format,
            encoder,
            records: 0,
        })
    }

    /// Appends one record.
    pub fn write(&mut self, r: &HintRecord) -> Result<(), HintError> {
        let at = Location::Record(self.records);
        r.validate()
            .map_err(|k| HintError::new(&self.origin, at, k))?;
        let result = match &mut self.encoder {
            Encoder::Text => text::write_record(&mut self.out, r).map_err(ErrorKind::Io),
            Encoder::Binary(b) => b.write_record(&mut self.out, r),
        };
        result.map_err(|k| HintError::new(&self.origin, at, k))?;
        self.records += 1;
        Ok(())
    }

    /// Records written so far.
    pub fn records_written(&self) -> u64 {
        self.records
    }

    /// The form being written.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Ends the stream, flushes and returns the underlying writer.
    pub fn finish(mut self) -> Result<W, HintError> {
        let at = Location::Record(self.records);
        if let Encoder::Binary(b) = &mut self.encoder {
            b.finish(&mut self.out)
                .map_err(|e| HintError::io(&self.origin, at, e))?;
        }
        let origin = self.origin;
        self.out
            .into_inner()
            .map_err(|e| HintError::io(&origin, at, e.into_error()))
    }
}
