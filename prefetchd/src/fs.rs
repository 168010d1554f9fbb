//! The read-only FUSE view of the data directory.
//!
//! ```text
//! MOUNT/data/...        the data directory; reads are unhinted
//! MOUNT/jobs/NAME/...   the same files; reads are job NAME's
//! ```
//!
//! A job reads through its own subtree, so every read is attributed to
//! it without tracking processes: the subtree is the job's identity.
//! Only directories and regular files are shown.
//!
//! **The page cache.** By default the kernel caches what it read of a
//! file (each view of a file is its own inode, so each job its own copy)
//! and reads ahead sequentially (up to the daemon's `--readahead`): a
//! re-read costs what it costs on any file, and only the *first* read of a
//! block reaches the daemon. The cache is kept across opens while the file
//! keeps its identity (device, inode, size, mtime); an open that finds the
//! file changed drops it, and file attributes are never cached, so a
//! changed file is never served stale. With `direct_io` every read
//! reaches the daemon instead (the kernel neither caches nor reads ahead).
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::consts::{FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE};
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, Request,
};

use crate::daemon::Daemon;
use crate::files::FileEntry;
use crate::plan::FileId;

/// How long the kernel may keep a directory's attributes and entries.
const TTL: Duration = Duration::from_secs(1);
/// Regular files' attributes are asked for each time: the kernel then
/// sees a changed size at once (it clamps cached reads to the size).
const FILE_TTL: Duration = Duration::ZERO;
const ROOT: u64 = 1;

/// A node of the mount.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Node {
    Root,
    Jobs,
    /// A path of the data directory seen through a view: `job` None is
    /// `data/`, Some(name) is `jobs/NAME/`.
    View {
        job: Option<String>,
        rel: String,
    },
}

struct Handle {
    file: Arc<FileEntry>,
    job: Option<String>,
}

/// See the module documentation.
pub struct PrefetchFs {
    daemon: Arc<Daemon>,
    nodes: Vec<Node>,
    inos: HashMap<Node, u64>,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    mounted_at: SystemTime,
    /// The file version whose data the kernel may hold, per inode.
    cached: HashMap<u64, FileId>,
    /// Largest kernel readahead, in bytes (0: none).
    readahead: u32,
}

impl PrefetchFs {
    /// The view of `daemon`'s data directory; with the page cache, the
    /// kernel reads ahead at most `readahead` bytes.
    pub fn new(daemon: Arc<Daemon>, readahead: u32) -> PrefetchFs {
        let mut fs = PrefetchFs {
            daemon,
            nodes: Vec::new(),
            inos: HashMap::new(),
            handles: HashMap::new(),
            next_fh: 1,
            mounted_at: SystemTime::now(),
            cached: HashMap::new(),
            readahead,
        };
        fs.ino(Node::Root);
        fs
    }

    fn ino(&mut self, node: Node) -> u64 {
        if let Some(&i) = self.inos.get(&node) {
            return i;
        }
        self.nodes.push(node.clone());
        let i = self.nodes.len() as u64;
        self.inos.insert(node, i);
        i
    }

    fn node(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(ino.checked_sub(1)? as usize)
    }

    fn synthetic_dir(&self, ino: u64) -> FileAttr {
        FileAttr {
            ino,
            size: 0,
            blocks: 0,
            atime: self.mounted_at,
            mtime: self.mounted_at,
            ctime: self.mounted_at,
            crtime: self.mounted_at,
            kind: FileType::Directory,
            perm: 0o555,
            nlink: 2,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: self.daemon.block_size() as u32,
            flags: 0,
        }
    }

    fn underlying(&self, rel: &str) -> std::path::PathBuf {
        if rel.is_empty() {
            self.daemon.files().root().to_path_buf()
        } else {
            self.daemon.files().root().join(rel)
        }
    }

    /// Attributes of a view node from the file it shows; None if it is
    /// gone or neither a directory nor a regular file.
    fn view_attr(&self, ino: u64, rel: &str) -> Option<FileAttr> {
        let meta = fs::metadata(self.underlying(rel)).ok()?;
        let kind = if meta.is_dir() {
            FileType::Directory
        } else if meta.is_file() {
            FileType::RegularFile
        } else {
            return None;
        };
        let time = |secs: i64, nsecs: i64| {
            if secs >= 0 {
                UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
            } else {
                UNIX_EPOCH
            }
        };
        Some(FileAttr {
            ino,
            size: meta.size(),
            blocks: meta.blocks(),
            atime: time(meta.atime(), meta.atime_nsec()),
            mtime: time(meta.mtime(), meta.mtime_nsec()),
            ctime: time(meta.ctime(), meta.ctime_nsec()),
            crtime: time(meta.ctime(), meta.ctime_nsec()),
            kind,
            perm: (meta.mode() & 0o7555) as u16,
            nlink: meta.nlink() as u32,
            uid: meta.uid(),
            gid: meta.gid(),
            rdev: 0,
            blksize: self.daemon.block_size() as u32,
            flags: 0,
        })
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        match self.node(ino)? {
            Node::Root | Node::Jobs => Some(self.synthetic_dir(ino)),
            Node::View { rel, .. } => self.view_attr(ino, rel),
        }
    }

    /// Children of a directory node: (name, node, kind).
    fn children(&self, node: &Node) -> Vec<(String, Node, FileType)> {
        match node {
            Node::Root => vec![
                (
                    "data".into(),
                    Node::View {
                        job: None,
                        rel: String::new(),
                    },
                    FileType::Directory,
                ),
                ("jobs".into(), Node::Jobs, FileType::Directory),
            ],
            Node::Jobs => self
                .daemon
                .job_names()
                .into_iter()
                .map(|n| {
                    (
                        n.clone(),
                        Node::View {
                            job: Some(n),
                            rel: String::new(),
                        },
                        FileType::Directory,
                    )
                })
                .collect(),
            Node::View { job, rel } => {
                let Ok(rd) = fs::read_dir(self.underlying(rel)) else {
                    return Vec::new();
                };
                let mut out: Vec<_> = rd
                    .flatten()
                    .filter_map(|e| {
                        let name = e.file_name().into_string().ok()?;
                        let meta = fs::metadata(e.path()).ok()?;
                        let kind = if meta.is_dir() {
                            FileType::Directory
                        } else if meta.is_file() {
                            FileType::RegularFile
                        } else {
                            return None;
                        };
                        let child = Node::View {
                            job: job.clone(),
                            rel: join(rel, &name),
                        };
                        Some((name, child, kind))
                    })
                    .collect();
                out.sort_by(|a, b| a.0.cmp(&b.0));
                out
            }
        }
    }
}

fn join(rel: &str, name: &str) -> String {
    if rel.is_empty() {
        name.to_owned()
    } else {
        format!("{rel}/{name}")
    }
}

fn ttl(attr: &FileAttr) -> Duration {
    match attr.kind {
        FileType::RegularFile => FILE_TTL,
        _ => TTL,
    }
}

impl Filesystem for PrefetchFs {
    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), libc::c_int> {
        let ra = if self.daemon.page_cache() {
            self.readahead
        } else {
            0
        };
        // 0 is refused, 1 byte rounds down to no readahead; above the
        // kernel's limit, its limit.
        if let Err(nearest) = config.set_max_readahead(ra.max(1)) {
            let _ = config.set_max_readahead(nearest);
        }
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let Some(parent) = self.node(parent).cloned() else {
            return reply.error(libc::ENOENT);
        };
        let Some(name) = name.to_str() else {
            return reply.error(libc::ENOENT);
        };
        let child = match &parent {
            Node::Root => match name {
                "data" => Node::View {
                    job: None,
                    rel: String::new(),
                },
                "jobs" => Node::Jobs,
                _ => return reply.error(libc::ENOENT),
            },
            Node::Jobs if self.daemon.has_job(name) => Node::View {
                job: Some(name.to_owned()),
                rel: String::new(),
            },
            Node::Jobs => return reply.error(libc::ENOENT),
            Node::View { job, rel } => {
                if name == "." || name == ".." || name.contains('/') {
                    return reply.error(libc::ENOENT);
                }
                Node::View {
                    job: job.clone(),
                    rel: join(rel, name),
                }
            }
        };
        let ino = self.ino(child);
        match self.attr(ino) {
            Some(a) => reply.entry(&ttl(&a), &a, 0),
            None => reply.error(libc::ENOENT),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&ttl(&a), &a),
            None => reply.error(libc::ENOENT),
        }
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let Some(node) = self.node(ino).cloned() else {
            return reply.error(libc::ENOENT);
        };
        if matches!(node, Node::View { .. })
            && self.attr(ino).map(|a| a.kind) != Some(FileType::Directory)
        {
            return reply.error(libc::ENOTDIR);
        }
        let mut entries = vec![
            (".".to_owned(), ino, FileType::Directory),
            ("..".to_owned(), ROOT, FileType::Directory),
        ];
        for (name, child, kind) in self.children(&node) {
            let i = self.ino(child);
            entries.push((name, i, kind));
        }
        for (i, (name, ino, kind)) in entries.into_iter().enumerate().skip(offset.max(0) as usize) {
            if reply.add(ino, (i + 1) as i64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        let Some(Node::View { job, rel }) = self.node(ino).cloned() else {
            return reply.error(libc::EISDIR);
        };
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return reply.error(libc::EROFS);
        }
        match self.daemon.files().resolve(&rel) {
            Ok(file) => {
                let fh = self.next_fh;
                self.next_fh += 1;
                let flags = if !self.daemon.page_cache() {
                    FOPEN_DIRECT_IO
                } else if self.cached.insert(ino, file.id) == Some(file.id) {
                    FOPEN_KEEP_CACHE
                } else {
                    // A new file, or a changed one: without KEEP_CACHE the
                    // kernel drops what it holds of the inode.
                    0
                };
                self.handles.insert(fh, Handle { file, job });
                reply.opened(fh, flags);
            }
            Err(e) => {
                tracing::debug!("open {rel}: {e}");
                reply.error(match e {
                    crate::files::FileError::NotAFile { .. } => libc::EISDIR,
                    crate::files::FileError::Io { source, .. } => {
                        source.raw_os_error().unwrap_or(libc::EIO)
                    }
                    crate::files::FileError::BadPath { .. } => libc::ENOENT,
                })
            }
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let Some(h) = self.handles.get(&fh) else {
            return reply.error(libc::EBADF);
        };
        if offset < 0 {
            return reply.error(libc::EINVAL);
        }
        self.daemon.read(
            h.job.as_deref(),
            &h.file,
            offset as u64,
            size,
            Box::new(move |r| match r {
                Ok(data) => reply.data(&data),
                Err(errno) => reply.error(errno),
            }),
        );
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.handles.remove(&fh);
        reply.ok();
    }
}

/// Mount options: read-only, visible to every user. (fusermount3's
/// auto_unmount is not used: its watcher does not survive here, and the
/// mount then outlives a clean stop. A daemon killed with SIGKILL leaves
/// the mount behind; `fusermount3 -u MOUNT` removes it.)
pub fn mount_options() -> Vec<fuser::MountOption> {
    use fuser::MountOption::*;
    vec![
        FSName("prefetchd".into()),
        Subtype("prefetchd".into()),
        RO,
        NoAtime,
        AllowOther,
        DefaultPermissions,
    ]
}

/// Whether `path` is the root of a mount (its device differs from its
/// parent's).
pub fn is_mount_point(path: &Path) -> bool {
    let (Ok(m), Some(parent)) = (fs::metadata(path), path.parent()) else {
        return false;
    };
    fs::metadata(parent).is_ok_and(|p| p.dev() != m.dev())
}
