//! The simulated cluster: donors with their pages, clients placing pages
//! each epoch, and the tally of what one run measured.

use std::collections::VecDeque;

use pager_client::policy::{self, DonorView, PolicyParams, Selector, FREE_PAGE_AGE_MS};

use super::{ClusterShape, EpochPoint, Placement, SimConfig, SimError, SimRow};

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
    /// In the cluster (shape join: the last donor only from `idle_epoch`).
    present: bool,
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
        if !self.present {
            0
        } else if self.busy {
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

pub(super) struct Cluster<'a> {
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
    pub(super) fn new(config: &'a SimConfig) -> Self {
        let mut rng = Rng(config.seed);
        let last = config.donors - 1;
        let donors: Vec<Donor> = (0..config.donors)
            .map(|i| {
                let (capacity, busy) = match config.shape {
                    ClusterShape::Mixed => (
                        config.pages_per_donor * (2 + ((i + 2) % 3) as u64) / 2,
                        i == 0 || i % 2 == 1,
                    ),
                    ClusterShape::Uniform => (config.pages_per_donor, i == 0),
                    ClusterShape::Join if i == last => (2 * config.pages_per_donor, false),
                    ClusterShape::Join => (config.pages_per_donor, false),
                };
                Donor {
                    present: !(config.shape == ClusterShape::Join && i == last),
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
        // Shape join has no owner leaving: the newcomer comes empty.
        let owner_pages = if config.shape == ClusterShape::Join {
            0
        } else {
            (donors[0].capacity - donors[0].budget) / 2
        };
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
            eligible: d.present,
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

    pub(super) fn run(mut self, placement: Placement) -> Result<SimRow, SimError> {
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
                match config.shape {
                    ClusterShape::Join => {
                        if let Some(d) = self.donors.last_mut() {
                            d.present = true;
                        }
                    }
                    _ => self.owner_leaves(),
                }
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
        // A donor not yet in the cluster is not part of its balance.
        let present = donors.iter().filter(|d| d.present).count().max(1);
        let mean = utilisation.iter().sum::<f64>() / present as f64;
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
            held: donors.iter().map(Donor::held).collect(),
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
