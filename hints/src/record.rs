//! Hint files from what jobs did: recording a run's reads ([`Recorder`]),
//! combining recordings ([`merge`]) and reducing one to its distinct
//! blocks ([`distinct`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use crate::error::{ErrorKind, HintError, Location};
use crate::{FileDecl, Format, HintHeader, HintReader, HintRecord, HintWriter};

/// Records a job's reads, in order, as a hint file.
///
/// Records go to a spool file beside the output (`OUT.part`) as they come;
/// [`Recorder::finish`] writes the output with a header declaring every
/// file read (size and mtime as the recorder was told at the file's first
/// read, so a recording of files changed since is stale like any hint
/// file) and removes the spool.
pub struct Recorder {
    out: PathBuf,
    spool_path: PathBuf,
    spool: HintWriter<File>,
    header: HintHeader,
    declared: BTreeMap<String, FileDecl>,
}

impl Recorder {
    /// Starts a recording of job `job` into `out`.
    pub fn create(out: &Path, job: &str, block_size: u32) -> Result<Recorder, HintError> {
        let header = HintHeader::new(job, block_size);
        let mut spool_path = out.as_os_str().to_owned();
        spool_path.push(".part");
        let spool_path = PathBuf::from(spool_path);
        let spool = HintWriter::create(&spool_path, Format::Binary, &header)?;
        Ok(Recorder {
            out: out.to_path_buf(),
            spool_path,
            spool,
            header,
            declared: BTreeMap::new(),
        })
    }

    /// The output file.
    pub fn path(&self) -> &Path {
        &self.out
    }

    /// Appends a read of `length` bytes of `path` at `offset`; `decl` gives
    /// the file's declaration at its first read.
    pub fn read(
        &mut self,
        path: &str,
        offset: u64,
        length: u64,
        decl: impl FnOnce() -> FileDecl,
    ) -> Result<(), HintError> {
        self.spool.write(&HintRecord::new(path, offset, length))?;
        if !self.declared.contains_key(path) {
            self.declared.insert(path.to_owned(), decl());
        }
        Ok(())
    }

    /// Writes the hint file (text form); returns the number of records.
    pub fn finish(self) -> Result<u64, HintError> {
        self.spool.finish()?;
        let header = HintHeader {
            files: self.declared.into_values().collect(),
            ..self.header
        };
        let reader = HintReader::open(&self.spool_path)?;
        let mut w = HintWriter::create(&self.out, Format::Text, &header)?;
        for r in reader {
            w.write(&r?)?;
        }
        let n = w.records_written();
        w.finish()?;
        fs::remove_file(&self.spool_path).map_err(|e| {
            HintError::io(&self.spool_path.display().to_string(), Location::File, e)
        })?;
        Ok(n)
    }
}

/// Writes the records of every input, one after the other (every pass of
/// each), as one hint file of job `job` (default: the first input's).
/// Block sizes must agree; file declarations are combined, and must agree
/// where two inputs declare one file. Returns the number of records.
pub fn merge(
    inputs: &[PathBuf],
    out: &Path,
    format: Format,
    job: Option<&str>,
) -> Result<u64, HintError> {
    let origin = |p: &Path| p.display().to_string();
    let mut header: Option<HintHeader> = None;
    let mut declared: BTreeMap<String, FileDecl> = BTreeMap::new();
    for input in inputs {
        let r = HintReader::open(input)?;
        let h = r.header();
        let first = header.get_or_insert_with(|| h.clone());
        if h.block_size != first.block_size {
            return Err(HintError::new(
                &origin(input),
                Location::File,
                ErrorKind::BlockSizeMismatch {
                    expected: first.block_size,
                    found: h.block_size,
                },
            ));
        }
        for f in &h.files {
            match declared.get(&f.path) {
                Some(d) if d != f => {
                    return Err(HintError::new(
                        &origin(input),
                        Location::File,
                        ErrorKind::ConflictingDeclaration(f.path.clone()),
                    ))
                }
                Some(_) => {}
                None => {
                    declared.insert(f.path.clone(), f.clone());
                }
            }
        }
    }
    let Some(first) = header else {
        return Err(HintError::new(
            &origin(out),
            Location::File,
            ErrorKind::Syntax("nothing to merge: no input".into()),
        ));
    };
    let header = HintHeader {
        job: job.map_or(first.job, str::to_owned),
        repeat: 1,
        files: declared.into_values().collect(),
        ..first
    };
    let mut w = HintWriter::create(out, format, &header)?;
    for input in inputs {
        for r in HintReader::open(input)?.references() {
            w.write(&r?.record)?;
        }
    }
    let n = w.records_written();
    w.finish()?;
    Ok(n)
}

/// Writes `input` reduced to its distinct blocks in first-use order (over
/// every pass): each record keeps the part covering blocks not read
/// before, as few records as that takes. Returns the number of records.
pub fn distinct(input: &Path, out: &Path, format: Format) -> Result<u64, HintError> {
    let reader = HintReader::open(input)?;
    let header = HintHeader {
        repeat: 1,
        ..reader.header().clone()
    };
    let bs = u64::from(header.block_size);
    let mut paths: HashMap<String, u32> = HashMap::new();
    let mut seen: HashSet<(u32, u64)> = HashSet::new();
    let mut w = HintWriter::create(out, format, &header)?;
    for r in reader.references() {
        let r = r?.record;
        let next = paths.len() as u32;
        let id = *paths.entry(r.path.clone()).or_insert(next);
        let mut run: Option<(u64, u64)> = None;
        for block in r.blocks(header.block_size) {
            if seen.insert((id, block)) {
                run = Some(run.map_or((block, block + 1), |(a, _)| (a, block + 1)));
                continue;
            }
            if let Some(run) = run.take() {
                w.write(&clip(&r, run, bs))?;
            }
        }
        if let Some(run) = run {
            w.write(&clip(&r, run, bs))?;
        }
    }
    let n = w.records_written();
    w.finish()?;
    Ok(n)
}

/// The part of record `r` in blocks `run.0..run.1`.
fn clip(r: &HintRecord, run: (u64, u64), bs: u64) -> HintRecord {
    let start = (run.0 * bs).max(r.offset);
    let end = (run.1 * bs).min(r.end());
    HintRecord::new(r.path.clone(), start, end - start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decl(path: &str, size: u64) -> FileDecl {
        FileDecl {
            path: path.into(),
            size,
            mtime_ns: Some(1_700_000_000_000_000_000),
        }
    }

    fn records(path: &Path) -> Vec<(String, u64, u64)> {
        HintReader::open(path)
            .unwrap()
            .map(|r| {
                let r = r.unwrap();
                (r.path, r.offset, r.length)
            })
            .collect()
    }

    fn write(path: &Path, header: &HintHeader, recs: &[(&str, u64, u64)]) {
        let mut w = HintWriter::create(path, Format::Text, header).unwrap();
        for &(p, o, l) in recs {
            w.write(&HintRecord::new(p, o, l)).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn a_recording_declares_each_file_at_its_first_read() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("job.hints");
        let mut rec = Recorder::create(&out, "scan", 8192).unwrap();
        let mut asked = 0;
        for (p, o) in [("b.db", 0), ("a.db", 4096), ("b.db", 8192)] {
            rec.read(p, o, 4096, || {
                asked += 1;
                decl(p, 65536)
            })
            .unwrap();
        }
        assert_eq!(asked, 2);
        assert!(d.path().join("job.hints.part").exists());
        assert_eq!(rec.finish().unwrap(), 3);
        assert!(!d.path().join("job.hints.part").exists());
        let r = HintReader::open(&out).unwrap();
        assert_eq!(r.format(), Format::Text);
        assert_eq!(r.header().job, "scan");
        assert_eq!(
            r.header().files,
            vec![decl("a.db", 65536), decl("b.db", 65536)]
        );
        assert_eq!(
            records(&out),
            vec![
                ("b.db".into(), 0, 4096),
                ("a.db".into(), 4096, 4096),
                ("b.db".into(), 8192, 4096)
            ]
        );
    }

    #[test]
    fn merge_concatenates_and_combines_declarations() {
        let d = tempfile::tempdir().unwrap();
        let (a, b, out) = (d.path().join("a"), d.path().join("b"), d.path().join("o"));
        let mut h = HintHeader::new("one", 4096);
        h.files = vec![decl("x", 100)];
        h.repeat = 2;
        write(&a, &h, &[("x", 0, 10)]);
        h.files = vec![decl("x", 100), decl("y", 5)];
        h.repeat = 1;
        write(&b, &h, &[("y", 0, 5)]);
        assert_eq!(
            merge(&[a.clone(), b.clone()], &out, Format::Binary, Some("both")).unwrap(),
            3
        );
        let r = HintReader::open(&out).unwrap();
        assert_eq!((r.header().job.as_str(), r.header().repeat), ("both", 1));
        assert_eq!(r.header().files.len(), 2);
        assert_eq!(
            records(&out),
            vec![("x".into(), 0, 10), ("x".into(), 0, 10), ("y".into(), 0, 5)]
        );
        // A file that changed between the recordings.
        h.files = vec![decl("x", 200)];
        write(&b, &h, &[("x", 0, 5)]);
        let e = merge(&[a.clone(), b.clone()], &out, Format::Text, None).unwrap_err();
        assert!(e.to_string().contains("field 'file': \"x\""), "{e}");
        assert!(e.to_string().starts_with(&b.display().to_string()), "{e}");
        write(&b, &HintHeader::new("one", 8192), &[("x", 0, 5)]);
        let e = merge(&[a, b], &out, Format::Text, None).unwrap_err();
        assert!(e.to_string().contains("8192 differs from 4096"), "{e}");
    }

    #[test]
    fn distinct_keeps_first_uses_in_order() {
        let d = tempfile::tempdir().unwrap();
        let (a, out) = (d.path().join("a"), d.path().join("o"));
        let mut h = HintHeader::new("j", 4096);
        h.repeat = 3;
        write(
            &a,
            &h,
            &[
                ("f", 100, 50),     // block 0
                ("f", 0, 4096),     // block 0 again
                ("f", 4000, 9000),  // blocks 0..=3: 1..=3 are new
                ("g", 0, 10),       // another file's block 0
                ("f", 12288, 4096), // block 3 again
                ("f", 20480, 100),  // block 5
            ],
        );
        assert_eq!(distinct(&a, &out, Format::Text).unwrap(), 4);
        assert_eq!(
            records(&out),
            vec![
                ("f".into(), 100, 50),
                ("f".into(), 4096, 8904),
                ("g".into(), 0, 10),
                ("f".into(), 20480, 100)
            ]
        );
        assert_eq!(HintReader::open(&out).unwrap().header().repeat, 1);
    }
}
