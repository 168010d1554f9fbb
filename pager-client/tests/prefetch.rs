//! The stride prefetcher on a real device (`prefetch_pages`): strided
//! reads are served from its cache, a write racing a prefetch of the same
//! page reads back the write, and a donor killed while prefetches are in
//! flight loses nothing in mode parity.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{config, wait_status, wait_status_every, Model, Nbdkit, Rng};
use pager_client::config::Mode;
use pager_client::device::Device;
use pager_client::status::render_table;

const EXTENT: u64 = 64 << 10;
const SIZE: u64 = 4 << 20;
const PAGE: u64 = 4096;

fn device(mode: Mode, ds: &[Nbdkit], prefetch: u32) -> (Arc<Device>, tempfile::TempDir) {
    let refs: Vec<&Nbdkit> = ds.iter().collect();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(mode, SIZE, EXTENT, &refs);
    cfg.prefetch_pages = prefetch;
    (Arc::new(Device::open(cfg, state.path()).unwrap()), state)
}

/// Reads every `stride`-th page (of 2 pages each) from `from`, checked;
/// with `settle`, each read waits until the prefetcher has every page it
/// predicted in its cache (so what counts is what it predicted, not how
/// fast its threads ran).
fn strided_pass(dev: &Device, model: &Model, from: u64, stride: u64, settle: bool) {
    let mut off = from;
    while off + 2 * PAGE <= SIZE {
        if settle {
            wait_status_every(dev, "the predicted pages", Duration::from_millis(1), |s| {
                s.totals.prefetch_pending == 0
            });
        }
        model.check(dev, off, 2 * PAGE);
        off += stride * PAGE;
    }
}

#[test]
fn strided_reads_are_served_from_the_prefetch_cache() {
    let ds: Vec<Nbdkit> = (0..3).map(|_| Nbdkit::memory("8M")).collect();
    let (dev, _state) = device(Mode::None, &ds, 32);
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(1), EXTENT);
    strided_pass(&dev, &model, 0, 5, true);
    let t = dev.status().totals;
    let reads = (SIZE / PAGE / 5) as f64;
    // Without the prefetcher there is no hit at all; with it, every read
    // but those that find the trend is served from its cache.
    assert!(
        t.prefetch_hits as f64 > 0.9 * reads,
        "{} hits of {reads} strided reads: {}",
        t.prefetch_hits,
        render_table(&dev.status())
    );
    assert!(t.prefetch_cache_bytes <= 8 * 32 * PAGE);
    // Random reads find no trend: nothing more is read ahead.
    let issued = t.prefetch_issued;
    let mut rng = Rng::new(2);
    for _ in 0..300 {
        model.check(&dev, rng.below(SIZE / PAGE) * PAGE, PAGE);
    }
    let after = dev.status().totals.prefetch_issued;
    assert!(
        after - issued < 64,
        "random reads issued {} prefetches",
        after - issued
    );
}

#[test]
fn a_write_racing_a_prefetch_of_the_same_page_reads_back_the_write() {
    let ds: Vec<Nbdkit> = (0..3).map(|_| Nbdkit::memory("8M")).collect();
    let (dev, _state) = device(Mode::Parity { width: 3 }, &ds, 64);
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(3), EXTENT);
    // A sequential reader keeps prefetching the pages just ahead of it...
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (dev, stop) = (dev.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; PAGE as usize];
            while !stop.load(Ordering::Relaxed) {
                for p in 0..SIZE / PAGE {
                    dev.read(&mut buf, p * PAGE).unwrap();
                }
            }
        })
    };
    // ...while the pages ahead are written and read back at once: 3000
    // times, and on until the race has shown (prefetched pages read, and
    // some dropped by a write), however the threads were scheduled.
    let mut rng = Rng::new(4);
    for i in 0u64.. {
        let p = rng.below(SIZE / PAGE);
        let mut page = vec![0u8; PAGE as usize];
        rng.fill(&mut page);
        dev.write(&page, p * PAGE).unwrap();
        let mut back = vec![0u8; PAGE as usize];
        dev.read(&mut back, p * PAGE).unwrap();
        assert!(back == page, "write {i} of page {p} read back stale data");
        if i >= 3000 && i % 100 == 0 {
            let t = dev.status().totals;
            if t.prefetch_hits > 0 && t.prefetch_wasted > 0 {
                break;
            }
            assert!(
                i < 300_000,
                "no race in {i} writes: {}",
                render_table(&dev.status())
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
}

#[test]
fn parity_loses_nothing_when_a_donor_dies_under_prefetches() {
    let mut ds: Vec<Nbdkit> = (0..4).map(|_| Nbdkit::memory("8M")).collect();
    let (dev, _state) = device(Mode::Parity { width: 3 }, &ds, 64);
    let mut model = Model::new(SIZE);
    model.fill(&dev, &mut Rng::new(5), EXTENT);
    let model = Arc::new(model);
    // Two sequential readers, each checking every byte, pass after pass.
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2u64)
        .map(|r| {
            let (dev, model, stop) = (dev.clone(), model.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut passes = 0;
                while !stop.load(Ordering::Relaxed) || passes < 2 {
                    strided_pass(&dev, &model, r * PAGE * 2, 4, false);
                    passes += 1;
                }
            })
        })
        .collect();
    // Kill a donor while prefetches are in flight.
    wait_status(&dev, "prefetches issued", |s| {
        s.totals.prefetch_issued > 200
    });
    ds[1].kill9();
    wait_status(&dev, "donor d1 marked failed", |s| s.donors[1].failed);
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join()
            .expect("every read after the kill returned the right bytes");
    }
    model.check_all(&dev, 256 << 10);
    let s = dev.status();
    assert_eq!(s.totals.lost, 0, "{}", render_table(&s));
}
