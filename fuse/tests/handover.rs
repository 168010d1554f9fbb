//! A serving process killed with a request read and unanswered (root): a
//! holder keeps the connection, the next server takes it over its socket,
//! sends FUSE_NOTIFY_RESEND and answers the request the dead one left, and
//! the reader gets the right bytes.
//!
//! The killed server is this test binary run again as a child
//! (`handover_child`, selected by an environment variable), so that the
//! test can SIGKILL it; both servers answer from one backing file.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pager_fuse::handover::{self, Request};
use pager_fuse::{Backend, Mount, Options};

const SIZE: u64 = 4 << 20;
/// The read the first server never answers.
const STALL_AT: u64 = 1 << 20;

/// A backend over a file, so that two processes serve the same bytes.
/// With `stall` set, a read at [`STALL_AT`] never returns.
struct FileBackend {
    file: File,
    stall: Option<PathBuf>,
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        SIZE
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        if offset == STALL_AT {
            if let Some(marker) = &self.stall {
                let _ = std::fs::write(marker, b"stalled");
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
        }
        self.file.read_exact_at(buf, offset).map_err(|_| libc::EIO)
    }
    fn write(&self, data: &[u8], offset: u64) -> Result<(), i32> {
        self.file.write_all_at(data, offset).map_err(|_| libc::EIO)
    }
    fn zero(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.write(&vec![0; len as usize], offset)
    }
    fn trim(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.zero(len, offset)
    }
    fn flush(&self) -> Result<(), i32> {
        Ok(())
    }
}

fn root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

fn opts() -> Options {
    Options {
        threads: 2,
        ..Options::default()
    }
}

/// The holder: keeps `connection` and gives it to whoever asks; the
/// first taker gets it fresh (INIT to answer).
fn hold(listener: UnixListener, connection: File, stop: Arc<AtomicBool>) {
    let mut fresh = true;
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).unwrap();
                let line = handover::read_line(&mut s).unwrap();
                if Request::parse(&line) == Ok(Request::Take) {
                    handover::give(&s, &connection, fresh).unwrap();
                    fresh = false;
                }
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// The first server, run as a child process: serves until killed.
#[test]
fn handover_child() {
    let Ok(socket) = std::env::var("NP_HANDOVER_SOCKET") else {
        return;
    };
    let backing = std::env::var("NP_HANDOVER_BACKING").unwrap();
    let marker = std::env::var("NP_HANDOVER_MARKER").unwrap();
    let mountpoint = std::env::var("NP_HANDOVER_MOUNT").unwrap();
    let (fd, fresh) = handover::take(Path::new(&socket), Duration::from_secs(10)).unwrap();
    assert!(fresh);
    let backend = FileBackend {
        file: OpenOptions::new()
            .read(true)
            .write(true)
            .open(backing)
            .unwrap(),
        stall: Some(marker.into()),
    };
    let m = Mount::serve_held(backend, fd, Path::new(&mountpoint), &opts(), true).unwrap();
    let _ = m.wait();
}

/// Unmounts and stops the holder on every exit path.
struct Cleanup {
    mountpoint: PathBuf,
    stop: Arc<AtomicBool>,
    child: Option<std::process::Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = pager_fuse::unmount(&self.mountpoint, true);
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[test]
fn a_killed_servers_unanswered_read_is_answered_by_the_next() {
    if std::env::var_os("NP_HANDOVER_SOCKET").is_some() {
        return;
    }
    if !root() {
        panic!("needs root (mounts FUSE)");
    }
    let dir = tempfile::tempdir().unwrap();
    let mountpoint = dir.path().join("mnt");
    std::fs::create_dir(&mountpoint).unwrap();
    let backing = dir.path().join("backing");
    let pattern: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&backing, &pattern).unwrap();
    let socket = dir.path().join("holder.sock");
    let marker = dir.path().join("stalled");

    let connection = pager_fuse::mount_connection(&mountpoint, &opts()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut cleanup = Cleanup {
        mountpoint: mountpoint.clone(),
        stop: stop.clone(),
        child: None,
    };
    let listener = UnixListener::bind(&socket).unwrap();
    let holder = std::thread::spawn(move || hold(listener, connection, stop));

    cleanup.child = Some(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "handover_child", "--nocapture"])
            .env("NP_HANDOVER_SOCKET", &socket)
            .env("NP_HANDOVER_BACKING", &backing)
            .env("NP_HANDOVER_MARKER", &marker)
            .env("NP_HANDOVER_MOUNT", &mountpoint)
            .spawn()
            .unwrap(),
    );
    // Wait for the first server (INIT answered: the file has its size).
    let file = mountpoint.join("device");
    let start = Instant::now();
    while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) != SIZE {
        assert!(start.elapsed() < Duration::from_secs(20), "no first server");
        std::thread::sleep(Duration::from_millis(20));
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&file)
        .unwrap();
    let f = Arc::new(f);
    // A write the first server answers, then a read it never does.
    let (mut buf, at) = aligned(8192);
    buf[at..at + 4096].fill(0x5a);
    f.write_all_at(&buf[at..at + 4096], 0).unwrap();
    let reader = {
        let f = f.clone();
        std::thread::spawn(move || {
            let (mut buf, at) = aligned(65536);
            f.read_exact_at(&mut buf[at..at + 65536], STALL_AT)
                .map(|()| buf[at..at + 65536].to_vec())
        })
    };
    while !marker.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the read never came"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut child = cleanup.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();

    // The next server: the same connection, the request sent again.
    let (fd, fresh) = handover::take(&socket, Duration::from_secs(10)).unwrap();
    assert!(!fresh);
    let backend = FileBackend {
        file: OpenOptions::new()
            .read(true)
            .write(true)
            .open(&backing)
            .unwrap(),
        stall: None,
    };
    let m = Mount::serve_held(backend, fd, &mountpoint, &opts(), false).unwrap();
    let waited = Instant::now();
    while !reader.is_finished() {
        assert!(
            waited.elapsed() < Duration::from_secs(20),
            "the read left by the killed server was never answered"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let got = reader.join().unwrap().unwrap();
    assert!(
        got == pattern[STALL_AT as usize..STALL_AT as usize + 65536],
        "the resent read returned other bytes"
    );
    assert!(m.resent() >= 1, "no request came marked as resent");
    // The first server's write is there; the new one serves as usual.
    let (mut back, bat) = aligned(4096);
    f.read_exact_at(&mut back[bat..bat + 4096], 0).unwrap();
    assert!(back[bat..bat + 4096].iter().all(|&b| b == 0x5a));
    drop(f);
    pager_fuse::unmount(&mountpoint, false).unwrap();
    m.wait().unwrap();
    drop(cleanup);
    holder.join().unwrap();
}

/// A buffer with a 4096-aligned window of `len` bytes at the offset
/// returned.
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + 4096];
    let at = v.as_ptr().align_offset(4096);
    (v, at)
}
