//! `prefetch-job`: a self-verifying job that reads what a hint file says,
//! in order, with a fixed compute time between reads (PGMS's synthetic
//! benchmarks, PGMS §4.3). It checks every byte against the data set's
//! content function (`--manifest`) and/or a reference copy
//! (`--reference`), and prints a JSON summary.
//!
//! The hint file given here is the job's *real* access pattern; prefetchd
//! may have been given other (wrong, stale) hints or none.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser)]
#[command(
    name = "prefetch-job",
    version = netpager_util::version!(),
    about = "replay a hint file's reads with compute time between them, verifying bytes"
)]
struct Cli {
    /// The reads to make, in order (all passes).
    #[arg(long)]
    hints: PathBuf,
    /// Directory the hint paths are relative to (e.g. MOUNT/jobs/NAME).
    #[arg(long)]
    root: PathBuf,
    /// Compute time between reads, in microseconds.
    #[arg(long, default_value_t = 250)]
    compute_us: u64,
    /// Busy-wait the compute time instead of sleeping.
    #[arg(long)]
    spin: bool,
    /// manifest.json of a generated data set: verify with its content function.
    #[arg(long)]
    manifest: Option<PathBuf>,
    /// Directory with the same files: verify against their bytes.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Stop after this many reads.
    #[arg(long)]
    limit: Option<u64>,
    /// Replay the hint file again and again until this file exists (a
    /// test's job that must run until the test has done what it does
    /// meanwhile), then stop after the read under way.
    #[arg(long)]
    until: Option<PathBuf>,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(summary) => {
            println!("{summary}");
            if summary["mismatches"].as_u64() == Some(0) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("prefetch-job: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Each file's content seed and size.
fn file_seeds(manifest: &Path) -> Result<HashMap<String, (u64, u64)>> {
    let text =
        std::fs::read_to_string(manifest).with_context(|| format!("{}", manifest.display()))?;
    let m: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", manifest.display()))?;
    let files = m["files"]
        .as_array()
        .with_context(|| format!("{}: no \"files\"", manifest.display()))?;
    files
        .iter()
        .map(|f| {
            let path = f["path"].as_str().context("file without \"path\"")?;
            let seed = f["file_seed"]
                .as_u64()
                .context("file without \"file_seed\"")?;
            let size = f["size"].as_u64().context("file without \"size\"")?;
            Ok((path.to_owned(), (seed, size)))
        })
        .collect()
}

fn open<'a>(cache: &'a mut HashMap<String, File>, dir: &Path, rel: &str) -> Result<&'a File> {
    if !cache.contains_key(rel) {
        let p = dir.join(rel);
        let f = File::open(&p).with_context(|| format!("opening {}", p.display()))?;
        cache.insert(rel.to_owned(), f);
    }
    Ok(&cache[rel])
}

fn read_full(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], offset + n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn run(cli: Cli) -> Result<Value> {
    let seeds = cli.manifest.as_deref().map(file_seeds).transpose()?;
    let compute = Duration::from_micros(cli.compute_us);
    let mut v = Verifier {
        cli: &cli,
        seeds,
        files: HashMap::new(),
        refs: HashMap::new(),
        records: 0,
        bytes: 0,
        mismatches: 0,
        first_mismatch: None,
        buf: Vec::new(),
        expect: Vec::new(),
    };
    let stop = || cli.until.as_deref().is_some_and(Path::exists);
    let started = Instant::now();
    let mut passes = 0u64;
    'replay: loop {
        let reader = hints::HintReader::open(&cli.hints)?;
        passes += 1;
        for r in reader.references() {
            if cli.limit.is_some_and(|l| v.records >= l) || (v.records > 0 && stop()) {
                break 'replay;
            }
            let r = r?.record;
            if v.records > 0 {
                if cli.spin {
                    let until = Instant::now() + compute;
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                } else {
                    std::thread::sleep(compute);
                }
            }
            v.read(&r)?;
        }
        if cli.until.is_none() || stop() {
            break;
        }
    }
    Ok(json!({
        "passes": passes,
        "records": v.records,
        "bytes": v.bytes,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "mismatches": v.mismatches,
        "first_mismatch": v.first_mismatch,
    }))
}

/// Reads records and checks their bytes, counting what it saw.
struct Verifier<'a> {
    cli: &'a Cli,
    seeds: Option<HashMap<String, (u64, u64)>>,
    files: HashMap<String, File>,
    refs: HashMap<String, File>,
    records: u64,
    bytes: u64,
    mismatches: u64,
    first_mismatch: Option<String>,
    buf: Vec<u8>,
    expect: Vec<u8>,
}

impl Verifier<'_> {
    fn read(&mut self, r: &hints::HintRecord) -> Result<()> {
        let buf = &mut self.buf;
        buf.resize(r.length as usize, 0);
        let f = open(&mut self.files, &self.cli.root, &r.path)?;
        let n = read_full(f, buf, r.offset)
            .with_context(|| format!("reading {} at {}", r.path, r.offset))?;
        self.records += 1;
        self.bytes += n as u64;
        let mut bad: Option<u64> = None;
        if let Some(seeds) = &self.seeds {
            let (seed, size) = *seeds
                .get(&r.path)
                .with_context(|| format!("{} is not in the manifest", r.path))?;
            let want = size.saturating_sub(r.offset).min(r.length) as usize;
            bad = hints::content::first_mismatch(seed, r.offset, &buf[..n]);
            if bad.is_none() && n != want {
                bad = Some(r.offset + n.min(want) as u64);
            }
        }
        if let (None, Some(dir)) = (bad, &self.cli.reference) {
            self.expect.resize(r.length as usize, 0);
            let f = open(&mut self.refs, dir, &r.path)?;
            let m = read_full(f, &mut self.expect, r.offset)?;
            if m != n {
                bad = Some(r.offset + m.min(n) as u64);
            } else if let Some(i) = buf[..n]
                .iter()
                .zip(&self.expect[..n])
                .position(|(a, b)| a != b)
            {
                bad = Some(r.offset + i as u64);
            }
        }
        if let Some(at) = bad {
            self.mismatches += 1;
            let records = self.records;
            self.first_mismatch
                .get_or_insert_with(|| format!("{} byte {at} (record {})", r.path, records - 1));
        }
        Ok(())
    }
}
