//! The planner driving a whole job against simulated disks and donors: a
//! small discrete-event simulation on the planner's clock.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::*;

/// A small discrete-event simulation: one job reads `refs` one block at
/// a time with `gap` compute between reads; the local disk and each
/// donor's replica serve one request at a time in `fd`; donor memory
/// answers in `fg`.
struct Sim {
    e: Engine,
    job: JobId,
    now: Nanos,
    events: BinaryHeap<Reverse<(Nanos, u64, Ev)>>,
    seq: u64,
    disk_free: Nanos,
    replica_free: Vec<Nanos>,
    fd: Nanos,
    fg: Nanos,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    JobRead,
    Run(RunId),
    Local(BlockId),
    Global(BlockId),
}

impl Sim {
    fn new(e: Engine, job: JobId, donors: usize) -> Sim {
        Sim {
            e,
            job,
            now: 0,
            events: BinaryHeap::new(),
            seq: 0,
            disk_free: 0,
            replica_free: vec![0; donors],
            fd: 10 * MS,
            fg: 200 * US,
        }
    }

    fn at(&mut self, t: Nanos, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, ev)));
    }

    fn issue(&mut self, a: Action) {
        match a {
            Action::ReadDisk { run, .. } => {
                // The disk's cost is per request, whatever its length.
                self.disk_free = self.disk_free.max(self.now) + self.fd;
                let t = self.disk_free;
                self.at(t, Ev::Run(run));
            }
            Action::FillLocal { block, .. } => {
                let t = self.now + self.fg;
                self.at(t, Ev::Local(block));
            }
            Action::FillGlobal {
                block, donor, from, ..
            } => {
                let free = match from {
                    GlobalSource::Replica => &mut self.replica_free[donor],
                    GlobalSource::LocalDisk => &mut self.disk_free,
                };
                *free = (*free).max(self.now) + self.fd;
                let t = *free + self.fg;
                self.at(t, Ev::Global(block));
            }
        }
    }

    /// Runs the job to its end; returns the elapsed time.
    fn run(&mut self, refs: &[u64], gap: Nanos) -> Nanos {
        let mut next = 0;
        let mut waiting: Option<BlockId> = None;
        self.at(0, Ev::JobRead);
        while let Some(Reverse((t, _, ev))) = self.events.pop() {
            self.now = t;
            // Blocks that reached local memory at `t`.
            let filled = match ev {
                Ev::JobRead => {
                    let block = b(refs[next]);
                    self.e.read_started(Some(self.job), 1, t);
                    match self.e.access(Some(self.job), block, t) {
                        Step::Hit { .. } => {
                            self.e.read_done(Some(self.job), t, 10 * US, 0, 1);
                            next += 1;
                            if next < refs.len() {
                                self.at(t + 10 * US + gap, Ev::JobRead);
                            }
                        }
                        Step::Wait => waiting = Some(block),
                        Step::Fetch(a) => {
                            waiting = Some(block);
                            self.issue(a);
                        }
                    }
                    Vec::new()
                }
                Ev::Run(run) => self.e.run_done(run),
                Ev::Local(block) => vec![block],
                Ev::Global(block) => {
                    self.e.global_filled(block, t);
                    if waiting == Some(block) && !self.e.local.contains_key(&block) {
                        if let Step::Fetch(a) = self.e.retry(block, t) {
                            self.issue(a);
                        }
                    }
                    Vec::new()
                }
            };
            for block in filled {
                self.e.local_filled(block);
                if waiting == Some(block) {
                    waiting = None;
                    self.e.read_done(Some(self.job), t, 0, 1, 1);
                    next += 1;
                    if next < refs.len() {
                        self.at(t + gap, Ev::JobRead);
                    }
                }
            }
            for a in self.e.plan(self.now) {
                self.issue(a);
            }
        }
        assert_eq!(next, refs.len(), "the job finished");
        self.now
    }
}

fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn simulate(refs: &[u64], n_donors: usize, prefetch: bool) -> (Nanos, JobStats) {
    let e = Engine::new(
        EngineConfig {
            prefetch,
            ..cfg(128)
        },
        &donors(n_donors, 128, true),
    );
    run_sim(e, refs, n_donors)
}

/// Runs one job reading `refs` (250 us of compute apart) on `e` to its end;
/// the simulated time it took and its statistics.
fn run_sim(mut e: Engine, refs: &[u64], n_donors: usize) -> (Nanos, JobStats) {
    let job = e.add_job("sim", source(refs.to_vec()));
    let mut sim = Sim::new(e, job, n_donors);
    let took = sim.run(refs, 250 * US);
    (took, sim.e.status().jobs[0].stats)
}

#[test]
fn simulated_coalescing_cuts_disk_requests_for_clustered_reads() {
    // 16 regions of 16 blocks, regions in random order, blocks in
    // random order within each: what a B-tree scan looks like.
    let mut refs = Vec::new();
    for r in shuffled(16, 3) {
        refs.extend(shuffled(16, r + 11).into_iter().map(|i| r * 16 + i));
    }
    let run = |coalesce: u32| {
        let e = Engine::new(
            EngineConfig {
                coalesce: CoalesceConfig {
                    max_blocks: coalesce,
                    max_gap: 2,
                },
                ..cfg(128)
            },
            &[],
        );
        run_sim(e, &refs, 0)
    };
    let (single, s1) = run(1);
    let (coalesced, s32) = run(32);
    for s in [&s1, &s32] {
        assert_eq!(s.hits.local + s.hits.global + s.hits.disk, s.blocks);
    }
    // Simulated time, so a comparison is deterministic here.
    assert!(
        coalesced * 3 < single,
        "single {single} coalesced {coalesced}"
    );
}

#[test]
fn simulated_random_workload_gains_from_donors_and_counts_add_up() {
    let refs = shuffled(400, 7);
    let (none, s0) = simulate(&refs, 0, false);
    let (local, s1) = simulate(&refs, 0, true);
    let (coop, s4) = simulate(&refs, 4, true);
    for s in [&s0, &s1, &s4] {
        assert_eq!(s.blocks, refs.len() as u64);
        assert_eq!(s.hits.local + s.hits.global + s.hits.disk, s.blocks);
    }
    assert_eq!(s0.hits.disk, 400);
    // Prefetching turns demand disk reads into local hits...
    assert!(s1.disk_to_local.used > 300, "{s1:?}");
    // ...and four donors with their own disks bring most blocks ahead of
    // time into global memory, the local disk the rest, and then they
    // are prefetched into local memory.
    assert!(s4.disk_to_global.used > 250, "{s4:?}");
    assert!(
        s4.global_to_local.used + s4.disk_to_local.used > 300,
        "{s4:?}"
    );
    assert!(s4.hits.disk < 40, "{s4:?}");
    // Simulated time, so a comparison is deterministic here.
    assert!(
        local <= none && coop * 2 < local,
        "none {none} local {local} coop {coop}"
    );
}
