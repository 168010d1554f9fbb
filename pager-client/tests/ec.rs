//! Mode ec 4+2 on real donors: data reads back, a read of data on a live
//! donor reads that donor only, two donors failed at once (killed, or one
//! hung and one killed) lose nothing and are rebuilt, a third failure loses exactly the groups that had three
//! members there (named, every other byte intact), and a re-attach with
//! another code is refused.

mod common;

use std::sync::Arc;

use common::{config, wait_status, Fault, Model, Nbdkit, Rng, Workers};
use pager_client::config::Mode;
use pager_client::device::Device;
use pager_client::status::render_table;

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;
const EC: Mode = Mode::Ec { data: 4, parity: 2 };
/// A whole stripe: four data extents.
const STRIPE: u64 = 4 * EXTENT;

fn donors(n: usize) -> Vec<Nbdkit> {
    (0..n).map(|_| Nbdkit::memory("8M")).collect()
}

/// A fresh ec 4+2 device on `ds`, its state in `state`.
fn open_ec(ds: &[Nbdkit], state: &std::path::Path) -> Device {
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    Device::open(config(EC, SIZE, EXTENT, &refs), state).unwrap()
}

/// Whole stripes of random data over the device, then random small writes.
fn fill(dev: &Device, model: &mut Model, rng: &mut Rng) {
    model.fill(dev, rng, STRIPE);
    for _ in 0..200 {
        model.random_write(dev, rng, 3 * 4096);
    }
}

#[test]
fn ec_reads_back_what_was_written_reading_one_donor_per_read() {
    let ds = donors(6);
    let state = tempfile::tempdir().unwrap();
    let dev = open_ec(&ds, state.path());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(41);
    model.fill(&dev, &mut rng, STRIPE);
    // Pages 17 and 300 go to the parity log, 0 and 777 stay home.
    for page in [17u64, 300] {
        let b = [page as u8; 4096];
        dev.write(&b, page * 4096).unwrap();
        model.data[(page * 4096) as usize..((page + 1) * 4096) as usize].copy_from_slice(&b);
    }
    // A page read on healthy donors is one request to one donor.
    let reads = |dev: &Device| -> u64 { dev.status().donors.iter().map(|d| d.reads).sum() };
    for page in [0u64, 17, 300, 777] {
        let before = reads(&dev);
        model.check(&dev, page * 4096, 4096);
        assert_eq!(reads(&dev), before + 1, "page {page}");
    }
    for _ in 0..300 {
        match rng.below(4) {
            0 => model.random_write(&dev, &mut rng, 2 * STRIPE),
            1 => model.aligned_write(&dev, &mut rng, STRIPE, STRIPE),
            2 => model.random_zero(&dev, &mut rng, EXTENT),
            _ => model.random_check(&dev, &mut rng, 2 * STRIPE),
        }
    }
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert_eq!((s.code.as_str(), s.memory_overhead), ("4+2", 1.5));
    assert_eq!(s.totals.can_lose, 2, "{}", render_table(&s));
    assert_eq!(s.totals.can_lose_units[..2], [0, 0], "{}", render_table(&s));
    assert!(render_table(&s).contains("ec (code 4+2)"));
}

#[test]
fn ec_survives_two_donors_killed_at_once_and_rebuilds() {
    two_failures_mid_run([Fault::Kill, Fault::Kill], 42);
}

#[test]
fn ec_survives_a_hung_and_a_killed_donor_and_rebuilds() {
    two_failures_mid_run([Fault::Hang, Fault::Kill], 44);
}

/// Two donors fail at once under concurrent I/O: no error reaches the
/// caller, every byte reads back, the rebuild restores both failures'
/// worth of redundancy.
fn two_failures_mid_run(faults: [Fault; 2], seed: u64) {
    // Eight donors: after two die, each group's two lost members still
    // have live donors that hold none of its members.
    let mut ds = donors(8);
    let state = tempfile::tempdir().unwrap();
    let dev = Arc::new(open_ec(&ds, state.path()));
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(seed);
    fill(&dev, &mut model, &mut rng);
    let workers = Workers::start(&dev, &model, STRIPE, 2 * EXTENT, seed);
    for (i, f) in [1, 4].into_iter().zip(faults) {
        f.apply(&mut ds[i]);
    }
    workers.join(&mut model);
    let s = wait_status(&dev, "d1 and d4 marked failed", |s| {
        s.donors[1].failed && s.donors[4].failed
    });
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
    model.check_all(&dev, 256 << 10);
    let s = wait_status(&dev, "rebuild done", |s| {
        s.totals.degraded == 0
            && !s.totals.rebuild.active
            && s.donors[1].extents_held == 0
            && s.donors[4].extents_held == 0
    });
    assert_eq!(
        (s.totals.lost, s.totals.can_lose),
        (0, 2),
        "{}",
        render_table(&s)
    );
    assert!(s.totals.rebuild.done > 0, "{}", render_table(&s));
    model.check_all(&dev, 256 << 10);
}

#[test]
fn ec_a_third_failure_loses_exactly_the_named_extents() {
    let mut ds = donors(8);
    let state = tempfile::tempdir().unwrap();
    let dev = open_ec(&ds, state.path());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(43);
    fill(&dev, &mut model, &mut rng);
    // Three at once: no rebuild comes between them.
    for i in [0, 3, 6] {
        ds[i].kill9();
    }
    let mut failed = Vec::new();
    for (e, msg) in model.failing_extents(&dev, EXTENT) {
        assert!(msg.contains("extent") && msg.contains("needed"), "{msg}");
        failed.push(e);
    }
    assert!(
        !failed.is_empty() && failed.len() < (SIZE / EXTENT) as usize,
        "lost {failed:?}"
    );
    let s = wait_status(&dev, "lost extents reported", |s| {
        s.donors[0].failed && s.donors[3].failed && s.donors[6].failed
    });
    assert_eq!(s.totals.lost_extents, failed, "{}", render_table(&s));
    assert!(render_table(&s).contains("LOST extents"));
    // Nothing else was affected: a second pass reads the same.
    for e in (0..SIZE / EXTENT).filter(|e| !failed.contains(e)) {
        model.check(&dev, e * EXTENT, EXTENT);
    }
}

#[test]
fn ec_reattach_with_another_code_is_refused_by_name() {
    let ds = donors(6);
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let dev = Device::open(config(EC, SIZE, EXTENT, &refs), state.path()).unwrap();
    dev.write(&[7u8; 4096], 0).unwrap();
    drop(dev);
    let other = Mode::Ec { data: 3, parity: 2 };
    let err = match Device::open(config(other, SIZE, EXTENT, &refs), state.path()) {
        Ok(_) => panic!("a 3+2 device opened over a 4+2 map"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("mode") && err.contains("data: 4") && err.contains("data: 3"),
        "{err}"
    );
    let dev = Device::open(config(EC, SIZE, EXTENT, &refs), state.path()).unwrap();
    let mut b = [0u8; 4096];
    dev.read(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 7));
}

#[test]
fn ec_reads_of_the_whole_device_spread_evenly_over_the_donors() {
    let ds = donors(6);
    let state = tempfile::tempdir().unwrap();
    let dev = open_ec(&ds, state.path());
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(43), STRIPE);
    let before: Vec<u64> = dev.status().donors.iter().map(|d| d.reads).collect();
    model.check_all(&dev, STRIPE);
    let s = dev.status();
    let reads: Vec<u64> = s
        .donors
        .iter()
        .zip(&before)
        .map(|(d, b)| d.reads - b)
        .collect();
    // 16 stripes of 4 data extents on 6 donors: 64 reads, 10 or 11 each
    // when every donor holds as many parity members as any other.
    let (lo, hi) = (reads.iter().min().unwrap(), reads.iter().max().unwrap());
    assert!(
        hi - lo <= 2,
        "reads per donor {reads:?}\n{}",
        render_table(&s)
    );
}
