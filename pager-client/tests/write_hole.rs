//! The parity write hole: a stripe torn by a client crash (a data member
//! written, its parity not) is resynced when the device opens again, so a
//! later donor loss decodes the group's other extents correctly. The tear
//! is made deterministically: the device is closed, the group's write
//! intent journaled open again (a clean close closes it), then one data
//! member is overwritten behind its back through another NBD connection,
//! which is exactly what a client killed between its data and parity
//! writes leaves behind.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{config, wait_status, Nbdkit, Rng};
use pager_client::config::{ByteSize, DeviceConfig, Mode};
use pager_client::device::Device;
use pager_client::extent_map::{ExtentMap, Layout, Loc};

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 2 << 20;

fn cfg(mode: Mode, ds: &[Nbdkit]) -> DeviceConfig {
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut c = config(mode, SIZE, EXTENT, &refs);
    // Whole-group writes only, so the bytes live at home; and no sweep
    // while the test runs, so closing leaves the intent open as a crash
    // would.
    c.parity_log = Some(ByteSize(0));
    c.write_intent_quiet_ms = 3_600_000;
    c
}

/// Where member `pos` of group `g` lives: (donor index, byte offset).
fn member(state: &Path, c: &DeviceConfig, g: u64, pos: usize) -> (usize, u64) {
    let map = ExtentMap::open(state, Layout::from_config(c)).unwrap();
    let unit = map.unit(g).read().unwrap().clone().expect("group placed");
    match unit.members[pos].loc {
        // A fresh map numbers donors in configuration order.
        Loc::Donor { donor, slot } => (donor as usize, slot as u64 * EXTENT),
        Loc::Fallback { .. } => panic!("no fallback configured"),
    }
}

/// What a client killed between group 0's data and parity writes leaves:
/// the group written whole (`want`), its intent open, and extent 0's
/// member holding new bytes its parity does not know (`want` updated).
/// Returns the index of extent 0's donor.
fn torn_group(c: &DeviceConfig, state: &Path, want: &mut [u8]) -> usize {
    let layout = Layout::from_config(c);
    let session = {
        let dev = Device::open(c.clone(), state).unwrap();
        dev.write(want, 0).unwrap();
        dev.flush().unwrap();
        assert_eq!(dev.status().totals.groups_open, 1);
        dev.session()
    };
    ExtentMap::open(state, layout)
        .unwrap()
        .mark_written(0)
        .unwrap();
    let (d0, off0) = member(state, c, 0, layout.locate(0).1);
    let mut torn = vec![0u8; EXTENT as usize];
    Rng::new(14).fill(&mut torn);
    // As the session that wrote, which the donor still takes.
    let ep = c.endpoint(&c.donors[d0], session);
    let mut conn = netpager_nbd::Connection::connect(&ep, Duration::from_secs(5)).unwrap();
    conn.pwrite(&torn, off0, Duration::from_secs(5)).unwrap();
    conn.flush(Duration::from_secs(5)).unwrap();
    drop(conn);
    want[..EXTENT as usize].copy_from_slice(&torn);
    d0
}

/// Reads group 0 and checks each of its `k` extents against `want`.
fn check_group(dev: &Device, want: &[u8], k: u64, when: &str) {
    let mut got = vec![0u8; want.len()];
    dev.read(&mut got, 0).unwrap();
    for e in 0..k as usize {
        let r = e * EXTENT as usize..(e + 1) * EXTENT as usize;
        assert!(
            got[r.clone()] == want[r],
            "extent {e} of the torn group reads wrong {when}"
        );
    }
}

/// Tears group 0 (`torn_group`), reopens, kills the donors in `kill`
/// (given the layout, as member positions) and checks every byte of the
/// group.
fn torn_stripe_is_resynced(mode: Mode, donors: usize, kill: impl Fn(&Layout) -> Vec<usize>) {
    let mut ds: Vec<Nbdkit> = (0..donors).map(|_| Nbdkit::memory("8M")).collect();
    let state = tempfile::tempdir().unwrap();
    let c = cfg(mode, &ds);
    let layout = Layout::from_config(&c);
    let k = layout.data_per_unit();
    let mut want = vec![0u8; (k * EXTENT) as usize];
    Rng::new(13).fill(&mut want);
    let d0 = torn_group(&c, state.path(), &mut want);

    let victims: Vec<usize> = kill(&layout)
        .into_iter()
        .map(|pos| member(state.path(), &c, 0, pos).0)
        .collect();
    let dev = Device::open(c, state.path()).unwrap();
    let s = dev.status();
    assert_eq!(
        (s.totals.groups_resynced, s.totals.groups_open),
        (1, 0),
        "{}",
        pager_client::status::render_table(&s)
    );
    for v in victims {
        assert_ne!(v, d0, "the torn member's donor stays up");
        ds[v].kill9();
    }
    check_group(&dev, &want, k, "after the donor loss");
}

#[test]
fn parity_resyncs_a_torn_stripe_at_open() {
    // Lose extent 1's member: it is decoded from extent 0's and the parity.
    torn_stripe_is_resynced(Mode::Parity { width: 3 }, 3, |l| vec![l.locate(1).1]);
}

#[test]
fn ec_resyncs_a_torn_stripe_at_open() {
    // 2+2: lose extent 1's member and the first parity member, so extent 1
    // is decoded from extent 0's member and the second parity.
    torn_stripe_is_resynced(Mode::Ec { data: 2, parity: 2 }, 4, |l| {
        vec![l.locate(1).1, l.member_of(0, 2)]
    });
}

/// The torn member's donor is away (paused) when the device opens again,
/// so the group's parity cannot be recomputed. It used to be journaled
/// closed anyway, and the away member decoded from the stale parity: the
/// group's bytes from before the tear, zeros for a fresh group (the
/// nemesis's parity finding: a swap page read back as zeros after a
/// restart while a donor was slow). Now the member reads as lost while
/// its donor is away, and once it is back the group is resynced, so a
/// later loss of another member decodes right.
#[test]
fn parity_group_whose_resync_finds_a_data_member_away_waits_for_it() {
    let mut ds: Vec<Nbdkit> = (0..3).map(|_| Nbdkit::memory("8M")).collect();
    let state = tempfile::tempdir().unwrap();
    let mut c = cfg(Mode::Parity { width: 3 }, &ds);
    c.grace_ms = 1500;
    let layout = Layout::from_config(&c);
    let k = layout.data_per_unit();
    let mut want = vec![0u8; (k * EXTENT) as usize];
    Rng::new(15).fill(&mut want);
    let d0 = torn_group(&c, state.path(), &mut want);
    let other = member(state.path(), &c, 0, layout.locate(1).1).0;
    ds[d0].stop();
    // The sweep that retries the resync.
    c.write_intent_quiet_ms = 200;
    let dev = Device::open(c, state.path()).unwrap();
    let mut page = vec![0u8; 4096];
    let read = dev.read(&mut page, 0);
    assert!(
        read.is_err(),
        "extent 0 read while its donor is away and its group's parity is stale: {}",
        if page == want[..4096] {
            "right by chance"
        } else {
            "wrong bytes"
        }
    );
    ds[d0].cont();
    let name = format!("d{d0}");
    wait_status(
        &dev,
        "the torn member's donor back and its group resynced",
        |s| {
            s.totals.groups_open == 0
                && s.totals.lost == 0
                && s.donors.iter().any(|d| d.name == name && !d.failed)
        },
    );
    check_group(&dev, &want, k, "once its donor is back");
    ds[other].kill9();
    check_group(&dev, &want, k, "after the loss of another member");
}
