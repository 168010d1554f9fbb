//! netpager's in-process front end: the client process serves its device
//! to the kernel itself, as one file on a FUSE mount, with no other process
//! between the kernel and the donors. A loop device with direct I/O on
//! that file is then a block device for swap or a file system.
//!
//! The FUSE protocol is spoken raw ([`abi`]), since neither Debian 12's
//! libfuse nor the `fuser` crate has FUSE over io_uring. Two transports
//! carry it: io_uring ([`uring`], Linux 6.14+ with
//! `/sys/module/fuse/parameters/enable_uring` on) and classic `/dev/fuse`
//! reads and writes ([`classic`]), one cloned fd per thread. Both answer
//! through one [`session::Session`], which calls the [`Backend`]
//! ([`memory::Memory`] is one over plain memory, for the floor and tests).

pub mod abi;
pub mod classic;
pub mod fdstore;
pub mod handover;
pub mod memory;
pub mod session;
#[allow(unsafe_code)]
mod sys;
pub mod uring;

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use netpager_util::trace::Marks;
pub use session::Session;
pub use sys::{set_io_flusher, unmount};

/// The bytes a mount serves. Errors are errnos (positive).
pub trait Backend: Send + Sync + 'static {
    fn size(&self) -> u64;
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32>;
    fn write(&self, data: &[u8], offset: u64) -> Result<(), i32>;
    fn zero(&self, len: u64, offset: u64) -> Result<(), i32>;
    fn trim(&self, len: u64, offset: u64) -> Result<(), i32>;
    fn flush(&self) -> Result<(), i32>;
    /// A request of `kind` was answered: `marks` are its clock's
    /// (`netpager_util::trace`), from being taken from the kernel to its
    /// reply committed. Called on the thread that served it.
    fn traced(&self, _kind: IoKind, _marks: &Marks) {}
}

/// The kinds of request a backend's clock tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
    /// Flush, zero or trim.
    Other,
}

#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("FUSE message too short for {what}: {got} bytes, need {need}")]
    Short {
        what: &'static str,
        got: usize,
        need: usize,
    },
    #[error(
        "the kernel speaks FUSE {major}.{minor}; this server needs 7.{} or newer",
        abi::OLDEST_MINOR
    )]
    Version { major: u32, minor: u32 },
    #[error("expected INIT as the kernel's first request, got opcode {0}")]
    NoInit(u32),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> FuseError {
    let what = what.into();
    move |source| FuseError::Io { what, source }
}

/// How requests travel between the kernel and this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// FUSE over io_uring.
    Uring,
    /// read(2) and write(2) on `/dev/fuse`.
    Classic,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Uring => "fuse-uring",
            Transport::Classic => "fuse",
        })
    }
}

/// Where the kernel's switch for FUSE over io_uring lives.
pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// How a mount is served.
#[derive(Debug, Clone)]
pub struct Options {
    /// The one file in the mount's root.
    pub file_name: String,
    /// The transport wanted; io_uring falls back to classic when the
    /// kernel does not offer it.
    pub transport: Transport,
    /// Classic: reader threads. io_uring: serving threads per queue (one
    /// queue per possible CPU), each holding a ring entry: the requests a
    /// queue answers at once.
    pub threads: usize,
    /// io_uring: ring entries per serving thread.
    pub ring_depth: usize,
    /// Largest request, in 4 KiB pages (the kernel caps it at 256).
    pub max_pages: u16,
    /// Asynchronous requests the kernel keeps in flight (direct I/O from
    /// the loop device is asynchronous).
    pub max_background: u16,
    /// Owner of the file.
    pub uid: u32,
    pub gid: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            file_name: "device".into(),
            transport: Transport::Uring,
            threads: 16,
            ring_depth: 1,
            max_pages: 256,
            max_background: 128,
            uid: 0,
            gid: 0,
        }
    }
}

impl Options {
    fn max_write(&self) -> u32 {
        self.max_pages as u32 * 4096
    }
}

/// The INIT reply to `init` under `opts`, and whether it switches
/// io_uring on.
pub fn init_reply(init: &abi::InitIn, opts: &Options) -> Result<(abi::InitOut, bool), FuseError> {
    use abi::init as f;
    if init.major != abi::KERNEL_VERSION || init.minor < abi::OLDEST_MINOR {
        return Err(FuseError::Version {
            major: init.major,
            minor: init.minor,
        });
    }
    let mut want = f::ASYNC_READ | f::ASYNC_DIO | f::BIG_WRITES | f::MAX_PAGES | f::INIT_EXT;
    if opts.transport == Transport::Uring {
        want |= f::OVER_IO_URING;
    }
    let flags = want & init.flags;
    let out = abi::InitOut {
        minor: init.minor.min(abi::KERNEL_MINOR),
        max_readahead: init.max_readahead,
        flags,
        max_background: opts.max_background,
        congestion_threshold: opts.max_background / 4 * 3,
        max_write: opts.max_write(),
        max_pages: opts.max_pages,
    };
    Ok((out, flags & f::OVER_IO_URING != 0))
}

/// The CPUs the kernel may ever run on ("0-1,4"): FUSE over io_uring has
/// one queue for each, and every one must have an entry.
pub fn possible_cpus(list: &str) -> Option<usize> {
    let mut max = None;
    for part in list.trim().split(',') {
        let last = part.rsplit('-').next()?.trim().parse::<usize>().ok()?;
        max = max.max(Some(last));
    }
    max.map(|m| m + 1)
}

/// A mounted, served file system.
pub struct Mount {
    threads: Vec<JoinHandle<std::io::Result<()>>>,
    transport: Transport,
    /// Why io_uring was not used although wanted.
    fallback: Option<String>,
    mountpoint: PathBuf,
    ring_answers: Arc<AtomicU64>,
    resent: Arc<AtomicU64>,
}

fn mount_options(opts: &Options) -> String {
    format!(
        "rootmode=40000,user_id={},group_id={},allow_other,default_permissions",
        opts.uid, opts.gid
    )
}

/// Opens a new connection and mounts it on `mountpoint` (a directory),
/// serving nothing: for a holder that keeps the connection while serving
/// processes come and go ([`Mount::serve_held`]). Root only.
pub fn mount_connection(mountpoint: &Path, opts: &Options) -> Result<File, FuseError> {
    let fd = sys::open_fuse().map_err(io_err("cannot open /dev/fuse"))?;
    sys::mount(&fd, mountpoint, "fuse.netpager", &mount_options(opts)).map_err(io_err(format!(
        "cannot mount FUSE on {}",
        mountpoint.display()
    )))?;
    Ok(fd)
}

impl Mount {
    /// Mounts `backend` as one file in `mountpoint` (a directory) and
    /// starts serving it. Root only.
    pub fn start<B: Backend>(
        backend: B,
        mountpoint: &Path,
        opts: &Options,
    ) -> Result<Mount, FuseError> {
        let fd = mount_connection(mountpoint, opts)?;
        match Self::serve(backend, fd, mountpoint, opts) {
            Ok(m) => Ok(m),
            Err(e) => {
                let _ = sys::unmount(mountpoint, true);
                Err(e)
            }
        }
    }

    fn serve<B: Backend>(
        backend: B,
        fd: File,
        mountpoint: &Path,
        opts: &Options,
    ) -> Result<Mount, FuseError> {
        let uring = negotiate(&fd, opts)?;
        let fd = Arc::new(fd);
        let session = Arc::new(Session::new(backend, &opts.file_name, opts.uid, opts.gid));
        let resent = session.resent_counter();
        let classic_buf = opts.max_write() as usize + 4096;
        let mut threads = Vec::new();
        let mut fallback = None;
        let ring_answers = Arc::new(AtomicU64::new(0));
        if opts.transport == Transport::Uring && !uring {
            fallback = Some(format!(
                "the kernel did not offer FUSE over io_uring ({ENABLE_URING} is not Y, or the kernel is older than 6.14)"
            ));
        }
        if uring {
            match start_rings(&fd, &session, opts, &ring_answers, &mut threads) {
                Ok(()) => {}
                Err(e) => fallback = Some(format!("registering io_uring queues failed: {e}")),
            }
        }
        // INIT, FORGET and INTERRUPT always come through /dev/fuse, and so
        // does everything until every queue has an entry.
        let readers = if uring && fallback.is_none() {
            1
        } else {
            opts.threads.max(1)
        };
        for i in 0..readers {
            let reader = if i == 0 {
                fd.try_clone()
            } else {
                sys::clone_fuse(&fd)
            }
            .map_err(io_err("cannot clone the /dev/fuse fd"))?;
            let s = session.clone();
            threads.push(spawn(format!("fuse-read-{i}"), move || {
                classic::serve(&s, &reader, classic_buf)
            })?);
        }
        let transport = if uring && fallback.is_none() {
            Transport::Uring
        } else {
            Transport::Classic
        };
        Ok(Mount {
            threads,
            transport,
            fallback,
            mountpoint: mountpoint.to_path_buf(),
            ring_answers,
            resent,
        })
    }

    /// Serves a connection that a holder keeps open too, so that it
    /// outlives this process. Classic `/dev/fuse` only, every thread on
    /// `fd`'s own open file: a request read there and left unanswered by a
    /// server that died stays on that file's processing queue, which
    /// FUSE_NOTIFY_RESEND puts back (one read on a clone would be failed
    /// when the dead server's clone closed, and one in an io_uring entry
    /// is never resent: pagerctl(1) RESTARTS). `fresh`: no server has
    /// answered the kernel's INIT yet; otherwise one served before, and the
    /// kernel is asked to resend what it left unanswered.
    pub fn serve_held<B: Backend>(
        backend: B,
        fd: File,
        mountpoint: &Path,
        opts: &Options,
        fresh: bool,
    ) -> Result<Mount, FuseError> {
        let opts = Options {
            transport: Transport::Classic,
            ..opts.clone()
        };
        if fresh {
            negotiate(&fd, &opts)?;
        }
        let session = Arc::new(Session::new(backend, &opts.file_name, opts.uid, opts.gid));
        let resent = session.resent_counter();
        let buf = opts.max_write() as usize + 4096;
        let mut threads = Vec::new();
        for i in 0..opts.threads.max(1) {
            // A dup, not a clone: the same open file as the holder's.
            let reader = fd
                .try_clone()
                .map_err(io_err("cannot dup the /dev/fuse fd"))?;
            let s = session.clone();
            threads.push(spawn(format!("fuse-read-{i}"), move || {
                classic::serve(&s, &reader, buf)
            })?);
        }
        if !fresh {
            (&fd)
                .write_all(&abi::notify_resend())
                .map_err(|e| FuseError::Io {
                    what: "sending FUSE_NOTIFY_RESEND (Linux 6.9 or newer)".into(),
                    source: e,
                })?;
        }
        Ok(Mount {
            threads,
            transport: Transport::Classic,
            fallback: None,
            mountpoint: mountpoint.to_path_buf(),
            ring_answers: Arc::new(AtomicU64::new(0)),
            resent,
        })
    }

    /// Requests answered so far that the kernel had sent before, to a
    /// server that died with them unanswered.
    pub fn resent(&self) -> u64 {
        self.resent.load(Ordering::Relaxed)
    }

    /// [`Mount::resent`] for another thread, after [`Mount::wait`] took
    /// the mount.
    pub fn resent_counter(&self) -> Arc<AtomicU64> {
        self.resent.clone()
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Why io_uring was wanted but not used.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Requests answered through io_uring so far.
    pub fn ring_answers(&self) -> u64 {
        self.ring_answers.load(Ordering::Relaxed)
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Waits until the file system is unmounted and every thread is done;
    /// the first thread's error, if any.
    pub fn wait(self) -> std::io::Result<()> {
        let mut first = Ok(());
        for t in self.threads {
            let r = t
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a serving thread panicked")));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// Stack of a serving thread: a request's path through the device keeps
/// its bookkeeping on the stack but needs far less than Rust's default 2
/// MiB, which a locked process (mlockall) would hold for each of its many
/// serving threads.
const SERVE_STACK: usize = 512 << 10;

fn spawn(
    name: String,
    f: impl FnOnce() -> std::io::Result<()> + Send + 'static,
) -> Result<JoinHandle<std::io::Result<()>>, FuseError> {
    std::thread::Builder::new()
        .name(name.clone())
        .stack_size(SERVE_STACK)
        .spawn(f)
        .map_err(io_err(format!("cannot start thread {name}")))
}

/// Reads INIT and answers it; whether io_uring is on.
fn negotiate(mut fd: &File, opts: &Options) -> Result<bool, FuseError> {
    let mut buf = vec![0u8; opts.max_write() as usize + 4096];
    let n = fd
        .read(&mut buf)
        .map_err(io_err("reading INIT from /dev/fuse"))?;
    let h = abi::InHeader::parse(&buf[..n])?;
    if h.opcode != abi::op::INIT {
        return Err(FuseError::NoInit(h.opcode));
    }
    let init = abi::InitIn::parse(&buf[abi::IN_HEADER_LEN..n])?;
    let (out, uring) = init_reply(&init, opts)?;
    let mut reply = [0u8; abi::OUT_HEADER_LEN + abi::INIT_OUT_LEN];
    let len = abi::OUT_HEADER_LEN + out.encode(&mut reply[abi::OUT_HEADER_LEN..]);
    abi::encode_out_header(&mut reply, len as u32, 0, h.unique);
    // Queues register only once this write has returned (the kernel
    // answers REGISTER with EAGAIN before).
    fd.write_all(&reply[..len])
        .map_err(io_err("answering INIT"))?;
    Ok(uring)
}

/// Starts `opts.threads` serving threads per possible CPU, each with its
/// ring registered on that CPU's queue. Fails if any queue cannot register.
///
/// The threads are pinned to their queue's CPU, where the kernel queued
/// the request (the issuing CPU's queue): a request then wakes a thread on
/// the CPU that is already running its caller's side, not one asleep on
/// another CPU. Measured on 2 CPUs (mode none, one donor on loopback,
/// alternating): QD1 4 KiB reads 63-78 us pinned against 82-84 us
/// unpinned, writes 65-72 against 83-90 us; at QD16 unpinned threads did
/// 5-15% more IOPS,
/// because under a loop device one queue carries a whole device's depth
/// and pinned threads answer it on one CPU. A swap-in waits on QD1.
fn start_rings<B: Backend>(
    fd: &Arc<File>,
    session: &Arc<Session<B>>,
    opts: &Options,
    answered: &Arc<AtomicU64>,
    threads: &mut Vec<JoinHandle<std::io::Result<()>>>,
) -> Result<(), FuseError> {
    let cpus = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|l| possible_cpus(&l))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let payload = (opts.max_write() as usize).max(abi::ring::MIN_PAYLOAD);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut started = 0;
    for cpu in 0..cpus {
        for t in 0..opts.threads.max(1) {
            let (fd, s, tx, n) = (fd.clone(), session.clone(), tx.clone(), answered.clone());
            let depth = opts.ring_depth.max(1);
            threads.push(spawn(format!("fuse-ring-{cpu}.{t}"), move || {
                if let Err(e) = sys::pin_to_cpu(cpu) {
                    tracing::warn!("cannot pin ring thread to CPU {cpu}: {e}");
                }
                match uring::Queue::register(&fd, cpu as u16, depth, payload) {
                    Ok((q, refused)) => {
                        let _ =
                            tx.send(refused.map_or(Ok(()), |e| Err(format!("queue {cpu}: {e}"))));
                        q.serve(&s, &n)
                    }
                    Err(e) => {
                        let _ = tx.send(Err(format!("queue {cpu}: {e}")));
                        Ok(())
                    }
                }
            })?);
            started += 1;
        }
    }
    let mut first = Ok(());
    for _ in 0..started {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) if first.is_ok() => first = Err(e),
            Ok(Err(_)) => {}
            Err(_) => break,
        }
    }
    first.map_err(|e| FuseError::Io {
        what: "FUSE over io_uring".into(),
        source: std::io::Error::other(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn init_in(flags: u64, minor: u32) -> abi::InitIn {
        abi::InitIn {
            major: 7,
            minor,
            max_readahead: 1 << 17,
            flags,
        }
    }

    #[test]
    fn init_takes_only_what_the_kernel_offers() {
        use abi::init as f;
        let all =
            f::ASYNC_READ | f::ASYNC_DIO | f::MAX_PAGES | f::INIT_EXT | f::OVER_IO_URING | (1 << 3);
        let (out, uring) = init_reply(&init_in(all, 45), &Options::default()).unwrap();
        assert!(uring);
        assert_eq!(out.flags & (1 << 3), 0);
        assert_eq!(out.max_write, 1 << 20);
        assert_eq!(out.minor, 45);
        let (out, uring) =
            init_reply(&init_in(all & !f::OVER_IO_URING, 50), &Options::default()).unwrap();
        assert!(!uring);
        assert_eq!(out.minor, abi::KERNEL_MINOR);
        let classic = Options {
            transport: Transport::Classic,
            ..Options::default()
        };
        assert!(!init_reply(&init_in(all, 45), &classic).unwrap().1);
    }

    #[test]
    fn init_refuses_old_kernels() {
        assert!(matches!(
            init_reply(&init_in(0, 12), &Options::default()),
            Err(FuseError::Version {
                major: 7,
                minor: 12
            })
        ));
        let mut i = init_in(0, 45);
        i.major = 8;
        assert!(init_reply(&i, &Options::default()).is_err());
    }

    #[test]
    fn possible_cpu_lists() {
        assert_eq!(possible_cpus("0-1\n"), Some(2));
        assert_eq!(possible_cpus("0"), Some(1));
        assert_eq!(possible_cpus("0-3,8-9"), Some(10));
        assert_eq!(possible_cpus("x"), None);
    }
}
