use super::*;

use std::sync::Arc;

/// No waiting for pages in flight.
const NOW: Duration = Duration::ZERO;

fn trend_after(pages: &[u64]) -> Option<i64> {
    let mut d = StrideDetector::new();
    let mut t = None;
    for &p in pages {
        t = d.record(p);
    }
    t
}

/// xorshift64*, for reproducible noise.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn vote_finds_sequential_and_strided_reads() {
    let seq: Vec<u64> = (100..110).collect();
    assert_eq!(trend_after(&seq), Some(1));
    let by8: Vec<u64> = (0..10).map(|i| 4096 + 8 * i).collect();
    assert_eq!(trend_after(&by8), Some(8));
    let back: Vec<u64> = (0..10).map(|i| 10_000 - 3 * i).collect();
    assert_eq!(trend_after(&back), Some(-3));
    // Four reads give three deltas: too few to call a trend.
    assert_eq!(trend_after(&[0, 1, 2, 3]), None);
    assert_eq!(trend_after(&[0, 1, 2, 3, 4]), Some(1));
}

#[test]
fn vote_holds_a_trend_through_stray_reads() {
    let mut next = rng(7);
    let mut d = StrideDetector::new();
    let (mut page, mut seen, mut trend_reads) = (1u64 << 20, 0, 0);
    for i in 0..400 {
        // One read in eight is somewhere else entirely (two deltas off
        // the stride: there and back).
        let p = if i % 8 == 7 {
            next() % (1 << 30)
        } else {
            page += 4;
            page
        };
        if let Some(t) = d.record(p) {
            assert_eq!(t, 4, "read {i}: trend {t}");
            seen += 1;
        }
        trend_reads += 1;
    }
    assert!(
        seen * 10 > trend_reads * 8,
        "trend seen on {seen} of {trend_reads} reads"
    );
}

#[test]
fn vote_follows_a_new_stride_within_a_few_reads() {
    let mut d = StrideDetector::new();
    for p in 0..64 {
        d.record(p);
    }
    let mut p = 5000;
    let mut when = None;
    for i in 0..8 {
        p += 16;
        if d.record(p) == Some(16) {
            when = Some(i);
            break;
        }
    }
    assert!(
        matches!(when, Some(i) if i <= 3),
        "new stride seen after {when:?} reads"
    );
}

#[test]
fn vote_finds_no_trend_in_random_reads() {
    let mut next = rng(11);
    let mut d = StrideDetector::new();
    let found = (0..10_000)
        .filter(|_| d.record(next() % (1 << 20)).is_some())
        .count();
    assert_eq!(found, 0, "random reads made {found} trends");
    // Re-reads of one page are no trend either.
    assert_eq!(trend_after(&[9; 40]), None);
}

fn page_of(v: u8) -> Vec<u8> {
    vec![v; PAGE as usize]
}

/// What the prefetch thread does for one page: take its slot, send it,
/// and keep what came back.
fn prefetch(c: &PrefetchCache, page: u64, data: &[u8]) {
    let t = c.reserve(page).unwrap();
    assert!(c.start(page, t));
    c.fill(page, t, data);
}

#[test]
fn a_prefetched_page_is_served_once() {
    let c = PrefetchCache::new(4);
    let t = c.reserve(7).unwrap();
    assert_eq!(c.reserve(7), None, "one slot per page");
    let mut out = page_of(0);
    // Still queued: the read goes to the donors itself, and says it had
    // been predicted; the prefetch thread then skips the page.
    assert_eq!(c.take(7, &mut out, NOW), Take::Late);
    assert!(!c.start(7, t));
    assert_eq!(c.slots(), 0);
    prefetch(&c, 7, &page_of(2));
    assert_eq!(c.ready_bytes(), PAGE);
    assert_eq!(c.take(7, &mut out, NOW), Take::Hit);
    assert_eq!(out, page_of(2));
    assert_eq!(
        c.take(7, &mut out, NOW),
        Take::Miss,
        "a page leaves the cache when read"
    );
    let n = c.counters();
    assert_eq!((n.issued, n.hits, n.wasted), (1, 1, 0));
    assert_eq!(c.ready_bytes(), 0);
}

#[test]
fn a_read_of_several_pages_is_served_only_whole() {
    let c = PrefetchCache::new(8);
    for p in 10..14 {
        prefetch(&c, p, &page_of(p as u8));
    }
    let mut out = vec![0u8; 4 * PAGE as usize];
    assert_eq!(c.take(10, &mut out, NOW), Take::Hit);
    for (i, chunk) in out.chunks(PAGE as usize).enumerate() {
        assert_eq!(chunk, &page_of(10 + i as u8)[..]);
    }
    prefetch(&c, 20, &page_of(1));
    let mut two = vec![0u8; 2 * PAGE as usize];
    assert_eq!(
        c.take(20, &mut two, NOW),
        Take::Miss,
        "page 21 was never prefetched"
    );
    assert_eq!(c.slots(), 0, "the part that was there goes too");
    assert_eq!(c.counters().wasted, 1);
}

#[test]
fn a_write_racing_a_prefetch_of_the_same_page_wins() {
    let c = PrefetchCache::new(4);
    // The prefetch reads the donor's old page...
    let t = c.reserve(3).unwrap();
    assert!(c.start(3, t));
    let old = page_of(0xAA);
    // ...while a write of the page lands, then the prefetch comes back.
    c.invalidate(3, 1);
    c.fill(3, t, &old);
    let mut out = page_of(0);
    assert_eq!(
        c.take(3, &mut out, NOW),
        Take::Miss,
        "the stale prefetch must not be served"
    );
    // A write to a page already prefetched replaces it too.
    prefetch(&c, 4, &old);
    c.invalidate(0, 100);
    assert_eq!(c.take(4, &mut out, NOW), Take::Miss);
    assert_eq!(c.counters().wasted, 2);
    assert_eq!(c.ready_bytes(), 0);
}

#[test]
fn a_failed_prefetch_frees_its_slot() {
    let c = PrefetchCache::new(1);
    let t = c.reserve(1).unwrap();
    assert!(c.start(1, t));
    c.cancel(1, t);
    assert_eq!(c.slots(), 0);
    assert!(c.reserve(2).is_some());
    assert_eq!(c.counters().wasted, 1);
}

#[test]
fn the_cache_stays_bounded_under_a_flood_of_prefetches() {
    let cap = 16;
    let c = PrefetchCache::new(cap);
    let mut next = rng(3);
    let mut out = page_of(0);
    for i in 0..100_000u64 {
        let p = next() % 4096;
        match i % 4 {
            // Most prefetches are never read: the flood. Some stay queued,
            // some in flight, the rest come back.
            0..=2 => {
                if let Some(t) = c.reserve(p) {
                    if i % 8 != 1 && c.start(p, t) && i % 8 != 2 {
                        c.fill(p, t, &page_of(p as u8));
                    }
                }
            }
            _ => {
                if c.take(p, &mut out, NOW) == Take::Hit {
                    assert_eq!(out, page_of(p as u8), "page {p} served another page's data");
                }
            }
        }
        assert!(c.slots() <= cap);
        assert!(c.ready_bytes() <= cap as u64 * PAGE);
        let inner = c.inner.lock().unwrap();
        assert!(
            inner.order.len() <= 2 * cap + 1,
            "order queue {}",
            inner.order.len()
        );
        let ready = inner
            .slots
            .values()
            .filter(|s| matches!(s.state, State::Ready(_)))
            .count();
        assert_eq!(
            inner.free.len() + ready,
            cap,
            "a buffer lost or given twice"
        );
    }
    let n = c.counters();
    assert!(n.issued > 30_000 && n.wasted > 0 && n.hits > 0, "{n:?}");
    assert!(n.issued >= n.hits + n.wasted, "{n:?}");
}

#[test]
fn a_cache_of_no_pages_takes_nothing() {
    let c = PrefetchCache::new(0);
    assert_eq!(c.reserve(1), None);
}

#[test]
fn a_read_waits_for_its_page_in_flight() {
    let c = Arc::new(PrefetchCache::new(4));
    let t = c.reserve(5).unwrap();
    assert!(c.start(5, t), "the prefetch thread takes the page");
    let filler = {
        let c = c.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            c.fill(5, t, &page_of(9));
        })
    };
    let mut out = page_of(0);
    assert_eq!(c.take(5, &mut out, Duration::from_secs(30)), Take::Hit);
    assert_eq!(out, page_of(9));
    filler.join().unwrap();
    // A prefetch that fails wakes the reader, who then reads the donors.
    let t = c.reserve(6).unwrap();
    assert!(c.start(6, t));
    let failer = {
        let c = c.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            c.cancel(6, t);
        })
    };
    assert_ne!(c.take(6, &mut out, Duration::from_secs(30)), Take::Hit);
    failer.join().unwrap();
    // Not past the bound: a page in flight too long is read again.
    let t = c.reserve(7).unwrap();
    assert!(c.start(7, t));
    assert_ne!(c.take(7, &mut out, Duration::from_millis(10)), Take::Hit);
    assert!(!c.start(7, t), "its slot went");
}

#[test]
fn the_window_grows_with_hits_and_shrinks_with_misses() {
    let mut w = Window::new(32);
    assert_eq!(w.pages(), 1);
    for want in [2, 4, 8, 16, 32, 32] {
        w.hit();
        assert_eq!(w.pages(), want);
    }
    for want in [16, 8, 4, 2, 2] {
        w.miss(2);
        assert_eq!(w.pages(), want);
    }
    assert_eq!(Window::new(0).pages(), 0);
}
