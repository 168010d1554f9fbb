//! Forestall's local prefetch predicate, adapted to three levels (PGMS
//! §2.2 "Computing the local prefetch predicate").
//!
//! With b[1..] the job's next *missing* blocks (not resident locally and not
//! already being fetched there), t_b[j] the time until b[j] is used assuming
//! no stalls, and F_i = F_G when b[i] is in global memory, else F_D: the job
//! must start prefetching b[1] now iff for some j
//!
//! ```text
//!     Σ_{i≤j} F_i ≥ t_b[j]
//! ```
//!
//! i.e. fetching the first j missing blocks one after the other would not
//! finish before the j-th is needed.

use super::Nanos;

/// One missing block ahead of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Missing {
    /// References before its use (0 = the next read).
    pub distance: u64,
    /// F_i: F_G if it is in global memory, else F_D.
    pub fetch: Nanos,
}

/// t_b for a block `distance` references ahead, with `per_ref` the job's
/// time per reference: `distance × per_ref`.
///
/// The block `distance` ahead is really used about one reference later
/// than that, but the predicate is only evaluated at events (reads and
/// completions), about one reference apart: a fetch not started now can
/// start only one reference later, so that reference time is already gone.
pub fn time_until(distance: u64, per_ref: Nanos) -> Nanos {
    distance.saturating_mul(per_ref)
}

/// The prefetch predicate over the missing blocks in stream order.
pub fn must_prefetch(missing: impl IntoIterator<Item = Missing>, per_ref: Nanos) -> bool {
    let mut sum: Nanos = 0;
    for m in missing {
        sum = sum.saturating_add(m.fetch);
        if sum >= time_until(m.distance, per_ref) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const FG: Nanos = 300;
    const FD: Nanos = 10_000;

    fn m(distance: u64, fetch: Nanos) -> Missing {
        Missing { distance, fetch }
    }

    #[test]
    fn nothing_missing_needs_no_prefetch() {
        assert!(!must_prefetch([], 100));
    }

    #[test]
    fn next_read_missing_is_urgent() {
        assert!(must_prefetch([m(0, FG)], 1_000));
        // The one after can wait until the next read if it arrives in time.
        assert!(!must_prefetch([m(1, FG)], 1_000));
        assert!(must_prefetch([m(1, FD)], 1_000));
    }

    #[test]
    fn far_single_block_can_wait() {
        // Used in 100 refs * 250 = 25_000 > F_D.
        assert!(!must_prefetch([m(100, FD)], 250));
        assert!(must_prefetch([m(30, FD)], 250));
    }

    #[test]
    fn a_run_of_disk_blocks_triggers_early() {
        // Each alone could wait, but fetching 5 serially takes 50_000 while
        // the 5th is used at 51*800 = 40_800.
        let run: Vec<_> = (47..52).map(|d| m(d, FD)).collect();
        assert!(run.iter().all(|x| !must_prefetch([*x], 800)));
        assert!(must_prefetch(run, 800));
    }

    #[test]
    fn global_blocks_delay_the_predicate() {
        // The same run from global memory fits in the time available.
        let run: Vec<_> = (47..52).map(|d| m(d, FG)).collect();
        assert!(!must_prefetch(run, 800));
    }

    #[test]
    fn saturates_instead_of_overflowing() {
        assert!(must_prefetch(
            [m(u64::MAX, Nanos::MAX), m(u64::MAX, Nanos::MAX)],
            Nanos::MAX
        ));
        assert_eq!(time_until(u64::MAX, 2), Nanos::MAX);
    }
}
