//! The service manager's file descriptor store (systemd's, or anything
//! speaking its protocol): the FUSE connection kept by the manager while
//! serving processes come and go, instead of by a holder process.
//!
//! Storing is `sd_notify`'s protocol (sd_notify(3), `sd_pid_notify_with_fds`):
//! one datagram `FDSTORE=1\nFDNAME=NAME\n` to the unix socket named by
//! `$NOTIFY_SOCKET` (a path, or `@` for the abstract namespace), the fd
//! attached (SCM_RIGHTS); systemd keeps it when the unit has
//! `FileDescriptorStoreMax=`. Taking it back is `sd_listen_fds_with_names`
//! (sd_listen_fds(3)): the next process of the unit gets the stored fds
//! from fd 3 up, `$LISTEN_PID` its own pid, `$LISTEN_FDS` their count and
//! `$LISTEN_FDNAMES` their names, colon-separated.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

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

/// The fd named `name` among those passed to process `pid`, from the
/// values of `LISTEN_PID`, `LISTEN_FDS` and `LISTEN_FDNAMES`: `None` when
/// nothing was passed, or not to this process, or nothing of that name.
pub fn listen_fd(
    pid: u32,
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    names: Option<&str>,
    name: &str,
) -> Result<Option<RawFd>, String> {
    let (Some(for_pid), Some(count)) = (listen_pid, listen_fds) else {
        return Ok(None);
    };
    let for_pid: u32 = for_pid
        .trim()
        .parse()
        .map_err(|_| format!("LISTEN_PID={for_pid:?} is not a pid"))?;
    if for_pid != pid {
        // Meant for another process (a parent that did not unset them).
        return Ok(None);
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
        .position(|n| *n == name)
        .map(|i| LISTEN_FDS_START + i as RawFd))
}

/// Sends `fd` to the service manager at `notify_socket` to keep under
/// `name`.
pub fn store(notify_socket: &str, name: &str, fd: &File) -> io::Result<()> {
    let msg = store_message(name).map_err(io::Error::other)?;
    let addr = match notify_socket.strip_prefix('@') {
        Some(abstract_name) => SocketAddr::from_abstract_name(abstract_name.as_bytes())?,
        None => SocketAddr::from_pathname(notify_socket)?,
    };
    let sock = UnixDatagram::unbound()?;
    sock.connect_addr(&addr)?;
    sys::send_with_fd(sock.as_raw_fd(), msg.as_bytes(), Some(fd.as_raw_fd()))
}

/// Takes the fd named `name` that the service manager passed to this
/// process, if any (close-on-exec from then on).
pub fn take(name: &str) -> io::Result<Option<File>> {
    let var = |k: &str| std::env::var(k).ok();
    let fd = listen_fd(
        std::process::id(),
        var("LISTEN_PID").as_deref(),
        var("LISTEN_FDS").as_deref(),
        var("LISTEN_FDNAMES").as_deref(),
        name,
    )
    .map_err(io::Error::other)?;
    fd.map(sys::adopt_passed_fd).transpose()
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
    fn the_named_fd_is_found_from_fd_3_for_this_pid_only() {
        let f = |pid, fds, names| listen_fd(42, pid, fds, names, "netpager-fuse");
        assert_eq!(f(None, None, None), Ok(None));
        assert_eq!(f(Some("42"), Some("1"), Some("netpager-fuse")), Ok(Some(3)));
        assert_eq!(
            f(Some("42"), Some("3"), Some("a:b:netpager-fuse")),
            Ok(Some(5))
        );
        // For another process, or under another name: not ours.
        assert_eq!(f(Some("41"), Some("1"), Some("netpager-fuse")), Ok(None));
        assert_eq!(f(Some("42"), Some("1"), Some("stored")), Ok(None));
        // Unnamed fds are never taken for ours.
        assert_eq!(f(Some("42"), Some("1"), None), Ok(None));
        assert!(f(Some("x"), Some("1"), None).is_err());
        assert!(f(Some("42"), Some("2"), Some("netpager-fuse")).is_err());
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
        store(path.to_str().unwrap(), "netpager-fuse", &f).unwrap();
        let mut buf = [0u8; 128];
        let (n, got) = sys::recv_with_fd(manager.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"FDSTORE=1\nFDNAME=netpager-fuse\n");
        let mut got = got.expect("the fd came along");
        got.rewind().unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "stored bytes");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
