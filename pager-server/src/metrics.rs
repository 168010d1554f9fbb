//! The donor's `/metrics` families (`metrics=ADDR:PORT`), rendered from
//! the status it publishes and its service-time histograms. The HTTP side
//! and the access rule are `netpager_metrics`.

use netpager_metrics::{labels, BaseUnit, Exposition, HistogramSnapshot, Value};
use netpager_proto::{compression_ratio, DonorState, DonorStatus};

use crate::donor::Op;

const STATES: [DonorState; 3] = [DonorState::Idle, DonorState::Busy, DonorState::Draining];

fn one(v: impl Into<Value>) -> Vec<(Vec<(String, String)>, Value)> {
    vec![(vec![], v.into())]
}

/// A ratio sample, or none while nothing takes memory.
fn ratio(
    logical: u64,
    stored: u64,
    l: Vec<(String, String)>,
) -> Vec<(Vec<(String, String)>, Value)> {
    compression_ratio(logical, stored)
        .map(|r| (l, Value::Float(r)))
        .into_iter()
        .collect()
}

/// Every family of one scrape.
pub fn exposition(s: &DonorStatus, service: &[(Op, HistogramSnapshot)]) -> Exposition {
    let mut e = Exposition::new();
    let b = Some(BaseUnit::Bytes);
    e.gauge(
        "donor_info",
        "The donor's name (node-id); always 1.",
        None,
        vec![(labels([("node", &s.node_id)]), Value::Int(1))],
    );
    e.gauge(
        "donor_state",
        "1 for the state the donor is in (idle, busy or draining), 0 for the others.",
        None,
        STATES
            .iter()
            .map(|st| (labels([("state", st.word())]), (s.state() == *st).into()))
            .collect(),
    );
    e.gauge(
        "donor_budget",
        "Cap on donated bytes over all exports.",
        b,
        one(s.budget_bytes),
    );
    e.gauge(
        "donor_used",
        "Bytes of pages held over all exports.",
        b,
        one(s.used_bytes),
    );
    e.gauge(
        "donor_free",
        "Budget left for new pages (0 while draining).",
        b,
        one(s.free_bytes),
    );
    e.gauge(
        "donor_logical",
        "Bytes of the pages held over all exports, as written (zero pages are none).",
        b,
        one(s.logical_bytes),
    );
    e.gauge(
        "donor_compression",
        "Logical bytes held over the memory they take (absent while nothing is held).",
        Some(BaseUnit::Ratio),
        ratio(s.logical_bytes, s.used_bytes, vec![]),
    );
    if !s.recompress.is_empty() {
        e.counter(
            "donor_recompressed_pages",
            "Pages packed again once cold (recompress=zstd or lz4hc), since start.",
            None,
            one(s.recompressed_pages),
        );
        e.counter(
            "donor_recompress_saved",
            "Bytes the recompressor saved when it packed those pages, since start.",
            b,
            one(s.recompress_saved_bytes),
        );
    }
    e.gauge(
        "donor_capacity",
        "Bytes of pages the donor can still take at the ratio it offers (clients' G_i).",
        b,
        one(s.capacity_bytes),
    );
    e.gauge(
        "donor_reserve",
        "Free memory kept for the node; below it the donor drains.",
        b,
        one(s.reserve_bytes),
    );
    e.gauge(
        "donor_mem_available",
        "MemAvailable of the node at the last look.",
        b,
        one(s.mem_available_bytes),
    );
    e.gauge(
        "donor_export_used",
        "Bytes of pages held per export (client).",
        b,
        s.exports
            .iter()
            .map(|x| (labels([("export", &x.name)]), Value::Int(x.used_bytes)))
            .collect(),
    );
    e.gauge(
        "donor_export_logical",
        "Bytes of the pages held per export, as written.",
        b,
        s.exports
            .iter()
            .map(|x| (labels([("export", &x.name)]), Value::Int(x.logical_bytes)))
            .collect(),
    );
    e.gauge(
        "donor_export_compression",
        "Logical bytes per export over the memory its pages take.",
        Some(BaseUnit::Ratio),
        s.exports
            .iter()
            .flat_map(|x| ratio(x.logical_bytes, x.used_bytes, labels([("export", &x.name)])))
            .collect(),
    );
    e.gauge(
        "donor_export_size",
        "Size of each export.",
        b,
        s.exports
            .iter()
            .map(|x| (labels([("export", &x.name)]), Value::Int(x.size_bytes)))
            .collect(),
    );
    e.gauge(
        "donor_export_shut",
        "1 when a request panicked in the export and it answers EIO to everything.",
        None,
        s.exports
            .iter()
            .map(|x| {
                let shut = !x.broken.is_empty();
                (labels([("export", &x.name)]), Value::Int(u64::from(shut)))
            })
            .collect(),
    );
    e.gauge(
        "donor_page_age",
        "Age of the x-th oldest page held (age-x=), 0 with fewer pages.",
        Some(BaseUnit::Seconds),
        vec![(
            labels([("x", &s.age_x.to_string())]),
            Value::Float(s.age_x_ms as f64 / 1000.0),
        )],
    );
    e.gauge(
        "donor_utilisation",
        "Share of the node's CPU time spent serving remote requests over the window.",
        Some(BaseUnit::Ratio),
        one(s.utilisation),
    );
    e.gauge(
        "donor_utilisation_allowed",
        "The utilisation remote requests may use (u-star=).",
        Some(BaseUnit::Ratio),
        one(s.u_star),
    );
    e.counter("donor_reads", "Read requests served.", None, one(s.reads));
    e.counter(
        "donor_writes",
        "Write requests served.",
        None,
        one(s.writes),
    );
    e.counter("donor_trims", "Trim requests served.", None, one(s.trims));
    e.counter("donor_zeroes", "Zero requests served.", None, one(s.zeroes));
    e.counter("donor_read", "Bytes read by clients.", b, one(s.bytes_read));
    e.counter(
        "donor_written",
        "Bytes written by clients.",
        b,
        one(s.bytes_written),
    );
    e.counter(
        "donor_enospc_refusals",
        "Writes refused for lack of budget (ENOSPC).",
        None,
        one(s.enospc),
    );
    e.counter(
        "donor_uptime",
        "Time since the donor started.",
        Some(BaseUnit::Seconds),
        one(s.uptime_ms as f64 / 1000.0),
    );
    e.histogram(
        "donor_service",
        "Time to serve one request, per kind of request.",
        service
            .iter()
            .map(|(op, h)| (labels([("op", op.word())]), h.clone()))
            .collect(),
    );
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use netpager_metrics::AtomicHistogram;
    use netpager_proto::ExportUsage;
    use std::time::Duration;

    #[test]
    fn every_family_renders_with_its_value() {
        let s = DonorStatus {
            node_id: "d1".into(),
            state: DonorState::Draining as i32,
            budget_bytes: 1 << 30,
            used_bytes: 8192,
            logical_bytes: 16384,
            capacity_bytes: 4096,
            exports: vec![ExportUsage {
                name: "c1".into(),
                size_bytes: 1 << 20,
                used_bytes: 8192,
                clients: 1,
                logical_bytes: 3 * 8192,
                ..Default::default()
            }],
            age_x: 64,
            age_x_ms: 1500,
            utilisation: 0.25,
            reads: 3,
            bytes_written: 4096,
            enospc: 2,
            recompress: "zstd".into(),
            recompressed_pages: 5,
            recompress_saved_bytes: 7000,
            ..Default::default()
        };
        let h = AtomicHistogram::new();
        h.observe(Duration::from_micros(30));
        let text = exposition(&s, &[(Op::Read, h.snapshot())]).prometheus_text();
        let off = exposition(&DonorStatus::default(), &[]).prometheus_text();
        assert!(!off.contains("recompress"), "no recompressor, no series");
        for want in [
            "netpager_donor_info{node=\"d1\"} 1\n",
            "netpager_donor_state{state=\"idle\"} 0\n",
            "netpager_donor_state{state=\"draining\"} 1\n",
            "netpager_donor_budget_bytes 1073741824\n",
            "netpager_donor_used_bytes 8192\n",
            "netpager_donor_export_used_bytes{export=\"c1\"} 8192\n",
            "netpager_donor_export_logical_bytes{export=\"c1\"} 24576\n",
            "netpager_donor_export_compression_ratio{export=\"c1\"} 3.0\n",
            "netpager_donor_logical_bytes 16384\n",
            "netpager_donor_compression_ratio 2.0\n",
            "netpager_donor_capacity_bytes 4096\n",
            "netpager_donor_page_age_seconds{x=\"64\"} 1.5\n",
            "netpager_donor_utilisation_ratio 0.25\n",
            "netpager_donor_reads_total 3\n",
            "netpager_donor_written_bytes_total 4096\n",
            "netpager_donor_enospc_refusals_total 2\n",
            "netpager_donor_recompressed_pages_total 5\n",
            "netpager_donor_recompress_saved_bytes_total 7000\n",
            "netpager_donor_service_seconds_bucket{le=\"0.00004\",op=\"read\"} 1\n",
            "netpager_donor_service_seconds_count{op=\"read\"} 1\n",
        ] {
            assert!(text.contains(want), "{want:?} missing from\n{text}");
        }
    }
}
