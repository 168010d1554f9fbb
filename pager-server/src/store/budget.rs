//! The page budget shared by all exports of a donor: every 4 KiB page the
//! store takes from its slabs, raw or part of a zspage, is counted here,
//! so `used` is the memory the donor really holds for its clients.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// Why the budget gave no pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Draining,
    Full { free: u64 },
}

/// Page budget shared by all exports of a donor.
pub struct Budget {
    limit: u64,
    used: AtomicU64,
    refusing: AtomicBool,
}

impl Budget {
    pub fn new(limit_pages: u64) -> Self {
        Budget {
            limit: limit_pages,
            used: AtomicU64::new(0),
            refusing: AtomicBool::new(false),
        }
    }

    pub fn limit_pages(&self) -> u64 {
        self.limit
    }

    pub fn used_pages(&self) -> u64 {
        self.used.load(Relaxed)
    }

    /// While refusing (draining), no new page is handed out.
    pub fn set_refusing(&self, refusing: bool) {
        self.refusing.store(refusing, Relaxed);
    }

    pub fn refusing(&self) -> bool {
        self.refusing.load(Relaxed)
    }

    /// Takes `n` pages, all or none.
    pub fn take(&self, n: u64) -> Result<(), Refusal> {
        if n == 0 {
            return Ok(());
        }
        if self.refusing() {
            return Err(Refusal::Draining);
        }
        self.used
            .fetch_update(Relaxed, Relaxed, |u| {
                u.checked_add(n).filter(|t| *t <= self.limit)
            })
            .map(|_| ())
            .map_err(|u| Refusal::Full {
                free: self.limit.saturating_sub(u),
            })
    }

    pub fn give_back(&self, n: u64) {
        if n > 0 {
            self.used.fetch_sub(n, Relaxed);
        }
    }
}
