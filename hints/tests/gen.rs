//! Each reference workload has the shape docs/DESIGN.md "3 Reference workloads"
//! describes, and the generated data matches the content function.

use std::collections::HashSet;
use std::fs;

use hints::content;
use hints::gen::*;
use hints::{Format, HintReader};

fn generate(kind: WorkloadKind) -> Workload {
    Workload::generate(kind, &GenParams::default()).unwrap()
}

fn blocks_of(w: &Workload, file: u32) -> u64 {
    w.files[file as usize].size / u64::from(w.params.block_size)
}

/// Fraction of accesses that start where the previous one ended.
fn sequential_fraction(w: &Workload) -> f64 {
    let seq = w
        .accesses
        .windows(2)
        .filter(|p| p[0].file == p[1].file && p[0].block + u64::from(p[0].blocks) == p[1].block)
        .count();
    seq as f64 / (w.accesses.len() - 1) as f64
}

fn distinct_blocks(w: &Workload) -> HashSet<(u32, u64)> {
    w.accesses
        .iter()
        .flat_map(|a| (a.block..a.block + u64::from(a.blocks)).map(move |b| (a.file, b)))
        .collect()
}

#[test]
fn default_scale_is_a_few_megabytes_and_paper_scale_is_100_mb() {
    let small = generate(WorkloadKind::Random);
    assert_eq!(small.files[0].size, 100 << 20 >> 5);
    let paper = Workload::generate(
        WorkloadKind::Random,
        &GenParams {
            scale: 1.0,
            ..GenParams::default()
        },
    )
    .unwrap();
    assert_eq!(paper.files[0].size, 100 << 20);
    let render = generate(WorkloadKind::Render);
    assert_eq!(render.files[0].size / 8192, ((178u64 << 20) >> 5) / 8192);
}

#[test]
fn random_is_a_permutation() {
    let w = generate(WorkloadKind::Random);
    let n = blocks_of(&w, 0);
    let mut blocks: Vec<u64> = w.accesses.iter().map(|a| a.block).collect();
    assert!(w.accesses.iter().all(|a| a.blocks == 1));
    assert!(sequential_fraction(&w) < 0.05);
    blocks.sort_unstable();
    assert_eq!(blocks, (0..n).collect::<Vec<_>>());
}

#[test]
fn reverse_is_descending_and_sequential_ascending() {
    let w = generate(WorkloadKind::Reverse);
    let blocks: Vec<u64> = w.accesses.iter().map(|a| a.block).collect();
    assert_eq!(blocks, (0..blocks_of(&w, 0)).rev().collect::<Vec<_>>());
    let w = generate(WorkloadKind::Sequential);
    let blocks: Vec<u64> = w.accesses.iter().map(|a| a.block).collect();
    assert_eq!(blocks, (0..blocks_of(&w, 0)).collect::<Vec<_>>());
}

#[test]
fn cyclic_variants_repeat_their_base_three_times() {
    for (cyclic, base) in [
        (WorkloadKind::CyclicRandom, WorkloadKind::Random),
        (WorkloadKind::CyclicReverse, WorkloadKind::Reverse),
        (WorkloadKind::CyclicHotcold, WorkloadKind::Hotcold),
    ] {
        let c = generate(cyclic);
        let b = generate(base);
        assert_eq!((c.repeat, b.repeat), (3, 1));
        assert_eq!(c.accesses, b.accesses);
        assert_eq!(c.files, b.files);
        assert_eq!(c.header().repeat, 3);
        assert_eq!(c.job(), cyclic.name());
    }
    // Through a real file: 3 passes of the same stream.
    let dir = tempfile::tempdir().unwrap();
    let w = generate(WorkloadKind::CyclicReverse);
    let m = write_dataset(&w, dir.path(), Format::Binary).unwrap();
    let refs: Vec<_> = HintReader::open(&dir.path().join(&m.hints))
        .unwrap()
        .references()
        .collect::<Result<_, _>>()
        .unwrap();
    let n = w.accesses.len();
    assert_eq!(refs.len(), 3 * n);
    for pass in 0..3 {
        assert!(refs[pass * n..(pass + 1) * n]
            .iter()
            .all(|r| r.pass == pass as u32));
        assert_eq!(refs[pass * n].record.offset, w.files[0].size - 8192);
    }
}

#[test]
fn hotcold_has_twenty_phases_of_hot_then_cold_runs() {
    let w = generate(WorkloadKind::Hotcold);
    let total = blocks_of(&w, 0);
    let hot = total / 5;
    let hot_runs = HOT_PAGES / RUN_PAGES as usize;
    let cold_runs = COLD_PAGES / RUN_PAGES as usize;
    assert_eq!(w.accesses.len(), HOTCOLD_PHASES * (hot_runs + cold_runs));
    for (p, phase) in w.accesses.chunks(hot_runs + cold_runs).enumerate() {
        let (h, c) = phase.split_at(hot_runs);
        assert!(
            h.iter()
                .all(|a| a.blocks == RUN_PAGES && a.block + 4 <= hot),
            "phase {p} hot"
        );
        assert!(
            c.iter()
                .all(|a| a.blocks == RUN_PAGES && a.block >= hot && a.block + 4 <= total),
            "phase {p} cold"
        );
    }
    // Random within the regions: many different run starts.
    let starts: HashSet<u64> = w.accesses.iter().map(|a| a.block).collect();
    assert!(starts.len() > 300, "{} distinct run starts", starts.len());
}

#[test]
fn render_touches_56_percent_with_poor_locality_and_some_reuse() {
    let w = generate(WorkloadKind::Render);
    let n = blocks_of(&w, 0);
    let touched = distinct_blocks(&w).len() as u64;
    let target = (n as f64 * RENDER_TOUCHED).ceil() as u64;
    assert!(
        (target..target + 3).contains(&touched),
        "touched {touched} of {n}"
    );
    assert!(w.accesses.iter().all(|a| (1..=3).contains(&a.blocks)));
    assert!(sequential_fraction(&w) < 0.1, "{}", sequential_fraction(&w));
    let refs: u64 = w.accesses.iter().map(|a| u64::from(a.blocks)).sum();
    let reuse = refs as f64 / touched as f64;
    assert!((1.1..1.3).contains(&reuse), "reuse {reuse}");
}

#[test]
fn oo7_chases_pointers_through_part_of_the_database() {
    let w = generate(WorkloadKind::Oo7);
    let n = blocks_of(&w, 0);
    let touched = distinct_blocks(&w).len() as f64 / n as f64;
    assert!((0.55..0.75).contains(&touched), "touched {touched}");
    assert!(w.accesses.iter().all(|a| a.blocks == 1));
    // Composite parts are 4 adjacent blocks read in a shuffled order, the
    // rest is scattered: few accesses follow their predecessor.
    assert!(
        sequential_fraction(&w) < 0.35,
        "{}",
        sequential_fraction(&w)
    );
    let mut groups_of_four = 0;
    for win in w.accesses.windows(4) {
        let mut b: Vec<u64> = win.iter().map(|a| a.block).collect();
        b.sort_unstable();
        if b[3] - b[0] == 3 && b.windows(2).all(|p| p[1] == p[0] + 1) {
            groups_of_four += 1;
        }
    }
    let parts_visited = (n as f64 * 0.68 / 5.5) as usize * OO7_PARTS_PER_BASE;
    assert!(
        groups_of_four >= parts_visited,
        "{groups_of_four} part visits, want {parts_visited}"
    );
}

#[test]
fn hashjoin_builds_sequentially_then_probes_partition_by_partition() {
    let w = generate(WorkloadKind::Hashjoin);
    assert_eq!(
        w.files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
        ["build.rel", "probe.rel"]
    );
    let nb = blocks_of(&w, 0) as usize;
    let (build, probe) = w.accesses.split_at(nb);
    assert!(build
        .iter()
        .enumerate()
        .all(|(i, a)| a.file == 0 && a.block == i as u64));
    assert!(probe.iter().all(|a| a.file == 1));
    let keys: Vec<(u64, u64)> = probe
        .iter()
        .map(|a| (hashjoin_partition(w.params.seed, a.block), a.block))
        .collect();
    assert!(
        keys.windows(2).all(|p| p[0] < p[1]),
        "partition order, ascending within"
    );
    assert_eq!(keys.len() as u64, blocks_of(&w, 1));
    let partitions: HashSet<u64> = keys.iter().map(|k| k.0).collect();
    assert_eq!(partitions.len() as u64, HASHJOIN_PARTITIONS);
}

#[test]
fn generation_is_deterministic_per_seed() {
    for kind in WorkloadKind::ALL {
        let a = generate(kind);
        let b = generate(kind);
        assert_eq!(a.accesses, b.accesses, "{kind}");
        let other = Workload::generate(
            kind,
            &GenParams {
                seed: 99,
                ..GenParams::default()
            },
        )
        .unwrap();
        assert_ne!(a.files[0].file_seed, other.files[0].file_seed);
        if !matches!(
            kind,
            WorkloadKind::Reverse | WorkloadKind::CyclicReverse | WorkloadKind::Sequential
        ) {
            assert_ne!(a.accesses, other.accesses, "{kind}");
        }
    }
}

#[test]
fn bad_parameters_are_refused() {
    for scale in [0.0, -1.0, f64::NAN, f64::INFINITY, 2000.0] {
        let e = Workload::generate(
            WorkloadKind::Random,
            &GenParams {
                scale,
                ..GenParams::default()
            },
        );
        assert!(matches!(e, Err(GenError::Scale(_))), "{scale}");
    }
    let e = Workload::generate(
        WorkloadKind::Random,
        &GenParams {
            block_size: 1000,
            ..GenParams::default()
        },
    );
    assert!(matches!(e, Err(GenError::BlockSize(_))));
    assert!("nonsense".parse::<WorkloadKind>().is_err());
    for kind in WorkloadKind::ALL {
        assert_eq!(kind.name().parse::<WorkloadKind>().unwrap(), kind);
    }
}

#[test]
fn written_data_sets_match_the_content_function_and_their_hints() {
    let dir = tempfile::tempdir().unwrap();
    let params = GenParams {
        scale: 1.0 / 64.0,
        seed: 5,
        block_size: 4096,
    };
    for (kind, format) in [
        (WorkloadKind::Hashjoin, Format::Text),
        (WorkloadKind::Oo7, Format::Binary),
    ] {
        let out = dir.path().join(kind.name());
        let w = Workload::generate(kind, &params).unwrap();
        let m = write_dataset(&w, &out, format).unwrap();
        let root = out.join(&m.root);
        for f in &m.files {
            assert_eq!(f.file_seed, content::file_seed(5, &f.path));
            let data = fs::read(root.join(&f.path)).unwrap();
            assert_eq!(data.len() as u64, f.size);
            assert_eq!(
                content::first_mismatch(f.file_seed, 0, &data),
                None,
                "{}",
                f.path
            );
        }
        let reader = HintReader::open(&out.join(&m.hints)).unwrap();
        assert_eq!(reader.format(), format);
        assert_eq!(reader.header().job, kind.name());
        assert!(reader.header().files.iter().all(|d| d.mtime_ns.is_some()));
        let records: Vec<_> = reader.collect::<Result<_, _>>().unwrap();
        assert_eq!(records, w.records().collect::<Vec<_>>());
        let manifest: serde_json::Value =
            serde_json::from_slice(&fs::read(out.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["workload"], kind.name());
        assert_eq!(manifest["files"][0]["file_seed"], m.files[0].file_seed);
        let stale = HintReader::open(&out.join(&m.hints))
            .unwrap()
            .check_against(&root)
            .unwrap();
        assert_eq!(stale, vec![]);
        // Hint offsets read the bytes the content function promises.
        let r = &records[records.len() / 2];
        let data = fs::read(root.join(&r.path)).unwrap();
        let seed = content::file_seed(5, &r.path);
        let at = r.offset as usize;
        assert_eq!(data[at], content::expected_byte(seed, r.offset));
        assert_eq!(
            content::first_mismatch(seed, r.offset, &data[at..at + r.length as usize]),
            None
        );
    }
}
