//! The kernel nbd driver's generic netlink interface as bytes, no I/O:
//! resolving a family through the controller (`CTRL_CMD_GETFAMILY`),
//! `NBD_CMD_CONNECT`, `NBD_CMD_RECONFIGURE` (new sockets for a device whose
//! server died) and `NBD_CMD_DISCONNECT`, and the kernel's replies. The
//! socket that carries them is [`crate::kernel`].
//!
//! Numbers from the kernel's uapi headers `linux/netlink.h`,
//! `linux/genetlink.h` and `linux/nbd-netlink.h`; what each attribute means
//! from `drivers/block/nbd.c` (`nbd_genl_connect`, `nbd_genl_reconfigure`:
//! timeouts in seconds, sizes in bytes, all u64 but the index and the
//! socket fds). Netlink is in host byte order.

use std::os::fd::RawFd;

/// `struct nlmsghdr`: length, type, flags, sequence, port.
pub const NLMSG_HDRLEN: usize = 16;
/// `struct genlmsghdr`: command, version, reserved.
pub const GENL_HDRLEN: usize = 4;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
/// Set on an attribute holding attributes.
pub const NLA_F_NESTED: u16 = 1 << 15;
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | (1 << 14));

/// The controller's fixed family id (`GENL_ID_CTRL`).
pub const GENL_ID_CTRL: u16 = 0x10;
pub const CTRL_CMD_NEWFAMILY: u8 = 1;
pub const CTRL_CMD_GETFAMILY: u8 = 3;
pub const CTRL_ATTR_FAMILY_ID: u16 = 1;
pub const CTRL_ATTR_FAMILY_NAME: u16 = 2;
pub const CTRL_ATTR_MCAST_GROUPS: u16 = 7;
pub const CTRL_ATTR_MCAST_GRP_NAME: u16 = 1;
pub const CTRL_ATTR_MCAST_GRP_ID: u16 = 2;
/// The version we speak to the controller (its own is 2; it ignores ours).
const CTRL_VERSION: u8 = 2;

pub const NBD_GENL_FAMILY_NAME: &str = "nbd";
pub const NBD_GENL_VERSION: u8 = 1;
pub const NBD_CMD_CONNECT: u8 = 1;
pub const NBD_CMD_DISCONNECT: u8 = 2;
pub const NBD_CMD_RECONFIGURE: u8 = 3;
pub const NBD_CMD_LINK_DEAD: u8 = 4;
/// The group the driver multicasts `NBD_CMD_LINK_DEAD` to.
pub const NBD_GENL_MCAST_GROUP_NAME: &str = "nbd_mc_group";
pub const NBD_ATTR_INDEX: u16 = 1;
pub const NBD_ATTR_SIZE_BYTES: u16 = 2;
pub const NBD_ATTR_BLOCK_SIZE_BYTES: u16 = 3;
pub const NBD_ATTR_TIMEOUT: u16 = 4;
pub const NBD_ATTR_SERVER_FLAGS: u16 = 5;
pub const NBD_ATTR_SOCKETS: u16 = 7;
pub const NBD_ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
pub const NBD_SOCK_ITEM: u16 = 1;
pub const NBD_SOCK_FD: u16 = 1;

/// What went wrong talking to the kernel's generic netlink.
#[derive(Debug, thiserror::Error)]
pub enum GenlError {
    #[error(
        "the kernel has no generic netlink family {name:?}: its driver is not loaded (modprobe {name})"
    )]
    NoFamily { name: String },
    #[error("{command} refused by the kernel: {} (errno {errno})", std::io::Error::from_raw_os_error(*errno))]
    Kernel { command: &'static str, errno: i32 },
    #[error("the kernel has no multicast group {group:?} in generic netlink family {family:?}")]
    NoGroup { family: String, group: String },
    /// The socket's buffer overflowed: the kernel dropped notices.
    #[error("the kernel dropped netlink notices (receive buffer overrun): a connection may have died unannounced")]
    Overrun,
    #[error("malformed netlink reply to {command}: {what}")]
    Malformed { command: &'static str, what: String },
    #[error("netlink {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A message being built: headers first, attributes appended, the
/// length filled in by [`Msg::finish`].
struct Msg(Vec<u8>);

impl Msg {
    fn new(family: u16, seq: u32, cmd: u8, version: u8) -> Msg {
        let mut b = Vec::with_capacity(128);
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&family.to_ne_bytes());
        b.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        // Port 0: the kernel fills in ours.
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&[cmd, version, 0, 0]);
        Msg(b)
    }

    fn attr(&mut self, kind: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(data);
        self.0.resize(align4(self.0.len()), 0);
    }

    fn u32(&mut self, kind: u16, v: u32) {
        self.attr(kind, &v.to_ne_bytes());
    }

    fn u64(&mut self, kind: u16, v: u64) {
        self.attr(kind, &v.to_ne_bytes());
    }

    /// `NBD_ATTR_SOCKETS` { `NBD_SOCK_ITEM` { `NBD_SOCK_FD` } ... }.
    fn sockets(&mut self, fds: &[RawFd]) {
        let mut items = Vec::new();
        for &fd in fds {
            let mut item = Msg(Vec::new());
            item.u32(NBD_SOCK_FD, fd as u32);
            let mut one = Msg(Vec::new());
            one.attr(NBD_SOCK_ITEM | NLA_F_NESTED, &item.0);
            items.extend_from_slice(&one.0);
        }
        self.attr(NBD_ATTR_SOCKETS | NLA_F_NESTED, &items);
    }

    fn finish(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

/// `CTRL_CMD_GETFAMILY` for the family called `name`.
pub fn get_family(name: &str, seq: u32) -> Vec<u8> {
    let mut m = Msg::new(GENL_ID_CTRL, seq, CTRL_CMD_GETFAMILY, CTRL_VERSION);
    let mut z = name.as_bytes().to_vec();
    z.push(0);
    m.attr(CTRL_ATTR_FAMILY_NAME, &z);
    m.finish()
}

/// How a kernel nbd device is to be connected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectConfig {
    /// `/dev/nbdINDEX`.
    pub index: u32,
    pub size_bytes: u64,
    pub block_size: u64,
    /// The export's transmission flags, as the server gave them.
    pub server_flags: u64,
    /// A request unanswered this long (seconds) is resent on another (or
    /// the reconfigured) connection.
    pub timeout_secs: u64,
    /// How long (seconds) requests wait for `NBD_CMD_RECONFIGURE` once
    /// every connection is dead, before they fail.
    pub dead_conn_timeout_secs: u64,
}

/// `NBD_CMD_CONNECT` of `cfg.index` to the negotiated sockets `fds`.
pub fn connect(family: u16, seq: u32, cfg: &ConnectConfig, fds: &[RawFd]) -> Vec<u8> {
    let mut m = Msg::new(family, seq, NBD_CMD_CONNECT, NBD_GENL_VERSION);
    m.u32(NBD_ATTR_INDEX, cfg.index);
    m.u64(NBD_ATTR_SIZE_BYTES, cfg.size_bytes);
    m.u64(NBD_ATTR_BLOCK_SIZE_BYTES, cfg.block_size);
    m.u64(NBD_ATTR_SERVER_FLAGS, cfg.server_flags);
    m.u64(NBD_ATTR_TIMEOUT, cfg.timeout_secs);
    m.u64(NBD_ATTR_DEAD_CONN_TIMEOUT, cfg.dead_conn_timeout_secs);
    m.sockets(fds);
    m.finish()
}

/// `NBD_CMD_RECONFIGURE` of device `index`: `fds` replace connections the
/// kernel has marked dead (a live one is kept, and a socket with no dead
/// connection to replace is dropped without an error).
pub fn reconfigure(family: u16, seq: u32, index: u32, fds: &[RawFd]) -> Vec<u8> {
    let mut m = Msg::new(family, seq, NBD_CMD_RECONFIGURE, NBD_GENL_VERSION);
    m.u32(NBD_ATTR_INDEX, index);
    m.sockets(fds);
    m.finish()
}

/// `NBD_CMD_DISCONNECT` of device `index`.
pub fn disconnect(family: u16, seq: u32, index: u32) -> Vec<u8> {
    let mut m = Msg::new(family, seq, NBD_CMD_DISCONNECT, NBD_GENL_VERSION);
    m.u32(NBD_ATTR_INDEX, index);
    m.finish()
}

/// One message the kernel sent back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply<'a> {
    /// `NLMSG_ERROR` with error 0: the request with this sequence number
    /// was done.
    Ack {
        seq: u32,
    },
    /// `NLMSG_ERROR` with a negative errno.
    Error {
        seq: u32,
        errno: i32,
    },
    /// A generic netlink message of `family`: its command and attributes.
    Genl {
        family: u16,
        seq: u32,
        cmd: u8,
        attrs: &'a [u8],
    },
    Done {
        seq: u32,
    },
}

/// Splits what one `recv` gave into messages.
pub fn replies<'a>(mut buf: &'a [u8], command: &'static str) -> Result<Vec<Reply<'a>>, GenlError> {
    let bad = |what: String| GenlError::Malformed { command, what };
    let mut out = Vec::new();
    while !buf.is_empty() {
        if buf.len() < NLMSG_HDRLEN {
            return Err(bad(format!("{} bytes left, short of a header", buf.len())));
        }
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        let kind = u16::from_ne_bytes(buf[4..6].try_into().unwrap());
        let seq = u32::from_ne_bytes(buf[8..12].try_into().unwrap());
        if len < NLMSG_HDRLEN || len > buf.len() {
            return Err(bad(format!(
                "message length {len} with {} bytes there",
                buf.len()
            )));
        }
        let body = &buf[NLMSG_HDRLEN..len];
        out.push(match kind {
            NLMSG_ERROR => {
                if body.len() < 4 {
                    return Err(bad("error message without its errno".into()));
                }
                match i32::from_ne_bytes(body[0..4].try_into().unwrap()) {
                    0 => Reply::Ack { seq },
                    e => Reply::Error { seq, errno: -e },
                }
            }
            NLMSG_DONE => Reply::Done { seq },
            _ => {
                if body.len() < GENL_HDRLEN {
                    return Err(bad("generic netlink message without its header".into()));
                }
                Reply::Genl {
                    family: kind,
                    seq,
                    cmd: body[0],
                    attrs: &body[GENL_HDRLEN..],
                }
            }
        });
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// The attributes in `buf` as (type without flags, payload).
pub fn attrs(mut buf: &[u8]) -> Result<Vec<(u16, &[u8])>, String> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return Err(format!(
                "attribute {kind} of length {len} with {} bytes there",
                buf.len()
            ));
        }
        out.push((kind, &buf[4..len]));
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// What the controller says of a family: its id and multicast groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    pub id: u16,
    /// (name, id) of each multicast group.
    pub groups: Vec<(String, u32)>,
}

impl Family {
    /// The id of the multicast group `name`.
    pub fn group(&self, name: &str) -> Option<u32> {
        self.groups
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, id)| *id)
    }
}

/// The family in the controller's answer to [`get_family`]:
/// `CTRL_ATTR_FAMILY_ID`, and `CTRL_ATTR_MCAST_GROUPS` { one nested
/// attribute per group { `CTRL_ATTR_MCAST_GRP_NAME`, `CTRL_ATTR_MCAST_GRP_ID` } }.
pub fn family(attrs_buf: &[u8]) -> Result<Family, GenlError> {
    let bad = |what: String| GenlError::Malformed {
        command: "CTRL_CMD_GETFAMILY",
        what,
    };
    let mut id = None;
    let mut groups = Vec::new();
    for (kind, data) in attrs(attrs_buf).map_err(bad)? {
        match kind {
            CTRL_ATTR_FAMILY_ID => {
                let b: [u8; 2] = data
                    .get(..2)
                    .and_then(|d| d.try_into().ok())
                    .ok_or_else(|| bad(format!("family id of {} bytes", data.len())))?;
                id = Some(u16::from_ne_bytes(b));
            }
            CTRL_ATTR_MCAST_GROUPS => {
                for (_, group) in attrs(data).map_err(bad)? {
                    let (mut name, mut gid) = (None, None);
                    for (k, v) in attrs(group).map_err(bad)? {
                        match k {
                            CTRL_ATTR_MCAST_GRP_NAME => {
                                let z = v.split(|&c| c == 0).next().unwrap_or_default();
                                name = Some(String::from_utf8_lossy(z).into_owned());
                            }
                            CTRL_ATTR_MCAST_GRP_ID => {
                                gid = v
                                    .get(..4)
                                    .map(|b| u32::from_ne_bytes(b.try_into().unwrap()));
                            }
                            _ => {}
                        }
                    }
                    match (name, gid) {
                        (Some(n), Some(g)) => groups.push((n, g)),
                        _ => return Err(bad("a multicast group without its name or id".into())),
                    }
                }
            }
            _ => {}
        }
    }
    Ok(Family {
        id: id.ok_or_else(|| bad("no CTRL_ATTR_FAMILY_ID".into()))?,
        groups,
    })
}

/// The device indexes of the `NBD_CMD_LINK_DEAD` notices of `family` among
/// `replies` (what one `recv` on a socket in `nbd_mc_group` gave).
pub fn link_dead_indexes(replies: &[Reply<'_>], family: u16) -> Result<Vec<u32>, GenlError> {
    let mut out = Vec::new();
    for r in replies {
        let Reply::Genl {
            family: f,
            cmd: NBD_CMD_LINK_DEAD,
            attrs: a,
            ..
        } = *r
        else {
            continue;
        };
        if f != family {
            continue;
        }
        let bad = |what: String| GenlError::Malformed {
            command: "NBD_CMD_LINK_DEAD",
            what,
        };
        let index = attrs(a)
            .map_err(bad)?
            .into_iter()
            .find(|(k, _)| *k == NBD_ATTR_INDEX)
            .and_then(|(_, v)| {
                v.get(..4)
                    .map(|b| u32::from_ne_bytes(b.try_into().unwrap()))
            })
            .ok_or_else(|| bad("a notice without NBD_ATTR_INDEX".into()))?;
        out.push(index);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ne16(v: u16) -> [u8; 2] {
        v.to_ne_bytes()
    }
    fn ne32(v: u32) -> [u8; 4] {
        v.to_ne_bytes()
    }

    /// The 20 bytes of headers every request starts with.
    fn headers(len: u32, family: u16, seq: u32, cmd: u8, version: u8) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(&ne32(len));
        h.extend_from_slice(&ne16(family));
        h.extend_from_slice(&ne16(0x1 | 0x4));
        h.extend_from_slice(&ne32(seq));
        h.extend_from_slice(&ne32(0));
        h.extend_from_slice(&[cmd, version, 0, 0]);
        h
    }

    fn attr(kind: u16, data: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&ne16(4 + data.len() as u16));
        a.extend_from_slice(&ne16(kind));
        a.extend_from_slice(data);
        while a.len() % 4 != 0 {
            a.push(0);
        }
        a
    }

    #[test]
    fn get_family_names_the_family_nul_terminated_and_padded() {
        let m = get_family("nbd", 7);
        // "nbd\0": 4 + 4 bytes, no padding; the controller is family 16,
        // CTRL_CMD_GETFAMILY is 3, CTRL_ATTR_FAMILY_NAME is 2.
        let mut want = headers(28, 16, 7, 3, 2);
        want.extend_from_slice(&ne16(8));
        want.extend_from_slice(&ne16(2));
        want.extend_from_slice(b"nbd\0");
        assert_eq!(m, want);
        let m = get_family("nlctrl", 1);
        // "nlctrl\0" is 7 bytes: attribute length 11, padded to 12.
        assert_eq!(m.len(), 20 + 12);
        assert_eq!(&m[20..22], &ne16(11));
        assert_eq!(&m[24..31], b"nlctrl\0");
        assert_eq!(m[31], 0);
    }

    #[test]
    fn connect_carries_every_attribute_with_its_type_and_width() {
        let cfg = ConnectConfig {
            index: 3,
            size_bytes: 1 << 30,
            block_size: 4096,
            server_flags: 0x1 | 0x4 | 0x20,
            timeout_secs: 10,
            dead_conn_timeout_secs: 120,
        };
        let m = connect(0x24, 9, &cfg, &[5, 6]);
        let sock = |fd: u32| attr(NBD_SOCK_ITEM | NLA_F_NESTED, &attr(1, &ne32(fd)));
        let mut socks = sock(5);
        socks.extend(sock(6));
        let mut body = Vec::new();
        body.extend(attr(1, &ne32(3)));
        body.extend(attr(2, &(1u64 << 30).to_ne_bytes()));
        body.extend(attr(3, &4096u64.to_ne_bytes()));
        body.extend(attr(5, &0x25u64.to_ne_bytes()));
        body.extend(attr(4, &10u64.to_ne_bytes()));
        body.extend(attr(8, &120u64.to_ne_bytes()));
        body.extend(attr(7 | 0x8000, &socks));
        let mut want = headers(20 + body.len() as u32, 0x24, 9, 1, 1);
        want.extend(body);
        assert_eq!(m, want);
        // Each socket item: 4 (item) + 8 (fd attribute) bytes.
        assert_eq!(socks.len(), 24);
        // And it reads back.
        let a = attrs(&m[20..]).unwrap();
        let kinds: Vec<u16> = a.iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, [1, 2, 3, 5, 4, 8, 7]);
        let items = attrs(a[6].1).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(attrs(items[1].1).unwrap(), [(1, &ne32(6)[..])]);
    }

    #[test]
    fn reconfigure_and_disconnect_name_the_device() {
        let m = reconfigure(0x24, 2, 0, &[11]);
        let mut want = headers(20 + 8 + 16, 0x24, 2, 3, 1);
        want.extend(attr(1, &ne32(0)));
        want.extend(attr(7 | 0x8000, &attr(1 | 0x8000, &attr(1, &ne32(11)))));
        assert_eq!(m, want);
        let m = disconnect(0x24, 3, 4);
        let mut want = headers(28, 0x24, 3, 2, 1);
        want.extend(attr(1, &ne32(4)));
        assert_eq!(m, want);
    }

    fn message(kind: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&ne32(16 + body.len() as u32));
        m.extend_from_slice(&ne16(kind));
        m.extend_from_slice(&ne16(0));
        m.extend_from_slice(&ne32(seq));
        m.extend_from_slice(&ne32(0));
        m.extend_from_slice(body);
        while m.len() % 4 != 0 {
            m.push(0);
        }
        m
    }

    #[test]
    fn replies_split_an_answer_an_ack_and_an_error() {
        let mut answer = vec![CTRL_CMD_NEWFAMILY, 2, 0, 0];
        answer.extend(attr(CTRL_ATTR_FAMILY_NAME, b"nbd\0"));
        answer.extend(attr(CTRL_ATTR_FAMILY_ID, &ne16(0x24)));
        let mut buf = message(0x10, 5, &answer);
        let mut ack = ne32(0).to_vec();
        ack.extend(vec![0; 16]);
        buf.extend(message(NLMSG_ERROR, 5, &ack));
        let mut err = (-2i32).to_ne_bytes().to_vec();
        err.extend(vec![0; 16]);
        buf.extend(message(NLMSG_ERROR, 6, &err));
        let r = replies(&buf, "CTRL_CMD_GETFAMILY").unwrap();
        assert_eq!(r.len(), 3);
        let Reply::Genl {
            family: 0x10,
            seq: 5,
            cmd,
            attrs,
        } = r[0]
        else {
            panic!("{:?}", r[0])
        };
        assert_eq!(cmd, CTRL_CMD_NEWFAMILY);
        assert_eq!(
            family(attrs).unwrap(),
            Family {
                id: 0x24,
                groups: vec![]
            }
        );
        assert_eq!(r[1], Reply::Ack { seq: 5 });
        assert_eq!(r[2], Reply::Error { seq: 6, errno: 2 });
    }

    #[test]
    fn truncated_replies_are_errors_naming_the_command() {
        let m = message(NLMSG_ERROR, 1, &ne32(0));
        let e = replies(&m[..10], "NBD_CMD_CONNECT").unwrap_err();
        assert!(e.to_string().contains("NBD_CMD_CONNECT"), "{e}");
        let mut long = m.clone();
        long[0] = 200;
        assert!(replies(&long, "NBD_CMD_CONNECT").is_err());
        assert!(family(&attr(CTRL_ATTR_FAMILY_NAME, b"x\0")).is_err());
    }

    /// The controller's answer for nbd as `nbd_genl_family` registers it:
    /// one group, `nbd_mc_group`, listed as CTRL_ATTR_MCAST_GROUPS { 1 {
    /// name, id } } (`ctrl_fill_info`: groups numbered from 1).
    #[test]
    fn the_family_names_its_multicast_groups() {
        let group = |n: u16, name: &[u8], id: u32| {
            let mut g = attr(CTRL_ATTR_MCAST_GRP_ID, &ne32(id));
            g.extend(attr(CTRL_ATTR_MCAST_GRP_NAME, name));
            attr(n | NLA_F_NESTED, &g)
        };
        let mut groups = group(1, b"nbd_mc_group\0", 7);
        groups.extend(group(2, b"other\0", 9));
        let mut a = attr(CTRL_ATTR_FAMILY_NAME, b"nbd\0");
        a.extend(attr(CTRL_ATTR_FAMILY_ID, &ne16(0x24)));
        a.extend(attr(CTRL_ATTR_MCAST_GROUPS | NLA_F_NESTED, &groups));
        let f = family(&a).unwrap();
        assert_eq!(f.id, 0x24);
        assert_eq!(f.group(NBD_GENL_MCAST_GROUP_NAME), Some(7));
        assert_eq!(f.group("other"), Some(9));
        assert_eq!(f.group("nope"), None);
        // A group without its id is malformed, not skipped.
        let mut a = attr(CTRL_ATTR_FAMILY_ID, &ne16(0x24));
        let g = attr(1 | NLA_F_NESTED, &attr(CTRL_ATTR_MCAST_GRP_NAME, b"x\0"));
        a.extend(attr(CTRL_ATTR_MCAST_GROUPS | NLA_F_NESTED, &g));
        assert!(family(&a).is_err());
    }

    /// `nbd_mcast_index`: genlmsg_put with port 0, sequence 0, command
    /// NBD_CMD_LINK_DEAD, and one u32 NBD_ATTR_INDEX.
    #[test]
    fn link_dead_notices_give_their_device_index() {
        let notice = |family: u16, cmd: u8, index: u32| {
            let mut body = vec![cmd, NBD_GENL_VERSION, 0, 0];
            body.extend(attr(NBD_ATTR_INDEX, &ne32(index)));
            message(family, 0, &body)
        };
        let mut buf = notice(0x24, NBD_CMD_LINK_DEAD, 3);
        buf.extend(notice(0x24, NBD_CMD_LINK_DEAD, 0));
        // Another command of the family, and the same command of another
        // family: not notices of ours.
        buf.extend(notice(0x24, NBD_CMD_CONNECT, 5));
        buf.extend(notice(0x25, NBD_CMD_LINK_DEAD, 6));
        let r = replies(&buf, "NBD_CMD_LINK_DEAD").unwrap();
        assert_eq!(link_dead_indexes(&r, 0x24).unwrap(), [3, 0]);
        let bare = message(0x24, 0, &[NBD_CMD_LINK_DEAD, 1, 0, 0]);
        let r = replies(&bare, "NBD_CMD_LINK_DEAD").unwrap();
        assert!(link_dead_indexes(&r, 0x24).is_err());
    }

    #[test]
    fn errors_say_what_to_do() {
        let e = GenlError::NoFamily { name: "nbd".into() };
        assert!(e.to_string().contains("modprobe nbd"), "{e}");
        let e = GenlError::Kernel {
            command: "NBD_CMD_RECONFIGURE",
            errno: libc::EINVAL,
        };
        let s = e.to_string();
        assert!(
            s.contains("NBD_CMD_RECONFIGURE") && s.contains("errno 22"),
            "{s}"
        );
    }
}
