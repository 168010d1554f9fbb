//! Donor failures: a donor killed (-9) or hung (SIGSTOP) in the middle of
//! concurrent I/O. Mirror, parity and disk keep every byte readable,
//! report the device degraded, rebuild onto the other donors, and a donor
//! that comes back is used as a new one. Mode none reports exactly the
//! extents that were on the dead donor as lost.

mod common;

use std::sync::Arc;

use common::{config, wait_status, Fault, Model, Nbdkit, Rng, Workers};
use pager_client::config::{ByteSize, Mode};
use pager_client::device::Device;
use pager_client::status::render_table;

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 2 << 20;

/// Fills the device, then runs two threads of random I/O on disjoint halves
/// while donor 1 fails; checks everything, waits for the rebuild, then
/// fails donor 0 as well and checks again.
fn fail_mid_run(
    mode: Mode,
    n_donors: usize,
    fault: Fault,
    seed: u64,
) -> (Vec<Nbdkit>, Arc<Device>, Model, tempfile::TempDir) {
    let mut ds: Vec<Nbdkit> = (0..n_donors).map(|_| Nbdkit::memory("4M")).collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(mode.clone(), SIZE, EXTENT, &refs);
    if let Mode::Disk { .. } = mode {
        cfg.mode = Mode::Disk {
            path: state.path().join("wt.img"),
            queue: ByteSize(1 << 20),
        };
    }
    let dev = Arc::new(Device::open(cfg, state.path()).unwrap());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(seed);
    model.fill(&dev, &mut rng, EXTENT);
    // Whole parity groups of width 3: two extents of data.
    let workers = Workers::start(&dev, &model, 2 * EXTENT, 2 * EXTENT, seed);
    fault.apply(&mut ds[1]);
    workers.join(&mut model);
    let s = wait_status(&dev, "donor d1 marked failed", |s| s.donors[1].failed);
    assert!(s.donors[1].failure.is_some());
    model.check_all(&dev, 256 << 10);
    let s = wait_status(&dev, "rebuild done", |s| {
        s.totals.degraded == 0 && !s.totals.rebuild.active && s.donors[1].extents_held == 0
    });
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
    assert!(s.totals.rebuild.done > 0, "{}", render_table(&s));
    model.check_all(&dev, 256 << 10);
    (ds, dev, model, state)
}

#[test]
fn mirror_survives_a_killed_donor_and_rebuilds() {
    let (mut ds, dev, mut model, _state) = fail_mid_run(Mode::Mirror, 3, Fault::Kill, 11);
    // The dead donor comes back empty at the same address: a new donor.
    let addr = ds[1].addr.clone();
    ds[1] = Nbdkit::memory_at(&addr, "4M");
    wait_status(&dev, "d1 back as a new donor", |s| !s.donors[1].failed);
    dev.write(&[5u8; 100], 0).unwrap();
    model.data[..100].fill(5);
    // Redundancy was restored: losing another donor loses nothing.
    ds[0].kill9();
    model.check_all(&dev, 256 << 10);
}

#[test]
fn mirror_detects_a_hung_donor_by_timeout() {
    let (mut ds, dev, model, _state) = fail_mid_run(Mode::Mirror, 3, Fault::Hang, 12);
    ds[0].kill9();
    model.check_all(&dev, 256 << 10);
}

#[test]
fn parity_survives_a_killed_donor_and_rebuilds() {
    let (mut ds, dev, model, _state) = fail_mid_run(Mode::Parity { width: 3 }, 4, Fault::Kill, 13);
    ds[0].kill9();
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert!(
        s.totals.degraded > 0 && s.totals.lost == 0,
        "{}",
        render_table(&s)
    );
}

#[test]
fn parity_detects_a_hung_donor_by_timeout() {
    let (mut ds, dev, model, _state) = fail_mid_run(Mode::Parity { width: 3 }, 4, Fault::Hang, 14);
    ds[2].kill9();
    model.check_all(&dev, 256 << 10);
}

#[test]
fn disk_mode_reads_back_from_the_file_and_rebuilds() {
    let (mut ds, dev, model, _state) = fail_mid_run(
        Mode::Disk {
            path: "set in fail_mid_run".into(),
            queue: ByteSize(1 << 20),
        },
        2,
        Fault::Kill,
        15,
    );
    // Every remote copy gone: the write-through file still has it all.
    ds[0].kill9();
    model.check_all(&dev, 256 << 10);
}

#[test]
fn disk_mode_detects_a_hung_donor() {
    let (_ds, dev, model, _state) = fail_mid_run(
        Mode::Disk {
            path: "set in fail_mid_run".into(),
            queue: ByteSize(1 << 20),
        },
        3,
        Fault::Hang,
        16,
    );
    model.check_all(&dev, 256 << 10);
}

#[test]
fn mode_none_reports_exactly_the_dead_donors_extents_as_lost() {
    let mut ds: Vec<Nbdkit> = (0..3).map(|_| Nbdkit::memory("4M")).collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let dev = Device::open(config(Mode::None, SIZE, EXTENT, &refs), state.path()).unwrap();
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(21);
    let n = SIZE / EXTENT;
    for e in 0..n {
        model.write_random(&dev, &mut rng, e * EXTENT + 300, 5000);
    }
    let held = dev.status().donors[1].extents_held;
    assert!(held > 0);
    ds[1].kill9();
    let mut failed = Vec::new();
    for e in 0..n {
        let mut b = vec![0u8; EXTENT as usize];
        match dev.read(&mut b, e * EXTENT) {
            Ok(()) => assert_eq!(
                b,
                model.data[(e * EXTENT) as usize..((e + 1) * EXTENT) as usize],
                "extent {e}"
            ),
            Err(err) => {
                assert_eq!(err.errno(), libc::EIO, "{err}");
                failed.push(e);
            }
        }
    }
    assert_eq!(failed.len() as u64, held);
    let s = wait_status(&dev, "lost extents reported", |s| s.totals.lost == held);
    assert_eq!(s.totals.lost_extents, failed, "{}", render_table(&s));
    assert!(render_table(&s).contains("LOST extents"));
    // A partial write to a lost extent cannot bring the rest back...
    assert_eq!(
        dev.write(&[1u8; 10], failed[0] * EXTENT)
            .unwrap_err()
            .errno(),
        libc::EIO
    );
    // ...a whole-extent write replaces it on a live donor.
    dev.write(&vec![8u8; EXTENT as usize], failed[0] * EXTENT)
        .unwrap();
    let mut b = vec![0u8; EXTENT as usize];
    dev.read(&mut b, failed[0] * EXTENT).unwrap();
    assert!(b.iter().all(|&x| x == 8));
    // Nothing else was affected.
    dev.write(&[3u8; 10], 0).unwrap();
}

#[test]
fn a_donor_that_restarted_while_the_client_was_down_is_not_trusted() {
    let mut ds: Vec<Nbdkit> = (0..3).map(|_| Nbdkit::memory("4M")).collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let cfg = config(Mode::Mirror, SIZE, EXTENT, &refs);
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(51);
    {
        let dev = Device::open(cfg.clone(), state.path()).unwrap();
        for _ in 0..100 {
            model.random_write(&dev, &mut rng, 2 * EXTENT);
        }
        assert!(dev.status().donors[1].extents_held > 0);
    }
    // Donor 1 restarts empty: reading its (zeroed) slots would be wrong.
    let addr = ds[1].addr.clone();
    ds[1].kill9();
    ds[1] = Nbdkit::memory_at(&addr, "4M");
    let dev = Device::open(cfg, state.path()).unwrap();
    let s = dev.status();
    assert!(
        s.donors[1]
            .failure
            .as_deref()
            .unwrap_or("")
            .contains("label mismatch"),
        "{}",
        render_table(&s)
    );
    model.check_all(&dev, 256 << 10);
    let s = wait_status(&dev, "rebuilt, and donor 1 back as a new donor", |s| {
        s.totals.degraded == 0 && !s.totals.rebuild.active && !s.donors[1].failed
    });
    assert_eq!(s.totals.lost, 0);
    model.check_all(&dev, 256 << 10);
}
