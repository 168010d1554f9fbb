//! A job's hint file as a stream of blocks for its cursor.
//!
//! [`HintBlocks`] reads the hint file lazily (the cursor pulls only as far
//! as its window) through the hints crate's streaming reader, over every
//! pass, and turns each record into the daemon's blocks. Hints it cannot
//! use are dropped and counted, never fatal:
//!
//! - records of files the staleness check reported (changed, missing,
//!   read beyond their end since the hints were written);
//! - records of paths that do not resolve to a regular file of the data
//!   directory;
//! - the part of a record past the end of its file;
//! - everything after a malformed record (the error is kept for status).
//!
//! The hints crate's reader is not `Send`, so each job's reader lives on a
//! thread of its own and hands blocks over a bounded channel
//! ([`BlockStream`]): it reads at most [`READ_AHEAD`] blocks ahead of the
//! cursor, and parsing happens outside the daemon's lock.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, IntoIter};
use std::sync::{Arc, Mutex};

use hints::{HintError, HintReader, References, Staleness};

use crate::files::FileTable;
use crate::plan::{BlockId, FileId};
use crate::status::HintStream;

/// What happened to a job's hints, for status.
#[derive(Debug, Default)]
pub struct SourceReport {
    pub records: AtomicU64,
    pub ignored_stale: AtomicU64,
    pub ignored_unknown: AtomicU64,
    pub ignored_beyond_eof: AtomicU64,
    pub error: Mutex<Option<String>>,
}

impl SourceReport {
    pub fn snapshot(&self) -> HintStream {
        HintStream {
            records: self.records.load(Ordering::Relaxed),
            ignored_stale: self.ignored_stale.load(Ordering::Relaxed),
            ignored_unknown: self.ignored_unknown.load(Ordering::Relaxed),
            ignored_beyond_eof: self.ignored_beyond_eof.load(Ordering::Relaxed),
            error: self.error.lock().expect("report lock").clone(),
        }
    }
}

/// Blocks the reader thread may have read ahead of the cursor.
pub const READ_AHEAD: usize = 1024;

/// A registered job's hint file, checked.
pub struct OpenedHints {
    pub job: String,
    pub blocks: BlockStream,
    pub stale: Vec<Staleness>,
    pub report: Arc<SourceReport>,
}

/// Opens `path`, runs the staleness check against the data directory and
/// starts the reader thread.
pub fn open_hints(
    path: &Path,
    files: Arc<FileTable>,
    block_size: u32,
) -> Result<OpenedHints, HintError> {
    let stale = HintReader::open(path)?.check_against(files.root())?;
    let job = HintReader::open(path)?.header().job.clone();
    let report = Arc::new(SourceReport::default());
    let stale_paths: HashSet<String> = stale.iter().map(|s| s.path.clone()).collect();
    let (tx, rx) = sync_channel(READ_AHEAD);
    let (path, thread_report) = (path.to_path_buf(), report.clone());
    let spawned = std::thread::Builder::new()
        .name(format!("hints-{job}"))
        .spawn(move || {
            let blocks = match HintReader::open(&path) {
                Ok(r) => HintBlocks::new(r, files, stale_paths, block_size, thread_report),
                Err(e) => {
                    *thread_report.error.lock().expect("report lock") = Some(e.to_string());
                    return;
                }
            };
            for b in blocks {
                // The job was removed: stop reading.
                if tx.send(b).is_err() {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        *report.error.lock().expect("report lock") =
            Some(format!("cannot start the hint reader: {e}"));
    }
    Ok(OpenedHints {
        job,
        blocks: BlockStream { rx: rx.into_iter() },
        stale,
        report,
    })
}

/// The blocks of a job's hints, as its reader thread produces them.
pub struct BlockStream {
    rx: IntoIter<BlockId>,
}

impl Iterator for BlockStream {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        self.rx.next()
    }
}

/// See the module documentation.
pub struct HintBlocks {
    refs: References,
    files: Arc<FileTable>,
    stale: HashSet<String>,
    resolved: HashMap<String, Option<(FileId, u64)>>,
    block_size: u64,
    pending: Option<(FileId, Range<u64>)>,
    last: Option<BlockId>,
    report: Arc<SourceReport>,
}

impl HintBlocks {
    pub fn new(
        reader: HintReader,
        files: Arc<FileTable>,
        stale: HashSet<String>,
        block_size: u32,
        report: Arc<SourceReport>,
    ) -> HintBlocks {
        HintBlocks {
            refs: reader.references(),
            files,
            stale,
            resolved: HashMap::new(),
            block_size: u64::from(block_size),
            pending: None,
            last: None,
            report,
        }
    }

    fn file(&mut self, path: &str) -> Option<(FileId, u64)> {
        if let Some(r) = self.resolved.get(path) {
            return *r;
        }
        let r = match self.files.resolve(path) {
            Ok(e) => Some((e.id, e.size())),
            Err(e) => {
                tracing::info!("hints name {path}, which is ignored: {e}");
                None
            }
        };
        self.resolved.insert(path.to_owned(), r);
        r
    }

    /// The next record's blocks, or None at the end of the hints.
    fn next_record(&mut self) -> Option<(FileId, Range<u64>)> {
        loop {
            let r = match self.refs.next()? {
                Ok(r) => r.record,
                Err(e) => {
                    tracing::warn!("hint stream stops: {e}");
                    *self.report.error.lock().expect("report lock") = Some(e.to_string());
                    return None;
                }
            };
            self.report.records.fetch_add(1, Ordering::Relaxed);
            if self.stale.contains(&r.path) {
                self.report.ignored_stale.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let Some((file, size)) = self.file(&r.path) else {
                self.report.ignored_unknown.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if r.offset >= size {
                self.report
                    .ignored_beyond_eof
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let end = r.end().min(size);
            let first = r.offset / self.block_size;
            let last = (end - 1) / self.block_size;
            return Some((file, first..last + 1));
        }
    }
}

impl Iterator for HintBlocks {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        loop {
            if let Some((file, range)) = &mut self.pending {
                if let Some(index) = range.next() {
                    let b = BlockId::new(*file, index);
                    // Consecutive records within one block are one reference.
                    if self.last == Some(b) {
                        continue;
                    }
                    self.last = Some(b);
                    return Some(b);
                }
            }
            self.pending = Some(self.next_record()?);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hints::{Format, HintHeader, HintRecord, HintWriter};
    use std::fs;

    fn write_hints(path: &Path, header: &HintHeader, records: &[HintRecord]) {
        let mut w = HintWriter::create(path, Format::Text, header).unwrap();
        for r in records {
            w.write(r).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn records_become_blocks_over_every_pass() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("data");
        fs::create_dir(&root).unwrap();
        fs::write(root.join("f"), vec![7u8; 40_000]).unwrap();
        let mut h = HintHeader::new("j", 8192);
        h.repeat = 2;
        let hp = d.path().join("j.hints");
        write_hints(
            &hp,
            &h,
            &[
                HintRecord::new("f", 100, 20_000), // blocks 0..=2
                HintRecord::new("f", 20_000, 10),  // block 2 again: merged
                HintRecord::new("nope", 0, 10),
                HintRecord::new("f", 39_999, 100), // clipped at EOF: block 4
                HintRecord::new("f", 50_000, 10),  // beyond EOF
            ],
        );
        let files = Arc::new(FileTable::new(&root).unwrap());
        // The staleness check would drop every hint of "f" (it has records
        // past its end); without it, the conversion clips them.
        let o = open_hints(&hp, files.clone(), 8192).unwrap();
        assert_eq!(o.job, "j");
        let mut stale: Vec<&str> = o.stale.iter().map(|s| s.path.as_str()).collect();
        stale.sort_unstable();
        assert_eq!(stale, vec!["f", "nope"]);
        let report = Arc::new(SourceReport::default());
        let blocks = HintBlocks::new(
            HintReader::open(&hp).unwrap(),
            files.clone(),
            HashSet::new(),
            8192,
            report.clone(),
        );
        let id = files.resolve("f").unwrap().id;
        let got: Vec<u64> = blocks
            .map(|b| {
                assert_eq!(b.file, id);
                b.index
            })
            .collect();
        assert_eq!(got, vec![0, 1, 2, 4, 0, 1, 2, 4]);
        let r = report.snapshot();
        assert_eq!(r.records, 10);
        assert_eq!(r.ignored_unknown, 2);
        assert_eq!(r.ignored_beyond_eof, 2);
    }

    #[test]
    fn hints_of_changed_files_are_reported_and_ignored() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("data");
        fs::create_dir(&root).unwrap();
        fs::write(root.join("a"), vec![1u8; 8192]).unwrap();
        fs::write(root.join("b"), vec![1u8; 8192]).unwrap();
        let mut h = HintHeader::new("j", 8192);
        h.files = vec![
            hints::FileDecl {
                path: "a".into(),
                size: 8192,
                mtime_ns: None,
            },
            hints::FileDecl {
                path: "b".into(),
                size: 4096,
                mtime_ns: None,
            },
        ];
        let hp = d.path().join("j.hints");
        write_hints(
            &hp,
            &h,
            &[HintRecord::new("a", 0, 10), HintRecord::new("b", 0, 10)],
        );
        let files = Arc::new(FileTable::new(&root).unwrap());
        let o = open_hints(&hp, files, 8192).unwrap();
        assert_eq!(o.stale.len(), 1);
        assert_eq!(o.stale[0].path, "b");
        assert_eq!(o.blocks.count(), 1);
        assert_eq!(o.report.snapshot().ignored_stale, 1);
    }

    #[test]
    fn a_malformed_hint_file_is_refused_at_registration() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("data");
        fs::create_dir(&root).unwrap();
        fs::write(root.join("f"), vec![0u8; 100_000]).unwrap();
        let hp = d.path().join("j.hints");
        fs::write(
            &hp,
            "netpager-hints 1\njob j\nblock-size 8192\nrecords\nf 0 10\nf 16384 10\nf x 1\nf 0 1\n",
        )
        .unwrap();
        let files = Arc::new(FileTable::new(&root).unwrap());
        let err = open_hints(&hp, files.clone(), 8192).err().expect("refused");
        assert!(err.to_string().contains("j.hints:7"), "{err}");
        // Read without the check, the stream stops at the bad record and
        // keeps the error.
        let report = Arc::new(SourceReport::default());
        let blocks = HintBlocks::new(
            HintReader::open(&hp).unwrap(),
            files,
            HashSet::new(),
            8192,
            report.clone(),
        );
        assert_eq!(blocks.map(|b| b.index).collect::<Vec<_>>(), vec![0, 2]);
        assert!(report.snapshot().error.unwrap().contains("j.hints:7"));
    }

    #[test]
    fn the_reader_thread_streams_blocks_lazily() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("data");
        fs::create_dir(&root).unwrap();
        fs::write(root.join("f"), vec![0u8; 8192 * 4000]).unwrap();
        let hp = d.path().join("j.hints");
        let records: Vec<_> = (0..4000)
            .map(|i| HintRecord::new("f", i * 8192, 8192))
            .collect();
        write_hints(&hp, &HintHeader::new("j", 8192), &records);
        let o = open_hints(&hp, Arc::new(FileTable::new(&root).unwrap()), 8192).unwrap();
        let mut blocks = o.blocks;
        assert_eq!(blocks.next().map(|b| b.index), Some(0));
        // The reader is bounded by the channel, not by the file: once it
        // has filled the channel it waits there.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while o.report.records.load(Ordering::Relaxed) < READ_AHEAD as u64 {
            assert!(
                std::time::Instant::now() < deadline,
                "the reader never filled the channel"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(o.report.records.load(Ordering::Relaxed) <= READ_AHEAD as u64 + 2);
        assert_eq!(blocks.count(), 3999);
    }
}
