//! Every unsafe call of the front end: mount(2), the `/dev/fuse` clone
//! ioctl, io_uring submissions whose buffers the kernel keeps (one owner
//! type, [`FuseRing`]), the swap-path process set-up (PR_SET_IO_FLUSHER),
//! ring threads' CPU affinity, and passing the connection's fd between
//! processes (SCM_RIGHTS, or a service manager's `LISTEN_FDS`).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

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

/// Runs the calling thread on `cpu` only.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes within the set for a cpu below CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the set is live for the call; 0 is the calling thread.
    check(unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) })
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

/// `PR_SET_IO_FLUSHER` (linux/prctl.h, 5.6+), which the libc crate lacks.
const PR_SET_IO_FLUSHER: libc::c_int = 57;

/// Marks the process as one that frees memory (PR_SET_IO_FLUSHER): its
/// allocations do not recurse into reclaim that would wait on its own I/O.
pub fn set_io_flusher() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) })
}

/// A ring entry's buffers: the header (`struct fuse_uring_req_header`)
/// and the payload, boxed, so their addresses never move while the kernel
/// holds them. Only [`FuseRing`] has them.
struct RingBuffers {
    header: Box<[u8]>,
    payload: Box<[u8]>,
    iov: Box<[libc::iovec; 2]>,
}

impl RingBuffers {
    fn new(payload_len: usize) -> RingBuffers {
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

/// One FUSE queue's io_uring and the buffers of its entries, owned
/// together because the kernel keeps the buffers' addresses from an
/// entry's REGISTER until the entry ends (-ENOTCONN at unmount). The
/// buffers are never handed out but as borrows of the owner, never moved
/// and never freed while the kernel may still hold one: `Drop` leaks them
/// if an entry has not ended (an error path), and the ring is dropped
/// after that (fields drop in declaration order: `ring`, then `entries`).
pub struct FuseRing {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    entries: Vec<RingBuffers>,
    /// Entries registered with the kernel and not yet ended.
    held: Vec<bool>,
}

impl FuseRing {
    /// A ring for `depth` entries of `payload_len` bytes on `fd`'s
    /// connection (fixed file 0).
    pub fn new(fd: &File, depth: usize, payload_len: usize) -> io::Result<FuseRing> {
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(2 * depth as u32)
            .build(depth as u32)?;
        ring.submitter().register_files(&[fd.as_raw_fd()])?;
        Ok(FuseRing {
            ring,
            entries: (0..depth).map(|_| RingBuffers::new(payload_len)).collect(),
            held: vec![false; depth],
        })
    }

    /// Entry `i`'s header and payload buffers. The kernel writes a request
    /// into them before completing the entry's SQE and reads the reply
    /// after its COMMIT_AND_FETCH: use them only in between.
    pub fn entry(&mut self, i: usize) -> (&mut [u8], &mut [u8]) {
        let e = &mut self.entries[i];
        (&mut e.header, &mut e.payload)
    }

    /// Entry `i` completed with an error that ends it (or its REGISTER was
    /// refused): the kernel no longer holds its buffers.
    pub fn ended(&mut self, i: usize) {
        self.held[i] = false;
    }

    /// Queues FUSE_IO_URING_CMD_REGISTER for entry `i` on queue `qid`
    /// (user data `i`).
    pub fn push_register(&mut self, i: usize, qid: u16) -> io::Result<()> {
        let entry = opcode::UringCmd80::new(types::Fixed(0), ring::CMD_REGISTER)
            .cmd(cmd_req(qid, 0))
            .addr(Some(self.entries[i].iov.as_ptr() as u64))
            .build()
            .user_data(i as u64);
        // The crate has no setter for `len`, which must count the two iovecs.
        // SAFETY: Entry128 is repr(C) over two plain-data halves of 64 bytes
        // (the SQE and its extension); every bit pattern is a valid value.
        let mut raw: [u8; 128] = unsafe { std::mem::transmute(entry) };
        raw[SQE_LEN_AT..SQE_LEN_AT + 4].copy_from_slice(&2u32.to_ne_bytes());
        // SAFETY: as above, the bytes came from an Entry128.
        let entry: squeue::Entry128 = unsafe { std::mem::transmute(raw) };
        self.push(&entry)?;
        self.held[i] = true;
        Ok(())
    }

    /// Queues FUSE_IO_URING_CMD_COMMIT_AND_FETCH for entry `i`: the reply
    /// in its buffers goes back for `commit_id`, and the entry waits for
    /// the next request.
    pub fn push_commit(&mut self, i: usize, qid: u16, commit_id: u64) -> io::Result<()> {
        let entry = opcode::UringCmd80::new(types::Fixed(0), ring::CMD_COMMIT_AND_FETCH)
            .cmd(cmd_req(qid, commit_id))
            .build()
            .user_data(i as u64);
        self.push(&entry)
    }

    fn push(&mut self, entry: &squeue::Entry128) -> io::Result<()> {
        // SAFETY: the buffers the entry points at are `self.entries`',
        // boxed (they never move), freed only after the ring is gone and
        // leaked while the kernel may still hold them (see `Drop`).
        unsafe { self.ring.submission().push(entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))
    }

    pub fn submit(&mut self) -> io::Result<usize> {
        self.ring.submit()
    }

    pub fn submit_and_wait(&mut self, want: usize) -> io::Result<usize> {
        self.ring.submit_and_wait(want)
    }

    /// The next completion: its entry and result.
    pub fn completion(&mut self) -> Option<(usize, i32)> {
        self.ring
            .completion()
            .next()
            .map(|c| (c.user_data() as usize, c.result()))
    }
}

impl Drop for FuseRing {
    fn drop(&mut self) {
        if self.held.iter().any(|&h| h) {
            // An entry the kernel still holds (we stopped on an error):
            // its buffers must outlive whatever the kernel does with the
            // ring, so they are never freed.
            std::mem::forget(std::mem::take(&mut self.entries));
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

/// Sends `msg` on the connected unix socket `sock`, with `fd` attached
/// (SCM_RIGHTS) when given: the receiver gets its own fd on the same open
/// file.
pub fn send_with_fd(sock: RawFd, msg: &[u8], fd: Option<RawFd>) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    // Room for one cmsghdr carrying one int, u64-aligned as cmsghdr wants.
    let mut control = [0u64; 4];
    // SAFETY: msghdr is plain data; zeroed is "no name, no control".
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE/CMSG_LEN are pure arithmetic.
        let (space, len) = unsafe {
            (
                libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32),
                libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32),
            )
        };
        hdr.msg_control = control.as_mut_ptr().cast();
        hdr.msg_controllen = space as usize;
        // SAFETY: the control buffer (32 bytes) holds CMSG_SPACE(4) = 24
        // bytes and outlives the calls; CMSG_FIRSTHDR of a msghdr whose
        // controllen covers one header is non-null and points into it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&hdr);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = len as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    // SAFETY: hdr points at iov, msg and control, all live for the call;
    // the kernel only reads them.
    let n = unsafe { libc::sendmsg(sock, &hdr, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != msg.len() {
        return Err(io::Error::other("short sendmsg on a unix socket"));
    }
    Ok(())
}

/// Takes ownership of `fd`, an fd this process was started with (a
/// service manager's `LISTEN_FDS`), after checking that it is open; marks
/// it close-on-exec, as sd_listen_fds(3) does.
pub fn adopt_passed_fd(fd: RawFd) -> io::Result<File> {
    use std::os::fd::FromRawFd;
    // SAFETY: fcntl on any number is harmless; it fails on a closed fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::other(format!(
            "fd {fd} was announced in LISTEN_FDS but is not open: {}",
            io::Error::last_os_error()
        )));
    }
    // SAFETY: as above, on an fd known open.
    check(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) })?;
    // SAFETY: the fd is open and was handed to this process to own; it is
    // taken once (by name) and nothing else in the process uses it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Receives one message into `buf` from the unix socket `sock`, and the fd
/// attached to it (SCM_RIGHTS), if any; close-on-exec.
pub fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<File>)> {
    use std::os::fd::FromRawFd;
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 4];
    // SAFETY: msghdr is plain data; zeroed is "no name".
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr().cast();
    hdr.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: hdr points at buf and control, live and writable for the call.
    let n = unsafe { libc::recvmsg(sock, &mut hdr, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut file = None;
    // SAFETY: the kernel filled control and set controllen; CMSG_FIRSTHDR
    // and CMSG_NXTHDR stay within it and return null past its end.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&hdr);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
                // The fd is new in this process and nobody else owns it.
                file = Some(File::from_raw_fd(fd));
            }
            c = libc::CMSG_NXTHDR(&hdr, c);
        }
    }
    Ok((n as usize, file))
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
