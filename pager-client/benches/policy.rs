//! Cost of computing selection frequencies and of one donor pick.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pager_client::policy::{frequencies, DonorView, PolicyParams, Selector};

/// A mixed cluster: every third donor busy, ages spread so some bounds bind.
fn donors(n: usize) -> Vec<DonorView> {
    (0..n)
        .map(|i| DonorView {
            give_pages: 1000 + 250 * (i as u64 % 7),
            age_x_ms: 1 + 10_000 * ((i as u64 * 7919) % 13),
            busy: i % 3 == 0,
            u_star: 0.25,
            u_unused: 0.1,
            eligible: i % 11 != 5,
        })
        .collect()
}

fn params() -> PolicyParams {
    PolicyParams {
        b: 0.5,
        service_time_s: 100e-6,
        interarrival_s: 1e-3,
        n_clients: 8,
        borrowing: true,
    }
}

fn bench_frequencies(c: &mut Criterion) {
    let mut group = c.benchmark_group("frequencies");
    for n in [4, 16, 64] {
        let d = donors(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &d, |b, d| {
            b.iter(|| frequencies(black_box(d), black_box(&params())).expect("valid input"))
        });
    }
    group.finish();
}

fn bench_pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("selector_pick");
    group.throughput(Throughput::Elements(1));
    for n in [4, 16, 64] {
        let f = frequencies(&donors(n), &params()).expect("valid input").f;
        group.bench_with_input(BenchmarkId::from_parameter(n), &f, |b, f| {
            let mut sel = Selector::new(f.len());
            b.iter(|| sel.pick(black_box(f), |_| true))
        });
    }
    let f = frequencies(&donors(16), &params()).expect("valid input").f;
    group.bench_function("distinct_3_of_16", |b| {
        let mut sel = Selector::new(f.len());
        b.iter(|| sel.pick_distinct(black_box(&f), 3, |_| true))
    });
    group.finish();
}

criterion_group!(benches, bench_frequencies, bench_pick);
criterion_main!(benches);
