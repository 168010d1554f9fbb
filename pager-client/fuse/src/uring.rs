//! The io_uring transport (FUSE over io_uring, Linux 6.14+): the kernel
//! queues each request on the ring queue of the CPU that issued it, writes
//! it straight into a registered entry's buffers and completes that
//! entry's SQE; the reply goes back, and the next request is fetched, with
//! one COMMIT_AND_FETCH SQE.
//!
//! Each serving thread owns a ring and one entry per unit of depth, all
//! registered on one queue, and runs on that queue's CPU, so the wake-up
//! that hands it a request stays on the CPU that made it. Several threads
//! per queue let requests from one CPU be answered in parallel (each
//! answer waits on a donor's round trip).

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::{cqueue, squeue, IoUring};

use crate::abi::{self, ring, InHeader};
use crate::session::{Outcome, Session};
use crate::sys::{self, RingBuffers};
use crate::Backend;

/// A thread's ring, registered on queue `qid`.
pub struct Queue {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    entries: Vec<RingBuffers>,
    /// Each entry's last command: 0 for REGISTER, else the commit id of
    /// its COMMIT_AND_FETCH (to send again if the kernel asks for a retry).
    last: Vec<u64>,
    /// Entries whose request arrived while registering.
    arrived: Vec<u64>,
    /// Entries registered and not yet ended.
    live: usize,
    qid: u16,
}

impl Queue {
    /// Creates the ring and registers `depth` entries of `payload_len`
    /// bytes on queue `qid` of `fd`'s connection. A REGISTER the kernel
    /// refuses at once (io_uring refused by the connection, a buffer too
    /// small) comes back beside the queue, which must still serve the
    /// entries that were accepted: a request may already wait in one.
    pub fn register(
        fd: &File,
        qid: u16,
        depth: usize,
        payload_len: usize,
    ) -> io::Result<(Queue, Option<io::Error>)> {
        let mut ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(2 * depth as u32)
            .build(depth as u32)?;
        ring.submitter().register_files(&[sys::raw(fd)])?;
        let entries: Vec<RingBuffers> = (0..depth).map(|_| RingBuffers::new(payload_len)).collect();
        for (i, e) in entries.iter().enumerate() {
            sys::push_register(&mut ring, e, qid, i as u64)?;
        }
        ring.submit()?;
        // A refused REGISTER completes at once; an accepted one only when a
        // request arrives, which can be at once too (the other queues made
        // the ring ready): such a request is answered first by `serve`.
        let mut arrived = Vec::new();
        let mut refused = None;
        for cqe in ring.completion() {
            match cqe.result() {
                0 => arrived.push(cqe.user_data()),
                err => refused = Some(io::Error::from_raw_os_error(-err)),
            }
        }
        let live = depth - usize::from(refused.is_some());
        let queue = Queue {
            ring,
            entries,
            last: vec![0; depth],
            arrived,
            live,
            qid,
        };
        Ok((queue, refused))
    }

    /// Answers requests until the connection ends (every entry completes
    /// with -ENOTCONN at unmount).
    pub fn serve<B: Backend>(
        mut self,
        session: &Session<B>,
        answered: &AtomicU64,
    ) -> io::Result<()> {
        for i in std::mem::take(&mut self.arrived) {
            self.reply(i as usize, session, answered)?;
        }
        while self.live > 0 {
            self.ring.submit_and_wait(1)?;
            loop {
                let Some(cqe) = self.ring.completion().next() else {
                    break;
                };
                let i = cqe.user_data() as usize;
                match -cqe.result() {
                    0 => self.reply(i, session, answered)?,
                    libc::EAGAIN | libc::EINTR => match self.last[i] {
                        0 => sys::push_register(
                            &mut self.ring,
                            &self.entries[i],
                            self.qid,
                            i as u64,
                        )?,
                        id => sys::push_commit(&mut self.ring, self.qid, id, i as u64)?,
                    },
                    libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED => self.live -= 1,
                    errno => {
                        return Err(io::Error::from_raw_os_error(errno));
                    }
                }
            }
        }
        Ok(())
    }

    /// Answers the request in entry `i` and queues the commit that sends
    /// the reply and fetches the next request.
    fn reply<B: Backend>(
        &mut self,
        i: usize,
        session: &Session<B>,
        answered: &AtomicU64,
    ) -> io::Result<()> {
        self.last[i] = self.answer(i, session);
        answered.fetch_add(1, Ordering::Relaxed);
        sys::push_commit(&mut self.ring, self.qid, self.last[i], i as u64)
    }

    /// Answers the request in entry `i`; returns its commit id.
    fn answer<B: Backend>(&mut self, i: usize, session: &Session<B>) -> u64 {
        let RingBuffers {
            header, payload, ..
        } = &mut self.entries[i];
        let commit_id = abi::u64_at(header, ring::COMMIT_ID);
        let payload_in = (abi::u32_at(header, ring::PAYLOAD_SZ) as usize).min(payload.len());
        let (error, len) = match InHeader::parse(&header[ring::IN_OUT..]) {
            Ok(h) => {
                let op_in = &header[ring::OP_IN..ring::OP_IN + abi::op_in_len(h.opcode).min(128)];
                match session.handle(&h, op_in, payload, payload_in) {
                    Outcome::Reply(len) => (0, len),
                    Outcome::Error(errno) => (-errno, 0),
                    // Every ring request takes a commit; FORGET and
                    // INTERRUPT come through /dev/fuse.
                    Outcome::NoReply => (0, 0),
                }
            }
            Err(e) => {
                tracing::error!("ring entry {i}: {e}");
                (-libc::EIO, 0)
            }
        };
        // The out header overwrites the in header; `unique` stays where it
        // was, at the same offset in both.
        let unique = abi::u64_at(header, ring::IN_OUT + 8);
        abi::encode_out_header(
            &mut header[ring::IN_OUT..],
            (abi::OUT_HEADER_LEN + len) as u32,
            error,
            unique,
        );
        abi::put_u32(header, ring::PAYLOAD_SZ, len as u32);
        commit_id
    }
}
