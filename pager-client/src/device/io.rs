//! Moving bytes: requests to members' locations (donor slots through the
//! NBD pools, in parallel; fallback slots through the local file), the
//! preallocated extent buffers, and XOR.
//! Also the one test of whether a member can be read (`Inner::usable`)
//! and the one way a member gives its slot back (`Inner::release_slot`;
//! a whole unit: `Inner::free_unit_locked`).
//!
//! Calls: `netpager-nbd` batches, the fallback file; called by both
//! backends, maintenance and lost.rs. A failed request fails its donor
//! here (after one retry on a fresh connection).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex};

use super::donor::Donor;
use super::{DeviceError, Inner, Result};
use crate::config::FallbackConfig;
use crate::erasure::{CodeError, Codec};
use crate::extent_map::{CopyState, ExtentMap, Loc, Member, SlotOwner, Unit};
use netpager_nbd::{self as nbd, Op};
use netpager_util::{CondvarExt, LockExt};

/// Zeros for zero-writes to local files and parity zeroing.
pub(crate) static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// Extent-sized buffers allocated once, so parity updates, rebuild and
/// drain never allocate large memory on the swap path.
pub(crate) struct BufPool {
    free: Mutex<Vec<Box<[u8]>>>,
    cv: Condvar,
}

impl BufPool {
    pub fn new(n: usize, size: usize) -> BufPool {
        // Filled with a non-zero byte so the pages are really allocated now.
        let free = (0..n)
            .map(|_| vec![0xa5u8; size].into_boxed_slice())
            .collect();
        BufPool {
            free: Mutex::new(free),
            cv: Condvar::new(),
        }
    }

    /// Takes `n` (1 or 2) buffers at once (waiting for them), so two
    /// takers can never each hold part of what the other needs.
    pub fn take(&self, n: usize) -> Bufs<'_> {
        assert!((1..=2).contains(&n), "{n} buffers at once");
        let mut free = self.free.lock_or_recover();
        while free.len() < n {
            free = self.cv.wait_or_recover(free);
        }
        let bufs = [free.pop(), if n == 2 { free.pop() } else { None }];
        Bufs { pool: self, bufs }
    }
}

/// Buffers taken from a [`BufPool`]; they go back on drop (into the pool's
/// own vector, which has room for all of them: no allocation either way).
pub(crate) struct Bufs<'a> {
    pool: &'a BufPool,
    bufs: [Option<Box<[u8]>>; 2],
}

impl Bufs<'_> {
    pub fn one(&mut self, len: usize) -> &mut [u8] {
        &mut self.bufs[0].as_mut().expect("taken")[..len]
    }

    pub fn two(&mut self, len: usize) -> (&mut [u8], &mut [u8]) {
        let [a, b] = &mut self.bufs;
        (
            &mut a.as_mut().expect("taken")[..len],
            &mut b.as_mut().expect("two taken")[..len],
        )
    }
}

impl Drop for Bufs<'_> {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock_or_recover();
        free.extend(self.bufs.iter_mut().filter_map(Option::take));
        self.pool.cv.notify_all();
    }
}

pub(crate) use crate::erasure::xor_into;

/// Codecs made once (Reed-Solomon's working memory is allocated when a
/// codec is made), taken for one encode or decode at a time and never
/// held across I/O, so a taker never waits for anything else.
pub(crate) struct CodecPool {
    free: Mutex<Vec<Codec>>,
    cv: Condvar,
}

impl CodecPool {
    pub fn new(n: usize, k: usize, r: usize, xor: bool) -> std::result::Result<Self, CodeError> {
        let free = (0..n)
            .map(|_| Codec::new(k, r, xor))
            .collect::<std::result::Result<_, _>>()?;
        Ok(CodecPool {
            free: Mutex::new(free),
            cv: Condvar::new(),
        })
    }

    /// Runs `f` with a codec (waiting for one).
    pub fn with<T>(&self, f: impl FnOnce(&mut Codec) -> T) -> T {
        let mut free = self.free.lock_or_recover();
        let mut c = loop {
            match free.pop() {
                Some(c) => break c,
                None => free = self.cv.wait_or_recover(free),
            }
        };
        drop(free);
        let out = f(&mut c);
        self.free.lock_or_recover().push(c);
        self.cv.notify_one();
        out
    }
}

/// The local fallback file (or block device), in extent-sized slots.
pub(crate) struct Fallback {
    file: File,
    pub path: PathBuf,
    extent: u64,
    pub size: u64,
}

/// Opens (creating it if missing, never truncating) a local file the
/// device reads and writes: the fallback file, mode disk's file.
pub(crate) fn open_rw(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

fn write_zeros(file: &File, mut off: u64, mut len: u64) -> std::io::Result<()> {
    while len > 0 {
        let n = len.min(ZEROS.len() as u64);
        file.write_all_at(&ZEROS[..n as usize], off)?;
        off += n;
        len -= n;
    }
    Ok(())
}

impl Fallback {
    pub fn open(cfg: &FallbackConfig, extent: u64, map: &ExtentMap) -> Result<Fallback> {
        let ferr = |source| DeviceError::File {
            path: cfg.path.clone(),
            source,
        };
        let file = open_rw(&cfg.path).map_err(ferr)?;
        let meta = file.metadata().map_err(ferr)?;
        let size = cfg.size.0;
        let in_use = map.slot_usage(SlotOwner::Fallback).0 > 0;
        map.set_capacity(SlotOwner::Fallback, (size / extent) as u32);
        if meta.file_type().is_block_device() {
            let dev_size = std::fs::read_to_string(format!(
                "/sys/dev/block/{}:{}/size",
                libc::major(std::os::unix::fs::MetadataExt::rdev(&meta)),
                libc::minor(std::os::unix::fs::MetadataExt::rdev(&meta))
            ))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(|sectors| sectors * 512);
            if let Some(d) = dev_size {
                if d < size {
                    return Err(ferr(std::io::Error::other(format!(
                        "block device has {d} bytes, fallback.size is {size}"
                    ))));
                }
            }
        } else if !in_use {
            // Nothing of ours is in it: start from a sparse, all-zero file.
            file.set_len(0)
                .and_then(|_| file.set_len(size))
                .map_err(ferr)?;
            map.mark_free_slots_clean(SlotOwner::Fallback);
        } else if meta.len() < size {
            file.set_len(size).map_err(ferr)?;
        }
        Ok(Fallback {
            file,
            path: cfg.path.clone(),
            extent,
            size,
        })
    }

    fn at(&self, slot: u32, off: u64) -> u64 {
        slot as u64 * self.extent + off
    }

    pub fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(|source| DeviceError::File {
            path: self.path.clone(),
            source,
        })
    }

    fn run(&self, slot: u32, off: u64, op: Op<'_>) -> std::io::Result<()> {
        let at = self.at(slot, off);
        match op {
            Op::Read(b) => self.file.read_exact_at(b, at),
            Op::Write(b) => self.file.write_all_at(b, at),
            Op::Zero(n) => write_zeros(&self.file, at, n),
            // Trim is advisory; freed slots are zeroed before partial reuse.
            Op::Trim(_) | Op::Flush => Ok(()),
        }
    }
}

/// Most requests in one batch: one per member of the widest unit.
pub(crate) const MAX_BATCH: usize = crate::config::MAX_WIDTH as usize;

/// Requests by member position, `None` where a member gets none.
pub(crate) type Batch<'b> = [Option<IoReq<'b>>; MAX_BATCH];

/// A batch with no requests yet.
pub(crate) fn batch<'b>() -> Batch<'b> {
    std::array::from_fn(|_| None)
}

/// One request to a member's location: `op` at `off` within its slot.
pub(crate) struct IoReq<'b> {
    pub loc: Loc,
    pub off: u64,
    pub op: Op<'b>,
}

/// Why a request to a location failed.
#[derive(Debug, Clone)]
pub(crate) enum IoFail {
    /// The donor has no room (its budget is used up, or it is draining).
    NoSpace(String),
    /// The donor is failed (now marked so), or the local file failed.
    Failed(String),
}

impl IoFail {
    pub fn reason(&self) -> &str {
        match self {
            IoFail::NoSpace(s) | IoFail::Failed(s) => s,
        }
    }
}

/// Whether a failed request is worth sending once more before its donor is
/// failed: not a refusal for space, not a timeout (its deadline is spent),
/// not a donor marked failed already, not one that restarted.
fn retryable(e: &nbd::NbdError) -> bool {
    !e.is_no_space()
        && !e.is_fenced()
        && !e.is_restarted()
        && !matches!(
            e,
            nbd::NbdError::Timeout { .. }
                | nbd::NbdError::ConnectTimeout { .. }
                | nbd::NbdError::Unavailable { .. }
        )
}

/// Whether to send a request that failed with `e` on `d` once more (see
/// [`retryable`]); counts the retry.
pub(crate) fn retry_once(d: &super::donor::Donor, e: &nbd::NbdError) -> bool {
    let again = retryable(e) && !d.is_failed();
    if again {
        d.retries.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("donor {}: {e}; retrying once", d.cfg.name);
    }
    again
}

/// Sends of a request the donor refused for an older round of
/// connections, each on a new round. Each check of a second name of a
/// member fences the member's round once, so a request is refused as
/// often as such checks come while it waits; a newer session refuses
/// every round, and that is found after the last (`donor_error`).
const STALE_TRIES: usize = 16;

/// Runs a batch of NBD requests, a result for each.
fn run<const N: usize>(
    batch: &mut [Option<nbd::Request<'_, '_>>; N],
) -> [std::result::Result<(), nbd::NbdError>; N] {
    let mut out = std::array::from_fn(|_| Ok(()));
    nbd::run_into(batch, &mut out);
    out
}

/// What became of one request.
pub(crate) type IoResult = std::result::Result<(), IoFail>;

impl Inner {
    /// The entry of the donor in the set holding `loc`, if it is on one.
    pub(crate) fn loc_donor(&self, loc: Loc) -> Option<usize> {
        match loc {
            Loc::Donor { donor, .. } => self.members.by_id(donor),
            Loc::Fallback { .. } => None,
        }
    }

    /// Whether requests to `loc` can be tried now.
    pub(crate) fn loc_available(&self, loc: Loc) -> bool {
        match loc {
            Loc::Fallback { .. } => self.fallback.is_some(),
            Loc::Donor { .. } => self
                .loc_donor(loc)
                .is_some_and(|i| !self.members[i].is_failed()),
        }
    }

    /// Whether member `m` holds its data and can be read now: the one
    /// liveness test for members, in every mode.
    pub(crate) fn usable(&self, m: &Member) -> bool {
        m.state == CopyState::Ok && self.loc_available(m.loc)
    }

    /// Member `m` leaves its slot: trimmed on its donor if that answers
    /// (the donor then frees the memory), the slot given back. A lost
    /// member's slot was given back when it was lost.
    pub(crate) fn release_slot(&self, m: Member) {
        if m.state != CopyState::Ok {
            return;
        }
        let trimmed =
            self.loc_available(m.loc) && self.exec1(m.loc, 0, Op::Trim(self.layout.extent)).is_ok();
        self.give_back(m.loc, trimmed);
    }

    /// Slot `loc` is given back. One not `trimmed` (its donor failed, or
    /// failed on the trim) is noted, to be trimmed should the donor be
    /// taken back: its copies are marked lost later, and only the slots
    /// still in use then are noted there, so the donor kept this one's
    /// pages for nobody (the nemesis, ec: a donor kept 12.5 MB where its
    /// 22 extents fit in 11.5 MB).
    fn give_back(&self, loc: Loc, trimmed: bool) {
        if let (false, Loc::Donor { slot, .. }, Some(i)) = (trimmed, loc, self.loc_donor(loc)) {
            self.members[i].left_behind.lock_or_recover().push(slot);
        }
        self.map.free(loc);
    }

    /// Unit `u` (write-locked as `g`) becomes unplaced, journaled first;
    /// then its members are trimmed on their donors and their slots given
    /// back.
    pub(crate) fn free_unit_locked(&self, u: u64, g: &mut Option<Unit>) -> Result<()> {
        let Some(unit) = g.take() else { return Ok(()) };
        self.map.commit(u, &None)?;
        let owned: Vec<Member> = unit
            .members
            .into_iter()
            .filter(|m| m.state == CopyState::Ok)
            .collect();
        let mut reqs = batch();
        for (m, r) in owned.iter().zip(&mut reqs) {
            *r = self.loc_available(m.loc).then_some(IoReq {
                loc: m.loc,
                off: 0,
                op: Op::Trim(self.layout.extent),
            });
        }
        let res = self.exec(&mut reqs);
        for (m, r) in owned.into_iter().zip(res) {
            self.give_back(m.loc, matches!(r, Some(Ok(()))));
        }
        Ok(())
    }

    /// Runs requests in parallel across donors; a donor that errors or
    /// times out is marked failed here. The result of `reqs[i]` is at `i`
    /// (`None` where there is no request). Everything lives on the stack:
    /// callers size `N` to their batch (at most a unit's members).
    pub(crate) fn exec<const N: usize>(
        &self,
        reqs: &mut [Option<IoReq<'_>>; N],
    ) -> [Option<IoResult>; N] {
        let mut results: [Option<IoResult>; N] = std::array::from_fn(|_| None);
        let mut batch: [Option<nbd::Request<'_, '_>>; N] = std::array::from_fn(|_| None);
        let mut who: [Option<&Donor>; N] = [None; N];
        let mut any = false;
        for (((r, res), req), who) in reqs
            .iter_mut()
            .zip(&mut results)
            .zip(&mut batch)
            .zip(&mut who)
        {
            let Some(r) = r else { continue };
            match r.loc {
                Loc::Fallback { slot } => {
                    *res = Some(match &self.fallback {
                        Some(fb) => fb.run(slot, r.off, r.op.reborrow()).map_err(|e| {
                            IoFail::Failed(format!("fallback {}: {e}", fb.path.display()))
                        }),
                        None => Err(IoFail::Failed(
                            "a fallback slot but no fallback configured".into(),
                        )),
                    });
                }
                Loc::Donor { slot, .. } => {
                    let Some(d) = self.loc_donor(r.loc).map(|i| &self.members[i]) else {
                        *res = Some(Err(IoFail::Failed("donor no longer in the set".into())));
                        continue;
                    };
                    if d.is_failed() {
                        *res = Some(Err(IoFail::Failed(format!(
                            "donor {} is failed",
                            d.cfg.name
                        ))));
                        continue;
                    }
                    match r.op {
                        Op::Read(_) => d.reads.fetch_add(1, Ordering::Relaxed),
                        _ => d.writes.fetch_add(1, Ordering::Relaxed),
                    };
                    *req = Some(self.nbd_request(d, slot, r));
                    *who = Some(d);
                    any = true;
                }
            }
        }
        if any {
            // Rounds of connections the requests went out on: a refusal
            // (EPERM) on a round the pool has since left is a queued
            // request the donor fenced off, not a newer session.
            let mut rounds: [u64; N] =
                std::array::from_fn(|i| who[i].map_or(0, |d| d.pool.generation()));
            let mut out = run(&mut batch);
            // One failed request is not a failed donor: a connection reset
            // or a torn reply fails fast, and the pool has retired that
            // connection, so it is sent once more (on another or a fresh
            // one) before the donor is failed. A timeout has used the
            // request's deadline already and is not retried.
            for pass in 0..STALE_TRIES {
                let mut retry: [Option<nbd::Request<'_, '_>>; N] = std::array::from_fn(|_| None);
                let mut again = false;
                for ((((o, d), r), slot), round) in out
                    .iter()
                    .zip(&who)
                    .zip(reqs.iter_mut())
                    .zip(&mut retry)
                    .zip(rounds)
                {
                    let (Some(d), Some(r), Err(e)) = (d, r.as_mut(), o) else {
                        continue;
                    };
                    let Loc::Donor { slot: s, .. } = r.loc else {
                        continue;
                    };
                    // Refused for an older round: this pool's connections
                    // were superseded, by a round of its own (the pool moved
                    // on) or by another entry of this session that reached
                    // the same export (a second name of a member being
                    // checked): again on a new round. A newer session
                    // refuses that one too.
                    let stale = e.is_fenced();
                    if stale {
                        d.pool.renew_from(round);
                    }
                    if stale || (pass == 0 && retry_once(d, e)) {
                        *slot = Some(self.nbd_request(d, s, r));
                        again = true;
                    }
                }
                if !again {
                    break;
                }
                rounds = std::array::from_fn(|i| who[i].map_or(0, |d| d.pool.generation()));
                let next = run(&mut retry);
                for ((o, s), b) in out.iter_mut().zip(next).zip(&retry) {
                    if b.is_some() {
                        *o = s;
                    }
                }
            }
            for (((d, o), res), r) in who.iter().zip(out).zip(&mut results).zip(reqs.iter_mut()) {
                let Some(d) = d else { continue };
                let o = match (o, r.as_mut()) {
                    (Err(e), Some(r)) if self.waits_for(d, &e) => self.retry_within_grace(d, r, e),
                    (o, _) => o,
                };
                if o.as_ref().map_or_else(|e| e.is_no_space(), |_| true) {
                    d.answered.fetch_add(1, Ordering::Relaxed);
                }
                *res = Some(o.map_err(|e| self.donor_error(d, &e)));
            }
        }
        // After the results: a donor this batch failed is away by now, so
        // the batch's own writes count as written while it was.
        self.dirty.note(
            reqs.iter()
                .flatten()
                .filter(|r| !matches!(r.op, Op::Read(_)))
                .map(|r| r.loc),
        );
        results
    }

    /// `r` as a request to donor `d`, whose slot `slot` it is in.
    fn nbd_request<'b, 'd>(
        &self,
        d: &'d Donor,
        slot: u32,
        r: &'b mut IoReq<'_>,
    ) -> nbd::Request<'d, 'b> {
        nbd::Request {
            pool: &d.pool,
            offset: slot as u64 * self.layout.extent + r.off,
            op: r.op.reborrow(),
        }
    }

    pub(crate) fn exec1(&self, loc: Loc, off: u64, op: Op<'_>) -> IoResult {
        let [res] = self.exec(&mut [Some(IoReq { loc, off, op })]);
        res.expect("one request, one result")
    }

    /// Flushes every donor that is up, in parallel. A failing donor is
    /// marked failed; the caller's data is safe elsewhere or reported lost.
    pub(crate) fn flush_donors(&self) {
        let up: Vec<&Donor> = self
            .members
            .iter()
            .filter(|d| !d.is_failed() && d.attached.load(Ordering::Acquire))
            .collect();
        let mut batch: Vec<nbd::Request<'_, '_>> = up
            .iter()
            .map(|d| nbd::Request {
                pool: &d.pool,
                offset: 0,
                op: Op::Flush,
            })
            .collect();
        for (d, res) in up.into_iter().zip(nbd::run(&mut batch)) {
            if let Err(e) = res {
                self.donor_error(d, &e);
            }
        }
    }

    /// Whether a request that failed with `e` on `d` should wait for `d`
    /// (within the grace) rather than fail it: `d` did not answer, and
    /// failing it now would lose data.
    fn waits_for(&self, d: &Donor, e: &nbd::NbdError) -> bool {
        !e.is_no_space()
            && !e.is_fenced()
            && !d.is_failed()
            && self.cfg.grace_ms > 0
            && !self.may_fail_now(d)
    }

    /// Sends `r` to `d` again each time `d` answers again, until it
    /// succeeds, fails for another reason, or the grace is over (then the
    /// last error: the caller fails `d`).
    fn retry_within_grace(
        &self,
        d: &Donor,
        r: &mut IoReq<'_>,
        mut e: nbd::NbdError,
    ) -> std::result::Result<(), nbd::NbdError> {
        let Loc::Donor { slot, .. } = r.loc else {
            return Err(e);
        };
        while self.await_donor(d, &e) {
            let mut one = [Some(self.nbd_request(d, slot, r))];
            let [o] = run(&mut one);
            match o {
                Ok(()) => return Ok(()),
                Err(next) if self.waits_for(d, &next) => e = next,
                Err(next) => return Err(next),
            }
        }
        Err(e)
    }

    /// What a request's error on donor `d` means, acted on: no room marks
    /// it full; a refusal for an older session fences this whole process
    /// (a newer one serves the device); anything else fails the donor.
    pub(crate) fn donor_error(&self, d: &Donor, e: &nbd::NbdError) -> IoFail {
        if e.is_no_space() {
            d.full.store(true, Ordering::Release);
            IoFail::NoSpace(e.to_string())
        } else if e.is_fenced() && self.refused_on_a_new_round(d) {
            self.fence(&format!("donor {}: {e}", d.cfg.name));
            IoFail::Failed(e.to_string())
        } else if e.is_fenced() {
            IoFail::Failed(format!(
                "{e} (an older round of connections; the next try uses a new one)"
            ))
        } else if e.is_refused() {
            self.fail_donor_gone(d, &e.to_string());
            IoFail::Failed(e.to_string())
        } else {
            self.fail_donor(d, &e.to_string());
            IoFail::Failed(e.to_string())
        }
    }

    /// Whether `d` refuses us on a fresh round of connections too (a newer
    /// session owns the export), after a request of an older round was
    /// refused.
    fn refused_on_a_new_round(&self, d: &Donor) -> bool {
        self.read_on_a_live_round(d, &mut [0u8; 512])
            .is_err_and(|e| e.is_fenced())
    }

    /// A newer session of this device owns its exports: serve and change
    /// nothing from now on, and say so once.
    pub(crate) fn fence(&self, why: &str) {
        if self.fenced.set(why.to_string()).is_ok() {
            tracing::error!(
                "FENCED: {why}: a newer session of this device owns its exports; this serving process serves no more requests"
            );
            self.maint_wake.notify();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xor_handles_unaligned_tails() {
        let mut a: Vec<u8> = (0..21).collect();
        let b: Vec<u8> = (100..121).collect();
        let want: Vec<u8> = a.iter().zip(&b).map(|(x, y)| x ^ y).collect();
        xor_into(&mut a, &b);
        assert_eq!(a, want);
    }

    #[test]
    fn buffers_come_back_to_the_pool() {
        let p = BufPool::new(2, 4096);
        {
            let mut b = p.take(2);
            let (x, y) = b.two(10);
            x[0] = 1;
            y[0] = 2;
        }
        let mut b = p.take(2);
        assert_eq!(b.one(4096).len(), 4096);
    }
}
