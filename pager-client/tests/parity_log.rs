//! The parity log (mode parity): small writes become whole new rows with
//! no reads, their data reads back from the log, survives reopen and a
//! killed donor, and a log too small for the working set is cleaned while
//! every byte stays right; an idle device moves the log home and frees it,
//! a donor killed meanwhile included. Real nbdkit donors; checked against
//! a model.

mod common;

use std::sync::Arc;

use common::{config, wait_status, Model, Nbdkit, Rng};
use pager_client::config::{ByteSize, Mode};
use pager_client::device::Device;
use pager_client::extent_map::Layout;
use pager_client::status::{render_table, ClientStatus};

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;
const PAGE: u64 = 4096;

fn donors(n: usize) -> Vec<Nbdkit> {
    (0..n).map(|_| Nbdkit::memory("8M")).collect()
}

fn open(ds: &[Nbdkit], log: Option<u64>, state: &std::path::Path) -> Device {
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut cfg = config(Mode::Parity { width: 3 }, SIZE, EXTENT, &refs);
    cfg.parity_log = log.map(ByteSize);
    Device::open(cfg, state).unwrap()
}

fn donor_io(s: &ClientStatus) -> (u64, u64) {
    s.donors
        .iter()
        .fold((0, 0), |(r, w), d| (r + d.reads, w + d.writes))
}

/// Writes `n` random whole pages from 8 threads at once; returns the model.
fn write_pages(dev: &Arc<Device>, mut model: Model, n: usize, seed: u64) -> Model {
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let dev = dev.clone();
            // Disjoint regions: each thread keeps its own model.
            let (lo, hi) = (t * SIZE / 8, (t + 1) * SIZE / 8);
            let mut m = model.region(lo, hi);
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed * 10 + t);
                for _ in 0..n / 8 {
                    let off = lo + rng.below((hi - lo) / PAGE) * PAGE;
                    m.write_random(&dev, &mut rng, off, PAGE);
                }
                m
            })
        })
        .collect();
    for t in threads {
        model.merge(&t.join().unwrap());
    }
    model
}

#[test]
fn small_writes_become_log_rows_without_reads() {
    let ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    // Room for 800 pages even if every row held just one.
    let dev = Arc::new(open(&ds, Some(2 * SIZE), state.path()));
    let before = donor_io(&dev.status());
    let model = write_pages(&dev, Model::new(SIZE), 800, 1);
    let s = dev.status();
    let (reads, writes) = donor_io(&s);
    // Placing a log unit zeroes its members; a row is at most 3 writes
    // for up to 2 pages, so never more than 2 writes per page.
    assert_eq!(reads, before.0, "{}", render_table(&s));
    assert!(writes - before.1 <= 2 * 800, "{} writes", writes - before.1);
    assert_eq!(s.totals.parity_log_bytes, 2 * SIZE);
    assert!(s.totals.parity_log_live_bytes > 0, "{}", render_table(&s));
    assert!(render_table(&s).contains("parity log:"));
    model.check_all(&dev, 256 << 10);
}

#[test]
fn without_the_log_small_writes_read_modify_write() {
    let ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let dev = Arc::new(open(&ds, Some(0), state.path()));
    let before = donor_io(&dev.status());
    let model = write_pages(&dev, Model::new(SIZE), 400, 2);
    let s = dev.status();
    // Old data and old parity are read for every page.
    assert_eq!(donor_io(&s).0 - before.0, 2 * 400, "{}", render_table(&s));
    assert_eq!(s.totals.parity_log_bytes, 0);
    model.check_all(&dev, 256 << 10);
}

#[test]
fn any_mix_of_writes_reads_back_with_the_log() {
    let ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let dev = open(&ds, None, state.path());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(3);
    for _ in 0..1500 {
        match rng.below(10) {
            // Unaligned pieces: merged with the page's current copy.
            0..=3 => model.random_write(&dev, &mut rng, 3 * PAGE),
            4 => model.random_zero(&dev, &mut rng, 2 * EXTENT),
            // Whole groups go home and supersede logged pages.
            5 => model.aligned_write(&dev, &mut rng, 2 * EXTENT, 2 * EXTENT),
            _ => model.random_check(&dev, &mut rng, 3 * EXTENT),
        }
    }
    model.check_all(&dev, 256 << 10);
}

#[test]
fn logged_pages_survive_reopen() {
    let ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let model = {
        let dev = Arc::new(open(&ds, None, state.path()));
        let m = write_pages(&dev, Model::new(SIZE), 400, 4);
        assert!(dev.status().totals.parity_log_live_bytes > 0);
        dev.flush().unwrap();
        m
    };
    let dev = open(&ds, None, state.path());
    assert!(dev.status().totals.parity_log_live_bytes > 0);
    model.check_all(&dev, 256 << 10);
}

#[test]
fn a_full_log_is_cleaned_and_keeps_every_byte() {
    let ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    // Three log units of 32 pages each for a working set of 1024 pages.
    let log = 3 * 2 * EXTENT;
    let dev = Arc::new(open(&ds, Some(log), state.path()));
    let mut model = Model::new(SIZE);
    for round in 0..4 {
        model = write_pages(&dev, model, 800, 10 + round);
        let s = dev.status();
        assert!(
            s.totals.parity_log_used_bytes <= log,
            "{}",
            render_table(&s)
        );
        model.check_all(&dev, 256 << 10);
    }
    // Pages in the log are rewritten elsewhere until units are free again.
    let s = wait_status(&dev, "the cleaner frees log units", |s| {
        s.totals.parity_log_used_bytes < log
    });
    assert_eq!(s.totals.lost, 0);
    model.check_all(&dev, 256 << 10);
}

#[test]
fn a_killed_donor_loses_no_logged_page() {
    let mut ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let dev = Arc::new(open(&ds, None, state.path()));
    let model = write_pages(&dev, Model::new(SIZE), 800, 5);
    assert!(dev.status().totals.parity_log_live_bytes > 0);
    ds[2].kill9();
    // Reads of pages on the dead donor are rebuilt from their rows.
    model.check_all(&dev, 256 << 10);
    let s = wait_status(&dev, "rebuild done", |s| {
        s.donors[2].failed && s.totals.degraded == 0 && !s.totals.rebuild.active
    });
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
    // Writes carry on into units on the three live donors.
    let model = write_pages(&dev, model, 400, 6);
    model.check_all(&dev, 256 << 10);
    // And the rebuilt copies hold: lose another donor.
    ds[0].kill9();
    model.check_all(&dev, 256 << 10);
}

#[test]
fn block_status_counts_logged_pages_as_data() {
    let ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let dev = open(&ds, None, state.path());
    let off = 5 * EXTENT + 3 * PAGE;
    dev.write(&[7u8; PAGE as usize], off).unwrap();
    let s = dev.status();
    // The page is in the log and its home group was never placed.
    assert_eq!(s.totals.units_placed, 0, "{}", render_table(&s));
    assert_eq!(s.totals.parity_log_live_bytes, PAGE);
    let map = dev.allocation(0, SIZE);
    let data: Vec<_> = map.iter().filter(|r| r.2).collect();
    assert_eq!(data.len(), 1, "{map:?}");
    assert!(
        data[0].0 <= off && off + PAGE <= data[0].0 + data[0].1,
        "{map:?}"
    );
}

#[test]
fn pages_written_together_read_back_in_a_few_requests() {
    let mut ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let dev = open(&ds, None, state.path());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(7);
    // One page at a time from one thread: every row holds one page, so
    // the 32 pages lie in consecutive rows of a few log units.
    let (start, pages) = (9 * EXTENT, 32u64);
    for p in 0..pages {
        let mut b = vec![0u8; PAGE as usize];
        rng.fill(&mut b);
        dev.write(&b, start + p * PAGE).unwrap();
        model.data[(start + p * PAGE) as usize..(start + (p + 1) * PAGE) as usize]
            .copy_from_slice(&b);
    }
    assert_eq!(dev.status().totals.parity_log_live_bytes, pages * PAGE);
    let before = donor_io(&dev.status()).0;
    model.check(&dev, start, pages * PAGE);
    let s = dev.status();
    // A request per run of rows on one member, not one per page.
    assert!(
        donor_io(&s).0 - before <= 4,
        "{} reads for {pages} logged pages\n{}",
        donor_io(&s).0 - before,
        render_table(&s)
    );
    // With a member gone the same read is rebuilt page by page.
    ds[0].kill9();
    model.check(&dev, start, pages * PAGE);
    model.check_all(&dev, 256 << 10);
}

#[test]
fn reads_at_any_offset_across_logged_and_home_pages_read_back() {
    let mut ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let dev = open(&ds, None, state.path());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(11);
    // Two groups at home (full stripes), then every third page logged.
    let group = 2 * EXTENT;
    model.write_random(&dev, &mut rng, 0, 2 * group);
    for p in (0..2 * group / PAGE).step_by(3) {
        model.write_random(&dev, &mut rng, p * PAGE, PAGE);
    }
    // Reads that start and end inside home pages and inside logged ones,
    // across an extent's and a group's end, and the whole of both groups.
    let reads = [
        (PAGE + 100, 6 * PAGE),
        (PAGE + 1, 2 * PAGE - 2),
        (3 * PAGE + 7, 40 * PAGE),
        (EXTENT - 50, 100),
        (group - 3000, 10_000),
        (0, 2 * group),
    ];
    for (off, len) in reads {
        model.check(&dev, off, len);
    }
    // The same with a member gone: rebuilt page by page.
    ds[1].kill9();
    for (off, len) in reads {
        model.check(&dev, off, len);
    }
}

/// Once idle, a device in `mode` moves its logged pages home and frees
/// the log: its donors then hold only the home groups, and every byte
/// reads back with `lose` donors killed.
fn idle_log_drains_home(mode: Mode, lose: usize) {
    let mut ds = donors(4);
    let state = tempfile::tempdir().unwrap();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut cfg = config(mode, SIZE, EXTENT, &refs);
    cfg.parity_log_idle_ms = 300;
    let members = Layout::from_config(&cfg).members() as u64;
    let dev = Arc::new(Device::open(cfg, state.path()).unwrap());
    let model = write_pages(&dev, Model::new(SIZE), 800, 8);
    assert!(dev.status().totals.parity_log_live_bytes > 0);
    let s = wait_status(&dev, "the idle log drained", |s| {
        s.totals.parity_log_used_bytes == 0
    });
    let held: u64 = s.donors.iter().map(|d| d.extents_held).sum();
    assert_eq!(
        held,
        s.totals.units_placed * members,
        "{}",
        render_table(&s)
    );
    model.check_all(&dev, 256 << 10);
    for d in &mut ds[..lose] {
        d.kill9();
    }
    model.check_all(&dev, 256 << 10);
    assert_eq!(dev.status().totals.lost, 0);
}

#[test]
fn an_idle_device_moves_logged_pages_home_and_frees_the_log() {
    idle_log_drains_home(Mode::Parity { width: 3 }, 1);
}

#[test]
fn an_idle_ec_device_moves_logged_pages_home_and_frees_the_log() {
    idle_log_drains_home(Mode::Ec { data: 2, parity: 2 }, 2);
}

#[test]
fn a_donor_killed_while_the_idle_log_drains_loses_no_page() {
    // Slow donors, so that moving the log home takes seconds.
    let mut ds: Vec<Nbdkit> = (0..4)
        .map(|_| Nbdkit::with_args(&["--filter=delay", "memory", "8M", "delay-write=3ms"]))
        .collect();
    let state = tempfile::tempdir().unwrap();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut cfg = config(Mode::Parity { width: 3 }, SIZE, EXTENT, &refs);
    cfg.parity_log = Some(ByteSize(2 * SIZE));
    cfg.parity_log_idle_ms = 300;
    let dev = Arc::new(Device::open(cfg, state.path()).unwrap());
    let model = write_pages(&dev, Model::new(SIZE), 800, 11);
    let logged = dev.status().totals.parity_log_live_bytes;
    let s = wait_status(&dev, "the idle drain under way", |s| {
        s.totals.parity_log_live_bytes < logged
    });
    assert!(
        s.totals.parity_log_live_bytes > 0,
        "the drain ended before the donor could be killed"
    );
    ds[1].kill9();
    let s = wait_status(&dev, "the log drained and the donor rebuilt", |s| {
        s.totals.parity_log_used_bytes == 0 && s.totals.degraded == 0 && !s.totals.rebuild.active
    });
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
    model.check_all(&dev, 256 << 10);
}
