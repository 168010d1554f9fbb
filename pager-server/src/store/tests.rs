//! The store: budget, ages, eviction and exports.

use super::*;

fn spec(name: &str) -> ExportSpec {
    ExportSpec {
        name: name.into(),
        size: None,
    }
}

fn pool(limit_pages: u64) -> Pool {
    Pool::new(limit_pages, 8, Compress::Off)
}

fn read(e: &Export, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0xAA; len];
    e.read(&mut v, offset, 0).unwrap();
    v
}

#[test]
fn unwritten_ranges_read_as_zeros_and_use_no_pages() {
    let p = pool(16);
    let e = p.open(&spec("a"), 1 << 20).unwrap();
    assert_eq!(read(&e, 12345, 10000), vec![0; 10000]);
    assert_eq!(e.logical_pages(), 0);
    e.write(&[7; 10], 4090, 1).unwrap();
    assert_eq!(
        e.logical_pages(),
        2,
        "a write across a page boundary allocates both pages"
    );
    let got = read(&e, 4080, 40);
    assert_eq!(&got[..10], &[0; 10]);
    assert_eq!(&got[10..20], &[7; 10]);
    assert_eq!(&got[20..], &[0; 20]);
    e.write(&[0; 8192], 3 * 4096, 1).unwrap();
    assert_eq!(
        e.logical_pages(),
        2,
        "zeros written into a hole need no page"
    );
    assert_eq!(p.budget().used_pages(), 2);
}

#[test]
fn trimmed_pages_return_their_slabs_and_freed_pages_are_reused_zeroed() {
    let slab = 4 * PAGE;
    let p = Pool::with_slabs(64, 8, Compress::Off, Slabs::with_slab_pages(4));
    let a = p.open(&spec("a"), 1 << 20).unwrap();
    let b = p.open(&spec("b"), 1 << 20).unwrap();
    a.write(&[1; 10 * 4096], 0, 0).unwrap();
    b.write(&[2; 6 * 4096], 0, 0).unwrap();
    assert_eq!(p.mapped_bytes(), 4 * slab, "16 pages fill 4 slabs");
    // Half of a's pages freed, scattered: the slabs stay, the freed
    // pages serve the next writes (partly written: zeroed first).
    for i in (0..10).step_by(2) {
        a.discard(i * PAGE, PAGE).unwrap();
    }
    assert_eq!(p.budget().used_pages(), 11);
    for i in 0..5 {
        b.write(&[3; 10], 100 * PAGE + i * PAGE, 0).unwrap();
    }
    assert_eq!(p.mapped_bytes(), 4 * slab);
    assert_eq!(
        read(&b, 100 * PAGE, 4096),
        [&[3; 10][..], &[0; 4086]].concat()
    );
    // Everything trimmed: only the spare slab stays mapped.
    a.discard(0, 1 << 20).unwrap();
    b.discard(0, 1 << 20).unwrap();
    assert_eq!(p.budget().used_pages(), 0);
    assert_eq!(p.mapped_bytes(), slab);
    b.write(&[4; 4096], 0, 0).unwrap();
    assert_eq!(read(&a, 0, 4 * 4096), vec![0; 4 * 4096]);
    assert_eq!(read(&b, 0, 4096), vec![4; 4096]);
}

#[test]
fn requests_past_the_end_are_refused() {
    let p = pool(16);
    let e = p.open(&spec("a"), 10_000).unwrap();
    assert!(matches!(
        e.write(&[1; 2], 9_999, 0),
        Err(StoreError::OutOfRange { .. })
    ));
    let mut b = [0u8; 1];
    assert!(e.read(&mut b, 10_000, 0).is_err());
    assert!(e.read(&mut b, u64::MAX, 0).is_err());
    assert!(e.discard(u64::MAX - 1, 5).is_err());
    e.write(&[1; 16], 9_984, 0).unwrap();
    assert_eq!(read(&e, 9_984, 16), vec![1; 16]);
}

#[test]
fn trim_frees_whole_pages_and_zeros_partial_ones() {
    let p = pool(16);
    let e = p.open(&spec("a"), 1 << 20).unwrap();
    e.write(&[9; 4 * 4096], 0, 0).unwrap();
    assert_eq!(e.logical_pages(), 4);
    // Bytes 100..(4096*2+50): page 0 partly, page 1 whole, page 2 partly.
    assert_eq!(e.discard(100, 4096 * 2 - 50).unwrap(), 1);
    assert_eq!(e.logical_pages(), 3);
    let got = read(&e, 0, 4 * 4096);
    assert!(got[..100].iter().all(|b| *b == 9));
    assert!(got[100..4096 * 2 + 50].iter().all(|b| *b == 0));
    assert!(got[4096 * 2 + 50..].iter().all(|b| *b == 9));
    // Zeroing the rest of page 0 leaves it all zero: it is freed.
    assert_eq!(e.discard(0, 100).unwrap(), 1);
    assert_eq!(e.logical_pages(), 2);
    assert_eq!(p.budget().used_pages(), 2);
    assert_eq!(e.discard(0, 1 << 20).unwrap(), 2);
    assert_eq!(p.budget().used_pages(), 0);
    assert_eq!(read(&e, 0, 4 * 4096), vec![0; 4 * 4096]);
}

#[test]
fn budget_refuses_new_pages_and_keeps_stored_data() {
    let p = pool(4);
    let a = p.open(&spec("a"), 1 << 20).unwrap();
    let b = p.open(&spec("b"), 1 << 20).unwrap();
    a.write(&[1; 3 * 4096], 0, 0).unwrap();
    // Needs 2 new pages, 1 left: refused as a whole.
    let err = b.write(&[2; 4096 + 1], 8192, 0).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::NoSpace {
                needed: 2,
                free: 1,
                limit: 4,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.errno(), libc::ENOSPC);
    assert_eq!(
        read(&b, 8192, 4097),
        vec![0; 4097],
        "a refused write leaves nothing behind"
    );
    assert_eq!(b.logical_pages(), 0);
    // Rewriting existing pages and filling the last free page still work.
    a.write(&[3; 3 * 4096], 0, 0).unwrap();
    b.write(&[4; 4096], 0, 0).unwrap();
    assert!(b.write(&[5; 1], 4096, 0).is_err());
    assert_eq!(read(&a, 0, 3 * 4096), vec![3; 3 * 4096]);
    // Draining refuses new pages even with budget left, never drops old ones.
    a.discard(0, 4096).unwrap();
    p.budget().set_refusing(true);
    assert!(matches!(
        b.write(&[6; 1], 4096, 0),
        Err(StoreError::Draining { needed: 1, .. })
    ));
    b.write(&[7; 4096], 0, 0).unwrap();
    assert_eq!(read(&b, 0, 4096), vec![7; 4096]);
    p.budget().set_refusing(false);
    b.write(&[6; 1], 4096, 0).unwrap();
    assert_eq!(p.budget().used_pages(), 4);
}

#[test]
fn exports_are_isolated_and_shared_by_name() {
    let p = pool(64);
    let a = p.open(&spec("a"), 1 << 20).unwrap();
    let b = p.open(&spec("b"), 1 << 20).unwrap();
    a.write(&[1; 4096], 0, 0).unwrap();
    assert_eq!(read(&b, 0, 4096), vec![0; 4096]);
    let a2 = p
        .open(
            &ExportSpec {
                name: "a".into(),
                size: Some(1 << 20),
            },
            4096,
        )
        .unwrap();
    assert_eq!(
        read(&a2, 0, 4096),
        vec![1; 4096],
        "a second connection sees the same store"
    );
    let mismatch = p.open(
        &ExportSpec {
            name: "a".into(),
            size: Some(2 << 20),
        },
        4096,
    );
    assert!(matches!(
        mismatch,
        Err(OpenError::SizeMismatch {
            existing: 1048576,
            asked: 2097152,
            ..
        })
    ));
    let c = p
        .open(
            &ExportSpec {
                name: "c".into(),
                size: Some(8192),
            },
            1 << 20,
        )
        .unwrap();
    assert_eq!(c.size(), 8192);
    let usage = p.usage();
    assert_eq!(
        usage
            .iter()
            .map(|u| (u.name.as_str(), u.logical_bytes / PAGE))
            .collect::<Vec<_>>(),
        [("a", 1), ("b", 0), ("c", 0)]
    );
    let small = Pool::new(8, 1, Compress::Off);
    small.open(&spec("x"), 4096).unwrap();
    assert!(matches!(
        small.open(&spec("y"), 4096),
        Err(OpenError::TooMany { max: 1, .. })
    ));
}

#[test]
fn extents_report_allocated_runs() {
    let p = pool(64);
    let e = p.open(&spec("a"), 64 * 4096 + 100).unwrap();
    let collect = |off, len, max| {
        let mut v = Vec::new();
        e.extents(off, len, max, |o, l, a| {
            v.push((o, l, a));
            true
        });
        v
    };
    assert_eq!(collect(0, u64::MAX, 1024), [(0, 64 * 4096 + 100, false)]);
    e.write(&[1; 4096], 4096, 0).unwrap();
    e.write(&[1; 2 * 4096], 40 * 4096, 0).unwrap();
    assert_eq!(
        collect(0, 64 * 4096 + 100, 1024),
        [
            (0, 4096, false),
            (4096, 4096, true),
            (8192, 38 * 4096, false),
            (40 * 4096, 2 * 4096, true),
            (42 * 4096, 22 * 4096 + 100, false),
        ]
    );
    assert_eq!(collect(5000, 100, 1024), [(5000, 100, true)]);
    assert_eq!(
        collect(0, 64 * 4096, 3),
        [(0, 4096, false), (4096, 4096, true), (8192, 4096, false)]
    );
    let mut one = Vec::new();
    e.extents(0, 64 * 4096, 1024, |o, l, a| {
        one.push((o, l, a));
        false
    });
    assert_eq!(one, [(0, 4096, false)]);
}

#[test]
fn xth_oldest_page_follows_touches() {
    let p = pool(64);
    assert_eq!(p.xth_oldest_stamp(2), None);
    let a = p.open(&spec("a"), 1 << 20).unwrap();
    let b = p.open(&spec("b"), 1 << 20).unwrap();
    for (i, t) in [10u32, 20, 30, 40].iter().enumerate() {
        a.write(&[1; 4096], i as u64 * 4096, *t).unwrap();
    }
    b.write(&[1; 4096], 0, 25).unwrap();
    assert_eq!(p.xth_oldest_stamp(1), Some(10));
    assert_eq!(p.xth_oldest_stamp(3), Some(25));
    assert_eq!(
        p.xth_oldest_stamp(100),
        Some(40),
        "fewer pages than x: the youngest"
    );
    let mut buf = [0u8; 4096];
    a.read(&mut buf, 0, 50).unwrap();
    assert_eq!(
        p.xth_oldest_stamp(1),
        Some(20),
        "a read makes the page young again"
    );
    a.discard(4096, 4096).unwrap();
    assert_eq!(p.xth_oldest_stamp(1), Some(25), "a freed page has no age");
}

#[test]
fn parallel_writers_readers_and_trimmers_keep_pages_consistent() {
    let p = Arc::new(pool(1 << 16));
    let e = p.open(&spec("a"), 64 << 20).unwrap();
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let e = Arc::clone(&e);
            std::thread::spawn(move || {
                // Each thread owns every 8th 12 KiB slot (spanning groups
                // and shards), writes a pattern, reads it, trims half.
                let mut buf = vec![0u8; 3 * 4096];
                for round in 0..20u8 {
                    for slot in (t as u64..1500).step_by(8) {
                        let off = slot * 3 * 4096 + 1000;
                        e.write(&vec![t ^ round | 1; 3 * 4096], off, u32::from(round))
                            .unwrap();
                        e.read(&mut buf, off, 0).unwrap();
                        assert!(buf.iter().all(|b| *b == t ^ round | 1));
                        if slot % 2 == 0 {
                            e.discard(off, 3 * 4096).unwrap();
                            e.read(&mut buf, off, 0).unwrap();
                            assert!(buf.iter().all(|b| *b == 0));
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut counted = 0;
    e.extents(0, 64 << 20, u64::MAX, |_, l, a| {
        if a {
            counted += l / 4096;
        }
        true
    });
    assert_eq!(counted, e.logical_pages());
    assert_eq!(p.budget().used_pages(), e.logical_pages());
}

/// One write that turns the only page its group holds into zeros (no
/// entry) and puts a new page in the same group: the emptied group must
/// stay until the new page is in it. It was dropped at once, and putting
/// the new page aborted the donor ("the group was reserved": a swap job in
/// mode parity, the donor's pages gone with it).
#[test]
fn a_write_emptying_a_group_and_filling_it_again_keeps_the_group() {
    for compress in [Compress::Off, Compress::Lz4] {
        let p = Pool::new(64, 8, compress);
        let e = p.open(&spec("a"), 1 << 20).unwrap();
        e.write(&[5; 4096], 0, 1).unwrap();
        let mut buf = vec![0u8; 2 * 4096];
        buf[4096..].fill(9);
        e.write(&buf, 0, 2).unwrap();
        assert_eq!(read(&e, 0, 2 * 4096), buf);
        assert_eq!(e.logical_pages(), 1);
    }
}

#[test]
fn a_panic_in_a_request_shuts_its_export_and_spares_the_others() {
    let p = pool(64);
    let a = p.open(&spec("a"), 1 << 20).unwrap();
    let b = p.open(&spec("b"), 1 << 20).unwrap();
    b.write(&[2; 8192], 0, 1).unwrap();
    // A bug that panics while the request holds a shard's lock (in the
    // middle of an extents walk), after a write of the same request.
    let r = a.guarded(|a| {
        a.write(&[1; 4096], 0, 1)?;
        a.extents(0, 4096, 16, |_, _, _| panic!("a bug in the walk"));
        Ok(())
    });
    let shut = |r: Result<(), StoreError>| match r {
        Err(e @ StoreError::Broken { .. }) => {
            assert_eq!(e.errno(), libc::EIO);
            assert!(e.to_string().contains("a bug in the walk"), "{e}");
        }
        other => panic!("expected the export shut, got {other:?}"),
    };
    shut(r);
    // Every later request on it, by any connection, is refused.
    let mut buf = [0u8; 4096];
    shut(a.guarded(|a| a.read(&mut buf, 0, 2)));
    shut(a.guarded(|a| a.write(&[3; 4096], 4096, 2)));
    shut(a.guarded(|a| a.discard(0, 4096).map(|_| ())));
    let again = p.open(&spec("a"), 1 << 20).unwrap();
    shut(again.guarded(|a| a.read(&mut buf, 0, 2)));
    // The other export goes on, and status names the shut one.
    b.guarded(|b| b.write(&[4; 4096], 8192, 3)).unwrap();
    assert_eq!(read(&b, 0, 8192), vec![2; 8192]);
    assert_eq!(read(&b, 8192, 4096), vec![4; 4096]);
    let usage = p.usage();
    let by = |n: &str| usage.iter().find(|u| u.name == n).unwrap().broken.clone();
    assert_eq!(by("a").as_deref(), Some("a bug in the walk"));
    assert_eq!(by("b"), None);
}
