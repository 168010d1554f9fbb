//! A donor is known by what it is, and a device owns its exports: the
//! same pager-server reached by two names is refused as a duplicate (it
//! used to share slots and corrupt half the device); a second device of
//! the same client on the same donors leaves the first one's pages alone
//! (it used to clear them); and a serving process replaced by a newer
//! session of its device is fenced off by the donors. Real pager-server
//! donors; skipped with a note when libpager_server.so is not built.

mod common;

use std::time::Duration;

use common::{config, Model, Nbdkit, Rng};
use netpager_membership::Joined;
use pager_client::config::{DonorConfig, Mode};
use pager_client::device::{Device, DeviceError};

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;

fn donor_args() -> [&'static str; 3] {
    ["size=16M", "budget=64M", "poll-ms=100"]
}

/// A donor on 127.0.0.1, which `localhost` reaches too (the one address
/// outside this process's loopback block: the name is what is tested).
fn on_localhost() -> Option<Nbdkit> {
    netpager_test_support::pager_server_on("127.0.0.1", &donor_args())
}

fn port_of(d: &Nbdkit) -> &str {
    d.addr.rsplit_once(':').expect("host:port").1
}

/// Device A (mode none) on donor `a` (127.0.0.1, which `localhost`
/// reaches too) and one other donor, `d0`; with `file`, its donors file.
/// Fields drop in order: the device before its donors.
struct OnLocalhost {
    dev: Device,
    a: Nbdkit,
    d0: Nbdkit,
    _dir: tempfile::TempDir,
}

fn a_on_localhost_and_d0(file: Option<&std::path::Path>) -> Option<OnLocalhost> {
    let (a, mut others) = (on_localhost()?, netpager_test_support::pager_servers(1)?);
    let dir = tempfile::tempdir().unwrap();
    let d0 = others.remove(0);
    let mut cfg = config(Mode::None, SIZE, EXTENT, &[&d0]);
    let mut first = DonorConfig::new("a", a.addr.clone());
    first.status = a.status.clone();
    cfg.donors.insert(0, first);
    cfg.donors_file = file.map(|f| f.to_path_buf());
    let dev = Device::open(cfg, dir.path()).unwrap();
    Some(OnLocalhost {
        dev,
        a,
        d0,
        _dir: dir,
    })
}

impl OnLocalhost {
    /// Donor `a` under its host name, as donor `b`.
    fn alias(&self) -> DonorConfig {
        let mut b = DonorConfig::new("b", format!("localhost:{}", port_of(&self.a)));
        b.status = self.a.status.clone();
        b
    }

    fn draining(&self, which: &Nbdkit, on: bool) {
        let status = which.status.clone().expect("status endpoint");
        netpager_proto::set_draining(&status, on, Duration::from_secs(2)).unwrap();
    }

    /// Drains `a` until it holds nothing of the device: no extent, and (as
    /// the donor itself says) no page, its label gone too.
    fn drain_a(&self) {
        self.draining(&self.a, true);
        let cfg = self.dev.config();
        let store = cfg.store_name(&cfg.donors[0]);
        let status = self.a.status.clone().expect("status endpoint");
        common::wait_status(&self.dev, "donor a drained, its label gone", |s| {
            self.dev.poll_donors_now();
            let held = netpager_proto::query_status(&status, Duration::from_secs(2))
                .map(|r| {
                    r.exports
                        .iter()
                        .filter(|x| x.name == store)
                        .map(|x| x.logical_bytes)
                        .sum()
                })
                .unwrap_or(1u64);
            s.donors[0].extents_held == 0 && held == 0
        });
    }

    fn names(&self) -> Vec<String> {
        self.dev
            .status()
            .donors
            .iter()
            .map(|d| d.name.clone())
            .collect()
    }
}

/// The bug of issue 34: a member added again under its host name was
/// accepted and then shared slots with itself. Now the second name is
/// refused, naming the member, and every extent reads back as written.
#[test]
fn a_donor_reached_by_a_second_name_is_refused() {
    let Some(t) = a_on_localhost_and_d0(None) else {
        return;
    };
    let e = t
        .dev
        .add_donor(t.alias(), Joined::Added)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("same export as member a") && e.contains("localhost"),
        "{e}"
    );
    assert_eq!(t.names(), ["a", "d0"], "the duplicate is not a member");
    let mut model = Model::new(SIZE);
    model.fill(&t.dev, &mut Rng::new(3), EXTENT);
    model.check_all(&t.dev, EXTENT);
}

/// A second name tried again and again while the member serves: each
/// check opens a newer round of connections on the shared export, which
/// fences the member's; the member moves to a round of its own and its
/// requests go on. It used to close and reopen its pool, and a request
/// that came between the two was refused ("no new connections"), which
/// failed the member (the nemesis, mirror, seed 658104338: after "add-alias
/// d2" d2 was failed, and the next "add-alias d2" moved it to the alias).
#[test]
fn a_second_name_tried_under_load_fails_nothing() {
    let Some(t) = a_on_localhost_and_d0(None) else {
        return;
    };
    let mut model = Model::new(SIZE);
    model.fill(&t.dev, &mut Rng::new(11), EXTENT);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let quarter = SIZE / 4;
    let regions = std::thread::scope(|s| {
        let writers: Vec<_> = (0..4u64)
            .map(|k| {
                let (dev, stop) = (&t.dev, &stop);
                let mut m = model.region(k * quarter, (k + 1) * quarter);
                s.spawn(move || {
                    let mut rng = Rng::new(20 + k);
                    let mut n = 0u64;
                    // At least some requests even if the adds are quick.
                    while n < 64 || !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        m.random_write(dev, &mut rng, 8192);
                        m.random_check(dev, &mut rng, 8192);
                        n += 1;
                    }
                    m
                })
            })
            .collect();
        // Asserted once the writers are stopped: a panic here would
        // leave the scope waiting for them.
        let answers: Vec<_> = (0..20)
            .map(|_| t.dev.add_donor(t.alias(), Joined::Added))
            .collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let regions: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        (answers, regions)
    });
    let (answers, regions) = regions;
    let s = t.dev.status();
    let why: Vec<_> = s.donors.iter().map(|d| (&d.name, &d.failure)).collect();
    assert!(
        s.donors.iter().all(|d| !d.failed),
        "no donor failed: {why:?}"
    );
    for a in answers {
        let e = a.expect_err("the second name is refused").to_string();
        assert!(e.contains("same export as"), "{e}");
    }
    let regions: Vec<Model> = regions
        .into_iter()
        .map(|r| r.expect("every request succeeded"))
        .collect();
    for r in &regions {
        model.merge(r);
    }
    assert_eq!(t.names(), ["a", "d0"]);
    model.check_all(&t.dev, EXTENT);
}

/// Device A with its member `a` drained empty (still draining, or not),
/// then `a`'s export added under its host name: refused, saying `why`;
/// every extent reads back as written, before and after.
fn second_name_of_a_drained_member(still_draining: bool, why: &str) {
    let Some(t) = a_on_localhost_and_d0(None) else {
        return;
    };
    let mut model = Model::new(SIZE);
    model.fill(&t.dev, &mut Rng::new(5), EXTENT);
    t.drain_a();
    if !still_draining {
        t.draining(&t.a, false);
    }
    let e = t
        .dev
        .add_donor(t.alias(), Joined::Added)
        .unwrap_err()
        .to_string();
    assert!(e.contains(why), "{e}");
    assert_eq!(t.names(), ["a", "d0"], "the duplicate is not a member");
    t.draining(&t.a, false);
    model.fill(&t.dev, &mut Rng::new(6), EXTENT);
    model.check_all(&t.dev, EXTENT);
}

/// A member drained empty drops its label (so the donor ends holding
/// nothing); its export reached by a second name was then accepted as a
/// new donor, found by the nemesis (mode none: "drain d2 meminfo; ...;
/// add-alias d2"). Now the label written on the newcomer is looked for
/// through every unlabelled member, and the second name is refused.
#[test]
fn a_drained_members_second_name_is_refused() {
    second_name_of_a_drained_member(false, "same export as member a");
}

/// The same with the member still draining: its export refuses the
/// newcomer's label (ENOSPC), so nothing can tell the two apart, and the
/// second name was accepted unchecked (the nemesis, mode mirror: "drain
/// d3 admin; ...; add-alias d3"). `donor-add` now refuses a donor it
/// cannot label, saying why.
#[test]
fn a_draining_members_second_name_is_refused() {
    second_name_of_a_drained_member(true, "takes no label");
}

/// A donors file line naming a draining member's export another way
/// waits (listed, not failed, not used: "takes no label"; tried again
/// each epoch): it cannot be told apart from the member while the donor
/// refuses new pages. Once the
/// member takes pages again, the line is refused as the member reached
/// another way, and every extent placed meanwhile reads back as written.
#[test]
fn a_second_name_joined_while_draining_waits_and_is_refused() {
    let state = tempfile::tempdir().unwrap();
    let file = state.path().join("donors");
    std::fs::write(&file, "# lab donors\n").unwrap();
    let Some(t) = a_on_localhost_and_d0(Some(&file)) else {
        return;
    };
    let half = SIZE / 2;
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(9);
    for off in (0..half).step_by(EXTENT as usize) {
        model.write_random(&t.dev, &mut rng, off, EXTENT);
    }
    t.drain_a();
    let b = t.alias();
    let line = format!(
        "{},name=b,status={}\n",
        b.address,
        b.status.as_deref().unwrap()
    );
    std::fs::write(&file, format!("# lab donors\n{line}")).unwrap();
    common::wait_status(&t.dev, "b joined from the file, waiting", |s| {
        s.donors.iter().any(|d| {
            d.name == "b"
                && !d.failed
                && d.failure
                    .as_deref()
                    .is_some_and(|f| f.contains("takes no label"))
        })
    });
    // New extents can go only to a now.
    t.draining(&t.d0, true);
    t.draining(&t.a, false);
    common::wait_status(&t.dev, "a takes pages again, d0 drains", |s| {
        t.dev.poll_donors_now();
        s.donors
            .iter()
            .any(|d| d.name == "a" && d.state != "draining")
            && s.donors
                .iter()
                .any(|d| d.name == "d0" && d.state == "draining")
    });
    for off in (half..SIZE).step_by(EXTENT as usize) {
        model.write_random(&t.dev, &mut rng, off, EXTENT);
    }
    let s = common::wait_status(&t.dev, "b refused as a's second name", |s| {
        s.donors.iter().any(|d| {
            d.name == "b"
                && d.failure.as_deref().is_some_and(|f| {
                    // Found by a's label, or by a's connections
                    // taking the export over while b was checked.
                    f.contains("same export as member a")
                        || f.contains("serves the same export as a member")
                })
        })
    });
    model.check_all(&t.dev, EXTENT);
    let b = s.donors.iter().find(|d| d.name == "b").unwrap();
    assert_eq!(b.extents_held, 0, "{b:?}");
    let a = s.donors.iter().find(|d| d.name == "a").unwrap();
    assert!(a.extents_held > 0 && !a.failed, "{a:?}");
}

/// The same export named twice at attach: the device does not open.
#[test]
fn two_names_of_one_donor_at_attach_are_refused() {
    let Some(a) = on_localhost() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(Mode::None, SIZE, EXTENT, &[]);
    cfg.donors.push(DonorConfig::new("a", a.addr.clone()));
    cfg.donors
        .push(DonorConfig::new("b", format!("localhost:{}", port_of(&a))));
    let e = Device::open(cfg, dir.path()).err().expect("refused");
    let msg = e.to_string();
    assert!(
        matches!(e, DeviceError::Membership(_)) && msg.contains("same export as member a"),
        "{msg}"
    );
}

/// A device that holds data, restarted with a second name of a member in
/// its set (a donors file edited, a discovered address): it opens, the
/// second name left out and shown why, and every extent reads back. It
/// used to refuse to open, so every restart failed: the device was
/// bricked (the nemesis, after a second name got in).
#[test]
fn a_device_holding_data_reopens_with_a_second_name_left_out() {
    let Some(t) = a_on_localhost_and_d0(None) else {
        return;
    };
    let mut model = Model::new(SIZE);
    model.fill(&t.dev, &mut Rng::new(4), EXTENT);
    let alias = t.alias();
    let OnLocalhost { dev, a, d0, _dir } = t;
    let mut cfg = dev.config().clone();
    drop(dev);
    cfg.donors.push(alias);
    let dev = Device::open(cfg, _dir.path()).expect("opens without the second name");
    let s = dev.status();
    let b = s.donors.iter().find(|d| d.name == "b").expect("b listed");
    let table = pager_client::status::render_table(&s);
    assert!(
        b.failed && table.contains("same export as member a"),
        "{table}"
    );
    model.check_all(&dev, EXTENT);
    drop(dev);
    drop((a, d0));
}

/// Two devices of one client (two state directories, same client id, same
/// donors) keep apart: the second one's attach leaves the first one's
/// pages alone, and each reads back only what it wrote.
#[test]
fn a_second_device_of_the_same_client_leaves_the_first_alone() {
    let Some(ds) = netpager_test_support::pager_servers(2) else {
        return;
    };
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let one = Device::open(config(Mode::Mirror, SIZE, EXTENT, &refs), dir1.path()).unwrap();
    let mut m1 = Model::new(SIZE);
    m1.fill(&one, &mut Rng::new(1), EXTENT);
    let two = Device::open(config(Mode::Mirror, SIZE, EXTENT, &refs), dir2.path()).unwrap();
    let mut m2 = Model::new(SIZE);
    m2.fill(&two, &mut Rng::new(2), EXTENT);
    m1.check_all(&one, EXTENT);
    m2.check_all(&two, EXTENT);
    // Each device's pages are a store of their own on every donor.
    let (c1, c2) = (one.config().clone(), two.config().clone());
    let stores = [c1.store_name(&c1.donors[0]), c2.store_name(&c2.donors[0])];
    assert_ne!(stores[0], stores[1]);
    for s in [one.status(), two.status()] {
        assert!(s.donors.iter().all(|d| !d.failed), "{s:?}");
    }
}

/// A device whose configuration was copied (same device id, another state
/// directory) finds the first one's label on the exports and refuses them
/// instead of clearing them.
#[test]
fn a_copied_device_does_not_clear_the_original() {
    let Some(ds) = netpager_test_support::pager_servers(1) else {
        return;
    };
    let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let cfg = config(Mode::None, SIZE, EXTENT, &[&ds[0]]);
    let one = Device::open(cfg.clone(), dir1.path()).unwrap();
    let mut m1 = Model::new(SIZE);
    m1.fill(&one, &mut Rng::new(5), EXTENT);
    let e = Device::open(cfg, dir2.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("holds the pages of device") && e.contains(&dir1.path().display().to_string()),
        "{e}"
    );
    m1.check_all(&one, EXTENT);
}

/// A newer session of a device fences the older one: a connection that
/// claims the device's exports with the next session number makes the
/// donor refuse the running process's requests, which then reports that
/// it was replaced, marks no donor failed and loses nothing on the donor.
#[test]
fn a_newer_session_fences_the_older_one() {
    let Some(ds) = netpager_test_support::pager_servers(1) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(Mode::None, SIZE, EXTENT, &[&ds[0]]);
    let dev = Device::open(cfg.clone(), dir.path()).unwrap();
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(9), EXTENT);
    let newer = cfg.endpoint(&cfg.donors[0], dev.session() + 1);
    let conn = netpager_nbd::Connection::connect(&newer, Duration::from_secs(5)).unwrap();
    let e = dev.write(&[1u8; 4096], 0).unwrap_err();
    assert!(matches!(e, DeviceError::Fenced(_)), "{e}");
    assert!(e.to_string().contains("fenced"), "{e}");
    // Refused from now on, without another round trip.
    let e = dev.read(&mut [0u8; 4096], EXTENT).unwrap_err();
    assert!(matches!(e, DeviceError::Fenced(_)), "{e}");
    let s = dev.status();
    assert!(s.donors.iter().all(|d| !d.failed), "no donor failed: {s:?}");
    // An older session cannot come back either: every request refused.
    let older = cfg.endpoint(&cfg.donors[0], dev.session());
    let mut c = netpager_nbd::Connection::connect(&older, Duration::from_secs(5)).unwrap();
    let e = c
        .pwrite(&[0u8; 4096], 0, Duration::from_secs(5))
        .unwrap_err();
    assert!(e.is_fenced(), "{e}");
    drop(conn);
}

/// Placement and a removal race: extents are being placed (each first
/// write chooses donors and takes slots) while one of the donors, slow to
/// write, is removed. The removal waits for a placement under way, so
/// nothing is placed on a donor that left: every write succeeds, the
/// donor ends holding nothing and leaves, and every byte reads back.
/// (Before, a donor chosen just before its removal could retire before
/// it got its slot: the unit then sat on a retired donor, EIO.)
#[test]
fn placement_never_lands_on_a_donor_that_left() {
    let Some(so) = netpager_test_support::pager_server_so() else {
        return;
    };
    let slow = Nbdkit::start(
        &[
            "--filter=delay".into(),
            so.display().to_string(),
            "mlock=false".into(),
            "size=16M".into(),
            "budget=64M".into(),
            "reserve=0".into(),
            "busy-load=1000".into(),
            "poll-ms=100".into(),
            "delay-write=100ms".into(),
        ],
        true,
    );
    let Some(fast) = netpager_test_support::pager_servers(1) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(Mode::None, SIZE, EXTENT, &[&fast[0], &slow]);
    cfg.donors[1].name = "slow".into();
    let dev = std::sync::Arc::new(Device::open(cfg, dir.path()).unwrap());
    let mut model = Model::new(SIZE);
    let mut rng = Rng::new(21);
    // A few extents first, so the slow donor holds some.
    for e in 0..8 {
        model.write_random(&dev, &mut rng, e * EXTENT, EXTENT);
    }
    let writer = {
        let (dev, mut model, mut rng) = (dev.clone(), model.clone(), Rng::new(22));
        std::thread::spawn(move || {
            for e in 8..SIZE / EXTENT {
                model.write_random(&dev, &mut rng, e * EXTENT, EXTENT);
            }
            model
        })
    };
    dev.remove_donor("slow").unwrap();
    let model = writer.join().expect("every write succeeded");
    common::wait_status(&dev, "the slow donor to leave", |s| {
        s.donors.iter().all(|d| d.name != "slow") && s.left.iter().any(|l| l.name == "slow")
    });
    model.check_all(&dev, EXTENT);
    let s = dev.status();
    assert_eq!((s.totals.lost, s.totals.degraded), (0, 0), "{s:?}");
}

/// A donors file line that names a member under another address is not
/// applied: status says which line and which member it duplicates, and
/// the set keeps the member once.
#[test]
fn a_donors_file_line_naming_a_member_again_is_reported_with_its_line() {
    let Some(a) = on_localhost() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("donors");
    let first = format!("# lab donors\n{},name=a\n", a.addr);
    std::fs::write(&file, &first).unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(Mode::None, SIZE, EXTENT, &[]);
    cfg.donors_file = Some(file.clone());
    let dev = Device::open(cfg, state.path()).unwrap();
    // Its first line joins (and labels its export) first.
    common::wait_status(&dev, "donor a attached", |s| {
        s.donors.iter().any(|d| d.name == "a" && !d.failed)
    });
    std::fs::write(&file, format!("{first}localhost:{},name=b\n", port_of(&a))).unwrap();
    // Written in place: an epoch may read it empty or cut short, which the
    // device does not take (follow.rs); only the whole file is reported.
    let s = common::wait_status(&dev, "the duplicate line reported", |s| {
        s.donors_file_pending
            .as_deref()
            .is_some_and(|p| p.contains("line 3"))
    });
    let why = s.donors_file_pending.clone().unwrap();
    assert!(
        why.contains("line 3") && why.contains("same export as member a"),
        "{why}"
    );
    let names: Vec<&str> = s.donors.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["a"]);
}
