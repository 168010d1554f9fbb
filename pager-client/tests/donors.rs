//! With real pager-server donors (status endpoint, budget, draining): a
//! draining donor is emptied while writes go on, and a donor whose budget
//! runs out mid-extent makes that extent move. Skipped with a note when
//! libpager_server.so has not been built (see netpager_test_support::pager_server_so).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, run_epoch, wait_status, Model, Nbdkit, Rng};
use pager_client::config::{ByteSize, DeviceConfig, FallbackConfig, Mode};
use pager_client::device::Device;
use pager_client::status::render_table;

const EXTENT: u64 = 64 << 10;

fn server(budget: &str) -> Option<Nbdkit> {
    netpager_test_support::pager_server(&["size=8M", &format!("budget={budget}"), "poll-ms=100"])
}

/// `n` donors of `budget` bytes each, or `None` when the plugin is not built.
fn servers(n: usize, budget: &str) -> Option<Vec<Nbdkit>> {
    (0..n).map(|_| server(budget)).collect()
}

/// Gives `cfg` a fallback file of `size` bytes in `dir`.
fn with_fallback(cfg: &mut DeviceConfig, dir: &tempfile::TempDir, size: u64) {
    cfg.fallback = Some(FallbackConfig {
        path: dir.path().join("fb.img"),
        size: ByteSize(size),
    });
}

fn donor_used(addr: &str) -> u64 {
    netpager_proto::query_status(addr, Duration::from_secs(2))
        .expect("donor status")
        .used_bytes
}

/// How donor 0 is told to give its memory back.
enum DrainTrigger {
    /// The admin's DrainCommand on its status endpoint.
    Command,
    /// Its node runs short of memory: the meminfo file it watches says
    /// MemAvailable fell below its reserve.
    Meminfo(tempfile::TempDir),
}

fn meminfo(available_kib: u64) -> String {
    format!("MemTotal:       16000000 kB\nMemFree:        {available_kib} kB\nMemAvailable:   {available_kib} kB\n")
}

#[test]
fn drain_command_empties_the_donor_without_losing_a_page() {
    let Some(ds) = servers(3, "16M") else {
        return;
    };
    drain_test(ds, DrainTrigger::Command);
}

#[test]
fn memory_pressure_on_a_donor_empties_it_without_losing_a_page() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meminfo");
    std::fs::write(&path, meminfo(8_000_000)).unwrap();
    let watched = format!("meminfo={}", path.display());
    let Some(d0) = netpager_test_support::pager_server(&[
        "size=8M",
        "budget=16M",
        "reserve=1G",
        "poll-ms=100",
        &watched,
    ]) else {
        return;
    };
    let Some(rest) = servers(2, "16M") else {
        return;
    };
    let ds = std::iter::once(d0).chain(rest).collect();
    drain_test(ds, DrainTrigger::Meminfo(dir));
}

fn drain_test(ds: Vec<Nbdkit>, trigger: DrainTrigger) {
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let size = 2 << 20;
    let dev =
        Arc::new(Device::open(config(Mode::Mirror, size, EXTENT, &refs), state.path()).unwrap());
    let mut model = Model::new(size);
    let mut rng = Rng::new(31);
    for _ in 0..300 {
        model.random_write(&dev, &mut rng, 2 * EXTENT);
    }
    let s = wait_status(&dev, "the donors' usage reported", |s| {
        s.donors.iter().all(|d| d.free_bytes.is_some())
    });
    assert!(
        s.donors[0].extents_held > 0 && s.donors[0].state == "idle",
        "{}",
        render_table(&s)
    );
    let d0 = ds[0].status.clone().expect("status endpoint");
    assert!(donor_used(&d0) > 0);

    match &trigger {
        DrainTrigger::Command => {
            netpager_proto::set_draining(&d0, true, Duration::from_secs(2)).unwrap();
        }
        // 500 MiB available, reserve 1 GiB.
        DrainTrigger::Meminfo(dir) => {
            std::fs::write(dir.path().join("meminfo"), meminfo(500_000)).unwrap()
        }
    }
    wait_status(&dev, "donor 0 draining", |_| {
        dev.poll_donors_now();
        netpager_proto::query_status(&d0, Duration::from_secs(2))
            .unwrap()
            .state()
            == netpager_proto::DonorState::Draining
    });
    dev.poll_donors_now();
    // Writes go on while extents move.
    let writer = {
        let dev = dev.clone();
        let mut m = model.region(0, size / 2);
        std::thread::spawn(move || {
            let mut rng = Rng::new(32);
            for _ in 0..300 {
                m.random_write(&dev, &mut rng, 2 * EXTENT);
                m.random_check(&dev, &mut rng, 2 * EXTENT);
            }
            m
        })
    };
    model.merge(&writer.join().unwrap());
    let s = wait_status(&dev, "drain finished", |s| {
        s.donors[0].state == "draining" && s.donors[0].extents_held == 0 && !s.totals.drain.active
    });
    assert!(s.totals.drain.done > 0, "{}", render_table(&s));
    assert_eq!(s.totals.degraded, 0, "{}", render_table(&s));
    wait_status(&dev, "donor reports nothing stored", |_| {
        donor_used(&d0) == 0
    });
    // Our own view of that donor, from its status: nothing of ours left.
    dev.poll_donors_now();
    wait_status(&dev, "status shows donor 0 empty", |s| {
        s.donors[0].used_bytes == 0
    });
    model.check_all(&dev, 256 << 10);
    // Nothing new lands on a draining donor.
    for _ in 0..50 {
        model.random_write(&dev, &mut rng, 2 * EXTENT);
    }
    assert_eq!(dev.status().donors[0].extents_held, 0);
    model.check_all(&dev, 256 << 10);
}

#[test]
fn budget_running_out_mid_extent_moves_it_to_the_fallback() {
    // Each donor may hold 3 extents' worth of pages (plus its label page).
    let budget = (3 * EXTENT + 4096).to_string();
    let Some(ds) = servers(2, &budget) else {
        return;
    };
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let fb = tempfile::tempdir().unwrap();
    let size = 16 * EXTENT;
    let mut cfg = config(Mode::None, size, EXTENT, &refs);
    with_fallback(&mut cfg, &fb, size);
    let dev = Device::open(cfg, state.path()).unwrap();
    let mut model = Model::new(size);
    let mut rng = Rng::new(41);
    // First a page in every extent: the donors take extents faster than
    // their budget can back them...
    for e in 0..16 {
        model.write_random(&dev, &mut rng, e * EXTENT, 4096);
    }
    // ...then fill every extent: donors refuse new pages (ENOSPC) and
    // those extents move, with their data, to the fallback.
    for e in 0..16 {
        model.write_random(&dev, &mut rng, e * EXTENT, EXTENT);
    }
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert!(s.totals.on_fallback > 0, "{}", render_table(&s));
    assert!(s.donors.iter().all(|d| !d.failed), "{}", render_table(&s));
    assert_eq!(s.totals.lost, 0);
}

#[test]
fn parity_members_both_refused_move_to_the_fallback() {
    // Mode parity without its log: a partial write updates the data member
    // and the parity member in place. Once both donors refuse new pages,
    // the write must move a member to the fallback, not fail.
    let budget = (3 * EXTENT + 4096).to_string();
    let Some(ds) = servers(3, &budget) else {
        return;
    };
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let fb = tempfile::tempdir().unwrap();
    let size = 16 * EXTENT;
    let mut cfg = config(Mode::Parity { width: 3 }, size, EXTENT, &refs);
    cfg.parity_log = Some(ByteSize(0));
    with_fallback(&mut cfg, &fb, 2 * size);
    let dev = Device::open(cfg, state.path()).unwrap();
    let mut model = Model::new(size);
    let mut rng = Rng::new(43);
    for e in 0..16 {
        model.write_random(&dev, &mut rng, e * EXTENT, 4096);
    }
    // Half an extent at a time: never a full stripe, always read-modify-write.
    for e in 0..16 {
        model.write_random(&dev, &mut rng, e * EXTENT + EXTENT / 2, EXTENT / 2);
    }
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert!(s.totals.on_fallback > 0, "{}", render_table(&s));
    assert_eq!(s.totals.lost, 0);
}

#[test]
fn donors_filling_up_between_epochs_send_new_extents_to_the_fallback() {
    // Four donors that each hold two extents; their status says so only
    // once per epoch, so most refusals arrive as ENOSPC on first writes.
    let budget = (2 * EXTENT + 4096).to_string();
    let Some(ds) = servers(4, &budget) else {
        return;
    };
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let fb = tempfile::tempdir().unwrap();
    let size = 24 * EXTENT;
    let mut cfg = config(Mode::None, size, EXTENT, &refs);
    cfg.policy.epoch_ms = 60_000;
    with_fallback(&mut cfg, &fb, size);
    let dev = Device::open(cfg, state.path()).unwrap();
    let mut model = Model::new(size);
    let mut rng = Rng::new(43);
    model.fill(&dev, &mut rng, EXTENT);
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert!(s.totals.on_fallback >= 16, "{}", render_table(&s));
    assert!(s.donors.iter().all(|d| !d.failed), "{}", render_table(&s));
}

/// Busy donors that allow no remote utilisation (u-star=0) cap every
/// frequency: that throttles a device with traffic, but an idle one (no
/// request since the last epoch, so no time between requests to bound)
/// says nothing.
#[test]
fn an_idle_device_is_not_throttled_and_a_busy_one_is() {
    let Some(ds) = (0..2)
        .map(|_| {
            netpager_test_support::pager_server(&[
                "size=8M",
                "budget=16M",
                "reserve=0",
                "busy-load=0",
                "u-star=0",
                "poll-ms=100",
            ])
        })
        .collect::<Option<Vec<_>>>()
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dev = Arc::new(
        Device::open(
            config(Mode::None, 4 << 20, EXTENT, &[&ds[0], &ds[1]]),
            dir.path(),
        )
        .unwrap(),
    );
    wait_status(&dev, "the donors to report busy", |s| {
        s.donors.iter().all(|d| d.state == "busy")
    });
    for _ in 0..3 {
        run_epoch(&dev);
        let s = dev.status();
        assert!(
            !s.totals.throttled,
            "idle, yet {:?}",
            s.totals.throttle_reason
        );
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (dev, stop) = (dev.clone(), stop.clone());
        std::thread::spawn(move || {
            let b = vec![7u8; 4096];
            let mut off = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                dev.write(&b, off).unwrap();
                off = (off + 4096) % (4 << 20);
            }
        })
    };
    let s = wait_status(&dev, "the busy device to be throttled", |s| {
        s.totals.throttled
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert!(s.totals.all_capped, "{}", render_table(&s));
}
