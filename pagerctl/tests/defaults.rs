//! One set of defaults: every port, path and timeout an admin meets in the
//! README, the man pages, the packaged configuration and Ansible's
//! defaults is the one the code defines (`netpager_util::defaults`, the
//! device configuration's defaults, pagerctl's own `--help`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use netpager_util::{defaults as d, HostPort};
use pager_client::config::{DeviceConfig, Mode};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Where an admin reads ports and paths.
const DOCUMENTS: &[&str] = &[
    "README.md",
    "SECURITY.md",
    "pagerctl/pagerctl.1.md",
    "pager-server/pager-server.1.md",
    "client-plugin/pager-client-plugin.1.md",
    "prefetchd/prefetchd.8.md",
    "ansible/README.md",
    "packaging/deb/client/client.conf",
    "packaging/deb/donor/donor.conf",
    "packaging/deb/client/netpager-client.service",
    "packaging/deb/donor/netpager-donor.service",
];

/// Commands of a text: lines joined where they end in a backslash.
fn commands(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut first = 0;
    for (i, line) in text.lines().enumerate() {
        if cur.is_empty() {
            first = i + 1;
        }
        match line.trim_end().strip_suffix('\\') {
            Some(part) => {
                cur.push_str(part);
                cur.push(' ');
            }
            None => {
                cur.push_str(line);
                out.push((first, std::mem::take(&mut cur)));
            }
        }
    }
    out
}

/// The words of a command, without Markdown's and the shell's quoting.
fn words(cmd: &str) -> Vec<String> {
    cmd.split(|c: char| c.is_whitespace() || "`*\"'()|;&".contains(c))
        .filter(|w| !w.is_empty())
        .map(|w| w.trim_end_matches([',', '.', ':']).to_string())
        .collect()
}

/// The port of `HOST:PORT` (a literal one: placeholders are `None`).
fn port(addr: &str) -> Option<u16> {
    let addr = addr.split(['/', ',']).next()?;
    HostPort::parse(addr).ok().map(|hp| hp.port)
}

/// Every port the documents give in a known role that is not the
/// default's, as `FILE:LINE: what`.
fn wrong_ports(file: &str, text: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let mut check = |line: usize, role: &str, addr: &str, want: u16| {
        if let Some(p) = port(addr) {
            if p != want {
                bad.push(format!(
                    "{file}:{line}: {role} {addr}: port {p}, the default is {want}"
                ));
            }
        }
    };
    for (line, cmd) in commands(text) {
        let w = words(&cmd);
        let serves_donor = cmd.contains("pager-server")
            || cmd.contains("libpager_server.so")
            || cmd.contains("NBDKIT_ARGS");
        for (i, word) in w.iter().enumerate() {
            let next = w.get(i + 1).map(String::as_str).unwrap_or("");
            for part in word.split(',') {
                if let Some(a) = part.strip_prefix("status=") {
                    check(line, "status=", a, d::STATUS_PORT);
                }
                if let Some(a) = part.strip_prefix("metrics=") {
                    check(line, "metrics=", a, d::DONOR_METRICS_PORT);
                }
            }
            if let Some(spec) = word.strip_prefix("--donor=") {
                check(line, "--donor", spec, d::NBD_PORT);
            }
            match word.as_str() {
                "--donor" => check(line, "--donor", next, d::NBD_PORT),
                "--port" | "-p" if serves_donor => {
                    check(line, "nbdkit --port", &format!("h:{next}"), d::NBD_PORT)
                }
                "donor-status" | "donor-drain" | "netpager-drain" => {
                    for a in w[i + 1..].iter().take_while(|a| !a.starts_with('#')) {
                        if !a.starts_with('-') && a.contains(':') {
                            check(line, word, a, d::STATUS_PORT);
                        }
                    }
                }
                "--metrics" if cmd.contains("pagerctl attach") => {
                    check(line, "attach --metrics", next, d::CLIENT_METRICS_PORT)
                }
                "--metrics" if cmd.contains("prefetchd") && next.contains(':') => {
                    check(line, "prefetchd --metrics", next, d::PREFETCHD_METRICS_PORT)
                }
                _ => {}
            }
            if let Some(rest) = word.strip_prefix("nbd://") {
                check(line, "nbd://", rest, d::NBD_PORT);
            }
        }
    }
    bad
}

#[test]
fn every_document_gives_the_default_ports() {
    let bad: Vec<String> = DOCUMENTS
        .iter()
        .flat_map(|f| wrong_ports(f, &read(f)))
        .collect();
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn a_wrong_port_is_found() {
    let text = "pagerctl donor-status 127.0.0.2:10900\n\
                nbdkit --port 10811 -i 127.0.0.1 pager-server \\\n    status=127.0.0.1:7070 metrics=127.0.0.1:10811\n\
                pagerctl attach --donor 127.0.0.2:10809,status=127.0.0.2:10810 --metrics 0.0.0.0:10812\n\
                --donor=donor1:10809,status=donor1:10900\n\
                pagerctl donor-drain ADDR:PORT --wait\n";
    let bad = wrong_ports("t", text);
    assert_eq!(bad.len(), 4, "{bad:#?}");
    assert!(
        bad[0].starts_with("t:1: donor-status 127.0.0.2:10900"),
        "{bad:#?}"
    );
    assert!(
        bad.iter().any(|b| b.starts_with("t:2: nbdkit --port")),
        "{bad:#?}"
    );
    assert!(
        bad.iter().any(|b| b.contains("status= 127.0.0.1:7070")),
        "{bad:#?}"
    );
    assert!(
        bad.iter()
            .any(|b| b.starts_with("t:5: status= donor1:10900")),
        "{bad:#?}"
    );
}

#[test]
fn every_document_names_the_default_key_files() {
    let mut bad = Vec::new();
    for f in DOCUMENTS {
        for (line, cmd) in commands(&read(f)) {
            for w in words(&cmd) {
                let Some(at) = w.find("/etc/netpager/") else {
                    continue;
                };
                let path = w[at..].split(['=', ',']).next().unwrap_or_default();
                let want = if path.ends_with(".psk") {
                    d::LAB_KEY_FILE
                } else if path.ends_with(".secret") {
                    d::EXPORT_SECRET_FILE
                } else {
                    continue;
                };
                if path != want {
                    bad.push(format!("{f}:{line}: {path}, the default is {want}"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Ansible's knobs (`group_vars/all.yml`) by name, values as written.
fn ansible_defaults() -> BTreeMap<String, String> {
    read("ansible/group_vars/all.yml")
        .lines()
        .filter(|l| !l.starts_with([' ', '#', '-']))
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.trim().trim_matches('"').to_string()))
        .collect()
}

#[test]
fn ansible_rolls_out_the_defaults() {
    let a = ansible_defaults();
    let etc = &a["netpager_etc_dir"];
    let expand = |v: &str| v.replace("{{ netpager_etc_dir }}", etc);
    let want = [
        ("netpager_donor_port", d::NBD_PORT.to_string()),
        ("netpager_donor_status_port", d::STATUS_PORT.to_string()),
        (
            "netpager_donor_metrics_port",
            d::DONOR_METRICS_PORT.to_string(),
        ),
        (
            "netpager_client_metrics_port",
            d::CLIENT_METRICS_PORT.to_string(),
        ),
        (
            "netpager_prefetchd_metrics_port",
            d::PREFETCHD_METRICS_PORT.to_string(),
        ),
        ("netpager_etc_dir", d::ETC_DIR.to_string()),
        ("netpager_tls_psk_file", d::LAB_KEY_FILE.to_string()),
        (
            "netpager_export_secret_file",
            d::EXPORT_SECRET_FILE.to_string(),
        ),
        ("netpager_state_dir", d::STATE_ROOT.to_string()),
        ("netpager_tls_psk_identity", d::LAB_KEY_IDENTITY.to_string()),
        (
            "netpager_donor_drain_timeout",
            d::DRAIN_TIMEOUT_SECS.to_string(),
        ),
        (
            "netpager_client_b",
            pager_client::policy::DEFAULT_B.to_string(),
        ),
    ];
    for (knob, value) in want {
        assert_eq!(
            expand(&a[knob]),
            value,
            "ansible/group_vars/all.yml: {knob}"
        );
    }
    // Its README's table says the same.
    let readme = read("ansible/README.md");
    let row = readme
        .lines()
        .find(|l| l.starts_with("| `netpager_donor_port` / `netpager_donor_status_port`"))
        .expect("the ports' row");
    assert!(
        row.contains(&format!("`{}` / `{}`", d::NBD_PORT, d::STATUS_PORT)),
        "{row}"
    );
}

/// `pagerctl SUBCOMMAND --help`'s defaults, by option.
fn help_defaults(sub: &[&str]) -> BTreeMap<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_pagerctl"))
        .args(sub)
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut m = BTreeMap::new();
    for l in text.lines() {
        let Some(opt) = l.split_whitespace().find(|w| w.starts_with("--")) else {
            continue;
        };
        if let Some(v) = l
            .split("[default: ")
            .nth(1)
            .and_then(|v| v.split(']').next())
        {
            m.insert(opt.trim_end_matches(',').to_string(), v.to_string());
        }
    }
    m
}

/// The defaults pagerctl(1) states for a subcommand's options, as
/// `(option, value, line)`, from its entries (`**--opt** ...` then `:`
/// text, defaults in the order of the options an entry names) and the
/// prose after an option's entry.
fn page_defaults(section: &str) -> Vec<(String, String, usize)> {
    let page = read("pagerctl/pagerctl.1.md");
    let start = page
        .find(&format!("\n## {section}\n"))
        .expect("the section");
    let end = page[start + 1..]
        .find("\n## ")
        .map_or(page.len(), |e| start + 1 + e);
    let first_line = page[..start].lines().count() + 1;
    let mut out = Vec::new();
    // The options of the current entry, and the defaults found so far.
    let mut opts: Vec<String> = Vec::new();
    let mut found: Vec<(String, usize)> = Vec::new();
    let mut flush = |opts: &[String], found: &mut Vec<(String, usize)>| {
        if opts.len() == 1 || opts.len() == found.len() {
            for (i, (v, line)) in found.drain(..).enumerate() {
                out.push((opts[i.min(opts.len() - 1)].clone(), v, line));
            }
        }
        found.clear();
    };
    for (i, l) in page[start..end].lines().enumerate() {
        if l.starts_with("**--") {
            flush(&opts, &mut found);
            opts = l
                .split("**")
                .filter(|w| w.starts_with("--"))
                .map(str::to_string)
                .collect();
            continue;
        }
        for piece in l.split("default ").skip(1) {
            let v: String = piece
                .trim_start_matches('*')
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
                .collect();
            let v = v.trim_end_matches('.').to_string();
            // Values only: "the default was chosen" is prose.
            if v.starts_with(|c: char| c.is_ascii_digit()) || v == "auto" {
                found.push((v, first_line + i));
            }
        }
    }
    flush(&opts, &mut found);
    out
}

#[test]
fn pagerctl_page_states_the_defaults_the_code_has() {
    let cfg = DeviceConfig::new("c", 1 << 30, Mode::None);
    // Options whose default is the device configuration's.
    let code: BTreeMap<&str, String> = [
        (
            "--connect-timeout",
            (cfg.timeouts.connect_ms / 1000).to_string(),
        ),
        (
            "--request-timeout",
            (cfg.timeouts.request_ms / 1000).to_string(),
        ),
        ("--epoch", (cfg.policy.epoch_ms / 1000).to_string()),
        ("--forget-after", (cfg.forget_after_ms / 1000).to_string()),
        ("--spin-us", cfg.timeouts.spin_us.to_string()),
        ("--b", cfg.policy.b.to_string()),
        ("--prefetch-pages", cfg.prefetch_pages.to_string()),
        (
            "--rebalance-rate",
            format!("{}M", cfg.rebalance_rate.0 >> 20),
        ),
        (
            "--rebalance-busy-rate",
            format!("{}M", cfg.rebalance_busy_rate.0 >> 20),
        ),
        (
            "--rebalance-hot-epochs",
            cfg.rebalance_hot_epochs.to_string(),
        ),
    ]
    .into_iter()
    .collect();
    let mut checked = 0;
    let mut bad = Vec::new();
    for (section, sub) in [
        ("attach", vec!["attach"]),
        ("detach", vec!["detach"]),
        ("top", vec!["top"]),
        ("donor-status", vec!["donor-status"]),
        ("donor-drain", vec!["donor-drain"]),
        ("donor-remove", vec!["donor-remove"]),
    ] {
        let help = help_defaults(&sub);
        for (opt, value, line) in page_defaults(section) {
            let want = help
                .get(&opt)
                .cloned()
                .or_else(|| code.get(opt.as_str()).cloned());
            let Some(want) = want else { continue };
            checked += 1;
            if value != want {
                bad.push(format!(
                    "pagerctl/pagerctl.1.md:{line}: {opt} (default {value}), the code says {want}"
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(checked >= 12, "only {checked} defaults found in the page");
}

#[test]
fn the_device_toml_example_and_the_readme_keep_the_config_defaults() {
    let cfg = DeviceConfig::new("c", 1 << 30, Mode::None);
    let page = read("client-plugin/pager-client-plugin.1.md");
    for (key, want) in [
        ("connect_ms", cfg.timeouts.connect_ms),
        ("request_ms", cfg.timeouts.request_ms),
        ("epoch_ms", cfg.policy.epoch_ms),
        ("spin_us", cfg.timeouts.spin_us),
    ] {
        let line = page
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("{key} in pager-client-plugin.1.md"));
        let got: u64 = line
            .split('=')
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(got, want, "pager-client-plugin.1.md: {line}");
    }
    let readme = read("README.md");
    for (said, want) in [
        (
            format!("`--spin-us US` (default {})", cfg.timeouts.spin_us),
            true,
        ),
        (
            format!(
                "dead for {} minutes (`--forget-after`)",
                cfg.forget_after_ms / 60_000
            ),
            true,
        ),
        (
            format!(
                "`write_intent_quiet_ms` in\n`device.toml`, default {})",
                cfg.write_intent_quiet_ms
            ),
            true,
        ),
    ] {
        assert_eq!(readme.contains(&said), want, "README.md: {said:?}");
    }
}
