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

use thiserror::Error;

/// Default load-balancing rate b.
///
/// Chosen with `pagerctl simulate` ([`crate::sim`]: 8 donors, 8 clients,
/// 60 epochs, one donor turning idle at epoch 20), in four settings: donors
/// of mixed or equal size, at 12.5% or 25% mean donor utilisation. Measured
/// age deviation (mean percentile rank of the replaced page in global LRU
/// order) / slowdown (M/M/1 response time in units of S):
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

/// Deterministic weighted choice that follows the frequencies over time.
///
/// It is smooth weighted round-robin: every pick credits each participating
/// donor (eligible, f > 0) with its normalised frequency and takes the one
/// with the most credit, which then pays 1. With fixed f each donor's share
/// of picks stays within a few picks of f_i, and picks to the same donor are
/// spread out rather than bunched. When f changes, the credits carry over,
/// so what a donor was owed is honoured gradually. A donor that drops out
/// keeps its credit (clamped to one pick either way) for when it returns.
/// Frequencies that sum below 1 (all capped) are normalised here: throttling
/// is the caller's decision.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    credit: Vec<f64>,
    participating: Vec<bool>,
}

impl Selector {
    /// A selector for `n` donors; it grows if later called with more.
    pub fn new(n: usize) -> Self {
        Selector {
            credit: vec![0.0; n],
            participating: vec![false; n],
        }
    }

    /// The next donor, or None when no eligible donor has f > 0.
    pub fn pick(&mut self, f: &[f64], eligible: impl Fn(usize) -> bool) -> Option<usize> {
        self.pick_excluding(f, &eligible, &[])
    }

    /// k distinct donors for one extent's copies (2 for mirroring, N for a
    /// parity group), chosen one after another by the same credits; None,
    /// without changing any credit, when fewer than k donors qualify.
    pub fn pick_distinct(
        &mut self,
        f: &[f64],
        k: usize,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<Vec<usize>> {
        let qualifying = (0..f.len())
            .filter(|&i| participates(f[i]) && eligible(i))
            .count();
        if qualifying < k {
            return None;
        }
        let mut chosen = Vec::with_capacity(k);
        for _ in 0..k {
            let i = self.pick_excluding(f, &eligible, &chosen)?;
            chosen.push(i);
        }
        Some(chosen)
    }

    /// `excluded` donors (already chosen for this extent) sit this pick out:
    /// they are neither credited nor chosen, but still count as present.
    fn pick_excluding(
        &mut self,
        f: &[f64],
        eligible: &impl Fn(usize) -> bool,
        excluded: &[usize],
    ) -> Option<usize> {
        let n = f.len();
        if self.credit.len() < n {
            self.credit.resize(n, 0.0);
            self.participating.resize(n, false);
        }
        let mut total = 0.0;
        let mut present = 0usize;
        let mut changed = false;
        for (i, &fi) in f.iter().enumerate() {
            let p = participates(fi) && eligible(i);
            changed |= self.participating[i] != p;
            self.participating[i] = p;
            if p {
                present += 1;
                if !excluded.contains(&i) {
                    total += fi;
                }
            }
        }
        if total <= 0.0 {
            return None;
        }
        let scale = 1.0 / total;
        let mut best: Option<usize> = None;
        for (i, &fi) in f.iter().enumerate() {
            if !self.participating[i] {
                self.credit[i] = self.credit[i].clamp(-1.0, 1.0);
            } else if !excluded.contains(&i) {
                self.credit[i] += fi * scale;
                match best {
                    Some(b) if self.credit[b] >= self.credit[i] => {}
                    _ => best = Some(i),
                }
            }
        }
        let best = best?;
        self.credit[best] -= 1.0;
        // Each pick adds and takes away one unit, so present donors' credits
        // keep summing to zero; after a donor joins or leaves, re-centre
        // them so they cannot drift.
        if changed {
            let sum: f64 = (0..n)
                .filter(|&i| self.participating[i])
                .map(|i| self.credit[i])
                .sum();
            let mean = sum / present as f64;
            for i in 0..n {
                if self.participating[i] {
                    self.credit[i] -= mean;
                }
            }
        }
        Some(best)
    }
}

fn participates(f: f64) -> bool {
    f.is_finite() && f > 0.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EPS: f64 = 1e-9;

    fn idle(give: u64, age: u64) -> DonorView {
        DonorView {
            give_pages: give,
            age_x_ms: age,
            busy: false,
            u_star: 1.0,
            u_unused: 0.0,
            eligible: true,
        }
    }

    /// Bounds far above 1: nothing binds.
    fn loose(b: f64) -> PolicyParams {
        PolicyParams {
            b,
            service_time_s: 1e-4,
            interarrival_s: 1.0,
            n_clients: 1,
            borrowing: false,
        }
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < EPS, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn b_zero_gives_age_weights() {
        let donors = [idle(100, 1000), idle(300, 3000), idle(600, 6000)];
        let fr = frequencies(&donors, &loose(0.0)).unwrap();
        assert_close(&fr.f, &[0.1, 0.3, 0.6]);
        let donors = [idle(100, 6000), idle(300, 3000), idle(600, 1000)];
        let fr = frequencies(&donors, &loose(0.0)).unwrap();
        assert_close(&fr.f, &[0.6, 0.3, 0.1]);
        assert_close(&fr.age_weight, &[0.6, 0.3, 0.1]);
        assert!(!fr.all_capped);
    }

    #[test]
    fn b_one_gives_target_weights() {
        let donors = [idle(100, 6000), idle(300, 3000), idle(600, 1000)];
        let fr = frequencies(&donors, &loose(1.0)).unwrap();
        assert_close(&fr.f, &[0.1, 0.3, 0.6]);
        assert_close(&fr.target_weight, &[0.1, 0.3, 0.6]);
    }

    #[test]
    fn b_mixes_linearly() {
        let donors = [idle(100, 6000), idle(300, 3000), idle(600, 1000)];
        let fr = frequencies(&donors, &loose(0.25)).unwrap();
        assert_close(
            &fr.f,
            &[
                0.25 * 0.1 + 0.75 * 0.6,
                0.25 * 0.3 + 0.75 * 0.3,
                0.25 * 0.6 + 0.75 * 0.1,
            ],
        );
    }

    #[test]
    fn all_ages_zero_fall_back_to_target_weights() {
        let donors = [idle(100, 0), idle(300, 0)];
        let fr = frequencies(&donors, &loose(0.0)).unwrap();
        assert_close(&fr.f, &[0.25, 0.75]);
    }

    #[test]
    fn donors_with_free_pages_share_the_age_weight() {
        let donors = [
            idle(100, 50_000),
            idle(100, FREE_PAGE_AGE_MS),
            idle(300, FREE_PAGE_AGE_MS),
        ];
        let fr = frequencies(&donors, &loose(0.0)).unwrap();
        assert_close(&fr.f, &[0.0, 0.25, 0.75]);
    }

    #[test]
    fn binding_bound_caps_and_renormalises() {
        // Idle bound T/(N_g·S) = 0.01/(2·0.02) = 0.25; donor 0 wants 0.6.
        let p = PolicyParams {
            b: 0.0,
            service_time_s: 0.02,
            interarrival_s: 0.01,
            n_clients: 2,
            borrowing: false,
        };
        let donors = [idle(100, 6000), idle(100, 3000), idle(100, 1000)];
        let fr = frequencies(&donors, &p).unwrap();
        assert_close(&fr.bound, &[0.25, 0.25, 0.25]);
        // Ages 0.6 and 0.3 exceed 0.25: donors 0 and 1 are capped; donor 2
        // would then take the remaining 0.5 and is capped too.
        assert_close(&fr.f, &[0.25, 0.25, 0.25]);
        assert!(fr.all_capped);

        let donors = [
            idle(100, 6000),
            idle(100, 3000),
            idle(100, 1000),
            idle(100, 1000),
            idle(100, 1000),
        ];
        let fr = frequencies(&donors, &p).unwrap();
        // Round 1: 6/12 > 0.25 -> cap donor 0. Round 2: 0.75·3/6 = 0.375 >
        // 0.25 -> cap donor 1. Round 3: 0.5 split evenly over three.
        let third = 0.5 / 3.0;
        assert_close(&fr.f, &[0.25, 0.25, third, third, third]);
        assert_eq!(fr.capped, vec![true, true, false, false, false]);
        assert!(!fr.all_capped);
        assert!((fr.total() - 1.0).abs() < EPS);
    }

    #[test]
    fn busy_bound_uses_u_star() {
        let p = PolicyParams {
            b: 1.0,
            service_time_s: 0.001,
            interarrival_s: 0.002,
            n_clients: 4,
            borrowing: false,
        };
        let mut busy = idle(900, 10);
        busy.busy = true;
        busy.u_star = 0.2;
        let fr = frequencies(&[busy, idle(100, 10)], &p).unwrap();
        // Busy: 0.002·0.2/(4·0.001) = 0.1; idle: 0.002/(4·0.001) = 0.5.
        assert_close(&fr.bound, &[0.1, 0.5]);
        assert_close(&fr.f, &[0.1, 0.5]);
        assert!(fr.all_capped);
        assert!((fr.total() - 0.6).abs() < EPS);
    }

    #[test]
    fn borrowing_raises_a_bound() {
        let mut p = PolicyParams {
            b: 1.0,
            service_time_s: 0.001,
            interarrival_s: 0.002,
            n_clients: 3,
            borrowing: false,
        };
        let mut d = idle(100, 10);
        d.u_unused = 0.6;
        let without = frequencies(&[d, idle(100, 10)], &p).unwrap();
        p.borrowing = true;
        let with = frequencies(&[d, idle(100, 10)], &p).unwrap();
        // 2/3 without; plus 0.002·0.6/(2·0.001) = 0.6 with.
        assert!((without.bound[0] - 2.0 / 3.0).abs() < EPS);
        assert!((with.bound[0] - (2.0 / 3.0 + 0.6)).abs() < EPS);
        assert!((with.bound[1] - without.bound[1]).abs() < EPS);
        // A lone client has nobody to borrow from.
        p.n_clients = 1;
        let alone = frequencies(&[d, idle(100, 10)], &p).unwrap();
        assert!((alone.bound[0] - 2.0).abs() < EPS);
    }

    #[test]
    fn zero_give_and_ineligible_donors_get_nothing() {
        let mut failed = idle(500, 90_000);
        failed.eligible = false;
        let donors = [idle(0, 90_000), failed, idle(100, 10)];
        let fr = frequencies(&donors, &loose(0.5)).unwrap();
        assert_close(&fr.f, &[0.0, 0.0, 1.0]);
        assert_close(&fr.bound, &[0.0, 0.0, fr.bound[2]]);
        let mut sel = Selector::new(3);
        for _ in 0..100 {
            assert_eq!(sel.pick(&fr.f, |_| true), Some(2));
        }
    }

    #[test]
    fn selector_skips_donors_the_caller_rules_out() {
        let f = [0.5, 0.5];
        let mut sel = Selector::new(2);
        for _ in 0..20 {
            assert_eq!(sel.pick(&f, |i| i == 1), Some(1));
        }
        assert_eq!(sel.pick(&f, |_| false), None);
        assert_eq!(sel.pick_distinct(&f, 2, |i| i == 1), None);
        let two = sel.pick_distinct(&f, 2, |_| true).unwrap();
        assert_eq!(two.len(), 2);
        assert_ne!(two[0], two[1]);
    }

    #[test]
    fn selector_recovers_after_absence_and_follows_new_frequencies() {
        let mut sel = Selector::new(2);
        let f = [0.5, 0.5];
        for _ in 0..1000 {
            assert_eq!(sel.pick(&f, |i| i == 0), Some(0));
        }
        let back = (0..1000)
            .filter(|_| sel.pick(&f, |_| true) == Some(1))
            .count();
        assert!((back as i64 - 500).abs() <= 2, "{back}");
        let g = [0.9, 0.1];
        let second = (0..1000)
            .filter(|_| sel.pick(&g, |_| true) == Some(1))
            .count();
        assert!((second as i64 - 100).abs() <= 2, "{second}");
    }

    #[test]
    fn pick_distinct_spreads_copies_by_frequency() {
        let calls = 10_000;
        let inclusions = |f: &[f64], k: usize| {
            let mut sel = Selector::new(f.len());
            let mut counts = vec![0usize; f.len()];
            for _ in 0..calls {
                for i in sel.pick_distinct(f, k, |_| true).unwrap() {
                    counts[i] += 1;
                }
            }
            counts
        };
        for c in inclusions(&[0.2; 5], 2) {
            assert!((c as f64 / calls as f64 - 0.4).abs() < 0.01, "{c}");
        }
        let counts = inclusions(&[0.4, 0.3, 0.2, 0.1], 2);
        assert_eq!(counts.iter().sum::<usize>(), 2 * calls);
        assert!(counts.windows(2).all(|w| w[0] > w[1]), "{counts:?}");
        // One copy is a plain pick.
        let mut a = Selector::new(3);
        let mut b = Selector::new(3);
        let f = [0.5, 0.3, 0.2];
        for _ in 0..50 {
            assert_eq!(
                a.pick_distinct(&f, 1, |_| true).unwrap(),
                vec![b.pick(&f, |_| true).unwrap()]
            );
        }
    }

    #[test]
    fn no_selectable_donor_is_all_capped() {
        let fr = frequencies(&[idle(0, 5)], &loose(0.5)).unwrap();
        assert!(fr.all_capped);
        assert_eq!(fr.total(), 0.0);
        let fr = frequencies(&[], &loose(0.5)).unwrap();
        assert!(fr.all_capped);
    }

    #[test]
    fn parameter_validation() {
        let d = [idle(1, 1)];
        let bad = |p: PolicyParams| frequencies(&d, &p).unwrap_err();
        let ok = loose(DEFAULT_B);
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(
            bad(PolicyParams { b: 1.5, ..ok }),
            PolicyError::LoadBalancingRate(1.5)
        );
        assert!(matches!(
            bad(PolicyParams { b: f64::NAN, ..ok }),
            PolicyError::LoadBalancingRate(_)
        ));
        assert_eq!(
            bad(PolicyParams {
                service_time_s: 0.0,
                ..ok
            }),
            PolicyError::ServiceTime(0.0)
        );
        assert!(matches!(
            bad(PolicyParams {
                interarrival_s: f64::INFINITY,
                ..ok
            }),
            PolicyError::Interarrival(_)
        ));
        assert_eq!(
            bad(PolicyParams { n_clients: 0, ..ok }),
            PolicyError::NoClients
        );
        let mut busy = idle(1, 1);
        busy.busy = true;
        busy.u_star = -0.1;
        let err = frequencies(&[idle(1, 1), busy], &ok).unwrap_err();
        assert_eq!(
            err.to_string(),
            "donor 1: u_star = -0.1 is not within 0..=1"
        );
        let mut lender = idle(1, 1);
        lender.u_unused = f64::NAN;
        let borrowing = PolicyParams {
            n_clients: 2,
            borrowing: true,
            ..ok
        };
        assert!(matches!(
            frequencies(&[lender], &borrowing).unwrap_err(),
            PolicyError::DonorField {
                index: 0,
                field: "u_unused",
                ..
            }
        ));
        // A failed donor's garbage is not looked at.
        lender.eligible = false;
        assert!(frequencies(&[lender, idle(1, 1)], &borrowing).is_ok());
    }

    fn donor_strategy() -> impl Strategy<Value = DonorView> {
        (
            prop_oneof![Just(0u64), 1u64..10_000],
            prop_oneof![Just(0u64), Just(FREE_PAGE_AGE_MS), 1u64..1_000_000],
            any::<bool>(),
            0.0f64..=1.0,
            0.0f64..=1.0,
            prop::bool::weighted(0.85),
        )
            .prop_map(|(give_pages, age_x_ms, busy, u_star, u_unused, eligible)| {
                DonorView {
                    give_pages,
                    age_x_ms,
                    busy,
                    u_star,
                    u_unused,
                    eligible,
                }
            })
    }

    fn params_strategy() -> impl Strategy<Value = PolicyParams> {
        (
            0.0f64..=1.0,
            1e-5f64..1e-2,
            1e-5f64..1e-1,
            1u32..64,
            any::<bool>(),
        )
            .prop_map(
                |(b, service_time_s, interarrival_s, n_clients, borrowing)| PolicyParams {
                    b,
                    service_time_s,
                    interarrival_s,
                    n_clients,
                    borrowing,
                },
            )
    }

    proptest! {
        #[test]
        fn frequencies_respect_bounds_and_sum(
            donors in prop::collection::vec(donor_strategy(), 0..12),
            p in params_strategy(),
        ) {
            let fr = frequencies(&donors, &p).unwrap();
            let mut bound_sum = 0.0;
            for (i, d) in donors.iter().enumerate() {
                prop_assert!(fr.f[i] >= 0.0);
                prop_assert!(fr.f[i] <= fr.bound[i] + EPS, "donor {}: {:?}", i, fr);
                if !d.eligible || d.give_pages == 0 {
                    prop_assert_eq!(fr.f[i], 0.0);
                } else {
                    bound_sum += fr.bound[i];
                }
            }
            if fr.all_capped {
                prop_assert!(fr.total() <= 1.0 + EPS);
                prop_assert!((fr.total() - bound_sum).abs() < EPS * (1.0 + bound_sum));
            } else {
                prop_assert!((fr.total() - 1.0).abs() < EPS, "{:?}", fr);
            }
        }

        #[test]
        fn selector_follows_frequencies(
            weights in prop::collection::vec(prop_oneof![Just(0.0f64), 0.01f64..1.0], 1..10),
        ) {
            let total: f64 = weights.iter().sum();
            prop_assume!(total > 0.0);
            let f: Vec<f64> = weights.iter().map(|w| w / total).collect();
            let picks = 4000;
            let mut counts = vec![0usize; f.len()];
            let mut sel = Selector::new(f.len());
            for _ in 0..picks {
                counts[sel.pick(&f, |_| true).unwrap()] += 1;
            }
            for (i, &c) in counts.iter().enumerate() {
                if f[i] == 0.0 {
                    prop_assert_eq!(c, 0);
                }
                let share = c as f64 / picks as f64;
                prop_assert!((share - f[i]).abs() < 0.005, "donor {}: {} vs {}", i, share, f[i]);
            }
        }

        #[test]
        fn pick_distinct_gives_k_distinct_eligible_donors(
            f in prop::collection::vec(prop_oneof![Just(0.0f64), 0.0f64..1.0], 0..10),
            eligible in prop::collection::vec(any::<bool>(), 10),
            k in 0usize..6,
        ) {
            let ok = |i: usize| eligible[i];
            let qualifying = (0..f.len()).filter(|&i| f[i] > 0.0 && ok(i)).count();
            let mut sel = Selector::new(f.len());
            for _ in 0..20 {
                match sel.pick_distinct(&f, k, ok) {
                    None => prop_assert!(qualifying < k),
                    Some(chosen) => {
                        prop_assert_eq!(chosen.len(), k);
                        let mut sorted = chosen.clone();
                        sorted.sort_unstable();
                        sorted.dedup();
                        prop_assert_eq!(sorted.len(), k);
                        for &i in &chosen {
                            prop_assert!(ok(i) && f[i] > 0.0);
                        }
                    }
                }
            }
        }
    }
}
