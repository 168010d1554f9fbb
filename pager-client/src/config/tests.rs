//! Saving, loading and checking configurations.

use super::*;

fn sample() -> DeviceConfig {
    let mut c = DeviceConfig::new("busy1", 64 << 20, Mode::Parity { width: 3 })
        .with_donor(DonorConfig::new("d1", "127.0.0.2:10809").with_status("127.0.0.2:7000"))
        .with_donor(DonorConfig::new("d2", "127.0.0.3:10809"))
        .with_donor(DonorConfig::new("d3", "127.0.0.4:10809").with_tls("/etc/psk", None));
    c.fallback = Some(FallbackConfig {
        path: "/var/tmp/fb".into(),
        size: ByteSize(16 << 20),
    });
    c.metrics = Some(MetricsConfig {
        listen: "127.0.0.1:9102".into(),
        psk: Some("/etc/psk".into()),
        insecure: false,
    });
    c
}

#[test]
fn save_and_load_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(FILE_NAME);
    let c = sample();
    c.save(&p).unwrap();
    assert_eq!(DeviceConfig::load(&p).unwrap(), c);
}

#[test]
fn hand_written_file_with_suffixes_and_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(FILE_NAME);
    std::fs::write(
        &p,
        r#"
client_id = "busy1"
size = "256M"
mode = { kind = "disk", path = "/var/tmp/wt.img" }
[[donors]]
name = "a"
address = "127.0.0.2:10809"
"#,
    )
    .unwrap();
    let c = DeviceConfig::load(&p).unwrap();
    assert_eq!(c.size.0, 256 << 20);
    assert_eq!(c.extent_size.0, 1 << 20);
    assert_eq!(
        c.mode,
        Mode::Disk {
            path: "/var/tmp/wt.img".into(),
            queue: ByteSize(16 << 20)
        }
    );
    assert_eq!(c.policy.b, policy::DEFAULT_B);
    // A file without a device id (attached before ids existed) keeps its
    // export name.
    assert_eq!(c.device_id, None);
    assert_eq!(
        c.export_name(&c.donors[0], 7),
        format!("busy1@{}", 257u64 << 20)
    );
    assert_eq!(c.store_name(&c.donors[0]), "busy1");
}

#[test]
fn a_device_asks_for_its_own_export_with_its_session() {
    let mut c = DeviceConfig::new("busy1", 64 << 20, Mode::None)
        .with_donor(DonorConfig::new("a", "127.0.0.2:10809"))
        .with_donor(DonorConfig::new("b", "127.0.0.3:10809").with_export("busy1~00ff"))
        .with_donor(DonorConfig::new("c", "127.0.0.4:10809").with_export("x@64M"));
    let dev = c.device_id.clone().expect("a new device has an id");
    assert_eq!(dev.len(), 16);
    assert_ne!(
        DeviceConfig::new("busy1", 64 << 20, Mode::None).device_id,
        c.device_id,
        "two devices of one client"
    );
    assert_eq!(
        c.export_name(&c.donors[0], 3),
        format!("busy1/{dev}:3@{}", 65u64 << 20)
    );
    assert_eq!(
        c.export_name(&c.donors[1], 3),
        format!("busy1~00ff/{dev}:3")
    );
    assert_eq!(c.export_name(&c.donors[2], 4), format!("x/{dev}:4@64M"));
    assert_eq!(c.store_name(&c.donors[1]), format!("busy1/{dev}"));
    assert_eq!(c.store_name(&c.donors[2]), format!("x/{dev}"));
    c.device_id = Some("a b".into());
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("device_id"), "{e}");
}

#[test]
fn errors_name_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(FILE_NAME);
    let mut c = sample();
    c.donors.truncate(2);
    let e = c.save(&p).unwrap_err().to_string();
    assert!(
        e.contains("device.toml") && e.contains("`donors`") && e.contains("width 3"),
        "{e}"
    );

    let mut c = sample();
    c.extent_size = ByteSize(3 << 12);
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("`extent_size`"));

    let mut c = sample();
    c.donors[1].name = "d1".into();
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("`donors[1].name`"));

    let mut c = sample();
    c.fallback.as_mut().unwrap().path = "fb.img".into();
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("`fallback.path`"));

    std::fs::write(&p, "client_id = \"x\"\nsize = \"12Q\"\n").unwrap();
    let e = DeviceConfig::load(&p).unwrap_err().to_string();
    assert!(e.contains("device.toml") && e.contains("\"12Q\""), "{e}");
}

#[test]
fn parity_stripes_span_at_most_one_mib() {
    let ext = |mode: Mode| default_extent_size(&mode).0;
    for m in [Mode::None, Mode::Mirror] {
        assert_eq!(ext(m), 1 << 20);
    }
    for (width, want) in [
        (3, 512 << 10),
        (4, 256 << 10),
        (5, 256 << 10),
        (9, 128 << 10),
        (32, 64 << 10),
    ] {
        assert_eq!(ext(Mode::Parity { width }), want, "width {width}");
    }
    for width in 3..=17 {
        let e = ext(Mode::Parity { width });
        assert!(
            e.is_power_of_two() && (u64::from(width) - 1) * e <= 1 << 20,
            "width {width}"
        );
        assert!(
            (u64::from(width) - 1) * 2 * e > 1 << 20,
            "width {width}: not the largest"
        );
    }
    // New devices get it (a device.toml without the field still means
    // 1 MiB: hand_written_file_with_suffixes_and_defaults).
    assert_eq!(
        DeviceConfig::new("c", 64 << 20, Mode::Parity { width: 3 })
            .extent_size
            .0,
        512 << 10
    );
}

#[test]
fn mirror_needs_two_donors() {
    let c = DeviceConfig::new("c", 1 << 20, Mode::Mirror).with_donor(DonorConfig::new("a", "h:1"));
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("mirror needs at least 2"));
}

#[test]
fn sizes_in_toml() {
    #[derive(Deserialize)]
    struct T {
        s: ByteSize,
    }
    let t: T = toml::from_str("s = \"1GiB\"").unwrap();
    assert_eq!(t.s, ByteSize(1 << 30));
    let e = toml::from_str::<T>("s = \"1Q\"").err().unwrap().to_string();
    assert!(e.contains("\"1Q\""), "{e}");
}

#[test]
fn discovery_settings_round_trip_and_bad_ones_name_their_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(FILE_NAME);
    let mut c = sample();
    c.discover = true;
    c.trust_network = vec!["10.213.47.0/24".parse().unwrap()];
    c.discover_domain = vec!["lab.example.org".into()];
    c.dns_server = Some("10.0.0.53:5353".into());
    c.discover_export = Some("busy1~00ff".into());
    c.save(&p).unwrap();
    assert_eq!(DeviceConfig::load(&p).unwrap(), c);

    let mut bad = c.clone();
    bad.discover_domain = vec!["lab..org".into()];
    let e = bad.validate().unwrap_err().to_string();
    assert!(
        e.contains("`discover_domain`") && e.contains("empty label"),
        "{e}"
    );
    let mut bad = c.clone();
    bad.dns_server = Some("dns.lab".into());
    let e = bad.validate().unwrap_err().to_string();
    assert!(
        e.contains("`dns_server`") && e.contains("ADDR or ADDR:PORT"),
        "{e}"
    );
    let mut bad = c.clone();
    bad.discover_export = Some("busy1/dev".into());
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("`discover_export`"), "{e}");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("10.213.47.0/24", "10.213.47.5/24");
    std::fs::write(&p, text).unwrap();
    let e = DeviceConfig::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("device.toml") && e.contains("host bits are set"),
        "{e}"
    );
}
