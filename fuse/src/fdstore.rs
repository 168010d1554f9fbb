//! The service manager's file descriptor store (systemd's, or anything
//! speaking its protocol): the FUSE connection kept by the manager while
//! serving processes come and go, instead of by a holder process.
//!
//! Storing is `sd_notify`'s protocol (sd_notify(3), `sd_pid_notify_with_fds`):
//! one datagram `FDSTORE=1\nFDNAME=NAME\n` to the unix socket named by
//! `$NOTIFY_SOCKET` (a path, or `@` for the abstract namespace), the fd
//! attached (SCM_RIGHTS). The manager keeps it only when the unit has
//! `FileDescriptorStoreMax=` above 0, and drops it otherwise with no word
//! to the sender; it says so through `$FDSTORE` (systemd 254+ sets it to
//! that maximum when it is above 0, systemd.exec(5)). So [`store`] tells
//! a kept fd ([`Stored::Kept`]) from one sent to a manager that never said
//! it keeps any ([`Stored::NotKnownKept`]).
//!
//! Taking it back is `sd_listen_fds_with_names` (sd_listen_fds(3)): the
//! next process of the unit gets the stored fds from fd 3 up, `$LISTEN_PID`
//! its own pid, `$LISTEN_FDS` their count and `$LISTEN_FDNAMES` their
//! names, colon-separated. An fd is one open file with one owner: the
//! passed fds are claimed once per process ([`ListenFds::claim`]) and each
//! is handed out once ([`ListenFds::take`]).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::sys;

/// The first fd a service manager passes (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// The notification that stores an fd under `name`. Names are what
/// systemd accepts: at most 255 characters, printable, no `:`.
pub fn store_message(name: &str) -> Result<String, String> {
    if name.is_empty()
        || name.len() > 255
        || name.contains(':')
        || !name.chars().all(|c| c.is_ascii_graphic())
    {
        return Err(format!(
            "{name:?} cannot name a stored fd (1-255 printable characters, no ':')"
        ));
    }
    Ok(format!("FDSTORE=1\nFDNAME={name}\n"))
}

/// The fds passed to process `pid` with their names, from the values of
/// `LISTEN_PID`, `LISTEN_FDS` and `LISTEN_FDNAMES`: none when nothing was
/// passed, or not to this process. Unnamed fds are never ours.
pub fn listen_fds(
    pid: u32,
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    names: Option<&str>,
) -> Result<Vec<(String, RawFd)>, String> {
    let (Some(for_pid), Some(count)) = (listen_pid, listen_fds) else {
        return Ok(Vec::new());
    };
    let for_pid: u32 = for_pid
        .trim()
        .parse()
        .map_err(|_| format!("LISTEN_PID={for_pid:?} is not a pid"))?;
    if for_pid != pid {
        // Meant for another process (a parent that did not unset them).
        return Ok(Vec::new());
    }
    let count: usize = count
        .trim()
        .parse()
        .map_err(|_| format!("LISTEN_FDS={count:?} is not a number"))?;
    let names: Vec<&str> = names.map(|n| n.split(':').collect()).unwrap_or_default();
    if !names.is_empty() && names.len() != count {
        return Err(format!(
            "LISTEN_FDNAMES names {} fds, LISTEN_FDS says {count}",
            names.len()
        ));
    }
    Ok(names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), LISTEN_FDS_START + i as RawFd))
        .collect())
}

/// Whether the passed fds were claimed in this process.
static CLAIMED: AtomicBool = AtomicBool::new(false);

/// The fds the service manager passed to this process, by name. There is
/// one per process ([`ListenFds::claim`]), and [`ListenFds::take`] hands
/// each fd out once: two owners of one fd would close it twice, the second
/// time perhaps someone else's file.
#[derive(Debug)]
pub struct ListenFds {
    /// Not yet taken.
    named: Vec<(String, RawFd)>,
    taken: Vec<String>,
}

impl ListenFds {
    /// Claims the fds passed to this process (from the environment); refused
    /// once they were claimed.
    pub fn claim() -> io::Result<ListenFds> {
        if CLAIMED.swap(true, Ordering::SeqCst) {
            return Err(io::Error::other(
                "the fds the service manager passed (LISTEN_FDS) were claimed already in this process",
            ));
        }
        let var = |k: &str| std::env::var(k).ok();
        let named = listen_fds(
            std::process::id(),
            var("LISTEN_PID").as_deref(),
            var("LISTEN_FDS").as_deref(),
            var("LISTEN_FDNAMES").as_deref(),
        )
        .map_err(io::Error::other)?;
        Ok(ListenFds {
            named,
            taken: Vec::new(),
        })
    }

    /// Takes the fd named `name`, if one was passed (close-on-exec from then
    /// on); refused when it was taken already.
    pub fn take(&mut self, name: &str) -> io::Result<Option<File>> {
        if self.taken.iter().any(|t| t == name) {
            return Err(io::Error::other(format!(
                "the passed fd {name} was taken already: it has one owner"
            )));
        }
        let Some(i) = self.named.iter().position(|(n, _)| n == name) else {
            return Ok(None);
        };
        let (name, fd) = self.named.remove(i);
        self.taken.push(name);
        sys::adopt_passed_fd(fd).map(Some)
    }
}

/// How many fds the manager keeps for this service, from `$FDSTORE`
/// (`None`: not set, so it never said it keeps any).
pub fn capacity(fdstore: Option<&str>) -> Result<Option<u32>, String> {
    let Some(v) = fdstore else {
        return Ok(None);
    };
    v.trim()
        .parse()
        .map(|n: u32| (n > 0).then_some(n))
        .map_err(|_| format!("FDSTORE={v:?} is not a number"))
}

/// What became of a stored fd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Sent to a manager that keeps up to `max` fds for the service.
    Kept { max: u32 },
    /// Sent, but `$FDSTORE` is not set: a manager that keeps no fds for
    /// this service (it drops the fd), or systemd before 254, which never
    /// says. If this process dies, the fd may be gone with it.
    NotKnownKept,
}

/// Sends `fd` to the service manager at `notify_socket` to keep under
/// `name`; `fdstore` is `$FDSTORE`, which says whether it keeps it.
pub fn store(
    notify_socket: &str,
    fdstore: Option<&str>,
    name: &str,
    fd: &File,
) -> io::Result<Stored> {
    let msg = store_message(name).map_err(io::Error::other)?;
    let kept = capacity(fdstore).map_err(io::Error::other)?;
    let addr = match notify_socket.strip_prefix('@') {
        Some(abstract_name) => SocketAddr::from_abstract_name(abstract_name.as_bytes())?,
        None => SocketAddr::from_pathname(notify_socket)?,
    };
    let sock = UnixDatagram::unbound()?;
    sock.connect_addr(&addr)?;
    sys::send_with_fd(sock.as_raw_fd(), msg.as_bytes(), Some(fd.as_raw_fd()))?;
    Ok(match kept {
        Some(max) => Stored::Kept { max },
        None => Stored::NotKnownKept,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn the_store_message_is_sd_notify_s() {
        assert_eq!(
            store_message("netpager-fuse").unwrap(),
            "FDSTORE=1\nFDNAME=netpager-fuse\n"
        );
        assert!(store_message("a:b").is_err());
        assert!(store_message("").is_err());
        assert!(store_message("two words").is_err());
        assert!(store_message(&"x".repeat(256)).is_err());
    }

    #[test]
    fn the_named_fds_are_found_from_fd_3_for_this_pid_only() {
        let f = |pid, fds, names| listen_fds(42, pid, fds, names);
        let named = |v: &[(&str, RawFd)]| -> Result<Vec<(String, RawFd)>, String> {
            Ok(v.iter().map(|(n, fd)| (n.to_string(), *fd)).collect())
        };
        assert_eq!(f(None, None, None), named(&[]));
        assert_eq!(
            f(Some("42"), Some("1"), Some("netpager-fuse")),
            named(&[("netpager-fuse", 3)])
        );
        assert_eq!(
            f(Some("42"), Some("3"), Some("a:b:netpager-fuse")),
            named(&[("a", 3), ("b", 4), ("netpager-fuse", 5)])
        );
        // For another process: not ours.
        assert_eq!(f(Some("41"), Some("1"), Some("netpager-fuse")), named(&[]));
        // Unnamed fds are never taken for ours.
        assert_eq!(f(Some("42"), Some("1"), None), named(&[]));
        assert!(f(Some("x"), Some("1"), None).is_err());
        assert!(f(Some("42"), Some("2"), Some("netpager-fuse")).is_err());
    }

    #[test]
    fn the_passed_fds_are_claimed_once_and_each_taken_once() {
        // The only test that claims: the claim is once per process. Nothing
        // was passed to the test process.
        let mut fds = ListenFds::claim().unwrap();
        assert!(fds.take("netpager-fuse").unwrap().is_none());
        let e = ListenFds::claim().unwrap_err().to_string();
        assert!(e.contains("claimed already"), "{e}");
        // A passed fd: the one owner gets it, a second take is refused.
        let f = tempfile::tempfile().unwrap();
        let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
        let mut fds = ListenFds {
            named: vec![("netpager-fuse".into(), fd)],
            taken: Vec::new(),
        };
        let mut got = fds.take("netpager-fuse").unwrap().expect("the passed fd");
        got.write_all(b"owned").unwrap();
        let e = fds.take("netpager-fuse").unwrap_err().to_string();
        assert!(e.contains("taken already"), "{e}");
    }

    #[test]
    fn only_fdstore_above_0_says_the_manager_keeps_fds() {
        assert_eq!(capacity(None), Ok(None));
        assert_eq!(capacity(Some("0")), Ok(None));
        assert_eq!(capacity(Some("4")), Ok(Some(4)));
        assert!(capacity(Some("many")).is_err());
    }

    #[test]
    fn a_stored_fd_reaches_the_notify_socket_with_its_name() {
        let dir = std::env::temp_dir().join(format!("np-fdstore-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let manager = UnixDatagram::bind(&path).unwrap();
        let file_path = dir.join("data");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&file_path)
            .unwrap();
        f.write_all(b"stored bytes").unwrap();
        let to = path.to_str().unwrap();
        assert_eq!(
            store(to, Some("1"), "netpager-fuse", &f).unwrap(),
            Stored::Kept { max: 1 }
        );
        let mut buf = [0u8; 128];
        let (n, got) = sys::recv_with_fd(manager.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"FDSTORE=1\nFDNAME=netpager-fuse\n");
        let mut got = got.expect("the fd came along");
        got.rewind().unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "stored bytes");
        // Sent all the same without $FDSTORE, but not said to be kept.
        assert_eq!(
            store(to, None, "netpager-fuse", &f).unwrap(),
            Stored::NotKnownKept
        );
        let (n, got) = sys::recv_with_fd(manager.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"FDSTORE=1\nFDNAME=netpager-fuse\n");
        assert!(got.is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
