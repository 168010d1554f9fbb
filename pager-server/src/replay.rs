//! Recorded pages replayed through the real store (`make bench-compress`):
//! what a donor would hold for the pages a program really swapped, under
//! each `compress=`, and what compressing and decompressing them costs.
//!
//! A dump is a plain file of 4 KiB pages (the recorder writes the pages
//! zram held for a program, zero pages included). [`replay`] writes them
//! into one export of a fresh [`Pool`] in requests of `batch` pages, as a
//! donor's nbdkit writes would (page `i` at offset `i * 4096`), reads them
//! all back and compares every byte: a page that does not come back as
//! written is an error, never a number.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{Compress, ExportSpec, Recompress, PAGE_SIZE};
use crate::store::{codec, Export, OpenError, Pool, StoreError};

const PAGE: u64 = PAGE_SIZE as u64;

/// Why a replay could not measure.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("the dump holds {0} bytes: not a whole, non-zero number of 4 KiB pages")]
    NotPages(usize),
    #[error("request size of {0} pages: at least 1")]
    Batch(usize),
    #[error("compress={codec}: cannot open the replay export: {source}")]
    Open {
        codec: &'static str,
        source: OpenError,
    },
    #[error("compress={codec}: {what} of pages {first}..{end}: {source}")]
    Store {
        codec: &'static str,
        what: &'static str,
        first: u64,
        end: u64,
        source: StoreError,
    },
    #[error("compress={codec}: page {page} read back differs from what was written, first at byte {byte}")]
    Mismatch {
        codec: &'static str,
        page: u64,
        byte: usize,
    },
    #[error("compress={codec}: the codec alone does not give back the {index}th page it compressed: {why}")]
    Codec {
        codec: &'static str,
        index: u64,
        why: String,
    },
    #[error("this thread's CPU time (CLOCK_THREAD_CPUTIME_ID): {why}")]
    CpuTime { why: String },
}

/// What one codec made of a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replay {
    pub codec: Compress,
    /// Pages in the dump.
    pub pages: u64,
    /// Of which all zeros.
    pub zero_pages: u64,
    /// The store's own count: bytes of the pages it holds as data (a zero
    /// page is none).
    pub logical_bytes: u64,
    /// Slab pages held, raw or in zspages: the budget's use.
    pub stored_bytes: u64,
    /// Slabs mapped: what the node really gives up, size-class and slab
    /// slack and the spare slab included.
    pub mapped_bytes: u64,
    /// This thread's CPU time in the writes, and in the reads back.
    pub write_cpu: Duration,
    pub read_cpu: Duration,
    /// The codec alone on the same pages (`None` with `compress=off`).
    pub codec_cost: Option<CodecCost>,
    /// With `compress=lz4`: the same pages once the recompressor packed
    /// every one of them again (all cold), with each of its codecs.
    pub cold: Vec<Cold>,
}

/// The pages of a replay written afresh with lz4, after the recompressor's
/// pass over all of them, every byte read back and compared again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cold {
    /// The recompressor's codec.
    pub codec: Recompress,
    /// Pages it packed again (those its codec holds in a smaller class).
    pub pages: u64,
    pub stored_bytes: u64,
    pub mapped_bytes: u64,
    /// This thread's CPU time in the pass, and in reading every page back.
    pub recompress_cpu: Duration,
    pub read_cpu: Duration,
}

/// What the codec alone costs on a dump's pages, with no store around it:
/// one reused buffer, so no memory is mapped or faulted in while the
/// clock runs. Through the store a fresh slab's page faults count too,
/// and on a VM whose balloon reports free memory to the host (the lab's:
/// virtio-balloon free page reporting, in 2 MiB blocks, a slab's size)
/// each can be a fault on the host: `compress=off` wrote the same pages at
/// 450 to 10000 MB per CPU-second from one run to the next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodecCost {
    /// Bytes of the pages compressed (every page the store would try to
    /// compress: not filled with one word) and the CPU it took.
    pub compressed_bytes: u64,
    pub compress_cpu: Duration,
    /// Bytes of the pages that came out smaller than a page, decompressed
    /// back, and the CPU it took.
    pub decompressed_bytes: u64,
    pub decompress_cpu: Duration,
}

impl Replay {
    /// Bytes the pages were as written, zero pages included (what zram
    /// counts as its `orig_data_size`).
    pub fn dump_bytes(&self) -> u64 {
        self.pages * PAGE
    }
}

/// This thread's CPU time so far: neither another process on the machine
/// nor a wait for the CPU counts.
fn thread_cpu() -> Result<Duration, ReplayError> {
    crate::sys::thread_cpu_time().map_err(|e| ReplayError::CpuTime { why: e.to_string() })
}

/// A fresh store with `codec` and one export sized for `dump`.
fn fresh_store(dump: &[u8], codec: Compress) -> Result<(Pool, Arc<Export>), ReplayError> {
    let pages = (dump.len() / PAGE_SIZE) as u64;
    // Room for every page raw and the zspages' slack: a replay measures
    // what the pages take, it never runs into the budget.
    let pool = Pool::new(2 * pages + 1024, 1, codec);
    let spec = ExportSpec {
        name: "replay".into(),
        size: Some(pages * PAGE),
    };
    let export = pool
        .open(&spec, pages * PAGE)
        .map_err(|source| ReplayError::Open {
            codec: codec.word(),
            source,
        })?;
    Ok((pool, export))
}

/// The requests of a replay, `batch` pages each, through one export.
struct Requests<'a> {
    dump: &'a [u8],
    export: &'a Export,
    codec: Compress,
    request: usize,
}

impl Requests<'_> {
    fn fail(
        &self,
        what: &'static str,
        at: usize,
        len: usize,
    ) -> impl FnOnce(StoreError) -> ReplayError {
        let first = (at / PAGE_SIZE) as u64;
        let codec = self.codec.word();
        move |source| ReplayError::Store {
            codec,
            what,
            first,
            end: first + (len / PAGE_SIZE) as u64,
            source,
        }
    }

    /// Writes every page; this thread's CPU time it took.
    fn write_all(&self) -> Result<Duration, ReplayError> {
        let t0 = thread_cpu()?;
        for (i, chunk) in self.dump.chunks(self.request).enumerate() {
            let at = i * self.request;
            self.export
                .write(chunk, at as u64, 0)
                .map_err(self.fail("write", at, chunk.len()))?;
        }
        Ok(thread_cpu()?.saturating_sub(t0))
    }

    /// Reads every page back into `back` (filled first, so its pages are
    /// faulted in before the clock starts, as a donor's reused reply
    /// buffers are, and so a page the store failed to write does not read
    /// back as zeros by chance) and compares; the CPU time of the reads.
    fn read_all(&self, back: &mut [u8]) -> Result<Duration, ReplayError> {
        back.fill(0xA5);
        let t0 = thread_cpu()?;
        for (i, chunk) in back.chunks_mut(self.request).enumerate() {
            let at = i * self.request;
            let len = chunk.len();
            self.export
                .read(chunk, at as u64, 0)
                .map_err(self.fail("read", at, len))?;
        }
        let cpu = thread_cpu()?.saturating_sub(t0);
        compare(self.dump, back, self.codec)?;
        Ok(cpu)
    }
}

/// Writes the pages of `dump` through a fresh store with `codec`, in
/// requests of `batch` pages, reads them back and checks every byte; see
/// the module's documentation.
pub fn replay(dump: &[u8], codec: Compress, batch: usize) -> Result<Replay, ReplayError> {
    if dump.is_empty() || !dump.len().is_multiple_of(PAGE_SIZE) {
        return Err(ReplayError::NotPages(dump.len()));
    }
    if batch == 0 {
        return Err(ReplayError::Batch(batch));
    }
    let (pool, export) = fresh_store(dump, codec)?;
    let requests = Requests {
        dump,
        export: &export,
        codec,
        request: batch * PAGE_SIZE,
    };
    let write_cpu = requests.write_all()?;
    let mut back = vec![0u8; dump.len()];
    let read_cpu = requests.read_all(&mut back)?;
    let zero_pages = dump
        .chunks(PAGE_SIZE)
        .filter(|p| p.iter().all(|&b| b == 0))
        .count() as u64;
    let cold = match codec {
        Compress::Lz4 => [Recompress::Zstd, Recompress::Lz4hc]
            .into_iter()
            .map(|r| cold_pass(dump, batch, r, &mut back))
            .collect::<Result<_, _>>()?,
        _ => Vec::new(),
    };
    Ok(Replay {
        codec,
        pages: (dump.len() / PAGE_SIZE) as u64,
        zero_pages,
        logical_bytes: pool.logical_bytes(),
        stored_bytes: pool.stored_bytes(),
        mapped_bytes: pool.mapped_bytes(),
        write_cpu,
        read_cpu,
        codec_cost: match codec {
            Compress::Off => None,
            _ => Some(codec_cost(dump, codec)?),
        },
        cold,
    })
}

/// The dump written with lz4 into a fresh store, then the recompressor's
/// pass with `cold` over every page; `back` is the read-back buffer.
fn cold_pass(
    dump: &[u8],
    batch: usize,
    cold: Recompress,
    back: &mut [u8],
) -> Result<Cold, ReplayError> {
    let (pool, export) = fresh_store(dump, Compress::Lz4)?;
    let requests = Requests {
        dump,
        export: &export,
        codec: Compress::Lz4,
        request: batch * PAGE_SIZE,
    };
    requests.write_all()?;
    let t0 = thread_cpu()?;
    let pass = pool.recompress(cold, u32::MAX, u64::MAX);
    // As the donor's watch thread does after each pass: the classes the
    // pages left are emptied into fewer zspages, and slabs left part used
    // are emptied (one a call) and unmapped.
    pool.compact();
    while pool.evacuate(u64::MAX) > 0 {}
    let recompress_cpu = thread_cpu()?.saturating_sub(t0);
    Ok(Cold {
        codec: cold,
        pages: pass.pages,
        stored_bytes: pool.stored_bytes(),
        mapped_bytes: pool.mapped_bytes(),
        recompress_cpu,
        read_cpu: requests.read_all(back)?,
    })
}

/// Every page read back is the page written.
fn compare(dump: &[u8], back: &[u8], codec: Compress) -> Result<(), ReplayError> {
    for (page, (want, got)) in dump
        .chunks(PAGE_SIZE)
        .zip(back.chunks(PAGE_SIZE))
        .enumerate()
    {
        if let Some(byte) = want.iter().zip(got).position(|(a, b)| a != b) {
            return Err(ReplayError::Mismatch {
                codec: codec.word(),
                page: page as u64,
                byte,
            });
        }
    }
    Ok(())
}

/// See [`CodecCost`].
fn codec_cost(dump: &[u8], codec: Compress) -> Result<CodecCost, ReplayError> {
    let pages: Vec<&[u8]> = dump
        .chunks(PAGE_SIZE)
        .filter(|p| codec::same_filled(p).is_none())
        .collect();
    // Every object back to back; filled first so that its pages are
    // faulted in before the clock starts.
    let mut objects = vec![0xA5u8; pages.len() * codec::BOUND];
    let mut lens = Vec::with_capacity(pages.len());
    let t0 = thread_cpu()?;
    for (page, out) in pages.iter().zip(objects.chunks_exact_mut(codec::BOUND)) {
        let out: &mut [u8; codec::BOUND] = out.try_into().expect("chunks of BOUND");
        lens.push(codec::compress(codec, page, out, PAGE_SIZE - 1));
    }
    let compress_cpu = thread_cpu()?.saturating_sub(t0);
    let mut page = [0u8; PAGE_SIZE];
    let mut decompressed = 0u64;
    let t0 = thread_cpu()?;
    for (i, (len, object)) in lens
        .iter()
        .zip(objects.chunks_exact(codec::BOUND))
        .enumerate()
    {
        let Some(n) = *len else { continue };
        codec::decompress(codec, &object[..n], &mut page).map_err(|e| ReplayError::Codec {
            codec: codec.word(),
            index: i as u64,
            why: e.to_string(),
        })?;
        decompressed += 1;
    }
    let decompress_cpu = thread_cpu()?.saturating_sub(t0);
    Ok(CodecCost {
        compressed_bytes: pages.len() as u64 * PAGE,
        compress_cpu,
        decompressed_bytes: decompressed * PAGE,
        decompress_cpu,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of every kind a swap device gets: zeros, one repeated word,
    /// text-like bytes, noise, and half text half noise.
    fn synthetic(each: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut noise = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        let words = [&b"page "[..], b"swap ", b"donor ", b"netpager ", b"the "];
        let mut dump = Vec::new();
        for i in 0..each {
            dump.extend(std::iter::repeat_n(0u8, PAGE_SIZE));
            dump.extend((0..PAGE_SIZE).map(|j| [7u8, 0, 0, 0, 1, 0, 0, i as u8][j % 8]));
            let mut text = Vec::with_capacity(PAGE_SIZE);
            while text.len() < PAGE_SIZE {
                text.extend_from_slice(words[usize::from(noise()) % words.len()]);
            }
            dump.extend_from_slice(&text[..PAGE_SIZE]);
            dump.extend((0..PAGE_SIZE).map(|_| noise()));
            dump.extend((0..PAGE_SIZE).map(|j| if j < PAGE_SIZE / 2 { noise() } else { b'v' }));
        }
        dump
    }

    #[test]
    fn every_codec_gives_back_every_byte_and_compression_holds_less() {
        let dump = synthetic(40);
        let off = replay(&dump, Compress::Off, 16).unwrap();
        assert_eq!(off.pages, 200);
        assert_eq!(off.zero_pages, 40);
        // Zeros take nothing; with compress=off every other page is raw.
        assert_eq!(off.logical_bytes, 160 * PAGE);
        assert_eq!(off.stored_bytes, 160 * PAGE);
        for codec in [Compress::Lz4, Compress::Zstd] {
            // An odd request size: requests cross groups and shards.
            let r = replay(&dump, codec, 7).unwrap();
            assert_eq!(r.logical_bytes, off.logical_bytes, "{codec:?}");
            assert!(
                r.stored_bytes < off.stored_bytes * 3 / 4,
                "{codec:?}: {} stored of {} raw",
                r.stored_bytes,
                off.stored_bytes
            );
            assert!(r.mapped_bytes >= r.stored_bytes, "{codec:?}");
            // Zeros and the repeated word are not compressed; noise is,
            // but does not come back smaller than a page.
            let cost = r.codec_cost.expect("a codec");
            assert_eq!(cost.compressed_bytes, 120 * PAGE, "{codec:?}");
            assert_eq!(cost.decompressed_bytes, 80 * PAGE, "{codec:?}");
        }
        assert_eq!(off.codec_cost, None);
        // The recompressor's pass (lz4 only) read back every byte again and
        // holds the pages in no more than lz4 did, in what zstd takes.
        let lz4 = replay(&dump, Compress::Lz4, 16).unwrap();
        let zstd = replay(&dump, Compress::Zstd, 16).unwrap();
        let codecs: Vec<Recompress> = lz4.cold.iter().map(|c| c.codec).collect();
        assert_eq!(codecs, [Recompress::Zstd, Recompress::Lz4hc]);
        for cold in &lz4.cold {
            assert!(cold.pages > 0, "{cold:?}");
            assert!(cold.stored_bytes <= lz4.stored_bytes, "{cold:?}");
        }
        let cold = &lz4.cold[0];
        assert!(
            cold.stored_bytes <= zstd.stored_bytes + PAGE,
            "{} cold against {} zstd",
            cold.stored_bytes,
            zstd.stored_bytes
        );
        assert!(zstd.cold.is_empty());
    }

    #[test]
    fn noise_is_kept_raw_and_takes_no_more_than_off() {
        let mut x = 1u64;
        let dump: Vec<u8> = (0..64 * PAGE_SIZE)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        for codec in Compress::ALL {
            let r = replay(&dump, codec, 16).unwrap();
            assert_eq!(r.stored_bytes, 64 * PAGE, "{codec:?}");
        }
    }

    #[test]
    fn a_dump_of_no_whole_pages_is_refused() {
        assert!(matches!(
            replay(&[1; 100], Compress::Lz4, 16),
            Err(ReplayError::NotPages(100))
        ));
        assert!(matches!(
            replay(&[], Compress::Lz4, 16),
            Err(ReplayError::NotPages(0))
        ));
        assert!(matches!(
            replay(&[1; 4096], Compress::Lz4, 0),
            Err(ReplayError::Batch(0))
        ));
    }
}
