//! [`Stats`]: what a hint file asks for, computed in one streaming pass.

use std::collections::HashMap;

use serde::Serialize;

use crate::{Format, HintError, HintReader};

/// Blocks per bitmap chunk (4096 blocks = 512 bytes of bits).
const CHUNK_BLOCKS: u64 = 4096;
type Chunk = Box<[u64; (CHUNK_BLOCKS / 64) as usize]>;

/// Summary of a hint file. Totals count every pass; the records are read
/// once and multiplied by the repeat count, since each pass is the same.
///
/// Distinct blocks are exact: a sparse bitmap per file (chunks of 4096
/// blocks, allocated only where a record lands) remembers which blocks were
/// seen, so memory grows with the touched area (512 bytes per 4096-block
/// region touched, i.e. 32 MiB at 8 KiB blocks for 2 TiB touched), not
/// with the number of records.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    /// Job name.
    pub job: String,
    /// Form of the file.
    pub format: Format,
    /// Block size of the header.
    pub block_size: u32,
    /// Repeat count of the header.
    pub passes: u32,
    /// Files declared in the header.
    pub declared_files: u64,
    /// Distinct paths the records name.
    pub files: u64,
    /// Records in the file (one pass).
    pub records_per_pass: u64,
    /// Records over all passes.
    pub records: u64,
    /// Block references over all passes (a record touching blocks 3..5
    /// counts 3).
    pub blocks: u64,
    /// Different (file, block) pairs touched.
    pub distinct_blocks: u64,
    /// Sum of record lengths over all passes.
    pub bytes: u64,
    /// `distinct_blocks * block_size`: block-granular, so a partial block
    /// counts whole.
    pub distinct_bytes: u64,
    /// `bytes / distinct_bytes` (0 when nothing is read): how many times,
    /// on average, each distinct byte is read.
    pub reuse: f64,
}

impl HintReader {
    /// Reads one pass and summarises it; see [`Stats`].
    pub fn stats(mut self) -> Result<Stats, HintError> {
        let bs = self.header().block_size;
        let mut paths: HashMap<String, u32> = HashMap::new();
        let mut seen: HashMap<(u32, u64), Chunk> = HashMap::new();
        let (mut records, mut blocks, mut bytes, mut distinct) = (0u64, 0u64, 0u64, 0u64);
        for r in self.by_ref() {
            let r = r?;
            let next_id = paths.len() as u32;
            let id = match paths.get(r.path.as_str()) {
                Some(&id) => id,
                None => {
                    paths.insert(r.path.clone(), next_id);
                    next_id
                }
            };
            records += 1;
            bytes = bytes.saturating_add(r.length);
            let range = r.blocks(bs);
            blocks = blocks.saturating_add(range.end - range.start);
            for b in range {
                let chunk = seen
                    .entry((id, b / CHUNK_BLOCKS))
                    .or_insert_with(|| Box::new([0; (CHUNK_BLOCKS / 64) as usize]));
                let bit = b % CHUNK_BLOCKS;
                let word = &mut chunk[(bit / 64) as usize];
                let mask = 1u64 << (bit % 64);
                if *word & mask == 0 {
                    *word |= mask;
                    distinct += 1;
                }
            }
        }
        let h = self.header();
        let passes = u64::from(h.repeat);
        let total_bytes = bytes.saturating_mul(passes);
        let distinct_bytes = distinct.saturating_mul(u64::from(bs));
        Ok(Stats {
            job: h.job.clone(),
            format: self.format(),
            block_size: bs,
            passes: h.repeat,
            declared_files: h.files.len() as u64,
            files: paths.len() as u64,
            records_per_pass: records,
            records: records.saturating_mul(passes),
            blocks: blocks.saturating_mul(passes),
            distinct_blocks: distinct,
            bytes: total_bytes,
            distinct_bytes,
            reuse: if distinct_bytes == 0 {
                0.0
            } else {
                total_bytes as f64 / distinct_bytes as f64
            },
        })
    }
}
