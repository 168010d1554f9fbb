//! Live membership with real pager-server donors: donors join and leave a
//! device while I/O goes on, removals drain first and are refused below a
//! mode's minimum, the set survives a restart, dead donors are forgotten,
//! the donors file drives the set, and copies spilled to the fallback
//! move to donors that join. Skipped with a note when
//! libpager_server.so has not been built (see netpager_test_support::pager_server_so).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, wait_status, wait_status_every, Model, Nbdkit, Rng, Workers};
use netpager_membership::Joined;
use pager_client::config::{ByteSize, DonorConfig, FallbackConfig, Mode};
use pager_client::device::Device;
use pager_client::status::{render_table, ClientStatus};

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;

fn donor_config(name: &str, d: &Nbdkit) -> DonorConfig {
    let mut c = DonorConfig::new(name, d.addr.clone());
    c.status = d.status.clone();
    c
}

/// A parity (width 3) device on `ds` in a fresh state directory, filled
/// with random data in `chunk`-sized writes, and its model.
fn filled_parity(
    ds: &[Nbdkit],
    seed: u64,
    chunk: u64,
) -> (tempfile::TempDir, Arc<Device>, Model, Rng) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        Mode::Parity { width: 3 },
        SIZE,
        EXTENT,
        &ds.iter().collect::<Vec<_>>(),
    );
    let dev = Arc::new(Device::open(cfg, dir.path()).unwrap());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(seed);
    model.fill(&dev, &mut rng, chunk);
    (dir, dev, model, rng)
}

fn held(s: &ClientStatus, name: &str) -> u64 {
    s.donors
        .iter()
        .find(|d| d.name == name)
        .map_or(0, |d| d.extents_held)
}

fn names(s: &ClientStatus) -> Vec<String> {
    s.donors.iter().map(|d| d.name.clone()).collect()
}

fn has_left(s: &ClientStatus, name: &str) -> bool {
    !names(s).contains(&name.to_string()) && s.left.iter().any(|l| l.name == name)
}

/// A donor added to a running parity device takes new extents; then one
/// of the first three is removed while writes go on: it ends holding
/// nothing and leaves the set, and every byte reads back.
#[test]
fn a_donor_joins_and_another_leaves_while_writes_go_on() {
    let Some(mut ds) = netpager_test_support::pager_servers(4) else {
        return;
    };
    let fourth = ds.pop().expect("four donors");
    let (_dir, dev, mut model, mut rng) = filled_parity(&ds, 23, 3 * EXTENT);

    dev.add_donor(donor_config("d3", &fourth), Joined::Added)
        .unwrap();
    let s = dev.status();
    let d3 = s
        .donors
        .iter()
        .find(|d| d.name == "d3")
        .expect("d3 in status");
    assert_eq!(d3.joined, Joined::Added);
    // Joining twice is refused, by name or by address.
    let e = dev
        .add_donor(donor_config("d3", &fourth), Joined::Added)
        .unwrap_err();
    assert!(e.to_string().contains("already a member"), "{e}");
    let e = dev
        .add_donor(donor_config("other", &fourth), Joined::Added)
        .unwrap_err();
    assert!(e.to_string().contains("already a member"), "{e}");

    // Rewrites place new groups (whole stripes), some on the new donor.
    let workers = Workers::start(&dev, &model, 2 * EXTENT, 3 * EXTENT, 7);
    workers.join(&mut model);
    for _ in 0..40 {
        let off = rng.below(SIZE / (2 * EXTENT)) * 2 * EXTENT;
        model.write_random(&dev, &mut rng, off, 2 * EXTENT);
    }
    wait_status(&dev, "the new donor to hold extents", |s| held(s, "d3") > 0);

    let workers = Workers::start(&dev, &model, 2 * EXTENT, 3 * EXTENT, 8);
    assert_eq!(dev.remove_donor("d0").unwrap(), "d0");
    let s = wait_status(&dev, "d0 to leave", |s| has_left(s, "d0"));
    workers.join(&mut model);
    assert_eq!(s.left.last().map(|l| l.why.as_str()), Some("removed"));
    model.check_all(&dev, 3 * EXTENT);
    assert_eq!(s.totals.lost, 0);
}

#[test]
fn a_removal_below_the_modes_width_is_refused_with_what_to_do() {
    let Some(ds) = netpager_test_support::pager_servers(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        Mode::Parity { width: 3 },
        SIZE,
        EXTENT,
        &ds.iter().collect::<Vec<_>>(),
    );
    let dev = Device::open(cfg, dir.path()).unwrap();
    let e = dev.remove_donor(&ds[1].addr).unwrap_err().to_string();
    assert!(e.contains("parity") && e.contains("add one first"), "{e}");
    let e = dev.remove_donor("nobody").unwrap_err().to_string();
    assert!(
        e.contains("no donor named") && e.contains("d0, d1, d2"),
        "{e}"
    );
    assert_eq!(names(&dev.status()), ["d0", "d1", "d2"]);
}

/// Closing and opening the device again (a restart of the serving process)
/// keeps an added donor and not a removed one, and the data.
#[test]
fn a_restart_keeps_added_donors_and_not_removed_ones() {
    let Some(mut ds) = netpager_test_support::pager_servers(3) else {
        return;
    };
    let third = ds.pop().expect("three");
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(Mode::Mirror, SIZE, EXTENT, &ds.iter().collect::<Vec<_>>());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(5);
    {
        let dev = Device::open(cfg.clone(), dir.path()).unwrap();
        model.fill(&dev, &mut rng, EXTENT);
        dev.add_donor(donor_config("late", &third), Joined::Added)
            .unwrap();
        dev.remove_donor("d1").unwrap();
        wait_status(&dev, "d1 to leave", |s| has_left(s, "d1"));
        model.check_all(&dev, EXTENT);
    }
    let dev = Device::open(cfg, dir.path()).unwrap();
    let s = dev.status();
    assert_eq!(names(&s), ["d0", "late"]);
    assert_eq!(s.donors[1].joined, Joined::Added);
    model.check_all(&dev, EXTENT);
    assert_eq!(dev.status().totals.lost, 0);
}

/// A leaving donor killed halfway through its drain: the rest of its
/// extents are rebuilt from parity, it leaves the set, nothing is lost.
#[test]
fn a_donor_killed_while_it_leaves_loses_nothing_in_parity() {
    // Slow writes, so the drain is still going when the kill comes.
    let Some(mut ds) = (0..4)
        .map(|_| netpager_test_support::slow_pager_server("10ms"))
        .collect::<Option<Vec<Nbdkit>>>()
    else {
        return;
    };
    let (_dir, dev, mut model, _) = filled_parity(&ds, 11, 2 * EXTENT);
    let before = held(&dev.status(), "d2");
    assert!(before > 4, "d2 holds {before} extents");
    let workers = Workers::start(&dev, &model, 2 * EXTENT, 3 * EXTENT, 12);
    dev.remove_donor("d2").unwrap();
    // Looked at every 2 ms: on a busy machine the drain of a few extents
    // may start and end between two looks 50 ms apart.
    let s = wait_status_every(&dev, "d2's drain to start", Duration::from_millis(2), |s| {
        held(s, "d2") < before
    });
    assert!(
        held(&s, "d2") > 0,
        "d2's drain ended before the kill could come: {:?}",
        s.left
    );
    ds[2].kill9();
    let s = wait_status(&dev, "d2 to leave", |s| has_left(s, "d2"));
    workers.join(&mut model);
    wait_status(&dev, "the rebuild", |s| s.totals.degraded == 0);
    model.check_all(&dev, 3 * EXTENT);
    assert_eq!(dev.status().totals.lost, 0, "{:?}", s.left);
}

/// A dead donor is forgotten after forget_after once its copies are
/// rebuilt elsewhere; its slots are free for nobody and it leaves status.
#[test]
fn a_dead_donor_is_forgotten_after_forget_after() {
    let Some(mut ds) = netpager_test_support::pager_servers(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(Mode::Mirror, SIZE, EXTENT, &ds.iter().collect::<Vec<_>>());
    cfg.forget_after_ms = 300;
    let dev = Device::open(cfg, dir.path()).unwrap();
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(3);
    model.fill(&dev, &mut rng, EXTENT);
    ds[0].kill9();
    dev.poll_donors_now();
    let s = wait_status(&dev, "d0 to be forgotten", |s| has_left(s, "d0"));
    let l = s.left.iter().find(|l| l.name == "d0").unwrap();
    assert_eq!(l.why, "forgotten");
    wait_status(&dev, "the rebuild", |s| s.totals.degraded == 0);
    model.check_all(&dev, EXTENT);
}

/// The donors file: a line added joins, a line removed leaves after its
/// drain, a file that does not parse changes nothing and is reported with
/// its line number.
#[test]
fn the_donors_file_drives_the_set() {
    let Some(ds) = netpager_test_support::pager_servers(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("donors");
    let line = |d: &Nbdkit, name: &str| {
        format!(
            "{},status={},name={name}\n",
            d.addr,
            d.status.as_deref().unwrap()
        )
    };
    std::fs::write(
        &file,
        format!("# lab\n{}{}", line(&ds[0], "a"), line(&ds[1], "b")),
    )
    .unwrap();
    let mut cfg = config(Mode::None, SIZE, EXTENT, &[]);
    cfg.donors_file = Some(file.clone());
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let dev = Device::open(cfg, &state).unwrap();
    let s = wait_status(&dev, "the file's donors", |s| names(s) == ["a", "b"]);
    assert!(s.donors.iter().all(|d| d.joined == Joined::File));
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(9);
    model.fill(&dev, &mut rng, EXTENT);

    // Every rewrite keeps the file's modification time, as two writes
    // within one coarse tick of the kernel's clock do: the device must see
    // the change by the text (it missed it when it went by the time).
    let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
    let rewrite = |text: String| {
        std::fs::write(&file, text).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
    };
    rewrite(format!(
        "{}{}not a donor\n",
        line(&ds[0], "a"),
        line(&ds[2], "c")
    ));
    let s = wait_status(&dev, "the bad file to be reported", |s| {
        s.donors_file_error.is_some()
    });
    let err = s.donors_file_error.clone().unwrap();
    assert!(err.contains("line 3"), "{err}");
    assert_eq!(names(&s), ["a", "b"]);

    // Back to the text it last took: the error goes.
    rewrite(format!("# lab\n{}{}", line(&ds[0], "a"), line(&ds[1], "b")));
    let s = wait_status(&dev, "the error to clear", |s| {
        s.donors_file_error.is_none()
    });
    assert_eq!(names(&s), ["a", "b"]);

    rewrite(format!("{}{}", line(&ds[0], "a"), line(&ds[2], "c")));
    let s = wait_status(&dev, "b to leave and c to join", |s| {
        has_left(s, "b") && names(s) == ["a", "c"]
    });
    assert!(s.donors_file_error.is_none());
    model.check_all(&dev, EXTENT);
}

/// A device whose `small` donors (three extents each) are full, with the
/// rest of it on the fallback; `joiners` roomy donors then join while
/// writes go on, and the spilled copies move onto them until the fallback
/// holds nothing. Every byte reads back, with nothing lost.
fn spilled_copies_move_to_joining_donors(mode: Mode, small: usize, joiners: usize, seed: u64) {
    let budget = format!("budget={}", 3 * EXTENT + 4096);
    let params = ["size=8M", &budget, "poll-ms=100"];
    let Some(ds) = (0..small)
        .map(|_| netpager_test_support::pager_server(&params))
        .collect::<Option<Vec<_>>>()
    else {
        return;
    };
    let Some(roomy) = netpager_test_support::pager_servers(joiners) else {
        return;
    };
    let (state, fb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let size = 16 * EXTENT;
    let mut cfg = config(mode, size, EXTENT, &ds.iter().collect::<Vec<_>>());
    cfg.fallback = Some(FallbackConfig {
        path: fb.path().join("fb.img"),
        size: ByteSize(4 * size),
    });
    let dev = Arc::new(Device::open(cfg, state.path()).unwrap());
    let mut model = Model::new(size);
    let mut rng = Rng::new(seed);
    model.fill(&dev, &mut rng, EXTENT);
    let s = dev.status();
    assert!(s.totals.on_fallback > 0, "{}", render_table(&s));

    let workers = Workers::start(&dev, &model, EXTENT, 3 * EXTENT, seed);
    for (i, d) in roomy.iter().enumerate() {
        dev.add_donor(donor_config(&format!("j{i}"), d), Joined::Added)
            .unwrap();
    }
    workers.join(&mut model);
    let s = wait_status(&dev, "every copy to leave the fallback", |s| {
        s.totals.on_fallback == 0 && !s.totals.off_fallback.active
    });
    assert!(s.totals.off_fallback.done > 0, "{}", render_table(&s));
    assert_eq!(s.totals.fallback_used_bytes, 0, "{}", render_table(&s));
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
    model.check_all(&dev, 3 * EXTENT);
}

#[test]
fn spilled_extents_move_to_a_donor_that_joins() {
    spilled_copies_move_to_joining_donors(Mode::None, 2, 1, 61);
}

#[test]
fn spilled_parity_members_move_to_donors_that_join() {
    spilled_copies_move_to_joining_donors(Mode::Parity { width: 3 }, 3, 3, 62);
}
