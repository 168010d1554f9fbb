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
//!   oldest page or [`FREE_PAGE_AGE_MS`](pager_client::policy::FREE_PAGE_AGE_MS)
//!   with x free pages, utilisation of the last epoch); clients recompute
//!   their frequencies from it. A client whose donors are all capped sends
//!   only Σ bound of its requests remote and the rest to local disk
//!   (fallback).
//! - At `idle_epoch` donor 0's owner leaves: the donor turns idle, its G
//!   jumps to its whole capacity, half of the new pages are free and half
//!   are the owner's pages, last used long ago and now the oldest in the
//!   cluster (Voelker's thesis §3.4.1: new idle memory concentrates requests).
//!   [`ClusterShape::Join`] instead: equal idle donors, and at `idle_epoch`
//!   one more of twice their size joins, empty (§3.4.3, "Naive Load
//!   Balancing": a third idle node joins a third of the way through).
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
//!
//! The cluster itself is in `cluster`; this file holds the inputs, the
//! report and the placements compared.

mod cluster;
#[cfg(test)]
mod tests;

use std::fmt::Write as _;

use pager_client::policy::{PolicyError, PolicyParams};
use serde::Serialize;
use thiserror::Error;

use cluster::Cluster;
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
    /// Epoch at whose start donor 0 turns idle (shape join: the last donor
    /// joins); none if ≥ `epochs`.
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
    /// Idle donors of equal size, and the last of twice their size, which
    /// joins the cluster empty at `idle_epoch`.
    Join,
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
    /// Pages each donor holds at the epoch's end.
    pub held: Vec<u64>,
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
pub(crate) enum Placement {
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
