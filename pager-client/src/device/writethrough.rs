//! Mode disk: every write also goes, asynchronously, to a local file the
//! size of the device. A bounded queue of preallocated chunks feeds one
//! writer thread; flush and degraded reads wait until the queue is empty.
//!
//! Owned by the replicated backend (backend.rs); called by `replica.rs`
//! (queue, degraded reads) and maintenance (a rebuild from the file).

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};

use netpager_util::{CondvarExt, LockExt};

use super::io::{open_rw, ZEROS};
use super::{DeviceError, Result};

const CHUNK: usize = 256 << 10;

enum Entry {
    Data {
        off: u64,
        buf: Box<[u8]>,
        len: usize,
    },
    Zero {
        off: u64,
        len: u64,
    },
}

struct State {
    queue: VecDeque<Entry>,
    free: Vec<Box<[u8]>>,
    queued_bytes: u64,
    writing: bool,
    stop: bool,
    error: Option<String>,
}

pub(crate) struct WriteThrough {
    file: File,
    path: PathBuf,
    st: Mutex<State>,
    cv: Condvar,
}

impl WriteThrough {
    /// Opens (or creates, sparse) the file; `queue` bounds the bytes of data
    /// waiting in memory.
    pub fn open(path: &Path, size: u64, queue: usize) -> Result<WriteThrough> {
        let ferr = |source| DeviceError::File {
            path: path.to_path_buf(),
            source,
        };
        let file = open_rw(path).map_err(ferr)?;
        if file.metadata().map_err(ferr)?.len() < size {
            file.set_len(size).map_err(ferr)?;
        }
        let chunks = (queue / CHUNK).max(1);
        let free = (0..chunks)
            .map(|_| vec![0xa5u8; CHUNK].into_boxed_slice())
            .collect();
        Ok(WriteThrough {
            file,
            path: path.to_path_buf(),
            st: Mutex::new(State {
                queue: VecDeque::new(),
                free,
                queued_bytes: 0,
                writing: false,
                stop: false,
                error: None,
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock_or_recover()
    }

    /// Queues a copy of `data` for offset `off`, waiting for queue room.
    pub fn enqueue_write(&self, mut off: u64, mut data: &[u8]) {
        while !data.is_empty() {
            let mut st = self.lock();
            while st.free.is_empty() && st.error.is_none() && !st.stop {
                st = self.cv.wait_or_recover(st);
            }
            if st.error.is_some() || st.stop {
                return;
            }
            let mut buf = st.free.pop().expect("checked above");
            let n = data.len().min(CHUNK);
            buf[..n].copy_from_slice(&data[..n]);
            st.queue.push_back(Entry::Data { off, buf, len: n });
            st.queued_bytes += n as u64;
            self.cv.notify_all();
            off += n as u64;
            data = &data[n..];
        }
    }

    pub fn enqueue_zero(&self, off: u64, len: u64) {
        let mut st = self.lock();
        if st.error.is_none() && !st.stop {
            st.queue.push_back(Entry::Zero { off, len });
            self.cv.notify_all();
        }
    }

    /// The writer thread's body; returns once stopped and the queue is empty.
    pub fn writer_loop(&self) {
        loop {
            let mut st = self.lock();
            while st.queue.is_empty() && !st.stop {
                st = self.cv.wait_or_recover(st);
            }
            let Some(entry) = st.queue.pop_front() else {
                return;
            };
            st.writing = true;
            drop(st);
            let (res, buf) = match entry {
                Entry::Data { off, buf, len } => (
                    self.file.write_all_at(&buf[..len], off).map(|_| len as u64),
                    Some(buf),
                ),
                Entry::Zero { mut off, mut len } => {
                    let mut r = Ok(0);
                    while len > 0 && r.is_ok() {
                        let n = len.min(ZEROS.len() as u64);
                        r = self.file.write_all_at(&ZEROS[..n as usize], off).map(|_| 0);
                        off += n;
                        len -= n;
                    }
                    (r, None)
                }
            };
            let mut st = self.lock();
            st.writing = false;
            if let Some(b) = buf {
                st.free.push(b);
            }
            match res {
                Ok(n) => st.queued_bytes -= n,
                Err(e) => {
                    let msg = format!("write-through file {}: {e}", self.path.display());
                    tracing::error!("{msg}; the local copy is no longer kept");
                    st.error = Some(msg);
                    let dropped: Vec<Entry> = st.queue.drain(..).collect();
                    for e in dropped {
                        if let Entry::Data { buf, .. } = e {
                            st.free.push(buf);
                        }
                    }
                    st.queued_bytes = 0;
                }
            }
            self.cv.notify_all();
        }
    }

    /// Waits until everything queued is in the file.
    fn drain(&self) -> std::result::Result<(), String> {
        let mut st = self.lock();
        while (!st.queue.is_empty() || st.writing) && st.error.is_none() {
            st = self.cv.wait_or_recover(st);
        }
        st.error.clone().map_or(Ok(()), Err)
    }

    pub fn flush(&self) -> std::result::Result<(), String> {
        self.drain()?;
        self.file
            .sync_data()
            .map_err(|e| format!("syncing {}: {e}", self.path.display()))
    }

    /// Reads the local copy (after the queue drained), for a lost remote copy.
    pub fn read(&self, off: u64, buf: &mut [u8]) -> std::result::Result<(), String> {
        self.drain()?;
        self.file
            .read_exact_at(buf, off)
            .map_err(|e| format!("reading {} at {off}: {e}", self.path.display()))
    }

    pub fn stop(&self) {
        self.lock().stop = true;
        self.cv.notify_all();
    }

    /// Bytes waiting, and the error that stopped the local copy, if any.
    pub fn state(&self) -> (u64, Option<String>) {
        let st = self.lock();
        (st.queued_bytes, st.error.clone())
    }
}
