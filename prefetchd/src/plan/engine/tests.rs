//! The planner's unit tests, on a simulated clock (a whole job against
//! simulated disks and donors in `sim.rs`).

use super::*;
use crate::plan::coalesce::CoalesceConfig;
use crate::plan::cursor::CursorConfig;
use crate::plan::timing::CostDefaults;

mod sim;

const MS: Nanos = 1_000_000;
const US: Nanos = 1_000;

fn b(i: u64) -> BlockId {
    BlockId::new(1, i)
}

fn source(refs: Vec<u64>) -> BlockSource {
    Box::new(refs.into_iter().map(b).collect::<Vec<_>>().into_iter())
}

fn cfg(local_blocks: u32) -> EngineConfig {
    EngineConfig {
        local_blocks,
        cursor: CursorConfig {
            window: 256,
            ..CursorConfig::default()
        },
        costs: CostDefaults {
            local: 10 * US,
            global: 200 * US,
            disk: 10 * MS,
            gap: 250 * US,
        },
        // One block per disk request unless a test says otherwise.
        coalesce: CoalesceConfig {
            max_blocks: 1,
            max_gap: 0,
        },
        readahead_blocks: 1,
        ..EngineConfig::default()
    }
}

/// `cfg(local_blocks)` without prefetching: demand reads and replacement alone.
fn no_prefetch(local_blocks: u32) -> EngineConfig {
    EngineConfig {
        prefetch: false,
        ..cfg(local_blocks)
    }
}

/// `n` donors of `slots` block slots each; with `replica`, each reads from
/// its own replica of the data set.
fn donors(n: usize, slots: u32, replica: bool) -> Vec<DonorSpec> {
    vec![DonorSpec { slots, replica }; n]
}

/// 8 local buffers and no local prefetching over `donors`: what the planner
/// does with global memory, alone.
fn global_only(donors: &[DonorSpec]) -> Engine {
    Engine::new(
        EngineConfig {
            local_prefetch_depth: 0,
            ..cfg(8)
        },
        donors,
    )
}

/// Fetches `block` by demand and completes the fill at once.
fn read_now(e: &mut Engine, job: Option<JobId>, block: BlockId, now: Nanos) -> Level {
    match e.access(job, block, now) {
        Step::Hit { .. } => Level::Local,
        Step::Fetch(Action::FillLocal { .. }) => {
            e.local_filled(block);
            Level::Global
        }
        Step::Fetch(Action::ReadDisk { run, .. }) => {
            for b in e.run_done(run) {
                e.local_filled(b);
            }
            Level::Disk
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn demand_read_then_local_hit() {
    let mut e = Engine::new(cfg(4), &[]);
    assert_eq!(read_now(&mut e, None, b(1), 0), Level::Disk);
    assert_eq!(read_now(&mut e, None, b(1), 1), Level::Local);
    assert_eq!(
        e.status().unhinted.hits,
        Hits {
            local: 1,
            global: 0,
            disk: 1
        }
    );
}

#[test]
fn unhinted_blocks_are_replaced_lru() {
    let mut e = Engine::new(cfg(3), &[]);
    for (t, i) in [1, 2, 3].into_iter().enumerate() {
        read_now(&mut e, None, b(i), t as Nanos * 10);
    }
    read_now(&mut e, None, b(1), 40); // 2 is now least recently used
    read_now(&mut e, None, b(4), 50);
    assert!(e.is_local(b(1)) && e.is_local(b(3)) && e.is_local(b(4)));
    assert!(!e.is_local(b(2)));
}

#[test]
fn hinted_job_replaces_the_block_used_furthest_in_the_future() {
    let mut e = Engine::new(no_prefetch(3), &[]);
    let j = e.add_job("j", source(vec![1, 2, 3, 4, 2, 1, 3]));
    for (t, i) in [1, 2, 3, 4].into_iter().enumerate() {
        read_now(&mut e, Some(j), b(i), t as Nanos * MS);
    }
    // Reading 4 evicted 3, the resident block needed last.
    assert!(e.is_local(b(1)) && e.is_local(b(2)) && !e.is_local(b(3)));
}

#[test]
fn a_block_in_the_page_cache_gives_up_its_buffer_first_and_is_not_prefetched() {
    let mut e = Engine::new(no_prefetch(2), &[]);
    let j = e.add_job("j", source(vec![1, 2, 1, 2, 3, 1]));
    read_now(&mut e, Some(j), b(1), 0);
    e.page_cached(Some(j), b(1));
    // 2 was read only in part: the kernel does not hold all of it.
    read_now(&mut e, Some(j), b(2), MS);
    read_now(&mut e, Some(j), b(3), 2 * MS);
    // Without the page cache 1 would be kept (used again soonest).
    assert!(!e.is_local(b(1)) && e.is_local(b(2)) && e.is_local(b(3)));
    let st = &e.status().jobs[0];
    assert_eq!((st.page_cache_refs, st.missed), (2, 0), "{st:?}");
    // One buffer: reading 2 evicts 1, which the page cache still holds.
    let mut e = Engine::new(cfg(1), &[]);
    let j = e.add_job("j", source(vec![1, 2, 1, 3]));
    read_now(&mut e, Some(j), b(1), 0);
    e.page_cached(Some(j), b(1));
    read_now(&mut e, Some(j), b(2), MS);
    let wanted: Vec<u64> = disk_runs(&e.plan(MS)).iter().map(|r| r.1).collect();
    assert_eq!(wanted, vec![3], "1 comes from the page cache");
}

#[test]
fn an_io_bound_job_prefetches_from_disk_and_hits() {
    let mut e = Engine::new(cfg(64), &[]);
    let j = e.add_job("j", source((0..40).collect()));
    let actions = e.plan(0);
    assert!(!actions.is_empty());
    // The local disk gets a short queue of prefetches, in stream order.
    assert_eq!(actions.len() as u32, e.config().disk_prefetch_depth);
    for (i, a) in actions.iter().enumerate() {
        let Action::ReadDisk {
            run,
            first,
            count,
            prefetch,
            ..
        } = *a
        else {
            panic!("{a:?}")
        };
        assert_eq!((first, count, prefetch), (i as u64, 1, true));
        for block in e.run_done(run) {
            assert!(e.local_filled(block).is_some());
        }
    }
    assert!(matches!(e.access(Some(j), b(0), MS), Step::Hit { .. }));
    let s = &e.status().jobs[0].stats;
    assert_eq!(
        (s.hits.local, s.disk_to_local.issued, s.disk_to_local.used),
        (1, 2, 1)
    );
}

#[test]
fn a_compute_bound_job_does_not_prefetch_early() {
    // 100 ms per reference: each disk read fits between two reads, so
    // only the next block is fetched now.
    let mut e = Engine::new(
        EngineConfig {
            costs: CostDefaults {
                gap: 100 * MS,
                ..cfg(64).costs
            },
            ..cfg(64)
        },
        &[],
    );
    e.add_job("j", source((0..40).collect()));
    assert_eq!(e.plan(0).len(), 1);
}

#[test]
fn local_prefetch_does_no_harm() {
    // The cache is full of blocks the job needs before the missing one.
    let mut e = Engine::new(
        EngineConfig {
            disk_prefetch_depth: 8,
            ..cfg(2)
        },
        &[],
    );
    let j = e.add_job("j", source(vec![1, 2, 1, 2, 1, 2, 9]));
    read_now(&mut e, Some(j), b(1), 0);
    read_now(&mut e, Some(j), b(2), 0);
    assert!(e.plan(0).is_empty(), "would evict a block used before 9");
}

#[test]
fn demoted_job_stops_prefetching() {
    let mut e = Engine::new(cfg(64), &[]);
    let j = e.add_job("j", source((0..100).collect()));
    for i in 1000..1008 {
        read_now(&mut e, Some(j), b(i), 0);
    }
    assert_eq!(e.job_state(j), Some(CursorState::Unhinted));
    // Clear what was prefetched before, then nothing new is planned.
    assert!(e
        .plan(0)
        .iter()
        .all(|a| !matches!(a, Action::FillLocal { prefetch: true, .. })));
}

#[test]
fn disk_to_global_is_aggressive_bounded_by_b_and_round_robin() {
    let mut e = Engine::new(cfg(8), &donors(2, 100, true));
    e.add_job("j", source((0..200).collect()));
    let actions = e.plan(0);
    let fills: Vec<_> = actions
        .iter()
        .filter_map(|a| match *a {
            Action::FillGlobal {
                block,
                donor,
                from,
                deadline,
                ..
            } => Some((block, donor, from, deadline)),
            _ => None,
        })
        .collect();
    // B = 8 outstanding on each donor.
    assert_eq!(fills.len(), 16);
    assert_eq!(fills.iter().filter(|f| f.1 == 0).count(), 8);
    // Alternating donors, earliest deadlines first, all from replicas.
    assert!(fills
        .windows(2)
        .all(|w| w[0].1 != w[1].1 && w[0].3 <= w[1].3));
    assert!(fills.iter().all(|f| f.2 == GlobalSource::Replica));
    // Nothing more until some complete.
    assert!(e
        .plan(10 * MS)
        .iter()
        .all(|a| !matches!(a, Action::FillGlobal { .. })));
    e.global_filled(fills[0].0, 20 * MS);
    let more = e.plan(20 * MS);
    assert_eq!(
        more.iter()
            .filter(|a| matches!(a, Action::FillGlobal { donor: 0, .. }))
            .count(),
        1
    );
}

#[test]
fn the_local_disk_serves_blocks_not_already_headed_for_a_donor() {
    let mut e = Engine::new(cfg(64), &donors(1, 100, true));
    e.add_job("j", source((0..100).collect()));
    let a = e.plan(0);
    let to_global: HashSet<BlockId> = a
        .iter()
        .filter_map(|a| match a {
            Action::FillGlobal { block, .. } => Some(*block),
            _ => None,
        })
        .collect();
    let to_local: Vec<BlockId> = a
        .iter()
        .filter_map(|a| match a {
            Action::ReadDisk { file, first, .. } => Some(BlockId::new(*file, *first)),
            _ => None,
        })
        .collect();
    assert_eq!(to_global.len(), 8);
    assert!(!to_local.is_empty());
    assert!(
        to_local.iter().all(|b| !to_global.contains(b)),
        "{to_local:?} {to_global:?}"
    );
    assert_eq!(
        to_local[0],
        b(0),
        "nothing is headed for a donor before planning"
    );
}

#[test]
fn global_eviction_replaces_the_block_used_furthest_and_only_if_later() {
    let mut e = global_only(&donors(1, 2, true));
    let j = e.add_job("j", source(vec![1, 2, 9, 3, 2, 1]));
    let fills: Vec<_> = e
        .plan(0)
        .into_iter()
        .filter_map(|a| match a {
            Action::FillGlobal { block, slot, .. } => Some((block, slot)),
            _ => None,
        })
        .collect();
    assert_eq!(fills, vec![(b(1), 0), (b(2), 1)]);
    e.global_filled(b(1), MS);
    e.global_filled(b(2), MS);
    assert_eq!(read_now(&mut e, Some(j), b(1), MS), Level::Global);
    // 9 is needed before 1 is needed again: 1 makes room. 3 is needed
    // after 2, so 2 stays.
    let a = e.plan(2 * MS);
    assert_eq!(
        a,
        vec![Action::FillGlobal {
            block: b(9),
            donor: 0,
            slot: 0,
            from: GlobalSource::Replica,
            deadline: 2 * MS + time_until(1, e.per_ref(&e.jobs[&j])),
        }]
    );
    assert!(e.is_global(b(2)) && !e.is_global(b(1)));
    let s = e.status().jobs[0].stats.disk_to_global;
    assert_eq!((s.issued, s.used, s.wasted), (3, 1, 0));
}

#[test]
fn reads_from_global_credit_the_disk_to_global_prefetch() {
    let mut e = global_only(&donors(1, 8, false));
    let j = e.add_job("j", source(vec![1, 2]));
    let a = e.plan(0);
    assert!(a.iter().all(|a| matches!(
        a,
        Action::FillGlobal {
            from: GlobalSource::LocalDisk,
            ..
        }
    )));
    e.global_filled(b(1), MS);
    assert_eq!(read_now(&mut e, Some(j), b(1), 2 * MS), Level::Global);
    let s = e.status().jobs[0].stats;
    assert_eq!((s.hits.global, s.disk_to_global.used), (1, 1));
}

#[test]
fn reads_wait_for_a_block_on_its_way_to_global_memory() {
    let mut e = global_only(&donors(1, 8, true));
    let j = e.add_job("j", source(vec![1]));
    e.plan(0);
    assert_eq!(e.access(Some(j), b(1), 0), Step::Wait);
    e.global_filled(b(1), MS);
    match e.retry(b(1), MS) {
        Step::Fetch(Action::FillLocal { .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_dead_donor_loses_its_blocks_and_reads_go_to_disk() {
    let mut e = global_only(&donors(1, 8, true));
    let j = e.add_job("j", source(vec![1, 2]));
    e.plan(0);
    e.global_filled(b(1), MS);
    e.donor_failed(0);
    assert!(!e.is_global(b(1)));
    assert_eq!(read_now(&mut e, Some(j), b(1), 2 * MS), Level::Disk);
    // The fill still in flight reports its failure later: harmless.
    e.global_failed(b(2));
    assert!(e
        .plan(3 * MS)
        .iter()
        .all(|a| !matches!(a, Action::FillGlobal { .. })));
    assert!(!e.status().donors[0].alive);
}

#[test]
fn a_donor_let_go_and_back_is_a_fresh_one_under_a_new_id() {
    let spec = DonorSpec {
        slots: 8,
        replica: true,
    };
    let mut e = global_only(&[spec]);
    e.add_job("j", source(vec![1, 2, 3]));
    e.plan(0);
    e.global_filled(b(1), MS);
    e.donor_failed(0);
    // A fill that lands after the donor was let go is not trusted.
    e.global_filled(b(2), MS);
    assert!(!e.is_global(b(1)) && !e.is_global(b(2)));
    e.global_failed(b(3));
    assert_eq!(e.add_donor(spec), 1);
    let placed: Vec<(u64, DonorId)> = e
        .plan(2 * MS)
        .iter()
        .filter_map(|a| match *a {
            Action::FillGlobal { block, donor, .. } => Some((block.index, donor)),
            _ => None,
        })
        .collect();
    assert_eq!(placed, vec![(1, 1), (2, 1), (3, 1)]);
    let st = e.status();
    assert!(!st.donors[0].alive && st.donors[1].alive);
    assert_eq!((st.donors[0].used, st.donors[0].outstanding), (0, 0));
}

#[test]
fn failed_fill_frees_its_buffer_and_retry_fetches_again() {
    let mut e = Engine::new(cfg(1), &[]);
    let Step::Fetch(Action::ReadDisk { run, .. }) = e.access(None, b(1), 0) else {
        panic!()
    };
    assert_eq!(e.run_done(run), vec![b(1)]);
    e.local_failed(b(1));
    assert_eq!(e.status().local_filling, 0);
    let Step::Fetch(Action::ReadDisk { run, .. }) = e.retry(b(1), 1) else {
        panic!()
    };
    assert_eq!(e.run_done(run), vec![b(1)]);
    assert_eq!(e.local_filled(b(1)), Some(0));
}

#[test]
fn when_every_buffer_is_being_filled_reads_are_served_uncached() {
    let mut e = Engine::new(cfg(1), &[]);
    assert!(matches!(
        e.access(None, b(1), 0),
        Step::Fetch(Action::ReadDisk { .. })
    ));
    assert!(matches!(
        e.access(None, b(2), 0),
        Step::Fetch(Action::ReadDisk { .. })
    ));
    assert_eq!(e.local_filled(b(2)), None);
    assert!(!e.is_local(b(2)));
    assert_eq!(e.local_filled(b(1)), Some(0));
}

fn coalescing(max_blocks: u32, max_gap: u32, readahead_blocks: u32) -> EngineConfig {
    EngineConfig {
        coalesce: CoalesceConfig {
            max_blocks,
            max_gap,
        },
        readahead_blocks,
        ..cfg(64)
    }
}

fn disk_runs(actions: &[Action]) -> Vec<(RunId, u64, u32, bool)> {
    actions
        .iter()
        .filter_map(|a| match *a {
            Action::ReadDisk {
                run,
                first,
                count,
                prefetch,
                ..
            } => Some((run, first, count, prefetch)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_prefetch_reads_the_jobs_nearby_upcoming_blocks_in_one_request() {
    let mut e = Engine::new(coalescing(8, 1, 1), &[]);
    let j = e.add_job("j", source(vec![10, 50, 12, 11, 200, 14, 51, 10]));
    let runs = disk_runs(&e.plan(0));
    // 10..=14 (13 is a hole, read and dropped), then 50..=51; 200 waits
    // for a disk request to finish (two are queued at most).
    assert_eq!(
        runs.iter().map(|r| (r.1, r.2, r.3)).collect::<Vec<_>>(),
        vec![(10, 5, true), (50, 2, true)]
    );
    assert_eq!(e.run_done(runs[0].0), vec![b(10), b(12), b(11), b(14)]);
    for i in [10, 12, 11, 14] {
        assert!(e.local_filled(b(i)).is_some());
    }
    assert!(matches!(e.access(Some(j), b(10), MS), Step::Hit { .. }));
    let s = e.status().jobs[0].stats;
    assert_eq!((s.disk_to_local.issued, s.disk_to_local.used), (6, 1));
    // A finished request makes room for the next one.
    assert_eq!(
        disk_runs(&e.plan(MS))
            .iter()
            .map(|r| (r.1, r.2))
            .collect::<Vec<_>>(),
        vec![(200, 1)]
    );
}

#[test]
fn a_following_jobs_miss_brings_its_upcoming_neighbours() {
    let mut e = Engine::new(
        EngineConfig {
            prefetch: true,
            local_prefetch_depth: 0,
            ..coalescing(8, 0, 1)
        },
        &[],
    );
    let j = e.add_job("j", source(vec![5, 7, 6, 30]));
    let Step::Fetch(Action::ReadDisk {
        run,
        first,
        count,
        prefetch,
        ..
    }) = e.access(Some(j), b(5), 0)
    else {
        panic!()
    };
    assert_eq!((first, count, prefetch), (5, 3, false));
    assert_eq!(e.run_done(run), vec![b(5), b(7), b(6)]);
}

#[test]
fn a_read_of_several_blocks_is_one_request() {
    let mut e = Engine::new(coalescing(8, 0, 1), &[]);
    let Step::Fetch(Action::ReadDisk { first, count, .. }) = e.access_read(None, b(3), 7..100, 0)
    else {
        panic!()
    };
    assert_eq!((first, count), (3, 4));
    for i in 4..7 {
        assert_eq!(e.access_read(None, b(i), 7..100, 0), Step::Wait);
    }
}

#[test]
fn sequential_readers_without_hints_read_ahead_up_to_the_end_of_the_file() {
    let mut e = Engine::new(
        EngineConfig {
            prefetch: false,
            ..coalescing(1, 0, 32)
        },
        &[],
    );
    // The start of a file: the block and three ahead.
    let Step::Fetch(Action::ReadDisk {
        run, first, count, ..
    }) = e.access_read(None, b(0), 1..100, 0)
    else {
        panic!()
    };
    assert_eq!((first, count), (0, 4));
    for i in e.run_done(run) {
        e.local_filled(i);
    }
    // Reaching the window queues the next one, even without prefetching.
    assert!(matches!(
        e.access_read(None, b(1), 2..100, 0),
        Step::Hit { .. }
    ));
    let runs = disk_runs(&e.plan(0));
    assert_eq!(
        runs.iter().map(|r| (r.1, r.2, r.3)).collect::<Vec<_>>(),
        vec![(4, 8, true)]
    );
    // A random miss reads what was asked; readahead stops at the end.
    let Step::Fetch(Action::ReadDisk { count, .. }) = e.access_read(None, b(50), 51..100, 0) else {
        panic!()
    };
    assert_eq!(count, 1);
    let Step::Fetch(Action::ReadDisk { first, count, .. }) = e.access_read(None, b(51), 52..53, 0)
    else {
        panic!()
    };
    assert_eq!((first, count), (51, 2));
}
