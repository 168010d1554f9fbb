//! A small buffered reader that knows its absolute byte position, can peek
//! at the magic and rewind seekable sources. Memory is one fixed buffer.

use std::io::{self, Read, Seek, SeekFrom};

const BUFFER_BYTES: usize = 64 * 1024;

/// `Read + Seek + Send` as one object-safe trait.
pub(crate) trait ReadSeek: Read + Seek + Send {}
impl<T: Read + Seek + Send> ReadSeek for T {}

enum Source {
    Stream(Box<dyn Read + Send>),
    Seekable(Box<dyn ReadSeek>),
}

impl Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Source::Stream(r) => r.read(buf),
            Source::Seekable(r) => r.read(buf),
        }
    }
}

/// Outcome of [`Input::read_line`].
pub(crate) enum Line {
    /// A line (without its `\n`) is in the caller's buffer.
    Read,
    /// End of input; the buffer is empty.
    Eof,
    /// The line exceeds the limit.
    TooLong,
}

pub(crate) struct Input {
    source: Source,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Offset of `buf[start]` from where the source stood when handed over.
    pos: u64,
    /// Seekable sources: the source's own offset at hand-over.
    base: u64,
}

impl Input {
    pub(crate) fn stream(r: Box<dyn Read + Send>) -> Input {
        Input::new(Source::Stream(r))
    }

    pub(crate) fn seekable(mut r: Box<dyn ReadSeek>) -> io::Result<Input> {
        let base = r.stream_position()?;
        let mut input = Input::new(Source::Seekable(r));
        input.base = base;
        Ok(input)
    }

    fn new(source: Source) -> Input {
        Input {
            source,
            buf: vec![0; BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            pos: 0,
            base: 0,
        }
    }

    pub(crate) fn is_seekable(&self) -> bool {
        matches!(self.source, Source::Seekable(_))
    }

    /// Offset of the next unread byte from the start of the hint data.
    pub(crate) fn position(&self) -> u64 {
        self.pos
    }

    /// Makes sure some unread bytes are buffered; false at end of input.
    fn fill(&mut self) -> io::Result<bool> {
        if self.start < self.end {
            return Ok(true);
        }
        self.start = 0;
        self.end = 0;
        loop {
            match self.source.read(&mut self.buf) {
                Ok(n) => {
                    self.end = n;
                    return Ok(n > 0);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        self.pos += n as u64;
    }

    /// Up to `n` (<= buffer size) unread bytes without consuming them;
    /// fewer only at end of input.
    pub(crate) fn peek(&mut self, n: usize) -> io::Result<&[u8]> {
        if self.end - self.start < n {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            while self.end < n {
                match self.source.read(&mut self.buf[self.end..]) {
                    Ok(0) => break,
                    Ok(k) => self.end += k,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            }
        }
        let avail = (self.end - self.start).min(n);
        Ok(&self.buf[self.start..self.start + avail])
    }

    pub(crate) fn skip(&mut self, n: usize) -> io::Result<()> {
        let got = self.peek(n)?.len();
        self.consume(got);
        Ok(())
    }

    /// Reads one line into `line` (cleared first), without the `\n`. A last
    /// line without `\n` counts as a line.
    pub(crate) fn read_line(&mut self, line: &mut Vec<u8>, max: usize) -> io::Result<Line> {
        line.clear();
        loop {
            if !self.fill()? {
                return Ok(if line.is_empty() {
                    Line::Eof
                } else {
                    Line::Read
                });
            }
            let avail = &self.buf[self.start..self.end];
            match avail.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    if line.len() + i > max {
                        return Ok(Line::TooLong);
                    }
                    line.extend_from_slice(&avail[..i]);
                    self.consume(i + 1);
                    return Ok(Line::Read);
                }
                None => {
                    if line.len() + avail.len() > max {
                        return Ok(Line::TooLong);
                    }
                    line.extend_from_slice(avail);
                    let n = avail.len();
                    self.consume(n);
                }
            }
        }
    }

    pub(crate) fn read_byte(&mut self) -> io::Result<Option<u8>> {
        if !self.fill()? {
            return Ok(None);
        }
        let b = self.buf[self.start];
        self.consume(1);
        Ok(Some(b))
    }

    /// Fills `out` completely; returns how many bytes were read (fewer only
    /// at end of input).
    pub(crate) fn read_full(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < out.len() {
            if !self.fill()? {
                break;
            }
            let n = (self.end - self.start).min(out.len() - done);
            out[done..done + n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.consume(n);
            done += n;
        }
        Ok(done)
    }

    pub(crate) fn at_eof(&mut self) -> io::Result<bool> {
        Ok(!self.fill()?)
    }

    /// Moves to offset `pos` (as counted by [`Input::position`]); only for
    /// seekable sources.
    pub(crate) fn seek_to(&mut self, pos: u64) -> io::Result<()> {
        match &mut self.source {
            Source::Stream(_) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "source is not seekable",
            )),
            Source::Seekable(r) => {
                r.seek(SeekFrom::Start(self.base + pos))?;
                self.start = 0;
                self.end = 0;
                self.pos = pos;
                Ok(())
            }
        }
    }
}
