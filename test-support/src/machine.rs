//! What test runs on one machine share, and how they keep apart (the
//! Python harness's `netpager_testkit/machine.py` takes the same files).
//!
//! Each test process holds a loopback block 127.N.0.0/16 of its own, so a
//! port picked free there is never taken by another run before nbdkit binds
//! it; and a test that flips a machine-wide switch (FUSE over io_uring's)
//! holds that switch's lock, which the other runs' attaches and detaches
//! take too. Each is an flock on a file in /run/lock, released by the
//! kernel when the process exits, however it exits.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno;

fn lock_path(name: &str) -> PathBuf {
    let run = std::path::Path::new("/run/lock");
    let dir = if run.is_dir() {
        run.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("netpager-test-{name}.lock"))
}

fn open(name: &str) -> File {
    let path = lock_path(name);
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Takes the file's exclusive flock if it is free: Ok(false) if it is not.
fn try_lock(f: &File) -> std::io::Result<bool> {
    match flock(f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Writes who holds the lock into its file (read by a run that waits).
fn mark(mut f: &File, what: &str) {
    let _ = f.set_len(0);
    let _ = writeln!(f, "pid {}: {what}", std::process::id());
}

/// N of the block 127.N.0.0/16 this process holds (taken on first use,
/// kept until it exits).
pub fn loopback_block() -> u8 {
    static BLOCK: OnceLock<(u8, File)> = OnceLock::new();
    BLOCK
        .get_or_init(|| {
            for n in 1..=254u8 {
                let f = open(&format!("net-{n}"));
                match try_lock(&f) {
                    Ok(true) => {
                        mark(&f, &format!("127.{n}.0.0/16"));
                        return (n, f);
                    }
                    Ok(false) => continue,
                    Err(e) => panic!("lock a loopback block: {e}"),
                }
            }
            panic!("every loopback block 127.1-254.0.0/16 is held by other test processes")
        })
        .0
}

/// A machine-wide lock, held until dropped.
pub struct MachineLock {
    _file: File,
}

impl MachineLock {
    /// Waits (up to half an hour, then panics naming the holder) for the
    /// lock `name`: "uring-switch" for FUSE over io_uring's switch.
    pub fn acquire(name: &str, what: &str) -> MachineLock {
        let f = open(name);
        let deadline = Instant::now() + Duration::from_secs(1800);
        loop {
            match try_lock(&f) {
                Ok(true) => {
                    mark(&f, what);
                    return MachineLock { _file: f };
                }
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Ok(false) => panic!(
                    "waited half an hour for {} ({what}), held by {}",
                    lock_path(name).display(),
                    std::fs::read_to_string(lock_path(name)).unwrap_or_default()
                ),
                Err(e) => panic!("lock {} ({what}): {e}", lock_path(name).display()),
            }
        }
    }
}
