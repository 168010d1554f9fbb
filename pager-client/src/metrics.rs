//! The client's `/metrics` (`[metrics]` in device.toml): per-request
//! counters and latency histograms that the device's request entry points
//! update (atomics only: no lock, no allocation on the swap path), and the
//! families of one scrape rendered from them, the device's status and the
//! front end in use. The HTTP side is `netpager_metrics`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use netpager_metrics::{labels, AtomicHistogram, BaseUnit, Exposition, Labels, Value};

use crate::stages::StageStats;
use crate::status::{ClientStatus, Progress, RequestReport};

/// Kinds of request the device serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    Read,
    Write,
    Zero,
    Trim,
    Flush,
}

impl RequestKind {
    pub const ALL: [RequestKind; 5] = [
        RequestKind::Read,
        RequestKind::Write,
        RequestKind::Zero,
        RequestKind::Trim,
        RequestKind::Flush,
    ];

    pub fn word(self) -> &'static str {
        match self {
            RequestKind::Read => "read",
            RequestKind::Write => "write",
            RequestKind::Zero => "zero",
            RequestKind::Trim => "trim",
            RequestKind::Flush => "flush",
        }
    }
}

/// Counters of the requests the device served, by kind.
#[derive(Debug, Default)]
pub struct RequestStats {
    latency: [AtomicHistogram; 5],
    bytes: [AtomicU64; 5],
    errors: [AtomicU64; 5],
    /// Where the serving process's requests spend their time, counted by
    /// the front end (`pagerctl serve`) when it commits each reply.
    pub stages: StageStats,
    /// The front end's write-back buffer (capacity 0: none).
    pub writeback: std::sync::Arc<crate::writeback::Counters>,
}

impl RequestStats {
    /// Counts one finished request of `bytes` that took `took`.
    pub fn record(&self, kind: RequestKind, bytes: u64, took: Duration, ok: bool) {
        let i = kind as usize;
        self.latency[i].observe(took);
        if ok {
            self.bytes[i].fetch_add(bytes, Relaxed);
        } else {
            self.errors[i].fetch_add(1, Relaxed);
        }
    }

    /// The counters as status.json keeps them.
    pub fn reports(&self) -> Vec<RequestReport> {
        RequestKind::ALL
            .iter()
            .map(|&k| {
                let i = k as usize;
                let h = self.latency[i].snapshot();
                RequestReport {
                    op: k.word().to_string(),
                    count: h.count,
                    bytes: self.bytes[i].load(Relaxed),
                    errors: self.errors[i].load(Relaxed),
                    seconds: h.sum_seconds,
                    buckets: h.buckets.iter().map(|(_, c)| *c).collect(),
                }
            })
            .collect()
    }
}

/// How the kernel reaches the device: told by the process that serves it
/// ([`crate::device::Device::set_frontend`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FrontendInfo {
    /// fuse-uring, fuse or nbd; empty when not attached by pagerctl.
    pub frontend: String,
    /// The transport `pagerctl serve` uses (fuse-uring or fuse).
    pub transport: Option<String>,
    /// Why io_uring was wanted but not used.
    pub fallback: Option<String>,
}

fn one(v: impl Into<Value>) -> Vec<(Labels, Value)> {
    vec![(vec![], v.into())]
}

/// Labelled `activity`, not `job`: Prometheus's own `job` label would
/// rename ours to `exported_job`.
fn per_job(s: &ClientStatus, f: impl Fn(&Progress) -> Value) -> Vec<(Labels, Value)> {
    [
        ("rebuild", &s.totals.rebuild),
        ("drain", &s.totals.drain),
        ("off_fallback", &s.totals.off_fallback),
        ("rebalance", &s.totals.rebalance.pass),
    ]
    .into_iter()
    .map(|(activity, p)| (labels([("activity", activity)]), f(p)))
    .collect()
}

/// Every family of one scrape.
pub fn exposition(s: &ClientStatus, fe: &FrontendInfo) -> Exposition {
    let mut e = Exposition::new();
    let b = Some(BaseUnit::Bytes);
    let t = &s.totals;
    e.gauge(
        "client_info",
        "The client's name, mode and code (K+R); always 1.",
        None,
        vec![(
            labels([
                ("client", &s.client_id),
                ("mode", &s.mode),
                ("code", &s.code),
            ]),
            Value::Int(1),
        )],
    );
    e.gauge(
        "client_frontend",
        "The front end the kernel reaches the device through, and its transport; always 1.",
        None,
        vec![(
            labels([
                ("frontend", &fe.frontend),
                ("transport", fe.transport.as_deref().unwrap_or("")),
            ]),
            Value::Int(1),
        )],
    );
    e.gauge(
        "client_frontend_fallback",
        "1 when FUSE over io_uring was wanted but classic /dev/fuse is used.",
        None,
        one(fe.fallback.is_some()),
    );
    e.gauge("client_size", "Device size.", b, one(s.size_bytes));
    e.gauge(
        "client_extent_size",
        "Unit of placement.",
        b,
        one(s.extent_bytes),
    );
    e.gauge(
        "client_units",
        "Units of placement (extents, or stripes).",
        None,
        one(t.units),
    );
    e.gauge(
        "client_units_placed",
        "Units that hold a placement.",
        None,
        one(t.units_placed),
    );
    e.gauge(
        "client_degraded_units",
        "Units missing a copy that can still be re-created.",
        None,
        one(t.degraded),
    );
    e.gauge(
        "client_lost_units",
        "Units whose data is gone.",
        None,
        one(t.lost),
    );
    e.gauge(
        "client_degraded",
        "1 while some unit misses a copy or is lost (a donor failed or drains).",
        None,
        one(t.degraded > 0 || t.lost > 0),
    );
    e.gauge(
        "client_can_lose_donors",
        "How many more donor failures every placed unit survives.",
        None,
        one(u64::from(t.can_lose)),
    );
    e.gauge(
        "client_fallback_members",
        "Extent copies kept on the local fallback file instead of a donor.",
        None,
        one(t.on_fallback),
    );
    e.gauge(
        "client_fallback_used",
        "Bytes of the fallback file in use.",
        b,
        one(t.fallback_used_bytes),
    );
    e.gauge(
        "client_parity_log_used",
        "Data bytes of parity log units placed on donors (modes parity and ec; \
         moved home once the device is idle).",
        b,
        one(t.parity_log_used_bytes),
    );
    e.gauge(
        "client_parity_log_live",
        "Bytes of pages whose newest copy is in the parity log.",
        b,
        one(t.parity_log_live_bytes),
    );
    e.counter(
        "client_prefetch_hits",
        "Reads served from the stride prefetcher's cache.",
        None,
        one(t.prefetch_hits),
    );
    e.counter(
        "client_prefetch_wasted",
        "Prefetched pages that left the cache unread (pushed out, written, or read before they came).",
        None,
        one(t.prefetch_wasted),
    );
    e.gauge(
        "client_prefetch_cache",
        "Bytes of prefetched pages waiting to be read.",
        b,
        one(t.prefetch_cache_bytes),
    );
    e.gauge(
        "client_throttled",
        "1 while every donor is at its load bound.",
        None,
        one(t.throttled),
    );
    e.gauge(
        "client_background_active",
        "1 while the background job (rebuild, drain, off_fallback, rebalance) has work left.",
        None,
        per_job(s, |p| p.active.into()),
    );
    e.gauge(
        "client_background_stalled",
        "1 while the background job waits (e.g. no donor has room).",
        None,
        per_job(s, |p| p.stalled.is_some().into()),
    );
    e.gauge(
        "client_background_members_done",
        "Extent copies the job has moved or re-created in this pass.",
        None,
        per_job(s, |p| p.done.into()),
    );
    e.gauge(
        "client_background_members_needed",
        "Extent copies that needed the job when the pass started.",
        None,
        per_job(s, |p| p.total.into()),
    );
    let donor = |f: &dyn Fn(&crate::status::DonorReport) -> Value| -> Vec<(Labels, Value)> {
        s.donors
            .iter()
            .map(|d| (labels([("donor", &d.name)]), f(d)))
            .collect()
    };
    e.gauge(
        "client_donor_extents",
        "Extent copies placed on each donor.",
        None,
        donor(&|d| d.extents_held.into()),
    );
    e.gauge(
        "client_donor_used",
        "Bytes of our export each donor holds.",
        b,
        donor(&|d| d.used_bytes.into()),
    );
    e.gauge(
        "client_donor_frequency",
        "Selection frequency f_i of each donor this epoch.",
        None,
        donor(&|d| d.f.into()),
    );
    e.gauge(
        "client_donor_share",
        "Each donor's share of the device's placed members.",
        Some(BaseUnit::Ratio),
        donor(&|d| d.share.into()),
    );
    e.gauge(
        "client_donor_target_share",
        "The share the rebalancer moves each donor toward (f_i normalised).",
        Some(BaseUnit::Ratio),
        donor(&|d| d.target_share.into()),
    );
    e.counter(
        "client_rebalance_moved",
        "Bytes the rebalancer moved between donors since the device opened.",
        b,
        one(t.rebalance.moved_bytes),
    );
    e.gauge(
        "client_rebalance_paused",
        "1 while the rebalancer waits (off, a rebuild or drain running, a donor silent).",
        None,
        one(t.rebalance.paused.is_some()),
    );
    e.gauge(
        "client_rebalance_busy",
        "1 while the device serves requests, so the rebalancer moves at its busy rate.",
        None,
        one(t.rebalance.busy),
    );
    e.gauge(
        "client_donor_bound",
        "Load bound of each donor's frequency this epoch.",
        None,
        donor(&|d| d.bound.into()),
    );
    e.gauge(
        "client_donor_failed",
        "1 for a donor this client marked failed.",
        None,
        donor(&|d| d.failed.into()),
    );
    e.gauge(
        "client_donor_utilisation",
        "Each donor's reported utilisation by remote requests.",
        Some(BaseUnit::Ratio),
        donor(&|d| d.utilisation.into()),
    );
    e.gauge(
        "client_epoch",
        "Wall time of the latest epoch (donor status polls, heartbeats, \
         frequencies).",
        Some(BaseUnit::Seconds),
        s.epochs
            .last()
            .map(|&(_, us)| vec![(Vec::new(), Value::Float(us as f64 / 1e6))])
            .unwrap_or_default(),
    );
    e.gauge(
        "client_donor_joined_timestamp_seconds",
        "When each donor joined the device's set, by how it joined \
         (attach, added, file, discovered).",
        Some(BaseUnit::Seconds),
        s.donors
            .iter()
            .map(|d| {
                (
                    labels([("donor", &d.name), ("joined", d.joined.as_str())]),
                    Value::Int(d.joined_unix),
                )
            })
            .collect(),
    );
    e.counter(
        "client_donor_retries",
        "Requests sent once more after a fast failure (a reset connection) \
         instead of failing the donor.",
        None,
        donor(&|d| d.retries.into()),
    );
    e.gauge(
        "client_donor_leaving",
        "1 for a donor being removed (its extents are moving off).",
        None,
        donor(&|d| d.leaving.into()),
    );
    e.gauge(
        "client_donor_state",
        "1 for each donor's state as its status endpoint last said \
         (idle, busy, draining, unknown, unreachable).",
        None,
        s.donors
            .iter()
            .map(|d| {
                (
                    labels([("donor", &d.name), ("state", &d.state)]),
                    Value::Int(1),
                )
            })
            .collect(),
    );
    e.counter(
        "client_donor_errors",
        "Request errors and timeouts per donor.",
        None,
        donor(&|d| d.errors.into()),
    );
    e.counter(
        "client_donor_reads",
        "Reads sent to each donor.",
        None,
        donor(&|d| d.reads.into()),
    );
    e.counter(
        "client_donor_writes",
        "Writes sent to each donor.",
        None,
        donor(&|d| d.writes.into()),
    );
    let kind = |f: &dyn Fn(&RequestReport) -> Value| -> Vec<(Labels, Value)> {
        s.requests
            .iter()
            .map(|r| (labels([("op", &r.op)]), f(r)))
            .collect()
    };
    e.counter(
        "client_request",
        "Bytes of requests served, by kind.",
        b,
        kind(&|r| r.bytes.into()),
    );
    e.counter(
        "client_request_errors",
        "Requests that failed, by kind.",
        None,
        kind(&|r| r.errors.into()),
    );
    e.histogram(
        "client_request",
        "Time to serve one request of the kernel, by kind.",
        s.requests
            .iter()
            .map(|r| (labels([("op", &r.op)]), r.histogram()))
            .collect(),
    );
    if let Some(w) = &s.writeback {
        e.gauge(
            "client_writeback_capacity",
            "The serving process's write-back buffer.",
            b,
            one(w.capacity_bytes),
        );
        e.gauge(
            "client_writeback_used",
            "Buffered pages not yet on the donors.",
            b,
            one(w.used_bytes),
        );
        for (name, help, v) in [
            (
                "client_writeback_pages_in",
                "Pages written into the buffer.",
                w.pages_in,
            ),
            (
                "client_writeback_pages_drained",
                "Pages sent from the buffer to the donors.",
                w.pages_drained,
            ),
            (
                "client_writeback_batches",
                "Requests the drained pages took.",
                w.batches,
            ),
            (
                "client_writeback_read_hits",
                "Pages of reads served from the buffer.",
                w.read_hits,
            ),
            (
                "client_writeback_full_waits",
                "Writes that waited for the full buffer.",
                w.full_waits,
            ),
            (
                "client_writeback_drain_failures",
                "Batches the device refused (retried).",
                w.drain_failures,
            ),
        ] {
            e.counter(name, help, None, one(v));
        }
    }
    e.histogram(
        "request_stage",
        "Time a request of the kernel spends in each stage inside the serving process, by kind (read, write, other; drain: the write-back buffer's batches).",
        s.stages
            .iter()
            .map(|r| (labels([("stage", &r.stage), ("op", &r.op)]), r.histogram()))
            .collect(),
    );
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{DonorReport, Totals};

    #[test]
    fn families_carry_the_status() {
        let s = ClientStatus {
            client_id: "c1".into(),
            mode: "mirror".into(),
            code: "1+1".into(),
            donors: vec![DonorReport {
                name: "d1".into(),
                state: "unreachable".into(),
                failed: true,
                extents_held: 3,
                f: 0.5,
                errors: 2,
                share: 0.75,
                target_share: 0.5,
                ..Default::default()
            }],
            totals: Totals {
                degraded: 4,
                parity_log_used_bytes: 1 << 20,
                parity_log_live_bytes: 8192,
                rebuild: Progress {
                    done: 1,
                    total: 4,
                    active: true,
                    stalled: Some("no room".into()),
                },
                rebalance: crate::status::RebalanceReport {
                    moved_bytes: 3 << 20,
                    ..Default::default()
                },
                ..Default::default()
            },
            ..Default::default()
        };
        let stats = RequestStats::default();
        stats.record(RequestKind::Write, 4096, Duration::from_micros(50), true);
        stats.record(RequestKind::Write, 4096, Duration::from_micros(50), false);
        let s = ClientStatus {
            requests: stats.reports(),
            ..s
        };
        let fe = FrontendInfo {
            frontend: "fuse".into(),
            transport: Some("fuse".into()),
            fallback: Some("no io_uring".into()),
        };
        let text = exposition(&s, &fe).prometheus_text();
        for want in [
            "netpager_client_info{client=\"c1\",mode=\"mirror\",code=\"1+1\"} 1\n",
            "netpager_client_frontend{frontend=\"fuse\",transport=\"fuse\"} 1\n",
            "netpager_client_frontend_fallback 1\n",
            "netpager_client_degraded 1\n",
            "netpager_client_degraded_units 4\n",
            "netpager_client_parity_log_used_bytes 1048576\n",
            "netpager_client_parity_log_live_bytes 8192\n",
            "netpager_client_background_active{activity=\"rebuild\"} 1\n",
            "netpager_client_background_stalled{activity=\"rebuild\"} 1\n",
            "netpager_client_background_stalled{activity=\"drain\"} 0\n",
            "netpager_client_background_active{activity=\"off_fallback\"} 0\n",
            "netpager_client_background_members_done{activity=\"rebuild\"} 1\n",
            "netpager_client_donor_extents{donor=\"d1\"} 3\n",
            "netpager_client_donor_frequency{donor=\"d1\"} 0.5\n",
            "netpager_client_donor_share_ratio{donor=\"d1\"} 0.75\n",
            "netpager_client_donor_target_share_ratio{donor=\"d1\"} 0.5\n",
            "netpager_client_rebalance_moved_bytes_total 3145728\n",
            "netpager_client_background_active{activity=\"rebalance\"} 0\n",
            "netpager_client_donor_failed{donor=\"d1\"} 1\n",
            "netpager_client_donor_state{donor=\"d1\",state=\"unreachable\"} 1\n",
            "netpager_client_donor_errors_total{donor=\"d1\"} 2\n",
            "netpager_client_request_bytes_total{op=\"write\"} 4096\n",
            "netpager_client_request_errors_total{op=\"write\"} 1\n",
            "netpager_client_request_seconds_count{op=\"write\"} 2\n",
            "netpager_client_request_seconds_bucket{le=\"+Inf\",op=\"read\"} 0\n",
        ] {
            assert!(text.contains(want), "{want:?} missing from\n{text}");
        }
    }
}
