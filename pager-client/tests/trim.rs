//! Trim in every mode (none, mirror, disk, parity, ec) on real donors:
//! trimmed pages read as zeros, also after a reopen; in
//! modes parity and ec a group trimmed whole (whatever the trims' sizes
//! and alignment) gives its members back, so the donors' used bytes fall;
//! a partial trim keeps the parity right, so a failed donor's pages still
//! decode; and the parity log's copies of trimmed pages are dropped, never
//! moved home by the idle drain. Skipped with a note when
//! libpager_server.so has not been built (see netpager_test_support::pager_server_so).

mod common;

use common::{config, wait_status, Model, Nbdkit, Rng};
use pager_client::config::{ByteSize, Mode};
use pager_client::device::Device;
use pager_client::status::{render_table, ClientStatus};

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;
const PAGE: u64 = 4096;
const PARITY: Mode = Mode::Parity { width: 3 };
const EC: Mode = Mode::Ec { data: 2, parity: 2 };

fn donors(n: usize) -> Vec<Nbdkit> {
    (0..n).map(|_| Nbdkit::memory("8M")).collect()
}

fn open(mode: &Mode, ds: &[Nbdkit], state: &std::path::Path) -> Device {
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut cfg = config(mode.clone(), SIZE, EXTENT, &refs);
    // The idle drain and the cleaner run soon after the last request.
    cfg.parity_log_idle_ms = 300;
    Device::open(cfg, state).unwrap()
}

fn width(mode: &Mode) -> usize {
    mode.donors_needed().max(2)
}

fn trim(dev: &Device, model: &mut Model, off: u64, len: u64) {
    dev.trim(len, off)
        .unwrap_or_else(|e| panic!("trim of {len} at {off}: {e}"));
    model.data[off as usize..(off + len) as usize].fill(0);
}

/// The device filled with whole stripes, then random pages written (into
/// the parity log in the striped modes).
fn filled(dev: &Device, seed: u64) -> (Model, Rng) {
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(seed);
    model.fill(dev, &mut rng, 256 << 10);
    for _ in 0..200 {
        let pages = 1 + rng.below(3);
        let off = rng.below(SIZE / PAGE - pages + 1) * PAGE;
        model.write_random(dev, &mut rng, off, pages * PAGE);
    }
    (model, rng)
}

/// Random page-aligned trims of up to `max_pages`, with writes between.
fn trim_randomly(dev: &Device, model: &mut Model, rng: &mut Rng, max_pages: u64) {
    for i in 0..150 {
        let pages = 1 + rng.below(max_pages);
        let off = rng.below(SIZE / PAGE - pages + 1) * PAGE;
        trim(dev, model, off, pages * PAGE);
        if i % 3 == 0 {
            let off = rng.below(SIZE / PAGE) * PAGE;
            model.write_random(dev, rng, off, PAGE);
        }
    }
}

fn trimmed_pages_read_zeros(mode: Mode) {
    let ds = donors(width(&mode));
    let state = tempfile::tempdir().unwrap();
    let dev = open(&mode, &ds, state.path());
    let (mut model, mut rng) = filled(&dev, 7);
    trim_randomly(&dev, &mut model, &mut rng, 40);
    // A whole extent and a whole group too.
    trim(&dev, &mut model, 8 * EXTENT, EXTENT);
    trim(&dev, &mut model, 12 * EXTENT, 4 * EXTENT);
    model.check_all(&dev, 128 << 10);
    drop(dev);
    // The zeros are the donors', not the running device's.
    let dev = open(&mode, &ds, state.path());
    model.check_all(&dev, 128 << 10);
}

#[test]
fn trimmed_pages_read_zeros_in_mode_none() {
    trimmed_pages_read_zeros(Mode::None);
}

#[test]
fn trimmed_pages_read_zeros_in_mode_mirror() {
    trimmed_pages_read_zeros(Mode::Mirror);
}

#[test]
fn trimmed_pages_read_zeros_in_mode_disk() {
    let wt = tempfile::tempdir().unwrap();
    trimmed_pages_read_zeros(Mode::Disk {
        path: wt.path().join("wt.img"),
        queue: ByteSize(1 << 20),
    });
}

#[test]
fn trimmed_pages_read_zeros_in_mode_parity() {
    trimmed_pages_read_zeros(PARITY);
}

#[test]
fn trimmed_pages_read_zeros_in_mode_ec() {
    trimmed_pages_read_zeros(EC);
}

/// A partial trim leaves parity matching the data (trimmed pages count as
/// zeros): with `lose` donors killed, every byte decodes right.
fn parity_holds_after_partial_trims(mode: Mode, lose: usize) {
    // Room to rebuild what the killed donors held.
    let mut ds = donors(width(&mode) + lose);
    let state = tempfile::tempdir().unwrap();
    let dev = open(&mode, &ds, state.path());
    let (mut model, mut rng) = filled(&dev, 11);
    trim_randomly(&dev, &mut model, &mut rng, 20);
    for d in ds.iter_mut().take(lose) {
        d.kill9();
    }
    // Read back at once: the pages on the killed donors are decoded from
    // the others unless their rebuild got there first.
    model.check_all(&dev, PAGE);
    wait_status(&dev, "the rebuild", |s| s.totals.degraded == 0);
    assert_eq!(
        dev.status().totals.lost,
        0,
        "{}",
        render_table(&dev.status())
    );
    model.check_all(&dev, 128 << 10);
}

#[test]
fn parity_holds_after_partial_trims_and_a_killed_donor() {
    parity_holds_after_partial_trims(PARITY, 1);
}

#[test]
fn ec_holds_after_partial_trims_and_two_killed_donors() {
    parity_holds_after_partial_trims(EC, 2);
}

fn used(s: &ClientStatus) -> u64 {
    s.donors.iter().map(|d| d.used_bytes).sum()
}

fn held(s: &ClientStatus) -> u64 {
    s.donors.iter().map(|d| d.extents_held).sum()
}

/// Each donor keeps one page of its own: our export's label.
fn nothing_held(s: &ClientStatus, ds: usize) -> bool {
    held(s) == 0 && s.totals.parity_log_used_bytes == 0 && used(s) <= ds as u64 * PAGE
}

/// The whole device trimmed by pieces that fit no group (7 pages, then
/// 1 MiB clusters shifted by 3 pages): every group and log unit is given
/// back and the donors' used bytes fall to their labels.
fn whole_groups_trimmed_free_their_members(mode: Mode) {
    let n = width(&mode);
    let Some(ds) = netpager_test_support::pager_servers(n) else {
        return;
    };
    let state = tempfile::tempdir().unwrap();
    let dev = open(&mode, &ds, state.path());
    let (mut model, _) = filled(&dev, 13);
    let s = wait_status(&dev, "the donors' reports of the data", |s| used(s) >= SIZE);
    let full = used(&s);
    let half = SIZE / 2;
    for off in (0..half).step_by(7 * PAGE as usize) {
        trim(&dev, &mut model, off, (7 * PAGE).min(half - off));
    }
    let cluster = 1u64 << 20;
    trim(&dev, &mut model, half, 3 * PAGE);
    let mut off = half + 3 * PAGE;
    while off < SIZE {
        let len = cluster.min(SIZE - off);
        trim(&dev, &mut model, off, len);
        off += len;
    }
    let s = wait_status(&dev, "the donors to give back what the device held", |s| {
        nothing_held(s, n)
    });
    assert!(used(&s) < full / 100, "{}", render_table(&s));
    model.check_all(&dev, 256 << 10);
    assert!(dev
        .allocation(0, SIZE)
        .iter()
        .all(|&(_, _, placed)| !placed));
}

#[test]
fn parity_groups_trimmed_whole_free_their_members() {
    whole_groups_trimmed_free_their_members(PARITY);
}

#[test]
fn ec_groups_trimmed_whole_free_their_members() {
    whole_groups_trimmed_free_their_members(EC);
}

/// Pages that only ever lived in the parity log, then trimmed: the idle
/// drain moves none of them home (no group is ever placed) and the log's
/// units are freed.
fn logged_trimmed_pages_stay_out_of_home(mode: Mode) {
    let n = width(&mode);
    let Some(ds) = netpager_test_support::pager_servers(n) else {
        return;
    };
    let state = tempfile::tempdir().unwrap();
    let dev = open(&mode, &ds, state.path());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(17);
    let pages: Vec<u64> = (0..300).map(|_| rng.below(SIZE / PAGE)).collect();
    for &p in &pages {
        model.write_random(&dev, &mut rng, p * PAGE, PAGE);
    }
    let s = dev.status();
    assert!(s.totals.parity_log_live_bytes > 0, "{}", render_table(&s));
    assert!(dev.allocation(0, SIZE).iter().any(|&(_, _, placed)| placed));
    for &p in &pages {
        trim(&dev, &mut model, p * PAGE, PAGE);
    }
    let s = wait_status(&dev, "the idle log to be freed", |s| nothing_held(s, n));
    assert_eq!(s.totals.parity_log_live_bytes, 0);
    assert!(
        dev.allocation(0, SIZE)
            .iter()
            .all(|&(_, _, placed)| !placed),
        "trimmed pages were moved home: {}",
        render_table(&s)
    );
    model.check_all(&dev, 256 << 10);
}

#[test]
fn parity_log_copies_of_trimmed_pages_are_not_drained_home() {
    logged_trimmed_pages_stay_out_of_home(PARITY);
}

#[test]
fn ec_log_copies_of_trimmed_pages_are_not_drained_home() {
    logged_trimmed_pages_stay_out_of_home(EC);
}
