//! The text form: tokenizer, numbers, header and record lines, writer.

use std::borrow::Cow;
use std::collections::HashSet;
use std::io::{self, Write};

use crate::error::{ErrorKind, HintError, Location};
use crate::input::{Input, Line};
use crate::{
    validate_block_size, validate_extent, validate_job, validate_path, validate_repeat, FileDecl,
    HintHeader, HintRecord, FORMAT_VERSION, MAX_LINE_BYTES, MAX_PATHS, TEXT_MAGIC,
};

/// Splits a line into fields: runs of non-blank characters, or
/// double-quoted strings with `\\ \" \n \t \r \xHH` escapes. `#` at the
/// start of a field starts a comment.
pub(crate) fn tokenize(line: &str) -> Result<Vec<Cow<'_, str>>, ErrorKind> {
    let bytes = line.as_bytes();
    let mut tokens = Vec::with_capacity(4);
    let mut i = 0;
    loop {
        while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'\t') {
            i += 1;
        }
        if i == bytes.len() || bytes[i] == b'#' {
            return Ok(tokens);
        }
        if bytes[i] == b'"' {
            let (token, next) = unquote(line, i + 1)?;
            if next < bytes.len() && bytes[next] != b' ' && bytes[next] != b'\t' {
                let rest: String = line[next..].split([' ', '\t']).next().unwrap_or("").into();
                return Err(ErrorKind::TrailingGarbage(rest));
            }
            tokens.push(Cow::Owned(token));
            i = next;
        } else {
            let start = i;
            while i < bytes.len() && bytes[i] != b' ' && bytes[i] != b'\t' {
                i += 1;
            }
            tokens.push(Cow::Borrowed(&line[start..i]));
        }
    }
}

/// Decodes a quoted string whose body starts at byte `from`; returns it and
/// the index after the closing quote.
fn unquote(line: &str, from: usize) -> Result<(String, usize), ErrorKind> {
    let mut out = String::new();
    let mut chars = line[from..].char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((out, from + i + 1)),
            '\\' => match chars.next().map(|(_, c)| c) {
                Some('\\') => out.push('\\'),
                Some('"') => out.push('"'),
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some('r') => out.push('\r'),
                Some('x') => {
                    let hex: String = chars.by_ref().take(2).map(|(_, c)| c).collect();
                    match u8::from_str_radix(&hex, 16) {
                        Ok(b) if hex.len() == 2 && b < 0x80 => out.push(char::from(b)),
                        _ => {
                            return Err(ErrorKind::Syntax(format!(
                                "bad escape \\x{hex}: want two hex digits below 80"
                            )))
                        }
                    }
                }
                Some(other) => {
                    return Err(ErrorKind::Syntax(format!("unknown escape \\{other}")));
                }
                None => break,
            },
            c => out.push(c),
        }
    }
    Err(ErrorKind::Syntax("unterminated quoted string".into()))
}

/// A field as written: bare if that reads back the same, else quoted.
pub(crate) fn quote(s: &str) -> Cow<'_, str> {
    let plain = !s.is_empty()
        && !s.starts_with('#')
        && !s.starts_with('"')
        && !s
            .chars()
            .any(|c| c == ' ' || c == '\\' || c == '"' || c.is_control());
    if plain {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    Cow::Owned(out)
}

/// A byte count in netpager's size syntax (`8192`, `8K`, `8KiB`; see
/// `netpager_util::parse_size`), its errors naming the field.
pub(crate) fn parse_size(field: &'static str, text: &str) -> Result<u64, ErrorKind> {
    use netpager_util::SizeError;
    netpager_util::parse_size(text).map_err(|e| {
        let text = text.into();
        match e {
            SizeError::Negative(_) => ErrorKind::Negative { field, text },
            SizeError::Overflow(_) => ErrorKind::Overflow { field, text },
            SizeError::Invalid(_) | SizeError::Unit { .. } => {
                ErrorKind::InvalidNumber { field, text }
            }
        }
    })
}

/// Modification time: `[-]SECONDS[.FRACTION]` (up to 9 fraction digits)
/// since the Unix epoch, to nanoseconds.
pub(crate) fn parse_mtime(text: &str) -> Result<i64, ErrorKind> {
    let invalid = || ErrorKind::InvalidNumber {
        field: "mtime",
        text: text.into(),
    };
    let (negative, magnitude) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (secs, frac) = magnitude.split_once('.').unwrap_or((magnitude, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if secs.is_empty() || !digits(secs) || !digits(frac) || frac.len() > 9 {
        return Err(invalid());
    }
    if magnitude.ends_with('.') {
        return Err(invalid());
    }
    let secs: i128 = secs.parse().map_err(|_| invalid())?;
    let frac_ns: i128 = if frac.is_empty() {
        0
    } else {
        frac.parse::<i128>().map_err(|_| invalid())? * 10i128.pow(9 - frac.len() as u32)
    };
    let ns = secs * 1_000_000_000 + frac_ns;
    let ns = if negative { -ns } else { ns };
    i64::try_from(ns).map_err(|_| ErrorKind::Overflow {
        field: "mtime",
        text: text.into(),
    })
}

pub(crate) fn format_mtime(ns: i64) -> String {
    let sign = if ns < 0 { "-" } else { "" };
    let m = ns.unsigned_abs();
    format!("{sign}{}.{:09}", m / 1_000_000_000, m % 1_000_000_000)
}

fn looks_like_record(tokens: &[Cow<'_, str>]) -> bool {
    tokens.len() == 3
        && parse_size("offset", &tokens[1]).is_ok()
        && parse_size("length", &tokens[2]).is_ok()
}

fn no_more(tokens: &[Cow<'_, str>], used: usize) -> Result<(), ErrorKind> {
    match tokens.get(used) {
        Some(t) => Err(ErrorKind::TrailingGarbage(t.to_string())),
        None => Ok(()),
    }
}

fn field<'t>(
    tokens: &'t [Cow<'_, str>],
    i: usize,
    name: &'static str,
) -> Result<&'t str, ErrorKind> {
    tokens
        .get(i)
        .map(|t| t.as_ref())
        .ok_or(ErrorKind::MissingField(name))
}

/// `path offset length`
fn parse_record(tokens: &[Cow<'_, str>]) -> Result<HintRecord, ErrorKind> {
    let path = field(tokens, 0, "path")?;
    validate_path("path", path)?;
    let offset = parse_size("offset", field(tokens, 1, "offset")?)?;
    let length = parse_size("length", field(tokens, 2, "length")?)?;
    no_more(tokens, 3)?;
    validate_extent(offset, length)?;
    Ok(HintRecord {
        path: path.to_owned(),
        offset,
        length,
    })
}

/// Reading state of a text hint file.
pub(crate) struct TextReader {
    line: Vec<u8>,
    line_no: u64,
    records_start: u64,
    records_start_line: u64,
}

#[derive(Default)]
struct HeaderDraft {
    job: Option<String>,
    block_size: Option<u32>,
    repeat: Option<u32>,
    files: Vec<FileDecl>,
    file_paths: HashSet<String>,
}

impl HeaderDraft {
    fn line(&mut self, tokens: &[Cow<'_, str>]) -> Result<(), ErrorKind> {
        match tokens[0].as_ref() {
            "job" => {
                let job = field(tokens, 1, "job")?;
                no_more(tokens, 2)?;
                validate_job(job)?;
                set_once(&mut self.job, "job", job.to_owned())
            }
            "block-size" => {
                let v = parse_size("block-size", field(tokens, 1, "block-size")?)?;
                no_more(tokens, 2)?;
                validate_block_size(v)?;
                set_once(&mut self.block_size, "block-size", v as u32)
            }
            "repeat" => {
                let v = parse_size("repeat", field(tokens, 1, "repeat")?)?;
                no_more(tokens, 2)?;
                validate_repeat(v)?;
                set_once(&mut self.repeat, "repeat", v as u32)
            }
            "file" => {
                let path = field(tokens, 1, "path")?;
                validate_path("path", path)?;
                let size = parse_size("size", field(tokens, 2, "size")?)?;
                let mtime_ns = tokens.get(3).map(|t| parse_mtime(t)).transpose()?;
                no_more(tokens, 4)?;
                if self.files.len() >= MAX_PATHS {
                    return Err(ErrorKind::TooManyPaths);
                }
                if !self.file_paths.insert(path.to_owned()) {
                    return Err(ErrorKind::DuplicateFile(path.to_owned()));
                }
                self.files.push(FileDecl {
                    path: path.to_owned(),
                    size,
                    mtime_ns,
                });
                Ok(())
            }
            _ if looks_like_record(tokens) => Err(ErrorKind::RecordBeforeHeader(
                "records come after the 'records' line",
            )),
            key => Err(ErrorKind::UnknownHeaderKey(key.to_owned())),
        }
    }

    fn finish(self) -> Result<HintHeader, ErrorKind> {
        Ok(HintHeader {
            version: FORMAT_VERSION,
            job: self.job.ok_or(ErrorKind::MissingHeaderField("job"))?,
            block_size: self
                .block_size
                .ok_or(ErrorKind::MissingHeaderField("block-size"))?,
            repeat: self.repeat.unwrap_or(1),
            files: self.files,
        })
    }
}

fn set_once<T>(slot: &mut Option<T>, name: &'static str, v: T) -> Result<(), ErrorKind> {
    if slot.is_some() {
        return Err(ErrorKind::DuplicateHeaderField(name));
    }
    *slot = Some(v);
    Ok(())
}

impl TextReader {
    /// Reads the header up to and including the `records` line.
    pub(crate) fn read_header(
        input: &mut Input,
        origin: &str,
    ) -> Result<(TextReader, HintHeader), HintError> {
        let mut r = TextReader {
            line: Vec::with_capacity(256),
            line_no: 0,
            records_start: 0,
            records_start_line: 0,
        };
        let mut draft: Option<HeaderDraft> = None;
        loop {
            if !r.next_line(input, origin)? {
                let kind = match draft {
                    None => ErrorKind::MissingVersion,
                    Some(d) => match d.finish() {
                        Ok(_) => ErrorKind::MissingRecordsLine,
                        Err(e) => e,
                    },
                };
                return Err(HintError::new(origin, Location::File, kind));
            }
            let at = Location::Line(r.line_no);
            let fail = |kind| HintError::new(origin, at, kind);
            let line = std::str::from_utf8(&r.line).map_err(|_| fail(ErrorKind::NotUtf8))?;
            let tokens = tokenize(line).map_err(fail)?;
            if tokens.is_empty() {
                continue;
            }
            match &mut draft {
                None => {
                    if tokens[0] == TEXT_MAGIC {
                        let v = tokens
                            .get(1)
                            .ok_or_else(|| fail(ErrorKind::MissingVersion))?;
                        let v = parse_size("version", v).map_err(fail)?;
                        if v != u64::from(FORMAT_VERSION) {
                            return Err(fail(ErrorKind::UnsupportedVersion(v)));
                        }
                        no_more(&tokens, 2).map_err(fail)?;
                        draft = Some(HeaderDraft::default());
                    } else if looks_like_record(&tokens) {
                        return Err(fail(ErrorKind::RecordBeforeHeader(
                            "the first line must be 'netpager-hints VERSION'",
                        )));
                    } else {
                        return Err(fail(ErrorKind::MissingVersion));
                    }
                }
                Some(d) => {
                    if tokens[0] == "records" && tokens.len() == 1 {
                        let header = draft.take().unwrap_or_default().finish().map_err(fail)?;
                        r.records_start = input.position();
                        r.records_start_line = r.line_no;
                        return Ok((r, header));
                    }
                    d.line(&tokens).map_err(fail)?;
                }
            }
        }
    }

    /// Reads the next physical line into `self.line` (without `\r\n`).
    fn next_line(&mut self, input: &mut Input, origin: &str) -> Result<bool, HintError> {
        let next = self.line_no + 1;
        let got = input
            .read_line(&mut self.line, MAX_LINE_BYTES)
            .map_err(|e| HintError::io(origin, Location::Line(next), e))?;
        match got {
            Line::Eof => Ok(false),
            Line::TooLong => Err(HintError::new(
                origin,
                Location::Line(next),
                ErrorKind::LineTooLong,
            )),
            Line::Read => {
                self.line_no = next;
                if self.line.last() == Some(&b'\r') {
                    self.line.pop();
                }
                Ok(true)
            }
        }
    }

    pub(crate) fn next_record(
        &mut self,
        input: &mut Input,
        origin: &str,
    ) -> Result<Option<HintRecord>, HintError> {
        loop {
            if !self.next_line(input, origin)? {
                return Ok(None);
            }
            let at = Location::Line(self.line_no);
            let fail = |kind| HintError::new(origin, at, kind);
            let line = std::str::from_utf8(&self.line).map_err(|_| fail(ErrorKind::NotUtf8))?;
            let tokens = tokenize(line).map_err(fail)?;
            if tokens.is_empty() {
                continue;
            }
            return parse_record(&tokens).map(Some).map_err(fail);
        }
    }

    pub(crate) fn rewind(&mut self, input: &mut Input) -> io::Result<()> {
        input.seek_to(self.records_start)?;
        self.line_no = self.records_start_line;
        Ok(())
    }
}

pub(crate) fn write_header(w: &mut impl Write, h: &HintHeader) -> io::Result<()> {
    writeln!(w, "{TEXT_MAGIC} {}", h.version)?;
    writeln!(w, "job {}", quote(&h.job))?;
    writeln!(w, "block-size {}", h.block_size)?;
    if h.repeat != 1 {
        writeln!(w, "repeat {}", h.repeat)?;
    }
    for f in &h.files {
        match f.mtime_ns {
            Some(ns) => writeln!(w, "file {} {} {}", quote(&f.path), f.size, format_mtime(ns))?,
            None => writeln!(w, "file {} {}", quote(&f.path), f.size)?,
        }
    }
    writeln!(w, "records")
}

pub(crate) fn write_record(w: &mut impl Write, r: &HintRecord) -> io::Result<()> {
    writeln!(w, "{} {} {}", quote(&r.path), r.offset, r.length)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(line: &str) -> Vec<String> {
        tokenize(line)
            .unwrap()
            .into_iter()
            .map(|t| t.into_owned())
            .collect()
    }

    #[test]
    fn tokenizer_handles_quotes_escapes_and_comments() {
        assert_eq!(toks("a 1 2"), ["a", "1", "2"]);
        assert_eq!(toks("  a\t1   2  # note"), ["a", "1", "2"]);
        assert_eq!(toks("# whole line"), Vec::<String>::new());
        assert_eq!(toks(r#""my file.dat" 0 8K"#), ["my file.dat", "0", "8K"]);
        assert_eq!(
            toks(r#""q\"uote\\ \n\t\r\x01" 1"#),
            ["q\"uote\\ \n\t\r\u{1}", "1"]
        );
        assert_eq!(toks("a#b 1"), ["a#b", "1"]);
        assert_eq!(toks(r##""#hash" 1"##), ["#hash", "1"]);
    }

    #[test]
    fn tokenizer_rejects_bad_quoting() {
        assert!(matches!(
            tokenize(r#""open 1 2"#),
            Err(ErrorKind::Syntax(_))
        ));
        assert!(matches!(
            tokenize(r#""bad\q" 1"#),
            Err(ErrorKind::Syntax(_))
        ));
        assert!(matches!(
            tokenize(r#""bad\xff" 1"#),
            Err(ErrorKind::Syntax(_))
        ));
        assert!(matches!(tokenize(r#""a"b 1 2"#), Err(ErrorKind::TrailingGarbage(t)) if t == "b"));
    }

    #[test]
    fn quote_round_trips_through_tokenize() {
        for s in [
            "plain",
            "with space",
            "#hash",
            "\"q",
            "back\\slash",
            "tab\there",
            "ctl\u{7f}\u{1}",
            "ünïcode",
            "a\"b",
        ] {
            let q = quote(s);
            let line = format!("{q} 1");
            assert_eq!(toks(&line), [s, "1"], "via {q}");
        }
        assert_eq!(quote("plain/path.db"), "plain/path.db");
    }

    #[test]
    fn sizes_take_suffixes_and_reject_nonsense() {
        assert_eq!(parse_size("f", "0").unwrap(), 0);
        assert_eq!(parse_size("f", "8K").unwrap(), 8192);
        assert_eq!(parse_size("f", "3m").unwrap(), 3 << 20);
        assert_eq!(parse_size("f", "2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("f", "1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("f", "1TiB").unwrap(), 1 << 40);
        assert_eq!(parse_size("f", "18446744073709551615").unwrap(), u64::MAX);
        assert!(matches!(
            parse_size("f", "12x"),
            Err(ErrorKind::InvalidNumber { .. })
        ));
        assert!(matches!(
            parse_size("f", "K"),
            Err(ErrorKind::InvalidNumber { .. })
        ));
        assert!(matches!(
            parse_size("f", "+1"),
            Err(ErrorKind::InvalidNumber { .. })
        ));
        assert!(matches!(
            parse_size("f", "1.5"),
            Err(ErrorKind::InvalidNumber { .. })
        ));
        assert!(matches!(
            parse_size("f", "-3"),
            Err(ErrorKind::Negative { .. })
        ));
        assert!(matches!(
            parse_size("f", "-3K"),
            Err(ErrorKind::Negative { .. })
        ));
        assert!(matches!(
            parse_size("f", "18446744073709551616"),
            Err(ErrorKind::Overflow { .. })
        ));
        assert!(matches!(
            parse_size("f", "17179869184G"),
            Err(ErrorKind::Overflow { .. })
        ));
    }

    #[test]
    fn mtimes_round_trip() {
        for ns in [
            0,
            1,
            1_700_000_000_123_456_789,
            -1_500_000_000,
            i64::MAX,
            i64::MIN + 1,
        ] {
            assert_eq!(parse_mtime(&format_mtime(ns)).unwrap(), ns);
        }
        assert_eq!(parse_mtime("12").unwrap(), 12_000_000_000);
        assert_eq!(parse_mtime("12.5").unwrap(), 12_500_000_000);
        for bad in ["", "-", "1.", ".5", "1.1234567890", "1e9", "x"] {
            assert!(parse_mtime(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            parse_mtime("99999999999999999999"),
            Err(ErrorKind::Overflow { .. })
        ));
    }
}
