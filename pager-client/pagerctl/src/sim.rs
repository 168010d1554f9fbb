//! A deterministic simulation of donor selection, to choose the load-balancing
//! rate b (docs/DESIGN.md "2.1 Choosing a donor") and to compare the weighted
//! rule with the simpler placements other systems use.
//!
//! The model, per run (one row of the report):
//!
//! - N donors. [`ClusterShape::Mixed`]: capacities of 1x, 1.5x and 2x
//!   `pages_per_donor`, donor 0 and every odd donor busy: their owners let
//!   remote pages use only a quarter of the memory (`G_i` = capacity/4) and
//!   a quarter of the machine (`U*` = 0.25); the others are idle (`G_i` =
//!   capacity). [`ClusterShape::Uniform`]: equal donors, only donor 0 busy.
//! - The cluster starts full of remote pages of random ages. Every placement
//!   stores a new page on the chosen donor, which makes room by replacing
//!   its oldest replaceable page (or uses a free page if it has one). Ages
//!   are global-clock ages, so pages nobody touches grow older.
//! - C clients place pages at fixed rates (client 0 three times as fast as
//!   the others), interleaved in time.
//! - Donors report their status at each epoch start (G_i, age of the x-th
//!   oldest page or [`FREE_PAGE_AGE_MS`] with x free pages, utilisation of
//!   the last epoch); clients recompute their frequencies from it. A client
//!   whose donors are all capped sends only Σ bound of its requests remote
//!   and the rest to local disk (fallback).
//! - At `idle_epoch` donor 0's owner leaves: the donor turns idle, its G
//!   jumps to its whole capacity, half of the new pages are free and half
//!   are the owner's pages, last used long ago and now the oldest in the
//!   cluster (Voelker's thesis §3.4.1: new idle memory concentrates requests).
//!
//! Measured per run:
//!
//! - skew: each epoch, max/mean utilisation (requests x S / epoch) over the
//!   donors; mean over epochs (`skew`) and worst epoch (`peak_skew`);
//! - slowdown: mean response time of remote requests in units of S, taking
//!   each donor as an M/M/1 queue at its utilisation in that epoch, 1/(1−U)
//!   with U capped at 0.99: what skew costs;
//! - age deviation: for every replaced page, the fraction of the cluster's
//!   replaceable pages older than it (its percentile rank in the global LRU
//!   order; 0 = exact global LRU, a free page counts as 0), averaged;
//! - over bound: donor-epochs whose utilisation exceeded what the donor
//!   allows (U* busy, 1 idle) by more than one request per client (each
//!   client rounds its share to whole requests);
//! - fallback: requests sent to local disk because every donor was capped;
//! - capped: client-epochs in which at least one bound bound.
//!
//! Only page placements (putpages) are simulated; faults that read pages
//! back follow wherever the pages were placed.

use std::collections::VecDeque;
use std::fmt::Write as _;

use serde::Serialize;
use thiserror::Error;

use pager_client::policy::{
    self, DonorView, PolicyError, PolicyParams, Selector, FREE_PAGE_AGE_MS,
};

/// Inputs of [`run`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimConfig {
    pub donors: usize,
    pub clients: usize,
    pub epochs: u32,
    /// One weighted-rule row per load-balancing rate.
    pub b_values: Vec<f64>,
    pub seed: u64,
    /// Capacity unit of a donor, in pages (donors have 1x, 1.5x or 2x).
    pub pages_per_donor: u64,
    /// Pages each client places per epoch (client 0: three times this).
    pub requests_per_client: u64,
    /// S, seconds per request at a donor.
    pub service_time_s: f64,
    /// Epoch length (status period), seconds.
    pub epoch_s: f64,
    /// x of "age of the x-th oldest page".
    pub age_x: u64,
    /// Borrowing unused capacity (Voelker's thesis §3.6.2).
    pub borrowing: bool,
    /// Epoch at whose start donor 0 turns idle; none if ≥ `epochs`.
    pub idle_epoch: u32,
    pub shape: ClusterShape,
}

/// Which donors the cluster has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ClusterShape {
    /// Donors of 1x, 1.5x and 2x the base size; donor 0 and every odd
    /// donor busy.
    Mixed,
    /// Donors of equal size; only donor 0 busy.
    Uniform,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            donors: 8,
            clients: 8,
            epochs: 60,
            b_values: vec![0.0, 0.25, 0.5, 0.75, 0.9, 1.0],
            seed: 1,
            pages_per_donor: 32_768,
            requests_per_client: 1000,
            service_time_s: 100e-6,
            epoch_s: 1.0,
            age_x: 64,
            borrowing: true,
            idle_epoch: 20,
            shape: ClusterShape::Mixed,
        }
    }
}

/// One placement's results; fractions are 0..=1.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimRow {
    pub policy: String,
    /// Load-balancing rate, for the weighted rule only.
    pub b: Option<f64>,
    pub skew: f64,
    pub peak_skew: f64,
    /// Mean response time of remote requests in units of S, each donor an
    /// M/M/1 queue at its epoch's utilisation (capped at 0.99).
    pub slowdown: f64,
    pub age_deviation: f64,
    pub over_bound: f64,
    pub fallback: f64,
    pub capped: f64,
    /// The same measures epoch by epoch.
    pub per_epoch: Vec<EpochPoint>,
}

/// One epoch of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochPoint {
    pub skew: f64,
    pub slowdown: f64,
    pub age_deviation: f64,
    pub fallback: f64,
}

/// Result of [`run`]: the configuration and one row per placement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    pub config: SimConfig,
    pub rows: Vec<SimRow>,
}

impl SimReport {
    /// The rows as an aligned text table.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "{:<13} {:>5} {:>6} {:>10} {:>9} {:>8} {:>11} {:>9} {:>7}\n",
            "policy",
            "b",
            "skew",
            "peak skew",
            "slowdown",
            "age dev",
            "over bound",
            "fallback",
            "capped"
        );
        for r in &self.rows {
            let b = r.b.map_or_else(|| "-".to_owned(), |b| format!("{b:.2}"));
            let pct = |x: f64| format!("{:.1}%", 100.0 * x);
            // Writing to a String cannot fail.
            let _ = writeln!(
                out,
                "{:<13} {:>5} {:>6.2} {:>10.2} {:>9.2} {:>8} {:>11} {:>9} {:>7}",
                r.policy,
                b,
                r.skew,
                r.peak_skew,
                r.slowdown,
                pct(r.age_deviation),
                pct(r.over_bound),
                pct(r.fallback),
                pct(r.capped)
            );
        }
        out
    }

    pub fn to_json(&self) -> serde_json::Result<String> {
        serde_json::to_string_pretty(self)
    }
}

/// Invalid [`SimConfig`].
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SimError {
    #[error("simulation field {field} must be at least {min}, got {value}")]
    TooSmall {
        field: &'static str,
        min: u64,
        value: u64,
    },
    #[error("simulation field {field} = {value} is not a finite number > 0")]
    NotPositive { field: &'static str, value: f64 },
    #[error("weighted rule with b = {b}: {source}")]
    Policy {
        b: f64,
        #[source]
        source: PolicyError,
    },
}

impl SimConfig {
    fn validate(&self) -> Result<(), SimError> {
        let at_least = |field, min: u64, value: u64| {
            if value < min {
                Err(SimError::TooSmall { field, min, value })
            } else {
                Ok(())
            }
        };
        at_least("donors", 1, self.donors as u64)?;
        at_least("clients", 1, self.clients as u64)?;
        at_least("epochs", 1, u64::from(self.epochs))?;
        at_least("pages_per_donor", 4, self.pages_per_donor)?;
        at_least("requests_per_client", 1, self.requests_per_client)?;
        at_least("age_x", 1, self.age_x)?;
        for (field, value) in [
            ("service_time_s", self.service_time_s),
            ("epoch_s", self.epoch_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(SimError::NotPositive { field, value });
            }
        }
        for &b in &self.b_values {
            let p = PolicyParams {
                b,
                service_time_s: self.service_time_s,
                interarrival_s: self.epoch_s,
                n_clients: 1,
                borrowing: self.borrowing,
            };
            p.validate()
                .map_err(|source| SimError::Policy { b, source })?;
        }
        Ok(())
    }
}

/// Runs the weighted rule for every b, then the related placements.
pub fn run(config: &SimConfig) -> Result<SimReport, SimError> {
    config.validate()?;
    let mut placements: Vec<Placement> = config
        .b_values
        .iter()
        .map(|&b| Placement::Weighted(b))
        .collect();
    placements.extend([
        Placement::RoundRobin,
        Placement::Random,
        Placement::PowerOfTwo,
        Placement::Hash,
        Placement::GlobalLru,
    ]);
    let rows = placements
        .into_iter()
        .map(|p| Cluster::new(config).run(p))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SimReport {
        config: config.clone(),
        rows,
    })
}

#[derive(Debug, Clone, Copy)]
enum Placement {
    /// The rule of [`pager_client::policy`] with this b.
    Weighted(f64),
    /// The Remote Memory Pager: donors in turn.
    RoundRobin,
    /// N-chance: a uniformly random donor.
    Random,
    /// Infiniswap: the less loaded (this epoch) of two random donors.
    PowerOfTwo,
    /// Hash-distributed caching: rendezvous hash of the block number.
    Hash,
    /// Reference: the donor holding the globally oldest page (exact global
    /// LRU, with knowledge no real client has).
    GlobalLru,
}

impl Placement {
    fn name(self) -> &'static str {
        match self {
            Placement::Weighted(_) => "weighted",
            Placement::RoundRobin => "round-robin",
            Placement::Random => "random",
            Placement::PowerOfTwo => "power-of-two",
            Placement::Hash => "hash",
            Placement::GlobalLru => "global-lru",
        }
    }
}

/// splitmix64: tiny, seeded, good enough to place pages.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Counts of replaceable pages by last-use tick, for percentile ranks.
struct Fenwick {
    tree: Vec<u32>,
    total: u64,
}

impl Fenwick {
    fn new(n: usize) -> Self {
        Fenwick {
            tree: vec![0; n + 1],
            total: 0,
        }
    }

    fn add(&mut self, tick: u64, delta: i32) {
        let mut i = tick as usize + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(delta);
            i += i & i.wrapping_neg();
        }
        self.total = self.total.wrapping_add_signed(i64::from(delta));
    }

    /// Pages last used strictly before `tick`.
    fn older_than(&self, tick: u64) -> u64 {
        let mut i = tick as usize;
        let mut sum = 0u64;
        while i > 0 {
            sum += u64::from(self.tree[i]);
            i -= i & i.wrapping_neg();
        }
        sum
    }
}

struct Donor {
    capacity: u64,
    budget: u64,
    busy: bool,
    u_star: f64,
    /// The owner's pages once it has left, oldest first.
    own: VecDeque<u64>,
    /// Placed pages, oldest first (placement ticks only grow).
    guest: VecDeque<u64>,
    epoch_requests: u64,
    last_utilisation: f64,
}

impl Donor {
    fn give(&self) -> u64 {
        if self.busy {
            self.budget
        } else {
            self.capacity
        }
    }

    fn allowed(&self) -> f64 {
        if self.busy {
            self.u_star
        } else {
            1.0
        }
    }

    fn held(&self) -> u64 {
        (self.own.len() + self.guest.len()) as u64
    }

    fn free(&self) -> u64 {
        self.give().saturating_sub(self.held())
    }

    fn oldest(&self) -> Option<u64> {
        match (self.own.front(), self.guest.front()) {
            (Some(&o), Some(&g)) => Some(o.min(g)),
            (o, g) => o.or(g).copied(),
        }
    }

    /// Tick of the k-th oldest held page (1-based), or the youngest if
    /// fewer are held.
    fn kth_oldest(&self, k: u64) -> Option<u64> {
        let (mut o, mut g) = (self.own.iter().peekable(), self.guest.iter().peekable());
        let mut last = None;
        for _ in 0..k {
            last = match (o.peek(), g.peek()) {
                (Some(&&a), Some(&&b)) if a <= b => o.next().copied(),
                (_, Some(_)) => g.next().copied(),
                (Some(_), None) => o.next().copied(),
                (None, None) => break,
            };
        }
        last
    }

    /// Stores a page placed at `now`; returns the percentile rank of the
    /// page it replaced in the cluster's LRU order.
    fn place(&mut self, now: u64, lru: &mut Fenwick) -> f64 {
        let rank = if self.free() > 0 {
            0.0
        } else {
            let from_own = matches!(
                (self.own.front(), self.guest.front()),
                (Some(o), Some(g)) if o <= g
            ) || self.guest.is_empty();
            let victim = if from_own {
                self.own.pop_front()
            } else {
                self.guest.pop_front()
            }
            .expect("a donor without free pages holds pages");
            let rank = lru.older_than(victim) as f64 / lru.total as f64;
            lru.add(victim, -1);
            rank
        };
        self.guest.push_back(now);
        lru.add(now, 1);
        rank
    }
}

struct Cluster<'a> {
    config: &'a SimConfig,
    donors: Vec<Donor>,
    lru: Fenwick,
    rng: Rng,
    /// Ticks reserved below the initial pages for donor 0's owner pages.
    owner_pages: u64,
    /// First tick of the simulated requests.
    start: u64,
}

impl<'a> Cluster<'a> {
    fn new(config: &'a SimConfig) -> Self {
        let mut rng = Rng(config.seed);
        let donors: Vec<Donor> = (0..config.donors)
            .map(|i| {
                let (capacity, busy) = match config.shape {
                    ClusterShape::Mixed => (
                        config.pages_per_donor * (2 + ((i + 2) % 3) as u64) / 2,
                        i == 0 || i % 2 == 1,
                    ),
                    ClusterShape::Uniform => (config.pages_per_donor, i == 0),
                };
                Donor {
                    capacity,
                    budget: capacity / 4,
                    busy,
                    u_star: 0.25,
                    own: VecDeque::new(),
                    guest: VecDeque::new(),
                    epoch_requests: 0,
                    last_utilisation: 0.0,
                }
            })
            .collect();
        let owner_pages = (donors[0].capacity - donors[0].budget) / 2;
        let initial: u64 = donors.iter().map(Donor::give).sum();
        let requests =
            u64::from(config.epochs) * config.requests_per_client * (config.clients as u64 + 2);
        let start = owner_pages + initial;
        let mut cluster = Cluster {
            config,
            donors,
            lru: Fenwick::new((start + requests + 1) as usize),
            rng: Rng(0),
            owner_pages,
            start,
        };
        // Fill every donor with pages of random ages: each tick goes to a
        // donor with probability proportional to its remaining room.
        let mut room: Vec<u64> = cluster.donors.iter().map(Donor::give).collect();
        let mut left = initial;
        for tick in owner_pages..start {
            let mut r = rng.below(left);
            let d = room
                .iter()
                .position(|&n| {
                    if r < n {
                        true
                    } else {
                        r -= n;
                        false
                    }
                })
                .expect("r < total room");
            room[d] -= 1;
            left -= 1;
            cluster.donors[d].guest.push_back(tick);
            cluster.lru.add(tick, 1);
        }
        cluster.rng = rng;
        cluster
    }

    fn owner_leaves(&mut self) {
        let d = &mut self.donors[0];
        d.busy = false;
        for tick in 0..self.owner_pages {
            d.own.push_back(tick);
            self.lru.add(tick, 1);
        }
    }

    fn ticks_per_epoch(&self) -> u64 {
        self.config.requests_per_client * (self.config.clients as u64 + 2)
    }

    fn view(&self, d: &Donor, now: u64) -> DonorView {
        let x = self.config.age_x;
        let age_x_ms = if d.free() >= x {
            FREE_PAGE_AGE_MS
        } else {
            let ms_per_tick = self.config.epoch_s * 1000.0 / self.ticks_per_epoch() as f64;
            d.kth_oldest(x - d.free())
                .map_or(0, |t| ((now - t) as f64 * ms_per_tick) as u64)
        };
        DonorView {
            give_pages: d.give(),
            age_x_ms,
            busy: d.busy,
            u_star: d.u_star,
            u_unused: (d.allowed() - d.last_utilisation).clamp(0.0, 1.0),
            eligible: true,
        }
    }

    /// Which client sends each request of an epoch, in time order.
    fn arrival_order(&self) -> Vec<usize> {
        let mut arrivals: Vec<(f64, usize)> = Vec::new();
        for j in 0..self.config.clients {
            let n = self.requests_of(j);
            arrivals.extend((0..n).map(|k| ((k as f64 + 0.5) / n as f64, j)));
        }
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        arrivals.into_iter().map(|(_, j)| j).collect()
    }

    fn requests_of(&self, client: usize) -> u64 {
        self.config.requests_per_client * if client == 0 { 3 } else { 1 }
    }

    /// Each client's frequencies for this epoch and the share of its
    /// requests it sends remote (below 1 when all its donors are capped).
    fn plans(&self, b: f64, tally: &mut Tally) -> Result<Vec<Plan>, SimError> {
        let now = tally.now;
        let views: Vec<DonorView> = self.donors.iter().map(|d| self.view(d, now)).collect();
        (0..self.config.clients)
            .map(|j| {
                let p = PolicyParams {
                    b,
                    service_time_s: self.config.service_time_s,
                    interarrival_s: self.config.epoch_s / self.requests_of(j) as f64,
                    n_clients: self.config.clients as u32,
                    borrowing: self.config.borrowing,
                };
                let fr = policy::frequencies(&views, &p)
                    .map_err(|source| SimError::Policy { b, source })?;
                if fr.capped.iter().any(|&c| c) {
                    tally.capped_client_epochs += 1;
                }
                let remote = if fr.all_capped { fr.total() } else { 1.0 };
                Ok(Plan {
                    f: fr.f,
                    remote,
                    remote_credit: 0.0,
                })
            })
            .collect()
    }

    /// The donor a placement other than the weighted rule chooses.
    fn pick_unweighted(&mut self, placement: Placement, next_rr: &mut usize) -> Option<usize> {
        let n = self.donors.len();
        let usable: Vec<usize> = (0..n).filter(|&i| self.donors[i].give() > 0).collect();
        if usable.is_empty() {
            return None;
        }
        let m = usable.len() as u64;
        let pick = match placement {
            Placement::Weighted(_) => unreachable!("the weighted rule picks through its plan"),
            Placement::RoundRobin => {
                let i = (0..n)
                    .map(|k| (*next_rr + k) % n)
                    .find(|i| usable.contains(i))?;
                *next_rr = i + 1;
                i
            }
            Placement::Random => usable[self.rng.below(m) as usize],
            Placement::PowerOfTwo => {
                let a = self.rng.below(m) as usize;
                let b = (a + 1 + self.rng.below(m.max(2) - 1) as usize) % usable.len();
                let (a, b) = (usable[a], usable[b]);
                if self.donors[b].epoch_requests < self.donors[a].epoch_requests {
                    b
                } else {
                    a
                }
            }
            Placement::Hash => {
                let block = self.rng.next_u64();
                *usable
                    .iter()
                    .max_by_key(|&&i| mix(block ^ (i as u64).wrapping_mul(0xA076_1D64_78BD_642F)))?
            }
            Placement::GlobalLru => *usable.iter().min_by_key(|&&i| {
                let d = &self.donors[i];
                // A free page beats any stored one.
                if d.free() > 0 {
                    0
                } else {
                    d.oldest().map_or(u64::MAX, |t| t + 1)
                }
            })?,
        };
        Some(pick)
    }

    fn run(mut self, placement: Placement) -> Result<SimRow, SimError> {
        let config = self.config;
        let order = self.arrival_order();
        let mut tally = Tally {
            now: self.start,
            ..Tally::default()
        };
        let mut selectors: Vec<Selector> = (0..config.clients)
            .map(|_| Selector::new(self.donors.len()))
            .collect();
        let mut next_rr = 0usize;

        for epoch in 0..config.epochs {
            if epoch == config.idle_epoch {
                self.owner_leaves();
            }
            let mut plans = match placement {
                Placement::Weighted(b) => self.plans(b, &mut tally)?,
                _ => Vec::new(),
            };
            for d in &mut self.donors {
                d.epoch_requests = 0;
            }
            tally.start_epoch();
            for &j in &order {
                tally.now += 1;
                let target = match plans.get_mut(j) {
                    Some(plan) => {
                        plan.remote_credit += plan.remote;
                        if plan.remote_credit < 1.0 - 1e-12 {
                            None
                        } else {
                            plan.remote_credit -= 1.0;
                            let donors = &self.donors;
                            selectors[j].pick(&plan.f, |i| donors[i].give() > 0)
                        }
                    }
                    None => self.pick_unweighted(placement, &mut next_rr),
                };
                match target {
                    Some(i) => {
                        tally.rank_sum += self.donors[i].place(tally.now, &mut self.lru);
                        tally.placed += 1;
                        self.donors[i].epoch_requests += 1;
                    }
                    None => tally.fallback += 1,
                }
            }
            tally.end_epoch(config, &mut self.donors);
        }
        Ok(tally.row(config, placement, self.donors.len()))
    }
}

/// One client's placements for an epoch.
struct Plan {
    f: Vec<f64>,
    remote: f64,
    remote_credit: f64,
}

/// What one run measured so far.
#[derive(Default)]
struct Tally {
    now: u64,
    skew_sum: f64,
    skew_epochs: u32,
    peak_skew: f64,
    response_sum: f64,
    rank_sum: f64,
    placed: u64,
    fallback: u64,
    over_bound: u64,
    capped_client_epochs: u64,
    per_epoch: Vec<EpochPoint>,
    epoch_start: (f64, u64, u64),
}

impl Tally {
    fn start_epoch(&mut self) {
        self.epoch_start = (self.rank_sum, self.placed, self.fallback);
    }

    fn end_epoch(&mut self, config: &SimConfig, donors: &mut [Donor]) {
        let utilisation: Vec<f64> = donors
            .iter()
            .map(|d| d.epoch_requests as f64 * config.service_time_s / config.epoch_s)
            .collect();
        let mean = utilisation.iter().sum::<f64>() / donors.len() as f64;
        let mut skew = 0.0;
        if mean > 0.0 {
            skew = utilisation.iter().copied().fold(0.0, f64::max) / mean;
            self.skew_sum += skew;
            self.skew_epochs += 1;
            self.peak_skew = self.peak_skew.max(skew);
        }
        let response: f64 = donors
            .iter()
            .zip(&utilisation)
            .map(|(d, &u)| d.epoch_requests as f64 / (1.0 - u.min(0.99)))
            .sum();
        self.response_sum += response;
        let (rank_before, placed_before, fallback_before) = self.epoch_start;
        let placed = self.placed - placed_before;
        let fallback = self.fallback - fallback_before;
        self.per_epoch.push(EpochPoint {
            skew,
            slowdown: ratio(response, placed as f64),
            age_deviation: ratio(self.rank_sum - rank_before, placed as f64),
            fallback: ratio(fallback as f64, (placed + fallback) as f64),
        });
        // Each client rounds its share to whole requests.
        let slack = config.clients as f64 * config.service_time_s / config.epoch_s;
        for (d, &u) in donors.iter_mut().zip(&utilisation) {
            if u > d.allowed() + slack {
                self.over_bound += 1;
            }
            d.last_utilisation = u;
        }
    }

    fn row(self, config: &SimConfig, placement: Placement, donors: usize) -> SimRow {
        let epochs = u64::from(config.epochs);
        let b = match placement {
            Placement::Weighted(b) => Some(b),
            _ => None,
        };
        SimRow {
            policy: placement.name().to_owned(),
            b,
            skew: ratio(self.skew_sum, f64::from(self.skew_epochs)),
            peak_skew: self.peak_skew,
            slowdown: ratio(self.response_sum, self.placed as f64),
            age_deviation: ratio(self.rank_sum, self.placed as f64),
            over_bound: ratio(self.over_bound as f64, (epochs * donors as u64) as f64),
            fallback: ratio(self.fallback as f64, (self.placed + self.fallback) as f64),
            capped: ratio(
                self.capped_client_epochs as f64,
                (epochs * config.clients as u64) as f64,
            ),
            per_epoch: self.per_epoch,
        }
    }
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SimConfig {
        SimConfig {
            donors: 4,
            clients: 3,
            epochs: 12,
            b_values: vec![0.0, 0.5, 1.0],
            seed: 7,
            pages_per_donor: 512,
            requests_per_client: 100,
            idle_epoch: 4,
            ..SimConfig::default()
        }
    }

    fn row<'r>(report: &'r SimReport, policy: &str, b: Option<f64>) -> &'r SimRow {
        report
            .rows
            .iter()
            .find(|r| r.policy == policy && r.b == b)
            .unwrap_or_else(|| panic!("no row {policy} {b:?}"))
    }

    #[test]
    fn runs_every_placement_deterministically() {
        let report = run(&small()).unwrap();
        let names: Vec<(&str, Option<f64>)> = report
            .rows
            .iter()
            .map(|r| (r.policy.as_str(), r.b))
            .collect();
        assert_eq!(
            names,
            vec![
                ("weighted", Some(0.0)),
                ("weighted", Some(0.5)),
                ("weighted", Some(1.0)),
                ("round-robin", None),
                ("random", None),
                ("power-of-two", None),
                ("hash", None),
                ("global-lru", None),
            ]
        );
        assert_eq!(run(&small()).unwrap(), report);
        for r in &report.rows {
            assert!(r.skew >= 1.0 && r.peak_skew >= r.skew, "{r:?}");
            assert!((0.0..1.0).contains(&r.age_deviation), "{r:?}");
        }
        let mut other_seed = small();
        other_seed.seed = 8;
        assert_ne!(run(&other_seed).unwrap().rows, report.rows);
    }

    #[test]
    fn placements_show_their_known_character() {
        let report = run(&small()).unwrap();
        let round_robin = row(&report, "round-robin", None);
        // Round-robin spreads requests exactly evenly.
        assert!((round_robin.skew - 1.0).abs() < 1e-9);
        // Exact global LRU replaces the oldest page, by construction.
        assert_eq!(row(&report, "global-lru", None).age_deviation, 0.0);
        let (b0, b1) = (
            row(&report, "weighted", Some(0.0)),
            row(&report, "weighted", Some(1.0)),
        );
        // Age weights send everyone to the newly idle donor at once.
        assert!(b1.peak_skew < b0.peak_skew, "{b0:?} {b1:?}");
        // Target weights follow the donors' sizes, which round-robin
        // ignores: small donors then replace young pages.
        assert!(
            b1.age_deviation < round_robin.age_deviation,
            "{b1:?} {round_robin:?}"
        );
    }

    #[test]
    fn age_weights_use_new_idle_memory_first() {
        let config = SimConfig {
            shape: ClusterShape::Uniform,
            b_values: vec![0.0, 1.0],
            // Room for more than an epoch of placements.
            pages_per_donor: 2048,
            ..small()
        };
        let report = run(&config).unwrap();
        let after_idle = |b| {
            let r = row(&report, "weighted", Some(b));
            let from = config.idle_epoch as usize;
            r.per_epoch[from..from + 2]
                .iter()
                .map(|e| e.age_deviation)
                .sum::<f64>()
        };
        assert!(after_idle(0.0) < after_idle(1.0), "{report:?}");
    }

    #[test]
    fn tight_bounds_fall_back_to_local_disk() {
        // The donors can serve only about half of the offered load.
        let config = SimConfig {
            service_time_s: 0.01,
            b_values: vec![0.5],
            borrowing: false,
            ..small()
        };
        let report = run(&config).unwrap();
        let strict = row(&report, "weighted", Some(0.5));
        assert!(strict.fallback > 0.0 && strict.capped > 0.0, "{strict:?}");
        assert_eq!(strict.over_bound, 0.0, "{strict:?}");
        assert!(row(&report, "random", None).over_bound > 0.0, "{report:?}");
        // Borrowing takes capacity other clients left unused.
        let borrowing = run(&SimConfig {
            borrowing: true,
            ..config
        })
        .unwrap();
        let lender = row(&borrowing, "weighted", Some(0.5));
        assert!(lender.fallback < strict.fallback, "{lender:?} {strict:?}");
    }

    #[test]
    fn report_renders_as_table_and_json() {
        let report = run(&small()).unwrap();
        let table = report.to_table();
        assert!(table.starts_with("policy"));
        assert_eq!(table.lines().count(), 1 + report.rows.len());
        let json: serde_json::Value = serde_json::from_str(&report.to_json().unwrap()).unwrap();
        assert_eq!(json["rows"].as_array().unwrap().len(), report.rows.len());
        assert_eq!(json["config"]["donors"], 4);
    }

    #[test]
    fn invalid_configs_are_named() {
        let mut config = small();
        config.b_values = vec![0.5, 2.0];
        assert_eq!(
            run(&config).unwrap_err().to_string(),
            "weighted rule with b = 2: load-balancing rate b = 2 is not within 0..=1"
        );
        let mut config = small();
        config.clients = 0;
        assert_eq!(
            run(&config).unwrap_err(),
            SimError::TooSmall {
                field: "clients",
                min: 1,
                value: 0
            }
        );
        let mut config = small();
        config.service_time_s = f64::NAN;
        assert!(matches!(
            run(&config).unwrap_err(),
            SimError::NotPositive {
                field: "service_time_s",
                ..
            }
        ));
    }
}
