//! The parity write hole: a stripe torn by a client crash (a data member
//! written, its parity not) is resynced when the device opens again, so a
//! later donor loss decodes the group's other extents correctly. The tear
//! is made deterministically: the device is closed with the group's write
//! intent still open, then one data member is overwritten behind its back
//! through another NBD connection, which is exactly what a client killed
//! between its data and parity writes leaves behind.

mod common;

use std::time::Duration;

use common::{config, Nbdkit, Rng};
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
fn member(state: &std::path::Path, c: &DeviceConfig, g: u64, pos: usize) -> (usize, u64) {
    let map = ExtentMap::open(state, Layout::from_config(c)).unwrap();
    let unit = map.unit(g).read().unwrap().clone().expect("group placed");
    match unit.members[pos].loc {
        // A fresh map numbers donors in configuration order.
        Loc::Donor { donor, slot } => (donor as usize, slot as u64 * EXTENT),
        Loc::Fallback { .. } => panic!("no fallback configured"),
    }
}

/// Writes group 0 whole, closes the device with its intent open, tears
/// the stripe (new bytes on extent 0's member only), reopens, kills the
/// donors in `kill` (given the layout, as member positions) and checks
/// every byte of the group.
fn torn_stripe_is_resynced(mode: Mode, donors: usize, kill: impl Fn(&Layout) -> Vec<usize>) {
    let mut ds: Vec<Nbdkit> = (0..donors).map(|_| Nbdkit::memory("8M")).collect();
    let state = tempfile::tempdir().unwrap();
    let c = cfg(mode, &ds);
    let layout = Layout::from_config(&c);
    let k = layout.data_per_unit();
    let group = (k * EXTENT) as usize;
    let mut want = vec![0u8; group];
    Rng::new(13).fill(&mut want);
    let session = {
        let dev = Device::open(c.clone(), state.path()).unwrap();
        dev.write(&want, 0).unwrap();
        dev.flush().unwrap();
        assert_eq!(dev.status().totals.groups_open, 1);
        dev.session()
    };
    // The torn write: extent 0's new bytes reached its member, the parity
    // update did not.
    let (d0, off0) = member(state.path(), &c, 0, layout.locate(0).1);
    let mut torn = vec![0u8; EXTENT as usize];
    Rng::new(14).fill(&mut torn);
    // As the session that wrote, which the donor still takes.
    let ep = c.endpoint(&c.donors[d0], session);
    let mut conn = netpager_nbd::Connection::connect(&ep, Duration::from_secs(5)).unwrap();
    conn.pwrite(&torn, off0, Duration::from_secs(5)).unwrap();
    conn.flush(Duration::from_secs(5)).unwrap();
    drop(conn);
    want[..EXTENT as usize].copy_from_slice(&torn);

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
    let mut got = vec![0u8; group];
    dev.read(&mut got, 0).unwrap();
    for e in 0..k as usize {
        let r = e * EXTENT as usize..(e + 1) * EXTENT as usize;
        assert!(
            got[r.clone()] == want[r],
            "extent {e} of the torn group reads wrong after the donor loss"
        );
    }
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
