//! The donor's state (idle / busy / draining, GMS's idle and active node
//! states plus giving memory back) and its utilisation by remote requests.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use netpager_proto::DonorState;
use netpager_util::format_size;

use crate::memwatch::MemInfo;

/// Thresholds of the state rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    pub reserve: u64,
    pub busy_load: f64,
    /// Load per CPU from which the donor offers less (`shed-load`).
    pub shed_load: f64,
    pub ncpu: usize,
}

/// The share of its room a donor at or above busy-load still offers: the
/// load shedding ends there, and clients' bounds (`u_star`) do the rest.
pub const BUSY_GIVE: f64 = 0.25;

/// G_i in all, the bytes the donor would lend now counting the pages it
/// holds (`offer_bytes` in its status; `free_bytes` is this less what it
/// holds): its budget, but never more than its node can spare (MemAvailable
/// plus its own pages, less the reserve), and less as the node's owner
/// returns: from MemAvailable at twice the reserve down to nothing at the
/// reserve (where draining starts), and from load per CPU at shed-load
/// down to [`BUSY_GIVE`] of it at busy-load. An offer below what it holds
/// asks for pages back: clients place nothing new there and their
/// rebalancers move the coldest pages off first (GMS's idle-to-active
/// transition, gradually), so a later drain has less to move. Nothing
/// while draining.
pub fn offer_bytes(
    policy: &Policy,
    obs: &Observation,
    state: DonorState,
    budget: u64,
    used: u64,
) -> u64 {
    if state == DonorState::Draining {
        return 0;
    }
    let avail = obs.mem.available;
    let spare = (avail + used).saturating_sub(policy.reserve);
    let mem = if policy.reserve == 0 {
        1.0
    } else {
        (avail.saturating_sub(policy.reserve) as f64 / policy.reserve as f64).min(1.0)
    };
    let per_cpu = obs.load1 / policy.ncpu.max(1) as f64;
    let span = policy.busy_load - policy.shed_load;
    let shed = if per_cpu <= policy.shed_load {
        0.0
    } else if span <= 0.0 || per_cpu >= policy.busy_load {
        1.0
    } else {
        (per_cpu - policy.shed_load) / span
    };
    let load = 1.0 - shed * (1.0 - BUSY_GIVE);
    (budget.min(spare) as f64 * mem * load) as u64
}

impl Policy {
    /// MemAvailable must rise this far above the reserve before a
    /// memory-pressure drain ends, so a node hovering at its reserve does
    /// not flap between draining and accepting pages.
    pub fn hysteresis(&self) -> u64 {
        self.reserve / 10
    }
}

/// One look at the node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    pub mem: MemInfo,
    pub load1: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Assessment {
    pub state: DonorState,
    pub reason: String,
}

/// Draining starts when MemAvailable < reserve or on an admin drain
/// request; a memory drain ends once MemAvailable >= reserve +
/// hysteresis, an admin drain only when lifted. Otherwise the node is busy
/// when its 1-minute load average per CPU exceeds busy-load, else idle.
#[derive(Clone, Debug, Default)]
pub struct StateMachine {
    mem_low: bool,
    admin_drain: bool,
}

impl StateMachine {
    pub fn set_admin_drain(&mut self, drain: bool) {
        self.admin_drain = drain;
    }

    pub fn assess(&mut self, policy: &Policy, obs: &Observation) -> Assessment {
        let avail = obs.mem.available;
        let leave_at = policy.reserve.saturating_add(policy.hysteresis());
        self.mem_low = if self.mem_low {
            avail < leave_at
        } else {
            avail < policy.reserve
        };
        let mem_reason = if avail < policy.reserve {
            format!(
                "MemAvailable {} below reserve {}",
                format_size(avail),
                format_size(policy.reserve)
            )
        } else {
            format!(
                "MemAvailable {} not yet back above reserve {} + {} hysteresis",
                format_size(avail),
                format_size(policy.reserve),
                format_size(policy.hysteresis())
            )
        };
        if self.admin_drain {
            let mut reason = "drain requested on the status endpoint".to_string();
            if self.mem_low {
                reason = format!("{reason}; {mem_reason}");
            }
            return Assessment {
                state: DonorState::Draining,
                reason,
            };
        }
        if self.mem_low {
            return Assessment {
                state: DonorState::Draining,
                reason: mem_reason,
            };
        }
        let per_cpu = obs.load1 / policy.ncpu.max(1) as f64;
        let load = format!(
            "load average {:.2} over {} CPUs is {:.2} per CPU",
            obs.load1, policy.ncpu, per_cpu
        );
        if per_cpu > policy.busy_load {
            Assessment {
                state: DonorState::Busy,
                reason: format!("{load}, above busy-load {:.2}", policy.busy_load),
            }
        } else {
            Assessment {
                state: DonorState::Idle,
                reason: format!(
                    "{load}, within busy-load {:.2}; MemAvailable {} above reserve {}",
                    policy.busy_load,
                    format_size(avail),
                    format_size(policy.reserve)
                ),
            }
        }
    }
}

/// Utilisation by remote requests over a sliding window: the plugin's
/// summed request service time in the window divided by (window length x
/// CPUs), clamped to 0..1, so 1.0 means every CPU did nothing but serve
/// remote requests. Built from periodic samples of two running totals.
#[derive(Clone, Debug)]
pub struct UtilWindow {
    window: Duration,
    ncpu: usize,
    samples: VecDeque<(Instant, u64, u64)>,
}

/// What [`UtilWindow::measure`] found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Utilisation {
    /// Fraction of CPU time spent serving requests (0..1).
    pub fraction: f64,
    /// Mean service time of one request, microseconds (0 without requests).
    pub mean_service_us: f64,
}

impl UtilWindow {
    pub fn new(window: Duration, ncpu: usize, at: Instant, busy_ns: u64, requests: u64) -> Self {
        UtilWindow {
            window,
            ncpu: ncpu.max(1),
            samples: VecDeque::from([(at, busy_ns, requests)]),
        }
    }

    /// Records the running totals (busy nanoseconds, requests) at `at`,
    /// keeping one sample at or before the window's start as baseline.
    pub fn push(&mut self, at: Instant, busy_ns: u64, requests: u64) {
        self.samples.push_back((at, busy_ns, requests));
        let start = at.checked_sub(self.window).unwrap_or(at);
        while self.samples.len() > 2 && self.samples[1].0 <= start {
            self.samples.pop_front();
        }
    }

    /// Utilisation from the baseline sample to the totals at `at`.
    pub fn measure(&self, at: Instant, busy_ns: u64, requests: u64) -> Utilisation {
        let (t0, b0, r0) = self
            .samples
            .front()
            .copied()
            .unwrap_or((at, busy_ns, requests));
        let span = at.saturating_duration_since(t0).as_nanos() as f64;
        let busy = busy_ns.saturating_sub(b0) as f64;
        let n = requests.saturating_sub(r0);
        let fraction = if span > 0.0 {
            (busy / (span * self.ncpu as f64)).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let mean_service_us = if n > 0 { busy / n as f64 / 1000.0 } else { 0.0 };
        Utilisation {
            fraction,
            mean_service_us,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn obs(avail_mib: u64, load1: f64) -> Observation {
        Observation {
            mem: MemInfo {
                total: 1024 * MIB,
                available: avail_mib * MIB,
            },
            load1,
        }
    }

    #[test]
    fn the_offer_shrinks_as_load_and_memory_use_rise() {
        let p = Policy {
            reserve: 100 * MIB,
            busy_load: 0.5,
            shed_load: 0.25,
            ncpu: 2,
        };
        // Offer in MiB with `avail` MiB available, load `load1`, a budget
        // of 400 MiB of which 100 MiB held.
        let offer = |avail, load1| {
            offer_bytes(
                &p,
                &obs(avail, load1),
                DonorState::Idle,
                400 * MIB,
                100 * MIB,
            ) / MIB
        };
        // Idle and roomy: the whole budget.
        assert_eq!(offer(900, 0.2), 400);
        // Memory use rises: at most what the node can spare (its pages
        // included), less from MemAvailable at twice the reserve.
        assert_eq!(offer(300, 0.2), 300);
        assert_eq!(offer(150, 0.2), 75);
        assert_eq!(offer(100, 0.2), 0);
        // Load rises past shed-load (0.25 per CPU): less, down to a
        // quarter at busy-load (0.5 per CPU) and above.
        assert_eq!(offer(900, 0.5), 400);
        assert_eq!(offer(900, 0.75), 250);
        assert_eq!(offer(900, 1.0), 100);
        assert_eq!(offer(900, 4.0), 100);
        // Draining: nothing.
        let draining = offer_bytes(&p, &obs(900, 0.0), DonorState::Draining, 400 * MIB, 0);
        assert_eq!(draining, 0);
        // shed-load at busy-load and no reserve: everything until busy.
        let q = Policy {
            shed_load: 0.5,
            reserve: 0,
            ..p
        };
        let all = offer_bytes(&q, &obs(50, 0.9), DonorState::Idle, 400 * MIB, 100 * MIB);
        assert_eq!(all, 150 * MIB);
    }

    #[test]
    fn states_follow_memory_load_and_admin() {
        let p = Policy {
            reserve: 100 * MIB,
            busy_load: 0.5,
            shed_load: 0.25,
            ncpu: 2,
        };
        let mut m = StateMachine::default();
        let a = m.assess(&p, &obs(500, 0.2));
        assert_eq!(a.state, DonorState::Idle);
        assert!(a.reason.contains("0.10 per CPU"), "{}", a.reason);
        let a = m.assess(&p, &obs(500, 1.52));
        assert_eq!(a.state, DonorState::Busy);
        assert_eq!(
            a.reason,
            "load average 1.52 over 2 CPUs is 0.76 per CPU, above busy-load 0.50"
        );
        let a = m.assess(&p, &obs(80, 0.0));
        assert_eq!(a.state, DonorState::Draining);
        assert_eq!(a.reason, "MemAvailable 80 MiB below reserve 100 MiB");
        // Hysteresis: 105 MiB is above the reserve but below 110 MiB.
        let a = m.assess(&p, &obs(105, 0.0));
        assert_eq!(a.state, DonorState::Draining);
        assert!(
            a.reason
                .contains("not yet back above reserve 100 MiB + 10 MiB"),
            "{}",
            a.reason
        );
        assert_eq!(m.assess(&p, &obs(111, 0.0)).state, DonorState::Idle);
        assert_eq!(
            m.assess(&p, &obs(105, 0.0)).state,
            DonorState::Idle,
            "entering needs MemAvailable < reserve"
        );
        m.set_admin_drain(true);
        let a = m.assess(&p, &obs(900, 0.0));
        assert_eq!(
            a,
            Assessment {
                state: DonorState::Draining,
                reason: "drain requested on the status endpoint".into()
            }
        );
        let a = m.assess(&p, &obs(50, 0.0));
        assert!(
            a.reason
                .ends_with("; MemAvailable 50 MiB below reserve 100 MiB"),
            "{}",
            a.reason
        );
        m.set_admin_drain(false);
        assert_eq!(
            m.assess(&p, &obs(50, 0.0)).state,
            DonorState::Draining,
            "memory drain outlives the admin one"
        );
        assert_eq!(m.assess(&p, &obs(900, 0.0)).state, DonorState::Idle);
    }

    #[test]
    fn utilisation_over_the_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = UtilWindow::new(10 * s, 2, t0, 0, 0);
        assert_eq!(
            w.measure(t0, 0, 0),
            Utilisation {
                fraction: 0.0,
                mean_service_us: 0.0
            }
        );
        // 4 s of service by 2000 requests in 4 s of wall time on 2 CPUs.
        let u = w.measure(t0 + 4 * s, 4_000_000_000, 2000);
        assert_eq!(
            u,
            Utilisation {
                fraction: 0.5,
                mean_service_us: 2000.0
            }
        );
        for i in 1..=30 {
            w.push(t0 + i * s, u64::from(i) * 1_000_000_000, u64::from(i) * 10);
        }
        // The baseline slid to 20 s: 10 s busy in 10 s on 2 CPUs.
        let u = w.measure(t0 + 30 * s, 30_000_000_000, 300);
        assert_eq!(
            u,
            Utilisation {
                fraction: 0.5,
                mean_service_us: 100_000.0
            }
        );
        assert_eq!(
            w.measure(t0 + 30 * s, 90_000_000_000, 300).fraction,
            1.0,
            "clamped"
        );
    }
}
