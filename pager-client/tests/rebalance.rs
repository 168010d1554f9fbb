//! Memory follows idleness: the rebalancer moves placed members toward a
//! donor below its share while the device serves and verifies its data.
//! In every mode a donor that joins a filled device gets its share by moves
//! alone (no rewrite places anything on it) while a job writes and checks
//! a hot region; the target, or the source, killed with -9 mid-move loses
//! nothing (in mode none when the target dies: the source still holds the
//! member); the serving process killed mid-move finds each member where
//! its data is when it opens again; a balanced set moves nothing. Real
//! pager-server donors; skipped with a note when libpager_server.so is not
//! built.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{config, wait_status, wait_status_every, Model, Nbdkit, Rng};
use netpager_membership::Joined;
use pager_client::config::{ByteSize, DeviceConfig, DonorConfig, Mode};
use pager_client::device::Device;
use pager_client::status::{render_table, ClientStatus, DonorReport};

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;
/// The hot region a job keeps writing and checking: the first quarter.
const HOT: u64 = SIZE / 4;

fn donor<'a>(s: &'a ClientStatus, name: &str) -> &'a DonorReport {
    s.donors.iter().find(|d| d.name == name).expect("a member")
}

fn donor_config(name: &str, d: &Nbdkit) -> DonorConfig {
    let mut c = DonorConfig::new(name, d.addr.clone());
    c.status = d.status.clone();
    c
}

/// A device in `mode` on `ds`, its rebalancer moving up to 64 MiB/s.
fn open(mode: &Mode, ds: &[&Nbdkit], dir: &tempfile::TempDir) -> Arc<Device> {
    open_with(mode, ds, dir, |_| {})
}

/// [`open`], with `adjust` changing the configuration first.
fn open_with(
    mode: &Mode,
    ds: &[&Nbdkit],
    dir: &tempfile::TempDir,
    adjust: impl FnOnce(&mut DeviceConfig),
) -> Arc<Device> {
    let mut cfg: DeviceConfig = config(mode.clone(), SIZE, EXTENT, ds);
    if let Mode::Disk { .. } = mode {
        cfg.mode = Mode::Disk {
            path: dir.path().join("wt.img"),
            queue: ByteSize(1 << 20),
        };
    }
    cfg.rebalance_rate = ByteSize(64 << 20);
    cfg.rebalance_busy_rate = ByteSize(64 << 20);
    adjust(&mut cfg);
    Arc::new(Device::open(cfg, dir.path()).unwrap())
}

/// Writes and checks random pieces of the hot region on another thread
/// until told to stop; hands its model back.
struct HotJob {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Model>,
}

impl HotJob {
    fn start(dev: &Arc<Device>, model: &Model, seed: u64) -> HotJob {
        let stop = Arc::new(AtomicBool::new(false));
        let (dev, mut m, flag) = (dev.clone(), model.region(0, HOT), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut rng = Rng::new(seed);
            while !flag.load(Ordering::Relaxed) {
                m.random_write(&dev, &mut rng, 3 * EXTENT);
                m.random_check(&dev, &mut rng, 3 * EXTENT);
            }
            m
        });
        HotJob { stop, thread }
    }

    fn finish(self, model: &mut Model) {
        self.stop.store(true, Ordering::Relaxed);
        model.merge(&self.thread.join().expect("every write and read right"));
    }
}

/// `mode` on `width` donors, filled; one more donor joins; while a job
/// writes and checks the hot region, the rebalancer moves members of the
/// cold rest onto the newcomer until its share is within the band of its
/// target. Every byte reads back, nothing is lost, no unit has two
/// members on one donor.
fn newcomer_gets_its_share(mode: Mode, width: usize, seed: u64) {
    let Some(mut ds) = netpager_test_support::pager_servers(width + 1) else {
        return;
    };
    let late = ds.pop().expect("one more");
    let dir = tempfile::tempdir().unwrap();
    let dev = open(&mode, &ds.iter().collect::<Vec<_>>(), &dir);
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(seed), 2 * EXTENT);
    let job = HotJob::start(&dev, &model, seed + 1);
    dev.add_donor(donor_config("late", &late), Joined::Added)
        .unwrap();
    let s = wait_status(&dev, "the newcomer near its share", |s| {
        let d = donor(s, "late");
        // Within the band: 5% of the members, at least 2.
        let placed: u64 = s.donors.iter().map(|d| d.extents_held).sum();
        let band = (0.05 * placed as f64).max(2.0) / placed.max(1) as f64;
        s.totals.rebalance.moves > 0 && d.target_share > 0.0 && d.share + band >= d.target_share
    });
    job.finish(&mut model);
    let moved = s.totals.rebalance.moves;
    assert!(
        donor(&s, "late").extents_held >= moved.min(1),
        "{}",
        render_table(&s)
    );
    assert_eq!(
        s.totals.rebalance.moved_bytes,
        moved * EXTENT,
        "{}",
        render_table(&s)
    );
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
    assert_eq!(s.totals.degraded, 0, "{}", render_table(&s));
    // The donors' own counts agree with the map: every member in place.
    let placed: u64 = s.donors.iter().map(|d| d.extents_held).sum();
    let members = s.totals.units_placed
        * s.code
            .split('+')
            .map(|x| x.parse::<u64>().unwrap())
            .sum::<u64>();
    assert!(
        placed >= members,
        "{placed} slots for {members} members: {}",
        render_table(&s)
    );
}

#[test]
fn mode_none_moves_members_to_a_newcomer_while_data_is_verified() {
    newcomer_gets_its_share(Mode::None, 2, 1);
}

#[test]
fn mirror_moves_members_to_a_newcomer_while_data_is_verified() {
    newcomer_gets_its_share(Mode::Mirror, 2, 2);
}

#[test]
fn parity_moves_members_to_a_newcomer_while_data_is_verified() {
    newcomer_gets_its_share(Mode::Parity { width: 3 }, 3, 3);
}

#[test]
fn ec_moves_members_to_a_newcomer_while_data_is_verified() {
    newcomer_gets_its_share(Mode::Ec { data: 2, parity: 1 }, 3, 4);
}

#[test]
fn disk_moves_members_to_a_newcomer_while_data_is_verified() {
    let path = std::path::PathBuf::new();
    newcomer_gets_its_share(
        Mode::Disk {
            path,
            queue: ByteSize(1 << 20),
        },
        1,
        5,
    );
}

/// Bytes the donor listening at `addr` has received on its established
/// connections (ss's tcp_info `bytes_received`): its NBD requests.
fn bytes_received(addr: &str) -> u64 {
    let out = std::process::Command::new("ss")
        .args(["-Htin", "state", "established", "src", addr])
        .output()
        .expect("run ss");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("bytes_received:"))
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// Which donor the test kills once the first move's copy is in flight.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Victim {
    Target,
    Source,
}

/// `mode` on `width` donors, filled; a slow donor (each write waits 0.5 s)
/// joins; once it has read a whole member's write (the first move's copy,
/// held by its delay), `victim` is killed with -9 while a job writes and
/// checks the hot region (the parity log off: it would place log units
/// on the newcomer). Every byte reads back and nothing is lost. The
/// source is known: d0's export holds exactly its members, so it is full,
/// weighs nothing and is the furthest above its share.
fn kill_mid_move(mode: Mode, width: usize, victim: Victim, seed: u64) {
    assert!(width >= 2, "d0 and at least one more");
    let exact = ((SIZE / EXTENT) * width as u64 / mode.redundancy().data_members() / width as u64
        + 1)
        * EXTENT;
    let first = format!("size={exact}");
    let first = [
        first.as_str(),
        "budget=64M",
        "reserve=0",
        "busy-load=1000",
        "poll-ms=100",
    ];
    let (Some(d0), Some(rest), Some(mut late)) = (
        netpager_test_support::pager_server(&first),
        netpager_test_support::pager_servers(width - 1),
        netpager_test_support::slow_pager_server("500ms"),
    ) else {
        return;
    };
    let mut ds = vec![d0];
    ds.extend(rest);
    let dir = tempfile::tempdir().unwrap();
    let dev = open_with(&mode, &ds.iter().collect::<Vec<_>>(), &dir, |c| {
        if c.mode.redundancy().striped() {
            c.parity_log = Some(ByteSize(0));
        }
        // The newcomer's writes take 0.5 s: not a failure.
        c.timeouts.request_ms = 20_000;
    });
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(seed), 2 * EXTENT);
    // Mode none can lose what a killed donor holds: only reads go on.
    let job = (mode != Mode::None).then(|| HotJob::start(&dev, &model, seed + 1));
    dev.add_donor(donor_config("late", &late), Joined::Added)
        .unwrap();
    let before = bytes_received(&late.addr);
    // Nothing but a move writes a whole member to it: no new unit is
    // placed (the job rewrites placed ones), labels and heartbeats are
    // small. Looked at every millisecond: the copy waits 0.5 s there.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while bytes_received(&late.addr) < before + EXTENT {
        assert!(
            std::time::Instant::now() < deadline,
            "no move reached the newcomer: {}",
            render_table(&dev.status())
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (killed, name) = match victim {
        Victim::Target => (&mut late, "late"),
        Victim::Source => (&mut ds[0], "d0"),
    };
    killed.kill9();
    let s = wait_status(&dev, "the killed donor marked failed", |s| {
        donor(s, name).failed
    });
    if let Some(job) = job {
        job.finish(&mut model);
    }
    model.check_all(&dev, 256 << 10);
    let s2 = dev.status();
    assert_eq!(
        s2.totals.lost,
        0,
        "{}\n{}",
        render_table(&s),
        render_table(&s2)
    );
    // The kill came mid-copy: a dead target's copy never finished, a dead
    // source's did (its data was read before the write began).
    let moves = s2.totals.rebalance.moves;
    match victim {
        Victim::Target => assert_eq!(moves, 0, "{}", render_table(&s2)),
        Victim::Source => assert!(moves >= 1, "{}", render_table(&s2)),
    }
    if mode != Mode::None {
        wait_status(&dev, "the rebuild done", |s| {
            s.totals.degraded == 0 && !s.totals.rebuild.active
        });
        model.check_all(&dev, 256 << 10);
    }
}

#[test]
fn mode_none_loses_nothing_when_the_target_dies_mid_move() {
    kill_mid_move(Mode::None, 2, Victim::Target, 11);
}

#[test]
fn parity_loses_nothing_when_the_target_dies_mid_move() {
    kill_mid_move(Mode::Parity { width: 3 }, 3, Victim::Target, 12);
}

#[test]
fn mirror_loses_nothing_when_the_target_dies_mid_move() {
    kill_mid_move(Mode::Mirror, 2, Victim::Target, 13);
}

#[test]
fn parity_loses_nothing_when_the_source_dies_mid_move() {
    kill_mid_move(Mode::Parity { width: 3 }, 3, Victim::Source, 14);
}

#[test]
fn mirror_loses_nothing_when_the_source_dies_mid_move() {
    kill_mid_move(Mode::Mirror, 2, Victim::Source, 15);
}

/// Three donors filled evenly by the selector: over ten epochs the
/// rebalancer, running and not paused, moves nothing.
/// With a busy rate of 0 the rebalancer waits while a job keeps the
/// device serving requests (status says why), and moves once it stops.
#[test]
fn a_busy_device_moves_at_its_busy_rate() {
    let Some(mut ds) = netpager_test_support::pager_servers(3) else {
        return;
    };
    let late = ds.pop().expect("one more");
    let dir = tempfile::tempdir().unwrap();
    let dev = open_with(&Mode::None, &ds.iter().collect::<Vec<_>>(), &dir, |c| {
        c.rebalance_busy_rate = ByteSize(0);
    });
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(71), 2 * EXTENT);
    let job = HotJob::start(&dev, &model, 72);
    dev.add_donor(donor_config("late", &late), Joined::Added)
        .unwrap();
    let s = wait_status(&dev, "the rebalancer waiting for the busy device", |s| {
        let r = &s.totals.rebalance;
        r.busy && r.paused.as_deref().is_some_and(|p| p.contains("busy"))
    });
    assert!(
        render_table(&s).contains("(0 B/s while busy, busy now)"),
        "{}",
        render_table(&s)
    );
    job.finish(&mut model);
    wait_status(&dev, "moves once the device is idle", |s| {
        !s.totals.rebalance.busy && donor(s, "late").extents_held > 0
    });
    model.check_all(&dev, 256 << 10);
    assert_eq!(dev.status().totals.lost, 0);
}

#[test]
fn a_balanced_set_moves_nothing_for_ten_epochs() {
    let Some(ds) = netpager_test_support::pager_servers(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dev = open(&Mode::None, &ds.iter().collect::<Vec<_>>(), &dir);
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(21), EXTENT);
    let s = wait_status(&dev, "the rebalancer to weigh the donors", |s| {
        s.donors.iter().all(|d| d.target_share > 0.0) && s.totals.rebalance.paused.is_none()
    });
    let start = s.epochs.last().map_or(0, |e| e.0);
    let s = wait_status_every(&dev, "ten more epochs", Duration::from_millis(20), |s| {
        s.epochs.iter().filter(|e| e.0 > start).count() >= 10
    });
    assert_eq!(s.totals.rebalance.moves, 0, "{}", render_table(&s));
    assert!(s.totals.rebalance.paused.is_none(), "{}", render_table(&s));
    model.check_all(&dev, 256 << 10);
}

/// The state directory the restart test's serving process uses, when this
/// test binary runs as that process.
const CHILD_DIR: &str = "NETPAGER_TEST_REBALANCE_CHILD";
/// The address of the donor it adds.
const CHILD_LATE: &str = "NETPAGER_TEST_REBALANCE_LATE";

/// Not a test of its own: the serving process of
/// [`a_restart_mid_move_finds_every_member_where_its_data_is`], run as a
/// child of that test (this binary, this test alone, with [`CHILD_DIR`]
/// set). Opens the device, adds the slow donor and serves until killed.
#[test]
#[ignore = "the serving process of a_restart_mid_move_finds_every_member_where_its_data_is, run by it"]
fn restart_child_serves_until_killed() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let cfg = DeviceConfig::load_from_state_dir(&dir).unwrap();
    let dev = Device::open(cfg, &dir).unwrap();
    let late = std::env::var(CHILD_LATE).unwrap();
    let mut c = DonorConfig::new("late", late.clone());
    c.status = std::env::var(format!("{CHILD_LATE}_STATUS")).ok();
    dev.add_donor(c, Joined::Added).unwrap();
    // Killed with -9 by the parent: this loop ends only with the process.
    loop {
        std::thread::park();
    }
}

/// Mode none: the serving process is killed with -9 while its first move
/// is copying (a slow newcomer holds the write). The next open finds the
/// member where its data is, the source, and every byte reads back; the
/// moves then go on.
#[test]
fn a_restart_mid_move_finds_every_member_where_its_data_is() {
    let (Some(ds), Some(late)) = (
        netpager_test_support::pager_servers(2),
        netpager_test_support::slow_pager_server("500ms"),
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(Mode::None, SIZE, EXTENT, &ds.iter().collect::<Vec<_>>());
    cfg.rebalance_rate = ByteSize(64 << 20);
    cfg.rebalance_busy_rate = ByteSize(64 << 20);
    cfg.timeouts.request_ms = 20_000;
    let mut model = Model::new(SIZE);
    {
        let dev = Device::open(cfg.clone(), dir.path()).unwrap();
        model.fill(&dev, &mut Rng::new(31), EXTENT);
    }
    cfg.save(&dir.path().join("device.toml")).unwrap();
    let before = bytes_received(&late.addr);
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "restart_child_serves_until_killed",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_DIR, dir.path())
        .env(CHILD_LATE, &late.addr)
        .env(
            format!("{CHILD_LATE}_STATUS"),
            late.status.clone().unwrap_or_default(),
        )
        .spawn()
        .unwrap();
    // Killed on every way out of this test, by pid.
    struct Reap<'a>(&'a mut std::process::Child);
    impl Drop for Reap<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let reap = Reap(&mut child);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while bytes_received(&late.addr) < before + EXTENT {
        assert!(
            std::time::Instant::now() < deadline,
            "no move reached the newcomer"
        );
        if let Some(st) = reap.0.try_wait().unwrap() {
            panic!("the serving process exited: {st}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(reap);
    let dev = Device::open(cfg, dir.path()).unwrap();
    let s = dev.status();
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
    assert!(
        s.donors.iter().any(|d| d.name == "late"),
        "{}",
        render_table(&s)
    );
    model.check_all(&dev, 256 << 10);
    wait_status(&dev, "the moves going on", |s| s.totals.rebalance.moves > 0);
    model.check_all(&dev, 256 << 10);
    assert_eq!(dev.status().totals.lost, 0);
}

/// Gradual shedding: a donor whose node's memory use rises toward its
/// reserve offers less (G_i, its free_bytes), and the rebalancer moves
/// its members to the others while it is still idle, before it has to
/// drain. Every byte reads back.
#[test]
fn a_donor_whose_memory_use_rises_sheds_its_members_before_it_drains() {
    let mem = tempfile::tempdir().unwrap();
    let meminfo = mem.path().join("meminfo");
    const GIB: u64 = 1 << 30;
    netpager_test_support::write_meminfo(&meminfo, 8 * GIB, 4 * GIB);
    let watched = format!("meminfo={}", meminfo.display());
    let (Some(d0), Some(rest)) = (
        netpager_test_support::pager_server(&[
            "size=16M",
            "budget=64M",
            "reserve=1G",
            "busy-load=1000",
            "poll-ms=100",
            &watched,
        ]),
        netpager_test_support::pager_servers(2),
    ) else {
        return;
    };
    let mut ds = vec![d0];
    ds.extend(rest);
    let dir = tempfile::tempdir().unwrap();
    let dev = open(&Mode::None, &ds.iter().collect::<Vec<_>>(), &dir);
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(41), EXTENT);
    let held = donor(&dev.status(), "d0").extents_held;
    assert!(held > 4, "{}", render_table(&dev.status()));
    // 2 MiB above the reserve: d0 offers 2 MiB, not the 60 MiB its budget
    // has left, and is not draining.
    netpager_test_support::write_meminfo(&meminfo, 8 * GIB, GIB + (2 << 20));
    let s = wait_status(&dev, "d0 to shed its members", |s| {
        let d = donor(s, "d0");
        d.extents_held <= 2 && s.totals.rebalance.moves >= held - 2
    });
    assert_eq!(donor(&s, "d0").state, "idle", "{}", render_table(&s));
    assert_eq!(s.totals.drain.done, 0, "{}", render_table(&s));
    model.check_all(&dev, 256 << 10);
    assert_eq!(dev.status().totals.lost, 0);
}
