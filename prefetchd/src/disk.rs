//! The disk level: block reads of the data files through io_uring.
//!
//! Callers queue reads; a submitter thread moves them into the ring
//! (demand reads before prefetches) and a completion thread runs their
//! completion closures. Neither caller nor completion closure ever blocks
//! on the ring, so a completion may queue further reads.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::sys::{Completion, Ring};

/// Whether a read is waited for by a job right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Urgency {
    Demand,
    Prefetch,
}

struct Request {
    file: Arc<File>,
    offset: u64,
    len: usize,
    done: Completion,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<Request>,
    prefetch: VecDeque<Request>,
    stopping: bool,
}

/// See the module documentation.
pub struct Disk {
    ring: Arc<Ring>,
    queues: Arc<(Mutex<Queues>, Condvar)>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Disk {
    /// A ring of `depth` reads of at most `block_size` bytes each.
    pub fn start(depth: u32, block_size: usize) -> io::Result<Disk> {
        let ring = Arc::new(Ring::new(depth, block_size)?);
        let queues: Arc<(Mutex<Queues>, Condvar)> = Arc::default();
        let submitter = {
            let (ring, queues) = (ring.clone(), queues.clone());
            std::thread::Builder::new()
                .name("disk-submit".into())
                .spawn(move || submit_loop(&ring, &queues))?
        };
        let reaper = {
            let ring = ring.clone();
            std::thread::Builder::new()
                .name("disk-complete".into())
                .spawn(move || while ring.reap() {})?
        };
        Ok(Disk {
            ring,
            queues,
            threads: Mutex::new(vec![submitter, reaper]),
        })
    }

    /// Queues a read of `len` bytes of `file` at `offset`.
    pub fn read(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        urgency: Urgency,
        done: Completion,
    ) {
        let (lock, cv) = &*self.queues;
        let mut q = lock.lock().expect("disk queue lock");
        if q.stopping {
            drop(q);
            done(Err(io::Error::other("disk level is shutting down")));
            return;
        }
        let req = Request {
            file,
            offset,
            len,
            done,
        };
        match urgency {
            Urgency::Demand => q.demand.push_back(req),
            Urgency::Prefetch => q.prefetch.push_back(req),
        }
        cv.notify_one();
    }

    /// Reads and waits (for worker threads that need the bytes themselves).
    pub fn read_blocking(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        urgency: Urgency,
    ) -> io::Result<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.read(
            file,
            offset,
            len,
            urgency,
            Box::new(move |r| {
                // The receiver only goes away if its thread died.
                let _ = tx.send(r.map(|b| b.to_vec()));
            }),
        );
        rx.recv()
            .map_err(|_| io::Error::other("disk completion lost"))?
    }

    /// Fails queued reads, stops the threads and waits for them.
    pub fn stop(&self) {
        let pending = {
            let (lock, cv) = &*self.queues;
            let mut q = lock.lock().expect("disk queue lock");
            q.stopping = true;
            cv.notify_all();
            let mut all: Vec<Request> = q.demand.drain(..).collect();
            all.extend(q.prefetch.drain(..));
            all
        };
        for r in pending {
            (r.done)(Err(io::Error::other("disk level is shutting down")));
        }
        self.ring.wake();
        for t in self.threads.lock().expect("disk threads lock").drain(..) {
            let _ = t.join();
        }
    }
}

fn submit_loop(ring: &Ring, queues: &(Mutex<Queues>, Condvar)) {
    let (lock, cv) = queues;
    loop {
        let req = {
            let mut q = lock.lock().expect("disk queue lock");
            loop {
                if q.stopping {
                    return;
                }
                if let Some(r) = q.demand.pop_front().or_else(|| q.prefetch.pop_front()) {
                    break r;
                }
                q = cv.wait(q).expect("disk queue lock");
            }
        };
        // Blocks while every ring slot is busy: that is the queue depth.
        let Request {
            file,
            offset,
            len,
            done,
        } = req;
        let done = Arc::new(Mutex::new(Some(done)));
        let cb = done.clone();
        if let Err(e) = ring.read(
            file,
            offset,
            len,
            Box::new(move |r| {
                if let Some(f) = cb.lock().expect("completion lock").take() {
                    f(r)
                }
            }),
        ) {
            if let Some(f) = done.lock().expect("completion lock").take() {
                f(Err(e));
            }
        }
    }
}
