//! The classic transport: a thread reads one request at a time from its
//! own fd on the connection (`read(2)` on `/dev/fuse`), answers it, and
//! writes the reply back to the same fd.

use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::time::Instant;

use netpager_util::trace::{self, Mark};

use crate::abi::{self, InHeader};
use crate::session::{Outcome, Session};
use crate::Backend;

/// Serves requests from `fd` until the file system is unmounted.
pub fn serve<B: Backend>(session: &Session<B>, mut fd: &File, buf_len: usize) -> io::Result<()> {
    // Non-zero fill: the pages are really there (and locked) now.
    let mut buf = vec![0xa5u8; buf_len].into_boxed_slice();
    loop {
        let n = match fd.read(&mut buf) {
            Ok(n) => {
                trace::start(Instant::now());
                n
            }
            // The request was interrupted before we read it, or a signal.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINTR)) => continue,
            // Unmounted: the connection is gone. ECONNABORTED is the same
            // end caught mid-read: the kernel had taken a request for this
            // read when the unmount aborted the connection (fuse_dev_do_read).
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENODEV | libc::ECONNABORTED)) => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        let h = InHeader::parse(&buf[..n]).map_err(io::Error::other)?;
        let body_len = n - abi::IN_HEADER_LEN;
        let op_len = abi::op_in_len(h.opcode).min(body_len);
        let (op_in, payload) = buf[abi::IN_HEADER_LEN..].split_at_mut(op_len);
        let outcome = session.handle(&h, op_in, payload, body_len - op_len);
        let (error, len) = match outcome {
            Outcome::Reply(len) => (0, len),
            Outcome::Error(errno) => (-errno, 0),
            Outcome::NoReply => continue,
        };
        let mut out = [0u8; abi::OUT_HEADER_LEN];
        abi::encode_out_header(
            &mut out,
            (abi::OUT_HEADER_LEN + len) as u32,
            error,
            h.unique,
        );
        match fd.write_vectored(&[IoSlice::new(&out), IoSlice::new(&payload[..len])]) {
            Ok(_) => {
                trace::mark(Mark::Committed);
                session.traced(h.opcode);
            }
            // The request was interrupted and is gone: nobody waits.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(e),
        }
        if session.destroyed() {
            return Ok(());
        }
    }
}
