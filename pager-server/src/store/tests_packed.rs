//! The store with compression: every byte against a model, the budget
//! under an adversary, memory given back.

use proptest::prelude::*;

use super::table::Entry;
use super::*;

/// Export size of the model tests: 6 groups of 16 pages, over 24 slabs of 4.
const PAGES: u64 = 96;

fn spec(name: &str) -> ExportSpec {
    ExportSpec {
        name: name.into(),
        size: None,
    }
}

fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Kinds of data real swap holds, and the adversary's.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Random,
    /// Text-like: words from a small vocabulary, about 3:1.
    Compressible,
    Zero,
    /// One 8-byte word repeated.
    Same,
    /// Pages whose halves are text and noise.
    Mixed,
}

fn fill(kind: Kind, seed: u64, out: &mut [u8], at: u64) {
    let mut r = xorshift(seed);
    let words: [&[u8]; 4] = [b"page", b"donor", b"swap", b"value"];
    let mut i = 0;
    while i < out.len() {
        let pos = at as usize + i;
        match kind {
            Kind::Random => {
                out[i] = r() as u8;
                i += 1;
            }
            Kind::Zero => {
                out[i] = 0;
                i += 1;
            }
            Kind::Same => {
                out[i] = (seed.rotate_left(8 * (pos % 8) as u32) >> 56) as u8;
                i += 1;
            }
            Kind::Compressible | Kind::Mixed => {
                if matches!(kind, Kind::Mixed) && pos % PAGE_SIZE >= PAGE_SIZE / 2 {
                    out[i] = r() as u8;
                    i += 1;
                    continue;
                }
                // Records like a program's heap: a counter, a word, padding.
                let line = format!(
                    "key:{:08} {:<8}|{:>6}        \n",
                    r() % 100_000,
                    String::from_utf8_lossy(words[(r() % 4) as usize]),
                    r() % 1000
                );
                let n = line.len().min(out.len() - i);
                out[i..i + n].copy_from_slice(&line.as_bytes()[..n]);
                i += n;
            }
        }
    }
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Random),
        Just(Kind::Compressible),
        Just(Kind::Zero),
        Just(Kind::Same),
        Just(Kind::Mixed),
    ]
}

#[derive(Clone, Debug)]
enum Op {
    Write {
        off: u64,
        len: u64,
        kind: Kind,
        seed: u64,
    },
    Discard {
        off: u64,
        len: u64,
    },
    Read {
        off: u64,
        len: u64,
    },
    Compact,
    /// A recompressor's pass with `cold` over pages untouched for `age`
    /// ops, looking at no more than `limit` (both codecs in one store:
    /// each leaves the other's pages alone).
    Recompress {
        age: u32,
        limit: u64,
        cold: Recompress,
    },
    /// Moves up to `limit` pages out of the slab worth emptying.
    Evacuate {
        limit: u64,
    },
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    let size = PAGES * PAGE;
    prop_oneof![
        // Anywhere, any length: partial pages, across groups and slabs.
        (0..size, 1..40_000u64),
        // Whole pages.
        (0..PAGES, 1..20u64).prop_map(|(p, n)| (p * PAGE, n * PAGE)),
        // A few bytes around a page boundary.
        (1..PAGES, 0..64u64, 1..128u64).prop_map(|(p, b, n)| (p * PAGE - b, n)),
    ]
    .prop_map(move |(off, len)| (off, len.min(size - off).max(1)))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (range(), kind(), any::<u64>()).prop_map(|((off, len), kind, seed)| Op::Write { off, len, kind, seed }),
        2 => range().prop_map(|(off, len)| Op::Discard { off, len }),
        2 => range().prop_map(|(off, len)| Op::Read { off, len }),
        1 => Just(Op::Compact),
        1 => (0..8u32, 1..200u64, prop_oneof![Just(Recompress::Zstd), Just(Recompress::Lz4hc)])
            .prop_map(|(age, limit, cold)| Op::Recompress { age, limit, cold }),
        1 => (1..20u64).prop_map(|limit| Op::Evacuate { limit }),
    ]
}

/// Raw pages, packed pages and repeated words an export holds.
fn census(e: &Export) -> (u64, u64, u64, u64) {
    let (mut raw, mut packed, mut same, mut bytes) = (0, 0, 0, 0);
    for shard in e.shards_for_tests() {
        for (entry, _) in shard.read_or_recover().entries() {
            match entry {
                Entry::Raw(_) => raw += 1,
                Entry::Packed(_) | Entry::Cold(_) => packed += 1,
                Entry::Same(_) => same += 1,
            }
            bytes += e.weight_for_tests(entry);
        }
    }
    (raw, packed, same, bytes)
}

/// What the store holds adds up: entries, bytes, budget, slabs.
fn check_accounting(p: &Pool, e: &Export) {
    let (raw, packed, same, bytes) = census(e);
    assert_eq!(e.logical_pages(), raw + packed + same);
    assert_eq!(e.stored_bytes(), bytes);
    let used = p.budget().used_pages();
    assert_eq!(
        used,
        raw + p.back.zs.pages(),
        "the budget counts raw pages and zspages"
    );
    assert!(used <= p.budget().limit_pages(), "budget exceeded: {used}");
    if p.codec() == Compress::Off {
        assert_eq!((packed, same), (0, 0));
    }
}

fn run_model(codec: Compress, limit: u64, ops: &[Op]) {
    let p = Pool::with_slabs(limit, 8, codec, Slabs::with_slab_pages(4));
    let e = p.open(&spec("a"), PAGES * PAGE).unwrap();
    let mut model = vec![0u8; (PAGES * PAGE) as usize];
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Write {
                off,
                len,
                kind,
                seed,
            } => {
                let mut data = vec![0u8; len as usize];
                fill(kind, seed, &mut data, off);
                match e.write(&data, off, i as u32) {
                    Ok(()) => model[off as usize..(off + len) as usize].copy_from_slice(&data),
                    Err(StoreError::NoSpace { .. }) => {}
                    Err(err) => panic!("op {i} {op:?}: {err}"),
                }
            }
            Op::Discard { off, len } => match e.discard(off, len) {
                Ok(_) => model[off as usize..(off + len) as usize].fill(0),
                Err(StoreError::NoSpace { .. }) => {}
                Err(err) => panic!("op {i} {op:?}: {err}"),
            },
            Op::Read { off, len } => {
                let mut got = vec![0xA5; len as usize];
                e.read(&mut got, off, i as u32).unwrap();
                assert!(
                    got == model[off as usize..(off + len) as usize],
                    "op {i} {op:?}: bytes differ"
                );
            }
            Op::Compact => {
                p.compact();
            }
            Op::Recompress { age, limit, cold } => {
                let before = (i as u32).saturating_sub(age) + 1;
                let done = p.recompress(cold, before, limit);
                assert!(done.examined <= limit);
                if codec != Compress::Lz4 {
                    assert_eq!(
                        done,
                        Recompressed::default(),
                        "only lz4's pages are repacked"
                    );
                }
            }
            Op::Evacuate { limit } => {
                let mapped = p.mapped_bytes();
                assert!(p.evacuate(limit) <= limit);
                assert!(p.mapped_bytes() <= mapped, "evacuating never maps a slab");
            }
        }
        check_accounting(&p, &e);
    }
    let mut all = vec![0u8; model.len()];
    e.read(&mut all, 0, 0).unwrap();
    assert!(all == model, "the whole export differs from the model");
    e.discard(0, PAGES * PAGE).unwrap();
    check_accounting(&p, &e);
    assert_eq!(p.budget().used_pages(), 0);
    assert!(
        p.mapped_bytes() <= 4 * PAGE,
        "all trimmed: at most the spare slab stays mapped"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Every byte written reads back, whatever the data, the request's
    /// shape and the codec; a refused request changes nothing.
    #[test]
    fn every_byte_reads_back_against_a_model(
        codec in prop_oneof![Just(Compress::Lz4), Just(Compress::Zstd), Just(Compress::Off)],
        limit in prop_oneof![Just(200u64), 24..60u64],
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run_model(codec, limit, &ops);
    }
}

#[test]
fn pages_take_the_cheapest_form() {
    let p = Pool::with_slabs(1000, 8, Compress::Lz4, Slabs::with_slab_pages(4));
    let e = p.open(&spec("a"), 1 << 20).unwrap();
    let page = |kind, seed| {
        let mut v = vec![0u8; PAGE_SIZE];
        fill(kind, seed, &mut v, 0);
        v
    };
    e.write(&page(Kind::Zero, 1), 0, 0).unwrap();
    e.write(&page(Kind::Same, 0x1122_3344_5566_7788), PAGE, 0)
        .unwrap();
    e.write(&page(Kind::Compressible, 2), 2 * PAGE, 0).unwrap();
    e.write(&page(Kind::Random, 3), 3 * PAGE, 0).unwrap();
    let (raw, packed, same, bytes) = census(&e);
    assert_eq!(
        (raw, packed, same),
        (1, 1, 1),
        "zero: nothing; same: a word; text: packed; noise: raw"
    );
    assert!(bytes < PAGE + PAGE / 2, "{bytes}");
    assert_eq!(p.logical_bytes(), 3 * PAGE);
    let u = &p.usage()[0];
    assert_eq!((u.logical_bytes, u.stored_bytes), (3 * PAGE, bytes));
    // A partial write into a packed page repacks it; into the repeated
    // word, makes an object of it.
    e.write(&[0xEE; 10], 2 * PAGE + 4090, 0).unwrap();
    e.write(&[0xEE; 10], PAGE + 100, 0).unwrap();
    let mut got = vec![0u8; 4 * PAGE_SIZE];
    e.read(&mut got, 0, 0).unwrap();
    let mut want = [
        page(Kind::Zero, 1),
        page(Kind::Same, 0x1122_3344_5566_7788),
        page(Kind::Compressible, 2),
        page(Kind::Random, 3),
    ]
    .concat();
    want[2 * PAGE_SIZE + 4090..2 * PAGE_SIZE + 4100].fill(0xEE);
    want[PAGE_SIZE + 100..PAGE_SIZE + 110].fill(0xEE);
    assert!(got == want);
    assert_eq!(census(&e).1, 2, "both are objects now");
}

#[test]
fn the_budget_holds_when_compressible_pages_are_overwritten_with_noise() {
    for codec in [Compress::Lz4, Compress::Zstd] {
        let limit = 64;
        let p = Pool::with_slabs(limit, 8, codec, Slabs::with_slab_pages(4));
        let e = p.open(&spec("a"), 4096 * PAGE).unwrap();
        let mut model = vec![0u8; 4096 * PAGE_SIZE];
        // Compressible pages until the budget refuses one.
        let mut n = 0u64;
        loop {
            let mut v = vec![0u8; PAGE_SIZE];
            fill(Kind::Compressible, n + 1, &mut v, 0);
            match e.write(&v, n * PAGE, 0) {
                Ok(()) => model[(n * PAGE) as usize..((n + 1) * PAGE) as usize].copy_from_slice(&v),
                Err(StoreError::NoSpace { .. }) => break,
                Err(err) => panic!("{err}"),
            }
            n += 1;
        }
        assert!(
            n > 2 * limit,
            "{codec:?}: {n} pages in {limit}: compression pays"
        );
        // Trimming every fourth page leaves sparse zspages; the writes
        // below compact them to land. Overwrite the rest with noise, in
        // runs of 1 to 3 pages: each write lands whole or not at all, and
        // the budget is never exceeded.
        for q in (0..n).step_by(4) {
            e.discard(q * PAGE, PAGE).unwrap();
            model[(q * PAGE) as usize..((q + 1) * PAGE) as usize].fill(0);
        }
        let (mut landed, mut refused) = (0, 0);
        let mut r = xorshift(7);
        let mut q = 0;
        while q < n {
            let run = (1 + r() % 3).min(n - q);
            let mut v = vec![0u8; (run * PAGE) as usize];
            fill(Kind::Random, q, &mut v, 0);
            match e.write(&v, q * PAGE, 1) {
                Ok(()) => {
                    model[(q * PAGE) as usize..((q + run) * PAGE) as usize].copy_from_slice(&v);
                    landed += 1;
                }
                Err(err @ StoreError::NoSpace { .. }) => {
                    assert_eq!(err.errno(), libc::ENOSPC);
                    refused += 1;
                }
                Err(err) => panic!("{err}"),
            }
            check_accounting(&p, &e);
            q += run;
        }
        assert!(
            landed > 0 && refused > 0,
            "{codec:?}: {landed} landed, {refused} refused"
        );
        let mut got = vec![0u8; model.len()];
        e.read(&mut got, 0, 0).unwrap();
        assert!(
            got == model,
            "{codec:?}: a refused write changed stored bytes"
        );
        assert!(p.budget().used_pages() <= limit);
    }
}

#[test]
fn memory_returns_after_trim_and_compaction() {
    let slab = 4 * PAGE;
    let p = Pool::with_slabs(4096, 8, Compress::Lz4, Slabs::with_slab_pages(4));
    let e = p.open(&spec("a"), 2048 * PAGE).unwrap();
    for q in 0..2048 {
        let mut v = vec![0u8; PAGE_SIZE];
        let kind = if q % 5 == 0 {
            Kind::Random
        } else {
            Kind::Mixed
        };
        fill(kind, q + 1, &mut v, 0);
        e.write(&v, q * PAGE, 0).unwrap();
    }
    let peak = p.mapped_bytes();
    assert!(peak < 2048 * PAGE * 17 / 20, "mixed pages pack: {peak}");
    // Keep one page in eight: the zspages are all sparse now.
    for q in (0..2048).filter(|q| q % 8 != 0) {
        e.discard(q * PAGE, PAGE).unwrap();
    }
    let sparse = p.mapped_bytes();
    let freed = p.compact();
    assert!(freed > 0);
    let compacted = p.mapped_bytes();
    // Raw pages do not move: the slabs they keep stay mapped.
    assert!(
        compacted * 3 < sparse,
        "compaction frees slabs: {sparse} -> {compacted} bytes mapped"
    );
    assert!(p.budget().used_pages() * PAGE <= compacted);
    for q in (0..2048).step_by(8) {
        let mut v = vec![0u8; PAGE_SIZE];
        let kind = if q % 5 == 0 {
            Kind::Random
        } else {
            Kind::Mixed
        };
        fill(kind, q + 1, &mut v, 0);
        let mut got = vec![0u8; PAGE_SIZE];
        e.read(&mut got, q * PAGE, 0).unwrap();
        assert!(got == v, "page {q} after compaction");
    }
    e.discard(0, 2048 * PAGE).unwrap();
    assert_eq!(p.budget().used_pages(), 0);
    assert_eq!(
        p.mapped_bytes(),
        slab,
        "everything trimmed: the spare slab only"
    );
}

#[test]
fn the_xth_oldest_counts_bytes_held() {
    let p = Pool::with_slabs(1000, 8, Compress::Lz4, Slabs::with_slab_pages(4));
    let e = p.open(&spec("a"), 1 << 20).unwrap();
    // Ten packed pages written at ticks 1..=10, then a raw page at 20.
    for t in 1..=10u64 {
        let mut v = vec![0u8; PAGE_SIZE];
        fill(Kind::Compressible, t, &mut v, 0);
        e.write(&v, t * PAGE, t as u32).unwrap();
    }
    let each = e.stored_bytes() / 10;
    assert!(each < PAGE / 2);
    let mut v = vec![0u8; PAGE_SIZE];
    fill(Kind::Random, 99, &mut v, 0);
    e.write(&v, 0, 20).unwrap();
    // One page's worth of bytes is reached after a few packed pages.
    let k = PAGE.div_ceil(each) as u32;
    assert_eq!(p.xth_oldest_stamp(1), Some(k.min(10)));
    assert_eq!(
        p.xth_oldest_stamp(100),
        Some(20),
        "fewer bytes than x pages: the youngest"
    );
}

#[test]
fn cold_pages_are_repacked_smaller_and_read_back() {
    for cold in [Recompress::Zstd, Recompress::Lz4hc] {
        repack_and_read_back(cold);
    }
}

fn repack_and_read_back(codec: Recompress) {
    let p = Pool::with_slabs(400, 8, Compress::Lz4, Slabs::with_slab_pages(4));
    let e = p.open(&spec("a"), PAGES * PAGE).unwrap();
    let mut model = vec![0u8; (PAGES * PAGE) as usize];
    let kinds = [Kind::Compressible, Kind::Random, Kind::Mixed, Kind::Same];
    for page in 0..PAGES {
        let at = (page * PAGE) as usize;
        fill(
            kinds[page as usize % 4],
            page,
            &mut model[at..at + PAGE_SIZE],
            page * PAGE,
        );
        // Pages 0..48 written at tick 1, the rest at tick 10.
        let tick = if page < PAGES / 2 { 1 } else { 10 };
        e.write(&model[at..at + PAGE_SIZE], page * PAGE, tick)
            .unwrap();
    }
    let before = e.stored_bytes();
    let weights: Vec<Option<u64>> = (0..PAGES).map(|q| e.page_weight_for_tests(q)).collect();
    // Only pages last touched before tick 5: the first half.
    let first = p.recompress(codec, 5, u64::MAX);
    assert!(
        first.pages > 0 && first.saved_bytes > 0,
        "{codec:?}: {first:?}"
    );
    assert!(
        first.examined <= PAGES / 2 - PAGES / 8,
        "repeated words are not looked at"
    );
    assert_eq!(e.stored_bytes(), before - first.saved_bytes);
    check_accounting(&p, &e);
    let cold: Vec<u64> = (0..PAGES)
        .filter(|&q| e.page_weight_for_tests(q) < weights[q as usize])
        .collect();
    assert_eq!(cold.len() as u64, first.pages, "{codec:?}");
    assert!(
        !cold.is_empty() && cold.iter().all(|&q| q < PAGES / 2),
        "{cold:?}"
    );
    // A second pass finds nothing more to gain.
    let again = p.recompress(codec, 5, u64::MAX);
    assert_eq!(again.pages, 0, "{again:?}");
    // Every byte reads back, whole pages and pieces across cold pages.
    let mut all = vec![0xA5; model.len()];
    e.read(&mut all, 0, 20).unwrap();
    assert!(all == model);
    let mut piece = vec![0xA5; 3 * PAGE_SIZE];
    e.read(&mut piece, PAGE + 100, 20).unwrap();
    assert!(piece[..] == model[PAGE_SIZE + 100..4 * PAGE_SIZE + 100]);
    // Rewritten in part, a cold page is lz4 again and holds the patch.
    let patch = vec![b'z'; 1000];
    e.write(&patch, cold[0] * PAGE + 50, 21).unwrap();
    let at = (cold[0] * PAGE) as usize + 50;
    model[at..at + 1000].copy_from_slice(&patch);
    // Trimmed in part and whole.
    e.discard(cold[1] * PAGE + 7, 300).unwrap();
    let at = (cold[1] * PAGE) as usize + 7;
    model[at..at + 300].fill(0);
    e.discard(cold[2] * PAGE, PAGE).unwrap();
    let at = (cold[2] * PAGE) as usize;
    model[at..at + PAGE_SIZE].fill(0);
    e.read(&mut all, 0, 22).unwrap();
    assert!(all == model);
    check_accounting(&p, &e);
    e.discard(0, PAGES * PAGE).unwrap();
    assert_eq!(p.budget().used_pages(), 0);
    assert_eq!(p.recompressed().pages, first.pages);
}

#[test]
fn the_recompressor_and_the_evacuator_racing_writers_lose_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let p = Arc::new(Pool::with_slabs(
        2000,
        8,
        Compress::Lz4,
        Slabs::with_slab_pages(4),
    ));
    let e = p.open(&spec("a"), PAGES * PAGE).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let passes = Arc::new(AtomicU64::new(0));
    let recompressor = {
        let (p, stop, passes) = (Arc::clone(&p), Arc::clone(&stop), Arc::clone(&passes));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                p.recompress(Recompress::Lz4hc, u32::MAX, 16);
                p.recompress(Recompress::Zstd, u32::MAX, 16);
                p.compact();
                p.evacuate(8);
                passes.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    // Two writers, each on its own pages, each checking its own model;
    // they start once the recompressor runs, and it runs until they end.
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (e, passes) = (Arc::clone(&e), Arc::clone(&passes));
            std::thread::spawn(move || {
                while passes.load(Ordering::Relaxed) == 0 {
                    std::thread::yield_now();
                }
                let mine = w * PAGES / 2..(w + 1) * PAGES / 2;
                let mut model = vec![0u8; (PAGES / 2 * PAGE) as usize];
                let mut r = xorshift(w + 7);
                for i in 0..3000u64 {
                    let page = mine.start + r() % (PAGES / 2);
                    let off = r() % PAGE;
                    let len = (1 + r() % (2 * PAGE)).min((mine.end - page) * PAGE - off);
                    let at = ((page - mine.start) * PAGE + off) as usize;
                    let slice = &mut model[at..at + len as usize];
                    match i % 5 {
                        4 => {
                            e.discard(page * PAGE + off, len).unwrap();
                            slice.fill(0);
                        }
                        k => {
                            let kind = [Kind::Compressible, Kind::Mixed, Kind::Random, Kind::Same]
                                [k as usize];
                            fill(kind, r(), slice, page * PAGE + off);
                            e.write(slice, page * PAGE + off, 0).unwrap();
                        }
                    }
                    if i % 50 == 0 {
                        let mut got = vec![0xA5; model.len()];
                        e.read(&mut got, mine.start * PAGE, 0).unwrap();
                        assert!(got == model, "writer {w}: bytes differ after op {i}");
                    }
                }
                let mut got = vec![0xA5; model.len()];
                e.read(&mut got, mine.start * PAGE, 0).unwrap();
                assert!(got == model, "writer {w}: bytes differ at the end");
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    recompressor.join().unwrap();
    check_accounting(&p, &e);
}

#[test]
fn pages_the_recompressor_cannot_shrink_are_tried_once_until_they_change() {
    for cold in [Recompress::Zstd, Recompress::Lz4hc] {
        tried_once_until_changed(cold);
    }
}

fn tried_once_until_changed(cold: Recompress) {
    let p = Pool::with_slabs(400, 8, Compress::Lz4, Slabs::with_slab_pages(4));
    let e = p.open(&spec("a"), PAGES * PAGE).unwrap();
    let mut noise = vec![0u8; (16 * PAGE) as usize];
    fill(Kind::Random, 3, &mut noise, 0);
    e.write(&noise, 0, 1).unwrap();
    let first = p.recompress(cold, u32::MAX, u64::MAX);
    assert_eq!((first.examined, first.pages), (16, 0), "{first:?}");
    let again = p.recompress(cold, u32::MAX, u64::MAX);
    assert_eq!(
        again.examined, 0,
        "noise is not compressed once a pass: {again:?}"
    );
    // Rewritten (with noise again), a page is tried again; so is one
    // written in part.
    e.write(&noise[..PAGE_SIZE], 5 * PAGE, 2).unwrap();
    e.write(&noise[..100], 9 * PAGE + 10, 2).unwrap();
    let after = p.recompress(cold, u32::MAX, u64::MAX);
    assert_eq!(after.examined, 2, "{after:?}");
}

#[test]
fn slabs_left_part_used_are_emptied_and_unmapped() {
    // Slabs of 8 pages; raw and packed pages in 3 exports.
    let p = Pool::with_slabs(400, 8, Compress::Lz4, Slabs::with_slab_pages(8));
    let exports: Vec<_> = ["a", "b", "c"]
        .map(|n| p.open(&spec(n), PAGES * PAGE).unwrap())
        .into();
    let mut models = vec![vec![0u8; (PAGES * PAGE) as usize]; 3];
    for (k, (e, model)) in exports.iter().zip(&mut models).enumerate() {
        for page in 0..PAGES / 2 + 6 {
            let at = (page * PAGE) as usize;
            let kind = if page % 4 == 0 {
                Kind::Random
            } else {
                Kind::Compressible
            };
            fill(
                kind,
                page + 100 * k as u64,
                &mut model[at..at + PAGE_SIZE],
                page * PAGE,
            );
            e.write(&model[at..at + PAGE_SIZE], page * PAGE, 1).unwrap();
        }
    }
    // Three pages of four trimmed, all over the slabs.
    for (e, model) in exports.iter().zip(&mut models) {
        for page in (0..PAGES / 2 + 6).filter(|q| q % 4 != 1) {
            e.discard(page * PAGE, PAGE).unwrap();
            let at = (page * PAGE) as usize;
            model[at..at + PAGE_SIZE].fill(0);
        }
    }
    p.compact();
    let before = p.mapped_bytes();
    let mut moved = 0;
    for _ in 0..100 {
        match p.evacuate(5) {
            0 => break,
            n => moved += n,
        }
    }
    assert!(moved > 0);
    let after = p.mapped_bytes();
    let used = p.budget().used_pages() * PAGE;
    let slab = 8 * PAGE;
    assert!(after < before, "{after} mapped after, {before} before");
    // What is used, rounded up to a slab, the spare, and one slab whose
    // pages do not fit in the free pages below it.
    assert!(
        after <= used.div_ceil(slab) * slab + 2 * slab,
        "{after} mapped for {used} used"
    );
    for (e, model) in exports.iter().zip(&models) {
        let mut all = vec![0xA5; model.len()];
        e.read(&mut all, 0, 2).unwrap();
        assert!(all == *model, "{}: bytes differ after the moves", e.name());
        check_accounting(&p, e);
    }
}
