//! Real mounts (root): a backend in memory served over each transport,
//! read and written through the kernel with O_DIRECT and through a loop
//! device, and the fallback when io_uring is switched off.

// Punching a hole (fallocate) has no safe std wrapper.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Mutex;

use netpager_test_support::machine::MachineLock;
use netpager_util::LockExt;
use pager_fuse::memory::Memory;
use pager_fuse::{Mount, Options, Transport, ENABLE_URING};

/// The sysfs switch is machine-wide: tests that depend on it take turns,
/// within this process and with other test runs' attaches and detaches.
static URING_SWITCH: Mutex<()> = Mutex::new(());

fn root() -> bool {
    // The effective uid, from /proc.
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

fn set_uring(on: bool) -> Option<bool> {
    let old = std::fs::read_to_string(ENABLE_URING).ok()?.trim() == "Y";
    std::fs::write(ENABLE_URING, if on { "Y" } else { "N" }).ok()?;
    Some(old)
}

/// Runs `test` with the io_uring switch `on` (root; the switch is
/// machine-wide, so such tests take turns), then puts the switch back,
/// also when `test` panics. Nothing to test where the kernel lacks it.
fn with_uring_switch(on: bool, test: impl FnOnce()) {
    if !root() {
        panic!("needs root (mounts FUSE)");
    }
    let _turn = URING_SWITCH.lock_or_recover();
    let _machine = MachineLock::acquire("uring-switch", "fuse's mount tests");
    let Some(old) = set_uring(on) else {
        eprintln!("this kernel has no FUSE over io_uring ({ENABLE_URING}); nothing to test");
        return;
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(test));
    set_uring(old);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

/// Aligned buffer for O_DIRECT.
fn aligned(len: usize, seed: u8) -> (Vec<u8>, usize) {
    let v: Vec<u8> = (0..len + 4096)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    let at = v.as_ptr().align_offset(4096);
    (v, at)
}

fn exercise(dir: &Path, size: usize) {
    let file = dir.join("device");
    assert_eq!(std::fs::metadata(&file).unwrap().len(), size as u64);
    let names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["device"]);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&file)
        .unwrap();
    for (i, (off, len)) in [
        (0usize, 4096usize),
        (8192, 65536),
        (size - (1 << 20), 1 << 20),
        (12288, 4096),
    ]
    .into_iter()
    .enumerate()
    {
        let (src, at) = aligned(len, i as u8);
        f.write_all_at(&src[at..at + len], off as u64).unwrap();
        let (mut back, bat) = aligned(len, 0xff);
        f.read_exact_at(&mut back[bat..bat + len], off as u64)
            .unwrap();
        assert!(
            back[bat..bat + len] == src[at..at + len],
            "bytes at {off}+{len} differ"
        );
    }
    // A hole punched is a trim.
    // SAFETY: fallocate(2) takes integers and an fd that `f` keeps open.
    let rc = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            8192,
            65536,
        )
    };
    assert_eq!(rc, 0, "punch hole: {}", std::io::Error::last_os_error());
    let (mut back, bat) = aligned(65536, 1);
    f.read_exact_at(&mut back[bat..bat + 65536], 8192).unwrap();
    assert!(back[bat..bat + 65536].iter().all(|&c| c == 0));
    f.sync_all().unwrap();
}

/// Unmounts on every exit path, a failed assertion included.
struct Mounted {
    dir: tempfile::TempDir,
    mount: Option<Mount>,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            let _ = pager_fuse::unmount(self.dir.path(), true);
            let _ = m.wait();
        }
    }
}

impl Mounted {
    /// Unmounts the normal way (not lazily) and waits for every thread.
    fn finish(mut self) {
        let m = self.mount.take().unwrap();
        pager_fuse::unmount(self.dir.path(), false).unwrap();
        m.wait().unwrap();
    }

    fn mount(&self) -> &Mount {
        self.mount.as_ref().unwrap()
    }
}

fn serve(transport: Transport, size: usize) -> Mounted {
    let dir = tempfile::tempdir().unwrap();
    let backend = Memory::new(size, 0);
    let opts = Options {
        transport,
        threads: 2,
        ..Options::default()
    };
    let m = Mount::start(backend, dir.path(), &opts).unwrap();
    Mounted {
        dir,
        mount: Some(m),
    }
}

#[test]
fn classic_serves_reads_writes_and_holes() {
    if !root() {
        panic!("needs root (mounts FUSE)");
    }
    let m = serve(Transport::Classic, 8 << 20);
    assert_eq!(m.mount().transport(), Transport::Classic);
    assert!(m.mount().fallback_reason().is_none());
    exercise(m.dir.path(), 8 << 20);
    m.finish();
}

#[test]
fn uring_serves_reads_writes_and_holes() {
    with_uring_switch(true, || {
        let m = serve(Transport::Uring, 8 << 20);
        let reason = m.mount().fallback_reason().map(str::to_string);
        assert_eq!(
            m.mount().transport(),
            Transport::Uring,
            "fell back: {reason:?}"
        );
        exercise(m.dir.path(), 8 << 20);
        // Every read and write of `exercise` at least (8 requests).
        let answered = m.mount().ring_answers();
        assert!(
            answered >= 8,
            "only {answered} requests came through the rings"
        );
        m.finish();
    });
}

#[test]
fn uring_switched_off_falls_back_to_classic_and_says_why() {
    with_uring_switch(false, || {
        let m = serve(Transport::Uring, 4 << 20);
        assert_eq!(m.mount().transport(), Transport::Classic);
        let reason = m.mount().fallback_reason().map(str::to_string);
        assert!(reason.unwrap().contains("enable_uring"));
        exercise(m.dir.path(), 4 << 20);
        assert_eq!(m.mount().ring_answers(), 0);
        m.finish();
    });
}

#[test]
fn requests_arriving_while_queues_register_are_answered() {
    with_uring_switch(true, || {
        // A reader that keeps asking from before the mount: some of its
        // requests may reach ring entries the moment their queue registers.
        // (The window is microseconds: this checks that every request of a
        // busy start is answered, and rarely catches the race itself.)
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("device");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let answered = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (f, s, a) = (file.clone(), stop.clone(), answered.clone());
        std::thread::spawn(move || {
            // Direct reads: each one is a request (attributes are cached).
            let (mut buf, at) = aligned(4096, 0);
            let mut seen = 0u32;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(f) = OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&f)
                else {
                    continue;
                };
                for _ in 0..64 {
                    if f.read_exact_at(&mut buf[at..at + 4096], 0).is_ok() {
                        seen += 1;
                        a.store(seen, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            let _ = done_tx.send(seen);
        });
        let backend = Memory::new(4 << 20, 0);
        let m = Mounted {
            mount: Some(Mount::start(backend, dir.path(), &Options::default()).unwrap()),
            dir,
        };
        // Until the mount has answered a few rounds of the reader's
        // requests, however long the machine takes for that.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while answered.load(std::sync::atomic::Ordering::Relaxed) < 256 {
            assert!(
                std::time::Instant::now() < deadline,
                "the mount answered no reads"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        // A request lost in a ring entry leaves the reader blocked for good.
        let seen = done_rx.recv_timeout(std::time::Duration::from_secs(30));
        m.finish();
        assert!(seen.expect("a request was never answered") > 0);
    });
}
