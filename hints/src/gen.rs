//! The reference workloads of docs/DESIGN.md "3 Reference workloads" as data
//! sets plus hint files.
//!
//! [`Workload::generate`] is pure: it returns the files to create (name,
//! size, content seed) and the job's accesses in order. [`write_dataset`]
//! materialises one under a directory. Sizes are the paper's times
//! [`GenParams::scale`] (1.0 = the paper's 100 MB files; the default 1/32
//! gives a few MB, fast enough for tests). File contents follow
//! [`crate::content`], so a job can verify every byte it reads.
//!
//! Output depends only on the workload, the parameters and this crate's
//! version.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Serialize;

use crate::content::{self, fnv1a64, mix64, GAMMA};
use crate::error::ErrorKind;
use crate::{
    validate_block_size, FileDecl, Format, HintError, HintHeader, HintRecord, HintWriter,
    DEFAULT_BLOCK_SIZE,
};

/// Default size factor: 1/32 of the paper's sizes (100 MB -> 3.1 MiB).
pub const DEFAULT_SCALE: f64 = 1.0 / 32.0;
/// Largest accepted scale (the render database would be 178 GiB).
pub const MAX_SCALE: f64 = 1024.0;
/// Default seed.
pub const DEFAULT_SEED: u64 = 1;
/// Passes of the cyclic variants.
pub const CYCLIC_REPEAT: u32 = 3;
/// Hotcold: phases.
pub const HOTCOLD_PHASES: usize = 20;
/// Hotcold: pages read from the hot region per phase.
pub const HOT_PAGES: usize = 512;
/// Hotcold: pages read from the cold region per phase.
pub const COLD_PAGES: usize = 256;
/// Hotcold: pages per sequential run (one record).
pub const RUN_PAGES: u32 = 4;
/// Render: fraction of the database touched (100 MB of 178 MB).
pub const RENDER_TOUCHED: f64 = 100.0 / 178.0;
/// Render: frames (viewpoint positions).
pub const RENDER_FRAMES: usize = 4;
/// OO7: blocks per composite part.
pub const OO7_PART_BLOCKS: u32 = 4;
/// OO7: composite parts referenced by each base assembly.
pub const OO7_PARTS_PER_BASE: usize = 3;
/// OO7: children per complex assembly.
pub const OO7_FANOUT: usize = 3;
/// Hash join: partitions of the probe relation.
pub const HASHJOIN_PARTITIONS: u64 = 16;

/// The reference workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// `scene.db`, 178 MB: ~56% of the blocks in runs of 1-3, random order,
    /// 4 frames each re-reading a quarter of the previous frame's runs.
    Render,
    /// `oo7.db`, 100 MB: depth-first traversal of an assembly tree whose
    /// nodes and 4-block composite parts lie at random places (pointer
    /// chasing); each base assembly visits 3 random shared parts; 32% of
    /// the file (documents) is never read. About 65% is touched.
    Oo7,
    /// `hotcold.dat`: 20 MB hot region then 80 MB cold; 20 phases of 512
    /// random hot pages then 256 random cold pages, in runs of 4.
    Hotcold,
    /// `random.dat`, 100 MB: every block once, in random order.
    Random,
    /// `reverse.dat`, 100 MB: every block, last to first.
    Reverse,
    /// Hotcold, 3 passes.
    CyclicHotcold,
    /// Random, 3 passes (the same order each pass).
    CyclicRandom,
    /// Reverse, 3 passes.
    CyclicReverse,
    /// `sequential.dat`, 100 MB, first block to last (negative control).
    Sequential,
    /// Hash join: `build.rel` (20 MB) read sequentially, then `probe.rel`
    /// (80 MB) partition by partition (16 partitions, block b in partition
    /// `mix64(seed ^ b) % 16`), ascending within a partition.
    Hashjoin,
}

impl WorkloadKind {
    /// Every workload, in documentation order.
    pub const ALL: [WorkloadKind; 10] = [
        WorkloadKind::Render,
        WorkloadKind::Oo7,
        WorkloadKind::Hotcold,
        WorkloadKind::Random,
        WorkloadKind::Reverse,
        WorkloadKind::CyclicHotcold,
        WorkloadKind::CyclicRandom,
        WorkloadKind::CyclicReverse,
        WorkloadKind::Sequential,
        WorkloadKind::Hashjoin,
    ];

    /// Command-line and job name.
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Render => "render",
            WorkloadKind::Oo7 => "oo7",
            WorkloadKind::Hotcold => "hotcold",
            WorkloadKind::Random => "random",
            WorkloadKind::Reverse => "reverse",
            WorkloadKind::CyclicHotcold => "cyclic-hotcold",
            WorkloadKind::CyclicRandom => "cyclic-random",
            WorkloadKind::CyclicReverse => "cyclic-reverse",
            WorkloadKind::Sequential => "sequential",
            WorkloadKind::Hashjoin => "hashjoin",
        }
    }

    /// The single-pass workload a cyclic variant repeats (itself otherwise).
    pub fn base(self) -> WorkloadKind {
        match self {
            WorkloadKind::CyclicHotcold => WorkloadKind::Hotcold,
            WorkloadKind::CyclicRandom => WorkloadKind::Random,
            WorkloadKind::CyclicReverse => WorkloadKind::Reverse,
            other => other,
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WorkloadKind {
    type Err = String;
    fn from_str(s: &str) -> Result<WorkloadKind, String> {
        WorkloadKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = WorkloadKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown workload {s:?} (one of {})", names.join(", "))
            })
    }
}

/// Generator parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenParams {
    /// Size factor relative to the paper (1.0 = 100 MB files).
    pub scale: f64,
    /// Seed of the access order and of the file contents.
    pub seed: u64,
    /// Block size in bytes.
    pub block_size: u32,
}

impl Default for GenParams {
    fn default() -> GenParams {
        GenParams {
            scale: DEFAULT_SCALE,
            seed: DEFAULT_SEED,
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }
}

/// Errors of the generator.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    /// Scale not in (0, [`MAX_SCALE`]].
    #[error("scale {0} must be a positive number of at most {MAX_SCALE}")]
    Scale(f64),
    /// Block size not allowed in hint files.
    #[error("{0}")]
    BlockSize(ErrorKind),
    /// Writing a data file or the manifest failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Writing the hint file failed.
    #[error(transparent)]
    Hints(#[from] HintError),
}

/// A file of the data set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileSpec {
    /// Path relative to the data set root.
    pub path: String,
    /// Size in bytes (a whole number of blocks).
    pub size: u64,
    /// Seed of its contents ([`content::file_seed`] of the data set seed
    /// and the path).
    pub file_seed: u64,
}

/// One read: `blocks` blocks of file `file` from block `block` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access {
    /// Index into [`Workload::files`].
    pub file: u32,
    /// First block.
    pub block: u64,
    /// Number of blocks.
    pub blocks: u32,
}

/// A generated workload: files and the job's accesses (one pass).
#[derive(Debug, Clone)]
pub struct Workload {
    /// Which workload.
    pub kind: WorkloadKind,
    /// Parameters it was generated with.
    pub params: GenParams,
    /// Passes (3 for cyclic variants).
    pub repeat: u32,
    /// Files of the data set.
    pub files: Vec<FileSpec>,
    /// The job's reads, in order (one pass).
    pub accesses: Vec<Access>,
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix64(self.0)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

struct Builder {
    params: GenParams,
    rng: Rng,
    files: Vec<FileSpec>,
    accesses: Vec<Access>,
}

impl Builder {
    /// Blocks for `mib` MiB at the current scale, at least `min`.
    fn blocks(&self, mib: f64, min: u64) -> u64 {
        let bytes = mib * (1u64 << 20) as f64 * self.params.scale;
        ((bytes / f64::from(self.params.block_size)) as u64).max(min)
    }

    fn file(&mut self, path: &str, blocks: u64) -> u32 {
        self.files.push(FileSpec {
            path: path.to_owned(),
            size: blocks * u64::from(self.params.block_size),
            file_seed: content::file_seed(self.params.seed, path),
        });
        (self.files.len() - 1) as u32
    }

    fn read(&mut self, file: u32, block: u64, blocks: u32) {
        self.accesses.push(Access {
            file,
            block,
            blocks,
        });
    }
}

impl Workload {
    /// Generates `kind` with `params`.
    pub fn generate(kind: WorkloadKind, params: &GenParams) -> Result<Workload, GenError> {
        if !(params.scale > 0.0 && params.scale <= MAX_SCALE) {
            return Err(GenError::Scale(params.scale));
        }
        validate_block_size(u64::from(params.block_size)).map_err(GenError::BlockSize)?;
        let base = kind.base();
        let mut b = Builder {
            params: *params,
            rng: Rng(params.seed ^ fnv1a64(base.name().as_bytes())),
            files: Vec::new(),
            accesses: Vec::new(),
        };
        match base {
            WorkloadKind::Render => render(&mut b),
            WorkloadKind::Oo7 => oo7(&mut b),
            WorkloadKind::Hotcold => hotcold(&mut b),
            WorkloadKind::Random => {
                let n = b.blocks(100.0, 16);
                let f = b.file("random.dat", n);
                let mut order: Vec<u64> = (0..n).collect();
                b.rng.shuffle(&mut order);
                for block in order {
                    b.read(f, block, 1);
                }
            }
            WorkloadKind::Reverse => {
                let n = b.blocks(100.0, 16);
                let f = b.file("reverse.dat", n);
                for block in (0..n).rev() {
                    b.read(f, block, 1);
                }
            }
            WorkloadKind::Sequential => {
                let n = b.blocks(100.0, 16);
                let f = b.file("sequential.dat", n);
                for block in 0..n {
                    b.read(f, block, 1);
                }
            }
            WorkloadKind::Hashjoin => hashjoin(&mut b),
            WorkloadKind::CyclicHotcold
            | WorkloadKind::CyclicRandom
            | WorkloadKind::CyclicReverse => {
                unreachable!("base() maps cyclic variants to their single-pass workload")
            }
        }
        Ok(Workload {
            kind,
            params: *params,
            repeat: if base == kind { 1 } else { CYCLIC_REPEAT },
            files: b.files,
            accesses: b.accesses,
        })
    }

    /// The job name (the workload's name).
    pub fn job(&self) -> &'static str {
        self.kind.name()
    }

    /// The header: job, block size, repeat and every file with its size
    /// (no mtime: [`write_dataset`] adds those once the files exist).
    pub fn header(&self) -> HintHeader {
        HintHeader {
            repeat: self.repeat,
            files: self
                .files
                .iter()
                .map(|f| FileDecl {
                    path: f.path.clone(),
                    size: f.size,
                    mtime_ns: None,
                })
                .collect(),
            ..HintHeader::new(self.job(), self.params.block_size)
        }
    }

    /// The accesses as hint records (one pass).
    pub fn records(&self) -> impl Iterator<Item = HintRecord> + '_ {
        let bs = u64::from(self.params.block_size);
        self.accesses.iter().map(move |a| HintRecord {
            path: self.files[a.file as usize].path.clone(),
            offset: a.block * bs,
            length: u64::from(a.blocks) * bs,
        })
    }
}

fn render(b: &mut Builder) {
    let n = b.blocks(178.0, 16);
    let f = b.file("scene.db", n);
    // The database as objects of 1-3 blocks; the job touches a random
    // selection of them covering RENDER_TOUCHED of the file.
    let mut objects = Vec::new();
    let mut at = 0;
    while at < n {
        let len = (1 + b.rng.below(3)).min(n - at);
        objects.push((at, len as u32));
        at += len;
    }
    b.rng.shuffle(&mut objects);
    let target = (n as f64 * RENDER_TOUCHED).ceil() as u64;
    let mut touched = 0;
    let chosen: Vec<(u64, u32)> = objects
        .into_iter()
        .take_while(|&(_, len)| {
            let take = touched < target;
            touched += u64::from(len);
            take
        })
        .collect();
    let per_frame = chosen.len().div_ceil(RENDER_FRAMES);
    let mut previous: Vec<(u64, u32)> = Vec::new();
    for frame in chosen.chunks(per_frame.max(1)) {
        // Moving the viewpoint closer revisits part of what the last frame saw.
        b.rng.shuffle(&mut previous);
        for &(block, len) in &previous[..previous.len() / 4] {
            b.read(f, block, len);
        }
        for &(block, len) in frame {
            b.read(f, block, len);
        }
        previous = frame.to_vec();
    }
}

fn oo7(b: &mut Builder) {
    enum Object {
        Node(usize),
        Part(usize),
        Document,
    }
    let n = b.blocks(100.0, 64);
    let f = b.file("oo7.db", n);
    // Structure (parts + assemblies, about 5.5 blocks per part) fills 68%.
    let parts = ((n as f64 * 0.68 / 5.5) as usize).max(1);
    let bases = parts;
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); bases];
    let mut level: Vec<usize> = (0..bases).collect();
    while level.len() > 1 {
        let mut up = Vec::new();
        for group in level.chunks(OO7_FANOUT) {
            children.push(group.to_vec());
            up.push(children.len() - 1);
        }
        level = up;
    }
    let root = level[0];
    let nodes = children.len();
    let structure = nodes as u64 + parts as u64 * u64::from(OO7_PART_BLOCKS);
    let mut objects: Vec<Object> = (0..nodes)
        .map(Object::Node)
        .chain((0..parts).map(Object::Part))
        .chain((structure..n).map(|_| Object::Document))
        .collect();
    b.rng.shuffle(&mut objects);
    let (mut node_block, mut part_block) = (vec![0u64; nodes], vec![0u64; parts]);
    let mut at = 0;
    for o in &objects {
        match *o {
            Object::Node(i) => {
                node_block[i] = at;
                at += 1;
            }
            Object::Part(i) => {
                part_block[i] = at;
                at += u64::from(OO7_PART_BLOCKS);
            }
            Object::Document => at += 1,
        }
    }
    let atom_order: Vec<Vec<u64>> = (0..parts)
        .map(|_| {
            let mut o: Vec<u64> = (0..u64::from(OO7_PART_BLOCKS)).collect();
            b.rng.shuffle(&mut o);
            o
        })
        .collect();
    let part_refs: Vec<Vec<usize>> = (0..bases)
        .map(|_| {
            (0..OO7_PARTS_PER_BASE)
                .map(|_| b.rng.below(parts as u64) as usize)
                .collect()
        })
        .collect();
    let mut stack = vec![root];
    while let Some(node) = stack.pop() {
        b.read(f, node_block[node], 1);
        if node < bases {
            for &p in &part_refs[node] {
                for &atom in &atom_order[p] {
                    b.read(f, part_block[p] + atom, 1);
                }
            }
        } else {
            stack.extend(children[node].iter().rev());
        }
    }
}

fn hotcold(b: &mut Builder) {
    let hot = b.blocks(20.0, 8);
    let cold = b.blocks(80.0, 8);
    let f = b.file("hotcold.dat", hot + cold);
    let run = u64::from(RUN_PAGES);
    for _ in 0..HOTCOLD_PHASES {
        for _ in 0..HOT_PAGES / RUN_PAGES as usize {
            let start = b.rng.below(hot - run + 1);
            b.read(f, start, RUN_PAGES);
        }
        for _ in 0..COLD_PAGES / RUN_PAGES as usize {
            let start = hot + b.rng.below(cold - run + 1);
            b.read(f, start, RUN_PAGES);
        }
    }
}

fn hashjoin(b: &mut Builder) {
    let nb = b.blocks(20.0, 8);
    let np = b.blocks(80.0, 16);
    let build = b.file("build.rel", nb);
    let probe = b.file("probe.rel", np);
    for block in 0..nb {
        b.read(build, block, 1);
    }
    let seed = b.params.seed;
    let mut partitions: Vec<Vec<u64>> = vec![Vec::new(); HASHJOIN_PARTITIONS as usize];
    for block in 0..np {
        partitions[(hashjoin_partition(seed, block)) as usize].push(block);
    }
    for partition in partitions {
        for block in partition {
            b.read(probe, block, 1);
        }
    }
}

/// The partition of probe block `block` in the hash join workload.
pub fn hashjoin_partition(seed: u64, block: u64) -> u64 {
    mix64(seed ^ block) % HASHJOIN_PARTITIONS
}

/// What [`write_dataset`] wrote; also saved as `manifest.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Manifest {
    /// Which workload.
    pub workload: WorkloadKind,
    /// Job name in the hint file.
    pub job: String,
    /// Data set seed.
    pub seed: u64,
    /// Size factor.
    pub scale: f64,
    /// Block size.
    pub block_size: u32,
    /// Passes.
    pub repeat: u32,
    /// Data set root, relative to the output directory (`data`).
    pub root: String,
    /// Hint file, relative to the output directory (`JOB.hints`).
    pub hints: String,
    /// Form of the hint file.
    pub format: Format,
    /// Records per pass.
    pub records: u64,
    /// Files of the data set.
    pub files: Vec<FileSpec>,
}

/// Name of the data set root under the output directory.
pub const DATA_DIR: &str = "data";

/// Writes the workload under `out`: the files in `out/data/`, the hint file
/// `out/JOB.hints` in `format` (declaring every file with its size and
/// mtime) and `out/manifest.json`.
pub fn write_dataset(w: &Workload, out: &Path, format: Format) -> Result<Manifest, GenError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| GenError::Io { path, source }
    };
    let root = out.join(DATA_DIR);
    fs::create_dir_all(&root).map_err(io_err(&root))?;
    let mut header = w.header();
    let mut chunk = vec![0u8; 1 << 20];
    for (spec, decl) in w.files.iter().zip(header.files.iter_mut()) {
        let path = root.join(&spec.path);
        let mut file = File::create(&path).map_err(io_err(&path))?;
        let mut at = 0;
        while at < spec.size {
            let n = (spec.size - at).min(chunk.len() as u64) as usize;
            content::fill(spec.file_seed, at, &mut chunk[..n]);
            file.write_all(&chunk[..n]).map_err(io_err(&path))?;
            at += n as u64;
        }
        drop(file);
        let meta = fs::metadata(&path).map_err(io_err(&path))?;
        let mtime = meta.modified().map_err(io_err(&path))?;
        let ns = mtime
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|e| io::Error::other(e.to_string()))
            .map_err(io_err(&path))?
            .as_nanos();
        decl.mtime_ns = Some(i64::try_from(ns).unwrap_or(i64::MAX));
    }
    let hints_name = format!("{}.hints", w.job());
    let mut writer = HintWriter::create(&out.join(&hints_name), format, &header)?;
    for r in w.records() {
        writer.write(&r)?;
    }
    writer.finish()?;
    let manifest = Manifest {
        workload: w.kind,
        job: w.job().to_owned(),
        seed: w.params.seed,
        scale: w.params.scale,
        block_size: w.params.block_size,
        repeat: w.repeat,
        root: DATA_DIR.to_owned(),
        hints: hints_name,
        format,
        records: w.accesses.len() as u64,
        files: w.files.clone(),
    };
    let path = out.join("manifest.json");
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| io_err(&path)(e.into()))?;
    fs::write(&path, json).map_err(io_err(&path))?;
    Ok(manifest)
}
