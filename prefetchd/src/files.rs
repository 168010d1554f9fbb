//! The files of the served data directory.
//!
//! Each regular file gets a [`FileId`] and an open descriptor (O_DIRECT when
//! the file system allows it, so the kernel's page cache does not act as a
//! fourth, unaccounted level). A file found changed (size, mtime, inode)
//! when looked up again gets a *new* id: blocks cached under the old id are
//! never asked for again, so a changed file can never be served stale.
//!
//! The replica layout: donors' replicas serve the data set's regular files
//! concatenated in byte order of their relative paths (the *manifest*, see
//! [`manifest`]); a file's offset in the replica is the sum of the sizes of
//! the files before it. Only files unchanged since the daemon started are
//! read from replicas.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use thiserror::Error;

use crate::plan::FileId;

#[derive(Debug, Error)]
pub enum FileError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not a regular file")]
    NotAFile { path: PathBuf },
    #[error("{path}: path leaves the data directory or is not normalised")]
    BadPath { path: String },
}

/// What identifies a file's contents well enough to notice a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
}

impl Identity {
    pub fn of(meta: &fs::Metadata) -> Identity {
        Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

/// One open file of the data directory.
#[derive(Debug)]
pub struct FileEntry {
    pub id: FileId,
    /// Path relative to the data directory.
    pub rel: String,
    pub identity: Identity,
    pub file: Arc<File>,
    /// Offset of the file in the donors' replicas, if it is in them as it is.
    pub replica_offset: Option<u64>,
}

impl FileEntry {
    pub fn size(&self) -> u64 {
        self.identity.size
    }
}

/// The data set's regular files in replica order with their sizes.
pub fn manifest(root: &Path) -> Result<Vec<(String, u64)>, FileError> {
    let mut out = Vec::new();
    walk(root, root, &mut out)?;
    out.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    Ok(out)
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, u64)>) -> Result<(), FileError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FileError::Io { path, source }
    };
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let path = entry.path();
        let meta = fs::metadata(&path).map_err(io_err(&path))?;
        if meta.is_dir() {
            walk(root, &path, out)?;
        } else if meta.is_file() {
            let rel = path
                .strip_prefix(root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            out.push((rel, meta.len()));
        }
    }
    Ok(())
}

struct Table {
    by_path: HashMap<String, Arc<FileEntry>>,
    by_id: HashMap<FileId, Arc<FileEntry>>,
    next: FileId,
}

/// See the module documentation.
pub struct FileTable {
    root: PathBuf,
    replica: HashMap<String, (u64, u64)>,
    replica_size: u64,
    table: RwLock<Table>,
}

impl FileTable {
    /// The table of `root`; the replica manifest is taken now.
    pub fn new(root: &Path) -> Result<FileTable, FileError> {
        let root = root.canonicalize().map_err(|source| FileError::Io {
            path: root.to_path_buf(),
            source,
        })?;
        let mut replica = HashMap::new();
        let mut at = 0u64;
        for (rel, size) in manifest(&root)? {
            replica.insert(rel, (at, size));
            at += size;
        }
        Ok(FileTable {
            root,
            replica,
            replica_size: at,
            table: RwLock::new(Table {
                by_path: HashMap::new(),
                by_id: HashMap::new(),
                next: 1,
            }),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Total size of the replica layout (what a replica export must hold).
    pub fn replica_size(&self) -> u64 {
        self.replica_size
    }

    /// The current entry of `rel`, opening it or noticing a change.
    pub fn resolve(&self, rel: &str) -> Result<Arc<FileEntry>, FileError> {
        if hints::validate_path("path", rel).is_err() {
            return Err(FileError::BadPath {
                path: rel.to_owned(),
            });
        }
        let path = self.root.join(rel);
        let meta = fs::metadata(&path).map_err(|source| FileError::Io {
            path: path.clone(),
            source,
        })?;
        if !meta.is_file() {
            return Err(FileError::NotAFile { path });
        }
        let identity = Identity::of(&meta);
        if let Some(e) = self.table.read().expect("file table lock").by_path.get(rel) {
            if e.identity == identity {
                return Ok(e.clone());
            }
        }
        let file = open_data_file(&path)?;
        let replica_offset = self
            .replica
            .get(rel)
            .filter(|&&(_, size)| size == identity.size)
            .map(|&(offset, _)| offset);
        let mut t = self.table.write().expect("file table lock");
        if let Some(e) = t.by_path.get(rel) {
            if e.identity == identity {
                return Ok(e.clone());
            }
            // Changed since the replica manifest was taken: no replica reads.
            tracing::info!(
                "{}: changed on disk; cached blocks of the old version are dropped",
                path.display()
            );
        }
        let first_version = !t.by_path.contains_key(rel);
        let id = t.next;
        t.next += 1;
        let entry = Arc::new(FileEntry {
            id,
            rel: rel.to_owned(),
            identity,
            file: Arc::new(file),
            replica_offset: replica_offset.filter(|_| first_version),
        });
        t.by_path.insert(rel.to_owned(), entry.clone());
        t.by_id.insert(id, entry.clone());
        Ok(entry)
    }

    /// The entry with id `id` (also a superseded version, while in use).
    pub fn by_id(&self, id: FileId) -> Option<Arc<FileEntry>> {
        self.table
            .read()
            .expect("file table lock")
            .by_id
            .get(&id)
            .cloned()
    }
}

/// Opens read-only, with O_DIRECT where the file system supports it.
fn open_data_file(path: &Path) -> Result<File, FileError> {
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok(f),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::info!(
                "{}: no O_DIRECT here; disk reads go through the page cache",
                path.display()
            );
            File::open(path).map_err(|source| FileError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
        Err(source) => Err(FileError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_orders_files_bytewise_and_recurses() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir(d.path().join("sub")).unwrap();
        fs::write(d.path().join("b"), b"bb").unwrap();
        fs::write(d.path().join("a.x"), b"a").unwrap();
        fs::write(d.path().join("sub/c"), b"ccc").unwrap();
        let m = manifest(d.path()).unwrap();
        assert_eq!(
            m,
            vec![("a.x".into(), 1), ("b".into(), 2), ("sub/c".into(), 3)]
        );
        let t = FileTable::new(d.path()).unwrap();
        assert_eq!(t.replica_size(), 6);
        assert_eq!(t.resolve("sub/c").unwrap().replica_offset, Some(3));
    }

    #[test]
    fn a_changed_file_gets_a_new_id_and_leaves_the_replica() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        fs::write(&p, b"1234").unwrap();
        let t = FileTable::new(d.path()).unwrap();
        let a = t.resolve("f").unwrap();
        assert_eq!(t.resolve("f").unwrap().id, a.id);
        fs::write(&p, b"123456").unwrap();
        let b = t.resolve("f").unwrap();
        assert_ne!(a.id, b.id);
        assert_eq!((b.size(), b.replica_offset), (6, None));
        assert!(t.by_id(a.id).is_some());
    }

    #[test]
    fn refuses_paths_outside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let t = FileTable::new(d.path()).unwrap();
        assert!(matches!(
            t.resolve("../etc/passwd"),
            Err(FileError::BadPath { .. })
        ));
        assert!(matches!(t.resolve("missing"), Err(FileError::Io { .. })));
    }
}
