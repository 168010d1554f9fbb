//! A dump of recorded pages through the donor's real store under each
//! `compress=` (`make bench-compress`; the recorder is
//! `netpager_testkit.bench_compress`): bytes held, the ratio, and MB of
//! pages compressed and decompressed per CPU-second. Every page is read
//! back and compared; a difference fails the run.
//!
//!     compress-replay DUMP [--codec off --codec lz4 ...] [--rounds 3] [--batch 16] [--json]
//!
//! Codecs alternate round by round and each keeps its least CPU, so that
//! a busy moment on a shared machine hits all alike and counts for none.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use pager_server::config::Compress;
use pager_server::replay::{replay, Replay};
use serde_json::json;

#[derive(Parser)]
#[command(
    about = "Replays a dump of 4 KiB pages through pager-server's store under each compress="
)]
struct Args {
    /// A file of 4 KiB pages.
    dump: PathBuf,
    /// Codecs to replay with (off, lz4, zstd); default all three.
    #[arg(long = "codec", value_parser = parse_codec)]
    codecs: Vec<Compress>,
    /// Rounds; each codec keeps its least CPU time.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Pages per write and read request (16: one 64 KiB group of the store).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_codec(s: &str) -> Result<Compress, String> {
    Compress::parse(s).ok_or_else(|| format!("{s:?}: expected off, lz4 or zstd"))
}

/// One codec's result: its bytes and its best CPU times over the rounds.
struct Best {
    last: Replay,
    write_cpu: Duration,
    read_cpu: Duration,
}

/// MB (10^6 bytes) of pages per CPU-second; `None` when too fast to see.
fn mb_per_cpu_s(bytes: u64, cpu: Duration) -> Option<f64> {
    (!cpu.is_zero()).then(|| bytes as f64 / 1e6 / cpu.as_secs_f64())
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b != 0).then(|| a as f64 / b as f64)
}

fn cell(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.digits$}"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let codecs = if args.codecs.is_empty() {
        Compress::ALL.to_vec()
    } else {
        args.codecs.clone()
    };
    let dump =
        std::fs::read(&args.dump).with_context(|| format!("reading {}", args.dump.display()))?;
    let mut best: Vec<Option<Best>> = codecs.iter().map(|_| None).collect();
    for round in 1..=args.rounds {
        for (slot, &codec) in best.iter_mut().zip(&codecs) {
            let r = replay(&dump, codec, args.batch)
                .with_context(|| format!("{} round {round}", args.dump.display()))?;
            *slot = Some(match slot.take() {
                None => Best {
                    write_cpu: r.write_cpu,
                    read_cpu: r.read_cpu,
                    last: r,
                },
                Some(b) => Best {
                    write_cpu: b.write_cpu.min(r.write_cpu),
                    read_cpu: b.read_cpu.min(r.read_cpu),
                    last: r,
                },
            });
        }
    }
    let best: Vec<Best> = best.into_iter().map(|b| b.expect("rounds >= 1")).collect();
    let first = &best[0].last;
    let bytes = first.dump_bytes();
    if args.json {
        let per: serde_json::Map<String, serde_json::Value> = best
            .iter()
            .map(|b| {
                let r = &b.last;
                let doc = json!({
                    "logical_bytes": r.logical_bytes,
                    "stored_bytes": r.stored_bytes,
                    "mapped_bytes": r.mapped_bytes,
                    "ratio": ratio(bytes, r.stored_bytes),
                    "ratio_mapped": ratio(bytes, r.mapped_bytes),
                    "write_cpu_s": b.write_cpu.as_secs_f64(),
                    "read_cpu_s": b.read_cpu.as_secs_f64(),
                    "compress_mb_per_cpu_s": mb_per_cpu_s(bytes, b.write_cpu),
                    "decompress_mb_per_cpu_s": mb_per_cpu_s(bytes, b.read_cpu),
                });
                (r.codec.word().to_string(), doc)
            })
            .collect();
        let doc = json!({
            "dump": args.dump,
            "pages": first.pages,
            "zero_pages": first.zero_pages,
            "dump_bytes": bytes,
            "rounds": args.rounds,
            "batch_pages": args.batch,
            "codecs": per,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!(
        "{}: {} pages ({} zero), {} rounds, {} pages a request",
        args.dump.display(),
        first.pages,
        first.zero_pages,
        args.rounds,
        args.batch
    );
    println!(
        "{:<6} {:>12} {:>12} {:>12} {:>7} {:>7} {:>12} {:>12}",
        "codec",
        "logical MiB",
        "stored MiB",
        "mapped MiB",
        "ratio",
        "mapped",
        "comp MB/s",
        "decomp MB/s"
    );
    for b in &best {
        let r = &b.last;
        let mib = |n: u64| format!("{:.1}", n as f64 / f64::from(1 << 20));
        println!(
            "{:<6} {:>12} {:>12} {:>12} {:>7} {:>7} {:>12} {:>12}",
            r.codec.word(),
            mib(r.logical_bytes),
            mib(r.stored_bytes),
            mib(r.mapped_bytes),
            cell(ratio(bytes, r.stored_bytes), 2),
            cell(ratio(bytes, r.mapped_bytes), 2),
            cell(mb_per_cpu_s(bytes, b.write_cpu), 0),
            cell(mb_per_cpu_s(bytes, b.read_cpu), 0),
        );
    }
    println!(
        "(ratio: the dump's bytes, zero pages included, over the bytes held; MB/s per CPU-second)"
    );
    Ok(())
}
