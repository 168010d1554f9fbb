//! What `pagerctl serve` puts between the FUSE front end and the device:
//! the hand-over gate, the write-back buffer (`--writeback-buffer`,
//! `pager_client::writeback`) and the request clock's Device and Done
//! marks, whose stages it counts in the device's status.
//!
//! The buffer sits here, above the device, rather than in it: it holds
//! the kernel's writes, whatever the mode does with them, so every mode
//! gets it with no change to the device's locks or ordering, and the
//! device stays what the nbd front end serves too. A write is
//! acknowledged once buffered, so only a device whose acknowledged writes
//! may die with the serving process has one: swap over fuse-uring or
//! fuse, where the kernel fails every request of a dead connection and the
//! process is the device anyway. A restartable device (`--held`) outlives
//! its serving process and the kernel resends only what was never
//! answered, and a block device's data must outlive a crash: both write
//! straight to the device (`pager_client::writeback` says what waiting
//! for a drainer cost them).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use netpager_util::trace::{self, Mark, Marks};
use pager_client::device::{Device, DeviceError};
use pager_client::stages::StageOp;
use pager_client::writeback::{WriteBack, WriteBackError, DRAINERS};
use pager_fuse::{Backend, IoKind};

/// Closed when the process hands over to the next one: a request that
/// reaches the device after that waits forever, unanswered, and the
/// kernel sends it again to the next process. Counts the requests inside.
#[derive(Default)]
pub struct Gate {
    closed: AtomicBool,
    inside: AtomicUsize,
}

pub struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    fn enter(&self) -> Inside<'_> {
        self.inside.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.inside.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        Inside(self)
    }

    /// Closes the gate and waits until no request is inside (at most
    /// `limit`); whether none is.
    pub fn close_and_drain(&self, limit: Duration) -> bool {
        self.closed.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while self.inside.load(Ordering::SeqCst) > 0 {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// The device's write-back buffer.
pub struct Buffer {
    pub wb: WriteBack<Arc<Device>>,
}

impl Buffer {
    /// A buffer of `bytes` in front of `device` (counted in its status),
    /// with its drainer threads started.
    pub fn start(device: &Arc<Device>, bytes: u64) -> std::io::Result<Arc<Buffer>> {
        let counters = device.stats().writeback.clone();
        let b = Arc::new(Buffer {
            wb: WriteBack::new(device.clone(), bytes, Some(counters)),
        });
        for i in 0..DRAINERS {
            let b = b.clone();
            std::thread::Builder::new()
                .name(format!("writeback-{i}"))
                .stack_size(256 << 10)
                .spawn(move || b.wb.drain_loop())?;
        }
        Ok(b)
    }

    /// Sends every buffered page to the device and stops the drainers:
    /// before the device is flushed at a detach or a hand-over.
    pub fn drain(&self) -> Result<(), WriteBackError> {
        let r = self.wb.flush();
        self.wb.stop();
        r
    }
}

/// The device as the FUSE front end sees it.
pub struct DeviceBackend {
    pub device: Arc<Device>,
    pub gate: Arc<Gate>,
    pub buffer: Option<Arc<Buffer>>,
}

impl Backend for DeviceBackend {
    fn size(&self) -> u64 {
        self.device.size()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        match &self.buffer {
            Some(b) => timed_wb(|| b.wb.read(buf, offset), "read", offset),
            None => timed(|| self.device.read(buf, offset), "read", offset),
        }
    }
    fn write(&self, data: &[u8], offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        match &self.buffer {
            Some(b) => timed_wb(|| b.wb.write(data, offset), "write", offset),
            None => timed(|| self.device.write(data, offset), "write", offset),
        }
    }
    fn zero(&self, len: u64, offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        self.settle(len, offset, "zero")?;
        timed(|| self.device.zero(len, offset), "zero", offset)
    }
    fn trim(&self, len: u64, offset: u64) -> Result<(), i32> {
        let _in = self.gate.enter();
        self.settle(len, offset, "trim")?;
        timed(|| self.device.trim(len, offset), "trim", offset)
    }
    fn flush(&self) -> Result<(), i32> {
        let _in = self.gate.enter();
        if let Some(b) = &self.buffer {
            timed_wb(|| b.wb.flush(), "flush", 0)?;
        }
        timed(|| self.device.flush(), "flush", 0)
    }
    fn traced(&self, kind: IoKind, marks: &Marks) {
        let op = match kind {
            IoKind::Read => StageOp::Read,
            IoKind::Write => StageOp::Write,
            IoKind::Other => StageOp::Other,
        };
        self.device.stats().stages.record(op, marks);
    }
}

impl DeviceBackend {
    /// A trim or zero waits until no buffered page of its range is left.
    fn settle(&self, len: u64, offset: u64, what: &str) -> Result<(), i32> {
        match &self.buffer {
            Some(b) => {
                b.wb.settle(offset, len)
                    .map_err(|e| wb_errno(what, offset, e))
            }
            None => Ok(()),
        }
    }
}

/// Runs one device call between the request clock's Device and Done
/// marks (`netpager_util::trace`).
fn timed(f: impl FnOnce() -> Result<(), DeviceError>, what: &str, offset: u64) -> Result<(), i32> {
    trace::mark(Mark::Device);
    let r = f();
    trace::mark(Mark::Done);
    r.map_err(|e| {
        tracing::error!("{what} at offset {offset}: {e}");
        e.errno()
    })
}

/// [`timed`] for a call through the write-back buffer.
fn timed_wb(
    f: impl FnOnce() -> Result<(), WriteBackError>,
    what: &str,
    offset: u64,
) -> Result<(), i32> {
    trace::mark(Mark::Device);
    let r = f();
    trace::mark(Mark::Done);
    r.map_err(|e| wb_errno(what, offset, e))
}

/// The kernel sees only an errno: the reason goes to the log.
fn wb_errno(what: &str, offset: u64, e: WriteBackError) -> i32 {
    tracing::error!("{what} at offset {offset}: {e}");
    e.errno()
}
