//! A dump of recorded pages through the donor's real store under each
//! `compress=` (`make bench-compress`; the recorder is
//! `netpager_testkit.bench_compress`): bytes held, the ratio, and MB of
//! pages compressed and decompressed per CPU-second, through the store and
//! by the codec alone. Every page is read back and compared; a difference
//! fails the run.
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

/// One codec's result: its bytes and its least CPU times over the rounds
/// (through the store, and the codec alone).
struct Best {
    last: Replay,
    write_cpu: Duration,
    read_cpu: Duration,
    codec_cpu: Option<(Duration, Duration)>,
    /// The recompressor's pass and the reads after it, a pair for each of
    /// its codecs (lz4 only).
    cold_cpu: Vec<(Duration, Duration)>,
}

impl Best {
    fn new(r: Replay) -> Self {
        Best {
            write_cpu: r.write_cpu,
            read_cpu: r.read_cpu,
            codec_cpu: r
                .codec_cost
                .as_ref()
                .map(|c| (c.compress_cpu, c.decompress_cpu)),
            cold_cpu: r
                .cold
                .iter()
                .map(|c| (c.recompress_cpu, c.read_cpu))
                .collect(),
            last: r,
        }
    }

    fn add(self, r: Replay) -> Self {
        let next = Best::new(r);
        Best {
            write_cpu: self.write_cpu.min(next.write_cpu),
            read_cpu: self.read_cpu.min(next.read_cpu),
            codec_cpu: self
                .codec_cpu
                .zip(next.codec_cpu)
                .map(|(a, b)| (a.0.min(b.0), a.1.min(b.1))),
            cold_cpu: self
                .cold_cpu
                .iter()
                .zip(&next.cold_cpu)
                .map(|(a, b)| (a.0.min(b.0), a.1.min(b.1)))
                .collect(),
            last: next.last,
        }
    }

    /// MB per CPU-second through the store: writing, reading back.
    fn store_rates(&self) -> (Option<f64>, Option<f64>) {
        let bytes = self.last.dump_bytes();
        (
            mb_per_cpu_s(bytes, self.write_cpu),
            mb_per_cpu_s(bytes, self.read_cpu),
        )
    }

    /// MB per CPU-second of the codec alone: compressing, decompressing.
    fn codec_rates(&self) -> (Option<f64>, Option<f64>) {
        match (&self.last.codec_cost, self.codec_cpu) {
            (Some(c), Some((comp, decomp))) => (
                mb_per_cpu_s(c.compressed_bytes, comp),
                mb_per_cpu_s(c.decompressed_bytes, decomp),
            ),
            _ => (None, None),
        }
    }
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
                None => Best::new(r),
                Some(b) => b.add(r),
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
                let (write, read) = b.store_rates();
                let (comp, decomp) = b.codec_rates();
                let doc = json!({
                    "logical_bytes": r.logical_bytes,
                    "stored_bytes": r.stored_bytes,
                    "mapped_bytes": r.mapped_bytes,
                    "ratio": ratio(bytes, r.stored_bytes),
                    "ratio_mapped": ratio(bytes, r.mapped_bytes),
                    "write_cpu_s": b.write_cpu.as_secs_f64(),
                    "read_cpu_s": b.read_cpu.as_secs_f64(),
                    "write_mb_per_cpu_s": write,
                    "read_mb_per_cpu_s": read,
                    "compress_mb_per_cpu_s": comp,
                    "decompress_mb_per_cpu_s": decomp,
                    "cold": r.cold.iter().zip(&b.cold_cpu).map(|(c, &(pass, read))| (
                        c.codec.word().to_string(),
                        json!({
                            "pages": c.pages,
                            "stored_bytes": c.stored_bytes,
                            "mapped_bytes": c.mapped_bytes,
                            "ratio": ratio(bytes, c.stored_bytes),
                            "ratio_mapped": ratio(bytes, c.mapped_bytes),
                            "recompress_mb_per_cpu_s": mb_per_cpu_s(bytes, pass),
                            "read_mb_per_cpu_s": mb_per_cpu_s(bytes, read),
                        }),
                    )).collect::<serde_json::Map<_, _>>(),
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
    let head = [
        "codec",
        "logical MiB",
        "stored MiB",
        "mapped MiB",
        "ratio",
        "mapped",
        "write MB/s",
        "read MB/s",
        "comp MB/s",
        "decomp MB/s",
    ];
    println!("{}", row(&head.map(String::from)));
    for b in &best {
        let r = &b.last;
        let mib = |n: u64| format!("{:.1}", n as f64 / f64::from(1 << 20));
        let (write, read) = b.store_rates();
        let (comp, decomp) = b.codec_rates();
        println!(
            "{}",
            row(&[
                r.codec.word().to_string(),
                mib(r.logical_bytes),
                mib(r.stored_bytes),
                mib(r.mapped_bytes),
                cell(ratio(bytes, r.stored_bytes), 2),
                cell(ratio(bytes, r.mapped_bytes), 2),
                cell(write, 0),
                cell(read, 0),
                cell(comp, 0),
                cell(decomp, 0),
            ])
        );
        for (c, &(pass, read)) in r.cold.iter().zip(&b.cold_cpu) {
            println!(
                "{}",
                row(&[
                    format!("-> {}", c.codec.word()),
                    mib(r.logical_bytes),
                    mib(c.stored_bytes),
                    mib(c.mapped_bytes),
                    cell(ratio(bytes, c.stored_bytes), 2),
                    cell(ratio(bytes, c.mapped_bytes), 2),
                    cell(mb_per_cpu_s(bytes, pass), 0),
                    cell(mb_per_cpu_s(bytes, read), 0),
                    "-".into(),
                    "-".into(),
                ])
            );
        }
    }
    println!(
        "(ratio: the dump's bytes, zero pages included, over the bytes held; MB per CPU-second \
         of the dump through the store (write, read) and of the codec alone (comp, decomp); \
         -> zstd, -> lz4hc: lz4's pages once the recompressor (recompress=zstd, lz4hc) packed \
         them all again, its pass in the write column)"
    );
    Ok(())
}

/// A table row: the codec's name left-aligned, the numbers right-aligned.
fn row(cells: &[String; 10]) -> String {
    let mut line = format!("{:<9}", cells[0]);
    for c in &cells[1..] {
        line.push_str(&format!(" {c:>12}"));
    }
    line
}
