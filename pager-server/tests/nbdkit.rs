//! The plugin in a real nbdkit on loopback: data through NBD (nbdsh,
//! nbdinfo), state and counters through the status endpoint.
//!
//! The plugin is `libpager_server.so` beside this test (cargo builds it
//! with the tests), or `$NETPAGER_SERVER_SO`.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use netpager_proto::{query_status, set_draining, DonorState, DonorStatus};
use netpager_test_support::{built_beside_test, Nbdkit};

const TIMEOUT: Duration = Duration::from_secs(10);
const MIB: u64 = 1 << 20;
/// Debian's tools first: nbdsh needs the python3 that has libnbd's binding.
const PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

fn plugin() -> PathBuf {
    std::env::var_os("NETPAGER_SERVER_SO")
        .map(PathBuf::from)
        .unwrap_or_else(|| built_beside_test("libpager_server.so"))
}

/// A port free on `ip` (this test process's own loopback address).
fn free_port(ip: &str) -> u16 {
    netpager_test_support::free_ports(ip)[0]
}

/// One nbdkit serving the plugin (the shared harness, which kills it by
/// pid when dropped) with a fake meminfo this test rewrites.
struct Donor {
    nbdkit: Nbdkit,
    status: String,
    meminfo: PathBuf,
    _dir: tempfile::TempDir,
}

impl Donor {
    /// Plugin with a fake meminfo (8 GiB total, 4 GiB available), reserve
    /// 1 GiB, budget 1 MiB (256 pages), default size 16 MiB, plus `extra`.
    fn start(extra: &[&str]) -> Donor {
        let dir = tempfile::tempdir().unwrap();
        let meminfo = dir.path().join("meminfo");
        netpager_test_support::write_meminfo(&meminfo, 8 << 30, 4 << 30);
        let mut args: Vec<String> = vec![
            "--exit-with-parent".into(),
            plugin().display().to_string(),
            "size=16M".into(),
            "budget=1M".into(),
            "reserve=1G".into(),
            "node-id=it-donor".into(),
            format!("meminfo={}", meminfo.display()),
            "poll-ms=20".into(),
            // Pages of one repeated byte, kept raw: the budget and drain
            // are counted page by page here (compression has its own tests).
            "compress=off".into(),
            "busy-load=1000".into(),
            "age-x=4".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut nbdkit = Nbdkit::start(&args, true);
        let status = nbdkit.status.clone().expect("a status endpoint");
        for _ in 0..100 {
            if query_status(&status, TIMEOUT).is_ok() {
                return Donor {
                    nbdkit,
                    status,
                    meminfo,
                    _dir: dir,
                };
            }
            if let Some(code) = nbdkit.exited() {
                panic!("nbdkit exited with {code}: {}", nbdkit.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("nbdkit did not answer on {status}: {}", nbdkit.log());
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.nbdkit.addr)
    }

    /// Runs Python `code` in nbdsh connected to `export` (handle `h`).
    fn nbdsh(&self, export: &str, code: &str) -> Output {
        let prelude = format!("import errno, nbd\nURI = {:?}\n", self.uri(export));
        Command::new("nbdsh")
            .args(["-u", &self.uri(export), "-c", &format!("{prelude}{code}")])
            .env("PATH", PATH)
            .output()
            .expect("nbdsh is installed")
    }

    fn nbdsh_ok(&self, export: &str, code: &str) -> String {
        let out = self.nbdsh(export, code);
        assert!(
            out.status.success(),
            "nbdsh on {export} failed:\n{}\n{}\nnbdkit log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.nbdkit.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn status(&self) -> DonorStatus {
        query_status(&self.status, TIMEOUT).unwrap()
    }

    /// Polls the status until the donor's watch thread reports `want`.
    fn wait_state(&self, want: DonorState) -> DonorStatus {
        for _ in 0..200 {
            let s = self.status();
            if s.state() == want {
                return s;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("donor never became {}: {:?}", want.word(), self.status());
    }
}

/// Bytes nbdinfo --map reports as data.
fn mapped_data(n: &Donor, export: &str) -> u64 {
    let out = Command::new("nbdinfo")
        .args(["--map", &n.uri(export)])
        .env("PATH", PATH)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim_end().ends_with("data"))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum()
}

#[test]
fn serves_pages_counts_them_and_refuses_beyond_budget() {
    let n = Donor::start(&[]);
    let s = n.status();
    assert_eq!(
        (s.node_id.as_str(), s.state()),
        ("it-donor", DonorState::Idle),
        "{s:?}"
    );
    assert_eq!((s.budget_bytes, s.used_bytes, s.free_bytes), (MIB, 0, MIB));
    assert_eq!(
        (s.reserve_bytes, s.mem_available_bytes, s.page_size, s.age_x),
        (1 << 30, 4 << 30, 4096, 4)
    );

    n.nbdsh_ok(
        "alpha",
        r#"
h.pwrite(b"A" * 12288, 0)
h.pwrite(b"B" * 100, 1048576 + 50)
assert h.pread(12288, 0) == b"A" * 12288
assert h.pread(200, 1048576) == b"\0" * 50 + b"B" * 100 + b"\0" * 50
assert h.pread(4096, 8 << 20) == b"\0" * 4096
# multi-conn: a second connection to the same name sees the same pages.
assert h.can_multi_conn()
h2 = nbd.NBD()
h2.connect_uri(URI)
h2.pwrite(b"C" * 4096, 4 << 20)
assert h.pread(4096, 4 << 20) == b"C" * 4096
h2.shutdown()
"#,
    );
    assert_eq!(mapped_data(&n, "alpha"), 5 * 4096);
    // Another name is another store, with the size it asked for.
    n.nbdsh_ok(
        "beta@8M",
        "assert h.get_size() == 8 << 20\nassert h.pread(4096, 0) == b'\\0' * 4096",
    );
    assert_eq!(mapped_data(&n, "beta"), 0);

    // 256 more pages do not fit in the 251 left: refused whole, nothing
    // before it lost.
    n.nbdsh_ok(
        "alpha",
        r#"
try:
    h.pwrite(b"Z" * 1048576, 8 << 20)
    raise SystemExit("a write beyond the budget succeeded")
except nbd.Error as e:
    assert e.errnum == errno.ENOSPC, e
assert h.pread(1048576, 8 << 20) == b"\0" * 1048576
assert h.pread(12288, 0) == b"A" * 12288
h.trim(8192, 0)
h.zero(100, 1048576 + 50)
assert h.pread(12288, 0) == b"\0" * 8192 + b"A" * 4096
"#,
    );
    let s = n.status();
    assert_eq!(
        (s.used_bytes, s.free_bytes),
        (2 * 4096, MIB - 2 * 4096),
        "{s:?}"
    );
    assert_eq!(s.enospc, 1);
    assert_eq!(
        (s.writes, s.bytes_written),
        (4, 12288 + 100 + 4096),
        "the refused write moved no bytes"
    );
    assert!(s.reads >= 6 && s.bytes_read >= 12288 * 2 + 1048576, "{s:?}");
    assert_eq!((s.trims, s.zeroes), (1, 1));
    let exports: Vec<_> = s
        .exports
        .iter()
        .map(|e| (e.name.as_str(), e.size_bytes, e.used_bytes))
        .collect();
    assert_eq!(
        exports,
        [("alpha", 16 * MIB, 2 * 4096), ("beta", 8 * MIB, 0)]
    );
    assert!(s.age_x_ms <= s.uptime_ms, "{s:?}");
    assert!(
        s.utilisation >= 0.0 && s.utilisation <= 1.0 && s.mean_service_us > 0.0,
        "{s:?}"
    );

    // A name that breaks the rules or a size that contradicts the store.
    for bad in ["bad/x/y", "alpha@32M"] {
        let out = n.nbdsh(bad, "pass");
        assert!(!out.status.success(), "export {bad:?} was accepted");
    }
    let log = n.nbdkit.log();
    assert!(
        log.contains("character '/' not allowed in the device"),
        "{log}"
    );
    assert!(
        log.contains("export alpha exists with size 16777216 bytes"),
        "{log}"
    );
}

#[test]
fn drains_under_memory_pressure_and_on_command_without_losing_pages() {
    let n = Donor::start(&[]);
    n.nbdsh_ok("d", "h.pwrite(b'K' * 4096, 0)");
    netpager_test_support::write_meminfo(&n.meminfo, 8 << 30, 512 << 20);
    let s = n.wait_state(DonorState::Draining);
    assert_eq!(s.free_bytes, 0);
    assert_eq!(s.state_reason, "MemAvailable 512 MiB below reserve 1 GiB");
    let refused = r#"
try:
    h.pwrite(b"N" * 4096, 4096)
    raise SystemExit("a new page was accepted while draining")
except nbd.Error as e:
    assert e.errnum == errno.ENOSPC, e
h.pwrite(b"L" * 4096, 0)
assert h.pread(4096, 0) == b"L" * 4096
"#;
    n.nbdsh_ok("d", refused);
    netpager_test_support::write_meminfo(&n.meminfo, 8 << 30, 4 << 30);
    n.wait_state(DonorState::Idle);
    n.nbdsh_ok("d", "h.pwrite(b'N' * 4096, 4096)");

    let s = set_draining(&n.status, true, TIMEOUT).unwrap();
    assert_eq!(
        (s.state(), s.state_reason.as_str()),
        (
            DonorState::Draining,
            "drain requested on the status endpoint"
        )
    );
    n.nbdsh_ok("d", &refused.replace("4096, 4096)", "4096, 8192)"));
    let s = set_draining(&n.status, false, TIMEOUT).unwrap();
    assert_eq!(s.state(), DonorState::Idle);
    assert_eq!(s.used_bytes, 2 * 4096);
    assert_eq!(s.enospc, 2);
}

#[test]
fn status_port_survives_garbage() {
    let n = Donor::start(&[]);
    let junk: [&[u8]; 4] = [
        b"GET / HTTP/1.0\r\n\r\n",
        &[0xff; 64],
        &[5, 1, 2],
        &[0x80; 11],
    ];
    for bytes in junk {
        let mut s = TcpStream::connect(&n.status).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        // The donor may answer and close before all of it is sent.
        let _ = s
            .write_all(bytes)
            .and_then(|_| s.shutdown(std::net::Shutdown::Write));
        // An error reply or a close (EOF or reset), never a hang.
        match std::io::Read::read(&mut s, &mut [0u8; 256]) {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("status endpoint hung on {bytes:?}")
            }
            _ => {}
        }
    }
    // A client that connects and says nothing does not block others.
    let _idle = TcpStream::connect(&n.status).unwrap();
    assert_eq!(n.status().node_id, "it-donor");
}

#[test]
fn bad_start_is_a_clear_error() {
    // Runs `PREFIX... nbdkit -f OPTS... plugin ARGS...`, which must fail.
    let run_with = |prefix: &[&str], opts: &[&str], args: &[&str]| {
        let ip = netpager_test_support::next_ip();
        let port = free_port(&ip).to_string();
        let so = plugin().display().to_string();
        let mut argv: Vec<&str> = prefix.to_vec();
        argv.extend(["nbdkit", "-f", "-p", &port, "-i", &ip]);
        argv.extend(opts);
        argv.push(&so);
        argv.extend(args);
        let out = Command::new(argv[0])
            .args(&argv[1..])
            .env("PATH", PATH)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "nbdkit started: {argv:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let run = |prefix: &[&str], args: &[&str]| run_with(prefix, &[], args);
    let e = run(&[], &["budget=150%"]);
    assert!(
        e.contains("budget=\"150%\": percentage must be above 0 and at most 100"),
        "{e}"
    );
    let e = run(&[], &["sise=1G"]);
    assert!(e.contains("unknown parameter \"sise\""), "{e}");
    let taken = TcpListener::bind((netpager_test_support::next_ip().as_str(), 0)).unwrap();
    let e = run(&[], &[&format!("status={}", taken.local_addr().unwrap())]);
    assert!(e.contains("cannot listen"), "{e}");
    // A status endpoint on a network address needs the lab key (nothing
    // connects to it: nbdkit stops before serving).
    let e = run(&[], &[&format!("status=0.0.0.0:{}", free_port("0.0.0.0"))]);
    assert!(
        e.contains("is not a loopback address") && e.contains("psk=FILE"),
        "{e}"
    );
    let e = run(&[], &["psk=/nonexistent/lab.psk"]);
    assert!(
        e.contains("psk=: cannot read key file /nonexistent/lab.psk"),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("export.secret");
    std::fs::write(&secret, "abc\n").unwrap();
    let e = run(&[], &[&format!("export-secret={}", secret.display())]);
    assert!(
        e.contains("export-secret=") && e.contains("export.secret:1: key is not even-length hex"),
        "{e}"
    );
    // Without CAP_IPC_LOCK and with a finite RLIMIT_MEMLOCK, mlock=true
    // refuses to start and says what to change.
    let e = run(
        &[
            "prlimit",
            "--memlock=1048576:1048576",
            "setpriv",
            "--bounding-set",
            "-ipc_lock",
        ],
        &["budget=64M"],
    );
    assert!(
        e.contains("RLIMIT_MEMLOCK is 1 MiB") && e.contains("mlock=false"),
        "{e}"
    );
    // The same check runs again after nbdkit drops root (-u/-g), which
    // happens after config_complete.
    let e = run_with(
        &["prlimit", "--memlock=1048576:1048576"],
        &["-u", "nobody", "-g", "nogroup"],
        &["budget=64M"],
    );
    assert!(e.contains("RLIMIT_MEMLOCK is 1 MiB"), "{e}");
}
