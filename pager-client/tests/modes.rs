//! Data integrity of the device in every mode against an in-memory model,
//! with random writes, zeroes and reads at any alignment across extent
//! boundaries, on real nbdkit donors; persistence across reopen; striping.

mod common;

use common::{config, Model, Nbdkit, Rng};
use pager_client::config::{ByteSize, FallbackConfig, Mode};
use pager_client::device::Device;

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;

fn donors(n: usize) -> Vec<Nbdkit> {
    (0..n).map(|_| Nbdkit::memory("8M")).collect()
}

fn exercise(mode: Mode, n_donors: usize, seed: u64) {
    let ds = donors(n_donors);
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(mode.clone(), SIZE, EXTENT, &refs);
    let wt = tempfile::tempdir().unwrap();
    if let Mode::Disk { .. } = mode {
        cfg.mode = Mode::Disk {
            path: wt.path().join("wt.img"),
            queue: ByteSize(1 << 20),
        };
    }
    let dev = Device::open(cfg, state.path()).unwrap();
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(seed);
    // Never-written space reads as zeros.
    model.check(&dev, 0, 3 * EXTENT + 17);
    // Whole parity groups (and runs of whole extents in other modes).
    let group = match mode {
        Mode::Parity { width } => (width as u64 - 1) * EXTENT,
        _ => EXTENT,
    };
    for i in 0..600 {
        match rng.below(11) {
            0..=4 => model.random_write(&dev, &mut rng, 3 * EXTENT),
            5 => model.random_zero(&dev, &mut rng, 2 * EXTENT),
            6 => {
                let len = group * (1 + rng.below(2));
                model.aligned_write(&dev, &mut rng, group, len)
            }
            _ => model.random_check(&dev, &mut rng, 3 * EXTENT),
        }
        if i % 200 == 199 {
            dev.flush().unwrap();
        }
    }
    model.check_all(&dev, 1 << 20);
    let s = dev.status();
    assert_eq!(s.totals.lost, 0);
    assert_eq!(s.totals.degraded, 0);
    assert!(s.totals.units_placed > 0);
    assert!(
        s.donors.iter().all(|d| !d.failed),
        "{}",
        pager_client::status::render_table(&s)
    );
}

#[test]
fn mode_none_keeps_data() {
    exercise(Mode::None, 3, 1);
}

#[test]
fn mode_mirror_keeps_data() {
    exercise(Mode::Mirror, 3, 2);
}

#[test]
fn mode_parity_keeps_data() {
    exercise(Mode::Parity { width: 3 }, 4, 3);
}

#[test]
fn mode_parity_width_four_keeps_data() {
    exercise(Mode::Parity { width: 4 }, 4, 4);
}

#[test]
fn mode_disk_keeps_data() {
    exercise(
        Mode::Disk {
            path: "set in exercise".into(),
            queue: ByteSize(1 << 20),
        },
        2,
        5,
    );
}

#[test]
fn extents_are_striped_and_mirror_copies_are_distinct() {
    let ds = donors(3);
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let dev = Device::open(config(Mode::Mirror, SIZE, EXTENT, &refs), state.path()).unwrap();
    // Three consecutive extents, six copies: with equal weights each donor
    // gets two and no extent has both copies on one donor.
    for e in 0..3u64 {
        dev.write(&[e as u8 + 1; 4096], e * EXTENT).unwrap();
    }
    let s = dev.status();
    let held: Vec<u64> = s.donors.iter().map(|d| d.extents_held).collect();
    assert_eq!(
        held,
        vec![2, 2, 2],
        "{}",
        pager_client::status::render_table(&s)
    );
    let ds1 = donors(3);
    let refs1: Vec<&Nbdkit> = ds1.iter().collect();
    let state1 = tempfile::tempdir().unwrap();
    let dev1 = Device::open(config(Mode::None, SIZE, EXTENT, &refs1), state1.path()).unwrap();
    for e in 0..6u64 {
        dev1.write(&[1; 512], e * EXTENT + 100).unwrap();
    }
    let held: Vec<u64> = dev1
        .status()
        .donors
        .iter()
        .map(|d| d.extents_held)
        .collect();
    assert_eq!(held, vec![2, 2, 2]);
}

#[test]
fn whole_extent_trim_frees_its_slots_and_reads_zeros() {
    let ds = donors(2);
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let dev = Device::open(config(Mode::Mirror, SIZE, EXTENT, &refs), state.path()).unwrap();
    dev.write(&vec![7u8; 2 * EXTENT as usize], EXTENT).unwrap();
    assert_eq!(dev.status().totals.units_placed, 2);
    dev.trim(EXTENT, EXTENT).unwrap();
    let s = dev.status();
    assert_eq!(s.totals.units_placed, 1);
    assert_eq!(s.donors.iter().map(|d| d.extents_held).sum::<u64>(), 2);
    let mut b = vec![1u8; 2 * EXTENT as usize];
    dev.read(&mut b, EXTENT).unwrap();
    assert!(b[..EXTENT as usize].iter().all(|&x| x == 0));
    assert!(b[EXTENT as usize..].iter().all(|&x| x == 7));
    // A freed slot is reused, and a partial write there must not expose
    // the old contents.
    dev.write(&[9u8; 10], 5 * EXTENT + 3).unwrap();
    let mut b = vec![1u8; EXTENT as usize];
    dev.read(&mut b, 5 * EXTENT).unwrap();
    assert!(
        b[..3].iter().all(|&x| x == 0)
            && b[3..13].iter().all(|&x| x == 9)
            && b[13..].iter().all(|&x| x == 0)
    );
    let alloc = dev.allocation(0, 3 * EXTENT);
    assert_eq!(
        alloc,
        vec![(0, 2 * EXTENT, false), (2 * EXTENT, EXTENT, true)]
    );
}

#[test]
fn map_survives_reopen() {
    let ds = donors(3);
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let cfg = config(Mode::Parity { width: 3 }, SIZE, EXTENT, &refs);
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(9);
    {
        let dev = Device::open(cfg.clone(), state.path()).unwrap();
        for _ in 0..200 {
            model.random_write(&dev, &mut rng, 2 * EXTENT);
        }
        dev.flush().unwrap();
    }
    let dev = Device::open(cfg, state.path()).unwrap();
    model.check_all(&dev, 1 << 20);
    assert_eq!(dev.status().totals.lost, 0);
}

#[test]
fn torn_journal_tail_loses_only_the_last_placement() {
    let ds = donors(2);
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let cfg = config(Mode::Mirror, SIZE, EXTENT, &refs);
    {
        let dev = Device::open(cfg.clone(), state.path()).unwrap();
        for e in 0..5u64 {
            dev.write(&[e as u8 + 1; 1000], e * EXTENT).unwrap();
        }
        dev.flush().unwrap();
    }
    // The last journal record is extent 4's placement: tear it.
    let j = state.path().join(pager_client::extent_map::JOURNAL_FILE);
    let len = std::fs::metadata(&j).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&j)
        .unwrap()
        .set_len(len - 5)
        .unwrap();
    let dev = Device::open(cfg, state.path()).unwrap();
    for e in 0..4u64 {
        let mut b = vec![0u8; 1000];
        dev.read(&mut b, e * EXTENT).unwrap();
        assert!(b.iter().all(|&x| x == e as u8 + 1), "extent {e}");
    }
    let mut b = vec![1u8; 1000];
    dev.read(&mut b, 4 * EXTENT).unwrap();
    assert!(
        b.iter().all(|&x| x == 0),
        "the torn placement reads as never written"
    );
    // Its slots were given back and are reused safely.
    dev.write(&[42u8; 10], 4 * EXTENT).unwrap();
    dev.read(&mut b, 4 * EXTENT).unwrap();
    assert!(b[..10].iter().all(|&x| x == 42) && b[10..].iter().all(|&x| x == 0));
}

#[test]
fn full_donors_spill_to_the_fallback_then_enospc() {
    // Donor exports of 4 extents: slot 0 is the label, 3 slots each.
    let ds: Vec<Nbdkit> = (0..2)
        .map(|_| Nbdkit::memory(&(4 * EXTENT).to_string()))
        .collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let fb_dir = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(Mode::None, 16 * EXTENT, EXTENT, &refs);
    cfg.fallback = Some(FallbackConfig {
        path: fb_dir.path().join("fallback.img"),
        size: ByteSize(8 * EXTENT),
    });
    let dev = Device::open(cfg, state.path()).unwrap();
    let mut model = Model::new(16 * EXTENT);
    for e in 0..14u64 {
        let mut b = vec![0u8; 3000];
        Rng::new(e).fill(&mut b);
        dev.write(&b, e * EXTENT + 50).unwrap();
        model.data[(e * EXTENT + 50) as usize..(e * EXTENT + 3050) as usize].copy_from_slice(&b);
    }
    let s = dev.status();
    assert_eq!(
        s.totals.on_fallback,
        8,
        "{}",
        pager_client::status::render_table(&s)
    );
    assert!(s
        .totals
        .placement_note
        .as_deref()
        .unwrap_or("")
        .contains("fallback"));
    // Donors and fallback are full now.
    let err = dev.write(&[1u8; 10], 15 * EXTENT).unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    model.check_all(&dev, 1 << 20);
}

#[test]
fn no_fallback_means_enospc_when_donors_are_full() {
    let ds: Vec<Nbdkit> = (0..2)
        .map(|_| Nbdkit::memory(&(3 * EXTENT).to_string()))
        .collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let dev = Device::open(
        config(Mode::Mirror, 16 * EXTENT, EXTENT, &refs),
        state.path(),
    )
    .unwrap();
    dev.write(&[1u8; 100], 0).unwrap();
    dev.write(&[2u8; 100], EXTENT).unwrap();
    let err = dev.write(&[3u8; 100], 2 * EXTENT).unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert!(err.to_string().contains("no fallback"), "{err}");
    let s = dev.status();
    assert!(s
        .totals
        .placement_note
        .as_deref()
        .unwrap_or("")
        .contains("ENOSPC"));
    let mut b = [0u8; 100];
    dev.read(&mut b, EXTENT).unwrap();
    assert_eq!(b, [2u8; 100]);
    // The reason names what is full, not the copies a unit already has.
    assert!(
        err.to_string().contains("our export on it is full"),
        "{err}"
    );
    assert!(!err.to_string().contains("holds another copy"), "{err}");
    // Room again (extent 0 trimmed whole): the next placement works and
    // status no longer shows the old ENOSPC.
    dev.trim(EXTENT, 0).unwrap();
    dev.write(&[3u8; 100], 2 * EXTENT).unwrap();
    assert_eq!(dev.status().totals.placement_note, None);
}
