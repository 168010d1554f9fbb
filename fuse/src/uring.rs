//! The io_uring transport (FUSE over io_uring, Linux 6.14+): the kernel
//! queues each request on the ring queue of the CPU that issued it, writes
//! it straight into a registered entry's buffers and completes that
//! entry's SQE; the reply goes back, and the next request is fetched, with
//! one COMMIT_AND_FETCH SQE.
//!
//! Each serving thread owns a ring and one entry per unit of depth, all
//! registered on one queue. The kernel hands a request to a free entry of
//! its queue (the one committed last first), so the threads of a queue are
//! its pool of workers with no hand-off in user space: a lone request is
//! answered by the thread its entry woke, and a queue answers as many at
//! once as it has threads, each waiting on its donor round trip (which
//! shares the donor's connections with the others: netpager-nbd).

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use netpager_util::trace::{self, Mark};

use crate::abi::{self, ring, InHeader};
use crate::session::{Outcome, Session};
use crate::sys::FuseRing;
use crate::Backend;

/// A thread's ring, registered on queue `qid`.
pub struct Queue {
    ring: FuseRing,
    /// Each entry's last command: 0 for REGISTER, else the commit id of
    /// its COMMIT_AND_FETCH (to send again if the kernel asks for a retry).
    last: Vec<u64>,
    /// Entries whose request arrived while registering.
    arrived: Vec<u64>,
    /// Entries registered and not yet ended.
    live: usize,
    qid: u16,
}

/// What the completions seen right after registering said.
#[derive(Debug, Default)]
struct Registered {
    /// Entries whose request arrived at once.
    arrived: Vec<u64>,
    /// Entries whose REGISTER was refused (they are not live).
    refused: Vec<u64>,
    /// The first refusal's error.
    error: Option<io::Error>,
}

impl Registered {
    fn note(&mut self, entry: u64, result: i32) {
        match result {
            0 => self.arrived.push(entry),
            err => {
                self.refused.push(entry);
                self.error.get_or_insert(io::Error::from_raw_os_error(-err));
            }
        }
    }

    /// Entries still registered out of `depth`: every refusal counts, or
    /// `serve` would wait at unmount for entries that never were.
    fn live(&self, depth: usize) -> usize {
        depth - self.refused.len()
    }
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
        let mut ring = FuseRing::new(fd, depth, payload_len)?;
        for i in 0..depth {
            ring.push_register(i, qid)?;
        }
        ring.submit()?;
        // A refused REGISTER completes at once; an accepted one only when a
        // request arrives, which can be at once too (the other queues made
        // the ring ready): such a request is answered first by `serve`.
        let mut reg = Registered::default();
        while let Some((i, result)) = ring.completion() {
            reg.note(i as u64, result);
        }
        for &i in &reg.refused {
            ring.ended(i as usize);
        }
        let queue = Queue {
            ring,
            last: vec![0; depth],
            live: reg.live(depth),
            arrived: reg.arrived,
            qid,
        };
        Ok((queue, reg.error))
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
            while let Some((i, result)) = self.ring.completion() {
                match -result {
                    0 => self.reply(i, session, answered)?,
                    libc::EAGAIN | libc::EINTR => match self.last[i] {
                        0 => self.ring.push_register(i, self.qid)?,
                        id => self.ring.push_commit(i, self.qid, id)?,
                    },
                    libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED => {
                        self.ring.ended(i);
                        self.live -= 1;
                    }
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
    ///
    /// The request's clock runs from here to the commit queued: the SQE
    /// goes to the kernel with the thread's next wait for a request, in
    /// one system call, so its submission cannot be told apart from the
    /// wait.
    fn reply<B: Backend>(
        &mut self,
        i: usize,
        session: &Session<B>,
        answered: &AtomicU64,
    ) -> io::Result<()> {
        trace::start(Instant::now());
        let (id, opcode) = self.answer(i, session);
        self.last[i] = id;
        answered.fetch_add(1, Ordering::Relaxed);
        let r = self.ring.push_commit(i, self.qid, id);
        trace::mark(Mark::Committed);
        session.traced(opcode);
        r
    }

    /// Answers the request in entry `i`; returns its commit id and opcode.
    fn answer<B: Backend>(&mut self, i: usize, session: &Session<B>) -> (u64, u32) {
        let (header, payload) = self.ring.entry(i);
        let commit_id = abi::u64_at(header, ring::COMMIT_ID);
        let payload_in = (abi::u32_at(header, ring::PAYLOAD_SZ) as usize).min(payload.len());
        let mut opcode = 0;
        let (error, len) = match InHeader::parse(&header[ring::IN_OUT..]) {
            Ok(h) => {
                opcode = h.opcode;
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
        (commit_id, opcode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Before, one refused REGISTER or five left `live` at depth - 1, and
    /// `serve` waited at unmount for entries the kernel never had.
    #[test]
    fn every_refused_register_counts() {
        let mut reg = Registered::default();
        for (entry, result) in [
            (0, -libc::EINVAL),
            (1, 0),
            (2, -libc::EINVAL),
            (3, -libc::ENOTCONN),
        ] {
            reg.note(entry, result);
        }
        assert_eq!(reg.arrived, [1]);
        assert_eq!(reg.refused, [0, 2, 3]);
        assert_eq!(reg.live(4), 1);
        assert_eq!(reg.error.unwrap().raw_os_error(), Some(libc::EINVAL));
        assert_eq!(Registered::default().live(4), 4);
    }
}
