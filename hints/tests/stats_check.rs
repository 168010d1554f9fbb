//! Stats of a known small file, and staleness detection against a real
//! directory.

mod common;

use std::fs;
use std::io::Cursor;
use std::time::{Duration, UNIX_EPOCH};

use common::*;
use hints::{FileDecl, Format, HintHeader, HintReader, HintRecord, Stale, Staleness};

const SMALL: &str = "\
netpager-hints 1
job small
block-size 4K
repeat 2
file declared-only 10
records
a 0 4K      # block a:0
a 0 4K      # a:0 again
a 2K 4K     # a:0 and a:1
b 10K 100   # b:2
";

#[test]
fn stats_of_a_known_file() {
    let s = HintReader::from_reader(Cursor::new(SMALL), "small.txt")
        .unwrap()
        .stats()
        .unwrap();
    assert_eq!(s.job, "small");
    assert_eq!(s.format, Format::Text);
    assert_eq!(s.block_size, 4096);
    assert_eq!(s.passes, 2);
    assert_eq!(s.declared_files, 1);
    assert_eq!(s.files, 2);
    assert_eq!(s.records_per_pass, 4);
    assert_eq!(s.records, 8);
    assert_eq!(s.blocks, 2 * 5);
    assert_eq!(s.distinct_blocks, 3);
    assert_eq!(s.bytes, 2 * (3 * 4096 + 100));
    assert_eq!(s.distinct_bytes, 3 * 4096);
    assert_eq!(s.reuse, (2.0 * (3.0 * 4096.0 + 100.0)) / (3.0 * 4096.0));
}

#[test]
fn stats_are_the_same_for_both_forms_and_sparse_far_offsets() {
    let header = HintHeader::new("far", 8192);
    let records = vec![
        HintRecord::new("x", 0, 8192),
        HintRecord::new("x", 1 << 60, 3 * 8192),
        HintRecord::new("x", (1 << 60) + 8192, 8192),
        HintRecord::new("y", 1 << 60, 1),
    ];
    let text = read_stats(&encode(Format::Text, &header, &records));
    let binary = read_stats(&encode(Format::Binary, &header, &records));
    assert_eq!(text.distinct_blocks, 5);
    assert_eq!(text.blocks, 6);
    assert_eq!(
        (text.files, text.records, text.bytes),
        (binary.files, binary.records, binary.bytes)
    );
    assert_eq!(
        (text.distinct_blocks, text.reuse),
        (binary.distinct_blocks, binary.reuse)
    );
}

fn read_stats(bytes: &[u8]) -> hints::Stats {
    HintReader::from_reader(Cursor::new(bytes.to_vec()), "mem")
        .unwrap()
        .stats()
        .unwrap()
}

fn mtime_ns(path: &std::path::Path) -> i64 {
    let t = fs::metadata(path).unwrap().modified().unwrap();
    t.duration_since(UNIX_EPOCH).unwrap().as_nanos() as i64
}

#[test]
fn fresh_hints_check_clean_and_every_change_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir_all(root.join("sub")).unwrap();
    for (name, size) in [
        ("same", 100),
        ("grows", 50),
        ("touched", 30),
        ("gone", 10),
        ("sub/undeclared", 20),
        ("shrinks", 8192),
    ] {
        fs::write(root.join(name), vec![7u8; size]).unwrap();
    }
    let decl = |name: &str| FileDecl {
        path: name.into(),
        size: fs::metadata(root.join(name)).unwrap().len(),
        mtime_ns: Some(mtime_ns(&root.join(name))),
    };
    let header = HintHeader {
        files: vec![
            decl("same"),
            decl("grows"),
            decl("touched"),
            decl("gone"),
            decl("shrinks"),
        ],
        ..HintHeader::new("stale", 4096)
    };
    let records = vec![
        HintRecord::new("same", 0, 100),
        HintRecord::new("sub/undeclared", 10, 10),
        HintRecord::new("shrinks", 0, 4096),
        HintRecord::new("shrinks", 4096, 4096),
        HintRecord::new("never-existed", 0, 1),
        HintRecord::new("sub", 0, 1),
        HintRecord::new("shrinks", 4096, 4096),
    ];
    let fresh: Vec<_> = records
        .iter()
        .filter(|r| r.path != "never-existed" && r.path != "sub")
        .cloned()
        .collect();
    let fresh_file = dir.path().join("fresh.txt");
    fs::write(&fresh_file, encode(Format::Text, &header, &fresh)).unwrap();
    assert_eq!(
        HintReader::open(&fresh_file)
            .unwrap()
            .check_against(&root)
            .unwrap(),
        vec![]
    );
    let hint_file = dir.path().join("h.bin");
    fs::write(&hint_file, encode(Format::Binary, &header, &records)).unwrap();
    let check = || {
        HintReader::open(&hint_file)
            .unwrap()
            .check_against(&root)
            .unwrap()
    };

    fs::write(root.join("grows"), vec![1u8; 60]).unwrap();
    let f = fs::File::options()
        .write(true)
        .open(root.join("touched"))
        .unwrap();
    let later = fs::metadata(root.join("touched"))
        .unwrap()
        .modified()
        .unwrap()
        + Duration::from_secs(5);
    f.set_modified(later).unwrap();
    drop(f);
    fs::remove_file(root.join("gone")).unwrap();
    fs::write(root.join("shrinks"), vec![1u8; 5000]).unwrap();
    fs::write(root.join("sub/undeclared"), vec![1u8; 15]).unwrap();
    let touched_before = header.files[2].mtime_ns.unwrap();
    let shrinks_mtime = mtime_ns(&root.join("shrinks"));
    let grows_mtime = mtime_ns(&root.join("grows"));

    let stale = check();
    let sp = |path: &str, problem: Stale| Staleness {
        path: path.into(),
        problem,
    };
    let mut expected = vec![
        sp(
            "grows",
            Stale::SizeDiffers {
                declared: 50,
                actual: 60,
            },
        ),
        sp(
            "touched",
            Stale::MtimeDiffers {
                declared_ns: touched_before,
                actual_ns: touched_before + 5_000_000_000,
            },
        ),
        sp("gone", Stale::Missing),
        sp(
            "shrinks",
            Stale::SizeDiffers {
                declared: 8192,
                actual: 5000,
            },
        ),
        sp("never-existed", Stale::Missing),
        sp("sub", Stale::NotAFile),
        sp(
            "shrinks",
            Stale::BeyondEof {
                size: 5000,
                records: 2,
                first_record: 3,
                first_end: 8192,
            },
        ),
        sp(
            "sub/undeclared",
            Stale::BeyondEof {
                size: 15,
                records: 1,
                first_record: 1,
                first_end: 20,
            },
        ),
    ];
    // Rewriting a file may or may not move its mtime within the clock's
    // resolution; when it does, that is reported too (after the size).
    if grows_mtime != header.files[1].mtime_ns.unwrap() {
        expected.insert(
            1,
            sp(
                "grows",
                Stale::MtimeDiffers {
                    declared_ns: header.files[1].mtime_ns.unwrap(),
                    actual_ns: grows_mtime,
                },
            ),
        );
    }
    if shrinks_mtime != header.files[4].mtime_ns.unwrap() {
        let at = expected.iter().position(|s| s.path == "shrinks").unwrap() + 1;
        expected.insert(
            at,
            sp(
                "shrinks",
                Stale::MtimeDiffers {
                    declared_ns: header.files[4].mtime_ns.unwrap(),
                    actual_ns: shrinks_mtime,
                },
            ),
        );
    }
    assert_eq!(stale, expected);
    assert_eq!(
        stale.iter().find(|s| matches!(s.problem, Stale::BeyondEof { .. })).unwrap().to_string(),
        "shrinks: 2 record(s) read beyond end of file (5000 bytes); first is record 3, ending at 8192"
    );
}
