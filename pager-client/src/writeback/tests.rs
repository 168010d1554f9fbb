//! The write-back buffer against a sink in memory that can be held,
//! failed and watched.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;

/// Memory behind a gate: while `hold` is set, writes wait (a slow donor);
/// while `fail` is set, they fail.
#[derive(Default)]
struct Mem {
    bytes: Mutex<Vec<u8>>,
    hold: AtomicBool,
    fail: AtomicBool,
    writes: AtomicUsize,
    reads: AtomicUsize,
}

impl Mem {
    fn new(size: usize) -> Arc<Mem> {
        Arc::new(Mem {
            bytes: Mutex::new(vec![0; size]),
            ..Mem::default()
        })
    }

    fn page(&self, p: usize) -> Vec<u8> {
        self.bytes.lock().unwrap()[p * PAGE..(p + 1) * PAGE].to_vec()
    }
}

impl Sink for Arc<Mem> {
    fn write(&self, data: &[u8], offset: u64) -> Result<(), SinkError> {
        while self.hold.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.fail.load(SeqCst) {
            return Err(SinkError {
                errno: libc::EIO,
                message: "donor gone".into(),
            });
        }
        self.writes.fetch_add(1, SeqCst);
        let o = offset as usize;
        self.bytes.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), SinkError> {
        self.reads.fetch_add(1, SeqCst);
        let o = offset as usize;
        buf.copy_from_slice(&self.bytes.lock().unwrap()[o..o + buf.len()]);
        Ok(())
    }
}

fn page_of(tag: u8) -> Vec<u8> {
    (0..PAGE).map(|i| (i as u8).wrapping_mul(7) ^ tag).collect()
}

/// A buffer of `pages` over `mem`, its drainers running in `scope`.
///
/// A panic in `f` (a failed assertion) opens the sink and stops the
/// drainers before it propagates: the scope joins them, and a drainer
/// left waiting on a held sink or a buffer that never empties would turn
/// the failure into a hang of the whole test binary.
fn with_buffer<R>(
    mem: &Arc<Mem>,
    pages: usize,
    f: impl FnOnce(&WriteBack<Arc<Mem>>, &Counters) -> R,
) -> R {
    let counters = Arc::new(Counters::default());
    let wb = WriteBack::new(mem.clone(), (pages * PAGE) as u64, Some(counters.clone()));
    let r = std::thread::scope(|s| {
        for _ in 0..DRAINERS {
            s.spawn(|| wb.drain_loop());
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&wb, &counters)));
        if r.is_err() {
            mem.hold.store(false, SeqCst);
            mem.fail.store(false, SeqCst);
        } else {
            wb.flush().unwrap();
        }
        wb.stop();
        r
    });
    r.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

#[test]
fn writes_are_acknowledged_before_the_sink_has_them_and_read_back_from_the_buffer() {
    let mem = Mem::new(64 * PAGE);
    mem.hold.store(true, SeqCst);
    with_buffer(&mem, 32, |wb, c| {
        wb.write(&page_of(1), 3 * PAGE as u64).unwrap();
        wb.write(&[page_of(2), page_of(3)].concat(), 4 * PAGE as u64)
            .unwrap();
        assert_eq!(
            mem.writes.load(SeqCst),
            0,
            "the sink is held: nothing reached it"
        );
        // A read of buffered pages returns the buffered bytes without the sink.
        let mut b = vec![0; 2 * PAGE];
        wb.read(&mut b, 3 * PAGE as u64).unwrap();
        assert_eq!(b, [page_of(1), page_of(2)].concat());
        assert_eq!(mem.reads.load(SeqCst), 0);
        // A read across buffered and unbuffered pages: sink, then buffer on top.
        let mut b = vec![0; 3 * PAGE];
        wb.read(&mut b, 2 * PAGE as u64).unwrap();
        assert_eq!(b, [vec![0; PAGE], page_of(1), page_of(2)].concat());
        // Part of a page, from the buffer.
        let mut b = vec![0; 100];
        wb.read(&mut b, 5 * PAGE as u64 + 10).unwrap();
        assert_eq!(b, page_of(3)[10..110]);
        assert_eq!(c.read_hits.load(SeqCst), 5);
        mem.hold.store(false, SeqCst);
    });
    assert_eq!(mem.page(3), page_of(1));
    assert_eq!(mem.page(5), page_of(3));
}

#[test]
fn flush_waits_for_the_drain_and_runs_are_batched() {
    let mem = Mem::new(256 * PAGE);
    let counters = Arc::new(Counters::default());
    let wb = WriteBack::new(mem.clone(), 128 * PAGE as u64, Some(counters.clone()));
    // Written before any drainer runs, so the runs drained do not depend
    // on how the drainers were scheduled against the writer.
    for p in 0..64u64 {
        wb.write(&page_of(p as u8), p * PAGE as u64).unwrap();
    }
    mem.hold.store(true, SeqCst);
    let flushed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..DRAINERS {
            s.spawn(|| wb.drain_loop());
        }
        s.spawn(|| {
            wb.flush().unwrap();
            flushed.store(true, SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        // Opened before asserting: a held sink would keep the scope from
        // ever ending.
        let early = flushed.load(SeqCst);
        mem.hold.store(false, SeqCst);
        assert!(!early, "flush returned with the sink held");
        while !flushed.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        wb.stop();
    });
    for p in 0..64 {
        assert_eq!(mem.page(p), page_of(p as u8), "page {p}");
    }
    assert_eq!(counters.pages_drained.load(SeqCst), 64);
    // 64 consecutive pages, whoever drains them: two runs of MAX_BATCH.
    assert_eq!(counters.batches.load(SeqCst), 64 / MAX_BATCH as u64);
    assert_eq!(wb.buffered(), 0);
}

#[test]
fn a_full_buffer_makes_writers_wait_instead_of_growing() {
    let mem = Mem::new(256 * PAGE);
    mem.hold.store(true, SeqCst);
    with_buffer(&mem, 32, |wb, c| {
        let done = AtomicUsize::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                for p in 0..64u64 {
                    wb.write(&page_of(p as u8), p * 2 * PAGE as u64).unwrap();
                    done.fetch_add(1, SeqCst);
                }
            });
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while c.full_waits.load(SeqCst) == 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (waits, taken, used) = (
                c.full_waits.load(SeqCst),
                done.load(SeqCst),
                c.used_bytes.load(SeqCst),
            );
            // Opened before asserting: the writer waits on the held sink,
            // and the scope would never end.
            mem.hold.store(false, SeqCst);
            assert!(waits > 0, "the writer never waited");
            assert_eq!(taken, 32, "exactly the buffer's pages were taken");
            assert!(used <= 32 * PAGE as u64);
        });
        assert_eq!(done.load(SeqCst), 64);
    });
    for p in 0..64 {
        assert_eq!(mem.page(p * 2), page_of(p as u8));
    }
}

#[test]
fn a_page_written_again_while_draining_reaches_the_sink_last() {
    let mem = Mem::new(16 * PAGE);
    with_buffer(&mem, 32, |wb, _| {
        for round in 0..200u32 {
            wb.write(&page_of(round as u8), 0).unwrap();
            if round % 7 == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        wb.flush().unwrap();
        assert_eq!(mem.page(0), page_of(199));
        let mut b = vec![0; PAGE];
        wb.read(&mut b, 0).unwrap();
        assert_eq!(b, page_of(199));
    });
}

#[test]
fn failed_drains_keep_the_pages_and_fail_the_flush() {
    let mem = Mem::new(16 * PAGE);
    with_buffer(&mem, 32, |wb, c| {
        mem.fail.store(true, SeqCst);
        wb.write(&page_of(9), PAGE as u64).unwrap();
        let e = wb.flush().unwrap_err();
        assert_eq!(e.errno(), libc::EIO);
        assert!(e.to_string().contains("donor gone"), "{e}");
        assert!(c.drain_failures.load(SeqCst) > 0);
        // Still served from the buffer, and drained once the sink is back.
        let mut b = vec![0; PAGE];
        wb.read(&mut b, PAGE as u64).unwrap();
        assert_eq!(b, page_of(9));
        mem.fail.store(false, SeqCst);
        wb.flush().unwrap();
        assert_eq!(mem.page(1), page_of(9));
    });
}

#[test]
fn unaligned_writes_and_settle_wait_for_buffered_pages() {
    let mem = Mem::new(16 * PAGE);
    with_buffer(&mem, 32, |wb, _| {
        mem.hold.store(true, SeqCst);
        wb.write(&page_of(4), 2 * PAGE as u64).unwrap();
        std::thread::scope(|s| {
            let h = s.spawn(|| wb.write(&[0xee; 10], 2 * PAGE as u64 + 5));
            std::thread::sleep(Duration::from_millis(30));
            let overtook = h.is_finished();
            mem.hold.store(false, SeqCst);
            assert!(!overtook, "the partial write overtook the buffered page");
            h.join().unwrap().unwrap();
        });
        let mut want = page_of(4);
        want[5..15].fill(0xee);
        assert_eq!(mem.page(2), want);
    });
}

#[test]
fn a_full_buffer_whose_drains_fail_fails_its_writers() {
    let mem = Mem::new(256 * PAGE);
    mem.fail.store(true, SeqCst);
    with_buffer(&mem, 32, |wb, _| {
        // Every page the buffer holds is refused: a writer waiting for a
        // slot gets the drain's error instead of waiting forever.
        let r: Result<Vec<()>, _> = (0..64u64)
            .map(|p| wb.write(&page_of(p as u8), p * PAGE as u64))
            .collect();
        let e = r.unwrap_err();
        assert_eq!(e.errno(), libc::EIO);
        mem.fail.store(false, SeqCst);
    });
}
