//! The compression ratio a donor offers its clients: what `capacity_bytes`
//! in its status assumes, so that clients weigh it by the pages it can
//! really take (its G_i) and not by its raw free bytes alone.
//!
//! The offer is the smaller of two ratios: of the pages it holds (logical
//! bytes over the memory they take, zspages' free room included), and of
//! the pages it was sent lately (over at least [`RECENT_PAGES`] pages
//! written). The second is what the next pages will most likely take; the
//! first keeps a short burst of well-compressing pages from promising
//! more than the donor has seen. Both are at least 1 and at most
//! [`MAX_OFFER_RATIO`]: a donor holding pages of one repeated word takes
//! no memory for them, and a ratio without bound would let one client's
//! empty pages call every client to a donor with no room. A run of pages
//! that do not compress brings the offer back to 1 within
//! [`RECENT_PAGES`] pages; the budget itself is never overcommitted
//! either way (a write beyond it gets ENOSPC and the client places the
//! extent elsewhere).

/// The most a donor promises: zram and zswap typically hold 2-4x.
pub const MAX_OFFER_RATIO: f64 = 4.0;
/// Pages written that make a new "recent" ratio (4 MiB).
pub const RECENT_PAGES: u64 = 1024;

/// Logical bytes over stored bytes, within `[1, MAX_OFFER_RATIO]`; 1 when
/// nothing is stored (no evidence yet).
pub fn ratio(logical: u64, stored: u64) -> f64 {
    if logical == 0 {
        return 1.0;
    }
    if stored == 0 {
        return MAX_OFFER_RATIO;
    }
    (logical as f64 / stored as f64).clamp(1.0, MAX_OFFER_RATIO)
}

/// The ratio of what was written lately, from the store's running totals
/// of pages written and the bytes they took.
#[derive(Debug, Default)]
pub struct RecentRatio {
    /// Totals when the current stretch began.
    from: (u64, u64),
    last: Option<f64>,
}

impl RecentRatio {
    /// Takes the totals now; a stretch of at least [`RECENT_PAGES`] pages
    /// becomes the recent ratio and a new stretch begins.
    pub fn sample(&mut self, pages: u64, bytes: u64, page_size: u64) {
        let dp = pages.saturating_sub(self.from.0);
        if dp >= RECENT_PAGES {
            let db = bytes.saturating_sub(self.from.1);
            self.last = Some(ratio(dp * page_size, db));
            self.from = (pages, bytes);
        }
    }

    pub fn get(&self) -> Option<f64> {
        self.last
    }
}

/// The ratio a donor offers: see the module's doc.
pub fn offered(held_logical: u64, held_stored: u64, recent: Option<f64>) -> f64 {
    let held = ratio(held_logical, held_stored);
    recent.map_or(held, |r| held.min(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offer_follows_the_smaller_ratio_within_bounds() {
        assert_eq!(offered(0, 0, None), 1.0, "nothing held: raw");
        assert_eq!(offered(3 << 20, 1 << 20, None), 3.0);
        assert_eq!(offered(100 << 20, 1 << 20, None), MAX_OFFER_RATIO);
        assert_eq!(
            offered(1 << 20, 0, None),
            MAX_OFFER_RATIO,
            "repeated words only"
        );
        assert_eq!(offered(3 << 20, 1 << 20, Some(1.0)), 1.0);
        assert_eq!(offered(2 << 20, 1 << 20, Some(3.0)), 2.0);
        assert_eq!(ratio(1 << 20, 2 << 20), 1.0, "never below raw");
    }

    #[test]
    fn a_run_of_incompressible_pages_brings_the_recent_ratio_to_one() {
        let mut r = RecentRatio::default();
        r.sample(RECENT_PAGES - 1, 1000, 4096);
        assert_eq!(r.get(), None, "too few pages yet");
        // 1024 pages at 1/3 of a page each.
        let (p, b) = (RECENT_PAGES, RECENT_PAGES * 4096 / 3);
        r.sample(p, b, 4096);
        assert!((r.get().unwrap() - 3.0).abs() < 1e-5);
        // Then 1024 raw pages.
        r.sample(2 * p, b + RECENT_PAGES * 4096, 4096);
        assert_eq!(r.get(), Some(1.0));
        assert_eq!(offered(6 << 20, 2 << 20, r.get()), 1.0);
    }
}
