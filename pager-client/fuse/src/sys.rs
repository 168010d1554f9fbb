//! Every unsafe call of the front end: mount(2), the `/dev/fuse` clone
//! ioctl, io_uring submissions whose buffers the kernel keeps, CPU
//! affinity, and the swap-path process set-up (PR_SET_IO_FLUSHER).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use io_uring::{opcode, squeue, types, IoUring};

use crate::abi::ring;

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = (2 << 30) | (4 << 16) | (229 << 8);

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput.into())
}

/// Opens a new FUSE connection.
pub fn open_fuse() -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
}

/// Mounts the connection `fd` on the directory `target` (root only: no
/// fusermount3 in between).
pub fn mount(fd: &File, target: &Path, fstype: &str, options: &str) -> io::Result<()> {
    let target = cpath(target)?;
    let source = CString::new("netpager").expect("no NUL");
    let fstype = CString::new(fstype).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let data = CString::new(format!("fd={},{options}", fd.as_raw_fd()))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the
    // call; the kernel copies them.
    check(unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    })
}

/// Unmounts `target`; `lazy` detaches it even while busy or disconnected.
pub fn unmount(target: &Path, lazy: bool) -> io::Result<()> {
    let target = cpath(target)?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: a NUL-terminated path that outlives the call.
    check(unsafe { libc::umount2(target.as_ptr(), flags) })
}

/// A second fd on the same connection, so that each reader thread reads
/// and replies on its own fd.
pub fn clone_fuse(fd: &File) -> io::Result<File> {
    let clone = open_fuse()?;
    let source: u32 = fd.as_raw_fd() as u32;
    // SAFETY: the ioctl reads one u32 through the pointer, which is live.
    check(unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE, &source) })?;
    Ok(clone)
}

/// Runs the calling thread on `cpu` only.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    // SAFETY: CPU_SET writes within the set for a cpu below CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the set is live for the call; 0 is the calling thread.
    check(unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) })
}

/// `PR_SET_IO_FLUSHER` (linux/prctl.h, 5.6+), which the libc crate lacks.
const PR_SET_IO_FLUSHER: libc::c_int = 57;

/// Marks the process as one that frees memory (PR_SET_IO_FLUSHER): its
/// allocations do not recurse into reclaim that would wait on its own I/O.
pub fn set_io_flusher() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) })
}

/// A ring entry's buffers: the header (`struct fuse_uring_req_header`)
/// and the payload, at addresses that never move while the kernel holds
/// them.
pub struct RingBuffers {
    pub header: Box<[u8]>,
    pub payload: Box<[u8]>,
    iov: Box<[libc::iovec; 2]>,
}

impl RingBuffers {
    pub fn new(payload_len: usize) -> RingBuffers {
        // Non-zero fill: the pages are really there (and locked) now.
        let mut header = vec![0xa5u8; ring::HEADER_LEN.next_multiple_of(64)].into_boxed_slice();
        let mut payload = vec![0xa5u8; payload_len].into_boxed_slice();
        let iov = Box::new([
            libc::iovec {
                iov_base: header.as_mut_ptr().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: payload.as_mut_ptr().cast(),
                iov_len: payload.len(),
            },
        ]);
        RingBuffers {
            header,
            payload,
            iov,
        }
    }
}

/// The 80-byte command of a FUSE ring SQE (`struct fuse_uring_cmd_req`).
fn cmd_req(qid: u16, commit_id: u64) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    c[16..18].copy_from_slice(&qid.to_ne_bytes());
    c
}

/// Byte offset of `len` in `struct io_uring_sqe`.
const SQE_LEN_AT: usize = 24;

/// Queues FUSE_IO_URING_CMD_REGISTER for `bufs` on queue `qid`. The file
/// at fixed index 0 must be the FUSE connection.
///
/// The kernel keeps `bufs`' addresses until the entry completes with an
/// error (-ENOTCONN at unmount): the caller must keep `bufs` alive and in
/// place until then.
pub fn push_register(
    ring: &mut IoUring<squeue::Entry128>,
    bufs: &RingBuffers,
    qid: u16,
    user_data: u64,
) -> io::Result<()> {
    let entry = opcode::UringCmd80::new(types::Fixed(0), ring::CMD_REGISTER)
        .cmd(cmd_req(qid, 0))
        .addr(Some(bufs.iov.as_ptr() as u64))
        .build()
        .user_data(user_data);
    // The crate has no setter for `len`, which must count the two iovecs.
    // SAFETY: Entry128 is repr(C) over two plain-data halves of 64 bytes
    // (the SQE and its extension); every bit pattern is a valid value.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(entry) };
    raw[SQE_LEN_AT..SQE_LEN_AT + 4].copy_from_slice(&2u32.to_ne_bytes());
    // SAFETY: as above, the bytes came from an Entry128.
    let entry: squeue::Entry128 = unsafe { std::mem::transmute(raw) };
    push(ring, &entry)
}

/// Queues FUSE_IO_URING_CMD_COMMIT_AND_FETCH: the reply in the entry's
/// buffers goes back for `commit_id`, and the entry waits for the next
/// request. The buffers' lifetime rule of [`push_register`] holds.
pub fn push_commit(
    ring: &mut IoUring<squeue::Entry128>,
    qid: u16,
    commit_id: u64,
    user_data: u64,
) -> io::Result<()> {
    let entry = opcode::UringCmd80::new(types::Fixed(0), ring::CMD_COMMIT_AND_FETCH)
        .cmd(cmd_req(qid, commit_id))
        .build()
        .user_data(user_data);
    push(ring, &entry)
}

fn push(ring: &mut IoUring<squeue::Entry128>, entry: &squeue::Entry128) -> io::Result<()> {
    // SAFETY: the buffers the entry points at belong to RingBuffers that
    // the caller keeps alive until the entry completes (see above).
    unsafe { ring.submission().push(entry) }
        .map_err(|_| io::Error::other("io_uring submission queue full"))
}

/// The raw fd, for the ring's fixed-file table.
pub fn raw(fd: &File) -> RawFd {
    fd.as_raw_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clone_ioctl_number_matches_fuse_h() {
        assert_eq!(FUSE_DEV_IOC_CLONE, 0x8004_e500);
    }

    #[test]
    fn cmd_req_layout() {
        let c = cmd_req(3, 0x1122);
        assert_eq!(u64::from_ne_bytes(c[8..16].try_into().unwrap()), 0x1122);
        assert_eq!(u16::from_ne_bytes([c[16], c[17]]), 3);
    }
}
