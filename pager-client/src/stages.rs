//! Where a request's time goes inside the serving process: the stages
//! between the hops of its clock (`netpager_util::trace`), counted in
//! histograms of relaxed atomics (no lock, no allocation) cheap enough to
//! stay on, shown in `status.json` and on `/metrics` as
//! `netpager_request_stage_seconds{stage,op}`.
//!
//! The stages of one request telescope: each runs from one mark it passed
//! to the next, so they add up to its time from being taken from the
//! kernel to its reply being committed. A stage it did not pass (a read of
//! a page nobody wrote sends nothing to a donor) is not counted for it.

use std::time::{Duration, Instant};

use netpager_metrics::{AtomicHistogram, HistogramSnapshot, STAGE_BOUNDS_NS};
use netpager_util::trace::{Mark, Marks};
use serde::{Deserialize, Serialize};

/// What a traced request was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageOp {
    Read,
    Write,
    /// Flush, zero or trim.
    Other,
    /// A batch of buffered writes sent to the device in the background
    /// (the write-back buffer's drain): taken when the batch is formed,
    /// committed when its pages leave the buffer.
    Drain,
}

impl StageOp {
    pub const ALL: [StageOp; 4] = [
        StageOp::Read,
        StageOp::Write,
        StageOp::Other,
        StageOp::Drain,
    ];

    pub fn word(self) -> &'static str {
        match self {
            StageOp::Read => "read",
            StageOp::Write => "write",
            StageOp::Other => "other",
            StageOp::Drain => "drain",
        }
    }
}

/// The stages, in the order a request passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Taken from the kernel until handed below the front end (parsing).
    Frontend,
    /// Handed down until its first request to a donor went out (the
    /// write-back buffer, the extent map, locks, a connection, the send),
    /// or until the device returned when no donor was asked.
    Device,
    /// First request out until the last reply was read off the socket:
    /// the network and the donors.
    Donor,
    /// Reply read until its waiting thread ran again (zero when the waiter
    /// read its own reply): the hand-off between threads.
    Wakeup,
    /// Waiter running again until the device returned.
    Complete,
    /// Device returned until the reply was committed to the kernel.
    Commit,
}

impl Stage {
    pub const ALL: [Stage; 6] = [
        Stage::Frontend,
        Stage::Device,
        Stage::Donor,
        Stage::Wakeup,
        Stage::Complete,
        Stage::Commit,
    ];

    pub fn word(self) -> &'static str {
        match self {
            Stage::Frontend => "frontend",
            Stage::Device => "device",
            Stage::Donor => "donor",
            Stage::Wakeup => "wakeup",
            Stage::Complete => "complete",
            Stage::Commit => "commit",
        }
    }
}

/// Each stage's time of one request, by its marks (`None`: not passed).
/// The stages present add up to Committed - Taken when both are marked.
pub fn stage_times(m: &Marks) -> [Option<Duration>; 6] {
    let at = |k: Mark| m[k as usize];
    let span = |a: Option<Instant>, b: Option<Instant>| Some(b?.saturating_duration_since(a?));
    let (taken, device, done, committed) = (
        at(Mark::Taken),
        at(Mark::Device),
        at(Mark::Done),
        at(Mark::Committed),
    );
    let (sent, replied, resumed) = (at(Mark::Sent), at(Mark::Replied), at(Mark::Resumed));
    // A request that reached a donor and heard back; one that sent and
    // failed before any reply counts its wait as the device's.
    let donor = sent.is_some() && replied.is_some() && resumed.is_some();
    let mut t = [None; 6];
    t[Stage::Frontend as usize] = span(taken, device);
    if donor {
        t[Stage::Device as usize] = span(device, sent);
        // Replied is the last reply; the clock never lets it precede Sent
        // (saturating), so the stages still telescope.
        t[Stage::Donor as usize] = span(sent, replied);
        t[Stage::Wakeup as usize] = span(replied, resumed);
        t[Stage::Complete as usize] = span(resumed, done);
    } else {
        t[Stage::Device as usize] = span(device, done);
    }
    t[Stage::Commit as usize] = span(done, committed);
    t
}

/// The stage histograms of a serving process, by op and stage.
#[derive(Debug)]
pub struct StageStats {
    hist: [[AtomicHistogram; 6]; 4],
}

impl Default for StageStats {
    fn default() -> Self {
        StageStats {
            hist: std::array::from_fn(|_| std::array::from_fn(|_| AtomicHistogram::stages())),
        }
    }
}

impl StageStats {
    /// Counts the stages of one finished request.
    pub fn record(&self, op: StageOp, marks: &Marks) {
        for (h, t) in self.hist[op as usize].iter().zip(stage_times(marks)) {
            if let Some(t) = t {
                h.observe(t);
            }
        }
    }

    /// The histograms as `status.json` keeps them (those with counts).
    pub fn reports(&self) -> Vec<StageReport> {
        let mut out = Vec::new();
        for op in StageOp::ALL {
            for stage in Stage::ALL {
                let h = self.hist[op as usize][stage as usize].snapshot();
                if h.count == 0 {
                    continue;
                }
                out.push(StageReport {
                    op: op.word().to_string(),
                    stage: stage.word().to_string(),
                    count: h.count,
                    seconds: h.sum_seconds,
                    buckets: h.buckets.iter().map(|(_, c)| *c).collect(),
                });
            }
        }
        out
    }
}

/// One stage of one op in `status.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageReport {
    pub op: String,
    pub stage: String,
    /// Requests that passed the stage.
    pub count: u64,
    /// Their time in it.
    pub seconds: f64,
    /// Cumulative counts within each bound of
    /// `netpager_metrics::STAGE_BOUNDS_NS`, then of all.
    pub buckets: Vec<u64>,
}

impl StageReport {
    /// The histogram, as `/metrics` shows it.
    pub fn histogram(&self) -> HistogramSnapshot {
        HistogramSnapshot::from_counts(&STAGE_BOUNDS_NS, self.seconds, self.count, &self.buckets)
    }

    /// Mean time in the stage, in microseconds.
    pub fn mean_us(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.seconds * 1e6 / self.count as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marks(offsets_us: [Option<u64>; 7]) -> (Instant, Marks) {
        let t0 = Instant::now();
        (
            t0,
            offsets_us.map(|o| o.map(|us| t0 + Duration::from_micros(us))),
        )
    }

    #[test]
    fn a_donor_request_passes_every_stage_and_they_add_up() {
        let (_, m) = marks([
            Some(0),
            Some(2),
            Some(7),
            Some(37),
            Some(45),
            Some(46),
            Some(50),
        ]);
        let t = stage_times(&m);
        let us: Vec<u64> = t.iter().map(|d| d.unwrap().as_micros() as u64).collect();
        assert_eq!(us, [2, 5, 30, 8, 1, 4]);
        assert_eq!(us.iter().sum::<u64>(), 50);
    }

    #[test]
    fn a_request_without_a_donor_counts_device_only() {
        let (_, m) = marks([Some(0), Some(1), None, None, None, Some(4), Some(6)]);
        let t = stage_times(&m);
        assert_eq!(t[Stage::Device as usize], Some(Duration::from_micros(3)));
        assert_eq!(t[Stage::Donor as usize], None);
        assert_eq!(t[Stage::Wakeup as usize], None);
        let sum: Duration = t.iter().flatten().sum();
        assert_eq!(sum, Duration::from_micros(6));
        // Sent but never answered (the request failed): the wait is the
        // device's, and the sum still holds.
        let (_, m) = marks([Some(0), Some(1), Some(2), None, None, Some(9), Some(10)]);
        let sum: Duration = stage_times(&m).iter().flatten().sum();
        assert_eq!(sum, Duration::from_micros(10));
    }

    #[test]
    fn stats_report_only_stages_passed() {
        let s = StageStats::default();
        let (_, m) = marks([Some(0), Some(1), None, None, None, Some(4), Some(6)]);
        s.record(StageOp::Read, &m);
        s.record(StageOp::Read, &m);
        let r = s.reports();
        let stages: Vec<&str> = r.iter().map(|r| r.stage.as_str()).collect();
        assert_eq!(stages, ["frontend", "device", "commit"]);
        assert!(r.iter().all(|r| r.op == "read" && r.count == 2));
        let dev = &r[1];
        assert!((dev.mean_us() - 3.0).abs() < 1e-6);
        assert_eq!(dev.histogram().count, 2);
        assert_eq!(dev.buckets.len(), netpager_metrics::STAGE_BUCKETS + 1);
    }
}
