//! The `pager-hints` command: exit statuses and output of each subcommand.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pager-hints"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn validate_reports_ok_or_the_error_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.txt");
    fs::write(
        &good,
        "netpager-hints 1\njob j\nblock-size 8K\nrecords\na 0 8K\n",
    )
    .unwrap();
    let o = run(&["validate", p(&good)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("ok: text form, job \"j\", block size 8192, 1 records"),
        "{}",
        stdout(&o)
    );

    let bad = dir.path().join("bad.txt");
    fs::write(
        &bad,
        "netpager-hints 1\njob j\nblock-size 8K\nrecords\na 0 8K\na 12x 8K\n",
    )
    .unwrap();
    let o = run(&["validate", p(&bad)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!(
            "{}:6: field 'offset': invalid number \"12x\"",
            bad.display()
        )),
        "{}",
        stderr(&o)
    );

    let o = run(&["validate", p(&dir.path().join("absent"))]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("absent"), "{}", stderr(&o));
}

#[test]
fn convert_round_trips_text_binary_text() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("a.txt");
    let original = "netpager-hints 1\njob \"two words\"\nblock-size 4096\nrepeat 3\nfile \"x y\" 100 5.000000001\nrecords\n\"x y\" 0 100\nz 4096 4096\nz 0 1\n";
    fs::write(&text, original).unwrap();
    let bin = dir.path().join("a.bin");
    let back = dir.path().join("b.txt");
    assert!(run(&["convert", p(&text), p(&bin)]).status.success());
    assert!(fs::read(&bin).unwrap().starts_with(b"\x89NPHINT\n"));
    assert!(run(&["convert", p(&bin), p(&back)]).status.success());
    assert_eq!(fs::read_to_string(&back).unwrap(), original);
    let o = run(&["convert", p(&bin), "-", "--to", "text"]);
    assert_eq!(stdout(&o), original);
    let o = run(&[
        "convert",
        p(&text),
        p(&dir.path().join("c")),
        "--to",
        "rot13",
    ]);
    assert_eq!(o.status.code(), Some(2), "usage error");
}

#[test]
fn stats_json_has_the_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("s.txt");
    fs::write(
        &f,
        "netpager-hints 1\njob s\nblock-size 4K\nrepeat 2\nrecords\na 0 8K\na 4K 4K\nb 0 1\n",
    )
    .unwrap();
    let o = run(&["stats", p(&f), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["files"], 2);
    assert_eq!(v["passes"], 2);
    assert_eq!(v["records"], 6);
    assert_eq!(v["blocks"], 8);
    assert_eq!(v["distinct_blocks"], 3);
    assert_eq!(v["bytes"], 2 * (8192 + 4096 + 1));
    assert_eq!(v["distinct_bytes"], 3 * 4096);
    let o = run(&["stats", p(&f)]);
    assert!(stdout(&o).contains("distinct blocks  3"), "{}", stdout(&o));
}

#[test]
fn gen_then_check_detects_a_changed_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hc");
    let o = run(&[
        "gen",
        "cyclic-hotcold",
        "--out",
        p(&out),
        "--seed",
        "3",
        "--format",
        "binary",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let hints = out.join("cyclic-hotcold.hints");
    let root = out.join("data");
    let o = run(&["check", p(&hints), "--root", p(&root)]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("fresh"));
    let o = run(&["stats", p(&hints), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["passes"], 3);
    assert_eq!(v["records_per_pass"], 20 * (128 + 64));

    let data = root.join("hotcold.dat");
    let len = fs::metadata(&data).unwrap().len();
    fs::File::options()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let o = run(&["check", p(&hints), "--root", p(&root), "--json"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let problems: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["problem"].as_str().unwrap())
        .collect();
    assert!(
        problems.contains(&"size-differs") && problems.contains(&"beyond-eof"),
        "{problems:?}"
    );
    assert_eq!(v[0]["path"], "hotcold.dat");
}

#[test]
fn gen_refuses_unknown_workloads_and_bad_scales() {
    let dir = tempfile::tempdir().unwrap();
    let o = run(&["gen", "bogus", "--out", p(dir.path())]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("render"),
        "lists the workloads: {}",
        stderr(&o)
    );
    let o = run(&["gen", "random", "--out", p(dir.path()), "--scale", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("scale 0"), "{}", stderr(&o));
}
