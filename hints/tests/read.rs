//! Good hint files in both forms read back as written.

mod common;

use std::io::Cursor;

use common::*;
use hints::{ErrorKind, FileDecl, Format, HintHeader, HintReader, HintRecord, Location};

const GOOD_TEXT: &str = "\
# a hint file written by hand
netpager-hints 1

job \"render frame 1\"   # quoted: has spaces
block-size 8K
repeat 2
file scene.db 1M 1700000000.5
file \"my dir/with space.dat\" 40960
records
scene.db 0 8K
scene.db 8192 8192     # same as the line above, next block
\"my dir/with space.dat\" 4K 100

scene.db 1M 1
# comment at the end
";

fn expected_records() -> Vec<HintRecord> {
    vec![
        HintRecord::new("scene.db", 0, 8192),
        HintRecord::new("scene.db", 8192, 8192),
        HintRecord::new("my dir/with space.dat", 4096, 100),
        HintRecord::new("scene.db", 1 << 20, 1),
    ]
}

fn expected_header() -> HintHeader {
    HintHeader {
        version: 1,
        job: "render frame 1".into(),
        block_size: 8192,
        repeat: 2,
        files: vec![
            FileDecl {
                path: "scene.db".into(),
                size: 1 << 20,
                mtime_ns: Some(1_700_000_000_500_000_000),
            },
            FileDecl {
                path: "my dir/with space.dat".into(),
                size: 40960,
                mtime_ns: None,
            },
        ],
    }
}

#[test]
fn text_file_with_comments_quotes_and_suffixes_reads() {
    let (h, records) = read_all(GOOD_TEXT.as_bytes(), "good.txt").unwrap();
    assert_eq!(h, expected_header());
    assert_eq!(records, expected_records());
}

#[test]
fn crlf_line_ends_and_missing_final_newline_are_accepted() {
    let text = GOOD_TEXT.replace('\n', "\r\n");
    let text = text.trim_end();
    let (h, records) = read_all(text.as_bytes(), "crlf.txt").unwrap();
    assert_eq!(h, expected_header());
    assert_eq!(records.len(), 4);
}

#[test]
fn minimal_text_file_defaults_repeat_to_one() {
    let (h, records) = read_all(
        b"netpager-hints 1\njob j\nblock-size 4096\nrecords\n",
        "min.txt",
    )
    .unwrap();
    assert_eq!(h, HintHeader::new("j", 4096));
    assert!(records.is_empty());
}

#[test]
fn hand_encoded_binary_file_reads() {
    // Path ids: 0 declared in the header; 1 defined by a path frame.
    let mut header = header_msg(1, "bin job", 4096, 3);
    header.extend(fb(5, &file_decl("a.db", 65536, Some(-1_500_000_000))));
    let bytes = concat(&[
        MAGIC,
        &frame(1, &header),
        &record_frame(1, 4096, 4096), // a.db 4096+4096
        &record_frame(0, 0, 0),       // a.db 8192+4096 (same path, length, contiguous)
        &path_frame("dir/b.db"),
        &record_frame(2, 100, 7),    // dir/b.db 100+7
        &record_frame(1, -12288, 0), // a.db 0+7
        &record_frame(0, 1 << 20, 4096),
        &end_frame(5),
    ]);
    let (h, records) = read_all(&bytes, "hand.bin").unwrap();
    assert_eq!(h.job, "bin job");
    assert_eq!((h.block_size, h.repeat), (4096, 3));
    assert_eq!(
        h.files,
        vec![FileDecl {
            path: "a.db".into(),
            size: 65536,
            mtime_ns: Some(-1_500_000_000)
        }]
    );
    assert_eq!(
        records,
        vec![
            HintRecord::new("a.db", 4096, 4096),
            HintRecord::new("a.db", 8192, 4096),
            HintRecord::new("dir/b.db", 100, 7),
            HintRecord::new("a.db", 0, 7),
            HintRecord::new("a.db", 7 + (1 << 20), 4096),
        ]
    );
}

#[test]
fn writer_output_matches_the_documented_encoding() {
    let header = HintHeader::new("j", 4096);
    let records = [
        HintRecord::new("f", 0, 4096),
        HintRecord::new("f", 4096, 4096),
        HintRecord::new("g", 0, 4096),
        HintRecord::new("f", 0, 512),
    ];
    let expected = concat(&[
        MAGIC,
        &header_frame("j", 4096),
        &path_frame("f"),
        &record_frame(1, 0, 4096),
        &record_frame(0, 0, 0),
        &path_frame("g"),
        &record_frame(2, 0, 0),
        &record_frame(1, -8192, 512),
        &end_frame(4),
    ]);
    assert_eq!(encode(Format::Binary, &header, &records), expected);
}

#[test]
fn open_detects_the_form_by_magic() {
    let dir = tempfile::tempdir().unwrap();
    let header = expected_header();
    for format in [Format::Text, Format::Binary] {
        let path = dir.path().join(format.name());
        std::fs::write(&path, encode(format, &header, &expected_records())).unwrap();
        let reader = HintReader::open(&path).unwrap();
        assert_eq!(reader.format(), format);
        assert_eq!(reader.header(), &header);
        assert_eq!(
            reader.collect::<Result<Vec<_>, _>>().unwrap(),
            expected_records()
        );
    }
}

#[test]
fn references_expand_repeats_by_rewinding() {
    let dir = tempfile::tempdir().unwrap();
    for format in [Format::Text, Format::Binary] {
        let path = dir.path().join(format.name());
        std::fs::write(
            &path,
            encode(format, &expected_header(), &expected_records()),
        )
        .unwrap();
        let refs: Vec<_> = HintReader::open(&path)
            .unwrap()
            .references()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(refs.len(), 8, "{format}");
        for (i, r) in refs.iter().enumerate() {
            assert_eq!(r.position, i as u64);
            assert_eq!(r.pass, (i / 4) as u32);
            assert_eq!(r.record, expected_records()[i % 4]);
        }
    }
}

#[test]
fn rewind_restarts_the_pass_and_reports_later_errors_at_the_right_line() {
    let text = "netpager-hints 1\njob j\nblock-size 4K\nrecords\na 0 1\nb 0 1\na x 1\n";
    let mut reader =
        HintReader::from_seekable(Cursor::new(text.as_bytes().to_vec()), "rw.txt").unwrap();
    for pass in 0..2 {
        assert_eq!(
            reader.next().unwrap().unwrap(),
            HintRecord::new("a", 0, 1),
            "pass {pass}"
        );
        assert_eq!(reader.records_read(), 1);
        reader.rewind().unwrap();
    }
    let err = reader.nth(2).unwrap().unwrap_err();
    assert_eq!(err.location, Location::Line(7));
    assert!(reader.next().is_none(), "the iterator ends after an error");
}

#[test]
fn from_seekable_starts_at_the_current_position() {
    let mut bytes = b"ignored prefix".to_vec();
    let start = bytes.len() as u64;
    bytes.extend(encode(
        Format::Binary,
        &expected_header(),
        &expected_records(),
    ));
    let mut cur = Cursor::new(bytes);
    cur.set_position(start);
    let refs = HintReader::from_seekable(cur, "mem")
        .unwrap()
        .references()
        .count();
    assert_eq!(refs, 8);
}

#[test]
fn a_stream_reads_one_pass_and_refuses_to_rewind() {
    let bytes = encode(Format::Text, &expected_header(), &expected_records());
    let mut refs = HintReader::from_reader(Cursor::new(bytes), "pipe")
        .unwrap()
        .references();
    for _ in 0..4 {
        refs.next().unwrap().unwrap();
    }
    let err = refs.next().unwrap().unwrap_err();
    assert!(matches!(err.kind, ErrorKind::NotSeekable), "{err}");
    assert!(refs.next().is_none());
}

#[test]
fn readers_can_move_to_another_thread() {
    let bytes = encode(Format::Binary, &expected_header(), &expected_records());
    let reader = HintReader::from_reader(Cursor::new(bytes), "mem").unwrap();
    let records = std::thread::spawn(move || reader.count()).join().unwrap();
    assert_eq!(records, 4);
}

#[test]
fn record_blocks_cover_partial_blocks() {
    assert_eq!(HintRecord::new("a", 0, 8192).blocks(8192), 0..1);
    assert_eq!(HintRecord::new("a", 8191, 2).blocks(8192), 0..2);
    assert_eq!(HintRecord::new("a", 16384, 1).blocks(8192), 2..3);
    assert_eq!(HintRecord::new("a", 100, 3 * 8192).blocks(8192), 0..4);
}
