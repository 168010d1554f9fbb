//! The FUSE kernel protocol, as far as this server speaks it: opcodes,
//! flags and the structures of `include/uapi/linux/fuse.h` (protocol 7.x),
//! read from and written into byte buffers. Pure code: no I/O, no
//! allocation.

use crate::FuseError;

/// Protocol major version; the kernel refuses any other.
pub const KERNEL_VERSION: u32 = 7;
/// Newest minor version this server knows; the reply carries the lower of
/// this and the kernel's.
pub const KERNEL_MINOR: u32 = 45;
/// Oldest minor whose structure layouts (64-bit `fuse_write_in`,
/// `fuse_attr` with flags) this server writes.
pub const OLDEST_MINOR: u32 = 23;

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

/// `fuse_init_in.flags` / `fuse_init_out.flags` bits.
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const MAX_PAGES: u64 = 1 << 22;
    /// `flags2` is valid: the bits from 32 up.
    pub const INIT_EXT: u64 = 1 << 30;
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// `fuse_open_out.open_flags`.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;

/// `fuse_setattr_in.valid`: the size is to change.
pub const FATTR_SIZE: u32 = 1 << 3;

/// fallocate(2) modes the kernel passes through.
pub const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
pub const FALLOC_FL_ZERO_RANGE: u32 = 0x10;

pub const IN_HEADER_LEN: usize = 40;
pub const OUT_HEADER_LEN: usize = 16;
pub const ATTR_LEN: usize = 88;
pub const ENTRY_OUT_LEN: usize = 40 + ATTR_LEN;
pub const ATTR_OUT_LEN: usize = 16 + ATTR_LEN;
pub const OPEN_OUT_LEN: usize = 16;
pub const WRITE_OUT_LEN: usize = 8;
pub const STATFS_OUT_LEN: usize = 80;
pub const INIT_OUT_LEN: usize = 64;

/// Layout of one io_uring ring entry's header buffer
/// (`struct fuse_uring_req_header`): the in/out header, the per-opcode
/// header, then `struct fuse_uring_ent_in_out`.
pub mod ring {
    pub const IN_OUT: usize = 0;
    pub const OP_IN: usize = 128;
    pub const ENT_IN_OUT: usize = 256;
    /// `commit_id` within the header buffer.
    pub const COMMIT_ID: usize = ENT_IN_OUT + 8;
    /// `payload_sz` within the header buffer.
    pub const PAYLOAD_SZ: usize = ENT_IN_OUT + 16;
    /// sizeof(struct fuse_uring_req_header).
    pub const HEADER_LEN: usize = ENT_IN_OUT + 32;
    pub const CMD_REGISTER: u32 = 1;
    pub const CMD_COMMIT_AND_FETCH: u32 = 2;
    /// The kernel's floor for a ring entry's payload buffer
    /// (FUSE_MIN_READ_BUFFER).
    pub const MIN_PAYLOAD: usize = 8192;
}

#[cfg(test)]
pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_ne_bytes());
}

pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

/// Checks that a structure of `need` bytes fits in what arrived.
fn need(what: &'static str, got: &[u8], need: usize) -> Result<(), FuseError> {
    if got.len() < need {
        return Err(FuseError::Short {
            what,
            got: got.len(),
            need,
        });
    }
    Ok(())
}

/// `struct fuse_in_header`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl InHeader {
    pub fn parse(b: &[u8]) -> Result<InHeader, FuseError> {
        need("fuse_in_header", b, IN_HEADER_LEN)?;
        Ok(InHeader {
            len: u32_at(b, 0),
            opcode: u32_at(b, 4),
            unique: u64_at(b, 8),
            nodeid: u64_at(b, 16),
            uid: u32_at(b, 24),
            gid: u32_at(b, 28),
            pid: u32_at(b, 32),
        })
    }

    pub fn encode(&self, b: &mut [u8]) {
        put_u32(b, 0, self.len);
        put_u32(b, 4, self.opcode);
        put_u64(b, 8, self.unique);
        put_u64(b, 16, self.nodeid);
        put_u32(b, 24, self.uid);
        put_u32(b, 28, self.gid);
        put_u32(b, 32, self.pid);
        b[36..40].fill(0);
    }
}

/// Writes `struct fuse_out_header`: `error` is 0 or a negated errno.
pub fn encode_out_header(b: &mut [u8], len: u32, error: i32, unique: u64) {
    put_u32(b, 0, len);
    put_u32(b, 4, error as u32);
    put_u64(b, 8, unique);
}

/// `FUSE_NOTIFY_RESEND` (Linux 6.9+): the kernel puts every request
/// that a server read from this connection's `/dev/fuse` files and has
/// not answered back on the queue, to be read again.
pub const NOTIFY_RESEND: i32 = 7;

/// `FUSE_UNIQUE_RESEND`: the bit the kernel sets in `unique` of a request
/// it queues again after [`NOTIFY_RESEND`]; the reply carries it too.
pub const UNIQUE_RESEND: u64 = 1 << 63;

/// The notification [`NOTIFY_RESEND`]: an out header alone, `unique` 0
/// and the notification code in `error`.
pub fn notify_resend() -> [u8; OUT_HEADER_LEN] {
    let mut b = [0u8; OUT_HEADER_LEN];
    encode_out_header(&mut b, OUT_HEADER_LEN as u32, NOTIFY_RESEND, 0);
    b
}

/// Bytes of the per-opcode header at the start of a request's body on
/// `/dev/fuse` (what io_uring puts in the separate `op_in` area); the rest
/// of the body is the payload (a name, or write data).
pub fn op_in_len(opcode: u32) -> usize {
    match opcode {
        op::GETATTR | op::FSYNC | op::FSYNCDIR => 16,
        op::SETATTR => 88,
        op::OPEN | op::OPENDIR | op::FORGET | op::INTERRUPT | op::ACCESS | op::BATCH_FORGET => 8,
        op::READ | op::WRITE | op::READDIR => 40,
        op::RELEASE | op::RELEASEDIR | op::FLUSH => 24,
        op::FALLOCATE => 32,
        op::INIT => 64,
        _ => 0,
    }
}

/// `struct fuse_init_in` (the fields this server reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// `flags`, with `flags2` in the high half when INIT_EXT is set.
    pub flags: u64,
}

impl InitIn {
    pub fn parse(b: &[u8]) -> Result<InitIn, FuseError> {
        need("fuse_init_in", b, 16)?;
        let low = u32_at(b, 12) as u64;
        let high = if low & init::INIT_EXT != 0 && b.len() >= 20 {
            u32_at(b, 16) as u64
        } else {
            0
        };
        Ok(InitIn {
            major: u32_at(b, 0),
            minor: u32_at(b, 4),
            max_readahead: u32_at(b, 8),
            flags: low | high << 32,
        })
    }
}

/// `struct fuse_init_out` (64 bytes since 7.23).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitOut {
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u64,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub max_pages: u16,
}

impl InitOut {
    pub fn encode(&self, b: &mut [u8]) -> usize {
        b[..INIT_OUT_LEN].fill(0);
        put_u32(b, 0, KERNEL_VERSION);
        put_u32(b, 4, self.minor);
        put_u32(b, 8, self.max_readahead);
        put_u32(b, 12, self.flags as u32);
        put_u16(b, 16, self.max_background);
        put_u16(b, 18, self.congestion_threshold);
        put_u32(b, 20, self.max_write);
        // time_gran: nanosecond timestamps.
        put_u32(b, 24, 1);
        put_u16(b, 28, self.max_pages);
        put_u32(b, 32, (self.flags >> 32) as u32);
        INIT_OUT_LEN
    }
}

/// `struct fuse_read_in` (also READDIR's) and `struct fuse_write_in`: the
/// fields this server reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
}

impl IoIn {
    pub fn parse(b: &[u8]) -> Result<IoIn, FuseError> {
        need("fuse_read_in/fuse_write_in", b, 24)?;
        Ok(IoIn {
            fh: u64_at(b, 0),
            offset: u64_at(b, 8),
            size: u32_at(b, 16),
        })
    }
}

/// `struct fuse_fallocate_in`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FallocateIn {
    pub offset: u64,
    pub length: u64,
    pub mode: u32,
}

impl FallocateIn {
    pub fn parse(b: &[u8]) -> Result<FallocateIn, FuseError> {
        need("fuse_fallocate_in", b, 28)?;
        Ok(FallocateIn {
            offset: u64_at(b, 8),
            length: u64_at(b, 16),
            mode: u32_at(b, 24),
        })
    }
}

/// `struct fuse_setattr_in`: what is to change, and the new size.
pub fn parse_setattr(b: &[u8]) -> Result<(u32, u64), FuseError> {
    need("fuse_setattr_in", b, 24)?;
    Ok((u32_at(b, 0), u64_at(b, 16)))
}

/// `struct fuse_attr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch, for atime, mtime and ctime alike.
    pub time: u64,
}

impl Attr {
    pub fn encode(&self, b: &mut [u8]) {
        b[..ATTR_LEN].fill(0);
        put_u64(b, 0, self.ino);
        put_u64(b, 8, self.size);
        put_u64(b, 16, self.size.div_ceil(512));
        for at in [24, 32, 40] {
            put_u64(b, at, self.time);
        }
        put_u32(b, 60, self.mode);
        put_u32(b, 64, self.nlink);
        put_u32(b, 68, self.uid);
        put_u32(b, 72, self.gid);
        put_u32(b, 80, 4096);
    }
}

/// `struct fuse_entry_out`: the node, with name and attributes valid for
/// `valid_secs`.
pub fn encode_entry_out(b: &mut [u8], attr: &Attr, valid_secs: u64) -> usize {
    put_u64(b, 0, attr.ino);
    put_u64(b, 8, 0);
    put_u64(b, 16, valid_secs);
    put_u64(b, 24, valid_secs);
    put_u64(b, 32, 0);
    attr.encode(&mut b[40..]);
    ENTRY_OUT_LEN
}

/// `struct fuse_attr_out`.
pub fn encode_attr_out(b: &mut [u8], attr: &Attr, valid_secs: u64) -> usize {
    put_u64(b, 0, valid_secs);
    put_u64(b, 8, 0);
    attr.encode(&mut b[16..]);
    ATTR_OUT_LEN
}

/// `struct fuse_open_out`.
pub fn encode_open_out(b: &mut [u8], fh: u64, open_flags: u32) -> usize {
    put_u64(b, 0, fh);
    put_u32(b, 8, open_flags);
    put_u32(b, 12, 0);
    OPEN_OUT_LEN
}

/// `struct fuse_write_out`.
pub fn encode_write_out(b: &mut [u8], size: u32) -> usize {
    put_u32(b, 0, size);
    put_u32(b, 4, 0);
    WRITE_OUT_LEN
}

/// `struct fuse_statfs_out` for a file system of `blocks` 4 KiB blocks,
/// all in use.
pub fn encode_statfs_out(b: &mut [u8], blocks: u64, files: u64) -> usize {
    b[..STATFS_OUT_LEN].fill(0);
    put_u64(b, 0, blocks);
    put_u64(b, 24, files);
    put_u32(b, 40, 4096);
    put_u32(b, 44, 255);
    put_u32(b, 48, 4096);
    STATFS_OUT_LEN
}

/// Appends `struct fuse_dirent` for `name` at `b[at..]`; `None` when it
/// does not fit. Returns the new end.
pub fn encode_dirent(
    b: &mut [u8],
    at: usize,
    ino: u64,
    next_off: u64,
    dtype: u32,
    name: &[u8],
) -> Option<usize> {
    let len = (24 + name.len()).next_multiple_of(8);
    if at + len > b.len() {
        return None;
    }
    let d = &mut b[at..at + len];
    put_u64(d, 0, ino);
    put_u64(d, 8, next_off);
    put_u32(d, 16, name.len() as u32);
    put_u32(d, 20, dtype);
    d[24..24 + name.len()].copy_from_slice(name);
    d[24 + name.len()..].fill(0);
    Some(at + len)
}

/// The name in a LOOKUP request: up to its NUL.
pub fn lookup_name(payload: &[u8]) -> &[u8] {
    payload
        .iter()
        .position(|&c| c == 0)
        .map_or(payload, |n| &payload[..n])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resend_notification_matches_fuse_h() {
        let b = notify_resend();
        // struct fuse_out_header { u32 len; s32 error; u64 unique }
        assert_eq!(u32_at(&b, 0), 16);
        assert_eq!(u32_at(&b, 4) as i32, 7);
        assert_eq!(u64_at(&b, 8), 0);
        assert_eq!(UNIQUE_RESEND, 0x8000_0000_0000_0000);
    }

    #[test]
    fn in_header_round_trips() {
        let h = InHeader {
            len: 80,
            opcode: op::WRITE,
            unique: 77,
            nodeid: 2,
            uid: 1,
            gid: 2,
            pid: 3,
        };
        let mut b = [0xffu8; IN_HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(InHeader::parse(&b).unwrap(), h);
        assert!(matches!(
            InHeader::parse(&b[..39]),
            Err(FuseError::Short {
                need: 40,
                got: 39,
                ..
            })
        ));
    }

    #[test]
    fn init_in_reads_flags2_only_with_init_ext() {
        let mut b = [0u8; 64];
        put_u32(&mut b, 0, 7);
        put_u32(&mut b, 4, 45);
        put_u32(&mut b, 12, init::ASYNC_DIO as u32);
        put_u32(&mut b, 16, 1 << 9);
        let i = InitIn::parse(&b).unwrap();
        assert_eq!(i.flags, init::ASYNC_DIO);
        put_u32(&mut b, 12, (init::ASYNC_DIO | init::INIT_EXT) as u32);
        let i = InitIn::parse(&b).unwrap();
        assert_eq!(i.flags & init::OVER_IO_URING, init::OVER_IO_URING);
        assert_eq!((i.major, i.minor), (7, 45));
    }

    #[test]
    fn init_out_puts_high_flags_in_flags2() {
        let mut b = [0xaau8; 64];
        let n = InitOut {
            minor: 45,
            max_readahead: 0,
            flags: init::MAX_PAGES | init::INIT_EXT | init::OVER_IO_URING,
            max_background: 64,
            congestion_threshold: 48,
            max_write: 1 << 20,
            max_pages: 256,
        }
        .encode(&mut b);
        assert_eq!(n, 64);
        assert_eq!(u32_at(&b, 0), 7);
        assert_eq!(u32_at(&b, 12) as u64, init::MAX_PAGES | init::INIT_EXT);
        assert_eq!(u32_at(&b, 32), 1 << 9);
        assert_eq!(u32_at(&b, 20), 1 << 20);
        assert_eq!(u16_at(&b, 28), 256);
        assert!(b[36..].iter().all(|&c| c == 0));
    }

    #[test]
    fn attr_layout_matches_fuse_h() {
        let mut b = [0u8; ATTR_OUT_LEN];
        let a = Attr {
            ino: 2,
            size: 1 << 30,
            mode: libc::S_IFREG | 0o600,
            nlink: 1,
            uid: 0,
            gid: 0,
            time: 5,
        };
        assert_eq!(encode_attr_out(&mut b, &a, 3600), 104);
        assert_eq!(u64_at(&b, 0), 3600);
        let attr = &b[16..];
        assert_eq!(u64_at(attr, 8), 1 << 30);
        assert_eq!(u64_at(attr, 16), (1 << 30) / 512);
        assert_eq!(u32_at(attr, 60), libc::S_IFREG | 0o600);
        assert_eq!(u32_at(attr, 80), 4096);
    }

    #[test]
    fn dirents_are_padded_and_stop_when_full() {
        let mut b = [0u8; 64];
        let end = encode_dirent(&mut b, 0, 1, 1, 4, b".").unwrap();
        assert_eq!(end, 32);
        let end = encode_dirent(&mut b, end, 2, 2, 8, b"device").unwrap();
        assert_eq!(end, 64);
        assert_eq!(&b[56..62], b"device");
        assert_eq!(encode_dirent(&mut b, end, 1, 3, 4, b".."), None);
    }

    #[test]
    fn body_split_matches_request_structs() {
        assert_eq!(op_in_len(op::WRITE), 40);
        assert_eq!(op_in_len(op::READ), 40);
        assert_eq!(op_in_len(op::LOOKUP), 0);
        assert_eq!(op_in_len(op::FALLOCATE), 32);
        assert_eq!(lookup_name(b"device\0junk"), b"device");
        assert_eq!(lookup_name(b"device"), b"device");
    }

    #[test]
    fn io_and_fallocate_in() {
        let mut b = [0u8; 40];
        put_u64(&mut b, 8, 4096);
        put_u32(&mut b, 16, 8192);
        assert_eq!(
            IoIn::parse(&b).unwrap(),
            IoIn {
                fh: 0,
                offset: 4096,
                size: 8192
            }
        );
        let mut f = [0u8; 32];
        put_u64(&mut f, 8, 1 << 20);
        put_u64(&mut f, 16, 1 << 16);
        put_u32(&mut f, 24, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE);
        let fi = FallocateIn::parse(&f).unwrap();
        assert_eq!((fi.offset, fi.length, fi.mode), (1 << 20, 1 << 16, 3));
        assert!(FallocateIn::parse(&f[..20]).is_err());
    }
}
