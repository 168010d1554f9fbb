//! The stride prefetcher's thin shell (policy in [`crate::readahead`]):
//! demand reads are served from its cache or recorded in the detector, and
//! the pages a trend predicts are read ahead by [`THREADS`] threads of
//! their own. Demand reads never queue behind them: they take a lock for
//! the cache look-up, wait only for a page of their own already on its way
//! to them, and hand work over a bounded queue that drops what does not fit.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Mutex;
use std::time::Duration;

use netpager_util::LockExt;

use super::Inner;
use crate::page_log::PAGE;
use crate::readahead::{PrefetchCache, StrideDetector, Take, Ticket, Window, CACHE_PER_PREFETCH};

/// Pages a prefetch thread reads in one request at most.
const RUN: u64 = 64;
/// Prefetch threads: requests of several predicted reads in flight at once.
pub(crate) const THREADS: usize = 4;

pub(crate) struct Prefetch {
    pub(crate) cache: PrefetchCache,
    /// The trend of the reads and how far ahead it pays to read.
    detector: Mutex<(StrideDetector, Window)>,
    queue: SyncSender<(u64, Ticket)>,
    work: Mutex<Receiver<(u64, Ticket)>>,
}

impl Prefetch {
    pub(crate) fn new(pages: u32) -> Prefetch {
        let cap = pages as usize * CACHE_PER_PREFETCH;
        let (queue, rx) = sync_channel(cap);
        Prefetch {
            cache: PrefetchCache::new(cap),
            detector: Mutex::new((StrideDetector::new(), Window::new(pages as u64))),
            queue,
            work: Mutex::new(rx),
        }
    }
}

impl Inner {
    /// A whole-page read served from the prefetch cache if it holds it
    /// all ([`Take::Hit`]); else whether it had been predicted.
    pub(crate) fn read_prefetched(&self, buf: &mut [u8], offset: u64) -> Take {
        match &self.prefetch {
            Some(pf) if offset.is_multiple_of(PAGE) && (buf.len() as u64).is_multiple_of(PAGE) => {
                let wait = Duration::from_millis(self.cfg.timeouts.request_ms);
                let took = pf.cache.take(offset / PAGE, buf, wait);
                if took == Take::Hit {
                    self.ahead(pf, offset / PAGE, buf.len() as u64 / PAGE, took);
                }
                took
            }
            _ => Take::Miss,
        }
    }

    /// After a read from the donors: feed the detector, read ahead on a trend.
    pub(crate) fn read_done(&self, offset: u64, len: u64, took: Take) {
        if let Some(pf) = &self.prefetch {
            if offset.is_multiple_of(PAGE) && len.is_multiple_of(PAGE) {
                self.ahead(pf, offset / PAGE, len / PAGE, took);
            }
        }
    }

    /// A write, zero or trim of the range: its prefetched pages go.
    pub(crate) fn written(&self, offset: u64, len: u64) {
        if let Some(pf) = &self.prefetch {
            let first = offset / PAGE;
            pf.cache
                .invalidate(first, (offset + len).div_ceil(PAGE) - first);
        }
    }

    /// Records a read of `n` pages at `first` and how the cache answered
    /// it (a late prefetch still proves the trend right); on a trend, queues
    /// the next reads it predicts (each as long as this one) up to the
    /// window's pages.
    fn ahead(&self, pf: &Prefetch, first: u64, n: u64, took: Take) {
        let (stride, pages) = {
            let mut d = pf.detector.lock_or_recover();
            let (det, window) = &mut *d;
            match took {
                Take::Hit | Take::Late => window.hit(),
                Take::Miss => window.miss(n),
            }
            match det.record(first) {
                Some(s) => (s, window.pages()),
                None => return,
            }
        };
        let end = self.layout.size / PAGE;
        let mut queued = 0;
        for i in 1.. {
            let Some(start) = first.checked_add_signed(stride * i) else {
                return;
            };
            for p in start..start + n {
                if queued >= pages || p >= end {
                    return;
                }
                queued += 1;
                let Some(t) = pf.cache.reserve(p) else {
                    continue;
                };
                match pf.queue.try_send((p, t)) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                        pf.cache.cancel(p, t);
                        return;
                    }
                }
            }
        }
    }

    /// A prefetch thread: reads queued pages, runs of consecutive pages in
    /// one request, into the cache.
    pub(crate) fn prefetch_loop(&self) {
        let Some(pf) = &self.prefetch else { return };
        let mut buf = vec![0u8; (RUN * PAGE) as usize];
        let mut run: Vec<(u64, Ticket)> = Vec::with_capacity(RUN as usize);
        let mut held: Option<(u64, Ticket)> = None;
        while !self.stop.load(Ordering::Relaxed) {
            run.clear();
            {
                let rx = pf.work.lock_or_recover();
                let first = match held.take() {
                    Some(j) => j,
                    None => match rx.recv_timeout(Duration::from_millis(100)) {
                        Ok(j) => j,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => return,
                    },
                };
                run.push(first);
                while (run.len() as u64) < RUN {
                    match rx.try_recv() {
                        Ok(j) if j.0 == run[run.len() - 1].0 + 1 => run.push(j),
                        Ok(j) => {
                            held = Some(j);
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            // Pages read or written since they were queued are skipped; the
            // run is read whole if any page of it is still wanted.
            let wanted = run.iter().filter(|&&(p, t)| pf.cache.start(p, t)).count();
            if wanted == 0 {
                continue;
            }
            let bytes = &mut buf[..run.len() * PAGE as usize];
            match self.read_device(bytes, run[0].0 * PAGE) {
                Ok(()) => {
                    for (i, &(p, t)) in run.iter().enumerate() {
                        pf.cache
                            .fill(p, t, &bytes[i * PAGE as usize..(i + 1) * PAGE as usize]);
                    }
                }
                Err(e) => {
                    tracing::debug!("prefetch of {} pages at page {}: {e}", run.len(), run[0].0);
                    for &(p, t) in &run {
                        pf.cache.cancel(p, t);
                    }
                }
            }
        }
    }
}
