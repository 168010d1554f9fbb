//! Memory follows idleness: which placed members to move, and where, so
//! each donor's share of a device's members tends to its selection
//! frequency f_i (docs/DESIGN.md §2.3a, the rebalancer).
//!
//! The weighted age/load rule ([`super::frequencies`]) only steers where
//! *new* extents go; without moves a newly idle donor gets only new
//! extents and a donor whose owner returns keeps all it holds until it
//! must drain at once. [`plan`] is the pure half of the device's
//! rebalancer: given each donor's placed-member count and f_i, and each
//! member's recency (the epoch of its unit's last access), it picks the
//! next moves:
//!
//! - a member moves from donor s to donor t only while s's excess over its
//!   target `f̂_i · total` (f normalised over the donors considered)
//!   exceeds t's by more than the hysteresis band (at least two members):
//!   each move then lowers Σ excess², so moves end, and the reverse move
//!   would need the gap reversed, so a donor near its share does not
//!   ping-pong; the set settles with every two donors' excesses within
//!   the band, and frequencies that wobble within it move nothing;
//! - coldest first (the member whose unit was accessed longest ago); a
//!   member accessed within the last `hot_epochs` moves only off a donor
//!   above its utilisation bound (its f_i capped), the one case where
//!   moving hot data is the point;
//! - never onto a donor that holds another member of the same unit (each
//!   mode's distinct-donor rule), nor onto one without room;
//! - at most `budget` moves (the rate limit, in members).

/// One donor as the rebalancer sees it; indices match the frequencies'.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DonorShare {
    /// Members of this device placed there (home units, copies that read).
    pub held: u64,
    /// Its selection frequency f_i (normalised here over the donors that
    /// may give or take).
    pub f: f64,
    /// Members may leave it (healthy, not draining or leaving: those are
    /// the drain's).
    pub may_give: bool,
    /// Members may come to it (eligible for placement).
    pub may_take: bool,
    /// Free slots of our export there.
    pub room: u64,
    /// Its utilisation bound binds (f_i capped): hot members may leave too.
    pub over_bound: bool,
}

/// A member that could move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub unit: u64,
    pub member: usize,
    /// The donor (index) it is on.
    pub donor: usize,
    /// Epoch of its unit's last access (0: none since the device opened).
    pub last_access: u32,
    /// Donors (indices) holding the unit's other members.
    pub others: Vec<usize>,
}

/// One move: member `member` of unit `unit` from donor `from` to donor `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub unit: u64,
    pub member: usize,
    pub from: usize,
    pub to: usize,
}

/// The rebalancer's knobs for one plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RebalanceParams {
    /// Hysteresis band as a share of all placed members.
    pub band: f64,
    /// The band in members at least (2 or more: see the module docs).
    pub min_band: u64,
    /// A member whose unit was accessed in the last this many epochs is
    /// hot.
    pub hot_epochs: u32,
    /// The epoch now.
    pub now: u32,
    /// Moves at most (the rate budget).
    pub budget: usize,
}

impl Default for RebalanceParams {
    fn default() -> Self {
        RebalanceParams {
            band: DEFAULT_BAND,
            min_band: MIN_BAND,
            hot_epochs: DEFAULT_HOT_EPOCHS,
            now: 0,
            budget: 0,
        }
    }
}

/// The default hysteresis band: 5% of the device's placed members.
pub const DEFAULT_BAND: f64 = 0.05;
/// The smallest band, in members, that rules out ping-pong.
pub const MIN_BAND: u64 = 2;
/// Accessed in the last two epochs: hot.
pub const DEFAULT_HOT_EPOCHS: u32 = 2;

/// Bytes a second the rebalancer may move this pass: `rate` while the
/// device is idle, at most `busy_rate` while it serves requests; `rate`
/// 0 is off either way.
pub fn rate_now(rate: u64, busy_rate: u64, busy: bool) -> u64 {
    if busy {
        busy_rate.min(rate)
    } else {
        rate
    }
}

/// Each donor's target in members (`f̂_i · total`), the band in members,
/// and the total; `None` when no donor has a frequency.
pub fn targets(donors: &[DonorShare], p: &RebalanceParams) -> Option<(Vec<f64>, f64, u64)> {
    let counted = |d: &DonorShare| d.may_give || d.may_take;
    let total: u64 = donors.iter().filter(|d| counted(d)).map(|d| d.held).sum();
    let f_sum: f64 = donors
        .iter()
        .filter(|d| counted(d))
        .map(|d| d.f.max(0.0))
        .sum();
    if f_sum <= 0.0 || total == 0 {
        return None;
    }
    let target = donors
        .iter()
        .map(|d| {
            if counted(d) {
                d.f.max(0.0) / f_sum * total as f64
            } else {
                0.0
            }
        })
        .collect();
    let band = (p.band * total as f64).max(p.min_band as f64);
    Some((target, band, total))
}

/// The next moves, in the order to make them (see the module docs).
pub fn plan(donors: &[DonorShare], candidates: &[Candidate], p: &RebalanceParams) -> Vec<Move> {
    let Some((target, band, _)) = targets(donors, p) else {
        return Vec::new();
    };
    let mut held: Vec<f64> = donors.iter().map(|d| d.held as f64).collect();
    let mut room: Vec<u64> = donors.iter().map(|d| d.room).collect();
    // Each donor's candidates, coldest first.
    let mut by_donor: Vec<Vec<&Candidate>> = vec![Vec::new(); donors.len()];
    for c in candidates.iter().filter(|c| c.donor < donors.len()) {
        by_donor[c.donor].push(c);
    }
    for v in &mut by_donor {
        v.sort_by_key(|c| (c.last_access, c.unit, c.member));
    }
    let mut next = vec![0usize; donors.len()];
    let mut moved_units: Vec<u64> = Vec::new();
    let mut out = Vec::new();
    let hot = |c: &Candidate| p.now.saturating_sub(c.last_access) < p.hot_epochs;
    while out.len() < p.budget {
        let excess = |held: &[f64], i: usize| held[i] - target[i];
        // The donor furthest above its target that still has a candidate.
        let source = (0..donors.len())
            .filter(|&i| donors[i].may_give && next[i] < by_donor[i].len())
            .max_by(|&a, &b| excess(&held, a).total_cmp(&excess(&held, b)));
        let Some(s) = source else { break };
        let mut chosen = None;
        while next[s] < by_donor[s].len() {
            let c = by_donor[s][next[s]];
            next[s] += 1;
            if hot(c) && !donors[s].over_bound {
                // Colder ones come first: the rest are hot too.
                next[s] = by_donor[s].len();
                break;
            }
            if moved_units.contains(&c.unit) {
                // One member of a unit per plan: the others' places are
                // as planned, not as they will be.
                continue;
            }
            let to = (0..donors.len())
                .filter(|&t| t != s && donors[t].may_take && room[t] > 0)
                .filter(|&t| !c.others.contains(&t))
                .filter(|&t| excess(&held, s) - excess(&held, t) > band)
                .min_by(|&a, &b| excess(&held, a).total_cmp(&excess(&held, b)));
            if let Some(t) = to {
                chosen = Some((c, t));
                break;
            }
        }
        let Some((c, t)) = chosen else { continue };
        held[s] -= 1.0;
        held[t] += 1.0;
        room[t] -= 1;
        moved_units.push(c.unit);
        out.push(Move {
            unit: c.unit,
            member: c.member,
            from: s,
            to: t,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn donor(held: u64, f: f64) -> DonorShare {
        DonorShare {
            held,
            f,
            may_give: true,
            may_take: true,
            room: 1000,
            over_bound: false,
        }
    }

    /// Mode none: one member per unit, units numbered across donors.
    fn singles(donors: &[DonorShare], last_access: impl Fn(u64) -> u32) -> Vec<Candidate> {
        let mut out = Vec::new();
        let mut u = 0;
        for (i, d) in donors.iter().enumerate() {
            for _ in 0..d.held {
                out.push(Candidate {
                    unit: u,
                    member: 0,
                    donor: i,
                    last_access: last_access(u),
                    others: Vec::new(),
                });
                u += 1;
            }
        }
        out
    }

    fn params(budget: usize, now: u32) -> RebalanceParams {
        RebalanceParams {
            budget,
            now,
            ..Default::default()
        }
    }

    /// Applies `moves` to the donors and the candidates.
    fn apply(donors: &mut [DonorShare], cands: &mut [Candidate], moves: &[Move]) {
        for m in moves {
            donors[m.from].held -= 1;
            donors[m.to].held += 1;
            donors[m.to].room -= 1;
            donors[m.from].room += 1;
            let c = cands
                .iter_mut()
                .find(|c| c.unit == m.unit && c.member == m.member)
                .expect("a candidate");
            assert_eq!(c.donor, m.from);
            c.donor = m.to;
            // The unit's other members see it on its new donor.
            let unit = c.unit;
            for o in cands.iter_mut().filter(|o| o.unit == unit) {
                if let Some(x) = o.others.iter_mut().find(|x| **x == m.from) {
                    if o.member != m.member {
                        *x = m.to;
                    }
                }
            }
        }
    }

    #[test]
    fn a_balanced_set_moves_nothing_for_ten_epochs() {
        // Three donors near their shares, whose frequencies wobble by a
        // few per cent from epoch to epoch as ages and free pages change.
        let mut donors = vec![donor(100, 0.33), donor(101, 0.34), donor(100, 0.33)];
        let mut cands = singles(&donors, |u| (u % 7) as u32);
        let wobble = [
            0.0, 0.015, -0.015, 0.01, -0.012, 0.015, -0.01, 0.005, 0.014, -0.015,
        ];
        for (epoch, w) in wobble.iter().enumerate() {
            donors[0].f = 0.33 + w;
            donors[1].f = 0.34 - w;
            let moves = plan(&donors, &cands, &params(50, 100 + epoch as u32));
            assert!(moves.is_empty(), "epoch {epoch}: {moves:?}");
            apply(&mut donors, &mut cands, &moves);
        }
    }

    #[test]
    fn a_newcomer_gets_its_share_and_then_nothing_moves() {
        let mut donors = vec![donor(120, 0.25), donor(120, 0.25), donor(120, 0.25)];
        donors.push(donor(0, 0.25));
        let mut cands = singles(&donors, |u| (u % 50) as u32);
        let mut epochs = 0;
        loop {
            let moves = plan(&donors, &cands, &params(8, 1000));
            if moves.is_empty() {
                break;
            }
            for m in &moves {
                assert_eq!(m.to, 3, "only toward the newcomer: {m:?}");
            }
            apply(&mut donors, &mut cands, &moves);
            epochs += 1;
            assert!(epochs < 100, "no convergence: {donors:?}");
        }
        // Within the band (5% of 360 = 18 members) of 90 each.
        for d in &donors {
            assert!(d.held.abs_diff(90) <= 18, "{donors:?}");
        }
        // The budget is what bounds the pace: about (90 - 9) / 8 epochs.
        assert!((8..=12).contains(&epochs), "{epochs} epochs");
        for now in 1000..1010 {
            assert!(plan(&donors, &cands, &params(8, now)).is_empty());
        }
    }

    #[test]
    fn coldest_first_and_hot_ones_stay() {
        let donors = vec![donor(10, 0.0), donor(0, 1.0)];
        // Units 0..10 on donor 0, accessed at epochs 11 - u: unit 9 is the
        // coldest; units 0 and 1 were accessed in the last two epochs.
        let cands = singles(&donors, |u| 11 - u as u32);
        let moves = plan(&donors, &cands, &params(100, 11));
        let units: Vec<u64> = moves.iter().map(|m| m.unit).collect();
        assert_eq!(units, [9, 8, 7, 6, 5, 4, 3, 2]);
        // Over its utilisation bound, the hot ones leave too.
        let mut bound = donors.clone();
        bound[0].over_bound = true;
        let moves = plan(&bound, &cands, &params(100, 11));
        // All but one: 1 against 9 is within the band of 2.
        assert_eq!(moves.len(), 9);
    }

    #[test]
    fn the_budget_caps_the_moves() {
        let donors = vec![donor(40, 0.5), donor(0, 0.5)];
        let cands = singles(&donors, |_| 0);
        assert_eq!(plan(&donors, &cands, &params(3, 100)).len(), 3);
        assert!(plan(&donors, &cands, &params(0, 100)).is_empty());
    }

    #[test]
    fn never_two_members_of_a_unit_on_one_donor() {
        // Parity width 3 on 4 donors: 30 groups on donors 0, 1, 2; donor 3
        // joined empty. Every move goes to donor 3, one member per group.
        let mut donors = vec![donor(30, 0.25), donor(30, 0.25), donor(30, 0.25)];
        donors.push(donor(0, 0.25));
        let mut cands: Vec<Candidate> = (0..30u64)
            .flat_map(|u| {
                (0..3).map(move |j| Candidate {
                    unit: u,
                    member: j,
                    donor: j,
                    last_access: 0,
                    others: (0..3).filter(|&k| k != j).collect(),
                })
            })
            .collect();
        for _ in 0..20 {
            let moves = plan(&donors, &cands, &params(4, 100));
            apply(&mut donors, &mut cands, &moves);
        }
        for u in 0..30u64 {
            let mut on: Vec<usize> = cands
                .iter()
                .filter(|c| c.unit == u)
                .map(|c| c.donor)
                .collect();
            on.sort_unstable();
            on.dedup();
            assert_eq!(on.len(), 3, "group {u} on {on:?}");
        }
        // Its share, within the band (5% of 90: 4.5 members).
        assert!(donors[3].held >= 22 - 4, "{donors:?}");
    }

    #[test]
    fn a_donor_that_sheds_gives_everything_and_no_one_takes_past_their_band() {
        // Donor 0's owner came back: it lowered G_i to nothing, f = 0.
        let mut donors = vec![donor(30, 0.0), donor(30, 0.5), donor(30, 0.5)];
        let mut cands = singles(&donors, |_| 0);
        for _ in 0..10 {
            let moves = plan(&donors, &cands, &params(10, 100));
            apply(&mut donors, &mut cands, &moves);
        }
        // It keeps no more than the band (5% of 90 is 4.5) above the
        // others' excess.
        assert!(donors[0].held <= 5, "{donors:?}");
        // Nothing goes to a donor without room or one that may not take.
        let mut full = vec![donor(30, 0.0), donor(30, 0.5), donor(30, 0.5)];
        full[1].room = 0;
        full[2].may_take = false;
        assert!(plan(&full, &singles(&full, |_| 0), &params(10, 100)).is_empty());
    }

    #[test]
    fn the_busy_rate_applies_while_the_device_serves_requests() {
        assert_eq!(rate_now(4 << 20, 1 << 20, false), 4 << 20);
        assert_eq!(rate_now(4 << 20, 1 << 20, true), 1 << 20);
        // Never above the idle rate, and off stays off.
        assert_eq!(rate_now(512 << 10, 1 << 20, true), 512 << 10);
        assert_eq!(rate_now(0, 1 << 20, true), 0);
        assert_eq!(rate_now(0, 1 << 20, false), 0);
        // Busy rate 0: moves only while idle.
        assert_eq!(rate_now(4 << 20, 0, true), 0);
        assert_eq!(rate_now(4 << 20, 0, false), 4 << 20);
    }
}
