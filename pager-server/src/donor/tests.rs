use super::*;
use crate::config::{Amount, Compress, ExportSpec};
use netpager_proto::v1::{DrainCommand, StatusQuery};

const MIB: u64 = 1 << 20;

fn quiet(_: &str) {}
const LOG: Logger = Logger {
    debug: quiet,
    error: quiet,
};

fn donor(avail_mib: u64) -> (Donor, Instant) {
    donor_with(avail_mib, Compress::Off)
}

fn donor_with(avail_mib: u64, compress: Compress) -> (Donor, Instant) {
    let cfg = Config {
        budget: Amount::Bytes(64 * 4096 + 100),
        reserve: Amount::PercentOfMemTotal(10.0),
        age_x: 2,
        u_star: 0.4,
        compress,
        ..Config::default()
    };
    let mem = MemInfo {
        total: 1000 * MIB,
        available: avail_mib * MIB,
    };
    let s = Settings::resolve(&cfg, mem, "host1", 2);
    let t0 = Instant::now();
    (Donor::new(s, Observation { mem, load1: 0.0 }, t0, LOG), t0)
}

#[test]
fn settings_resolve_percentages_and_hostname() {
    let (d, _) = donor(500);
    let s = d.settings();
    assert_eq!(s.node_id, "host1");
    assert_eq!(
        s.budget_bytes,
        64 * 4096,
        "budget rounds down to whole pages"
    );
    assert_eq!(s.reserve_bytes, 100 * MIB);
    assert!(
        describe(s).contains("budget 256 KiB, reserve 100 MiB"),
        "{}",
        describe(s)
    );
}

#[test]
fn a_budget_above_the_node_memory_is_refused() {
    let (d, _) = donor(500);
    let mem = MemInfo {
        total: 1000 * MIB,
        available: 500 * MIB,
    };
    assert_eq!(d.settings().check_budget(&mem), Ok(()));
    let mut s = d.settings().clone();
    s.budget_bytes = 1 << 40;
    let e = s.check_budget(&mem).unwrap_err();
    assert!(
        e.contains("budget=1 TiB") && e.contains("MemTotal 1000 MiB"),
        "{e}"
    );
    s.budget_bytes = 0;
    assert!(s.check_budget(&mem).unwrap_err().contains("less than one"));
}

#[test]
fn status_counts_the_connections_of_each_export() {
    let (d, t0) = donor(500);
    let d = Arc::new(d);
    for name in ["held", "left"] {
        let spec = ExportSpec {
            name: name.into(),
            size: Some(MIB),
        };
        d.pool().open(&spec, MIB).unwrap();
    }
    let (a, b) = (d.connected("held"), d.connected("held"));
    let clients = |d: &Donor| -> Vec<(String, u32)> {
        d.status(t0)
            .exports
            .into_iter()
            .map(|e| (e.name, e.clients))
            .collect()
    };
    assert_eq!(clients(&d), [("held".into(), 2), ("left".into(), 0)]);
    drop(a);
    assert_eq!(clients(&d)[0], ("held".into(), 1));
    drop(b);
    assert_eq!(clients(&d)[0], ("held".into(), 0));
}

#[test]
fn status_fills_every_field() {
    let (d, t0) = donor(500);
    let e = d
        .pool()
        .open(
            &ExportSpec {
                name: "a".into(),
                size: Some(MIB),
            },
            MIB,
        )
        .unwrap();
    let w = t0 + Duration::from_millis(250);
    e.write(&[1; 3 * 4096], 0, d.tick(w)).unwrap();
    let took = Duration::from_millis(100);
    d.record(Op::Write, 3 * 4096, took, Ok(()));
    let err = e.write(&[1; 4096 * 62], 3 * 4096, d.tick(w)).unwrap_err();
    d.record(Op::Write, 4096 * 62, took, Err(&err));
    d.record(Op::Read, 4096, took, Ok(()));
    d.record(Op::Trim, 0, took, Ok(()));
    d.record(Op::Zero, 0, took, Ok(()));
    let s = d.status(t0 + Duration::from_millis(1250));
    assert_eq!(s.node_id, "host1");
    assert_eq!(s.state(), DonorState::Idle);
    assert_eq!(
        (s.budget_bytes, s.used_bytes, s.free_bytes),
        (64 * 4096, 3 * 4096, 61 * 4096)
    );
    assert_eq!(
        s.exports,
        vec![ExportUsage {
            name: "a".into(),
            size_bytes: MIB,
            used_bytes: 3 * 4096,
            clients: 0,
            logical_bytes: 3 * 4096,
            ..Default::default()
        }]
    );
    assert_eq!(
        (s.age_x, s.age_x_ms),
        (2, 1000),
        "pages written at tick 2 are 10 ticks old at 1.25 s"
    );
    assert_eq!(
        (s.reads, s.writes, s.bytes_read, s.bytes_written),
        (1, 2, 4096, 3 * 4096)
    );
    assert_eq!((s.trims, s.zeroes, s.enospc), (1, 1, 1));
    assert_eq!(
        (s.reserve_bytes, s.mem_available_bytes, s.page_size),
        (100 * MIB, 500 * MIB, 4096)
    );
    assert_eq!(s.uptime_ms, 1250);
    // 5 requests of 100 ms in 1.25 s on 2 CPUs.
    assert!((s.utilisation - 0.2).abs() < 1e-9, "{}", s.utilisation);
    assert_eq!(s.u_star, 0.4);
    assert!((s.u_unused - 0.2).abs() < 1e-9, "{}", s.u_unused);
    assert!(
        (s.mean_service_us - 100_000.0).abs() < 1e-6,
        "{}",
        s.mean_service_us
    );
    assert!(
        s.state_reason.contains("within busy-load"),
        "{}",
        s.state_reason
    );
    assert_eq!(
        (
            s.logical_bytes,
            s.offered_ratio,
            s.capacity_bytes,
            s.compress.as_str()
        ),
        (3 * 4096, 1.0, 61 * 4096, "off")
    );
}

#[test]
fn status_offers_capacity_at_the_ratio_seen() {
    let (d, t0) = donor_with(500, Compress::Lz4);
    let e = d
        .pool()
        .open(
            &ExportSpec {
                name: "a".into(),
                size: Some(MIB),
            },
            MIB,
        )
        .unwrap();
    // Text pages: each packs into well under a third of a page.
    let text: Vec<u8> = (0..16 * 4096)
        .map(|i| b"donor pages "[i % 12] ^ (i / 4096) as u8)
        .collect();
    e.write(&text, 0, 0).unwrap();
    let s = d.status(t0);
    assert_eq!(s.compress, "lz4");
    assert_eq!(s.logical_bytes, 16 * 4096);
    assert!(s.used_bytes < 16 * 4096 / 3, "{}", s.used_bytes);
    assert_eq!(s.exports[0].logical_bytes, 16 * 4096);
    assert!(s.exports[0].used_bytes <= s.used_bytes);
    assert_eq!(s.offered_ratio, crate::ratio::MAX_OFFER_RATIO, "capped");
    assert_eq!(
        s.capacity_bytes,
        s.free_bytes * 4,
        "free bytes at the ratio offered"
    );
    // A run of noise brings the offer down to what it holds, then to
    // raw once the recent ratio sees it.
    let mut x = 1u64;
    let noise: Vec<u8> = (0..40 * 4096)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect();
    e.write(&noise, 16 * 4096, 0).unwrap();
    let s = d.status(t0);
    assert!(s.offered_ratio < 1.5, "{}", s.offered_ratio);
    assert!(s.capacity_bytes <= s.free_bytes * 3 / 2);
}

#[test]
fn draining_by_memory_and_by_command() {
    let (d, t0) = donor(500);
    let e = d
        .pool()
        .open(
            &ExportSpec {
                name: "a".into(),
                size: None,
            },
            MIB,
        )
        .unwrap();
    e.write(&[5; 4096], 0, 0).unwrap();
    d.observe(
        MemInfo {
            total: 1000 * MIB,
            available: 50 * MIB,
        },
        0.0,
        t0,
    );
    let s = d.status(t0);
    assert_eq!((s.state(), s.free_bytes), (DonorState::Draining, 0));
    assert_eq!(s.state_reason, "MemAvailable 50 MiB below reserve 100 MiB");
    assert!(matches!(
        e.write(&[1; 1], 4096, 0),
        Err(StoreError::Draining { .. })
    ));
    let mut b = [0u8; 4096];
    e.read(&mut b, 0, 0).unwrap();
    assert_eq!(b, [5; 4096], "draining never drops a stored page");
    d.observe(
        MemInfo {
            total: 1000 * MIB,
            available: 900 * MIB,
        },
        0.0,
        t0,
    );
    assert_eq!(d.status(t0).state(), DonorState::Idle);
    e.write(&[1; 1], 4096, 0).unwrap();

    let req = |body| Request {
        body: Some(body),
        ..Default::default()
    };
    let st = |r: Reply| match r.body {
        Some(reply::Body::Status(s)) => s,
        other => panic!("expected a status, got {other:?}"),
    };
    let s = st(d.handle(req(request::Body::Drain(DrainCommand { drain: true })), t0));
    assert_eq!(
        (s.state(), s.state_reason.as_str()),
        (
            DonorState::Draining,
            "drain requested on the status endpoint"
        )
    );
    d.observe(
        MemInfo {
            total: 1000 * MIB,
            available: 900 * MIB,
        },
        0.0,
        t0,
    );
    assert_eq!(
        st(d.handle(req(request::Body::Status(StatusQuery {})), t0)).state(),
        DonorState::Draining
    );
    let s = st(d.handle(req(request::Body::Drain(DrainCommand { drain: false })), t0));
    assert_eq!(s.state(), DonorState::Idle);
    assert!(matches!(
        d.handle(Request::default(), t0).body,
        Some(reply::Body::Error(_))
    ));
}

#[test]
fn busy_when_loaded() {
    let (d, t0) = donor(500);
    d.observe(
        MemInfo {
            total: 1000 * MIB,
            available: 500 * MIB,
        },
        1.5,
        t0,
    );
    let s = d.status(t0);
    assert_eq!(s.state(), DonorState::Busy);
    assert!(
        s.free_bytes > 0,
        "a busy donor still accepts pages within its budget"
    );
}
