//! `pager-hints`: validate, convert, summarise, check and generate hint
//! files (see hints/FORMAT.md).

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use hints::gen::{self, GenParams, Workload, WorkloadKind};
use hints::{Format, HintReader, HintWriter};

/// Exit status when `check` finds stale hints.
const EXIT_STALE: u8 = 3;

#[derive(Parser)]
#[command(
    name = "pager-hints",
    version = netpager_util::version!(),
    about = "netpager hint files: validate, convert, stats, check, merge, distinct, gen",
    after_help = "Exit status: 0 ok, 1 error (invalid hint file, i/o), 2 usage, 3 stale hints (check)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Read a whole hint file and report the first error, if any.
    Validate { file: PathBuf },
    /// Rewrite a hint file in the other (or the given) form.
    Convert {
        input: PathBuf,
        /// Output file, `-` for standard output.
        output: PathBuf,
        /// Output form; default: the other one.
        #[arg(long)]
        to: Option<Format>,
    },
    /// Summarise: files, records, blocks, bytes, distinct bytes, reuse, passes.
    Stats {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Report hints about files that changed since the hints were written.
    Check {
        file: PathBuf,
        /// Data set root the hint paths are relative to.
        #[arg(long)]
        root: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Write the records of several hint files (recordings), one after the
    /// other, as one hint file.
    Merge {
        /// Hint files, in the order their records are to be read.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Job name (default: the first input's).
        #[arg(long)]
        job: Option<String>,
        #[arg(long, default_value_t = Format::Text)]
        format: Format,
    },
    /// Reduce a hint file to its distinct blocks, in first-use order.
    Distinct {
        input: PathBuf,
        output: PathBuf,
        #[arg(long, default_value_t = Format::Text)]
        format: Format,
    },
    /// Write a reference workload's data set and hint file under DIR.
    Gen {
        workload: WorkloadKind,
        /// Output directory: data in DIR/data, hints in DIR/JOB.hints, DIR/manifest.json.
        #[arg(long)]
        out: PathBuf,
        /// Size factor relative to the paper (1 = 100 MB files).
        #[arg(long, default_value_t = gen::DEFAULT_SCALE)]
        scale: f64,
        #[arg(long, default_value_t = gen::DEFAULT_SEED)]
        seed: u64,
        #[arg(long, default_value_t = hints::DEFAULT_BLOCK_SIZE)]
        block_size: u32,
        /// Form of the hint file.
        #[arg(long, default_value_t = Format::Text)]
        format: Format,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pager-hints: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Validate { file } => {
            let mut reader = HintReader::open(&file)?;
            for r in reader.by_ref() {
                r?;
            }
            let h = reader.header();
            println!(
                "{}: ok: {} form, job {:?}, block size {}, {} records, {} pass(es), {} declared file(s)",
                file.display(),
                reader.format(),
                h.job,
                h.block_size,
                reader.records_read(),
                h.repeat,
                h.files.len()
            );
        }
        Command::Convert { input, output, to } => convert(&input, &output, to)?,
        Command::Stats { file, json } => {
            let s = HintReader::open(&file)?.stats()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                println!("job              {}", s.job);
                println!("format           {}", s.format);
                println!("block size       {}", s.block_size);
                println!("passes           {}", s.passes);
                println!("declared files   {}", s.declared_files);
                println!("files            {}", s.files);
                println!("records/pass     {}", s.records_per_pass);
                println!("records          {}", s.records);
                println!("blocks           {}", s.blocks);
                println!("distinct blocks  {}", s.distinct_blocks);
                println!("bytes            {}", s.bytes);
                println!("distinct bytes   {}", s.distinct_bytes);
                println!("reuse            {:.3}", s.reuse);
            }
        }
        Command::Check { file, root, json } => {
            let stale = HintReader::open(&file)?.check_against(&root)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&stale)?);
            } else if stale.is_empty() {
                println!("{}: fresh", file.display());
            } else {
                for s in &stale {
                    println!("{s}");
                }
            }
            if !stale.is_empty() {
                return Ok(ExitCode::from(EXIT_STALE));
            }
        }
        Command::Merge {
            inputs,
            out,
            job,
            format,
        } => {
            let n = hints::merge(&inputs, &out, format, job.as_deref())?;
            println!(
                "{}: {n} records from {} file(s)",
                out.display(),
                inputs.len()
            );
        }
        Command::Distinct {
            input,
            output,
            format,
        } => {
            let n = hints::distinct(&input, &output, format)?;
            println!("{}: {n} records", output.display());
        }
        Command::Gen {
            workload,
            out,
            scale,
            seed,
            block_size,
            format,
        } => {
            let params = GenParams {
                scale,
                seed,
                block_size,
            };
            let w = Workload::generate(workload, &params)?;
            let m = gen::write_dataset(&w, &out, format)
                .with_context(|| format!("generating {workload} under {}", out.display()))?;
            let bytes: u64 = m.files.iter().map(|f| f.size).sum();
            println!(
                "{}: {} file(s), {} bytes in {}, {} records x {} pass(es) in {}",
                m.job,
                m.files.len(),
                bytes,
                out.join(&m.root).display(),
                m.records,
                m.repeat,
                out.join(&m.hints).display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn convert(input: &Path, output: &Path, to: Option<Format>) -> Result<()> {
    let mut reader = HintReader::open(input)?;
    let format = to.unwrap_or(match reader.format() {
        Format::Text => Format::Binary,
        Format::Binary => Format::Text,
    });
    let header = reader.header().clone();
    let sink: Box<dyn Write> = if output == Path::new("-") {
        Box::new(io::stdout().lock())
    } else {
        Box::new(File::create(output).with_context(|| format!("creating {}", output.display()))?)
    };
    let mut writer = HintWriter::new(sink, format, &header, &output.display().to_string())?;
    for r in reader.by_ref() {
        writer.write(&r?)?;
    }
    writer.finish()?.flush()?;
    Ok(())
}
