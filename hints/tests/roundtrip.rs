//! text -> binary -> text keeps the header and every record, and text
//! written twice is byte-identical.

mod common;

use common::*;
use hints::{validate_path, FileDecl, Format, HintHeader, HintRecord};
use proptest::prelude::*;

fn round_trip(header: &HintHeader, records: &[HintRecord]) {
    let text = encode(Format::Text, header, records);
    let (h1, r1) = read_all(&text, "a.txt").unwrap();
    assert_eq!(&h1, header);
    assert_eq!(r1, records);
    let binary = encode(Format::Binary, &h1, &r1);
    let (h2, r2) = read_all(&binary, "b.bin").unwrap();
    assert_eq!(h2, h1);
    assert_eq!(r2, r1);
    let text_again = encode(Format::Text, &h2, &r2);
    assert_eq!(
        String::from_utf8(text_again).unwrap(),
        String::from_utf8(text).unwrap()
    );
}

#[test]
fn awkward_paths_and_extremes_round_trip() {
    let header = HintHeader {
        version: 1,
        job: "job with \"quotes\", tabs\tand # hash".into(),
        block_size: 16 << 20,
        repeat: 1_000_000,
        files: vec![
            FileDecl {
                path: "#not a comment".into(),
                size: 0,
                mtime_ns: Some(i64::MIN),
            },
            FileDecl {
                path: "line\nbreak/and\\back".into(),
                size: u64::MAX,
                mtime_ns: Some(i64::MAX),
            },
            FileDecl {
                path: "ünï cödé/ファイル".into(),
                size: 1,
                mtime_ns: None,
            },
        ],
    };
    let records = vec![
        HintRecord::new("#not a comment", 0, 1),
        HintRecord::new(
            "line\nbreak/and\\back",
            i64::MAX as u64 - (1 << 30),
            1 << 30,
        ),
        HintRecord::new("ünï cödé/ファイル", 5, 7),
        HintRecord::new("\"quoted\"", 0, 1),
        HintRecord::new("ctl\u{1}\u{7f}\r", 1, 1),
        HintRecord::new("line\nbreak/and\\back", 0, 1),
    ];
    round_trip(&header, &records);
}

fn path_strategy() -> impl Strategy<Value = String> {
    proptest::collection::vec("[a-z0-9 _.#\"\\\\\t\n\u{e9}\u{3000}-]{1,6}", 1..4)
        .prop_map(|parts| parts.join("/"))
        .prop_filter("valid path", |p| validate_path("path", p).is_ok())
}

fn header_strategy() -> impl Strategy<Value = HintHeader> {
    (
        "[^\u{0}]{1,20}",
        9u32..=24,
        1u32..=5,
        proptest::collection::vec(
            (
                path_strategy(),
                any::<u64>(),
                proptest::option::of(any::<i64>()),
            ),
            0..4,
        ),
    )
        .prop_map(|(job, shift, repeat, files)| {
            let mut seen = std::collections::HashSet::new();
            HintHeader {
                version: 1,
                job,
                block_size: 1 << shift,
                repeat,
                files: files
                    .into_iter()
                    .filter(|(p, _, _)| seen.insert(p.clone()))
                    .map(|(path, size, mtime_ns)| FileDecl {
                        path,
                        size,
                        mtime_ns,
                    })
                    .collect(),
            }
        })
}

fn records_strategy() -> impl Strategy<Value = Vec<HintRecord>> {
    proptest::collection::vec(path_strategy(), 1..5).prop_flat_map(|pool| {
        let n = pool.len();
        proptest::collection::vec(
            (0..n, 0u64..(1 << 62), 1u64..=(1 << 30)).prop_map(move |(i, offset, length)| {
                HintRecord::new(pool[i].clone(), offset, length)
            }),
            0..40,
        )
    })
}

proptest! {
    #[test]
    fn any_valid_stream_round_trips(header in header_strategy(), records in records_strategy()) {
        round_trip(&header, &records);
    }

    #[test]
    fn sequential_and_repeated_records_round_trip(start in 0u64..1_000_000, len in 1u64..100_000, n in 1usize..50) {
        let records: Vec<_> = (0..n as u64)
            .map(|i| HintRecord::new(if i % 7 == 3 { "other" } else { "main" }, start + i * len, len))
            .collect();
        round_trip(&HintHeader::new("seq", 4096), &records);
    }
}

#[test]
fn binary_is_compact_for_sequential_streams() {
    let records: Vec<_> = (0..10_000)
        .map(|i| HintRecord::new("data/file.db", i * 8192, 8192))
        .collect();
    let header = HintHeader::new("seq", 8192);
    let text = encode(Format::Text, &header, &records);
    let binary = encode(Format::Binary, &header, &records);
    // 3 bytes per record (length prefix, frame tag, empty record).
    assert!(binary.len() < 10_000 * 3 + 100, "{} bytes", binary.len());
    assert!(
        binary.len() * 8 < text.len(),
        "binary {} text {}",
        binary.len(),
        text.len()
    );
}
