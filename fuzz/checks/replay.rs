// Replays a fuzz target's kept inputs (fuzz/regressions/TARGET/: crashes
// once found and fixed, and hand-made cases) through its check on every
// `cargo test`, without the nightly toolchain that exploring needs
// (`make fuzz`). Included by each crate's tests/fuzz_regressions.rs.

pub fn replay(target: &str, check: fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        eprintln!("{target}: {}", path.display());
        check(&data);
        n += 1;
    }
    assert!(n > 0, "{}: no kept inputs", dir.display());
}
