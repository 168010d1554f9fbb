//! What an epoch costs when donors hang: a test binary of its own, since
//! it starts eight donors and stops six, and the timing of the failure
//! tests beside it would suffer.

mod common;

use common::{config, wait_status, Nbdkit};
use pager_client::config::Mode;
use pager_client::device::Device;
use pager_client::status::ClientStatus;

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 2 << 20;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Hangs `hung` (SIGSTOP, connections kept), waits for two epochs that
/// started after the hang, and returns the longest epoch (us) that ran
/// while they hung; then lets them go on and waits until the device uses
/// them again, with their status connections kept.
fn worst_epoch_while_hung(dev: &Device, hung: &mut [Nbdkit]) -> u64 {
    let since = now_ms();
    for d in hung.iter_mut() {
        d.stop();
    }
    let s = wait_status(dev, "two epochs after the hang", |s| {
        s.epochs.iter().filter(|(at, _)| *at > since).count() >= 2
    });
    let worst = s
        .epochs
        .iter()
        .filter(|(at, _)| *at + 100 > since)
        .map(|(_, us)| *us)
        .max()
        .unwrap();
    for d in hung.iter_mut() {
        d.cont();
    }
    let back = |s: &ClientStatus| {
        s.donors
            .iter()
            .all(|d| !d.failed && d.state != "unreachable")
    };
    let s = wait_status(dev, "the hung donors back", back);
    // Two more epochs: every status connection is kept again.
    let last = s.epochs.last().map_or(0, |e| e.0);
    wait_status(dev, "two epochs with them back", |s| {
        s.epochs.iter().filter(|(at, _)| *at > last).count() >= 2
    });
    eprintln!("{} hung: worst epoch {worst} us", hung.len());
    worst
}

/// Donors that hang with their status connections kept (SIGSTOP) are not
/// waited for one after the other: the first slow one sends the rest to the
/// parallel pollers, so an epoch waits about two status timeouts (and one
/// heartbeat timeout), not one per hung donor. Measured against the same
/// device with one donor hung, in the same run: six cost about what one
/// does (one after the other they took 2.5x and more).
#[test]
fn hung_donors_with_kept_status_connections_do_not_stretch_an_epoch_each() {
    let Some(mut ds) = netpager_test_support::pager_servers(8) else {
        return;
    };
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let mut c = config(Mode::None, SIZE, EXTENT, &refs);
    c.policy.epoch_ms = 100;
    c.timeouts.connect_ms = 1000;
    c.timeouts.request_ms = 1000;
    let state = tempfile::tempdir().unwrap();
    let dev = Device::open(c, state.path()).unwrap();
    // A few epochs: every status connection is kept now.
    wait_status(&dev, "three epochs", |s| s.epochs.len() >= 3);
    let one = worst_epoch_while_hung(&dev, &mut ds[2..3]);
    let six = worst_epoch_while_hung(&dev, &mut ds[2..]);
    assert!(
        six < 2 * one,
        "an epoch took {six} us with 6 hung donors, {one} us with 1: {:?}",
        dev.status().epochs
    );
}
