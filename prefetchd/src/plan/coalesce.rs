//! Which blocks one local disk request reads.
//!
//! A disk pays mostly per request (a seek, or a network disk's round
//! trip), little per byte, so neighbouring blocks are read together:
//!
//! - [`run_around`]: a block to fetch and the other blocks of its file
//!   wanted soon (a hinted job's upcoming references) become one run:
//!   neighbours are joined while the hole between two is at most
//!   `max_gap` blocks and the run at most `max_blocks` long. Holes are read
//!   and dropped: a few extra blocks cost less than another request.
//! - [`Stream`]: readers without hints (or not following them) get the
//!   kernel's sequential readahead: a miss that continues the previous
//!   read (or starts the file) reads a window ahead, doubling up to
//!   `max` blocks; reaching the first block of the last window starts the
//!   next one asynchronously, so a sequential reader rarely waits. A
//!   random miss reads just what was asked for.

use std::ops::Range;

/// How far disk requests are coalesced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// Longest run, in blocks (1: no coalescing).
    pub max_blocks: u32,
    /// Longest hole of unwanted blocks read inside a run.
    pub max_gap: u32,
}

impl Default for CoalesceConfig {
    fn default() -> CoalesceConfig {
        // 256 KiB runs and 32 KiB holes with 8 KiB blocks.
        CoalesceConfig {
            max_blocks: 32,
            max_gap: 4,
        }
    }
}

/// The run of block indexes around `anchor` covering the most of `wanted`
/// (indexes of the same file; any order, repeats allowed) reachable
/// through holes of at most `max_gap` blocks, within `max_blocks`. The
/// nearer neighbour is taken first, the later one on ties.
pub fn run_around(anchor: u64, wanted: &[u64], cfg: CoalesceConfig) -> Range<u64> {
    let max = u64::from(cfg.max_blocks.max(1));
    let gap = u64::from(cfg.max_gap);
    let mut v: Vec<u64> = wanted
        .iter()
        .copied()
        .filter(|&w| w.abs_diff(anchor) < max)
        .chain([anchor])
        .collect();
    v.sort_unstable();
    v.dedup();
    let at = v.binary_search(&anchor).expect("anchor is in the list");
    let (mut lo, mut hi) = (at, at);
    loop {
        let span = |a: usize, b: usize| v[b] - v[a] + 1;
        let left = (lo > 0 && v[lo] - v[lo - 1] - 1 <= gap && span(lo - 1, hi) <= max)
            .then(|| v[lo] - v[lo - 1]);
        let right = (hi + 1 < v.len() && v[hi + 1] - v[hi] - 1 <= gap && span(lo, hi + 1) <= max)
            .then(|| v[hi + 1] - v[hi]);
        match (left, right) {
            (Some(l), Some(r)) if l < r => lo -= 1,
            (_, Some(_)) => hi += 1,
            (Some(_), None) => lo -= 1,
            (None, None) => return v[lo]..v[hi] + 1,
        }
    }
}

/// One reader's sequential readahead state in one file; see the module
/// documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stream {
    /// One past the last block the reader asked for.
    last_end: u64,
    /// Size of the current readahead window (0: not sequential).
    size: u64,
    /// One past the blocks read ahead so far.
    ahead_end: u64,
    /// Reading this block starts the next window.
    marker: Option<u64>,
}

impl Stream {
    /// A miss of blocks `want`: the run to read, at most `max` blocks
    /// beyond what was asked for.
    pub fn miss(&mut self, want: Range<u64>, max: u64) -> Range<u64> {
        let sequential = want.start == 0 || (self.last_end > 0 && want.start == self.last_end);
        self.last_end = want.end;
        let asked = want.end - want.start;
        if !sequential || max <= asked {
            *self = Stream {
                last_end: want.end,
                ..Stream::default()
            };
            return want;
        }
        self.size = if self.size == 0 {
            initial_size(asked, max)
        } else {
            (self.size * 2).min(max)
        };
        let end = want.start + self.size.max(asked);
        self.ahead_end = end;
        self.marker = (end > want.end).then_some(want.end);
        want.start..end
    }

    /// A read of `block` found it cached or on its way: the next window to
    /// read ahead, when the reader has reached the current one.
    pub fn hit(&mut self, block: u64, max: u64) -> Option<Range<u64>> {
        self.last_end = self.last_end.max(block + 1);
        if self.marker != Some(block) {
            return None;
        }
        self.size = (self.size * 2).clamp(1, max.max(1));
        let next = self.ahead_end..self.ahead_end + self.size;
        self.ahead_end = next.end;
        self.marker = Some(next.start);
        Some(next)
    }
}

/// The kernel's first window: four times a small read, twice a middling
/// one, else the maximum.
fn initial_size(asked: u64, max: u64) -> u64 {
    let n = asked.next_power_of_two();
    if n <= max / 32 {
        n * 4
    } else if n <= max / 4 {
        n * 2
    } else {
        max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_blocks: u32, max_gap: u32) -> CoalesceConfig {
        CoalesceConfig {
            max_blocks,
            max_gap,
        }
    }

    #[test]
    fn contiguous_neighbours_join_up_to_the_limit() {
        let wanted: Vec<u64> = (0..100).collect();
        assert_eq!(run_around(10, &wanted, cfg(8, 0)), 10..18);
        assert_eq!(run_around(98, &wanted, cfg(8, 0)), 92..100);
        assert_eq!(run_around(10, &wanted, cfg(1, 4)), 10..11);
        assert_eq!(run_around(10, &[], cfg(32, 4)), 10..11);
    }

    #[test]
    fn small_holes_are_read_large_ones_end_the_run() {
        // 20 and 22 are two apart (hole of 1), 30 is 8 past 22.
        let wanted = [22, 20, 30, 23, 20];
        assert_eq!(run_around(20, &wanted, cfg(32, 1)), 20..24);
        assert_eq!(run_around(20, &wanted, cfg(32, 7)), 20..31);
        assert_eq!(run_around(20, &wanted, cfg(32, 0)), 20..21);
        // The limit holds with holes too.
        assert_eq!(run_around(20, &wanted, cfg(4, 7)), 20..24);
    }

    #[test]
    fn the_nearer_neighbour_is_taken_first() {
        // 7 is adjacent on the left, 13 three away on the right.
        assert_eq!(run_around(10, &[7, 9, 13], cfg(3, 2)), 9..11);
        assert_eq!(run_around(10, &[9, 11], cfg(2, 0)), 10..12);
        assert_eq!(run_around(10, &[7, 9, 13], cfg(8, 2)), 7..14);
    }

    #[test]
    fn far_blocks_are_not_even_considered() {
        let wanted: Vec<u64> = (0..1_000_000).step_by(2).collect();
        assert_eq!(run_around(500_000, &wanted, cfg(4, 1)), 500_000..500_003);
    }

    #[test]
    fn random_misses_read_what_was_asked() {
        let mut s = Stream::default();
        assert_eq!(s.miss(50..51, 16), 50..51);
        assert_eq!(s.miss(7..9, 16), 7..9);
        assert_eq!(s.hit(8, 16), None);
    }

    #[test]
    fn sequential_misses_read_ahead_in_growing_windows() {
        let mut s = Stream::default();
        // The start of the file counts as sequential: 4 x the read.
        assert_eq!(s.miss(0..1, 32), 0..4);
        // Blocks 1..3 are hits; reaching 1 (the marker) reads 4..12 ahead.
        assert_eq!(s.hit(1, 32), Some(4..12));
        assert_eq!(s.hit(2, 32), None);
        assert_eq!(s.hit(4, 32), Some(12..28));
        assert_eq!(s.hit(12, 32), Some(28..60));
        assert_eq!(s.hit(28, 32), Some(60..92));
    }

    #[test]
    fn a_miss_continuing_the_last_read_is_sequential() {
        let mut s = Stream::default();
        assert_eq!(s.miss(40..42, 32), 40..42);
        assert_eq!(s.miss(42..44, 32), 42..46);
        // The reader skipped the window: random again, state reset.
        assert_eq!(s.miss(100..101, 32), 100..101);
        assert_eq!(s.hit(44, 32), None);
        // Readahead off: max no larger than the read.
        let mut s = Stream::default();
        assert_eq!(s.miss(0..2, 2), 0..2);
        assert_eq!(s.miss(2..4, 1), 2..4);
    }
}
