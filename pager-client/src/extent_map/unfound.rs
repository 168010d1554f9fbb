//! Unfound pages: pages of a lost extent that was placed again (a write
//! into it, or `forget-lost` for a neighbour in its group) and that have
//! not been written since. Their data is gone, so they read as I/O errors
//! until written, as Ceph's unfound objects do until `mark_unfound_lost`;
//! `forget-lost` turns them into pages that read as zeros.
//!
//! Kept as disjoint, non-adjacent page ranges: a lost extent adds one
//! range, and writes mostly cut its ends or punch holes, so the set stays
//! small whatever the device's size.

use std::collections::BTreeMap;
use std::ops::Range;

/// A set of pages as disjoint, non-adjacent half-open ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageRanges {
    /// start -> end of each range.
    ranges: BTreeMap<u64, u64>,
    pages: u64,
}

impl PageRanges {
    /// Pages in the set.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The ranges, in order.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.ranges.iter().map(|(&s, &e)| s..e)
    }

    /// Whether any page of `r` is in the set.
    pub fn any_in(&self, r: Range<u64>) -> bool {
        if r.is_empty() {
            return false;
        }
        // The last range starting before `r.end` is the only one that can
        // reach into `r` (ranges are disjoint and sorted).
        self.ranges
            .range(..r.end)
            .next_back()
            .is_some_and(|(_, &end)| end > r.start)
    }

    /// The first page of `r` in the set.
    pub fn first_in(&self, r: Range<u64>) -> Option<u64> {
        if r.is_empty() {
            return None;
        }
        // A range reaching into `r` from before it, else the first one
        // starting inside it.
        match self.ranges.range(..=r.start).next_back() {
            Some((_, &end)) if end > r.start => Some(r.start),
            _ => self.ranges.range(r.start..r.end).next().map(|(&s, _)| s),
        }
    }

    /// Adds the pages of `r`; returns how many were not in the set.
    pub fn insert(&mut self, r: Range<u64>) -> u64 {
        if r.is_empty() {
            return 0;
        }
        let (mut start, mut end) = (r.start, r.end);
        // Every range touching or overlapping `r` merges into one.
        let touching: Vec<(u64, u64)> = self
            .ranges
            .range(..=end)
            .rev()
            .take_while(|(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        let before = self.pages;
        for (s, e) in touching {
            self.ranges.remove(&s);
            self.pages -= e - s;
            start = start.min(s);
            end = end.max(e);
        }
        self.ranges.insert(start, end);
        self.pages += end - start;
        self.pages - before
    }

    /// Takes the pages of `r` out; returns how many were in the set.
    pub fn remove(&mut self, r: Range<u64>) -> u64 {
        if !self.any_in(r.clone()) {
            return 0;
        }
        let before = self.pages;
        let overlapping: Vec<(u64, u64)> = self
            .ranges
            .range(..r.end)
            .rev()
            .take_while(|(_, &e)| e > r.start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in overlapping {
            self.ranges.remove(&s);
            self.pages -= e - s;
            if s < r.start {
                self.ranges.insert(s, r.start);
                self.pages += r.start - s;
            }
            if e > r.end {
                self.ranges.insert(r.end, e);
                self.pages += e - r.end;
            }
        }
        before - self.pages
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(r: &PageRanges) -> Vec<(u64, u64)> {
        r.ranges().map(|r| (r.start, r.end)).collect()
    }

    #[test]
    fn ranges_merge_split_and_count_their_pages() {
        let mut r = PageRanges::default();
        assert_eq!(r.insert(10..20), 10);
        assert_eq!(r.insert(12..15), 0, "already in");
        assert_eq!(r.insert(20..22), 2, "adjacent: merges");
        assert_eq!(set(&r), [(10, 22)]);
        assert_eq!(r.insert(30..40), 10);
        assert_eq!(r.insert(5..31), 13, "bridges both");
        assert_eq!(set(&r), [(5, 40)]);
        assert_eq!(r.pages(), 35);
        assert_eq!(r.remove(10..12), 2);
        assert_eq!(r.remove(39..50), 1);
        assert_eq!(r.remove(0..5), 0, "nothing there");
        assert_eq!(set(&r), [(5, 10), (12, 39)]);
        assert_eq!(r.pages(), 5 + 27);
        assert!(r.any_in(9..10) && r.any_in(0..6) && r.any_in(38..100));
        assert!(!r.any_in(10..12) && !r.any_in(39..100) && !r.any_in(7..7));
        assert_eq!(r.first_in(0..100), Some(5));
        assert_eq!(r.first_in(7..100), Some(7));
        assert_eq!(r.first_in(10..13), Some(12));
        assert_eq!(r.first_in(10..12), None);
        assert_eq!(r.remove(0..100), 32);
        assert_eq!(r, PageRanges::default());
    }

    #[test]
    fn a_random_mix_agrees_with_a_plain_bitmap() {
        let mut r = PageRanges::default();
        let mut bits = [false; 200];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let a = x % 200;
            let b = (a + 1 + (x >> 20) % 30).min(200);
            let add = (x >> 40).is_multiple_of(2);
            let changed = bits[a as usize..b as usize]
                .iter()
                .filter(|&&p| p != add)
                .count() as u64;
            bits[a as usize..b as usize].fill(add);
            let said = if add { r.insert(a..b) } else { r.remove(a..b) };
            assert_eq!(said, changed, "{a}..{b} add {add}");
            assert_eq!(r.pages(), bits.iter().filter(|&&p| p).count() as u64);
            let q = (x >> 8) % 200;
            let qe = (q + (x >> 30) % 10).min(200);
            assert_eq!(
                r.any_in(q..qe),
                bits[q as usize..qe as usize].iter().any(|&p| p)
            );
            assert_eq!(r.first_in(q..qe), (q..qe).find(|&p| bits[p as usize]));
        }
    }
}
