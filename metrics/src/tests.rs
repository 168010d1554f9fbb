use super::*;

fn sample() -> Exposition {
    let mut e = Exposition::new();
    e.counter(
        "donor_reads",
        "Read requests served.",
        None,
        vec![(vec![], Value::Int(7))],
    );
    e.gauge(
        "donor_used",
        "Bytes held.",
        Some(BaseUnit::Bytes),
        vec![
            (labels([("export", "a")]), Value::Int(4096)),
            (labels([("export", "b")]), Value::Int(0)),
        ],
    );
    let h = AtomicHistogram::new();
    h.observe(Duration::from_micros(5));
    h.observe(Duration::from_micros(15));
    h.observe(Duration::from_secs(5));
    e.histogram(
        "donor_service",
        "Service time.",
        vec![(labels([("op", "read")]), h.snapshot())],
    );
    e
}

#[test]
fn stage_histograms_start_below_a_microsecond() {
    assert_eq!(STAGE_BOUNDS_NS[0], 250);
    assert_eq!(STAGE_BOUNDS_NS[STAGE_BUCKETS - 1], 250 << 22);
    let h = AtomicHistogram::stages();
    for ns in [100, 250, 300, 5_000, 2_000_000_000] {
        h.observe(Duration::from_nanos(ns));
    }
    let s = h.snapshot();
    assert_eq!(s.buckets.len(), STAGE_BUCKETS + 1);
    assert_eq!(s.buckets[0], (250e-9, 2));
    assert_eq!(s.buckets[1], (500e-9, 3));
    assert_eq!(s.buckets[STAGE_BUCKETS - 1].1, 4);
    assert_eq!(s.buckets[STAGE_BUCKETS], (f64::INFINITY, 5));
}

#[test]
fn histogram_buckets_are_cumulative_and_bounded() {
    assert_eq!(BUCKET_BOUNDS_NS[0], 10_000);
    assert_eq!(BUCKET_BOUNDS_NS[BUCKETS - 1], 10_000 << 17);
    let h = AtomicHistogram::new();
    for us in [1, 10, 11, 100, 2_000_000] {
        h.observe(Duration::from_micros(us));
    }
    let s = h.snapshot();
    assert_eq!(s.count, 5);
    assert_eq!(s.buckets.len(), BUCKETS + 1);
    // le=10µs holds 1 µs and exactly 10 µs; 11 µs is in le=20µs.
    assert_eq!(s.buckets[0], (1e-5, 2));
    assert_eq!(s.buckets[1], (2e-5, 3));
    assert_eq!(s.buckets[BUCKETS - 1].1, 4, "2 s is above every bound");
    assert_eq!(s.buckets[BUCKETS], (f64::INFINITY, 5));
    assert!((s.sum_seconds - 2.000_122).abs() < 1e-9);
    assert_eq!(s.quantile_bound(0.5), Some(2e-5));
    assert_eq!(s.quantile_bound(1.0), Some(f64::INFINITY));
    assert_eq!(AtomicHistogram::new().snapshot().quantile_bound(0.5), None);
}

#[test]
fn families_render_in_both_formats() {
    let e = sample();
    let om = e.openmetrics();
    for want in [
        "# HELP netpager_donor_reads Read requests served.\n",
        "# TYPE netpager_donor_reads counter\n",
        "netpager_donor_reads_total 7\n",
        "# UNIT netpager_donor_used_bytes bytes\n",
        "netpager_donor_used_bytes{export=\"a\"} 4096\n",
        "netpager_donor_service_seconds_bucket{le=\"0.00001\",op=\"read\"} 1\n",
        "netpager_donor_service_seconds_bucket{le=\"0.00002\",op=\"read\"} 2\n",
        "netpager_donor_service_seconds_bucket{le=\"1.31072\",op=\"read\"} 2\n",
        "netpager_donor_service_seconds_bucket{le=\"+Inf\",op=\"read\"} 3\n",
        "netpager_donor_service_seconds_count{op=\"read\"} 3\n",
        "# EOF\n",
    ] {
        assert!(om.contains(want), "{want:?} missing from\n{om}");
    }
    let text = e.prometheus_text();
    for want in [
        "# HELP netpager_donor_reads_total Read requests served.\n",
        "# TYPE netpager_donor_reads_total counter\n",
        "netpager_donor_reads_total 7\n",
        "# TYPE netpager_donor_used_bytes gauge\n",
    ] {
        assert!(text.contains(want), "{want:?} missing from\n{text}");
    }
    assert!(
        !text.contains("# EOF") && !text.contains("# UNIT"),
        "{text}"
    );
}

#[test]
fn request_heads_are_parsed() {
    let r = parse_head(
        "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer  abc \r\n\
         Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
    )
    .unwrap();
    assert_eq!(
        r,
        HttpRequest {
            method: "GET".into(),
            path: "/metrics".into(),
            bearer: Some("abc".into()),
            openmetrics: true,
        }
    );
    let basic = parse_head("GET / HTTP/1.0\r\nauthorization: Basic eDp5").unwrap();
    assert_eq!((basic.bearer, basic.openmetrics), (None, false));
    for bad in [
        "",
        "GET",
        "GET /metrics",
        "GET /metrics SPDY/3",
        "GET / HTTP/1.1 x",
    ] {
        assert_eq!(parse_head(bad), None, "{bad:?}");
    }
}

#[test]
fn answers_check_path_method_and_token() {
    let key_hex = "00112233445566778899aabbccddeeff";
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("lab.psk");
    std::fs::write(&p, format!("lab:{key_hex}\n")).unwrap();
    let key = LabKey::from_psk_file(&p, None).unwrap();
    let req = |m: &str, path: &str, bearer: Option<String>| HttpRequest {
        method: m.into(),
        path: path.into(),
        bearer,
        openmetrics: false,
    };
    let status = |r: Option<&HttpRequest>, k: Option<&LabKey>| answer(r, k, &sample).status;
    assert_eq!(status(None, None), "400 Bad Request");
    assert_eq!(
        status(Some(&req("POST", "/metrics", None)), None),
        "405 Method Not Allowed"
    );
    assert_eq!(status(Some(&req("GET", "/", None)), None), "404 Not Found");
    assert_eq!(status(Some(&req("GET", "/metrics", None)), None), "200 OK");
    let token = key.metrics_token();
    assert_eq!(
        status(Some(&req("GET", "/metrics", None)), Some(&key)),
        "401 Unauthorized"
    );
    let wrong = Some("00".repeat(32));
    assert_eq!(
        status(Some(&req("GET", "/metrics", wrong)), Some(&key)),
        "401 Unauthorized"
    );
    let ok = answer(
        Some(&req("GET", "/metrics", Some(token))),
        Some(&key),
        &sample,
    );
    assert_eq!(ok.status, "200 OK");
    assert!(ok.content_type.contains("version=0.0.4"));
    assert!(ok.body.contains("netpager_donor_reads_total 7"));
}

#[test]
fn network_addresses_need_a_key_or_insecure() {
    let lan: SocketAddr = "10.0.0.1:9100".parse().unwrap();
    let any: SocketAddr = "0.0.0.0:9100".parse().unwrap();
    for a in [lan, any] {
        assert!(matches!(
            check_address("metrics", a, false, false),
            Err(EndpointError::Open { .. })
        ));
        assert!(check_address("metrics", a, true, false).is_ok());
        assert!(check_address("metrics", a, false, true).is_ok());
    }
    for lo in ["127.0.0.2:9100", "[::1]:9100", "[::ffff:127.0.0.1]:9100"] {
        assert!(
            check_address("metrics", lo.parse().unwrap(), false, false).is_ok(),
            "{lo}"
        );
    }
    let msg = check_address("metrics", lan, false, false)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("metrics=10.0.0.1:9100") && msg.contains("insecure=true"),
        "{msg}"
    );
}

#[test]
fn a_bound_endpoint_serves_over_http() {
    let b = Bound::new(&EndpointConfig {
        param: "metrics",
        addr: "127.0.0.1:0".into(),
        key_file: None,
        insecure: false,
    })
    .unwrap();
    let addr = b.local_addr().unwrap();
    b.spawn(sample).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
    assert!(
        got.contains("\r\n\r\n# HELP netpager_donor_reads_total"),
        "{got}"
    );
}
