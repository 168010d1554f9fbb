//! Every `unsafe` of prefetchd: the io_uring ring with the buffers it reads
//! into, and the signal mask.
//!
//! The [`Ring`] owns one aligned buffer per ring slot (O_DIRECT needs
//! alignment). A slot is either free, or in flight: then only the kernel
//! touches its buffer, and the file it reads is kept open by the slot. The
//! single reaping thread hands the filled bytes to the slot's completion
//! closure and frees the slot. Dropping the ring cancels the reads still
//! in flight and waits for each to complete before the buffers are freed:
//! the kernel never writes into freed memory.

use std::alloc::{self, Layout};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex};

use io_uring::{opcode, types, IoUring};

/// Alignment of read buffers: enough for O_DIRECT on any device here.
pub const BUFFER_ALIGN: usize = 4096;

/// What to do with a finished read: the bytes read (short at end of file).
pub type Completion = Box<dyn FnOnce(io::Result<&[u8]>) + Send>;

/// A zeroed heap buffer aligned to [`BUFFER_ALIGN`].
struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by this value; access is
// coordinated by the ring's slot states.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above: the ring never hands out overlapping access.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout =
            Layout::from_size_align(len.max(1), BUFFER_ALIGN).expect("valid buffer layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

struct Slot {
    file: Option<Arc<File>>,
    done: Option<Completion>,
}

struct Slots {
    table: Vec<Slot>,
    free: Vec<usize>,
    stopping: bool,
}

/// A small io_uring with its own read buffers and one reaping thread.
pub struct Ring {
    ring: IoUring,
    bufs: Vec<AlignedBuf>,
    buf_len: usize,
    slots: Mutex<Slots>,
    slot_freed: Condvar,
    reaping: Mutex<()>,
}

/// `user_data` of the no-op that wakes the reaper for shutdown.
const WAKE: u64 = u64::MAX;
/// `user_data` of the cancel requests made when the ring is dropped.
const CANCEL: u64 = u64::MAX - 1;

impl Ring {
    /// A ring of `depth` slots, each reading at most `buf_len` bytes.
    pub fn new(depth: u32, buf_len: usize) -> io::Result<Ring> {
        let depth = depth.max(1);
        let ring = IoUring::new((depth + 1).next_power_of_two())?;
        Ok(Ring {
            ring,
            bufs: (0..depth).map(|_| AlignedBuf::new(buf_len)).collect(),
            buf_len,
            slots: Mutex::new(Slots {
                table: (0..depth)
                    .map(|_| Slot {
                        file: None,
                        done: None,
                    })
                    .collect(),
                free: (0..depth as usize).rev().collect(),
                stopping: false,
            }),
            slot_freed: Condvar::new(),
            reaping: Mutex::new(()),
        })
    }

    /// Reads `len` bytes (at most the buffer length) of `file` at `offset`;
    /// `done` runs on the reaping thread. Waits for a free slot.
    pub fn read(
        &self,
        file: Arc<File>,
        offset: u64,
        len: usize,
        done: Completion,
    ) -> io::Result<()> {
        let len = len.min(self.buf_len);
        let mut slots = self.slots.lock().expect("ring slots lock");
        let idx = loop {
            if slots.stopping {
                return Err(io::Error::other("disk ring is shutting down"));
            }
            match slots.free.pop() {
                Some(i) => break i,
                None => slots = self.slot_freed.wait(slots).expect("ring slots lock"),
            }
        };
        let entry = opcode::Read::new(
            types::Fd(file.as_raw_fd()),
            self.bufs[idx].ptr.as_ptr(),
            len as u32,
        )
        .offset(offset)
        .build()
        .user_data(idx as u64);
        slots.table[idx] = Slot {
            file: Some(file),
            done: Some(done),
        };
        // SAFETY: the submission queue is only touched while holding the
        // `slots` lock (here and in `wake`); the buffer of slot `idx` is
        // not accessed by anyone until its completion is reaped, and the
        // slot keeps the file open until then.
        let pushed = unsafe { self.ring.submission_shared().push(&entry) };
        if pushed.is_err() {
            // Cannot happen: the queue has more entries than slots.
            slots.table[idx] = Slot {
                file: None,
                done: None,
            };
            slots.free.push(idx);
            return Err(io::Error::other("io_uring submission queue full"));
        }
        self.ring.submit()?;
        Ok(())
    }

    /// Waits for at least one completion and runs the completion closures.
    /// Returns false once [`Ring::wake`] asked the reaper to stop.
    pub fn reap(&self) -> bool {
        let _only_reaper = self.reaping.lock().expect("ring reaper lock");
        if let Err(e) = self.ring.submit_and_wait(1) {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::error!("io_uring wait failed: {e}");
            }
        }
        // SAFETY: the completion queue is only touched by the thread
        // holding the `reaping` lock.
        let done: Vec<(u64, i32)> = unsafe { self.ring.completion_shared() }
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let mut running = true;
        for (user_data, res) in done {
            if user_data == WAKE {
                running = false;
                continue;
            }
            self.complete(user_data as usize, res);
        }
        running
    }

    /// Runs the completion of slot `idx`, whose read returned `res`, and
    /// frees the slot.
    fn complete(&self, idx: usize, res: i32) {
        let (file, callback) = {
            let mut slots = self.slots.lock().expect("ring slots lock");
            let slot = &mut slots.table[idx];
            (slot.file.take(), slot.done.take())
        };
        let result = if res < 0 {
            Err(io::Error::from_raw_os_error(-res))
        } else {
            // SAFETY: the kernel finished writing `res` bytes into this
            // slot's buffer; the slot is not free yet, so nobody else
            // reads or writes it.
            Ok(unsafe { std::slice::from_raw_parts(self.bufs[idx].ptr.as_ptr(), res as usize) })
        };
        if let Some(cb) = callback {
            cb(result);
        }
        drop(file);
        let mut slots = self.slots.lock().expect("ring slots lock");
        slots.free.push(idx);
        self.slot_freed.notify_one();
    }

    /// Makes [`Ring::reap`] return false soon; new reads are refused.
    pub fn wake(&self) {
        let mut slots = self.slots.lock().expect("ring slots lock");
        slots.stopping = true;
        self.slot_freed.notify_all();
        let entry = opcode::Nop::new().build().user_data(WAKE);
        // SAFETY: submission queue accessed under the `slots` lock, as in
        // `read`; a no-op references no memory.
        let pushed = unsafe { self.ring.submission_shared().push(&entry) };
        if pushed.is_ok() {
            if let Err(e) = self.ring.submit() {
                tracing::warn!("io_uring wake-up submit failed: {e}");
            }
        }
    }
}

impl Drop for Ring {
    /// Cancels the reads still in flight and waits until the kernel has
    /// completed every one of them (cancelled or not: a read already
    /// running on a regular file completes anyway), running their
    /// completions, so that no buffer is freed while the kernel may still
    /// write into it.
    fn drop(&mut self) {
        let in_flight: Vec<usize> = {
            let slots = self.slots.get_mut().unwrap_or_else(|p| p.into_inner());
            slots.stopping = true;
            (0..slots.table.len())
                .filter(|i| !slots.free.contains(i))
                .collect()
        };
        let mut left = in_flight.len();
        for &idx in &in_flight {
            let entry = opcode::AsyncCancel::new(idx as u64)
                .build()
                .user_data(CANCEL);
            // SAFETY: `&mut self`: no other thread uses the ring; a cancel
            // request references no memory. A full queue only loses the
            // cancel, not the wait below.
            let _ = unsafe { self.ring.submission().push(&entry) };
        }
        while left > 0 {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.kind() != io::ErrorKind::Interrupted {
                    // Freeing the buffers now could let the kernel write
                    // into freed memory: leak them instead.
                    tracing::error!("io_uring wait while dropping the ring failed: {e}");
                    std::mem::forget(std::mem::take(&mut self.bufs));
                    return;
                }
            }
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (user_data, res) in done {
                if user_data < self.bufs.len() as u64 {
                    self.complete(user_data as usize, res);
                    left -= 1;
                }
            }
        }
    }
}

/// The signals that stop the daemon.
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

fn stop_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a plain sigset_t
    // owned here.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in STOP_SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the stop signals in this thread and every thread it starts
/// afterwards, so that [`wait_stop_signal`] receives them.
pub fn block_stop_signals() -> io::Result<()> {
    let set = stop_set();
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Waits for one of the stop signals; returns its number.
pub fn wait_stop_signal() -> io::Result<i32> {
    let set = stop_set();
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is initialised and `sig` is a valid out-pointer.
    let rc = unsafe { libc::sigwait(&set, &mut sig) };
    if rc == 0 {
        Ok(sig)
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Sends a stop signal to this process (to end [`wait_stop_signal`] when
/// the daemon decides to stop by itself).
pub fn raise_stop() {
    // SAFETY: kill on our own pid with a valid signal number.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGTERM);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::mpsc;

    #[test]
    fn ring_reads_file_bytes_and_short_reads_at_eof() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let file = Arc::new(File::open(f.path()).unwrap());
        let ring = Arc::new(Ring::new(2, 8192).unwrap());
        let (tx, rx) = mpsc::channel();
        for (i, off) in [0u64, 8192].into_iter().enumerate() {
            let tx = tx.clone();
            ring.read(
                file.clone(),
                off,
                8192,
                Box::new(move |r| tx.send((i, r.map(|b| b.to_vec()))).unwrap()),
            )
            .unwrap();
        }
        let reaper = {
            let ring = ring.clone();
            std::thread::spawn(move || while ring.reap() {})
        };
        let mut got: Vec<_> = (0..2).map(|_| rx.recv().unwrap()).collect();
        got.sort_by_key(|g| g.0);
        assert_eq!(got[0].1.as_ref().unwrap()[..], data[..8192]);
        assert_eq!(got[1].1.as_ref().unwrap()[..], data[8192..]);
        ring.wake();
        reaper.join().unwrap();
        assert!(ring.read(file, 0, 10, Box::new(|_| {})).is_err());
    }

    #[test]
    fn dropping_the_ring_waits_for_reads_in_flight() {
        // Reads of an empty pipe stay in flight until cancelled; nobody
        // reaps them.
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just created and are owned here.
        let (rd, wr) = unsafe {
            use std::os::fd::FromRawFd;
            (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
        };
        let rd = Arc::new(rd);
        let ring = Ring::new(4, 4096).unwrap();
        let (tx, rx) = mpsc::channel();
        for i in 0..3 {
            let tx = tx.clone();
            ring.read(
                rd.clone(),
                0,
                4096,
                Box::new(move |r| tx.send((i, r.map(|b| b.len()))).unwrap()),
            )
            .unwrap();
        }
        drop(ring);
        // Every completion ran before the buffers were freed, with the
        // cancellation's error: no read can still write into them.
        let mut got: Vec<_> = rx.try_iter().collect();
        got.sort_by_key(|g| g.0);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got.iter().all(|(_, r)| r.is_err()), "{got:?}");
        // The pipe's reader is no longer borrowed by the ring.
        assert_eq!(Arc::strong_count(&rd), 1);
        drop(wr);
    }
}
