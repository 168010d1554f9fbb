//! The plugin under a real nbdkit: three `nbdkit memory` donors, the
//! client plugin on a Unix socket, data copied in and out with nbdcopy,
//! holes seen by nbdinfo --map, status.json written, errors mapped to
//! errno. Processes are killed by pid when the guards drop (the shared
//! harness, netpager-test-support).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use netpager_test_support::{built_beside_test, Nbdkit};
use pager_client::config::{DeviceConfig, DonorConfig, Mode};

/// The plugin built alongside this test.
fn plugin_so() -> PathBuf {
    built_beside_test("libpager_client_plugin.so")
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Setup {
    _donors: Vec<Nbdkit>,
    _client: Nbdkit,
    uri: String,
    dir: tempfile::TempDir,
}

fn setup(mode: Mode) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = DeviceConfig::new("plugtest", 32 << 20, mode);
    cfg.mlock = false;
    cfg.extent_size = pager_client::config::ByteSize(256 << 10);
    let donors: Vec<Nbdkit> = (0..3).map(|_| Nbdkit::memory("64M")).collect();
    for (i, d) in donors.iter().enumerate() {
        cfg.donors
            .push(DonorConfig::new(format!("d{i}"), d.addr.clone()));
    }
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    cfg.save(&state.join("device.toml")).unwrap();
    let sock = dir.path().join("sock");
    let so = plugin_so().display().to_string();
    let client = Nbdkit::unix(&sock, &[&so, &format!("state={}", state.display())]);
    Setup {
        _donors: donors,
        _client: client,
        uri: format!("nbd+unix:///?socket={}", sock.display()),
        dir,
    }
}

/// `unit_bytes`: data one placement unit holds in this mode.
fn copy_in_and_out(mode: Mode, unit_bytes: u64) {
    let s = setup(mode);
    let input = s.dir.path().join("in.bin");
    let output = s.dir.path().join("out.bin");
    // 20 MiB of data, then 12 MiB never written.
    let mut data = vec![0u8; 32 << 20];
    let mut x = 0x1234_5678_9abc_def0u64;
    for b in data[..20 << 20].iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(&input, &data).unwrap();
    run("nbdcopy", &[input.to_str().unwrap(), &s.uri]);
    run("nbdcopy", &[&s.uri, output.to_str().unwrap()]);
    assert!(
        std::fs::read(&output).unwrap() == data,
        "data read back differs"
    );
    let map = run("nbdinfo", &["--map", &s.uri]);
    assert!(
        map.contains("hole,zero"),
        "never-written extents are holes:\n{map}"
    );
    let info = run("nbdinfo", &[&s.uri]);
    assert!(
        info.contains("can_multi_conn: true") && info.contains("can_trim: true"),
        "{info}"
    );
    // status.json is rewritten about once a second.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(s.dir.path().join("state/status.json")).unwrap(),
        )
        .unwrap();
        // Whole units at home, plus pages in the parity log.
        let t = &status["totals"];
        let held = t["units_placed"].as_u64().unwrap() * unit_bytes
            + t["parity_log_live_bytes"].as_u64().unwrap_or(0);
        if held == 20 << 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "status.json never showed the 20 MiB written: {status}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn parity_device_through_nbdkit() {
    copy_in_and_out(Mode::Parity { width: 3 }, 2 * (256 << 10));
}

#[test]
fn mirror_device_through_nbdkit() {
    copy_in_and_out(Mode::Mirror, 256 << 10);
}

#[test]
fn bad_state_dir_is_refused_before_serving() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("nbdkit")
        .args(["-f", "-U", dir.path().join("sock").to_str().unwrap()])
        .arg(plugin_so())
        .arg(format!("state={}", dir.path().display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("device.toml"), "{err}");
}
