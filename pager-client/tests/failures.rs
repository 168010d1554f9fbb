//! Donor failures: a donor killed (-9) or hung (SIGSTOP) in the middle of
//! concurrent I/O. Mirror, parity and disk keep every byte readable,
//! report the device degraded, rebuild onto the other donors, and a donor
//! that comes back is used as a new one. Mode none reports exactly the
//! extents that were on the dead donor as lost.

mod common;

use std::sync::Arc;

use common::{config, run_epoch, wait_status, Fault, Model, Nbdkit, Rng, Workers};
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
    // A partial write to a lost extent places it again on a live donor:
    // what it wrote reads back, the rest of the extent stays lost...
    dev.write(&[1u8; 10], failed[0] * EXTENT).unwrap();
    let mut b = vec![0u8; 10];
    dev.read(&mut b, failed[0] * EXTENT).unwrap();
    assert_eq!(b, [1u8; 10]);
    let mut b = vec![0u8; 4096];
    assert_eq!(
        dev.read(&mut b, failed[0] * EXTENT + 4096)
            .unwrap_err()
            .errno(),
        libc::EIO
    );
    // ...until written: a whole-extent write brings all of it back.
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
    // Failed at open (its label does not match: its copies are marked
    // lost), and back at once as a new, empty donor.
    assert!(
        s.donors[1].errors > 0 && !s.donors[1].failed,
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

/// The TCP connections from this process to `addr` (`HOST:PORT`), as `ss`
/// lists them: (local port, remote) pairs.
fn connections_to(addr: &str) -> Vec<u16> {
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let out = std::process::Command::new("ss")
        .args([
            "-Htnp",
            "state",
            "established",
            "dst",
            host,
            "dport",
            "=",
            port,
        ])
        .output()
        .expect("ss runs");
    let me = format!("pid={},", std::process::id());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&me))
        .filter_map(|l| {
            l.split_whitespace()
                .nth(2)?
                .rsplit_once(':')?
                .1
                .parse()
                .ok()
        })
        .collect()
}

/// One of a donor's connections reset (`ss -K`) while I/O is in flight:
/// the request is sent again on another connection, the donor is not
/// failed, nothing is rebuilt or lost.
#[test]
fn a_reset_connection_is_retried_not_a_failed_donor() {
    // One thread per connection on the donors: nbdkit before 1.33.10
    // aborts when a connection is reset while several of its threads send
    // replies (its commit 9d82aa4f), and this test is about the client.
    let mut ds: Vec<Nbdkit> = (0..3)
        .map(|_| Nbdkit::with_args(&["--threads=1", "memory", "4M"]))
        .collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut c = config(Mode::Parity { width: 3 }, SIZE, EXTENT, &refs);
    // A slow retry on a loaded machine must not pass for a failed one.
    c.timeouts.request_ms = 10_000;
    let state = tempfile::tempdir().unwrap();
    let dev = Arc::new(Device::open(c, state.path()).unwrap());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(41);
    model.fill(&dev, &mut rng, EXTENT);
    let mut resets = 0;
    for round in 0..3 {
        let workers = Workers::start(&dev, &model, 2 * EXTENT, 2 * EXTENT, 42 + round);
        let (host, port) = ds[1].addr.rsplit_once(':').unwrap();
        if let Some(local) = connections_to(&ds[1].addr).first() {
            let st = std::process::Command::new("ss")
                .args([
                    "-K",
                    "dst",
                    host,
                    "dport",
                    "=",
                    port,
                    "sport",
                    "=",
                    &local.to_string(),
                ])
                .output()
                .expect("ss -K runs");
            assert!(
                st.status.success(),
                "ss -K: {}",
                String::from_utf8_lossy(&st.stderr)
            );
            resets += 1;
        }
        workers.join(&mut model);
    }
    assert!(resets > 0, "no connection to {} to reset", ds[1].addr);
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert!(s.donors.iter().all(|d| !d.failed), "{}", render_table(&s));
    assert_eq!(s.totals.rebuild.total, 0, "{}", render_table(&s));
    assert_eq!(s.totals.lost, 0);
    for (i, d) in ds.iter_mut().enumerate() {
        assert_eq!(d.exited(), None, "donor d{i} died");
    }
    eprintln!(
        "{resets} connections reset; {} requests retried",
        s.donors[1].retries
    );
}

/// Heartbeat reads (512 bytes at offset 0, the label block) in a log
/// filter's file so far.
fn heartbeats(log: &std::path::Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Read") && l.contains("offset=0x0 count=0x200"))
        .count()
}

/// A donor that answered a request since the last epoch is alive: the
/// epoch sends a heartbeat only to a donor that answered nothing, so a busy
/// device's epochs cost its donors no extra request. The test runs each
/// epoch itself, after a request to the busy donor: what counts is how many
/// epochs ran, not how long they took.
#[test]
fn only_a_donor_that_answered_nothing_since_the_last_epoch_gets_a_heartbeat() {
    let logs = tempfile::tempdir().unwrap();
    let log = |i: usize| logs.path().join(format!("d{i}.log"));
    let ds: Vec<Nbdkit> = (0..2)
        .map(|i| {
            let logfile = format!("logfile={}", log(i).display());
            Nbdkit::with_args(&["--filter=log", "memory", "4M", &logfile])
        })
        .collect();
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut c = config(Mode::None, SIZE, EXTENT, &refs);
    // No epoch of its own: only those the test asks for.
    c.policy.epoch_ms = 3_600_000;
    let state = tempfile::tempdir().unwrap();
    let dev = Device::open(c, state.path()).unwrap();
    // Extent 0 lives on one donor: keep that one busy, the other idle.
    let page = vec![7u8; 4096];
    dev.write(&page, 0).unwrap();
    let s = dev.status();
    let busy = s.donors.iter().position(|d| d.extents_held == 1).unwrap();
    let idle = 1 - busy;
    let before = [heartbeats(&log(0)), heartbeats(&log(1))];
    let mut got = vec![0u8; 4096];
    const EPOCHS: usize = 20;
    for _ in 0..EPOCHS {
        dev.write(&page, 0).unwrap();
        dev.read(&mut got, 0).unwrap();
        assert_eq!(got, page);
        run_epoch(&dev);
    }
    let during = [
        heartbeats(&log(0)) - before[0],
        heartbeats(&log(1)) - before[1],
    ];
    // The idle donor is read every epoch (but perhaps the first, should the
    // open's own requests count), the busy one never: it answered the
    // test's requests before each.
    assert!(
        during[idle] >= EPOCHS - 1,
        "idle donor's heartbeats: {during:?}"
    );
    assert_eq!(during[busy], 0, "busy donor's heartbeats: {during:?}");
    let s = dev.status();
    assert!(s.donors.iter().all(|d| !d.failed), "{}", render_table(&s));
}

/// A donor killed and started again at once, empty, at its address while
/// the device is open: a request whose connection broke was sent once
/// more on a new connection, which reached the new, empty process, and
/// its zeros were served as our data (the nemesis, ec, seed 3141592607:
/// memhog read a page of zeros through swap). In mode none every read
/// must fail (the pages are gone), never return zeros; in mirror every
/// read returns what was written, from the other copy.
#[test]
fn a_donor_restarted_at_once_is_never_read_as_ours() {
    for (mode, n) in [(Mode::None, 1), (Mode::Mirror, 2)] {
        let mut ds: Vec<Nbdkit> = (0..n).map(|_| Nbdkit::memory("4M")).collect();
        let refs: Vec<&Nbdkit> = ds.iter().collect();
        let state = tempfile::tempdir().unwrap();
        let dev = Device::open(config(mode.clone(), SIZE, EXTENT, &refs), state.path()).unwrap();
        let mut model = Model::new(SIZE);
        let mut rng = Rng::new(61);
        model.fill(&dev, &mut rng, 2 * EXTENT);
        let addr = ds[0].addr.clone();
        ds[0].kill9();
        ds[0] = Nbdkit::memory_at(&addr, "4M");
        match mode {
            Mode::None => {
                let mut b = vec![0u8; EXTENT as usize];
                for e in 0..SIZE / EXTENT {
                    if dev.read(&mut b, e * EXTENT).is_ok() {
                        panic!(
                            "extent {e} read {} where its pages are gone with the donor",
                            if b.iter().all(|&x| x == 0) {
                                "zeros"
                            } else {
                                "bytes"
                            }
                        );
                    }
                }
            }
            _ => model.check_all(&dev, EXTENT),
        }
    }
}
