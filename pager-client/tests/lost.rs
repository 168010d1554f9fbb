//! Lost extents (issue 25, hazard 7): a parity device whose donors all
//! restarted while it was closed comes back with every extent lost. A
//! write into a lost extent places it again (its unwritten pages read as
//! errors until written), `forget_lost` makes lost extents read as zeros,
//! and both are journaled, so a reopen keeps them.

mod common;

use common::{config, wait_status, Model, Nbdkit, Rng};
use pager_client::config::Mode;
use pager_client::device::{Device, DeviceError};
use pager_client::status::render_table;

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 2 << 20;
const PAGE: u64 = 4096;
/// Mode parity of width 3: two data extents per group.
const MODE: Mode = Mode::Parity { width: 3 };

/// Three donors and a parity device on them in `state`, filled (whole
/// stripes, and small writes that go to the parity log), then closed; the
/// donors restart empty at the same addresses. Returns the donors.
fn donors_restarted_under_a_closed_device(state: &std::path::Path) -> Vec<Nbdkit> {
    let mut ds: Vec<Nbdkit> = (0..3).map(|_| Nbdkit::memory("16M")).collect();
    {
        let refs: Vec<&Nbdkit> = ds.iter().collect();
        let dev = Device::open(config(MODE, SIZE, EXTENT, &refs), state).unwrap();
        let mut model = Model::new(SIZE);
        let mut rng = Rng::new(25);
        model.fill(&dev, &mut rng, 2 * EXTENT);
        for _ in 0..50 {
            model.random_write(&dev, &mut rng, 3 * PAGE);
        }
    }
    for d in ds.iter_mut() {
        let addr = d.addr.clone();
        d.kill9();
        *d = Nbdkit::memory_at(&addr, "16M");
    }
    ds
}

/// Opens the device in `state` and waits until its donors serve again
/// (each is back as a new donor).
fn reopen(ds: &[Nbdkit], state: &std::path::Path) -> Device {
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let dev = Device::open(config(MODE, SIZE, EXTENT, &refs), state).unwrap();
    wait_status(&dev, "the restarted donors back as new ones", |s| {
        s.donors.iter().all(|d| !d.failed)
    });
    dev
}

fn read(dev: &Device, off: u64, len: u64) -> Result<Vec<u8>, DeviceError> {
    let mut b = vec![0u8; len as usize];
    dev.read(&mut b, off).map(|()| b)
}

fn assert_lost(dev: &Device, off: u64, len: u64) {
    match read(dev, off, len) {
        Ok(_) => panic!(
            "{len} bytes at {off} read, but they were lost\n{}",
            render_table(&dev.status())
        ),
        Err(e) => assert_eq!(e.errno(), libc::EIO, "{e}"),
    }
}

fn all_extents() -> Vec<u64> {
    (0..SIZE / EXTENT).collect()
}

#[test]
fn a_write_into_a_lost_extent_places_it_again_and_a_reopen_keeps_that() {
    let state = tempfile::tempdir().unwrap();
    let ds = donors_restarted_under_a_closed_device(state.path());
    let dev = reopen(&ds, state.path());
    let s = dev.status();
    assert_eq!(s.totals.lost_extents, all_extents(), "{}", render_table(&s));
    assert_lost(&dev, 0, PAGE);

    // Part of a page (it has to be merged with the lost rest) and a whole
    // page, in group 0 (extents 0 and 1).
    dev.write(&[7u8; 100], 0).unwrap_or_else(|e| {
        panic!(
            "a write into a lost extent: {e}\n{}",
            render_table(&dev.status())
        )
    });
    dev.write(&[9u8; PAGE as usize], EXTENT + PAGE).unwrap();
    let check = |dev: &Device| {
        let b = read(dev, 0, PAGE).unwrap();
        assert!(b[..100].iter().all(|&x| x == 7) && b[100..].iter().all(|&x| x == 0));
        assert!(read(dev, EXTENT + PAGE, PAGE)
            .unwrap()
            .iter()
            .all(|&x| x == 9));
        // The pages not written since are still lost, and say what to do.
        let e = read(dev, PAGE, PAGE).unwrap_err();
        assert_eq!(e.errno(), libc::EIO);
        assert!(e.to_string().contains("forget-lost"), "{e}");
        assert_lost(dev, EXTENT, 2 * PAGE);
        assert_lost(dev, 0, 2 * EXTENT);
        // Group 1 is untouched: still lost.
        assert_lost(dev, 2 * EXTENT, PAGE);
        let s = dev.status();
        let t = &s.totals;
        assert_eq!(t.lost_extents, (2..SIZE / EXTENT).collect::<Vec<_>>());
        assert_eq!(
            t.unfound_pages,
            2 * EXTENT / PAGE - 2,
            "{}",
            render_table(&s)
        );
        assert_eq!(t.unfound_extents, [0, 1]);
        assert!(render_table(&s).contains("UNFOUND: 30 pages in extents 0..1"));
    };
    check(&dev);
    drop(dev);

    let dev = reopen(&ds, state.path());
    check(&dev);
    // Written whole, a page is found again.
    dev.write(&[5u8; PAGE as usize], PAGE).unwrap();
    assert!(read(&dev, PAGE, PAGE).unwrap().iter().all(|&x| x == 5));
    assert_eq!(dev.status().totals.unfound_pages, 2 * EXTENT / PAGE - 3);
}

#[test]
fn forget_lost_makes_lost_extents_read_as_zeros_and_a_reopen_keeps_that() {
    let state = tempfile::tempdir().unwrap();
    let ds = donors_restarted_under_a_closed_device(state.path());
    let dev = reopen(&ds, state.path());
    // A page written into extent 0 first: the rest of group 0 is unfound.
    dev.write(&[3u8; PAGE as usize], 0).unwrap();

    // Extents 3..4: groups 1 and 2 get fresh members; extents 2 and 5
    // share those groups but are outside the range, so they stay lost.
    let f = dev.forget_lost(Some(3..=4)).unwrap();
    assert_eq!((f.extents, f.pages), (vec![3, 4], 0));
    assert!(read(&dev, 3 * EXTENT, 2 * EXTENT)
        .unwrap()
        .iter()
        .all(|&x| x == 0));
    assert_lost(&dev, 2 * EXTENT, PAGE);
    assert_lost(&dev, 5 * EXTENT, PAGE);
    assert_lost(&dev, 6 * EXTENT, PAGE);

    // Everything else: the unfound pages of group 0 too.
    let f = dev.forget_lost(None).unwrap();
    assert_eq!(f.extents, (6..SIZE / EXTENT).collect::<Vec<_>>());
    assert_eq!(f.pages, 2 * EXTENT / PAGE - 1 + 2 * EXTENT / PAGE);
    let check = |dev: &Device| {
        let all = read(dev, 0, SIZE).unwrap();
        assert!(all[..PAGE as usize].iter().all(|&x| x == 3));
        assert!(all[PAGE as usize..].iter().all(|&x| x == 0));
        let s = dev.status();
        assert_eq!(
            (s.totals.lost, s.totals.unfound_pages),
            (0, 0),
            "{}",
            render_table(&s)
        );
    };
    check(&dev);
    match dev.forget_lost(None) {
        Err(e @ DeviceError::NothingLost { .. }) => {
            assert!(e.to_string().contains("nothing is lost"), "{e}")
        }
        other => panic!("forget-lost with nothing lost: {other:?}"),
    }
    let e = dev.forget_lost(Some(30..=40)).unwrap_err();
    assert!(e.to_string().contains("has extents 0..31 only"), "{e}");
    drop(dev);

    let dev = reopen(&ds, state.path());
    check(&dev);
    // Writable and redundant as any other: a write reads back.
    dev.write(&[4u8; 10_000], 7 * EXTENT - 5000).unwrap();
    assert!(read(&dev, 7 * EXTENT - 5000, 10_000)
        .unwrap()
        .iter()
        .all(|&x| x == 4));
}
