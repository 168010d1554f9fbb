//! Huge hint files are streamed: the reader never reads far ahead of the
//! record it yields, so memory stays bounded however long the file is.
//! Sources here synthesise millions of records on the fly and check, at
//! every record, how many bytes the reader has pulled so far.

mod common;

use std::io::{self, Read};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use hints::{Format, HintReader, HintRecord};

/// Record counts are a quarter in unoptimised builds, which parse ~10x
/// slower; either way the stream is hundreds of times the reader's buffer.
const fn records(release: u64) -> u64 {
    if cfg!(debug_assertions) {
        release / 4
    } else {
        release
    }
}

/// Slack the reader may pull beyond the current record: its 64 KiB buffer
/// plus one line or frame.
const SLACK: u64 = 64 * 1024 + 1024;

/// A `Read` that serves `prefix`, then `count` items made by `item(i)`,
/// then `suffix`, counting bytes served.
struct Synth<F: FnMut(u64) -> Vec<u8>> {
    prefix: Vec<u8>,
    item: F,
    count: u64,
    next: u64,
    suffix: Vec<u8>,
    pending: Vec<u8>,
    at: usize,
    served: Arc<AtomicU64>,
}

impl<F: FnMut(u64) -> Vec<u8>> Synth<F> {
    /// The source, and the count of bytes it will have served.
    fn new(prefix: Vec<u8>, item: F, count: u64, suffix: Vec<u8>) -> (Synth<F>, Arc<AtomicU64>) {
        let served = Arc::new(AtomicU64::new(0));
        let src = Synth {
            prefix,
            item,
            count,
            next: 0,
            suffix,
            pending: Vec::new(),
            at: 0,
            served: served.clone(),
        };
        (src, served)
    }
}

/// Asserts that at record `n` the reader has pulled at most SLACK bytes
/// beyond the `consumed` bytes that make up the records so far.
fn assert_not_far_ahead(served: &AtomicU64, n: u64, consumed: u64) {
    let served = served.load(Ordering::Relaxed);
    assert!(
        served <= consumed + SLACK,
        "record {n}: read {} bytes ahead",
        served - consumed
    );
}

impl<F: FnMut(u64) -> Vec<u8>> Read for Synth<F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.at == self.pending.len() {
            self.at = 0;
            self.pending = if !self.prefix.is_empty() {
                std::mem::take(&mut self.prefix)
            } else if self.next < self.count {
                // Serve items in small batches, as a file would in pages.
                let mut batch = Vec::with_capacity(4096);
                while self.next < self.count && batch.len() < 4000 {
                    batch.extend((self.item)(self.next));
                    self.next += 1;
                }
                batch
            } else {
                std::mem::take(&mut self.suffix)
            };
        }
        let n = buf.len().min(self.pending.len() - self.at);
        buf[..n].copy_from_slice(&self.pending[self.at..self.at + n]);
        self.at += n;
        self.served.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

#[test]
fn text_with_two_million_records_streams() {
    const N: u64 = records(2_000_000);
    let prefix = b"netpager-hints 1\njob big\nblock-size 4K\nrecords\n".to_vec();
    // Fixed-width lines (zero-padded offsets), so the byte position of
    // every record is known.
    let line = |i: u64| format!("data/big.db {:013} 4096\n", i * 4096).into_bytes();
    let line_len = line(0).len() as u64;
    let (src, served) = Synth::new(prefix.clone(), line, N, Vec::new());
    let reader = HintReader::from_reader(src, "big.txt").unwrap();
    let mut n = 0u64;
    for r in reader {
        let r = r.unwrap();
        assert_eq!(r.offset, n * 4096);
        n += 1;
        let consumed = prefix.len() as u64 + n * line_len;
        assert_not_far_ahead(&served, n, consumed);
    }
    assert_eq!(n, N);
}

#[test]
fn binary_with_three_million_records_streams() {
    const N: u64 = records(3_000_000);
    let prefix = concat(&[
        MAGIC,
        &header_frame("big", 4096),
        &path_frame("data/big.db"),
        &record_frame(1, 0, 4096),
    ]);
    // Every later record: same path, contiguous, same length -> empty record.
    let same = record_frame(0, 0, 0);
    assert_eq!(same.len(), 3);
    let (src, served) = Synth::new(prefix.clone(), move |_| same.clone(), N - 1, end_frame(N));
    let reader = HintReader::from_reader(src, "big.bin").unwrap();
    assert_eq!(reader.format(), Format::Binary);
    let mut n = 0u64;
    for r in reader {
        let r = r.unwrap();
        assert_eq!(r, HintRecord::new("data/big.db", n * 4096, 4096));
        n += 1;
        let consumed = prefix.len() as u64 + (n - 1) * 3;
        assert_not_far_ahead(&served, n, consumed);
    }
    assert_eq!(n, N);
}

#[test]
fn stats_of_a_large_stream_are_exact() {
    const N: u64 = records(1_000_000);
    // Blocks 0..N/2 read twice: record i reads block i % (N/2).
    let (src, _) = Synth::new(
        concat(&[MAGIC, &header_frame("big", 4096), &path_frame("f")]),
        |i| {
            if i == 0 {
                record_frame(1, 0, 4096)
            } else if i == N / 2 {
                record_frame(0, -((N / 2) as i64) * 4096, 0)
            } else {
                record_frame(0, 0, 0)
            }
        },
        N,
        end_frame(N),
    );
    let s = HintReader::from_reader(src, "big.bin")
        .unwrap()
        .stats()
        .unwrap();
    assert_eq!((s.records, s.blocks, s.distinct_blocks), (N, N, N / 2));
    assert_eq!(s.bytes, N * 4096);
    assert_eq!(s.reuse, 2.0);
}
