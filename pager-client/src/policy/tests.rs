//! The selection rule against hand-computed cases and its invariants
//! (proptest).

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
        .prop_map(
            |(give_pages, age_x_ms, busy, u_star, u_unused, eligible)| DonorView {
                give_pages,
                age_x_ms,
                busy,
                u_star,
                u_unused,
                eligible,
            },
        )
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

#[test]
fn pick_distinct_or_fill_fills_with_eligible_donors_at_zero_only_when_it_must() {
    let mut sel = Selector::new(5);
    // Enough donors with a frequency: the donors at 0 are never chosen.
    let f = [0.5, 0.3, 0.2, 0.0, 0.0];
    for _ in 0..100 {
        let v = sel.pick_distinct_or_fill(&f, 3, |_| true).unwrap();
        assert!(v.iter().all(|&i| i < 3), "{v:?}");
    }
    // Too few: eligible donors at 0 fill in, distinct, never an ineligible one.
    let f = [0.5, 0.5, 0.0, 0.0, 0.0];
    for _ in 0..100 {
        let mut v = sel.pick_distinct_or_fill(&f, 3, |i| i != 4).unwrap();
        v.sort_unstable();
        v.dedup();
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(!v.contains(&4), "{v:?}");
    }
    // Too few eligible donors in all: none.
    assert_eq!(sel.pick_distinct_or_fill(&f, 3, |i| i < 2), None);
    assert_eq!(sel.pick_distinct(&f, 3, |_| true), None);
}
