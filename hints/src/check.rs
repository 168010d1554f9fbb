//! Staleness: hints about files that changed since the hints were written.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::path::Path;
use std::time::UNIX_EPOCH;

use serde::Serialize;

use crate::text::format_mtime;
use crate::{HintError, HintReader};

/// A file whose hints no longer match it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Staleness {
    /// Path relative to the data set root.
    pub path: String,
    /// What differs.
    #[serde(flatten)]
    pub problem: Stale,
}

/// What differs between the hints and the file on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "problem", rename_all = "kebab-case")]
pub enum Stale {
    /// The file does not exist.
    Missing,
    /// The path exists but is not a regular file.
    NotAFile,
    /// The file cannot be examined (permissions, ...).
    Unreadable {
        /// The operating system's error.
        error: String,
    },
    /// The header declared another size.
    SizeDiffers {
        /// Size in the header.
        declared: u64,
        /// Size on disk.
        actual: u64,
    },
    /// The header declared another modification time.
    MtimeDiffers {
        /// Nanoseconds since the epoch, in the header.
        declared_ns: i64,
        /// Nanoseconds since the epoch, on disk.
        actual_ns: i64,
    },
    /// `records` records read past the end of the file; the first is
    /// record `first_record` (0-based, in file order), ending at
    /// `first_end`.
    BeyondEof {
        /// Size on disk.
        size: u64,
        /// Records reading past it.
        records: u64,
        /// Index of the first such record.
        first_record: u64,
        /// Where that record ends.
        first_end: u64,
    },
}

impl fmt::Display for Staleness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.path)?;
        match &self.problem {
            Stale::Missing => write!(f, "missing"),
            Stale::NotAFile => write!(f, "not a regular file"),
            Stale::Unreadable { error } => write!(f, "cannot examine: {error}"),
            Stale::SizeDiffers { declared, actual } => {
                write!(f, "size differs: hints say {declared} bytes, file has {actual}")
            }
            Stale::MtimeDiffers { declared_ns, actual_ns } => write!(
                f,
                "mtime differs: hints say {}, file has {}",
                format_mtime(*declared_ns),
                format_mtime(*actual_ns)
            ),
            Stale::BeyondEof {
                size,
                records,
                first_record,
                first_end,
            } => write!(
                f,
                "{records} record(s) read beyond end of file ({size} bytes); first is record {first_record}, ending at {first_end}"
            ),
        }
    }
}

struct Seen {
    /// Actual size, when the file could be examined.
    size: Option<u64>,
    order: usize,
    beyond: Option<(u64, u64, u64)>,
}

fn examine(root: &Path, path: &str) -> Result<(u64, i64), Stale> {
    let meta = match fs::metadata(root.join(path)) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Stale::Missing),
        Err(e) => {
            return Err(Stale::Unreadable {
                error: e.to_string(),
            })
        }
    };
    if !meta.is_file() {
        return Err(Stale::NotAFile);
    }
    let mtime_ns = meta
        .modified()
        .map(|t| match t.duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
            Err(before) => i64::try_from(before.duration().as_nanos()).map_or(i64::MIN, |n| -n),
        })
        .unwrap_or(0);
    Ok((meta.len(), mtime_ns))
}

impl HintReader {
    /// Compares the hints with the files under `root`: every declared file
    /// (header `file` entries: existence, size, mtime when recorded) and
    /// every file the records of one pass name (existence, records past the
    /// end of file). Each file is examined once; memory grows with the
    /// number of distinct paths only. Missing, size and mtime problems come
    /// first (header order, then order of first appearance in the records),
    /// then records beyond end of file (same order); an empty list means
    /// the hints are fresh.
    pub fn check_against(mut self, root: &Path) -> Result<Vec<Staleness>, HintError> {
        let mut out = Vec::new();
        let mut seen: HashMap<String, Seen> = HashMap::new();
        for decl in &self.header().files {
            let size = match examine(root, &decl.path) {
                Err(problem) => {
                    out.push(Staleness {
                        path: decl.path.clone(),
                        problem,
                    });
                    None
                }
                Ok((size, mtime_ns)) => {
                    if size != decl.size {
                        out.push(Staleness {
                            path: decl.path.clone(),
                            problem: Stale::SizeDiffers {
                                declared: decl.size,
                                actual: size,
                            },
                        });
                    }
                    if let Some(declared_ns) = decl.mtime_ns {
                        if declared_ns != mtime_ns {
                            out.push(Staleness {
                                path: decl.path.clone(),
                                problem: Stale::MtimeDiffers {
                                    declared_ns,
                                    actual_ns: mtime_ns,
                                },
                            });
                        }
                    }
                    Some(size)
                }
            };
            let order = seen.len();
            seen.insert(
                decl.path.clone(),
                Seen {
                    size,
                    order,
                    beyond: None,
                },
            );
        }
        for (index, r) in self.by_ref().enumerate() {
            let index = index as u64;
            let r = r?;
            if !seen.contains_key(r.path.as_str()) {
                let size = match examine(root, &r.path) {
                    Ok((size, _)) => Some(size),
                    Err(problem) => {
                        out.push(Staleness {
                            path: r.path.clone(),
                            problem,
                        });
                        None
                    }
                };
                let order = seen.len();
                seen.insert(
                    r.path.clone(),
                    Seen {
                        size,
                        order,
                        beyond: None,
                    },
                );
            }
            let s = seen.get_mut(r.path.as_str()).expect("inserted above");
            if let Some(size) = s.size {
                if r.end() > size {
                    match &mut s.beyond {
                        Some((count, _, _)) => *count += 1,
                        None => s.beyond = Some((1, index, r.end())),
                    }
                }
            }
        }
        let mut beyond: Vec<(usize, Staleness)> = seen
            .into_iter()
            .filter_map(|(path, s)| {
                let (records, first_record, first_end) = s.beyond?;
                let size = s.size?;
                Some((
                    s.order,
                    Staleness {
                        path,
                        problem: Stale::BeyondEof {
                            size,
                            records,
                            first_record,
                            first_end,
                        },
                    },
                ))
            })
            .collect();
        beyond.sort_by_key(|(order, _)| *order);
        out.extend(beyond.into_iter().map(|(_, s)| s));
        Ok(out)
    }
}
