//! Which device pages are known to read as zeros (modes parity and ec):
//! a bit per page, so that a trim can tell when its group holds nothing
//! any more and can be freed whole rather than zeroed page by page. A set
//! bit promises that the page is in no parity log row and its home copy is
//! zero (or its group unplaced). Bits are set by a trim once it has done
//! so, and for a group's pages not written when it is placed (its members
//! were zeroed); every write clears its pages' bits before it changes
//! them, under their group's write lock.
//!
//! Not journaled: after a restart every bit is clear, which only means a
//! group written before the restart is freed once all its pages are
//! trimmed again, not at the first trim that completes it.
//!
//! Atomic words, because a word's 64 pages may span groups that are locked
//! separately. Preallocated at open: marking and clearing never allocate.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// One bit per device page.
pub struct ZeroPages {
    words: Box<[AtomicU64]>,
    pages: u64,
}

/// Calls `f(word index, mask)` for each word `[first, first + count)`
/// touches, the mask selecting the range's bits in that word.
fn words_of(first: u64, count: u64, mut f: impl FnMut(usize, u64) -> bool) -> bool {
    let end = first + count;
    let mut p = first;
    while p < end {
        let (w, bit) = (p / 64, p % 64);
        let n = (64 - bit).min(end - p);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << bit
        };
        if !f(w as usize, mask) {
            return false;
        }
        p += n;
    }
    true
}

impl ZeroPages {
    /// A map of `pages` pages, none trimmed.
    pub fn new(pages: u64) -> ZeroPages {
        ZeroPages {
            words: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            pages,
        }
    }

    /// Records that `[first, first + count)` reads as zeros.
    pub fn mark(&self, first: u64, count: u64) {
        words_of(
            first,
            count.min(self.pages.saturating_sub(first)),
            |w, m| {
                self.words[w].fetch_or(m, Relaxed);
                true
            },
        );
    }

    /// Forgets that `[first, first + count)` reads as zeros (it is being
    /// written). A word with no bit set is only read: the write path's
    /// usual case costs a load.
    pub fn clear(&self, first: u64, count: u64) {
        words_of(
            first,
            count.min(self.pages.saturating_sub(first)),
            |w, m| {
                if self.words[w].load(Relaxed) & m != 0 {
                    self.words[w].fetch_and(!m, Relaxed);
                }
                true
            },
        );
    }

    /// Whether every page of `[first, first + count)` reads as zeros
    /// (pages past the device's end count: they hold nothing).
    pub fn all(&self, first: u64, count: u64) -> bool {
        words_of(
            first,
            count.min(self.pages.saturating_sub(first)),
            |w, m| self.words[w].load(Relaxed) & m == m,
        )
    }

    /// Whether page `p` reads as zeros.
    pub fn get(&self, p: u64) -> bool {
        p < self.pages && self.words[(p / 64) as usize].load(Relaxed) & (1 << (p % 64)) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn marks_across_words_and_clears_part() {
        let t = ZeroPages::new(200);
        t.mark(60, 80);
        assert!(t.all(60, 80) && !t.all(59, 2) && !t.all(139, 2));
        t.clear(100, 1);
        assert!(!t.all(60, 80) && t.all(60, 40) && t.all(101, 39));
        assert!(!t.get(100) && t.get(101) && !t.get(10_000));
    }

    #[test]
    fn pages_past_the_end_count_as_trimmed() {
        let t = ZeroPages::new(70);
        t.mark(64, 100);
        assert!(t.all(64, 64));
        assert!(!t.all(0, 128));
    }

    proptest! {
        /// The bitmap agrees with a plain vector of flags after any
        /// sequence of marks and clears.
        #[test]
        fn agrees_with_a_vector(
            ops in proptest::collection::vec((0u64..300, 0u64..150, any::<bool>()), 0..60)
        ) {
            let t = ZeroPages::new(300);
            let mut v = vec![false; 300];
            for (first, count, mark) in ops {
                if mark { t.mark(first, count) } else { t.clear(first, count) }
                for f in v.iter_mut().skip(first as usize).take(count as usize) {
                    *f = mark;
                }
            }
            for p in 0..300u64 {
                prop_assert_eq!(t.get(p), v[p as usize]);
            }
            for (first, count) in [(0u64, 300u64), (10, 100), (64, 64)] {
                let want = v[first as usize..(first + count) as usize].iter().all(|&b| b);
                prop_assert_eq!(t.all(first, count), want);
            }
        }
    }
}
