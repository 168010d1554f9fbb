//! What each request means for a file system of one file: a root directory
//! holding the device file, whose bytes are the [`Backend`]'s. Pure
//! dispatch, shared by both transports: a request comes in as its header,
//! its per-opcode header and its payload; the reply is written into the
//! payload buffer. Nothing here allocates.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::abi::{self, op, Attr, InHeader};
use crate::{Backend, IoKind};
use netpager_util::trace;

/// Node ids: FUSE's root is always 1.
pub const ROOT: u64 = 1;
pub const FILE: u64 = 2;

/// How long the kernel may cache names and attributes: they never change
/// while mounted.
const VALID_SECS: u64 = 3600;

/// What to send back for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Success, with this many bytes of reply at the start of the payload
    /// buffer.
    Reply(usize),
    /// Failure with this errno (positive).
    Error(i32),
    /// The request takes no reply (FORGET, INTERRUPT).
    NoReply,
}

/// The volume a mount serves.
pub struct Session<B> {
    backend: B,
    file_name: Vec<u8>,
    size: u64,
    uid: u32,
    gid: u32,
    mounted_at: u64,
    destroyed: AtomicBool,
    /// Requests the kernel sent again after FUSE_NOTIFY_RESEND (a server
    /// before this one had read them and died).
    resent: Arc<AtomicU64>,
}

impl<B: Backend> Session<B> {
    pub fn new(backend: B, file_name: &str, uid: u32, gid: u32) -> Session<B> {
        let size = backend.size();
        let mounted_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Session {
            backend,
            file_name: file_name.as_bytes().to_vec(),
            size,
            uid,
            gid,
            mounted_at,
            destroyed: AtomicBool::new(false),
            resent: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Counts the requests that came again after FUSE_NOTIFY_RESEND.
    pub fn resent_counter(&self) -> Arc<AtomicU64> {
        self.resent.clone()
    }

    /// Whether the kernel said DESTROY (the mount is going away).
    pub fn destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Relaxed)
    }

    fn attr(&self, node: u64) -> Option<Attr> {
        let (mode, nlink, size) = match node {
            ROOT => (libc::S_IFDIR | 0o755, 2, 0),
            FILE => (libc::S_IFREG | 0o600, 1, self.size),
            _ => return None,
        };
        Some(Attr {
            ino: node,
            size,
            mode,
            nlink,
            uid: self.uid,
            gid: self.gid,
            time: self.mounted_at,
        })
    }

    /// Hands the clock of a request answered on this thread (started by
    /// the transport when it took the request, `netpager_util::trace`) to
    /// the backend, for the requests that reach it.
    pub fn traced(&self, opcode: u32) {
        let Some(marks) = trace::finish() else { return };
        let kind = match opcode {
            op::READ => IoKind::Read,
            op::WRITE => IoKind::Write,
            op::FSYNC | op::FALLOCATE => IoKind::Other,
            _ => return,
        };
        self.backend.traced(kind, &marks);
    }

    /// Answers one request. `op_in` is its per-opcode header; the first
    /// `payload_in` bytes of `payload` are its payload (write data, a name),
    /// and the reply goes into `payload` from its start.
    pub fn handle(
        &self,
        h: &InHeader,
        op_in: &[u8],
        payload: &mut [u8],
        payload_in: usize,
    ) -> Outcome {
        if h.unique & abi::UNIQUE_RESEND != 0 {
            self.resent.fetch_add(1, Ordering::Relaxed);
        }
        match self.dispatch(h, op_in, payload, payload_in) {
            Ok(o) => o,
            Err(errno) => Outcome::Error(errno),
        }
    }

    fn dispatch(
        &self,
        h: &InHeader,
        op_in: &[u8],
        payload: &mut [u8],
        payload_in: usize,
    ) -> Result<Outcome, i32> {
        let bad = |_| libc::EINVAL;
        Ok(match h.opcode {
            op::READ => {
                let r = abi::IoIn::parse(op_in).map_err(bad)?;
                let n = self.io_len(r.offset, r.size as u64).min(payload.len());
                if n > 0 {
                    self.backend.read(&mut payload[..n], r.offset)?;
                }
                Outcome::Reply(n)
            }
            op::WRITE => {
                let w = abi::IoIn::parse(op_in).map_err(bad)?;
                let n = (w.size as usize).min(payload_in);
                if w.offset.checked_add(n as u64).is_none_or(|e| e > self.size) {
                    return Err(libc::ENOSPC);
                }
                self.backend.write(&payload[..n], w.offset)?;
                Outcome::Reply(abi::encode_write_out(payload, n as u32))
            }
            op::FALLOCATE => {
                let f = abi::FallocateIn::parse(op_in).map_err(bad)?;
                self.fallocate(f)?;
                Outcome::Reply(0)
            }
            op::FSYNC | op::FSYNCDIR => {
                self.backend.flush()?;
                Outcome::Reply(0)
            }
            op::FLUSH | op::RELEASE | op::RELEASEDIR | op::ACCESS => Outcome::Reply(0),
            op::LOOKUP => {
                let name = abi::lookup_name(&payload[..payload_in]);
                if h.nodeid != ROOT || name != self.file_name.as_slice() {
                    return Err(libc::ENOENT);
                }
                let attr = self.attr(FILE).expect("file node");
                Outcome::Reply(abi::encode_entry_out(payload, &attr, VALID_SECS))
            }
            op::GETATTR => {
                let attr = self.attr(h.nodeid).ok_or(libc::ENOENT)?;
                Outcome::Reply(abi::encode_attr_out(payload, &attr, VALID_SECS))
            }
            op::SETATTR => {
                let attr = self.attr(h.nodeid).ok_or(libc::ENOENT)?;
                let (valid, size) = abi::parse_setattr(op_in).map_err(bad)?;
                // The device's size is fixed; times and modes are not kept.
                if valid & abi::FATTR_SIZE != 0 && size != attr.size {
                    return Err(libc::EPERM);
                }
                Outcome::Reply(abi::encode_attr_out(payload, &attr, VALID_SECS))
            }
            op::OPEN => {
                if h.nodeid != FILE {
                    return Err(libc::EISDIR);
                }
                // Direct I/O: the loop device's pages are the kernel's own
                // (swap), never cached twice; parallel writes: the backend
                // locks per extent, not per file.
                let flags = abi::FOPEN_DIRECT_IO | abi::FOPEN_PARALLEL_DIRECT_WRITES;
                Outcome::Reply(abi::encode_open_out(payload, 0, flags))
            }
            op::OPENDIR => {
                if h.nodeid != ROOT {
                    return Err(libc::ENOTDIR);
                }
                Outcome::Reply(abi::encode_open_out(payload, 0, 0))
            }
            op::READDIR => {
                let r = abi::IoIn::parse(op_in).map_err(bad)?;
                Outcome::Reply(self.readdir(r.offset, r.size as usize, payload))
            }
            op::STATFS => {
                Outcome::Reply(abi::encode_statfs_out(payload, self.size.div_ceil(4096), 2))
            }
            op::DESTROY => {
                self.destroyed.store(true, Ordering::Relaxed);
                Outcome::Reply(0)
            }
            op::FORGET | op::BATCH_FORGET | op::INTERRUPT => Outcome::NoReply,
            _ => return Err(libc::ENOSYS),
        })
    }

    /// Bytes of a request at `offset` that lie within the file.
    fn io_len(&self, offset: u64, len: u64) -> usize {
        self.size.saturating_sub(offset).min(len) as usize
    }

    /// Punching a hole is a trim; zeroing a range writes zeros; a plain
    /// allocation has nothing to do (every byte of the device exists).
    fn fallocate(&self, f: abi::FallocateIn) -> Result<(), i32> {
        let end = f.offset.checked_add(f.length).ok_or(libc::EINVAL)?;
        if end > self.size {
            return Err(if f.mode & abi::FALLOC_FL_KEEP_SIZE != 0 {
                libc::EINVAL
            } else {
                libc::EFBIG
            });
        }
        let mode = f.mode & !abi::FALLOC_FL_KEEP_SIZE;
        if mode == abi::FALLOC_FL_PUNCH_HOLE {
            self.backend.trim(f.length, f.offset)
        } else if mode == abi::FALLOC_FL_ZERO_RANGE {
            self.backend.zero(f.length, f.offset)
        } else if mode == 0 {
            Ok(())
        } else {
            Err(libc::EOPNOTSUPP)
        }
    }

    /// `.`, `..` and the file, from entry `offset` on.
    fn readdir(&self, offset: u64, size: usize, out: &mut [u8]) -> usize {
        let size = size.min(out.len());
        let out = &mut out[..size];
        let entries: [(u64, u32, &[u8]); 3] = [
            (ROOT, libc::DT_DIR as u32, b"."),
            (ROOT, libc::DT_DIR as u32, b".."),
            (FILE, libc::DT_REG as u32, &self.file_name),
        ];
        let mut end = 0;
        for (i, (ino, dtype, name)) in entries.iter().enumerate().skip(offset as usize) {
            match abi::encode_dirent(out, end, *ino, i as u64 + 1, *dtype, name) {
                Some(e) => end = e,
                None => break,
            }
        }
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Memory;
    use std::sync::Mutex;

    /// Memory that records the trims and zeroes it is asked for, and
    /// fails every flush.
    struct Recorded {
        memory: Memory,
        log: Mutex<Vec<String>>,
    }

    impl Recorded {
        fn note(&self, what: &str, len: u64, offset: u64) {
            self.log
                .lock()
                .unwrap()
                .push(format!("{what} {offset}+{len}"));
        }
    }

    impl Backend for Recorded {
        fn size(&self) -> u64 {
            self.memory.size()
        }
        fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
            self.memory.read(buf, offset)
        }
        fn write(&self, data: &[u8], offset: u64) -> Result<(), i32> {
            self.memory.write(data, offset)
        }
        fn zero(&self, len: u64, offset: u64) -> Result<(), i32> {
            self.note("zero", len, offset);
            self.memory.zero(len, offset)
        }
        fn trim(&self, len: u64, offset: u64) -> Result<(), i32> {
            self.note("trim", len, offset);
            self.memory.trim(len, offset)
        }
        fn flush(&self) -> Result<(), i32> {
            Err(libc::EIO)
        }
    }

    fn session(size: usize) -> Session<Recorded> {
        Session::new(
            Recorded {
                memory: Memory::new(size, 0),
                log: Mutex::new(Vec::new()),
            },
            "device",
            0,
            0,
        )
    }

    fn hdr(opcode: u32, nodeid: u64) -> InHeader {
        InHeader {
            opcode,
            nodeid,
            unique: 9,
            ..InHeader::default()
        }
    }

    fn io_in(offset: u64, size: u32) -> [u8; 40] {
        let mut b = [0u8; 40];
        abi::put_u64(&mut b, 8, offset);
        abi::put_u32(&mut b, 16, size);
        b
    }

    #[test]
    fn write_then_read_back() {
        let s = session(1 << 16);
        let mut buf = vec![0u8; 8192];
        buf[..4096].fill(0x5a);
        let w = s.handle(&hdr(op::WRITE, FILE), &io_in(4096, 4096), &mut buf, 4096);
        assert_eq!(w, Outcome::Reply(8));
        assert_eq!(abi::u32_at(&buf, 0), 4096);
        let r = s.handle(&hdr(op::READ, FILE), &io_in(4000, 200), &mut buf, 0);
        assert_eq!(r, Outcome::Reply(200));
        assert!(buf[..96].iter().all(|&c| c == 0));
        assert!(buf[96..200].iter().all(|&c| c == 0x5a));
    }

    #[test]
    fn reads_stop_at_the_end_and_writes_past_it_fail() {
        let s = session(8192);
        let mut buf = vec![0u8; 8192];
        let r = s.handle(&hdr(op::READ, FILE), &io_in(6144, 4096), &mut buf, 0);
        assert_eq!(r, Outcome::Reply(2048));
        let r = s.handle(&hdr(op::READ, FILE), &io_in(9000, 4096), &mut buf, 0);
        assert_eq!(r, Outcome::Reply(0));
        let w = s.handle(&hdr(op::WRITE, FILE), &io_in(6144, 4096), &mut buf, 4096);
        assert_eq!(w, Outcome::Error(libc::ENOSPC));
    }

    #[test]
    fn fallocate_punch_is_trim_and_zero_range_is_zero() {
        let s = session(1 << 20);
        let mut f = [0u8; 32];
        abi::put_u64(&mut f, 8, 4096);
        abi::put_u64(&mut f, 16, 8192);
        let mut buf = [0u8; 64];
        for mode in [
            abi::FALLOC_FL_PUNCH_HOLE | abi::FALLOC_FL_KEEP_SIZE,
            abi::FALLOC_FL_ZERO_RANGE | abi::FALLOC_FL_KEEP_SIZE,
            0,
        ] {
            abi::put_u32(&mut f, 24, mode);
            assert_eq!(
                s.handle(&hdr(op::FALLOCATE, FILE), &f, &mut buf, 0),
                Outcome::Reply(0)
            );
        }
        abi::put_u32(&mut f, 24, 0x08);
        assert_eq!(
            s.handle(&hdr(op::FALLOCATE, FILE), &f, &mut buf, 0),
            Outcome::Error(libc::EOPNOTSUPP)
        );
        abi::put_u64(&mut f, 8, 1 << 20);
        abi::put_u32(
            &mut f,
            24,
            abi::FALLOC_FL_PUNCH_HOLE | abi::FALLOC_FL_KEEP_SIZE,
        );
        assert_eq!(
            s.handle(&hdr(op::FALLOCATE, FILE), &f, &mut buf, 0),
            Outcome::Error(libc::EINVAL)
        );
        assert_eq!(
            *s.backend().log.lock().unwrap(),
            ["trim 4096+8192", "zero 4096+8192"]
        );
    }

    #[test]
    fn lookup_finds_only_the_file() {
        let s = session(4096);
        let mut buf = vec![0u8; 256];
        buf[..7].copy_from_slice(b"device\0");
        let r = s.handle(&hdr(op::LOOKUP, ROOT), &[], &mut buf, 7);
        assert_eq!(r, Outcome::Reply(abi::ENTRY_OUT_LEN));
        assert_eq!(abi::u64_at(&buf, 0), FILE);
        assert_eq!(abi::u64_at(&buf, 40 + 8), 4096);
        buf[..6].copy_from_slice(b"other\0");
        let r = s.handle(&hdr(op::LOOKUP, ROOT), &[], &mut buf, 6);
        assert_eq!(r, Outcome::Error(libc::ENOENT));
    }

    #[test]
    fn attributes_open_and_directory() {
        let s = session(4096);
        let mut buf = vec![0u8; 256];
        let r = s.handle(&hdr(op::GETATTR, ROOT), &[0; 16], &mut buf, 0);
        assert_eq!(r, Outcome::Reply(abi::ATTR_OUT_LEN));
        assert_eq!(abi::u32_at(&buf, 16 + 60) & libc::S_IFMT, libc::S_IFDIR);
        assert_eq!(
            s.handle(&hdr(op::GETATTR, 7), &[0; 16], &mut buf, 0),
            Outcome::Error(libc::ENOENT)
        );
        let r = s.handle(&hdr(op::OPEN, FILE), &[0; 8], &mut buf, 0);
        assert_eq!(r, Outcome::Reply(16));
        assert_eq!(
            abi::u32_at(&buf, 8),
            abi::FOPEN_DIRECT_IO | abi::FOPEN_PARALLEL_DIRECT_WRITES
        );
        assert_eq!(
            s.handle(&hdr(op::OPEN, ROOT), &[0; 8], &mut buf, 0),
            Outcome::Error(libc::EISDIR)
        );
        let r = s.handle(&hdr(op::READDIR, ROOT), &io_in(0, 4096), &mut buf, 0);
        assert_eq!(r, Outcome::Reply(32 + 32 + 32));
        let r = s.handle(&hdr(op::READDIR, ROOT), &io_in(3, 4096), &mut buf, 0);
        assert_eq!(r, Outcome::Reply(0));
        let mut setattr = [0u8; 88];
        abi::put_u32(&mut setattr, 0, abi::FATTR_SIZE);
        abi::put_u64(&mut setattr, 16, 1);
        assert_eq!(
            s.handle(&hdr(op::SETATTR, FILE), &setattr, &mut buf, 0),
            Outcome::Error(libc::EPERM)
        );
    }

    #[test]
    fn backend_errors_and_no_reply_requests() {
        let s = session(4096);
        let mut buf = vec![0u8; 64];
        assert_eq!(
            s.handle(&hdr(op::FSYNC, FILE), &[0; 16], &mut buf, 0),
            Outcome::Error(libc::EIO)
        );
        assert_eq!(
            s.handle(&hdr(op::FORGET, FILE), &[0; 8], &mut buf, 0),
            Outcome::NoReply
        );
        assert_eq!(
            s.handle(&hdr(op::INTERRUPT, FILE), &[0; 8], &mut buf, 0),
            Outcome::NoReply
        );
        assert_eq!(
            s.handle(&hdr(99, FILE), &[], &mut buf, 0),
            Outcome::Error(libc::ENOSYS)
        );
        assert!(!s.destroyed());
        assert_eq!(
            s.handle(&hdr(op::DESTROY, ROOT), &[], &mut buf, 0),
            Outcome::Reply(0)
        );
        assert!(s.destroyed());
    }
}
