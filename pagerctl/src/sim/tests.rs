//! The simulator against what the model says it must show.

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

/// First epoch in which the last donor holds at least 90% of `share` of
/// the pages held.
fn epoch_holding_share(r: &SimRow, share: f64) -> Option<usize> {
    r.per_epoch.iter().position(|e| {
        let total: u64 = e.held.iter().sum();
        *e.held.last().unwrap() as f64 >= 0.9 * share * total as f64
    })
}

#[test]
fn a_joining_donor_fills_faster_by_age_than_by_balance() {
    let config = SimConfig {
        shape: ClusterShape::Join,
        donors: 3,
        clients: 1,
        epochs: 20,
        b_values: vec![0.0, 1.0],
        ..small()
    };
    let report = run(&config).unwrap();
    let (b0, b1) = (
        row(&report, "weighted", Some(0.0)),
        row(&report, "weighted", Some(1.0)),
    );
    let join = config.idle_epoch as usize;
    for r in [b0, b1] {
        // Absent until it joins, then taking pages.
        assert!(r.per_epoch[..join].iter().all(|e| e.held[2] == 0), "{r:?}");
        assert!(r.per_epoch[join].held[2] > 0, "{r:?}");
    }
    // Its share is its capacity, 2 of 4 units. Its free pages are the
    // cluster's oldest: b = 0 sends every page there (300 an epoch, its
    // share after 3 epochs), b = 1 half of them (after 6).
    let (at0, at1) = (
        epoch_holding_share(b0, 0.5).unwrap(),
        epoch_holding_share(b1, 0.5).unwrap(),
    );
    assert_eq!((at0 - join, at1 - join), (2, 5), "{b0:?} {b1:?}");
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
