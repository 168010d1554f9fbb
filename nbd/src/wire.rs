//! The NBD protocol as bytes (fixed newstyle handshake with `NBD_OPT_GO`,
//! simple replies): pure encoding and decoding, no I/O. Numbers from the
//! protocol's own document, `doc/proto.md` in the NBD project.

use std::fmt;

pub const NBDMAGIC: &[u8; 8] = b"NBDMAGIC";
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub const FLAG_NO_ZEROES: u16 = 2;

pub const OPT_ABORT: u32 = 2;
pub const OPT_GO: u32 = 7;
pub const REP_ACK: u32 = 1;
pub const REP_INFO: u32 = 3;
const REP_ERROR_BIT: u32 = 1 << 31;
pub const INFO_EXPORT: u16 = 0;

/// Transmission flags of an export (`NBD_FLAG_*`).
pub const TX_HAS_FLAGS: u16 = 1;
pub const TX_READ_ONLY: u16 = 1 << 1;
pub const TX_SEND_FLUSH: u16 = 1 << 2;
pub const TX_SEND_FUA: u16 = 1 << 3;
pub const TX_SEND_TRIM: u16 = 1 << 5;
pub const TX_SEND_WRITE_ZEROES: u16 = 1 << 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1;

/// Length of a request header and of a simple reply header.
pub const REQUEST_LEN: usize = 28;
pub const REPLY_LEN: usize = 16;
/// Length of the server's greeting: magic, IHAVEOPT, handshake flags.
pub const GREETING_LEN: usize = 18;
/// Length of an option reply's header.
pub const OPT_REPLY_LEN: usize = 20;

/// NBD command types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Command {
    Read = 0,
    Write = 1,
    Disconnect = 2,
    Flush = 3,
    Trim = 4,
    WriteZeroes = 6,
}

impl Command {
    /// The export flag a server sets when it takes this command.
    pub fn needs(self) -> Option<u16> {
        match self {
            Command::Flush => Some(TX_SEND_FLUSH),
            Command::Trim => Some(TX_SEND_TRIM),
            Command::WriteZeroes => Some(TX_SEND_WRITE_ZEROES),
            Command::Read | Command::Write | Command::Disconnect => None,
        }
    }
}

/// A malformed or refused handshake or reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    NotNbd([u8; 8]),
    NotFixedNewstyle {
        flags: u16,
    },
    BadOptReplyMagic(u64),
    OptReplyForOtherOption {
        sent: u32,
        got: u32,
    },
    /// The server refused the option: its reply type and message.
    Refused {
        kind: u32,
        message: String,
    },
    UnexpectedReply {
        kind: u32,
        len: u32,
    },
    NoSize,
    BadReplyMagic(u32),
    WrongCookie {
        sent: u64,
        got: u64,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::NotNbd(m) => write!(f, "not an NBD server (greeting {m:02x?})"),
            WireError::NotFixedNewstyle { flags } => {
                write!(
                    f,
                    "server is not fixed-newstyle (handshake flags {flags:#x})"
                )
            }
            WireError::BadOptReplyMagic(m) => write!(f, "bad option reply magic {m:#x}"),
            WireError::OptReplyForOtherOption { sent, got } => {
                write!(f, "reply to option {got}, expected option {sent}")
            }
            WireError::Refused { kind, message } => {
                write!(f, "server refused: {} ({message:?})", refusal_name(*kind))
            }
            WireError::UnexpectedReply { kind, len } => {
                write!(f, "unexpected option reply type {kind:#x} of {len} bytes")
            }
            WireError::NoSize => write!(f, "server ended NBD_OPT_GO without the export's size"),
            WireError::BadReplyMagic(m) => write!(f, "bad reply magic {m:#x}"),
            WireError::WrongCookie { sent, got } => {
                write!(f, "reply for cookie {got}, expected {sent}")
            }
        }
    }
}

impl std::error::Error for WireError {}

fn refusal_name(kind: u32) -> &'static str {
    match kind & !REP_ERROR_BIT {
        1 => "unsupported option",
        2 => "forbidden by policy (wrong export or key?)",
        3 => "invalid request",
        4 => "not supported on this platform",
        5 => "TLS required",
        6 => "unknown export",
        7 => "server shutting down",
        8 => "block size negotiation required",
        9 => "request too big",
        _ => "error",
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// Checks the server's greeting; returns the client flags to send back.
pub fn client_flags(greeting: &[u8; GREETING_LEN]) -> Result<u32, WireError> {
    let magic: [u8; 8] = greeting[..8].try_into().expect("8 bytes");
    let flags = be16(&greeting[16..]);
    if &magic != NBDMAGIC || be64(&greeting[8..]) != IHAVEOPT {
        return Err(WireError::NotNbd(magic));
    }
    if flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(WireError::NotFixedNewstyle { flags });
    }
    Ok(u32::from(FLAG_FIXED_NEWSTYLE | (flags & FLAG_NO_ZEROES)))
}

/// An option request: header and data.
pub fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    m
}

/// `NBD_OPT_GO` for `export`, asking for no information beyond the
/// export's size and flags (which the server always sends).
pub fn opt_go(export: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(6 + export.len());
    d.extend_from_slice(&(export.len() as u32).to_be_bytes());
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    option(OPT_GO, &d)
}

/// An option reply's header: which option, what kind of reply, how many
/// bytes of data follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptReply {
    pub kind: u32,
    pub len: u32,
}

pub fn opt_reply(b: &[u8; OPT_REPLY_LEN], sent: u32) -> Result<OptReply, WireError> {
    let magic = be64(b);
    if magic != OPT_REPLY_MAGIC {
        return Err(WireError::BadOptReplyMagic(magic));
    }
    let got = be32(&b[8..]);
    if got != sent {
        return Err(WireError::OptReplyForOtherOption { sent, got });
    }
    Ok(OptReply {
        kind: be32(&b[12..]),
        len: be32(&b[16..]),
    })
}

/// What one reply to `NBD_OPT_GO` means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GoStep {
    /// `NBD_INFO_EXPORT`: the export's size and transmission flags.
    Export { size: u64, flags: u16 },
    /// Other information: ignored.
    Info,
    /// Transmission begins.
    Ack,
}

pub fn go_step(r: OptReply, data: &[u8]) -> Result<GoStep, WireError> {
    match r.kind {
        REP_ACK => Ok(GoStep::Ack),
        REP_INFO if data.len() >= 12 && be16(data) == INFO_EXPORT => Ok(GoStep::Export {
            size: be64(&data[2..]),
            flags: be16(&data[10..]),
        }),
        REP_INFO => Ok(GoStep::Info),
        k if k & REP_ERROR_BIT != 0 => Err(WireError::Refused {
            kind: k,
            message: String::from_utf8_lossy(data).into_owned(),
        }),
        kind => Err(WireError::UnexpectedReply { kind, len: r.len }),
    }
}

/// Encodes a request header.
pub fn request(cmd: Command, flags: u16, cookie: u64, offset: u64, len: u32) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&(cmd as u16).to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..28].copy_from_slice(&len.to_be_bytes());
    b
}

/// Decodes a simple reply to the request with `cookie`: `Ok(0)` for
/// success, else the server's error, which the protocol numbers as Linux
/// errno values (EPERM, EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW, ENOTSUP,
/// ESHUTDOWN).
pub fn reply(b: &[u8; REPLY_LEN], cookie: u64) -> Result<u32, WireError> {
    let (got, errno) = any_reply(b)?;
    if got != cookie {
        return Err(WireError::WrongCookie { sent: cookie, got });
    }
    Ok(errno)
}

/// Decodes a simple reply to any request: its cookie and the server's
/// error (0 for success), for a connection with several requests in
/// flight, whose replies may come in any order.
pub fn any_reply(b: &[u8; REPLY_LEN]) -> Result<(u64, u32), WireError> {
    let magic = be32(b);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(WireError::BadReplyMagic(magic));
    }
    Ok((be64(&b[8..]), be32(&b[4..])))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greeting(flags: u16) -> [u8; GREETING_LEN] {
        let mut g = [0u8; GREETING_LEN];
        g[..8].copy_from_slice(NBDMAGIC);
        g[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
        g[16..].copy_from_slice(&flags.to_be_bytes());
        g
    }

    #[test]
    fn greeting_gives_client_flags() {
        assert_eq!(client_flags(&greeting(3)), Ok(3));
        assert_eq!(client_flags(&greeting(1)), Ok(1));
        assert_eq!(
            client_flags(&greeting(0)),
            Err(WireError::NotFixedNewstyle { flags: 0 })
        );
        let mut g = greeting(3);
        g[0] = b'X';
        assert!(matches!(client_flags(&g), Err(WireError::NotNbd(_))));
    }

    #[test]
    fn opt_go_names_the_export() {
        let m = opt_go("abc");
        assert_eq!(be64(&m), IHAVEOPT);
        assert_eq!(be32(&m[8..]), OPT_GO);
        assert_eq!(be32(&m[12..]), 9);
        assert_eq!(be32(&m[16..]), 3);
        assert_eq!(&m[20..23], b"abc");
        assert_eq!(be16(&m[23..]), 0);
    }

    #[test]
    fn go_replies_give_size_and_flags_then_ack() {
        let mut h = [0u8; OPT_REPLY_LEN];
        h[..8].copy_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
        h[8..12].copy_from_slice(&OPT_GO.to_be_bytes());
        h[12..16].copy_from_slice(&REP_INFO.to_be_bytes());
        h[16..20].copy_from_slice(&12u32.to_be_bytes());
        let r = opt_reply(&h, OPT_GO).unwrap();
        let mut d = vec![0u8, 0];
        d.extend_from_slice(&(1u64 << 30).to_be_bytes());
        d.extend_from_slice(&0x6du16.to_be_bytes());
        assert_eq!(
            go_step(r, &d),
            Ok(GoStep::Export {
                size: 1 << 30,
                flags: 0x6d
            })
        );
        assert_eq!(
            opt_reply(&h, OPT_ABORT),
            Err(WireError::OptReplyForOtherOption {
                sent: OPT_ABORT,
                got: OPT_GO
            })
        );
        let ack = OptReply {
            kind: REP_ACK,
            len: 0,
        };
        assert_eq!(go_step(ack, &[]), Ok(GoStep::Ack));
        let refused = OptReply {
            kind: REP_ERROR_BIT | 6,
            len: 7,
        };
        let e = go_step(refused, b"no such").unwrap_err();
        assert!(e.to_string().contains("unknown export"), "{e}");
    }

    #[test]
    fn request_and_reply_round_trip() {
        let r = request(Command::Write, CMD_FLAG_FUA, 7, 1 << 40, 4096);
        assert_eq!(be32(&r), REQUEST_MAGIC);
        assert_eq!(be16(&r[4..]), CMD_FLAG_FUA);
        assert_eq!(be16(&r[6..]), 1);
        assert_eq!(be64(&r[8..]), 7);
        assert_eq!(be64(&r[16..]), 1 << 40);
        assert_eq!(be32(&r[24..]), 4096);
        let mut rep = [0u8; REPLY_LEN];
        rep[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        rep[4..8].copy_from_slice(&28u32.to_be_bytes());
        rep[8..].copy_from_slice(&7u64.to_be_bytes());
        assert_eq!(reply(&rep, 7), Ok(28));
        assert_eq!(
            reply(&rep, 8),
            Err(WireError::WrongCookie { sent: 8, got: 7 })
        );
        rep[0] = 0;
        assert!(matches!(reply(&rep, 7), Err(WireError::BadReplyMagic(_))));
    }
}
