//! The content function of generated data sets, so readers can verify
//! every byte they get (FORMAT.md, "Generated data sets").
//!
//! A file's bytes are a pure function of its `file_seed` and the offset:
//! the 64-bit word `w = offset / 8` is `mix64(file_seed + (w + 1) *
//! 0x9e3779b97f4a7c15)` (wrapping arithmetic), stored little-endian, and
//! the byte is byte `offset % 8` of that word. `mix64` is SplitMix64's
//! finaliser. A file's seed is `mix64(seed ^ fnv1a64(path))` with the
//! data set's seed and the path relative to the root.

/// SplitMix64's finaliser: a bijective 64-bit mix.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The golden-ratio increment of SplitMix64.
pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Seed of the file at `path` (relative to the data set root) in a data
/// set generated with `seed`.
pub fn file_seed(seed: u64, path: &str) -> u64 {
    mix64(seed ^ fnv1a64(path.as_bytes()))
}

/// The `word`-th little-endian 64-bit word of a file.
pub fn content_word(file_seed: u64, word: u64) -> u64 {
    mix64(file_seed.wrapping_add(word.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// The byte at `offset` of a file.
pub fn expected_byte(file_seed: u64, offset: u64) -> u8 {
    content_word(file_seed, offset / 8).to_le_bytes()[(offset % 8) as usize]
}

/// Fills `buf` with the file's bytes from `offset` on.
pub fn fill(file_seed: u64, offset: u64, buf: &mut [u8]) {
    let mut i = 0;
    let mut pos = offset;
    while i < buf.len() {
        let word = content_word(file_seed, pos / 8).to_le_bytes();
        let skip = (pos % 8) as usize;
        let n = (8 - skip).min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&word[skip..skip + n]);
        i += n;
        pos += n as u64;
    }
}

/// Checks `buf`, read from file offset `offset`, against the content
/// function: the file offset (`offset` + index in `buf`) of the first byte
/// that differs, or `None` if all match.
pub fn first_mismatch(file_seed: u64, offset: u64, buf: &[u8]) -> Option<u64> {
    let mut expected = [0u8; 4096];
    for (n, chunk) in buf.chunks(expected.len()).enumerate() {
        let at = offset + (n * expected.len()) as u64;
        let want = &mut expected[..chunk.len()];
        fill(file_seed, at, want);
        if let Some(i) = chunk.iter().zip(want.iter()).position(|(a, b)| a != b) {
            return Some(at + i as u64);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_agrees_with_expected_byte_at_any_alignment() {
        let seed = file_seed(7, "dir/file.dat");
        for start in 0..17u64 {
            let mut buf = vec![0u8; 37];
            fill(seed, start, &mut buf);
            for (i, &b) in buf.iter().enumerate() {
                assert_eq!(
                    b,
                    expected_byte(seed, start + i as u64),
                    "offset {}",
                    start + i as u64
                );
            }
        }
    }

    #[test]
    fn known_values_pin_the_function() {
        // Pinned so that a change to the content function (which would break
        // every reader verifying generated data) shows up here.
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(GAMMA), 0xe220_a839_7b1d_cdaf);
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(content_word(0, 0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(expected_byte(0, 0), 0xaf);
        assert_eq!(expected_byte(0, 7), 0xe2);
    }

    #[test]
    fn mismatch_is_found_where_it_is() {
        let seed = file_seed(1, "x");
        let mut buf = vec![0u8; 10_000];
        fill(seed, 123, &mut buf);
        assert_eq!(first_mismatch(seed, 123, &buf), None);
        buf[9_000] ^= 1;
        assert_eq!(first_mismatch(seed, 123, &buf), Some(9_123));
        assert!(first_mismatch(file_seed(2, "x"), 123, &buf).is_some());
    }

    #[test]
    fn different_paths_and_seeds_give_different_files() {
        assert_ne!(file_seed(1, "a"), file_seed(1, "b"));
        assert_ne!(file_seed(1, "a"), file_seed(2, "a"));
    }
}
