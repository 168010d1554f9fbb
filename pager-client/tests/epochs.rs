//! What an epoch costs when donors hang: a test binary of its own, since
//! it starts eight donors and stops six, and the timing of the failure
//! tests beside it would suffer.

mod common;

use common::{config, wait_status, Nbdkit};
use pager_client::config::Mode;
use pager_client::device::Device;

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 2 << 20;

/// Donors that hang with their status connections kept (SIGSTOP) are not
/// waited for one after the other: the first slow one sends the rest to the
/// parallel pollers, so an epoch waits about two status timeouts (and one
/// heartbeat timeout), not one per hung donor.
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
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for d in &mut ds[2..] {
        d.stop();
    }
    let s = wait_status(&dev, "two epochs after the hang", |s| {
        s.epochs.iter().filter(|(at, _)| *at > since).count() >= 2
    });
    let worst = s
        .epochs
        .iter()
        .filter(|(at, _)| *at + 100 > since)
        .map(|(_, us)| *us)
        .max()
        .unwrap();
    // One after the other, the six would take 6 s of status timeouts.
    assert!(
        worst < 4_500_000,
        "an epoch took {worst} us with 6 hung donors: {:?}",
        s.epochs
    );
    for d in &mut ds[2..] {
        d.cont();
    }
}
