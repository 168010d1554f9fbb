//! Following one job through its hinted reference stream.
//!
//! A [`HintCursor`] holds a bounded lookahead window of the job's next block
//! references, pulled lazily from a streaming source, and matches each block
//! the job actually reads against it:
//!
//! - a read of one of the next `slack` expected blocks is a **match**; the
//!   expected blocks it jumps over are remembered for a while, so small
//!   reorderings (B before A) also match;
//! - re-reading the block just read (a record split over several read
//!   calls) is a **repeat**, neither match nor miss;
//! - anything else is a **miss**; after `miss_limit` consecutive misses the
//!   job is **demoted** to unhinted: its hints no longer drive prefetching
//!   nor count as future uses.
//!
//! Re-promotion: a demoted job keeps its window, and each read is searched
//! in the next `resync_window` references. A found read moves the cursor
//! there; `promote_after` consecutive in-order matches promote the job back
//! to hinted. A job that skipped or deviated for a phase so benefits again
//! once it is back on its hints, while one that never returns to them costs
//! only the search.
//!
//! **Blocks in the page cache.** When the kernel caches what the job read
//! ([`HintCursor::mark_cached`]), later references to those blocks are
//! served by the kernel and never reach the cursor. They are passed over:
//! matching looks `slack` references ahead among the others, cached
//! references at the front are consumed as they come up (counted in
//! [`CursorCounts::page_cache_refs`]), and neither [`HintCursor::upcoming`]
//! nor [`HintCursor::next_use`] offers them for prefetching. A read of a
//! cached block (the kernel dropped it, or had only part of it) is a
//! [`Observation::Refetch`], neither match nor miss.

use std::collections::{HashMap, HashSet, VecDeque};

use super::BlockId;

/// Tolerances of the matching; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CursorConfig {
    /// Lookahead window length, in references.
    pub window: usize,
    /// How many expected references ahead a read may match.
    pub slack: usize,
    /// Consecutive misses that demote the job to unhinted.
    pub miss_limit: u32,
    /// How far ahead a demoted job's reads are searched.
    pub resync_window: usize,
    /// Consecutive in-order matches that promote a demoted job again.
    pub promote_after: u32,
}

impl Default for CursorConfig {
    fn default() -> CursorConfig {
        CursorConfig {
            window: 4096,
            slack: 16,
            miss_limit: 8,
            resync_window: 1024,
            promote_after: 8,
        }
    }
}

/// Whether the job's hints are trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorState {
    /// Reads follow the hints: they drive prefetching and block values.
    Following,
    /// Demoted after too many misses; searching for a way back.
    Unhinted,
    /// Every hinted reference has been consumed.
    Finished,
}

impl CursorState {
    pub fn name(self) -> &'static str {
        match self {
            CursorState::Following => "following",
            CursorState::Unhinted => "unhinted",
            CursorState::Finished => "finished",
        }
    }
}

/// How one read related to the hints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// The read was expected; `skipped` expected references were jumped over.
    Matched { skipped: u64 },
    /// A recently skipped reference, read a little late.
    Reordered,
    /// The block just read, read again.
    Repeat,
    /// Not among the expected references.
    Miss,
    /// A demoted job's read found further ahead in its stream.
    Resync,
    /// A block the page cache was thought to hold, read again.
    Refetch,
}

/// Counters of a cursor's life, for status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CursorCounts {
    pub matched: u64,
    pub missed: u64,
    pub demotions: u64,
    pub promotions: u64,
    /// References passed over because their block is in the page cache.
    pub page_cache_refs: u64,
}

/// A job's position in its hint stream; see the module documentation.
pub struct HintCursor<S> {
    cfg: CursorConfig,
    source: S,
    exhausted: bool,
    window: VecDeque<BlockId>,
    /// Absolute stream position of `window[0]`.
    base: u64,
    /// Absolute positions, ascending, of each block's references in the window.
    positions: HashMap<BlockId, VecDeque<u64>>,
    /// Recently jumped-over references, oldest first, at most `slack`.
    skipped: VecDeque<BlockId>,
    /// Blocks the kernel's page cache holds for this job.
    cached: HashSet<BlockId>,
    last: Option<BlockId>,
    misses: u32,
    streak: u32,
    state: CursorState,
    counts: CursorCounts,
}

impl<S: Iterator<Item = BlockId>> HintCursor<S> {
    pub fn new(cfg: CursorConfig, source: S) -> HintCursor<S> {
        let cfg = CursorConfig {
            window: cfg.window.max(1),
            slack: cfg.slack.max(1),
            miss_limit: cfg.miss_limit.max(1),
            resync_window: cfg.resync_window.max(1),
            promote_after: cfg.promote_after.max(1),
        };
        let mut cursor = HintCursor {
            cfg,
            source,
            exhausted: false,
            window: VecDeque::with_capacity(cfg.window),
            base: 0,
            positions: HashMap::new(),
            skipped: VecDeque::new(),
            cached: HashSet::new(),
            last: None,
            misses: 0,
            streak: 0,
            state: CursorState::Following,
            counts: CursorCounts::default(),
        };
        cursor.fill();
        if cursor.window.is_empty() {
            cursor.state = CursorState::Finished;
        }
        cursor
    }

    pub fn state(&self) -> CursorState {
        self.state
    }

    /// True while the hints drive prefetching.
    pub fn hinted(&self) -> bool {
        self.state == CursorState::Following
    }

    /// References consumed (matched or jumped over) so far.
    pub fn position(&self) -> u64 {
        self.base
    }

    /// References currently in the lookahead window.
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    pub fn counts(&self) -> CursorCounts {
        self.counts
    }

    /// How many references come before the next use of `block` (0: it is the
    /// next expected read), if it is in the window and not in the page cache.
    pub fn next_use(&self, block: BlockId) -> Option<u64> {
        if self.cached.contains(&block) {
            return None;
        }
        self.positions
            .get(&block)
            .and_then(|p| p.front())
            .map(|&pos| pos - self.base)
    }

    /// The expected references to blocks not in the page cache, in order,
    /// with their distance (0 = next; cached references count in it, since
    /// the job spends time on them too).
    pub fn upcoming(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.window
            .iter()
            .enumerate()
            .filter(|(_, b)| !self.cached.contains(b))
            .map(|(i, &b)| (i as u64, b))
    }

    /// The kernel's page cache now holds `block` (the job read all of it):
    /// its later references will not be read through the cursor.
    pub fn mark_cached(&mut self, block: BlockId) {
        self.cached.insert(block);
        self.pass_cached();
    }

    /// Window positions of the first `n` references not in the page cache.
    fn visible(&self, n: usize) -> impl Iterator<Item = (usize, BlockId)> + '_ {
        self.window
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, b)| !self.cached.contains(b))
            .take(n)
    }

    /// Consumes the cached references at the front of the window.
    fn pass_cached(&mut self) {
        while self.window.front().is_some_and(|b| self.cached.contains(b)) {
            self.pop_front();
            self.counts.page_cache_refs += 1;
            self.fill();
        }
        if self.window.is_empty() && self.exhausted {
            self.state = CursorState::Finished;
        }
    }

    /// Matches one block the job read against its hints.
    pub fn observe(&mut self, block: BlockId) -> Observation {
        if self.cached.contains(&block) {
            self.last = Some(block);
            return Observation::Refetch;
        }
        let obs = match self.state {
            CursorState::Finished => {
                self.counts.missed += 1;
                Observation::Miss
            }
            CursorState::Following => self.observe_following(block),
            CursorState::Unhinted => self.observe_unhinted(block),
        };
        self.last = Some(block);
        self.fill();
        self.pass_cached();
        obs
    }

    fn observe_following(&mut self, block: BlockId) -> Observation {
        let ahead = self
            .visible(self.cfg.slack)
            .find(|&(_, b)| b == block)
            .map(|(k, _)| k);
        if let Some(k) = ahead {
            if k > 0 && self.last == Some(block) {
                // A split re-read of the block just read, not a jump ahead to
                // a later reference of the same block.
                return Observation::Repeat;
            }
            self.consume(k, true);
            self.misses = 0;
            self.counts.matched += 1;
            return Observation::Matched { skipped: k as u64 };
        }
        if self.last == Some(block) {
            return Observation::Repeat;
        }
        if let Some(i) = self.skipped.iter().position(|&b| b == block) {
            self.skipped.remove(i);
            self.misses = 0;
            self.counts.matched += 1;
            return Observation::Reordered;
        }
        self.misses += 1;
        self.counts.missed += 1;
        if self.misses >= self.cfg.miss_limit {
            self.state = CursorState::Unhinted;
            self.streak = 0;
            self.counts.demotions += 1;
        }
        Observation::Miss
    }

    fn observe_unhinted(&mut self, block: BlockId) -> Observation {
        if self.last == Some(block) {
            return Observation::Repeat;
        }
        let found = self
            .visible(self.cfg.resync_window)
            .find(|&(_, b)| b == block)
            .map(|(k, _)| k);
        match found {
            Some(k) => {
                self.streak = if k < self.cfg.slack {
                    self.streak + 1
                } else {
                    1
                };
                self.consume(k, false);
                if self.streak >= self.cfg.promote_after {
                    self.state = CursorState::Following;
                    self.misses = 0;
                    self.counts.promotions += 1;
                }
                self.counts.matched += 1;
                Observation::Resync
            }
            None => {
                self.streak = 0;
                self.counts.missed += 1;
                Observation::Miss
            }
        }
    }

    /// Drops the first `k` references (remembering them as skipped when
    /// `remember`) and consumes the one after them.
    fn consume(&mut self, k: usize, remember: bool) {
        for _ in 0..k {
            let jumped = self.pop_front();
            if remember && !self.cached.contains(&jumped) {
                if self.skipped.len() == self.cfg.slack {
                    self.skipped.pop_front();
                }
                self.skipped.push_back(jumped);
            }
        }
        self.pop_front();
    }

    fn pop_front(&mut self) -> BlockId {
        let b = self.window.pop_front().expect("consume within the window");
        if let Some(p) = self.positions.get_mut(&b) {
            p.pop_front();
            if p.is_empty() {
                self.positions.remove(&b);
            }
        }
        self.base += 1;
        b
    }

    fn fill(&mut self) {
        while !self.exhausted && self.window.len() < self.cfg.window {
            match self.source.next() {
                Some(b) => {
                    let pos = self.base + self.window.len() as u64;
                    self.window.push_back(b);
                    self.positions.entry(b).or_default().push_back(pos);
                }
                None => self.exhausted = true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u64) -> BlockId {
        BlockId::new(0, i)
    }

    fn cursor(refs: Vec<u64>, cfg: CursorConfig) -> HintCursor<std::vec::IntoIter<BlockId>> {
        HintCursor::new(cfg, refs.into_iter().map(b).collect::<Vec<_>>().into_iter())
    }

    fn small() -> CursorConfig {
        CursorConfig {
            window: 8,
            slack: 3,
            miss_limit: 3,
            resync_window: 8,
            promote_after: 2,
        }
    }

    #[test]
    fn follows_in_order_and_finishes() {
        let mut c = cursor(vec![5, 3, 9], small());
        assert_eq!(c.next_use(b(9)), Some(2));
        assert_eq!(c.observe(b(5)), Observation::Matched { skipped: 0 });
        assert_eq!(c.position(), 1);
        assert_eq!(c.next_use(b(9)), Some(1));
        assert_eq!(c.next_use(b(5)), None);
        c.observe(b(3));
        assert_eq!(c.state(), CursorState::Following);
        c.observe(b(9));
        assert_eq!(c.state(), CursorState::Finished);
        assert_eq!(c.observe(b(1)), Observation::Miss);
        assert_eq!(c.counts().matched, 3);
    }

    #[test]
    fn window_is_bounded_and_refilled_lazily() {
        let mut pulled = 0u64;
        let src = (0..1_000_000u64).map(|i| {
            pulled += 1;
            b(i)
        });
        let mut c = HintCursor::new(small(), src);
        assert_eq!(c.window_len(), 8);
        c.observe(b(0));
        assert_eq!(c.window_len(), 8);
        assert_eq!(c.next_use(b(8)), Some(7));
        drop(c);
        assert_eq!(pulled, 9);
    }

    #[test]
    fn tolerates_small_reorderings() {
        let mut c = cursor(vec![1, 2, 3, 4, 5], small());
        assert_eq!(c.observe(b(2)), Observation::Matched { skipped: 1 });
        assert_eq!(c.observe(b(1)), Observation::Reordered);
        assert_eq!(c.observe(b(3)), Observation::Matched { skipped: 0 });
        assert_eq!(c.counts().missed, 0);
        assert_eq!(c.next_use(b(4)), Some(0));
    }

    #[test]
    fn split_reads_of_one_block_are_repeats() {
        let mut c = cursor(vec![1, 2, 1], small());
        c.observe(b(1));
        assert_eq!(c.observe(b(1)), Observation::Repeat);
        assert_eq!(c.observe(b(2)), Observation::Matched { skipped: 0 });
        assert_eq!(c.observe(b(1)), Observation::Matched { skipped: 0 });
    }

    #[test]
    fn repeated_reference_in_hints_matches_again() {
        let mut c = cursor(vec![1, 1, 2], small());
        c.observe(b(1));
        assert_eq!(c.observe(b(1)), Observation::Matched { skipped: 0 });
        assert_eq!(c.next_use(b(2)), Some(0));
    }

    #[test]
    fn demotes_after_consecutive_misses_and_a_match_resets() {
        let mut c = cursor((0..100).collect(), small());
        c.observe(b(50));
        c.observe(b(51));
        c.observe(b(0));
        assert_eq!(c.state(), CursorState::Following);
        for i in 60..63 {
            assert_eq!(c.observe(b(i)), Observation::Miss);
        }
        assert_eq!(c.state(), CursorState::Unhinted);
        assert_eq!(c.counts().demotions, 1);
    }

    #[test]
    fn demoted_job_is_promoted_after_in_order_matches() {
        let mut c = cursor((0..100).collect(), small());
        for i in 500..503 {
            c.observe(b(i));
        }
        assert_eq!(c.state(), CursorState::Unhinted);
        // Back on its hints a few references further on.
        assert_eq!(c.observe(b(5)), Observation::Resync);
        assert_eq!(c.state(), CursorState::Unhinted);
        assert_eq!(c.observe(b(6)), Observation::Resync);
        assert_eq!(c.state(), CursorState::Following);
        assert_eq!(c.position(), 7);
        assert_eq!(c.counts().promotions, 1);
    }

    #[test]
    fn demoted_job_off_its_hints_stays_demoted() {
        let mut c = cursor((0..100).collect(), small());
        for i in 500..520 {
            c.observe(b(i));
        }
        assert_eq!(c.state(), CursorState::Unhinted);
        // Scattered hits far apart never make an in-order streak.
        c.observe(b(7));
        c.observe(b(600));
        c.observe(b(14));
        assert_eq!(c.state(), CursorState::Unhinted);
    }

    #[test]
    fn references_to_page_cached_blocks_are_passed_over() {
        // The job reads 1 and 2; their later references are served by the
        // page cache and never reach the cursor.
        let mut c = cursor(vec![1, 2, 1, 2, 1, 3, 2, 4, 5, 6], small());
        c.observe(b(1));
        c.mark_cached(b(1));
        c.observe(b(2));
        c.mark_cached(b(2));
        // The three cached references before 3 were consumed.
        assert_eq!(c.counts().page_cache_refs, 3);
        assert_eq!(c.position(), 5);
        assert_eq!(c.next_use(b(2)), None);
        assert_eq!(c.next_use(b(4)), Some(2));
        assert_eq!(
            c.upcoming().collect::<Vec<_>>(),
            vec![(0, b(3)), (2, b(4)), (3, b(5)), (4, b(6))]
        );
        // A cached reference does not use up the slack (3): 5 is the third
        // reference that can reach the cursor.
        assert_eq!(c.observe(b(5)), Observation::Matched { skipped: 3 });
        assert_eq!(c.observe(b(6)), Observation::Matched { skipped: 0 });
        assert_eq!(c.state(), CursorState::Finished);
        assert_eq!(c.counts().missed, 0);
    }

    #[test]
    fn a_read_of_a_cached_block_is_neither_match_nor_miss() {
        let mut c = cursor(vec![1, 2, 3, 1, 4], small());
        c.observe(b(1));
        c.mark_cached(b(1));
        for _ in 0..5 {
            assert_eq!(c.observe(b(1)), Observation::Refetch);
        }
        assert_eq!(c.state(), CursorState::Following);
        assert_eq!(c.counts().missed, 0);
        assert_eq!(c.observe(b(2)), Observation::Matched { skipped: 0 });
    }

    #[test]
    fn empty_stream_is_finished() {
        let mut c = cursor(vec![], small());
        assert_eq!(c.state(), CursorState::Finished);
        assert_eq!(c.observe(b(1)), Observation::Miss);
    }
}
