use super::*;

#[test]
fn sizes_follow_nbdkit_syntax() {
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("1K"), Ok(1024));
    assert_eq!(parse_size("64m"), Ok(64 << 20));
    assert_eq!(parse_size("1G"), Ok(1 << 30));
    assert_eq!(parse_size("2s"), Ok(1024));
    assert_eq!(parse_size("7b"), Ok(7));
    assert_eq!(
        parse_size("8E"),
        Err("size \"8E\" overflows 2^63-1 bytes".into())
    );
    assert_eq!(parse_size("1MiB"), Ok(1 << 20));
    assert!(parse_size("").is_err());
    assert!(parse_size("-1").unwrap_err().contains("negative"));
    assert!(parse_size("1x").unwrap_err().contains("\"x\""));
    assert!(parse_size("G").is_err());
}

#[test]
fn every_parameter_is_parsed() {
    let mut c = Config::default();
    for (k, v) in [
        ("size", "64M"),
        ("budget", "512M"),
        ("reserve", "10%"),
        ("mlock", "off"),
        ("status", "127.0.0.2:10900"),
        ("metrics", "127.0.0.2:10901"),
        ("node-id", "d1"),
        ("age-x", "8"),
        ("u-star", "0.25"),
        ("window", "2.5"),
        ("busy-load", "0.8"),
        ("poll-ms", "50"),
        ("meminfo", "/tmp/fake"),
        ("psk", "/etc/netpager/lab.psk"),
        ("export-secret", "/etc/netpager/export.secret"),
        ("insecure", "yes"),
        ("announce", "on"),
        ("dns-server", "127.0.0.1:5353"),
        ("dns-zone", "lab.example"),
        ("dns-key", "/etc/netpager/dns.key"),
        ("dns-ttl", "30"),
        ("dns-lease", "90"),
        ("dns-prune", "false"),
        ("compress", "zstd"),
        ("recompress", "off"),
        ("recompress-idle", "5"),
        ("recompress-rate", "64M"),
    ] {
        c.set(k, v).unwrap();
    }
    assert_eq!(c.size, 64 << 20);
    assert_eq!(c.budget, Amount::Bytes(512 << 20));
    assert_eq!(c.reserve, Amount::PercentOfMemTotal(10.0));
    assert!(!c.mlock);
    assert_eq!(c.status.as_deref(), Some("127.0.0.2:10900"));
    assert_eq!(c.metrics.as_deref(), Some("127.0.0.2:10901"));
    assert_eq!(c.node_id.as_deref(), Some("d1"));
    assert_eq!(c.age_x, 8);
    assert_eq!(c.u_star, 0.25);
    assert_eq!(c.window, Duration::from_millis(2500));
    assert_eq!(c.busy_load, 0.8);
    assert_eq!(c.poll, Duration::from_millis(50));
    assert_eq!(c.meminfo, PathBuf::from("/tmp/fake"));
    assert_eq!(c.psk, Some(PathBuf::from("/etc/netpager/lab.psk")));
    assert_eq!(
        c.export_secret,
        Some(PathBuf::from("/etc/netpager/export.secret"))
    );
    assert!(c.insecure);
    assert_eq!(c.announce, Announce::Mdns);
    assert_eq!(c.dns_server.as_deref(), Some("127.0.0.1:5353"));
    assert_eq!(c.dns_zone.as_deref(), Some("lab.example"));
    assert_eq!(c.dns_key, Some(PathBuf::from("/etc/netpager/dns.key")));
    assert_eq!(c.dns_ttl, 30);
    assert_eq!(c.dns_lease, Some(90));
    assert!(!c.dns_prune);
    c.set("announce", "dns").unwrap();
    assert_eq!(c.announce, Announce::Dns);
    assert_eq!(c.compress, Compress::Zstd);
    assert_eq!(c.recompress, Some(Recompress::Off));
    assert_eq!(c.recompress_idle, Duration::from_secs(5));
    assert_eq!(c.recompress_rate, 64 << 20);
}

#[test]
fn recompress_is_on_with_lz4_only() {
    let with = |compress: &str, recompress: Option<&str>| {
        let mut c = Config::default();
        c.set("compress", compress).unwrap();
        if let Some(r) = recompress {
            c.set("recompress", r).unwrap();
        }
        c.recompressor()
    };
    assert_eq!(with("lz4", None), Ok(DEFAULT_RECOMPRESS));
    assert_ne!(DEFAULT_RECOMPRESS, Recompress::Off);
    assert_eq!(with("lz4", Some("off")), Ok(Recompress::Off));
    assert_eq!(with("lz4", Some("zstd")), Ok(Recompress::Zstd));
    assert_eq!(with("lz4", Some("lz4hc")), Ok(Recompress::Lz4hc));
    assert_eq!(with("zstd", None), Ok(Recompress::Off));
    assert_eq!(with("off", None), Ok(Recompress::Off));
    assert_eq!(with("off", Some("off")), Ok(Recompress::Off));
    let e = with("zstd", Some("zstd")).unwrap_err();
    assert!(
        e.contains("needs compress=lz4") && e.contains("already"),
        "{e}"
    );
    let e = with("off", Some("lz4hc")).unwrap_err();
    assert!(
        e.contains("recompress=lz4hc") && e.contains("keeps pages raw"),
        "{e}"
    );
}

#[test]
fn bad_parameters_name_key_and_reason() {
    let mut c = Config::default();
    let cases = [
        ("size", "0", "at least 1 byte"),
        ("size", "12X", "unknown unit"),
        ("budget", "150%", "at most 100"),
        ("budget", "x%", "N% with N a number"),
        ("reserve", "-5M", "negative"),
        ("mlock", "maybe", "true/false"),
        ("status", "10900", "HOST:PORT"),
        ("status", "127.0.0.1:http", "not a number"),
        ("status", ":80", "no host"),
        ("metrics", "9100", "HOST:PORT"),
        ("node-id", "a b", "spaces"),
        ("age-x", "0", "between 1"),
        ("u-star", "1.5", "between 0 and 1"),
        ("u-star", "NaN", "between"),
        ("window", "0", "between"),
        ("poll-ms", "5", "between 10"),
        ("meminfo", "", "file path"),
        ("psk", "", "file path"),
        ("export-secret", "", "file path"),
        ("insecure", "sometimes", "true/false"),
        ("announce", "loudly", "true/false"),
        ("dns-server", "dns.lab", "ADDR or ADDR:PORT"),
        ("dns-zone", "a..b", "empty label"),
        ("dns-key", "", "file path"),
        ("dns-ttl", "0", "1 to 86400"),
        ("dns-lease", "86401", "1 to 86400"),
        ("dns-lease", "soon", "1 to 86400"),
        ("dns-prune", "maybe", "true/false"),
        ("compress", "gzip", "lz4, zstd or off"),
        ("recompress", "lz4", "zstd, lz4hc or off"),
        ("recompress-idle", "soon", "whole number"),
        ("recompress-idle", "86401", "0 to 86400"),
        ("recompress-rate", "0", "4K to 1T"),
        ("recompress-rate", "fast", "not a size"),
    ];
    for (k, v, why) in cases {
        let e = c.set(k, v).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(k) && msg.contains(why), "{k}={v}: {msg}");
    }
    assert_eq!(
        c,
        Config::default(),
        "a refused value must not change the config"
    );
    assert_eq!(
        c.set("sise", "1G"),
        Err(ConfigError::UnknownKey { key: "sise".into() })
    );
}

#[test]
fn amounts_resolve_against_mem_total() {
    assert_eq!(Amount::PercentOfMemTotal(50.0).resolve(1 << 30), 1 << 29);
    assert_eq!(Amount::Bytes(4096).resolve(1 << 30), 4096);
    assert_eq!(whole_pages(4096 * 3 + 100), 3);
}

#[test]
fn export_names_and_sizes() {
    let spec = |n: &str| parse_export_name(n).unwrap();
    assert_eq!(
        spec(""),
        ExportSpec {
            name: "default".into(),
            size: None
        }
    );
    assert_eq!(
        spec("client-a@4G"),
        ExportSpec {
            name: "client-a".into(),
            size: Some(4 << 30)
        }
    );
    assert_eq!(
        spec("@1M"),
        ExportSpec {
            name: "default".into(),
            size: Some(1 << 20)
        }
    );
    assert_eq!(
        spec("node_7.swap"),
        ExportSpec {
            name: "node_7.swap".into(),
            size: None
        }
    );
    let why = |n: &str| parse_export_name(n).unwrap_err().to_string();
    assert_eq!(spec("a/dev-1@1M").name, "a/dev-1");
    assert_eq!(spec("/d1").name, "default/d1");
    assert!(why("a/").contains("device must start"));
    assert!(why("a/b/c").contains("'/' not allowed in the device"));
    assert!(why("a:b").contains("':' not allowed in the name"));
    assert!(why("-a").contains("start with a letter"));
    assert!(why(&"a".repeat(65)).contains("at most 64"));
    assert!(why("a@").contains("size after '@'"));
    assert!(why("a@0").contains("at least 1 byte"));
    assert!(why("a@1G@2G").contains("size after '@'"));
    assert!(why("é").contains("not allowed"));
}

#[test]
fn sessions_ride_on_device_exports() {
    let req = |n: &str| parse_requested(n).unwrap();
    let round = |session, conn| Some(crate::session::Round { session, conn });
    assert_eq!(
        req("c1/d9:42@64M"),
        Requested {
            spec: ExportSpec {
                name: "c1/d9".into(),
                size: Some(64 << 20)
            },
            session: round(42, 0)
        }
    );
    assert_eq!(req("c1/d9:42.7@64M").session, round(42, 7));
    assert_eq!(req("c1/d9").session, None);
    assert_eq!(req("c1@1M").spec.name, "c1");
    let why = |n: &str| parse_requested(n).unwrap_err().to_string();
    assert!(why("c1/d9:x@1M").contains("session after ':' must be SESSION"));
    assert!(why("c1/d9:-1").contains("numbers"));
    assert!(why("c1/d9:4.x").contains("SESSION.CONN"));
    // A session belongs to a device's export; the error quotes what was asked.
    let e = why("c1:3");
    assert!(
        e.contains("\"c1:3\"") && e.contains("':' not allowed"),
        "{e}"
    );
}
