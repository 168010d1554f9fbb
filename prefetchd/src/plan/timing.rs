//! Timing estimates: a job's time per reference and the fetch costs.
//!
//! PGMS estimates the time until a hinted block is used as its distance in
//! the hint stream times the job's recent inter-reference time (PGMS
//! §3.3). Here the inter-reference time is the job's *compute* time between
//! reads (end of one read to start of the next, divided over the blocks of
//! the next read), so stalls do not inflate it, plus F_L, the cost of
//! serving a block from local memory. F_G and F_D are measured: exponential
//! moving averages of real global-memory and disk fetches.

use super::Nanos;

/// Exponentially weighted moving average.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ewma {
    value: Option<f64>,
    weight: f64,
}

impl Ewma {
    /// `weight` is the share of each new sample (0 < weight <= 1).
    pub fn new(weight: f64) -> Ewma {
        Ewma {
            value: None,
            weight: weight.clamp(f64::MIN_POSITIVE, 1.0),
        }
    }

    pub fn update(&mut self, sample: f64) {
        self.value = Some(match self.value {
            None => sample,
            Some(v) => v + self.weight * (sample - v),
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }

    /// The average, or `default` before any sample.
    pub fn or(&self, default: Nanos) -> Nanos {
        self.value.map_or(default, |v| v.round().max(0.0) as Nanos)
    }
}

/// Weight of a new sample in every average here.
pub const EWMA_WEIGHT: f64 = 0.125;

/// A job's compute time between block references.
#[derive(Debug, Clone, Copy)]
pub struct RefClock {
    last_end: Option<Nanos>,
    gap: Ewma,
}

impl Default for RefClock {
    fn default() -> RefClock {
        RefClock {
            last_end: None,
            gap: Ewma::new(EWMA_WEIGHT),
        }
    }
}

impl RefClock {
    /// A read of `blocks` blocks starts at `now`.
    pub fn read_started(&mut self, now: Nanos, blocks: u64) {
        if let Some(end) = self.last_end {
            let gap = now.saturating_sub(end) as f64;
            self.gap.update(gap / blocks.max(1) as f64);
        }
    }

    /// The read finished (its bytes were returned) at `now`.
    pub fn read_done(&mut self, now: Nanos) {
        self.last_end = Some(now);
    }

    /// Compute time per block reference, or `default` before any sample.
    pub fn gap(&self, default: Nanos) -> Nanos {
        self.gap.or(default)
    }
}

/// Defaults used until the first measurement of each cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostDefaults {
    pub local: Nanos,
    pub global: Nanos,
    pub disk: Nanos,
    /// A job's compute time per reference before it has been measured.
    pub gap: Nanos,
}

impl Default for CostDefaults {
    /// PGMS's orders of magnitude: F_L tens of µs through FUSE, F_G a few
    /// hundred µs, F_D about 10 ms.
    fn default() -> CostDefaults {
        CostDefaults {
            local: 20_000,
            global: 300_000,
            disk: 10_000_000,
            gap: 250_000,
        }
    }
}

/// F_L, F_G and F_D as measured.
#[derive(Debug, Clone, Copy)]
pub struct Costs {
    defaults: CostDefaults,
    local: Ewma,
    global: Ewma,
    disk: Ewma,
    disk_last_done: Option<Nanos>,
}

impl Costs {
    pub fn new(defaults: CostDefaults) -> Costs {
        Costs {
            defaults,
            local: Ewma::new(EWMA_WEIGHT),
            global: Ewma::new(EWMA_WEIGHT),
            disk: Ewma::new(EWMA_WEIGHT),
            disk_last_done: None,
        }
    }

    /// F_L: serving a block from local memory.
    pub fn local(&self) -> Nanos {
        self.local.or(self.defaults.local)
    }

    /// F_G: fetching a block from a donor's memory.
    pub fn global(&self) -> Nanos {
        self.global.or(self.defaults.global)
    }

    /// F_D: reading a block from disk.
    pub fn disk(&self) -> Nanos {
        self.disk.or(self.defaults.disk)
    }

    pub fn local_sample(&mut self, took: Nanos) {
        self.local.update(took as f64);
    }

    pub fn global_sample(&mut self, took: Nanos) {
        self.global.update(took as f64);
    }

    /// A local disk read submitted at `submitted` finished at `done`. The
    /// disk serves one request at a time, so its service time is counted
    /// from when it became free for this request (the later of submission
    /// and the previous completion), not including the queueing before.
    pub fn disk_done(&mut self, submitted: Nanos, done: Nanos) {
        let began = self.disk_last_done.map_or(submitted, |d| d.max(submitted));
        self.disk.update(done.saturating_sub(began) as f64);
        self.disk_last_done = Some(self.disk_last_done.map_or(done, |d| d.max(done)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ewma_starts_at_first_sample_and_moves_towards_new_ones() {
        let mut e = Ewma::new(0.5);
        assert_eq!(e.or(7), 7);
        e.update(100.0);
        assert_eq!(e.or(7), 100);
        e.update(200.0);
        assert_eq!(e.or(7), 150);
    }

    #[test]
    fn ref_clock_counts_compute_time_per_block_not_stalls() {
        let mut c = RefClock::default();
        assert_eq!(c.gap(5), 5);
        c.read_started(0, 1);
        c.read_done(1_000); // stalled 1000 ns in the read
        c.read_started(1_400, 2); // computed 400 ns, reads 2 blocks
        assert_eq!(c.gap(5), 200);
    }

    #[test]
    fn disk_service_time_excludes_queueing() {
        let mut c = Costs::new(CostDefaults::default());
        // Three requests queued at once on a one-at-a-time disk, 10 each.
        c.disk_done(0, 10);
        c.disk_done(0, 20);
        c.disk_done(0, 30);
        assert_eq!(c.disk(), 10);
    }

    #[test]
    fn costs_use_defaults_until_measured() {
        let d = CostDefaults::default();
        let mut c = Costs::new(d);
        assert_eq!(
            (c.local(), c.global(), c.disk()),
            (d.local, d.global, d.disk)
        );
        c.global_sample(180_000);
        assert_eq!(c.global(), 180_000);
    }
}
