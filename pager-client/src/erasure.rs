//! Erasure codes of a stripe: `k` data shards and `r` parity shards, any
//! `r` of which may be lost. Mode parity is the `r = 1` case, coded as XOR
//! (its parity is what older maps hold); mode ec is Reed-Solomon over
//! GF(2^16) by the `reed-solomon-simd` crate.
//!
//! Shards are indexed `0..k` (data) then `k..k + r` (parity). Reed-Solomon
//! works on 64-byte chunks of each shard independently (32 symbols, low and
//! high bytes apart), so any range of a stripe starting and ending on a
//! multiple of [`ALIGN`] from the start of its shards encodes and decodes
//! on its own: a page can be coded without the rest of its extent.
//! Long shards are coded [`CHUNK`] bytes at a time, so a codec's working
//! memory is fixed when it is made and coding never allocates.

use reed_solomon_simd::{ReedSolomonDecoder, ReedSolomonEncoder};

/// Ranges coded with Reed-Solomon start and end on multiples of this.
pub const ALIGN: usize = 64;
/// Bytes of each shard coded at once.
pub const CHUNK: usize = 16 << 10;
/// Most shards (data plus parity) a stripe may have.
pub const MAX_SHARDS: usize = crate::config::MAX_WIDTH as usize;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodeError {
    #[error("{have} of the stripe's {total} shards are readable, {need} are needed")]
    TooFew {
        have: usize,
        need: usize,
        total: usize,
    },
    #[error("code {k}+{r}: {reason}")]
    Shape { k: usize, r: usize, reason: String },
}

/// Rounds `[off, off + len)` out to [`ALIGN`]: `(start, len)`.
pub fn aligned(off: u64, len: u64) -> (u64, u64) {
    let a = ALIGN as u64;
    let start = off / a * a;
    (start, (off + len).div_ceil(a) * a - start)
}

enum Engine {
    Xor,
    Rs {
        enc: Box<ReedSolomonEncoder>,
        dec: Box<ReedSolomonDecoder>,
    },
}

/// One `k + r` code with its working memory.
pub struct Codec {
    k: usize,
    r: usize,
    engine: Engine,
}

impl Codec {
    /// XOR for `r = 1` when `xor` (mode parity), Reed-Solomon otherwise.
    pub fn new(k: usize, r: usize, xor: bool) -> Result<Codec, CodeError> {
        let shape = |reason: String| CodeError::Shape { k, r, reason };
        if k == 0 || r == 0 || k + r > MAX_SHARDS {
            return Err(shape(format!(
                "needs at least one data and one parity shard, at most {MAX_SHARDS} in all"
            )));
        }
        let engine = if xor {
            if r != 1 {
                return Err(shape("XOR has exactly one parity shard".into()));
            }
            Engine::Xor
        } else {
            let err = |e: reed_solomon_simd::Error| shape(e.to_string());
            Engine::Rs {
                enc: Box::new(ReedSolomonEncoder::new(k, r, CHUNK).map_err(err)?),
                dec: Box::new(ReedSolomonDecoder::new(k, r, CHUNK).map_err(err)?),
            }
        };
        Ok(Codec { k, r, engine })
    }

    fn check_len(&self, len: usize) -> Result<(), CodeError> {
        if matches!(self.engine, Engine::Rs { .. }) && !len.is_multiple_of(ALIGN) {
            return Err(CodeError::Shape {
                k: self.k,
                r: self.r,
                reason: format!("a range of {len} bytes is not a multiple of {ALIGN}"),
            });
        }
        Ok(())
    }

    /// Writes the parity shards of `data` (`k` shards of one length) into
    /// `parity` (`r` of that length).
    pub fn encode(&mut self, data: &[&[u8]], parity: &mut [&mut [u8]]) -> Result<(), CodeError> {
        assert_eq!((data.len(), parity.len()), (self.k, self.r), "shard counts");
        let len = data[0].len();
        self.check_len(len)?;
        match &mut self.engine {
            Engine::Xor => {
                let p = &mut *parity[0];
                p.copy_from_slice(data[0]);
                for d in &data[1..] {
                    xor_into(p, d);
                }
            }
            Engine::Rs { enc, .. } => {
                for c in (0..len).step_by(CHUNK) {
                    let n = CHUNK.min(len - c);
                    rs_encode(
                        enc,
                        self.k,
                        self.r,
                        n,
                        |i| &data[i][c..c + n],
                        |i, b| parity[i][c..c + n].copy_from_slice(b),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Re-creates shard `want` into `out` from the readable shards `have`
    /// (`k + r` entries, `None` where a shard is missing; all of one
    /// length). Reed-Solomon needs any `k` of them (it uses the first `k`
    /// given); XOR needs all but `want`.
    pub fn recover(
        &mut self,
        have: &[Option<&[u8]>],
        want: usize,
        out: &mut [u8],
    ) -> Result<(), CodeError> {
        let (k, r) = (self.k, self.r);
        assert_eq!(have.len(), k + r, "shard count");
        let len = out.len();
        self.check_len(len)?;
        let n_have = have
            .iter()
            .enumerate()
            .filter(|(i, s)| *i != want && s.is_some())
            .count();
        let too_few = |need| CodeError::TooFew {
            have: n_have,
            need,
            total: k + r,
        };
        match &mut self.engine {
            Engine::Xor => {
                if n_have < k {
                    return Err(too_few(k));
                }
                let mut first = true;
                for s in have.iter().enumerate().filter(|(i, _)| *i != want) {
                    let s = s.1.expect("counted above");
                    if first {
                        out.copy_from_slice(s);
                        first = false;
                    } else {
                        xor_into(out, s);
                    }
                }
            }
            Engine::Rs { enc, dec } => {
                if n_have < k {
                    return Err(too_few(k));
                }
                for c in (0..len).step_by(CHUNK) {
                    let n = CHUNK.min(len - c);
                    rs_recover(enc, dec, k, r, have, want, c, &mut out[c..c + n])?;
                }
            }
        }
        Ok(())
    }
}

fn rs_err(k: usize, r: usize) -> impl Fn(reed_solomon_simd::Error) -> CodeError {
    move |e| CodeError::Shape {
        k,
        r,
        reason: e.to_string(),
    }
}

/// Encodes one chunk of `n` bytes: data shard `i` is `data(i)`, parity
/// shard `i` goes to `put(i, bytes)`.
fn rs_encode<'a>(
    enc: &mut ReedSolomonEncoder,
    k: usize,
    r: usize,
    n: usize,
    data: impl Fn(usize) -> &'a [u8],
    mut put: impl FnMut(usize, &[u8]),
) -> Result<(), CodeError> {
    let err = rs_err(k, r);
    enc.reset(k, r, n).map_err(&err)?;
    for i in 0..k {
        enc.add_original_shard(data(i)).map_err(&err)?;
    }
    let res = enc.encode().map_err(&err)?;
    for (i, b) in res.recovery_iter().enumerate() {
        put(i, b);
    }
    Ok(())
}

/// Re-creates chunk `[c, c + out.len())` of shard `want`.
#[allow(clippy::too_many_arguments)]
fn rs_recover(
    enc: &mut ReedSolomonEncoder,
    dec: &mut ReedSolomonDecoder,
    k: usize,
    r: usize,
    have: &[Option<&[u8]>],
    want: usize,
    c: usize,
    out: &mut [u8],
) -> Result<(), CodeError> {
    let err = rs_err(k, r);
    let n = out.len();
    let part = |i: usize| have[i].filter(|_| i != want).map(|s| &s[c..c + n]);
    // All data shards at hand: a parity shard is a plain encode.
    if want >= k && (0..k).all(|i| part(i).is_some()) {
        return rs_encode(
            enc,
            k,
            r,
            n,
            |i| part(i).expect("checked"),
            |i, b| {
                if i == want - k {
                    out.copy_from_slice(b)
                }
            },
        );
    }
    dec.reset(k, r, n).map_err(&err)?;
    let mut added = 0;
    for i in 0..k + r {
        let Some(s) = part(i) else { continue };
        if added == k {
            break;
        }
        if i < k {
            dec.add_original_shard(i, s).map_err(&err)?;
        } else {
            dec.add_recovery_shard(i - k, s).map_err(&err)?;
        }
        added += 1;
    }
    let res = dec.decode().map_err(&err)?;
    if want < k {
        out.copy_from_slice(res.restored_original(want).expect("a missing original"));
        return Ok(());
    }
    let data = |i: usize| {
        part(i)
            .or_else(|| res.restored_original(i))
            .expect("decoded")
    };
    rs_encode(enc, k, r, n, data, |i, b| {
        if i == want - k {
            out.copy_from_slice(b)
        }
    })
}

/// `dst ^= src`, eight bytes at a time.
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "XOR of buffers of different lengths");
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (a, b) in (&mut d).zip(&mut s) {
        let x = u64::from_ne_bytes(a.try_into().expect("8 bytes"))
            ^ u64::from_ne_bytes(b.try_into().expect("8 bytes"));
        a.copy_from_slice(&x.to_ne_bytes());
    }
    for (a, b) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *a ^= b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stripe(k: usize, r: usize, len: usize, seed: u64, xor: bool) -> Vec<Vec<u8>> {
        let mut x = seed | 1;
        let mut shards: Vec<Vec<u8>> = (0..k)
            .map(|_| {
                (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    })
                    .collect()
            })
            .collect();
        let mut parity = vec![vec![0u8; len]; r];
        let mut c = Codec::new(k, r, xor).unwrap();
        let data: Vec<&[u8]> = shards.iter().map(|s| &s[..]).collect();
        let mut p: Vec<&mut [u8]> = parity.iter_mut().map(|s| &mut s[..]).collect();
        c.encode(&data, &mut p).unwrap();
        shards.extend(parity);
        shards
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any erasure pattern of up to `r` shards is recovered exactly.
        #[test]
        fn recovers_any_r_erasures(
            (k, r) in (1usize..=8, 1usize..=4),
            chunks in 1usize..=(2 * CHUNK / ALIGN + 3),
            seed in any::<u64>(),
            pick in proptest::collection::vec(any::<prop::sample::Index>(), 1..=4),
        ) {
            let len = chunks * ALIGN;
            let shards = stripe(k, r, len, seed, false);
            let mut lost: Vec<usize> = pick.iter().map(|i| i.index(k + r)).collect();
            lost.sort_unstable();
            lost.dedup();
            lost.truncate(r);
            let have: Vec<Option<&[u8]>> = (0..k + r)
                .map(|i| (!lost.contains(&i)).then(|| &shards[i][..]))
                .collect();
            let mut c = Codec::new(k, r, false).unwrap();
            for &w in &lost {
                let mut out = vec![0u8; len];
                c.recover(&have, w, &mut out).unwrap();
                prop_assert_eq!(&out, &shards[w], "shard {} of {}+{}", w, k, r);
            }
        }

        /// A 64-byte-aligned piece of a stripe codes like the whole.
        #[test]
        fn aligned_pieces_code_alone(
            seed in any::<u64>(),
            from in 0usize..64,
            n in 1usize..64,
            lost in 0usize..6,
        ) {
            let len = 128 * ALIGN;
            let shards = stripe(4, 2, len, seed, false);
            let (a, b) = (from * ALIGN, (from + n).min(128) * ALIGN);
            let have: Vec<Option<&[u8]>> = (0..6)
                .map(|i| (i != lost).then(|| &shards[i][a..b]))
                .collect();
            let mut out = vec![0u8; b - a];
            Codec::new(4, 2, false).unwrap().recover(&have, lost, &mut out).unwrap();
            prop_assert_eq!(&out[..], &shards[lost][a..b]);
        }
    }

    #[test]
    fn xor_is_the_r1_code_and_takes_any_length() {
        let shards = stripe(3, 1, 1001, 7, true);
        let mut x = shards[0].clone();
        xor_into(&mut x, &shards[1]);
        xor_into(&mut x, &shards[2]);
        assert_eq!(x, shards[3]);
        let have: Vec<Option<&[u8]>> = (0..4).map(|i| (i != 1).then(|| &shards[i][..])).collect();
        let mut out = vec![0u8; 1001];
        Codec::new(3, 1, true)
            .unwrap()
            .recover(&have, 1, &mut out)
            .unwrap();
        assert_eq!(out, shards[1]);
    }

    #[test]
    fn too_many_erasures_are_refused_by_count() {
        let shards = stripe(4, 2, 256, 3, false);
        let have: Vec<Option<&[u8]>> = (0..6).map(|i| (i >= 3).then(|| &shards[i][..])).collect();
        let mut out = vec![0u8; 256];
        let e = Codec::new(4, 2, false)
            .unwrap()
            .recover(&have, 0, &mut out)
            .unwrap_err();
        assert_eq!(
            e,
            CodeError::TooFew {
                have: 3,
                need: 4,
                total: 6
            }
        );
        assert!(e.to_string().contains("3 of the stripe's 6"), "{e}");
    }

    #[test]
    fn unaligned_rs_ranges_and_bad_shapes_are_refused() {
        let mut c = Codec::new(4, 2, false).unwrap();
        let d = [[0u8; 100]; 4];
        let data: Vec<&[u8]> = d.iter().map(|s| &s[..]).collect();
        let mut p = [[0u8; 100]; 2];
        let [a, b] = &mut p;
        assert!(c.encode(&data, &mut [a, b]).is_err());
        assert!(Codec::new(4, 2, true).is_err());
        assert!(Codec::new(0, 2, false).is_err());
        assert_eq!(aligned(100, 10), (64, 64));
        assert_eq!(aligned(4096, 4096), (4096, 4096));
    }
}
