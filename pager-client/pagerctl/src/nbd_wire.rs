//! Just enough of the NBD protocol (fixed newstyle handshake, NBD_OPT_GO,
//! NBD_CMD_FLUSH) to see that the client's nbdkit answers, and to flush it
//! before it is stopped. Everything else talks NBD through the kernel,
//! nbdfuse or libnbd.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};

const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const OPT_ABORT: u32 = 2;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERROR_BIT: u32 = 1 << 31;
const INFO_EXPORT: u16 = 0;
const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const TRANSMIT_SEND_FLUSH: u16 = 1 << 2;

fn read_array<const N: usize>(s: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn connect(socket: &Path, timeout: Duration) -> Result<UnixStream> {
    let s = UnixStream::connect(socket)
        .with_context(|| format!("cannot connect to {}", socket.display()))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

/// The server's greeting and our client flags.
fn handshake(s: &mut UnixStream) -> Result<()> {
    let magic: [u8; 8] = read_array(s).context("reading the NBD greeting")?;
    let opt = u64::from_be_bytes(read_array(s)?);
    let flags = u16::from_be_bytes(read_array(s)?);
    if &magic != b"NBDMAGIC" || opt != IHAVEOPT || flags & FLAG_FIXED_NEWSTYLE == 0 {
        bail!("not a fixed-newstyle NBD server (greeting {magic:02x?} {opt:#x}, flags {flags:#x})");
    }
    let ours = u32::from(FLAG_FIXED_NEWSTYLE | (flags & FLAG_NO_ZEROES));
    s.write_all(&ours.to_be_bytes())?;
    Ok(())
}

fn send_option(s: &mut UnixStream, option: u32, data: &[u8]) -> Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)?;
    Ok(())
}

/// Reads one option reply: (type, data).
fn read_option_reply(s: &mut UnixStream, option: u32) -> Result<(u32, Vec<u8>)> {
    let magic = u64::from_be_bytes(read_array(s)?);
    let opt = u32::from_be_bytes(read_array(s)?);
    let kind = u32::from_be_bytes(read_array(s)?);
    let len = u32::from_be_bytes(read_array(s)?);
    if magic != OPT_REPLY_MAGIC || opt != option || len > 1 << 20 {
        bail!("malformed option reply (magic {magic:#x}, option {opt}, length {len})");
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((kind, data))
}

/// Whether an NBD server completes the handshake on `socket`. The probe
/// ends with NBD_OPT_ABORT, so the server logs no broken connection.
pub fn answers(socket: &Path) -> bool {
    let probe = || -> Result<()> {
        let mut s = connect(socket, Duration::from_secs(2))?;
        handshake(&mut s)?;
        send_option(&mut s, OPT_ABORT, &[])?;
        // The server acknowledges the abort (or just closes); either is fine.
        let _ = read_option_reply(&mut s, OPT_ABORT);
        Ok(())
    };
    probe().is_ok()
}

/// Opens `export` and sends NBD_CMD_FLUSH: the server writes back whatever
/// it holds for every connection (the client plugin advertises multi-conn,
/// so one connection's flush covers them all).
pub fn flush(socket: &Path, export: &str, timeout: Duration) -> Result<()> {
    let mut s = connect(socket, timeout)?;
    handshake(&mut s)?;
    let mut go = Vec::new();
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&0u16.to_be_bytes());
    send_option(&mut s, OPT_GO, &go)?;
    let mut transmit_flags = 0u16;
    loop {
        let (kind, data) = read_option_reply(&mut s, OPT_GO)?;
        match kind {
            REP_ACK => break,
            REP_INFO
                if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT =>
            {
                transmit_flags = u16::from_be_bytes([data[10], data[11]]);
            }
            REP_INFO => {}
            k if k & REP_ERROR_BIT != 0 => {
                bail!(
                    "server refused export {export:?} (error {k:#x}: {})",
                    String::from_utf8_lossy(&data)
                )
            }
            k => bail!("unexpected reply {k:#x} to NBD_OPT_GO"),
        }
    }
    if transmit_flags & TRANSMIT_SEND_FLUSH == 0 {
        bail!("export {export:?} does not accept flush requests");
    }
    s.write_all(&request(CMD_FLUSH, 1))?;
    let magic =
        u32::from_be_bytes(read_array(&mut s).context("waiting for the flush to complete")?);
    let error = u32::from_be_bytes(read_array(&mut s)?);
    let handle = u64::from_be_bytes(read_array(&mut s)?);
    if magic != SIMPLE_REPLY_MAGIC || handle != 1 {
        bail!("malformed reply to the flush (magic {magic:#x}, handle {handle})");
    }
    if error != 0 {
        bail!(
            "flush failed: {}",
            std::io::Error::from_raw_os_error(error as i32)
        );
    }
    // A clean disconnect; the server closes without replying.
    let _ = s.write_all(&request(CMD_DISC, 2));
    Ok(())
}

/// A transmission request without payload.
fn request(command: u16, handle: u64) -> [u8; 28] {
    let mut r = [0u8; 28];
    r[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    r[6..8].copy_from_slice(&command.to_be_bytes());
    r[8..16].copy_from_slice(&handle.to_be_bytes());
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command, Stdio};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    static SERVERS: AtomicUsize = AtomicUsize::new(0);

    /// `nbdkit memory` on a unix socket in a fresh directory, killed on drop.
    struct Server {
        child: Child,
        dir: std::path::PathBuf,
    }

    impl Server {
        fn start(args: &[&str]) -> Server {
            let n = SERVERS.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("pagerctl-nbd-wire-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let sock = dir.join("s");
            let child = Command::new("nbdkit")
                .args(["-f", "-U"])
                .arg(&sock)
                .args(args)
                .stdin(Stdio::null())
                .spawn()
                .expect("nbdkit is installed (make deps)");
            let start = Instant::now();
            while !sock.exists() {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "nbdkit did not start"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Server { child, dir }
        }

        fn socket(&self) -> std::path::PathBuf {
            self.dir.join("s")
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn probe_and_flush_against_nbdkit() {
        let srv = Server::start(&["memory", "1M"]);
        assert!(answers(&srv.socket()));
        flush(&srv.socket(), "", Duration::from_secs(5)).unwrap();
        assert!(!answers(&srv.dir.join("missing")));
    }

    #[test]
    fn flush_is_refused_by_name_without_flush_support() {
        let srv = Server::start(&["pattern", "1M"]);
        let e = flush(&srv.socket(), "", Duration::from_secs(5))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not accept flush"), "{e}");
    }

    #[test]
    fn request_layout() {
        let r = request(CMD_FLUSH, 7);
        assert_eq!(&r[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&r[4..8], &[0, 0, 0, 3]);
        assert_eq!(r[15], 7);
        assert!(r[16..].iter().all(|b| *b == 0));
    }
}
