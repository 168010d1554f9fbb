//! One serving process per device at a time, and the number of its
//! session. A device is opened under an exclusive lock on its state
//! directory's `device.lock` (held until the process exits, however it
//! exits), and each open counts its session up in `session`. The session
//! rides on the export names the device asks its donors for, and a donor
//! refuses the requests of any session older than the newest it has seen
//! (pager-server's `session.rs`): a serving process that was replaced
//! never writes over its successor's pages, even with requests still
//! queued on a donor.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{DeviceError, Result};

pub(crate) const LOCK_FILE: &str = "device.lock";
pub(crate) const SESSION_FILE: &str = "session";
/// How often a waiting open tries the lock again.
const RETRY: Duration = Duration::from_millis(50);

/// The held lock and this session's number.
pub struct Session {
    /// Held open for the device's life: closing it releases the lock.
    _lock: File,
    pub number: u64,
}

fn file_err(path: &Path) -> impl Fn(std::io::Error) -> DeviceError + '_ {
    move |source| DeviceError::File {
        path: path.to_path_buf(),
        source,
    }
}

/// Takes the state directory's lock (waiting up to `wait` for a serving
/// process that is still exiting), then starts the next session.
pub fn begin(dir: &Path, wait: Duration) -> Result<Session> {
    let lock_path = dir.join(LOCK_FILE);
    let lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(file_err(&lock_path))?;
    let deadline = Instant::now() + wait;
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(RETRY)
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
                return Err(DeviceError::InUse {
                    dir: dir.to_path_buf(),
                    holder: holder.trim().to_string(),
                    waited: wait,
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(file_err(&lock_path)(e)),
        }
    }
    // Who holds it, for the next one's message.
    let me = format!("pid {}\n", std::process::id());
    lock.set_len(0)
        .and_then(|()| (&lock).write_all(me.as_bytes()))
        .map_err(file_err(&lock_path))?;
    let number = last(dir)? + 1;
    store(dir, number)?;
    Ok(Session {
        _lock: lock,
        number,
    })
}

/// The last session the state directory began (0: none).
pub(crate) fn last(dir: &Path) -> Result<u64> {
    let path = dir.join(SESSION_FILE);
    match std::fs::read_to_string(&path) {
        Ok(t) => t.trim().parse().map_err(|_| DeviceError::File {
            path: path.clone(),
            source: std::io::Error::other(format!(
                "holds {:?}, not a session number; if the device is not attached, remove the file",
                t.trim()
            )),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(file_err(&path)(e)),
    }
}

/// Writes the session number durably (temporary file, fsync, rename,
/// fsync of the directory) before any donor sees it: a crash must never
/// let a later open reuse a number a donor has seen.
fn store(dir: &Path, n: u64) -> Result<()> {
    let path = dir.join(SESSION_FILE);
    let tmp: PathBuf = dir.join(format!("{SESSION_FILE}.tmp"));
    let mut f = File::create(&tmp).map_err(file_err(&tmp))?;
    f.write_all(format!("{n}\n").as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(file_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(file_err(&path))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(file_err(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_count_up_and_one_open_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let a = begin(dir.path(), Duration::ZERO).unwrap();
        assert_eq!(a.number, 1);
        let e = begin(dir.path(), Duration::from_millis(120))
            .err()
            .expect("a second open while the first holds the lock");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())) && msg.contains("in use"),
            "{msg}"
        );
        drop(a);
        let b = begin(dir.path(), Duration::ZERO).unwrap();
        assert_eq!(b.number, 2);
        assert_eq!(last(dir.path()).unwrap(), 2);
        drop(b);
        std::fs::write(dir.path().join(SESSION_FILE), "x\n").unwrap();
        let e = begin(dir.path(), Duration::ZERO).err().unwrap().to_string();
        assert!(e.contains("not a session number"), "{e}");
    }
}
