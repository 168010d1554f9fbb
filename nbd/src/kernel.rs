//! The kernel's nbd driver over generic netlink: the socket I/O around the
//! messages of [`crate::genl`], and [`LinkDeadWatch`], a socket in the
//! driver's multicast group that hears `NBD_CMD_LINK_DEAD`. The driver must
//! be loaded (`modprobe nbd`); every command needs CAP_SYS_ADMIN.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::genl::{self, ConnectConfig, GenlError, Reply};
use crate::sys;

/// Big enough for any answer we ask for: the controller's description of
/// a family (its operations and groups) is well under a page.
const RECV_BUF: usize = 32 << 10;

/// A generic netlink socket and the next sequence number.
struct Socket {
    fd: OwnedFd,
    seq: u32,
}

impl Socket {
    fn open() -> Result<Socket, GenlError> {
        let fd = sys::netlink_generic().map_err(|source| GenlError::Io {
            what: "socket",
            source,
        })?;
        Ok(Socket { fd, seq: 0 })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends `msg` (sequence number `seq`) and reads until the kernel's
    /// acknowledgement; returns the generic netlink answers before it as
    /// (command, attributes).
    fn request(
        &mut self,
        msg: &[u8],
        seq: u32,
        command: &'static str,
    ) -> Result<Vec<(u8, Vec<u8>)>, GenlError> {
        let io = |what| move |source| GenlError::Io { what, source };
        let n = sys::send(self.fd.as_raw_fd(), &[IoSlice::new(msg)]).map_err(io("send"))?;
        if n != msg.len() {
            return Err(GenlError::Malformed {
                command,
                what: format!("sent {n} of {} bytes", msg.len()),
            });
        }
        let mut answers = Vec::new();
        let mut buf = vec![0u8; RECV_BUF];
        loop {
            let n = sys::recv_datagram(self.fd.as_raw_fd(), &mut buf).map_err(io("recv"))?;
            if n > buf.len() {
                return Err(GenlError::Malformed {
                    command,
                    what: format!("a reply of {n} bytes, more than {}", buf.len()),
                });
            }
            for r in genl::replies(&buf[..n], command)? {
                match r {
                    Reply::Ack { seq: s } | Reply::Done { seq: s } if s == seq => {
                        return Ok(answers)
                    }
                    Reply::Error { seq: s, errno } if s == seq => {
                        return Err(GenlError::Kernel { command, errno })
                    }
                    Reply::Genl {
                        seq: s, cmd, attrs, ..
                    } if s == seq => answers.push((cmd, attrs.to_vec())),
                    // An answer to an earlier request given up on.
                    _ => {}
                }
            }
        }
    }
}

/// The id the kernel gave the generic netlink family `name`;
/// [`GenlError::NoFamily`] when no such family is registered (its module
/// is not loaded).
pub fn family_id(name: &str) -> Result<u16, GenlError> {
    let mut s = Socket::open()?;
    resolve(&mut s, name).map(|f| f.id)
}

fn resolve(s: &mut Socket, name: &str) -> Result<genl::Family, GenlError> {
    let seq = s.next_seq();
    let answers = match s.request(&genl::get_family(name, seq), seq, "CTRL_CMD_GETFAMILY") {
        Err(GenlError::Kernel { errno, .. }) if errno == libc::ENOENT => {
            return Err(GenlError::NoFamily { name: name.into() })
        }
        r => r?,
    };
    let (_, attrs) = answers
        .iter()
        .find(|(cmd, _)| *cmd == genl::CTRL_CMD_NEWFAMILY)
        .ok_or_else(|| GenlError::Malformed {
            command: "CTRL_CMD_GETFAMILY",
            what: "acknowledged without the family".into(),
        })?;
    genl::family(attrs)
}

/// A socket in multicast group `group` of `family` (`family_name`).
fn subscribe(family_name: &str, family: &genl::Family, group: &str) -> Result<Socket, GenlError> {
    let id = family.group(group).ok_or_else(|| GenlError::NoGroup {
        family: family_name.into(),
        group: group.into(),
    })?;
    let s = Socket::open()?;
    sys::netlink_join_group(s.fd.as_raw_fd(), id).map_err(|source| GenlError::Io {
        what: "joining the multicast group",
        source,
    })?;
    Ok(s)
}

/// Hears the nbd driver's `NBD_CMD_LINK_DEAD` notices: the driver marked
/// a device's connection dead (its server closed it, a send failed, or a
/// request went unanswered for the request timeout). Requests then wait
/// for `NBD_CMD_RECONFIGURE` up to the dead-conn timeout; a socket given
/// before the driver marked the old one dead is dropped without an error.
pub struct LinkDeadWatch {
    sock: Socket,
    family: u16,
    buf: Vec<u8>,
}

impl LinkDeadWatch {
    /// Waits for the next notices; the indexes of the devices they name.
    /// [`GenlError::Overrun`] when the kernel dropped some (the socket's
    /// buffer was full): a connection may have died unannounced.
    pub fn wait(&mut self) -> Result<Vec<u32>, GenlError> {
        loop {
            let n = match sys::recv_datagram(self.sock.fd.as_raw_fd(), &mut self.buf) {
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    return Err(GenlError::Overrun)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(GenlError::Io {
                        what: "recv",
                        source,
                    })
                }
            };
            if n > self.buf.len() {
                return Err(GenlError::Malformed {
                    command: "NBD_CMD_LINK_DEAD",
                    what: format!("a notice of {n} bytes, more than {}", self.buf.len()),
                });
            }
            let replies = genl::replies(&self.buf[..n], "NBD_CMD_LINK_DEAD")?;
            let indexes = genl::link_dead_indexes(&replies, self.family)?;
            if !indexes.is_empty() {
                return Ok(indexes);
            }
        }
    }
}

/// The kernel's nbd driver, through its generic netlink family.
pub struct NbdNetlink {
    sock: Socket,
    family: genl::Family,
}

impl NbdNetlink {
    /// Resolves the `nbd` family; fails naming `modprobe nbd` when the
    /// driver is not loaded.
    pub fn open() -> Result<NbdNetlink, GenlError> {
        let mut sock = Socket::open()?;
        let family = resolve(&mut sock, genl::NBD_GENL_FAMILY_NAME)?;
        Ok(NbdNetlink { sock, family })
    }

    /// A socket that hears the driver's `NBD_CMD_LINK_DEAD` notices, for
    /// every device, from now on.
    pub fn watch_link_dead(&self) -> Result<LinkDeadWatch, GenlError> {
        let sock = subscribe(
            genl::NBD_GENL_FAMILY_NAME,
            &self.family,
            genl::NBD_GENL_MCAST_GROUP_NAME,
        )?;
        Ok(LinkDeadWatch {
            sock,
            family: self.family.id,
            buf: vec![0; RECV_BUF],
        })
    }

    /// Connects `/dev/nbd{cfg.index}` to the negotiated sockets `fds` (the
    /// kernel takes its own reference to each).
    pub fn connect(&mut self, cfg: &ConnectConfig, fds: &[RawFd]) -> Result<(), GenlError> {
        let seq = self.sock.next_seq();
        let msg = genl::connect(self.family.id, seq, cfg, fds);
        self.sock.request(&msg, seq, "NBD_CMD_CONNECT").map(drop)
    }

    /// Gives device `index` the negotiated sockets `fds` in place of its
    /// dead connections.
    pub fn reconfigure(&mut self, index: u32, fds: &[RawFd]) -> Result<(), GenlError> {
        let seq = self.sock.next_seq();
        let msg = genl::reconfigure(self.family.id, seq, index, fds);
        self.sock
            .request(&msg, seq, "NBD_CMD_RECONFIGURE")
            .map(drop)
    }

    /// Disconnects device `index` (requests still queued fail).
    pub fn disconnect(&mut self, index: u32) -> Result<(), GenlError> {
        let seq = self.sock.next_seq();
        let msg = genl::disconnect(self.family.id, seq, index);
        self.sock.request(&msg, seq, "NBD_CMD_DISCONNECT").map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Talks to this machine's real generic netlink controller.
    #[test]
    fn the_controller_resolves_itself_and_names_modprobe_for_a_missing_family() {
        assert_eq!(family_id("nlctrl").unwrap(), genl::GENL_ID_CTRL);
        // The controller's own multicast group ("notify") resolves and
        // can be joined the way the nbd holder joins nbd_mc_group.
        let mut s = Socket::open().unwrap();
        let ctrl = resolve(&mut s, "nlctrl").unwrap();
        assert!(ctrl.group("notify").is_some(), "{ctrl:?}");
        subscribe("nlctrl", &ctrl, "notify").unwrap();
        let e = subscribe("nlctrl", &ctrl, "np-no-group").err().unwrap();
        assert!(matches!(e, GenlError::NoGroup { .. }), "{e:?}");
        if std::path::Path::new("/sys/module/nbd").exists() {
            // The driver is loaded here: its family resolves.
            assert!(NbdNetlink::open().is_ok());
            return;
        }
        let e = NbdNetlink::open().err().expect("no nbd module, no family");
        assert!(matches!(e, GenlError::NoFamily { .. }), "{e:?}");
        assert!(e.to_string().contains("modprobe nbd"), "{e}");
        let e = family_id("np-no-family").unwrap_err();
        assert!(matches!(e, GenlError::NoFamily { .. }), "{e:?}");
    }
}
