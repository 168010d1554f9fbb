//! The daemon's I/O: starting the engine's actions on the disk and the
//! donors' lanes, and taking their results back to the engine and to the
//! reads waiting for them.

use super::*;

impl Daemon {
    /// Gives `bytes` of `block` to every read waiting for it.
    pub(super) fn deliver(
        &self,
        st: &mut State,
        block: BlockId,
        bytes: &[u8],
        done: &mut Finished,
    ) {
        let Some(ids) = st.waiters.remove(&block) else {
            return;
        };
        let at = block.index * self.bs as u64;
        for id in ids {
            let Some(r) = st.reads.get_mut(&id) else {
                continue;
            };
            debug_assert_eq!(r.file, block.file);
            copy_block(bytes, at, r.offset, &mut r.data);
            r.remaining -= 1;
            if r.remaining == 0 {
                let r = st.reads.remove(&id).expect("present");
                let took = r.started.elapsed().as_nanos() as Nanos;
                st.engine.read_done(r.job, self.now(), took, took, r.blocks);
                done.push((r.reply, Ok(r.data)));
            }
        }
    }

    /// Fails every read waiting for `block` with `errno`.
    pub(super) fn fail_waiters(
        &self,
        st: &mut State,
        block: BlockId,
        errno: i32,
        done: &mut Finished,
    ) {
        let Some(ids) = st.waiters.remove(&block) else {
            return;
        };
        for id in ids {
            if let Some(r) = st.reads.remove(&id) {
                done.push((r.reply, Err(errno)));
            }
        }
    }

    /// A fill into local memory from a donor finished.
    pub(super) fn local_fill_done(
        self: &Arc<Self>,
        block: BlockId,
        from: LocalSource,
        result: Result<&[u8], String>,
    ) {
        self.completing(|st, actions, done| {
            self.block_arrived(st, block, from, result, actions, done);
        });
    }

    /// Runs `f` under the lock, then plans: answers the reads `f` finished
    /// and starts the I/O `f` and the plan decided, once the lock is
    /// released.
    fn completing(self: &Arc<Self>, f: impl FnOnce(&mut State, &mut Vec<Action>, &mut Finished)) {
        let mut done: Finished = Vec::new();
        let actions = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let mut actions = Vec::new();
            f(st, &mut actions, &mut done);
            actions.extend(st.engine.plan(self.now()));
            actions
        };
        answer(done);
        self.execute(actions);
    }

    /// Disk request `run`, reading from block `first` of its file, finished.
    pub(super) fn disk_run_done(
        self: &Arc<Self>,
        run: RunId,
        first: u64,
        result: Result<&[u8], String>,
    ) {
        self.completing(|st, actions, done| {
            for block in st.engine.run_done(run) {
                let bytes = result.as_ref().map_err(Clone::clone).map(|b| {
                    let at = ((block.index - first) as usize * self.bs).min(b.len());
                    &b[at..(at + self.bs).min(b.len())]
                });
                self.block_arrived(st, block, LocalSource::Disk, bytes, actions, done);
            }
        });
    }

    /// One block of a fill into local memory arrived (or failed to).
    pub(super) fn block_arrived(
        &self,
        st: &mut State,
        block: BlockId,
        from: LocalSource,
        result: Result<&[u8], String>,
        actions: &mut Vec<Action>,
        done: &mut Finished,
    ) {
        match result {
            Ok(bytes) => {
                if let Some(buf) = st.engine.local_filled(block) {
                    let b = buf as usize;
                    let n = bytes.len().min(self.bs);
                    st.cache[b * self.bs..b * self.bs + n].copy_from_slice(&bytes[..n]);
                    st.cache_len[b] = n as u32;
                }
                self.deliver(st, block, bytes, done);
            }
            Err(e) => {
                st.engine.local_failed(block);
                if let LocalSource::Global { donor, .. } = from {
                    tracing::debug!(
                        "block {block:?} from donor {donor}: {e}; reading it from disk"
                    );
                    if self.lanes.get(donor).refuses_work() {
                        st.engine.donor_failed(donor);
                    }
                } else {
                    tracing::warn!(
                        "disk read of block {} of file {}: {e}",
                        block.index,
                        block.file
                    );
                }
                if st.waiters.contains_key(&block) {
                    match (from, st.engine.retry(block, self.now())) {
                        (LocalSource::Disk, _) => self.fail_waiters(st, block, libc::EIO, done),
                        (_, Step::Fetch(a)) => actions.push(a),
                        (_, Step::Hit { buf }) => {
                            let b = buf as usize;
                            let bytes = st.cache
                                [b * self.bs..b * self.bs + st.cache_len[b] as usize]
                                .to_vec();
                            self.deliver(st, block, &bytes, done);
                        }
                        (_, Step::Wait) => {}
                    }
                }
            }
        }
    }

    /// A disk-to-global fill finished.
    pub(super) fn global_fill_done(
        self: &Arc<Self>,
        block: BlockId,
        donor: usize,
        result: Result<(), String>,
    ) {
        let actions = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let now = self.now();
            match result {
                Ok(()) => st.engine.global_filled(block, now),
                Err(e) => {
                    tracing::debug!("disk-to-global fill of block {block:?} on donor {donor}: {e}");
                    st.engine.global_failed(block);
                    // A lane that stopped (let go, or the daemon stopping)
                    // fails a fill on the planner's own stack: planned on
                    // again, the retries would recurse until the stack ran
                    // out (prefetchd died of it when a donor was let go).
                    if self.lanes.get(donor).refuses_work() {
                        st.engine.donor_failed(donor);
                    }
                }
            }
            let mut actions = Vec::new();
            if st.waiters.contains_key(&block) {
                if let Step::Fetch(a) = st.engine.retry(block, now) {
                    actions.push(a);
                }
            }
            actions.extend(st.engine.plan(now));
            actions
        };
        self.execute(actions);
    }

    /// Starts the I/O of `actions`; the lock must not be held.
    pub(super) fn execute(self: &Arc<Self>, actions: Vec<Action>) {
        let bs = self.bs as u64;
        for a in actions {
            match a {
                Action::ReadDisk {
                    run,
                    file,
                    first,
                    count,
                    prefetch,
                } => {
                    let me = self.clone();
                    let Some(entry) = self.files.by_id(file) else {
                        self.disk_run_done(run, first, Err(format!("unknown file id {file}")));
                        continue;
                    };
                    let submitted = self.now();
                    let urgency = if prefetch {
                        Urgency::Prefetch
                    } else {
                        Urgency::Demand
                    };
                    self.disk.read(
                        entry.file.clone(),
                        first * bs,
                        count as usize * self.bs,
                        urgency,
                        Box::new(move |r| {
                            if r.is_ok() {
                                let now = me.now();
                                me.lock().engine.disk_sample(submitted, now);
                            }
                            me.disk_run_done(run, first, r.map_err(|e| e.to_string()));
                        }),
                    );
                }
                Action::FillLocal {
                    block, donor, slot, ..
                } => {
                    let me = self.clone();
                    let from = LocalSource::Global { donor, slot };
                    let file_size = self.files.by_id(block.file).map_or(0, |f| f.size());
                    let valid = file_size.saturating_sub(block.index * bs).min(bs) as usize;
                    self.lanes.get(donor).read_slot(
                        slot,
                        Box::new(move |r, took| {
                            if r.is_ok() {
                                me.lock().engine.global_sample(took.as_nanos() as Nanos);
                            }
                            let r = r.map_err(|e| e.to_string());
                            me.local_fill_done(
                                block,
                                from,
                                r.as_ref()
                                    .map(|b| &b[..valid.min(b.len())])
                                    .map_err(|e| e.clone()),
                            );
                        }),
                    );
                }
                Action::FillGlobal {
                    block,
                    donor,
                    slot,
                    from,
                    deadline,
                } => {
                    let Some(file) = self.files.by_id(block.file) else {
                        self.global_fill_done(
                            block,
                            donor,
                            Err(format!("unknown file id {}", block.file)),
                        );
                        continue;
                    };
                    let at = block.index * bs;
                    let len = file.size().saturating_sub(at).min(bs) as usize;
                    let source = match (from, file.replica_offset) {
                        (GlobalSource::Replica, Some(base)) => FillSource::Replica {
                            offset: base + at,
                            len,
                        },
                        _ => FillSource::LocalDisk {
                            file: file.file.clone(),
                            offset: at,
                            len: self.bs,
                        },
                    };
                    let (me, me2) = (self.clone(), self.clone());
                    self.lanes.get(donor).fill(
                        slot,
                        deadline,
                        source,
                        Box::new(move || me.lock().engine.global_started(block)),
                        Box::new(move |r| me2.global_fill_done(block, donor, r)),
                    );
                }
            }
        }
    }
}
