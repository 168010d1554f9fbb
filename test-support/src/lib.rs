//! Harness shared by netpager's Rust tests (a dev-dependency only): real
//! nbdkit servers on loopback ([`Nbdkit`]) and the plugins the workspace
//! builds. The Python harness is `tests/netpager_testkit`, another thing.

pub mod machine;
mod nbdkit;

pub use nbdkit::{free_ports, next_ip, Nbdkit, PSK_USER};

use std::path::{Path, PathBuf};

/// A pager-server donor with a status endpoint, or `None` (with a note
/// on stderr) when its plugin has not been built. The machine's own load
/// and memory never decide a test's result: the donor is never busy and
/// never drains for the machine's memory (`busy-load=1000`, `reserve=0`)
/// unless `params` say otherwise (the plugin takes the last value given).
pub fn pager_server(params: &[&str]) -> Option<Nbdkit> {
    pager_server_filtered(&[], params)
}

/// [`pager_server`] behind nbdkit `filters` (`--filter=delay`, ...), whose
/// parameters go in `params` too.
pub fn pager_server_filtered(filters: &[&str], params: &[&str]) -> Option<Nbdkit> {
    Some(Nbdkit::start(&server_args(filters, params)?, true))
}

/// nbdkit's arguments for the pager-server plugin with the harness's
/// defaults, or `None` when the plugin has not been built.
fn server_args(filters: &[&str], params: &[&str]) -> Option<Vec<String>> {
    let so = pager_server_so()?;
    let mut args: Vec<String> = filters.iter().map(|s| s.to_string()).collect();
    args.push(so.display().to_string());
    args.extend(["mlock=false", "busy-load=1000", "reserve=0"].map(String::from));
    args.extend(params.iter().map(|s| s.to_string()));
    Some(args)
}

/// [`pager_server`] listening on loopback address `ip`.
pub fn pager_server_on(ip: &str, params: &[&str]) -> Option<Nbdkit> {
    Some(Nbdkit::start_on(ip, &server_args(&[], params)?, true))
}

/// `n` small pager-server donors (16 MiB exports) that report their state
/// and used bytes on a status endpoint, or `None` as [`pager_server`].
pub fn pager_servers(n: usize) -> Option<Vec<Nbdkit>> {
    (0..n)
        .map(|_| pager_server(&["size=16M", "budget=64M", "poll-ms=100"]))
        .collect()
}

/// One of [`pager_servers`]' donors whose every write waits `delay`
/// (nbdkit's delay filter, `delay-write=`, e.g. `500ms`): a copy or a
/// drain to it stays in flight that long.
pub fn slow_pager_server(delay: &str) -> Option<Nbdkit> {
    let so = pager_server_so()?;
    let args = [
        "--filter=delay",
        &so.display().to_string(),
        "mlock=false",
        "size=16M",
        "budget=64M",
        "reserve=0",
        "busy-load=1000",
        "poll-ms=100",
        &format!("delay-write={delay}"),
    ]
    .map(String::from);
    Some(Nbdkit::start(&args, true))
}

/// Writes a MemTotal/MemAvailable file for a donor's `meminfo=`, aside
/// and renamed into place, so the donor never reads half of it.
pub fn write_meminfo(path: &Path, total: u64, available: u64) {
    let tmp = path.with_extension("new");
    std::fs::write(
        &tmp,
        format!(
            "MemTotal: {} kB\nMemFree: 0 kB\nMemAvailable: {} kB\n",
            total / 1024,
            available / 1024
        ),
    )
    .expect("write the meminfo file");
    std::fs::rename(&tmp, path).expect("rename the meminfo file into place");
}

/// The pager-server plugin for tests of other crates: `$NETPAGER_TARGET_DIR`,
/// then the usual target directories. Tests that need it say so on stderr
/// and return when it is missing, unless `NETPAGER_REQUIRE_SERVER=1` (every
/// `make` target sets it) or `CI=true`: then they fail.
pub fn pager_server_so() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf();
    let mut dirs: Vec<PathBuf> = std::env::var_os("NETPAGER_TARGET_DIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    dirs.push(root.join("target/release"));
    dirs.push(root.join("target-server/release"));
    let found = dirs
        .into_iter()
        .map(|d| d.join("libpager_server.so"))
        .find(|p| p.exists());
    if found.is_none() {
        let required = std::env::var("NETPAGER_REQUIRE_SERVER").as_deref() == Ok("1")
            || std::env::var("CI").as_deref() == Ok("true");
        assert!(
            !required,
            "libpager_server.so not found (build pager-server or set NETPAGER_TARGET_DIR)"
        );
        eprintln!("NOTE: libpager_server.so not built; skipping this pager-server test");
    }
    found
}

/// A library the crate under test builds itself (a cdylib), beside the
/// running test: in target/<profile>/deps/, where `cargo test` leaves it,
/// or in target/<profile>/.
pub fn built_beside_test(file: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let deps = exe.parent().expect("target/<profile>/deps");
    let candidates = [deps.join(file), deps.join("..").join(file)];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .unwrap_or_else(|| panic!("{} not built", candidates[0].display()))
}
