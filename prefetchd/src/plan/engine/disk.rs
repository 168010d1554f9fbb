//! Local disk requests: which blocks one request reads (a demand miss
//! with its neighbours or readahead, a prefetch with the job's upcoming
//! blocks), and what a finished request fills.

use super::*;

impl Engine {
    /// A demand read from disk: with the rest of the read, and with the
    /// job's upcoming blocks nearby if it follows its hints, else with a
    /// sequential reader's readahead.
    pub(super) fn demand_disk(
        &mut self,
        block: BlockId,
        job: Option<JobId>,
        ends: Range<u64>,
        now: Nanos,
    ) -> Step {
        let read_end = ends.start;
        let rest = (block.index + 1..read_end).map(|index| RunBlock {
            block: BlockId::new(block.file, index),
            value: Some(0),
            prefetch: None,
        });
        let mut blocks = vec![RunBlock {
            block,
            value: None,
            prefetch: None,
        }];
        match job.filter(|_| self.follows(job)) {
            Some(id) => {
                let wanted = self.upcoming_missing(id, block.file);
                let run = coalesce::run_around(
                    block.index,
                    &wanted.iter().map(|w| w.block.index).collect::<Vec<_>>(),
                    self.cfg.coalesce,
                );
                blocks.extend(rest);
                blocks.extend(
                    wanted
                        .into_iter()
                        .filter(|w| run.contains(&w.block.index) && w.block.index >= read_end),
                );
            }
            None => {
                let max = u64::from(self.cfg.readahead_blocks);
                let run = self
                    .streams
                    .entry((job, block.file))
                    .or_default()
                    .miss(block.index..read_end, max);
                blocks.extend(rest);
                blocks.extend((read_end..run.end.min(ends.end)).map(|index| RunBlock {
                    block: BlockId::new(block.file, index),
                    value: Some(0),
                    prefetch: None,
                }));
            }
        }
        let run = self
            .start_run(blocks, job, RunKind::Demand, now)
            .expect("a waited-for block always joins its run");
        Step::Fetch(run)
    }

    /// The next blocks of `file` job `id` will read that are neither local
    /// nor in global memory, first use first, as prefetches of the job.
    /// Only as far ahead as local memory holds blocks: one used later would
    /// likely be evicted before its use by those used before it.
    pub(super) fn upcoming_missing(&self, id: JobId, file: FileId) -> Vec<RunBlock> {
        let Some(j) = self.jobs.get(&id) else {
            return Vec::new();
        };
        let per_ref = self.per_ref(j);
        let mut seen = HashSet::new();
        j.cursor
            .upcoming()
            .take(self.cfg.forestall_scan.min(self.bufs.capacity()))
            .filter(|(_, b)| {
                b.file == file
                    && !self.local.contains_key(b)
                    && !self.global.contains_key(b)
                    && seen.insert(*b)
            })
            .map(|(d, block)| RunBlock {
                block,
                value: Some(time_until(d, per_ref)),
                prefetch: Some(Pending {
                    job: id,
                    kind: Kind::DiskToLocal,
                }),
            })
            .collect()
    }

    /// One disk request filling what it can of `blocks` (the first is the
    /// one it is made for: without a buffer for it, there is no request),
    /// reading from the lowest to the highest block filled, at most
    /// [`Engine::max_run`] blocks.
    pub(super) fn start_run(
        &mut self,
        blocks: Vec<RunBlock>,
        job: Option<JobId>,
        kind: RunKind,
        now: Nanos,
    ) -> Option<Action> {
        let file = blocks.first()?.block.file;
        let limit = u64::from(self.max_run());
        let mut filled: Vec<BlockId> = Vec::with_capacity(blocks.len());
        let mut span = blocks[0].block.index..blocks[0].block.index + 1;
        for (i, rb) in blocks.into_iter().enumerate() {
            let index = rb.block.index;
            let wider = span.start.min(index)..span.end.max(index + 1);
            if wider.end - wider.start > limit {
                continue;
            }
            if self.local.contains_key(&rb.block) {
                if i == 0 {
                    return None;
                }
                continue;
            }
            let buf = match rb.value {
                None => self.take_buffer(None, now),
                Some(v) => match self.take_buffer(Some(v), now) {
                    Some(b) => Some(b),
                    None if i == 0 => return None,
                    None => continue,
                },
            };
            if let Some(p) = rb.prefetch {
                self.count_issued(p.job, p.kind);
            }
            self.local.insert(
                rb.block,
                LocalEntry {
                    buf,
                    filling: Some(LocalSource::Disk),
                    last_use: now,
                    last_user: job,
                    prefetched: kind == RunKind::Prefetch,
                    prefetch: rb.prefetch,
                },
            );
            if let Some(b) = buf {
                self.bufs.put(b, rb.block);
            }
            filled.push(rb.block);
            span = wider;
        }
        let first = filled.iter().map(|b| b.index).min()?;
        let last = filled.iter().map(|b| b.index).max()?;
        let counted = kind == RunKind::Prefetch;
        if counted {
            self.disk_prefetching += 1;
            self.local_prefetching += 1;
        }
        let run = self.next_run;
        self.next_run += 1;
        self.runs.insert(
            run,
            Run {
                blocks: filled,
                counted,
            },
        );
        Some(Action::ReadDisk {
            run,
            file,
            first,
            count: (last - first + 1) as u32,
            prefetch: kind != RunKind::Demand,
        })
    }

    /// The longest disk request, in blocks.
    pub fn max_run(&self) -> u32 {
        self.cfg
            .coalesce
            .max_blocks
            .max(self.cfg.readahead_blocks)
            .max(1)
    }

    /// Disk request `run` finished: the blocks it was to fill, to report
    /// with [`Engine::local_filled`] or [`Engine::local_failed`] each.
    pub fn run_done(&mut self, run: RunId) -> Vec<BlockId> {
        let Some(r) = self.runs.remove(&run) else {
            return Vec::new();
        };
        if r.counted {
            self.disk_prefetching = self.disk_prefetching.saturating_sub(1);
            self.local_prefetching = self.local_prefetching.saturating_sub(1);
        }
        r.blocks
    }
}
