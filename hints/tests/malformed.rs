//! Every kind of malformed hint file is rejected with an error that names
//! the file, the line (text) or byte offset (binary) and the field.

mod common;

use common::*;
use hints::{ErrorKind, Format, HintHeader, HintRecord, Location};

const HEAD: &str = "netpager-hints 1\njob j\nblock-size 8K\nrecords\n";

/// Reads `text` as `hints.txt`; returns the error's full message and kind.
fn text_err(text: &str) -> (String, ErrorKind, Location) {
    let e = read_err(text.as_bytes(), "hints.txt");
    (e.to_string(), e.kind, e.location)
}

/// A record line at line 5, after HEAD.
fn record_err(line: &str) -> (String, ErrorKind) {
    let (msg, kind, at) = text_err(&format!("{HEAD}{line}\n"));
    assert_eq!(at, Location::Line(5), "{msg}");
    (msg, kind)
}

#[test]
fn bad_number_names_file_line_and_field() {
    let (msg, kind) = record_err("a 12x 8K");
    assert_eq!(msg, r#"hints.txt:5: field 'offset': invalid number "12x""#);
    assert!(matches!(
        kind,
        ErrorKind::InvalidNumber {
            field: "offset",
            ..
        }
    ));
    let (msg, _) = record_err("a 0 8Q");
    assert_eq!(msg, r#"hints.txt:5: field 'length': invalid number "8Q""#);
}

#[test]
fn negative_and_overflowing_numbers() {
    let (msg, kind) = record_err("a -8192 8K");
    assert!(
        matches!(
            kind,
            ErrorKind::Negative {
                field: "offset",
                ..
            }
        ),
        "{msg}"
    );
    assert_eq!(
        msg,
        r#"hints.txt:5: field 'offset': negative number "-8192" not allowed"#
    );
    let (msg, kind) = record_err("a 0 -1");
    assert!(
        matches!(
            kind,
            ErrorKind::Negative {
                field: "length",
                ..
            }
        ),
        "{msg}"
    );
    let (msg, kind) = record_err("a 99999999999999999999 1");
    assert!(
        matches!(
            kind,
            ErrorKind::Overflow {
                field: "offset",
                ..
            }
        ),
        "{msg}"
    );
    let (msg, kind) = record_err("a 0 16777216T");
    assert!(
        matches!(
            kind,
            ErrorKind::Overflow {
                field: "length",
                ..
            }
        ),
        "{msg}"
    );
}

#[test]
fn zero_length_and_extent_overflow() {
    let (msg, kind) = record_err("a 0 0");
    assert!(matches!(kind, ErrorKind::ZeroLength));
    assert_eq!(msg, "hints.txt:5: field 'length': zero length");
    let (msg, kind) = record_err("a 9223372036854775807 1");
    assert!(matches!(kind, ErrorKind::OffsetOverflow { .. }), "{msg}");
    let (msg, kind) = record_err("a 18446744073709551615 1");
    assert!(matches!(kind, ErrorKind::OffsetOverflow { .. }), "{msg}");
    let (msg, kind) = record_err("a 0 2G");
    assert!(
        matches!(
            kind,
            ErrorKind::OutOfRange {
                field: "length",
                ..
            }
        ),
        "{msg}"
    );
}

#[test]
fn missing_fields_and_trailing_garbage() {
    let (msg, kind) = record_err("a 0");
    assert!(matches!(kind, ErrorKind::MissingField("length")), "{msg}");
    assert_eq!(msg, "hints.txt:5: field 'length': missing");
    let (msg, kind) = record_err("a 0 8K junk");
    assert!(
        matches!(kind, ErrorKind::TrailingGarbage(ref g) if g == "junk"),
        "{msg}"
    );
    let (msg, kind) = record_err("\"a b\"x 0 8K");
    assert!(matches!(kind, ErrorKind::TrailingGarbage(_)), "{msg}");
}

#[test]
fn bad_paths() {
    for (path, reason) in [
        ("/etc/passwd", "absolute"),
        ("../up", "'..'"),
        ("a/../../up", "'..'"),
        ("a//b", "empty path component"),
        ("./a", "'.'"),
        ("dir/", "empty path component"),
        ("\"\"", "empty path"),
        ("\"a\\x00b\"", "NUL"),
    ] {
        let (msg, kind) = record_err(&format!("{path} 0 1"));
        assert!(
            matches!(kind, ErrorKind::BadPath { field: "path", .. }),
            "{msg}"
        );
        assert!(
            msg.starts_with("hints.txt:5: field 'path': ") && msg.contains(reason),
            "{msg}"
        );
    }
    let long = "x".repeat(4097);
    let (msg, kind) = record_err(&format!("{long} 0 1"));
    assert!(
        matches!(kind, ErrorKind::OutOfRange { field: "path", .. }),
        "{msg}"
    );
}

#[test]
fn bad_quoting() {
    let (msg, kind) = record_err("\"open 0 1");
    assert!(
        matches!(kind, ErrorKind::Syntax(_)) && msg.contains("unterminated"),
        "{msg}"
    );
    let (msg, kind) = record_err("\"a\\q\" 0 1");
    assert!(
        matches!(kind, ErrorKind::Syntax(_)) && msg.contains("\\q"),
        "{msg}"
    );
}

#[test]
fn missing_or_unknown_version() {
    let (msg, kind, at) = text_err("job j\nblock-size 8K\nrecords\n");
    assert!(matches!(kind, ErrorKind::MissingVersion), "{msg}");
    assert_eq!(at, Location::Line(1));
    let (msg, kind, at) = text_err("# hello\n\nnetpager-hints\n");
    assert!(matches!(kind, ErrorKind::MissingVersion), "{msg}");
    assert_eq!(at, Location::Line(3));
    let (msg, kind, _) = text_err("netpager-hints 2\njob j\n");
    assert!(matches!(kind, ErrorKind::UnsupportedVersion(2)), "{msg}");
    assert_eq!(
        msg,
        "hints.txt:1: unsupported version 2 (this reader knows version 1)"
    );
    let (msg, kind, _) = text_err("netpager-hints one\n");
    assert!(
        matches!(
            kind,
            ErrorKind::InvalidNumber {
                field: "version",
                ..
            }
        ),
        "{msg}"
    );
    let (_, kind, at) = text_err("");
    assert!(matches!(kind, ErrorKind::MissingVersion));
    assert_eq!(at, Location::File);
}

#[test]
fn missing_header_fields_are_reported_at_the_records_line() {
    let (msg, kind, at) = text_err("netpager-hints 1\nblock-size 8K\nrecords\na 0 1\n");
    assert!(
        matches!(kind, ErrorKind::MissingHeaderField("job")),
        "{msg}"
    );
    assert_eq!(at, Location::Line(3));
    let (msg, kind, at) = text_err("netpager-hints 1\njob j\n\nrecords\n");
    assert!(
        matches!(kind, ErrorKind::MissingHeaderField("block-size")),
        "{msg}"
    );
    assert_eq!(at, Location::Line(4));
    assert_eq!(msg, "hints.txt:4: header field 'block-size' missing");
}

#[test]
fn header_ending_without_records_line() {
    let (msg, kind, _) = text_err("netpager-hints 1\njob j\nblock-size 8K\n");
    assert!(matches!(kind, ErrorKind::MissingRecordsLine), "{msg}");
    let (msg, kind, _) = text_err("netpager-hints 1\njob j\n");
    assert!(
        matches!(kind, ErrorKind::MissingHeaderField("block-size")),
        "{msg}"
    );
}

#[test]
fn unknown_and_duplicate_header_keys() {
    let (msg, kind, at) = text_err("netpager-hints 1\njob j\ncolour blue\n");
    assert!(
        matches!(kind, ErrorKind::UnknownHeaderKey(ref k) if k == "colour"),
        "{msg}"
    );
    assert_eq!(at, Location::Line(3));
    let (msg, kind, _) = text_err("netpager-hints 1\njob j\njob k\n");
    assert!(
        matches!(kind, ErrorKind::DuplicateHeaderField("job")),
        "{msg}"
    );
    let (msg, kind, _) = text_err("netpager-hints 1\nfile a 1\nfile a 2\n");
    assert!(matches!(kind, ErrorKind::DuplicateFile(_)), "{msg}");
}

#[test]
fn header_values_out_of_range() {
    for (line, field) in [
        ("block-size 1000", "block-size"),
        ("block-size 256", "block-size"),
        ("block-size 32M", "block-size"),
        ("repeat 0", "repeat"),
        ("repeat 1000001", "repeat"),
    ] {
        let (msg, kind, at) = text_err(&format!("netpager-hints 1\njob j\n{line}\n"));
        assert!(
            matches!(kind, ErrorKind::OutOfRange { field: f, .. } if f == field),
            "{msg}"
        );
        assert_eq!(at, Location::Line(3));
    }
    let (msg, kind, _) = text_err("netpager-hints 1\nfile a 1 yesterday\n");
    assert!(
        matches!(kind, ErrorKind::InvalidNumber { field: "mtime", .. }),
        "{msg}"
    );
    let (msg, kind, _) = text_err("netpager-hints 1\nfile a\n");
    assert!(matches!(kind, ErrorKind::MissingField("size")), "{msg}");
    let (msg, kind, _) = text_err("netpager-hints 1\njob\n");
    assert!(matches!(kind, ErrorKind::MissingField("job")), "{msg}");
}

#[test]
fn record_before_header() {
    let (msg, kind, at) = text_err("a 0 8K\nnetpager-hints 1\n");
    assert!(matches!(kind, ErrorKind::RecordBeforeHeader(_)), "{msg}");
    assert_eq!(at, Location::Line(1));
    let (msg, kind, at) = text_err("netpager-hints 1\njob j\nblock-size 8K\na 0 8K\nrecords\n");
    assert!(matches!(kind, ErrorKind::RecordBeforeHeader(_)), "{msg}");
    assert_eq!(at, Location::Line(4));
}

#[test]
fn overlong_and_non_utf8_lines() {
    let long = format!("{HEAD}{}\n", "a".repeat(40_000));
    let (msg, kind, at) = text_err(&long);
    assert!(matches!(kind, ErrorKind::LineTooLong), "{msg}");
    assert_eq!(at, Location::Line(5));
    let mut bytes = HEAD.as_bytes().to_vec();
    bytes.extend_from_slice(b"caf\xe9 0 1\n");
    let e = read_err(&bytes, "hints.txt");
    assert!(matches!(e.kind, ErrorKind::NotUtf8), "{e}");
    assert_eq!(e.location, Location::Line(5));
}

#[test]
fn bad_magic() {
    for bytes in [
        &b"\x89NPHINT\r"[..],
        b"\x89PNG\r\n\x1a\n\0\0",
        b"\x7fELF\x02\x01\x01\0",
    ] {
        let e = read_err(bytes, "hints.bin");
        assert!(matches!(e.kind, ErrorKind::BadMagic), "{e}");
        assert_eq!(e.location, Location::Byte(0));
    }
}

// ---- binary ----

/// A malformed frame and a check of the error kind it must cause.
type Case = (Vec<u8>, fn(&ErrorKind) -> bool);

fn bin_err(bytes: &[u8]) -> (String, ErrorKind, Location) {
    let e = read_err(bytes, "hints.bin");
    (e.to_string(), e.kind, e.location)
}

fn good_binary() -> Vec<u8> {
    let header = HintHeader::new("j", 4096);
    let records: Vec<_> = (0..10)
        .map(|i| HintRecord::new("f", i * 4096, 4096))
        .collect();
    encode(Format::Binary, &header, &records)
}

#[test]
fn binary_truncated_anywhere_is_an_error() {
    let good = good_binary();
    assert!(read_all(&good, "x").is_ok());
    for cut in 0..good.len() {
        let e = read_err(&good[..cut], "hints.bin");
        let ok = match cut {
            0 => matches!(e.kind, ErrorKind::MissingVersion),
            1..=7 => matches!(e.kind, ErrorKind::MissingVersion | ErrorKind::BadMagic),
            _ => matches!(e.kind, ErrorKind::Truncated(_) | ErrorKind::MissingEnd(_)),
        };
        assert!(ok, "cut at {cut}: {e}");
        if cut > 8 {
            assert!(
                matches!(e.location, Location::Byte(b) if b <= cut as u64),
                "cut at {cut}: {e}"
            );
        }
    }
}

#[test]
fn binary_truncated_record_names_its_offset() {
    let head = concat(&[MAGIC, &header_frame("j", 4096), &path_frame("f")]);
    let rec = record_frame(1, 0, 4096);
    let bytes = concat(&[&head, &rec[..rec.len() - 1]]);
    let (msg, kind, at) = bin_err(&bytes);
    assert!(matches!(kind, ErrorKind::Truncated("a frame")), "{msg}");
    assert_eq!(at, Location::Byte(head.len() as u64));
    assert_eq!(
        msg,
        format!(
            "hints.bin: byte {}: truncated: end of file inside a frame",
            head.len()
        )
    );
}

#[test]
fn binary_without_end_frame() {
    let bytes = concat(&[
        MAGIC,
        &header_frame("j", 4096),
        &path_frame("f"),
        &record_frame(1, 0, 1),
    ]);
    let (msg, kind, at) = bin_err(&bytes);
    assert!(matches!(kind, ErrorKind::MissingEnd(1)), "{msg}");
    assert_eq!(at, Location::Byte(bytes.len() as u64));
}

#[test]
fn binary_end_count_mismatch() {
    let body = concat(&[
        MAGIC,
        &header_frame("j", 4096),
        &path_frame("f"),
        &record_frame(1, 0, 1),
    ]);
    let bytes = concat(&[&body, &end_frame(2)]);
    let (msg, kind, at) = bin_err(&bytes);
    assert!(
        matches!(
            kind,
            ErrorKind::RecordCountMismatch {
                declared: 2,
                found: 1
            }
        ),
        "{msg}"
    );
    assert_eq!(at, Location::Byte(body.len() as u64));
}

#[test]
fn binary_trailing_garbage() {
    let good = good_binary();
    let bytes = concat(&[&good, b"\x00"]);
    let (msg, kind, at) = bin_err(&bytes);
    assert!(matches!(kind, ErrorKind::TrailingGarbage(_)), "{msg}");
    assert_eq!(at, Location::Byte(good.len() as u64));
}

#[test]
fn binary_absurd_lengths_are_capped() {
    let head = concat(&[MAGIC, &header_frame("j", 4096)]);
    let bytes = concat(&[&head, &varint(1 << 40), b"xx"]);
    let (msg, kind, at) = bin_err(&bytes);
    assert!(
        matches!(kind, ErrorKind::FrameTooLarge { len, .. } if len == 1 << 40),
        "{msg}"
    );
    assert_eq!(at, Location::Byte(head.len() as u64));
    let bytes = concat(&[MAGIC, &varint(1 << 30)]);
    let (msg, kind, _) = bin_err(&bytes);
    assert!(matches!(kind, ErrorKind::FrameTooLarge { .. }), "{msg}");
    let bytes = concat(&[&head, &[0xff; 11]]);
    let (msg, kind, _) = bin_err(&bytes);
    assert!(matches!(kind, ErrorKind::BadLengthPrefix), "{msg}");
}

#[test]
fn binary_header_problems() {
    let cases: Vec<Case> = vec![
        (frame(1, &header_msg(0, "j", 4096, 1)), |k| {
            matches!(k, ErrorKind::MissingVersion)
        }),
        (frame(1, &header_msg(2, "j", 4096, 1)), |k| {
            matches!(k, ErrorKind::UnsupportedVersion(2))
        }),
        (frame(1, &header_msg(1, "", 4096, 1)), |k| {
            matches!(k, ErrorKind::MissingHeaderField("job"))
        }),
        (frame(1, &header_msg(1, "j", 0, 1)), |k| {
            matches!(k, ErrorKind::MissingHeaderField("block-size"))
        }),
        (frame(1, &header_msg(1, "j", 3000, 1)), |k| {
            matches!(
                k,
                ErrorKind::OutOfRange {
                    field: "block-size",
                    ..
                }
            )
        }),
        (frame(1, &header_msg(1, "j", 4096, 2_000_000)), |k| {
            matches!(
                k,
                ErrorKind::OutOfRange {
                    field: "repeat",
                    ..
                }
            )
        }),
        (record_frame(1, 0, 1), |k| {
            matches!(k, ErrorKind::RecordBeforeHeader(_))
        }),
        (path_frame("f"), |k| {
            matches!(k, ErrorKind::RecordBeforeHeader(_))
        }),
        (end_frame(0), |k| {
            matches!(k, ErrorKind::UnexpectedFrame("end"))
        }),
        (concat(&[&varint(0)]), |k| {
            matches!(k, ErrorKind::EmptyFrame)
        }),
        (concat(&[&varint(2), &[0x0a, 0x05]]), |k| {
            matches!(k, ErrorKind::Decode(_))
        }),
    ];
    for (i, (first, check)) in cases.into_iter().enumerate() {
        let bytes = concat(&[MAGIC, &first, &end_frame(0)]);
        let (msg, kind, at) = bin_err(&bytes);
        assert!(check(&kind), "case {i}: {msg}");
        assert_eq!(at, Location::Byte(8), "case {i}: {msg}");
        assert!(msg.starts_with("hints.bin: byte 8: "), "{msg}");
    }
    let mut h = header_msg(1, "j", 4096, 1);
    h.extend(fb(5, &file_decl("../x", 1, None)));
    let (msg, kind, _) = bin_err(&concat(&[MAGIC, &frame(1, &h), &end_frame(0)]));
    assert!(matches!(kind, ErrorKind::BadPath { .. }), "{msg}");
}

#[test]
fn binary_record_problems_name_the_record_offset() {
    let head = concat(&[
        MAGIC,
        &header_frame("j", 4096),
        &path_frame("f"),
        &record_frame(1, 100, 8),
    ]);
    let cases: Vec<Case> = vec![
        (record_frame(7, 0, 1), |k| {
            matches!(k, ErrorKind::UnknownPathId(6))
        }),
        (record_frame(1, -109, 1), |k| {
            matches!(
                k,
                ErrorKind::Negative {
                    field: "offset",
                    ..
                }
            )
        }),
        (record_frame(1, i64::MAX, 1), |k| {
            matches!(k, ErrorKind::OffsetOverflow { .. })
        }),
        (record_frame(1, i64::MAX - 108, 0), |k| {
            matches!(k, ErrorKind::OffsetOverflow { .. })
        }),
        (record_frame(1, 0, 1 << 31), |k| {
            matches!(
                k,
                ErrorKind::OutOfRange {
                    field: "length",
                    ..
                }
            )
        }),
        (path_frame("/abs"), |k| {
            matches!(k, ErrorKind::BadPath { .. })
        }),
        (header_frame("again", 4096), |k| {
            matches!(k, ErrorKind::UnexpectedFrame("header"))
        }),
        (concat(&[&varint(0)]), |k| {
            matches!(k, ErrorKind::EmptyFrame)
        }),
        (concat(&[&varint(3), &[0x1a, 0x01, 0x08]]), |k| {
            matches!(k, ErrorKind::Decode(_))
        }),
    ];
    for (i, (bad, check)) in cases.into_iter().enumerate() {
        let bytes = concat(&[&head, &bad, &end_frame(2)]);
        let (msg, kind, at) = bin_err(&bytes);
        assert!(check(&kind), "case {i}: {msg}");
        assert_eq!(at, Location::Byte(head.len() as u64), "case {i}: {msg}");
    }
}

#[test]
fn binary_first_record_cannot_refer_to_a_previous_one() {
    let head = concat(&[MAGIC, &header_frame("j", 4096), &path_frame("f")]);
    let (msg, kind, _) = bin_err(&concat(&[&head, &record_frame(0, 0, 1), &end_frame(1)]));
    assert!(matches!(kind, ErrorKind::NoPreviousRecord("path")), "{msg}");
    let (msg, kind, _) = bin_err(&concat(&[&head, &record_frame(1, 0, 0), &end_frame(1)]));
    assert!(
        matches!(kind, ErrorKind::NoPreviousRecord("length")),
        "{msg}"
    );
}

#[test]
fn writer_rejects_invalid_input_naming_the_record() {
    let mut w = hints::HintWriter::new(
        Vec::new(),
        Format::Binary,
        &HintHeader::new("j", 4096),
        "out.bin",
    )
    .unwrap();
    w.write(&HintRecord::new("a", 0, 1)).unwrap();
    let e = w.write(&HintRecord::new("a", 0, 0)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "out.bin: record 1: field 'length': zero length"
    );
    let e = hints::HintWriter::new(
        Vec::new(),
        Format::Text,
        &HintHeader::new("", 4096),
        "out.txt",
    )
    .err()
    .unwrap();
    assert!(
        matches!(e.kind, ErrorKind::MissingHeaderField("job")),
        "{e}"
    );
}
