//! prefetchd's `/metrics` (`serve --metrics ADDR:PORT`): per job, reads
//! served per level, stall time, prefetches issued, used and wasted per
//! kind, demotions and stale hints, from the counters `status` shows. The
//! HTTP side is `netpager_metrics`. Jobs are labelled
//! `prefetch_job`: Prometheus's own `job` label would rename a `job` label
//! to `exported_job`.

use netpager_metrics::{labels, BaseUnit, Exposition, Labels, Value};

use crate::plan::engine::{EngineStatus, JobStats, PrefetchCounts};

/// One scrape's input: the engine's status, job names (unhinted readers
/// are the job `""`), stale hint files per job and donor names.
pub struct Snapshot {
    pub engine: EngineStatus,
    /// `(job id, stale hint files)` of every named job.
    pub stale: Vec<(u32, usize)>,
    pub donor_names: Vec<String>,
}

const UNHINTED: &str = "(unhinted)";

fn jobs_stats(s: &Snapshot) -> Vec<(&str, &JobStats)> {
    s.engine
        .jobs
        .iter()
        .map(|j| (j.name.as_str(), &j.stats))
        .chain(std::iter::once((UNHINTED, &s.engine.unhinted)))
        .collect()
}

/// Every family of one scrape.
pub fn exposition(s: &Snapshot) -> Exposition {
    let mut e = Exposition::new();
    let stats = jobs_stats(s);
    let per_job = |f: &dyn Fn(&JobStats) -> Value| -> Vec<(Labels, Value)> {
        stats
            .iter()
            .map(|(job, st)| (labels([("prefetch_job", job)]), f(st)))
            .collect()
    };
    e.counter(
        "prefetch_reads",
        "Reads served, per job ((unhinted): readers without hints).",
        None,
        per_job(&|st| st.reads.into()),
    );
    let mut hits = Vec::new();
    for (job, st) in &stats {
        for (level, n) in [
            ("local", st.hits.local),
            ("global", st.hits.global),
            ("disk", st.hits.disk),
        ] {
            hits.push((
                labels([("prefetch_job", job), ("level", level)]),
                Value::Int(n),
            ));
        }
    }
    e.counter(
        "prefetch_block_hits",
        "Blocks read, per job and the level that served them (local cache, donors' global memory, disk).",
        None,
        hits,
    );
    e.counter(
        "prefetch_stall",
        "Time readers waited for blocks, per job.",
        Some(BaseUnit::Seconds),
        per_job(&|st| Value::Float(st.stall_ns as f64 / 1e9)),
    );
    let kinds = |f: &dyn Fn(&PrefetchCounts) -> u64| -> Vec<(Labels, Value)> {
        let mut v = Vec::new();
        for (job, st) in &stats {
            for (kind, c) in [
                ("global_to_local", &st.global_to_local),
                ("disk_to_local", &st.disk_to_local),
                ("disk_to_global", &st.disk_to_global),
            ] {
                v.push((
                    labels([("prefetch_job", job), ("kind", kind)]),
                    Value::Int(f(c)),
                ));
            }
        }
        v
    };
    e.counter(
        "prefetch_issued",
        "Prefetches issued, per job and kind.",
        None,
        kinds(&|c| c.issued),
    );
    e.counter(
        "prefetch_used",
        "Prefetched blocks read before eviction, per job and kind.",
        None,
        kinds(&|c| c.used),
    );
    e.counter(
        "prefetch_wasted",
        "Prefetched blocks evicted (or lost with a donor) unread, per job and kind.",
        None,
        kinds(&|c| c.wasted),
    );
    let named = |f: &dyn Fn(&crate::plan::engine::JobStatus) -> Value| -> Vec<(Labels, Value)> {
        s.engine
            .jobs
            .iter()
            .map(|j| (labels([("prefetch_job", &j.name)]), f(j)))
            .collect()
    };
    e.counter(
        "prefetch_demotions",
        "Times a job was demoted to unhinted after consecutive misses.",
        None,
        named(&|j| j.demotions.into()),
    );
    e.counter(
        "prefetch_hint_misses",
        "Reads that did not match the job's hints.",
        None,
        named(&|j| j.missed.into()),
    );
    e.gauge(
        "prefetch_job_state",
        "1 for each job's state (hinted, unhinted...).",
        None,
        s.engine
            .jobs
            .iter()
            .map(|j| {
                (
                    labels([("prefetch_job", &j.name), ("state", j.state)]),
                    Value::Int(1),
                )
            })
            .collect(),
    );
    e.gauge(
        "prefetch_stale_hint_files",
        "Hint files of the job ignored because their data changed since recording.",
        None,
        s.engine
            .jobs
            .iter()
            .map(|j| {
                let n = s
                    .stale
                    .iter()
                    .find(|(id, _)| *id == j.id)
                    .map_or(0, |x| x.1);
                (labels([("prefetch_job", &j.name)]), Value::Int(n as u64))
            })
            .collect(),
    );
    e.gauge(
        "prefetch_local_blocks",
        "Blocks of the local cache.",
        None,
        vec![(vec![], Value::Int(u64::from(s.engine.local_blocks)))],
    );
    e.gauge(
        "prefetch_local_resident_blocks",
        "Blocks resident in the local cache.",
        None,
        vec![(vec![], Value::Int(u64::from(s.engine.local_resident)))],
    );
    let donor_name = |id: usize| s.donor_names.get(id).map_or("?", String::as_str);
    e.gauge(
        "prefetch_donor_alive",
        "1 while a donor answers.",
        None,
        s.engine
            .donors
            .iter()
            .map(|d| (labels([("donor", donor_name(d.id))]), d.alive.into()))
            .collect(),
    );
    e.gauge(
        "prefetch_donor_used_slots",
        "Blocks held on each donor.",
        None,
        s.engine
            .donors
            .iter()
            .map(|d| {
                (
                    labels([("donor", donor_name(d.id))]),
                    Value::Int(u64::from(d.used)),
                )
            })
            .collect(),
    );
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::engine::{DonorStatus, Hits, JobStatus};

    #[test]
    fn jobs_levels_and_kinds_render() {
        let stats = JobStats {
            reads: 5,
            hits: Hits {
                local: 3,
                global: 1,
                disk: 1,
            },
            stall_ns: 1_500_000_000,
            disk_to_global: PrefetchCounts {
                issued: 4,
                used: 2,
                wasted: 1,
            },
            ..Default::default()
        };
        let s = Snapshot {
            engine: EngineStatus {
                jobs: vec![JobStatus {
                    id: 7,
                    name: "render".into(),
                    state: "hinted",
                    position: 0,
                    window: 0,
                    matched: 0,
                    missed: 2,
                    demotions: 1,
                    promotions: 0,
                    per_ref_ns: 0,
                    page_cache_refs: 0,
                    stats,
                }],
                unhinted: JobStats::default(),
                local_blocks: 8,
                local_resident: 2,
                local_filling: 0,
                donors: vec![DonorStatus {
                    id: 0,
                    alive: true,
                    replica: false,
                    slots: 10,
                    used: 3,
                    outstanding: 0,
                }],
                f_local_ns: 0,
                f_global_ns: 0,
                f_disk_ns: 0,
            },
            stale: vec![(7, 1)],
            donor_names: vec!["d1".into()],
        };
        let text = exposition(&s).prometheus_text();
        for want in [
            "netpager_prefetch_reads_total{prefetch_job=\"render\"} 5\n",
            "netpager_prefetch_reads_total{prefetch_job=\"(unhinted)\"} 0\n",
            "netpager_prefetch_block_hits_total{prefetch_job=\"render\",level=\"global\"} 1\n",
            "netpager_prefetch_stall_seconds_total{prefetch_job=\"render\"} 1.5\n",
            "netpager_prefetch_issued_total{prefetch_job=\"render\",kind=\"disk_to_global\"} 4\n",
            "netpager_prefetch_used_total{prefetch_job=\"render\",kind=\"disk_to_global\"} 2\n",
            "netpager_prefetch_demotions_total{prefetch_job=\"render\"} 1\n",
            "netpager_prefetch_job_state{prefetch_job=\"render\",state=\"hinted\"} 1\n",
            "netpager_prefetch_stale_hint_files{prefetch_job=\"render\"} 1\n",
            "netpager_prefetch_donor_used_slots{donor=\"d1\"} 3\n",
        ] {
            assert!(text.contains(want), "{want:?} missing from\n{text}");
        }
    }
}
