//! The global level: blocks held in donors' memory.
//!
//! Each donor gives this prefetchd one memory export, divided into
//! block-sized *slots* (slot s = bytes `s * block_size ..`). A donor may
//! also offer a *replica export*: a read-only copy of the data set on the
//! donor's own disk, laid out as [`crate::files`] describes. A
//! disk-to-global fill then reads the block from the replica and writes it
//! into the slot: the donor's disk does the slow part, in parallel with
//! the busy node's disk and the other donors' (PGMS's parallel disks). The
//! block crosses the network twice (donor disk -> prefetchd -> donor
//! memory); a donor-side copy would save that, but needs no other change
//! here. Without a replica the block is read from the local disk.
//!
//! Per donor, a few *memory* workers serve slot reads (global-to-local, in
//! arrival order) and a few *fill* workers serve disk-to-global requests,
//! earliest deadline first (PGMS: the donor serves the most valuable
//! request first). Each worker has its own NBD connections. Any NBD error
//! marks the donor failed: it gets no more requests and its blocks are
//! forgotten; reads then go to disk.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, VecDeque};
use std::fs::File;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netpager_nbd::{Connection, Endpoint, NbdError};
use netpager_util::{HostPort, HostPortError};

use crate::disk::{Disk, Urgency};

/// `--donor` as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DonorArg {
    pub memory: Endpoint,
    pub replica: Option<Endpoint>,
    /// Use at most this many slots of the memory export.
    pub slots: Option<u32>,
    /// The donor's status endpoint (`HOST:PORT`), polled to follow its life.
    pub status: Option<String>,
}

/// A `--donor` value that does not parse, or a donor that cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum DonorError {
    #[error("donor address {spec:?}: expected HOST:PORT[/EXPORT]")]
    Address { spec: String, source: HostPortError },
    #[error("donor {spec:?}: option {option:?} is not KEY=VALUE")]
    NotKeyValue { spec: String, option: String },
    #[error("donor {spec:?}: bad slots {value:?}")]
    Slots {
        spec: String,
        value: String,
        source: std::num::ParseIntError,
    },
    #[error("donor {spec:?}: status endpoint {value:?}: expected HOST:PORT")]
    StatusEndpoint {
        spec: String,
        value: String,
        source: HostPortError,
    },
    #[error("donor {spec:?}: unknown option {key:?} (replica, slots, status, psk, user)")]
    UnknownOption { spec: String, key: String },
    #[error("donor {name}")]
    Connect { name: String, source: NbdError },
    #[error("donor {name}: export smaller than one {block_size}-byte block")]
    ExportTooSmall { name: String, block_size: usize },
    #[error("replica of donor {name}")]
    ReplicaConnect { name: String, source: NbdError },
    #[error(
        "replica {replica} of donor {name} holds {size} bytes but the data set's replica layout needs {needed} \
         (the data files concatenated in byte order of their paths)"
    )]
    ReplicaTooSmall {
        replica: String,
        name: String,
        size: u64,
        needed: u64,
    },
    #[error("donor {status}: lab key {}", psk.display())]
    LabKey {
        /// The donor's status endpoint, or "?".
        status: String,
        psk: PathBuf,
        source: netpager_proto::auth::AuthError,
    },
    /// A worker or poller thread that did not start.
    #[error(transparent)]
    Thread(#[from] std::io::Error),
    /// A donor joining while the daemon is being dropped.
    #[error("the daemon is stopping")]
    Stopping,
}

fn parse_endpoint(
    s: &str,
    psk: &Option<PathBuf>,
    user: &Option<String>,
) -> Result<Endpoint, DonorError> {
    let (addr, export) = s.split_once('/').unwrap_or((s, ""));
    let HostPort { host, port } = HostPort::parse(addr).map_err(|source| DonorError::Address {
        spec: s.to_owned(),
        source,
    })?;
    Ok(Endpoint {
        host,
        port,
        export: export.to_owned(),
        tls_psk_file: psk.clone(),
        tls_username: user.clone(),
    })
}

impl FromStr for DonorArg {
    type Err = DonorError;

    /// `HOST:PORT[/EXPORT][,replica=HOST:PORT[/EXPORT]][,slots=N][,status=HOST:PORT][,psk=FILE][,user=NAME]`
    fn from_str(s: &str) -> Result<DonorArg, DonorError> {
        let mut parts = s.split(',');
        let memory = parts.next().unwrap_or_default();
        let (mut replica, mut slots, mut status, mut psk, mut user) =
            (None, None, None, None, None);
        for p in parts {
            let (k, v) = p.split_once('=').ok_or_else(|| DonorError::NotKeyValue {
                spec: s.to_owned(),
                option: p.to_owned(),
            })?;
            match k {
                "replica" => replica = Some(v.to_owned()),
                "slots" => {
                    slots = Some(v.parse().map_err(|source| DonorError::Slots {
                        spec: s.to_owned(),
                        value: v.to_owned(),
                        source,
                    })?)
                }
                "status" => {
                    let hp = HostPort::parse(v).map_err(|source| DonorError::StatusEndpoint {
                        spec: s.to_owned(),
                        value: v.to_owned(),
                        source,
                    })?;
                    status = Some(hp.to_string());
                }
                "psk" => psk = Some(PathBuf::from(v)),
                "user" => user = Some(v.to_owned()),
                _ => {
                    return Err(DonorError::UnknownOption {
                        spec: s.to_owned(),
                        key: k.to_owned(),
                    })
                }
            }
        }
        Ok(DonorArg {
            memory: parse_endpoint(memory, &psk, &user)?,
            replica: replica
                .map(|r| parse_endpoint(&r, &psk, &user))
                .transpose()?,
            slots,
            status,
        })
    }
}

/// Where a disk-to-global fill reads the block.
pub enum FillSource {
    /// `len` bytes at `offset` of the donor's replica export.
    Replica { offset: u64, len: usize },
    /// `len` bytes at `offset` of a local data file.
    LocalDisk {
        file: Arc<File>,
        offset: u64,
        len: usize,
    },
}

/// Result of a slot read: the bytes and how long the read took.
pub type SlotRead = Box<dyn FnOnce(Result<Vec<u8>, NbdError>, Duration) + Send>;
/// Called when a fill worker begins a fill (PGMS's acknowledgement).
pub type FillStarted = Box<dyn FnOnce() + Send>;
/// Result of a fill.
pub type FillDone = Box<dyn FnOnce(Result<(), String>) + Send>;

struct ReadJob {
    slot: u32,
    done: SlotRead,
}

struct FillJob {
    slot: u32,
    deadline: u64,
    seq: u64,
    source: FillSource,
    started: FillStarted,
    done: FillDone,
}

impl PartialEq for FillJob {
    fn eq(&self, o: &Self) -> bool {
        (self.deadline, self.seq) == (o.deadline, o.seq)
    }
}
impl Eq for FillJob {}
impl PartialOrd for FillJob {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for FillJob {
    /// Max-heap order: the earliest deadline is the greatest.
    fn cmp(&self, o: &Self) -> CmpOrdering {
        (o.deadline, o.seq).cmp(&(self.deadline, self.seq))
    }
}

#[derive(Default)]
struct Queues {
    reads: VecDeque<ReadJob>,
    fills: BinaryHeap<FillJob>,
    seq: u64,
    stopping: bool,
}

/// One donor: its queues, workers and state.
pub struct DonorLane {
    pub name: String,
    memory: Endpoint,
    pub slots: u32,
    pub has_replica: bool,
    block_size: usize,
    failed: AtomicBool,
    queues: Mutex<Queues>,
    wake: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Memory workers and fill workers per donor.
const MEMORY_WORKERS: usize = 2;
const FILL_WORKERS: usize = 2;

impl DonorLane {
    /// Connects to the donor (checking export sizes) and starts its workers.
    pub fn start(
        id: usize,
        arg: &DonorArg,
        block_size: usize,
        replica_size: u64,
        disk: Arc<Disk>,
        timeouts: netpager_nbd::Timeouts,
    ) -> Result<Arc<DonorLane>, DonorError> {
        let name = format!("{}/{}", arg.memory.addr(), arg.memory.export);
        let probe = Connection::connect(&arg.memory, timeouts.connect).map_err(|source| {
            DonorError::Connect {
                name: name.clone(),
                source,
            }
        })?;
        let export_slots = probe.size() / block_size as u64;
        drop(probe);
        let slots = arg
            .slots
            .map_or(export_slots, |s| u64::from(s).min(export_slots));
        let slots = u32::try_from(slots).unwrap_or(u32::MAX);
        if slots == 0 {
            return Err(DonorError::ExportTooSmall { name, block_size });
        }
        if let Some(r) = &arg.replica {
            let c = Connection::connect(r, timeouts.connect).map_err(|source| {
                DonorError::ReplicaConnect {
                    name: name.clone(),
                    source,
                }
            })?;
            if c.size() < replica_size {
                return Err(DonorError::ReplicaTooSmall {
                    replica: format!("{}/{}", r.addr(), r.export),
                    name,
                    size: c.size(),
                    needed: replica_size,
                });
            }
        }
        let lane = Arc::new(DonorLane {
            name,
            memory: arg.memory.clone(),
            slots,
            has_replica: arg.replica.is_some(),
            block_size,
            failed: AtomicBool::new(false),
            queues: Mutex::new(Queues::default()),
            wake: Condvar::new(),
            threads: Mutex::new(Vec::new()),
        });
        let mut threads = Vec::new();
        for w in 0..MEMORY_WORKERS {
            let (lane2, ep) = (lane.clone(), arg.memory.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("donor{id}-mem{w}"))
                    .spawn(move || lane2.memory_worker(&ep, timeouts))?,
            );
        }
        for w in 0..FILL_WORKERS {
            let (lane2, ep, rep, disk) = (
                lane.clone(),
                arg.memory.clone(),
                arg.replica.clone(),
                disk.clone(),
            );
            threads.push(
                std::thread::Builder::new()
                    .name(format!("donor{id}-fill{w}"))
                    .spawn(move || lane2.fill_worker(&ep, rep.as_ref(), &disk, timeouts))?,
            );
        }
        *lane.threads.lock().expect("donor threads lock") = threads;
        Ok(lane)
    }

    /// Waits for the next job `pick` takes from the queues; `None` once the
    /// donor stops or fails.
    fn next_job<J>(&self, pick: impl Fn(&mut Queues) -> Option<J>) -> Option<J> {
        let mut q = self.queues.lock().expect("donor queue lock");
        loop {
            if q.stopping || self.failed() {
                return None;
            }
            if let Some(j) = pick(&mut q) {
                return Some(j);
            }
            q = self.wake.wait(q).expect("donor queue lock");
        }
    }

    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Failed or stopping: it takes no more work, and fails at once (on
    /// the caller's own stack) whatever it is given.
    pub fn refuses_work(&self) -> bool {
        self.failed() || self.queues.lock().expect("donor queue lock").stopping
    }

    /// Reads slot `slot` (a whole block) for a global-to-local fill.
    pub fn read_slot(&self, slot: u32, done: SlotRead) {
        let mut q = self.queues.lock().expect("donor queue lock");
        if q.stopping || self.failed() {
            drop(q);
            done(Err(self.unavailable()), Duration::ZERO);
            return;
        }
        q.reads.push_back(ReadJob { slot, done });
        self.wake.notify_all();
    }

    /// Queues a disk-to-global fill of `slot`.
    pub fn fill(
        &self,
        slot: u32,
        deadline: u64,
        source: FillSource,
        started: FillStarted,
        done: FillDone,
    ) {
        let mut q = self.queues.lock().expect("donor queue lock");
        if q.stopping || self.failed() {
            drop(q);
            done(Err(format!("donor {} unavailable", self.name)));
            return;
        }
        q.seq += 1;
        let seq = q.seq;
        q.fills.push(FillJob {
            slot,
            deadline,
            seq,
            source,
            started,
            done,
        });
        self.wake.notify_all();
    }

    fn unavailable(&self) -> NbdError {
        NbdError::Unavailable {
            addr: self.name.clone(),
        }
    }

    /// Marks the donor failed and fails everything queued.
    fn fail(&self, why: &str) {
        if self.failed.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(
            "donor {} failed: {why}; its blocks are dropped, reads go to disk",
            self.name
        );
        self.drain();
    }

    fn drain(&self) {
        let (reads, fills) = {
            let mut q = self.queues.lock().expect("donor queue lock");
            self.wake.notify_all();
            (
                q.reads.drain(..).collect::<Vec<_>>(),
                std::mem::take(&mut q.fills).into_vec(),
            )
        };
        for r in reads {
            (r.done)(Err(self.unavailable()), Duration::ZERO);
        }
        for f in fills {
            (f.done)(Err(format!("donor {} unavailable", self.name)));
        }
    }

    /// Stops the workers, failing whatever is still queued.
    pub fn stop(&self) {
        self.queues.lock().expect("donor queue lock").stopping = true;
        self.drain();
        for t in self.threads.lock().expect("donor threads lock").drain(..) {
            let _ = t.join();
        }
    }

    /// Trims the first `bytes` of the memory export on a connection of its
    /// own, so the donor frees what this prefetchd stored there.
    pub fn trim_all(&self, bytes: u64, t: netpager_nbd::Timeouts) -> Result<(), NbdError> {
        // Well under NBD's 32-bit request length.
        const CHUNK: u64 = 64 << 20;
        let mut conn = Connection::connect(&self.memory, t.connect)?;
        let mut at = 0;
        while at < bytes {
            let len = CHUNK.min(bytes - at);
            conn.trim(len, at, t.request)?;
            at += len;
        }
        Ok(())
    }

    fn connect(&self, ep: &Endpoint, t: netpager_nbd::Timeouts) -> Option<Connection> {
        match Connection::connect(ep, t.connect) {
            Ok(c) => Some(c),
            Err(e) => {
                self.fail(&e.to_string());
                None
            }
        }
    }

    fn memory_worker(&self, ep: &Endpoint, t: netpager_nbd::Timeouts) {
        let Some(mut conn) = self.connect(ep, t) else {
            return;
        };
        let mut buf = vec![0u8; self.block_size];
        loop {
            let Some(job) = self.next_job(|q| q.reads.pop_front()) else {
                return;
            };
            let began = Instant::now();
            let offset = u64::from(job.slot) * self.block_size as u64;
            match conn.pread(&mut buf, offset, t.request) {
                Ok(()) => (job.done)(Ok(buf.clone()), began.elapsed()),
                Err(e) => {
                    (job.done)(Err(e.clone()), began.elapsed());
                    self.fail(&e.to_string());
                    return;
                }
            }
        }
    }

    fn fill_worker(
        &self,
        ep: &Endpoint,
        replica: Option<&Endpoint>,
        disk: &Disk,
        t: netpager_nbd::Timeouts,
    ) {
        let Some(mut conn) = self.connect(ep, t) else {
            return;
        };
        let mut rconn = match replica {
            Some(r) => match self.connect(r, t) {
                Some(c) => Some(c),
                None => return,
            },
            None => None,
        };
        let mut buf = vec![0u8; self.block_size];
        loop {
            let Some(job) = self.next_job(|q| q.fills.pop()) else {
                return;
            };
            (job.started)();
            let slot_offset = u64::from(job.slot) * self.block_size as u64;
            let read = match job.source {
                FillSource::Replica { offset, len } => match rconn.as_mut() {
                    Some(rc) => rc
                        .pread(&mut buf[..len], offset, t.request)
                        .map(|()| len)
                        .map_err(|e| (e.to_string(), true)),
                    None => Err((format!("donor {} has no replica", self.name), false)),
                },
                FillSource::LocalDisk { file, offset, len } => {
                    match disk.read_blocking(file, offset, len, Urgency::Prefetch) {
                        Ok(bytes) => {
                            buf[..bytes.len()].copy_from_slice(&bytes);
                            Ok(bytes.len())
                        }
                        Err(e) => Err((format!("local disk read at offset {offset}: {e}"), false)),
                    }
                }
            };
            let result = read.and_then(|n| {
                conn.pwrite(
                    &buf[..n.max(1).min(self.block_size)],
                    slot_offset,
                    t.request,
                )
                .map_err(|e| (e.to_string(), true))
            });
            match result {
                Ok(()) => (job.done)(Ok(())),
                Err((e, donor_fault)) => {
                    (job.done)(Err(e.clone()));
                    if donor_fault {
                        self.fail(&e);
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_donor_arguments() {
        let d: DonorArg = "127.0.0.2:10809/mem,replica=127.0.0.2:10810,slots=64"
            .parse()
            .unwrap();
        assert_eq!(
            (
                d.memory.host.as_str(),
                d.memory.port,
                d.memory.export.as_str()
            ),
            ("127.0.0.2", 10809, "mem")
        );
        let r = d.replica.unwrap();
        assert_eq!((r.port, r.export.as_str()), (10810, ""));
        assert_eq!((d.slots, d.status), (Some(64), None));
        let d: DonorArg = "127.0.0.2:10809,status=[::1]:10900".parse().unwrap();
        assert_eq!(d.status.as_deref(), Some("[::1]:10900"));
        assert!("127.0.0.2:10809,status=10900".parse::<DonorArg>().is_err());
        assert!("127.0.0.1".parse::<DonorArg>().is_err());
        assert!("127.0.0.1:1,color=red".parse::<DonorArg>().is_err());
        assert!("127.0.0.1:x".parse::<DonorArg>().is_err());
    }

    #[test]
    fn ipv6_donors_lose_their_brackets() {
        let d: DonorArg = "[::1]:10809/mem".parse().unwrap();
        assert_eq!((d.memory.host.as_str(), d.memory.port), ("::1", 10809));
        let e = crate::error_chain(&"::1:10809".parse::<DonorArg>().unwrap_err());
        assert!(e.contains("brackets"), "{e}");
    }
}
