//! Donor selection by weighted age and load: the load-balanced global
//! replacement of Voelker's thesis §3.6 (docs/DESIGN.md "2.1 Choosing a
//! donor").
//!
//! Each epoch a client turns what donors report into selection frequencies
//! with [`frequencies`], then a [`Selector`] spreads its page placements over
//! the donors so that, over time, donor i receives a fraction f_i of them.
//!
//! Per selectable donor i (eligible and `G_i > 0`):
//!
//! - target weight `w_i = G_i / Σ G_j`;
//! - age weight `a_i = age_x(i) / Σ age_x(j)` (see [`DonorView::age_x_ms`]
//!   for donors with free pages and for the all-zero case);
//! - frequency `f_i = b·w_i + (1−b)·a_i`, b the load-balancing rate;
//! - upper bound `f_i ≤ bound_i` (see [`Frequencies::bound`] for the derivation
//!   and units). When bounds bind, the donors over their bound are capped
//!   there, w and a are renormalised over the donors not capped, the frequency
//!   still unassigned is shared among those by the same rule, and this repeats
//!   until no new bound binds (Voelker's thesis §3.6.1, last paragraph).

//!
//! [`Selector`] (in `selector.rs`) is the runtime half: it turns the
//! frequencies into picks. [`rebalance`] moves members already placed so
//! that each donor's share follows its f_i.

pub mod rebalance;
mod selector;
#[cfg(test)]
mod tests;

use thiserror::Error;

pub use selector::Selector;

/// Default load-balancing rate b.
///
/// Chosen with `pagerctl simulate` (module `sim` of crate `pagerctl`: 8
/// donors, 8 clients, 60 epochs, one donor turning idle at epoch 20), in
/// four settings: donors of mixed or equal size, at 12.5% or 25% mean donor
/// utilisation. Measured age deviation (mean percentile rank of the
/// replaced page in global LRU order) / slowdown (M/M/1 response time in
/// units of S):
///
/// | b    | mixed, 12.5%  | mixed, 25%    | equal, 12.5%  | equal, 25%    |
/// |------|---------------|---------------|---------------|---------------|
/// | 0    | 17.4% / 1.63  | 16.4% / 6.06  | 2.5% / 1.57   | 2.3% / 3.52   |
/// | 0.5  | 11.2% / 1.25  | 11.0% / 5.70  | 2.0% / 1.18   | 1.8% / 2.36   |
/// | 0.75 | 6.9% / 1.23   | 7.0% / 1.72   | 1.5% / 1.15   | 1.4% / 1.37   |
/// | 0.9  | 4.1% / 1.24   | 4.2% / 1.71   | 1.3% / 1.15   | 1.3% / 1.35   |
/// | 1    | 2.6% / 1.25   | 2.8% / 1.75   | 1.5% / 1.15   | 1.5% / 1.35   |
///
/// 0.9 is the smallest b whose slowdown stays within 5% of b = 1's and whose
/// age deviation stays below 5% (Voelker's thesis §3.4.3: 30% costs ~9% more
/// disk faults) in all four. Lower b sends everyone to a newly idle donor (peak
/// skew 7.6 at b = 0), and the age estimate `age_x/Σ age_x` settles at ages ∝
/// √G on donors of unequal size; on such clusters b = 1 is better.
/// `docs/choosing-b.md` has the full tables and reasoning.
pub const DEFAULT_B: f64 = 0.9;

/// The `age_x_ms` a donor with at least x free pages should be given.
///
/// A free page is cheaper to replace than any stored one, so, as in GMS, it
/// counts as the oldest page in the cluster. The status protocol reports
/// `age_x_ms = 0` for a donor without pages; callers map "at least x pages
/// free" (`free_bytes / page_size >= age_x`) to this value instead.
pub const FREE_PAGE_AGE_MS: u64 = u64::MAX;

/// What the policy needs to know about one donor, from its last status.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DonorView {
    /// G_i: pages the donor can give without harming its own jobs.
    pub give_pages: u64,
    /// Age in milliseconds of the donor's x-th oldest page.
    ///
    /// Donors holding at least x free pages should report
    /// [`FREE_PAGE_AGE_MS`]: such donors then share the whole age weight in
    /// proportion to their `G_i`, since free pages are all equally "old".
    /// When every selectable donor reports 0 (nothing stored anywhere yet,
    /// so no age information exists), the age weights fall back to the
    /// target weights.
    pub age_x_ms: u64,
    /// The donor's owner is using the machine: remote requests may use at
    /// most `u_star` of it. An idle donor may be used fully.
    pub busy: bool,
    /// U*_i: utilisation by remote requests the owner allows (0..=1). Only
    /// read for busy donors.
    pub u_star: f64,
    /// U_e,i = max(0, allowed − recent utilisation) (0..=1): capacity the
    /// donor's other clients left unused, which borrowing may take.
    pub u_unused: f64,
    /// False while the donor is failed, draining or full.
    pub eligible: bool,
}

/// The client-side inputs of the rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyParams {
    /// b, the load-balancing rate, 0..=1: 0 is GMS's approximate global
    /// LRU, 1 balances load only.
    pub b: f64,
    /// S, mean time a donor needs to serve one request, seconds.
    pub service_time_s: f64,
    /// T_j, this client's recent mean time between requests, seconds. A
    /// client without recent requests passes its measuring window.
    pub interarrival_s: f64,
    /// N_g, the number of clients sharing the donors, this one included.
    pub n_clients: u32,
    /// Add unused capacity U_e,i to the bounds (Voelker's thesis §3.6.2).
    pub borrowing: bool,
}

/// Result of [`frequencies`]; every vector is indexed like the donor slice.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct Frequencies {
    /// f_i, the fraction of this client's placements that should go to
    /// donor i. 0 for donors that are not selectable.
    pub f: Vec<f64>,
    /// w_i over all selectable donors, before any renormalisation.
    pub target_weight: Vec<f64>,
    /// a_i over all selectable donors, before any renormalisation.
    pub age_weight: Vec<f64>,
    /// Upper bound on f_i; 0 for donors that are not selectable.
    ///
    /// Seed 000 eq. 3.2 bounds this client's request *rate* to donor i by
    /// its equal share of the utilisation the donor allows: `f_i / T_j ≤
    /// U*_i / (N_g·S)` (requests per second on both sides; U*_i = 1 for an
    /// idle donor, eq. 3.3). Multiplying by T_j gives the dimensionless
    /// frequency bound `T_j·U*_i / (N_g·S)`.
    ///
    /// Borrowing (§3.6.2) raises the rate bound by the donor's unused
    /// capacity shared with the other N_g − 1 clients. The paper writes
    /// that term as `U_e,i / (N_g − 1)`, a utilisation; as a rate it is
    /// `U_e,i / ((N_g − 1)·S)` (docs/DESIGN.md "2.1 Choosing a donor"), and
    /// as a frequency, after the same multiplication by T_j,
    /// `T_j·U_e,i / ((N_g − 1)·S)`. So
    ///
    /// `bound_i = T_j/S · (U*_i/N_g + U_e,i/(N_g − 1))`,
    ///
    /// the second term only with borrowing on and N_g > 1 (a lone client
    /// already owns all capacity). Bounds above 1 are kept as computed.
    pub bound: Vec<f64>,
    /// f_i was set to its bound.
    pub capped: Vec<bool>,
    /// Every selectable donor is capped (or none is selectable): f sums to
    /// Σ bound < 1, and the client must throttle or page to its local
    /// fallback for the rest, and say so in its status.
    pub all_capped: bool,
}

impl Frequencies {
    /// Σ f_i: 1 unless `all_capped`.
    pub fn total(&self) -> f64 {
        self.f.iter().sum()
    }
}

/// Invalid input to [`frequencies`].
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PolicyError {
    #[error("load-balancing rate b = {0} is not within 0..=1")]
    LoadBalancingRate(f64),
    #[error("service time S = {0} s is not a finite number > 0")]
    ServiceTime(f64),
    #[error("interarrival time T = {0} s is not a finite number > 0")]
    Interarrival(f64),
    #[error("number of clients N_g is 0; it must count the calling client")]
    NoClients,
    #[error("donor {index}: {field} = {value} is not within 0..=1")]
    DonorField {
        index: usize,
        field: &'static str,
        value: f64,
    },
}

impl PolicyParams {
    /// Checks every field; [`frequencies`] calls this first.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if !(0.0..=1.0).contains(&self.b) {
            return Err(PolicyError::LoadBalancingRate(self.b));
        }
        if !(self.service_time_s.is_finite() && self.service_time_s > 0.0) {
            return Err(PolicyError::ServiceTime(self.service_time_s));
        }
        if !(self.interarrival_s.is_finite() && self.interarrival_s > 0.0) {
            return Err(PolicyError::Interarrival(self.interarrival_s));
        }
        if self.n_clients == 0 {
            return Err(PolicyError::NoClients);
        }
        Ok(())
    }

    fn borrows(&self) -> bool {
        self.borrowing && self.n_clients > 1
    }
}

fn selectable(d: &DonorView) -> bool {
    d.eligible && d.give_pages > 0
}

fn check_unit(index: usize, field: &'static str, value: f64) -> Result<(), PolicyError> {
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(PolicyError::DonorField {
            index,
            field,
            value,
        })
    }
}

/// Only the fields the rule will read are checked, so a failed donor's
/// stale or default view cannot make the whole computation fail.
fn validate_donors(donors: &[DonorView], p: &PolicyParams) -> Result<(), PolicyError> {
    for (i, d) in donors.iter().enumerate().filter(|(_, d)| selectable(d)) {
        if d.busy {
            check_unit(i, "u_star", d.u_star)?;
        }
        if p.borrows() {
            check_unit(i, "u_unused", d.u_unused)?;
        }
    }
    Ok(())
}

fn bound_for(d: &DonorView, p: &PolicyParams) -> f64 {
    let allowed = if d.busy { d.u_star } else { 1.0 };
    let n_g = f64::from(p.n_clients);
    let mut utilisation_share = allowed / n_g;
    if p.borrows() {
        utilisation_share += d.u_unused / (n_g - 1.0);
    }
    p.interarrival_s / p.service_time_s * utilisation_share
}

/// Target and age weights normalised over `set` (zero elsewhere).
fn weights(donors: &[DonorView], set: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let mut w = vec![0.0; donors.len()];
    let mut a = vec![0.0; donors.len()];
    let give = |i: usize| donors[i].give_pages as f64;
    let total_give: f64 = set.iter().map(|&i| give(i)).sum();
    for &i in set {
        w[i] = give(i) / total_give;
    }
    let free: Vec<usize> = set
        .iter()
        .copied()
        .filter(|&i| donors[i].age_x_ms == FREE_PAGE_AGE_MS)
        .collect();
    if !free.is_empty() {
        let free_give: f64 = free.iter().map(|&i| give(i)).sum();
        for &i in &free {
            a[i] = give(i) / free_give;
        }
        return (w, a);
    }
    let total_age: f64 = set.iter().map(|&i| donors[i].age_x_ms as f64).sum();
    if total_age > 0.0 {
        for &i in set {
            a[i] = donors[i].age_x_ms as f64 / total_age;
        }
    } else {
        a.clone_from(&w);
    }
    (w, a)
}

/// Selection frequencies for one client (see the module documentation).
///
/// Donors that are not eligible or have `give_pages == 0` get f = 0 and
/// bound 0. The result sums to 1 unless `all_capped`.
pub fn frequencies(donors: &[DonorView], p: &PolicyParams) -> Result<Frequencies, PolicyError> {
    p.validate()?;
    validate_donors(donors, p)?;
    let n = donors.len();
    let candidates: Vec<usize> = (0..n).filter(|&i| selectable(&donors[i])).collect();
    let mut bound = vec![0.0; n];
    for &i in &candidates {
        bound[i] = bound_for(&donors[i], p);
    }
    let (target_weight, age_weight) = weights(donors, &candidates);

    let mut f = vec![0.0; n];
    let mut capped = vec![false; n];
    let mut active = candidates;
    let mut remaining = 1.0_f64;
    while !active.is_empty() {
        let (w, a) = weights(donors, &active);
        let share = |i: usize| remaining * (p.b * w[i] + (1.0 - p.b) * a[i]);
        let over: Vec<usize> = active
            .iter()
            .copied()
            .filter(|&i| share(i) > bound[i])
            .collect();
        if over.is_empty() {
            for &i in &active {
                f[i] = share(i);
            }
            break;
        }
        for &i in &over {
            f[i] = bound[i];
            capped[i] = true;
            remaining -= bound[i];
        }
        // Each capped donor gave up more than it kept, so `remaining` stays
        // above zero in exact arithmetic; clamp the rounding.
        remaining = remaining.max(0.0);
        active.retain(|&i| !capped[i]);
    }
    Ok(Frequencies {
        f,
        target_weight,
        age_weight,
        bound,
        capped,
        all_capped: active.is_empty(),
    })
}
