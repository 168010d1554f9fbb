//! Global memory: donors' slots, disk-to-global prefetching (aggressive,
//! in order of use) and what becomes of its fills and of the donors.

use super::*;

impl Engine {
    /// The donor began a disk-to-global fill.
    pub fn global_started(&mut self, block: BlockId) {
        if let Some(g) = self.global.get_mut(&block) {
            g.started = true;
        }
    }

    /// A disk-to-global fill completed: the block is in the donor's slot.
    pub fn global_filled(&mut self, block: BlockId, now: Nanos) {
        let Some(g) = self.global.get_mut(&block) else {
            return;
        };
        if !g.filling {
            return;
        }
        g.filling = false;
        g.started = true;
        g.last_use = now;
        let (donor, from_local_disk) = (g.donor, !self.donors[g.donor].spec.replica);
        if !self.donors[donor].alive {
            // Landed in a donor that is gone or was let go meanwhile.
            let g = self.global.remove(&block).expect("present");
            self.donors[donor].slots.release(g.slot);
            if let Some(p) = g.prefetch {
                self.credit(p, false);
            }
        }
        self.finish_global(donor, from_local_disk);
    }

    /// A disk-to-global fill failed: the slot is free again.
    pub fn global_failed(&mut self, block: BlockId) {
        let Some(g) = self.global.get(&block) else {
            return;
        };
        if !g.filling {
            return;
        }
        let g = self.global.remove(&block).expect("present");
        let d = &mut self.donors[g.donor];
        d.slots.release(g.slot);
        let from_local_disk = !d.spec.replica;
        if let Some(p) = g.prefetch {
            self.credit(p, false);
        }
        self.finish_global(g.donor, from_local_disk);
    }

    pub(super) fn finish_global(&mut self, donor: DonorId, from_local_disk: bool) {
        let d = &mut self.donors[donor];
        d.outstanding = d.outstanding.saturating_sub(1);
        if from_local_disk {
            self.disk_prefetching = self.disk_prefetching.saturating_sub(1);
        }
        self.global_dirty = true;
    }

    /// A donor comes (back): a fresh one, with every slot empty, under a
    /// new id (requests decided for an earlier life of the same donor keep
    /// the old id, so they can never touch the new one's slots).
    pub fn add_donor(&mut self, spec: DonorSpec) -> DonorId {
        self.donors.push(Donor {
            spec,
            alive: true,
            slots: SlotTable::new(spec.slots),
            outstanding: 0,
        });
        self.global_dirty = true;
        self.donors.len() - 1
    }

    /// A donor stopped answering, or is let go: everything it held is
    /// forgotten and it gets no more requests. Fills in flight report their
    /// own end.
    pub fn donor_failed(&mut self, donor: DonorId) {
        let Some(d) = self.donors.get_mut(donor) else {
            return;
        };
        if !d.alive {
            return;
        }
        d.alive = false;
        let lost: Vec<BlockId> = d.slots.occupied().map(|(_, b)| b).collect();
        for block in lost {
            if let Some(g) = self.global.get(&block) {
                if !g.filling {
                    let g = self.global.remove(&block).expect("present");
                    if let Some(p) = g.prefetch {
                        self.credit(p, false);
                    }
                }
            }
        }
        let d = &mut self.donors[donor];
        let gone: Vec<u32> = d
            .slots
            .occupied()
            .filter(|(_, b)| !self.global.contains_key(b))
            .map(|(i, _)| i)
            .collect();
        for i in gone {
            d.slots.release(i);
        }
        self.global_dirty = true;
    }

    /// The hinted references of every following job in order of expected
    /// use, at most `global_scan` of them: (time to use, block, job).
    pub(super) fn upcoming_by_time(&self) -> Vec<(Nanos, BlockId, JobId)> {
        let mut all = Vec::new();
        for (&id, j) in &self.jobs {
            if !j.cursor.hinted() {
                continue;
            }
            let per_ref = self.per_ref(j);
            all.extend(
                j.cursor
                    .upcoming()
                    .take(self.cfg.global_scan)
                    .map(|(d, b)| (time_until(d, per_ref), b, id)),
            );
        }
        // Each job's references are already in order; a stable sort merges.
        all.sort_by_key(|&(t, _, _)| t);
        all.truncate(self.cfg.global_scan);
        all
    }

    /// Aggressive disk-to-global prefetching.
    pub(super) fn plan_global(&mut self, now: Nanos, out: &mut Vec<Action>) {
        let mut victims: Vec<Option<Option<(Nanos, u32)>>> = vec![None; self.donors.len()];
        for (t, block, job) in self.upcoming_by_time() {
            if self.local.contains_key(&block) || self.global.contains_key(&block) {
                continue;
            }
            let mut placed = false;
            for k in 0..self.donors.len() {
                let d = (self.donor_rr + k) % self.donors.len();
                let donor = &self.donors[d];
                if !donor.alive || donor.outstanding >= self.cfg.donor_outstanding {
                    continue;
                }
                if !donor.spec.replica && self.disk_prefetching >= self.cfg.disk_prefetch_depth {
                    continue;
                }
                let slot = if let Some(s) = self.donors[d].slots.take_free() {
                    s
                } else {
                    let v = match victims[d] {
                        Some(v) => v,
                        None => {
                            let v = self.global_victim(d, now);
                            victims[d] = Some(v);
                            v
                        }
                    };
                    match v {
                        Some((value, slot)) if value > t => {
                            victims[d] = None;
                            self.evict_global(d, slot);
                            slot
                        }
                        _ => continue,
                    }
                };
                let replica = self.donors[d].spec.replica;
                let donor = &mut self.donors[d];
                donor.slots.put(slot, block);
                donor.outstanding += 1;
                if !replica {
                    self.disk_prefetching += 1;
                }
                self.global.insert(
                    block,
                    GlobalEntry {
                        donor: d,
                        slot,
                        filling: true,
                        started: false,
                        readers: 0,
                        last_use: now,
                        last_user: Some(job),
                        prefetch: Some(Pending {
                            job,
                            kind: Kind::DiskToGlobal,
                        }),
                    },
                );
                self.count_issued(job, Kind::DiskToGlobal);
                out.push(Action::FillGlobal {
                    block,
                    donor: d,
                    slot,
                    from: if replica {
                        GlobalSource::Replica
                    } else {
                        GlobalSource::LocalDisk
                    },
                    deadline: now.saturating_add(t),
                });
                self.donor_rr = (d + 1) % self.donors.len();
                placed = true;
                break;
            }
            // References come in order of use: once no donor takes this one,
            // none takes a later one.
            if !placed {
                return;
            }
        }
    }

    /// The block in `donor` used furthest in the future: (value, slot).
    pub(super) fn global_victim(&self, donor: DonorId, now: Nanos) -> Option<(Nanos, u32)> {
        let victim = self.donors[donor]
            .slots
            .victim(self.cfg.eviction_sample, |block| {
                let g = &self.global[&block];
                (!g.filling && g.readers == 0)
                    .then(|| self.time_to_use(block, g.last_use, g.last_user, now))
            });
        victim.map(|(value, slot, _)| (value, slot))
    }

    pub(super) fn evict_global(&mut self, donor: DonorId, slot: u32) {
        let d = &mut self.donors[donor];
        d.slots.sweep_past(slot);
        let block = d.slots.vacate(slot).expect("victim slot holds a block");
        let g = self
            .global
            .remove(&block)
            .expect("slot map and entries agree");
        if let Some(p) = g.prefetch {
            self.credit(p, false);
        }
    }

    /// Whether `block` is resident in a donor (not being filled).
    pub fn is_global(&self, block: BlockId) -> bool {
        self.global.get(&block).is_some_and(|g| !g.filling)
    }
}
