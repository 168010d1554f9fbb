//! What a page becomes in the store (`compress=`): nothing (a page filled
//! with one repeated 8-byte word, zeros above all, is kept as that word, as
//! zram keeps its "same" pages), a compressed object, or the raw page when
//! it does not compress below [`super::zs::ZsPool::max_packed`].

use std::cell::RefCell;

use crate::config::PAGE_SIZE;
pub use crate::config::{Compress, Recompress};

/// A stored object that does not decompress to a page: memory corrupted
/// under the store, never a client's doing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{codec} object of {len} bytes does not decompress to a page: {why}")]
pub struct CorruptObject {
    pub codec: &'static str,
    pub len: usize,
    pub why: String,
}

/// The word a page repeats, if it is one word over and over.
pub fn same_filled(page: &[u8]) -> Option<u64> {
    debug_assert_eq!(page.len(), PAGE_SIZE);
    let (head, words, tail) = {
        let (chunks, rest) = page.as_chunks::<8>();
        (chunks.first()?, chunks, rest)
    };
    debug_assert!(tail.is_empty());
    let w = u64::from_ne_bytes(*head);
    words
        .iter()
        .all(|c| u64::from_ne_bytes(*c) == w)
        .then_some(w)
}

/// Fills `out` with the word `w` over and over.
pub fn fill_same(out: &mut [u8], w: u64, page_offset: usize) {
    let bytes = w.to_ne_bytes();
    for (i, b) in out.iter_mut().enumerate() {
        *b = bytes[(page_offset + i) % 8];
    }
}

// One zstd context per thread, made on first use (a context is about
// 1 MiB for compression: per call it would cost more than the page).
thread_local! {
    static ZSTD_C: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static ZSTD_D: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// zstd's level: 1 is its fastest regular level; denser levels cost far
/// more CPU for a few percent on swapped pages.
const ZSTD_LEVEL: i32 = 1;

/// Room a compressed page may need (lz4_flex wants its worst case up
/// front; zstd stops when a smaller buffer is full).
pub const BOUND: usize = lz4_flex::block::get_maximum_output_size(PAGE_SIZE);

/// Compresses a page into `out`; `None` when it takes more than `limit`
/// bytes (the caller keeps the page raw). `Off` never compresses.
pub fn compress(c: Compress, page: &[u8], out: &mut [u8; BOUND], limit: usize) -> Option<usize> {
    debug_assert_eq!(page.len(), PAGE_SIZE);
    let n = match c {
        Compress::Off => None,
        Compress::Lz4 => lz4_flex::block::compress_into(page, out).ok(),
        Compress::Zstd => ZSTD_C.with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.is_none() {
                *slot = zstd::bulk::Compressor::new(ZSTD_LEVEL).ok();
            }
            let z = slot.as_mut()?;
            z.compress_to_buffer(page, &mut out[..limit]).ok()
        }),
    }?;
    (n <= limit).then_some(n)
}

/// LZ4-HC's level for the recompressor: LZ4's first level that searches
/// chains of matches; the levels above find a percent more on real pages
/// for several times the CPU (pager-server(1)).
const LZ4HC_LEVEL: i32 = 4;

/// Compresses a cold page with the recompressor's codec into `out`;
/// `None` when it takes more than `limit` bytes, or the recompressor is
/// off. An LZ4-HC object is an LZ4 block: `Compress::Lz4` decompresses it.
pub fn recompress(
    r: Recompress,
    page: &[u8],
    out: &mut [u8; BOUND],
    limit: usize,
) -> Option<usize> {
    debug_assert_eq!(page.len(), PAGE_SIZE);
    match r {
        Recompress::Off => None,
        Recompress::Zstd => compress(Compress::Zstd, page, out, limit),
        Recompress::Lz4hc => {
            crate::sys::lz4hc_compress(page, &mut out[..limit.min(BOUND)], LZ4HC_LEVEL)
        }
    }
}

/// Decompresses `src` (made by [`compress`] with the same codec) into the
/// page `out`.
pub fn decompress(c: Compress, src: &[u8], out: &mut [u8]) -> Result<(), CorruptObject> {
    debug_assert_eq!(out.len(), PAGE_SIZE);
    let bad = |why: String| CorruptObject {
        codec: c.word(),
        len: src.len(),
        why,
    };
    let n = match c {
        Compress::Off => return Err(bad("compress=off stores no objects".into())),
        Compress::Lz4 => {
            lz4_flex::block::decompress_into(src, out).map_err(|e| bad(e.to_string()))?
        }
        Compress::Zstd => ZSTD_D.with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.is_none() {
                *slot = Some(zstd::bulk::Decompressor::new().map_err(|e| bad(e.to_string()))?);
            }
            let z = slot.as_mut().expect("just made");
            z.decompress_to_buffer(src, out)
                .map_err(|e| bad(e.to_string()))
        })?,
    };
    if n != PAGE_SIZE {
        return Err(bad(format!("gave {n} bytes")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_filled_pages_are_one_word() {
        let mut p = vec![0u8; PAGE_SIZE];
        assert_eq!(same_filled(&p), Some(0));
        for c in p.chunks_mut(8) {
            c.copy_from_slice(&0x0102_0304_0506_0708u64.to_ne_bytes());
        }
        let w = same_filled(&p).unwrap();
        let mut back = vec![0u8; 100];
        fill_same(&mut back, w, 4);
        assert_eq!(back[..], p[4..104]);
        p[4095] ^= 1;
        assert_eq!(same_filled(&p), None);
    }

    #[test]
    fn every_codec_round_trips_and_refuses_what_does_not_fit() {
        let text: Vec<u8> = (0..PAGE_SIZE)
            .map(|i| b"netpager "[i % 9] ^ (i / 512) as u8)
            .collect();
        let mut noise = vec![0u8; PAGE_SIZE];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for b in &mut noise {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        for c in [Compress::Lz4, Compress::Zstd] {
            let mut out = [0u8; BOUND];
            let n = compress(c, &text, &mut out, 3000).expect("text compresses");
            assert!(n < 1000, "{c:?}: {n}");
            let mut page = vec![0u8; PAGE_SIZE];
            decompress(c, &out[..n], &mut page).unwrap();
            assert_eq!(page, text);
            assert_eq!(
                compress(c, &noise, &mut out, 3000),
                None,
                "{c:?}: noise fits"
            );
            assert_eq!(
                compress(c, &text, &mut out, n - 1),
                None,
                "{c:?}: over the limit"
            );
            assert!(decompress(c, &out[..n / 2], &mut page).is_err());
        }
        assert_eq!(
            compress(Compress::Off, &text, &mut [0u8; BOUND], 4096),
            None
        );
        // LZ4-HC: LZ4 blocks, no larger than plain LZ4's.
        let mut out = [0u8; BOUND];
        let lz4 = compress(Compress::Lz4, &text, &mut out, 4096).unwrap();
        let n = recompress(Recompress::Lz4hc, &text, &mut out, 4096).expect("text compresses");
        assert!(n <= lz4, "{n} against lz4's {lz4}");
        let mut page = vec![0u8; PAGE_SIZE];
        decompress(Compress::Lz4, &out[..n], &mut page).unwrap();
        assert_eq!(page, text);
        assert_eq!(recompress(Recompress::Lz4hc, &noise, &mut out, 3000), None);
        assert_eq!(recompress(Recompress::Lz4hc, &text, &mut out, n - 1), None);
        assert_eq!(recompress(Recompress::Off, &text, &mut out, 4096), None);
        let z = recompress(Recompress::Zstd, &text, &mut out, 4096).unwrap();
        decompress(Compress::Zstd, &out[..z], &mut page).unwrap();
        assert_eq!(page, text);
        assert_eq!(Compress::parse("zstd"), Some(Compress::Zstd));
        assert_eq!(Compress::parse("gzip"), None);
    }
}
