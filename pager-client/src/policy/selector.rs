//! Smooth weighted round-robin over the donors' frequencies.

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

    /// [`Self::pick_distinct`], except that when fewer than k eligible
    /// donors have f > 0, eligible ones at f = 0 fill in. For a caller with
    /// nowhere else to go: frequencies are an epoch old (a donor that
    /// stopped draining since has f = 0 until the next epoch, which a
    /// donor that does not answer can hold up for a connect timeout), and
    /// placing against them beats failing the application's write.
    pub fn pick_distinct_or_fill(
        &mut self,
        f: &[f64],
        k: usize,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<Vec<usize>> {
        if let Some(v) = self.pick_distinct(f, k, &eligible) {
            return Some(v);
        }
        // Far below any real frequency: the filling donors come last
        // wherever credits allow.
        let filled: Vec<f64> = f
            .iter()
            .map(|&x| if participates(x) { x } else { FILL })
            .collect();
        self.pick_distinct(&filled, k, eligible)
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

/// The frequency [`Selector::pick_distinct_or_fill`] lends donors at 0.
const FILL: f64 = 1e-9;

fn participates(f: f64) -> bool {
    f.is_finite() && f > 0.0
}
