use super::*;

fn sample() -> ClientStatus {
    ClientStatus {
        client_id: "busy1".into(),
        mode: "mirror".into(),
        size_bytes: 64 << 20,
        extent_bytes: 1 << 20,
        donors: vec![
            DonorReport {
                name: "d1".into(),
                address: "127.0.0.2:10809".into(),
                state: "idle".into(),
                ..Default::default()
            },
            DonorReport {
                name: "d2".into(),
                address: "127.0.0.3:10809".into(),
                state: "unreachable".into(),
                failed: true,
                failure: Some("read timed out".into()),
                ..Default::default()
            },
        ],
        totals: Totals {
            units: 64,
            lost: 2,
            lost_extents: vec![3, 9],
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn json_round_trip_through_the_state_dir() {
    let dir = tempfile::tempdir().unwrap();
    let s = sample();
    s.write_atomic(dir.path()).unwrap();
    assert_eq!(ClientStatus::read(dir.path()).unwrap(), s);
}

#[test]
fn table_names_failures_and_lost_extents() {
    let t = render_table(&sample());
    assert!(t.contains("FAILED (unreachable)"), "{t}");
    assert!(t.contains("LOST extents: 3, 9"), "{t}");
    assert!(t.contains("d2: read timed out"), "{t}");
    assert!(t.contains("64 MiB in 64 extents"), "{t}");
    assert!(!t.contains("UNFOUND"), "{t}");
    let mut s = sample();
    s.totals.unfound_pages = 255;
    s.totals.unfound_extents = vec![4, 5, 6];
    let t = render_table(&s);
    assert!(t.contains("UNFOUND: 255 pages in extents 4..6"), "{t}");
}

#[test]
fn a_device_with_too_few_donors_taking_pages_says_it_cannot_place() {
    let mut s = sample();
    s.code = "1+1".into();
    s.donors[0].slots_free = 10;
    let why = s.cannot_place().expect("one of two donors for mirror");
    assert!(why.contains("2 distinct donors, and 1 of 2"), "{why}");
    assert!(why.contains("d2: failed (read timed out)"), "{why}");
    assert!(render_table(&s).contains("CANNOT PLACE new extents"));
    s.donors[1].failed = false;
    s.donors[1].slots_free = 10;
    assert_eq!(s.cannot_place(), None);
    s.donors[1].state = "draining".into();
    assert!(s.cannot_place().unwrap().contains("d2: draining"));
    // A fallback file takes what donors cannot.
    s.totals.fallback_path = Some("/var/tmp/fb".into());
    assert_eq!(s.cannot_place(), None);
    assert!(!render_table(&s).contains("CANNOT PLACE"));
}

#[test]
fn numbers_print_as_ranges() {
    assert_eq!(format_ranges(&[]), "");
    assert_eq!(format_ranges(&[7]), "7");
    assert_eq!(format_ranges(&(0..16).collect::<Vec<_>>()), "0..15");
    assert_eq!(format_ranges(&[0, 1, 3, 5, 6, 7, 9]), "0..1, 3, 5..7, 9");
}
