//! A FUSE front end over plain memory: the floor of the client's kernel
//! path. `make bench-client` swaps through it, beside the client, to show
//! what the kernel, FUSE and a loop device cost with no donor behind them.
//!
//!     fuse-memory MOUNTPOINT SIZE_MIB [fuse-uring|fuse]
//!
//! Serves MOUNTPOINT/device until MOUNTPOINT is unmounted. Its memory is
//! locked and touched up front, as the client's is.

use std::sync::Mutex;

use netpager_util::LockExt;
use pager_fuse::{Backend, Mount, Options, Transport};

/// Bytes per lock: requests of different chunks never wait on each other.
const CHUNK: usize = 64 << 10;

struct Memory(Vec<Mutex<Box<[u8]>>>);

impl Memory {
    fn new(size: usize) -> Memory {
        // Non-zero fill: every page is really there (and locked) now.
        Memory(
            (0..size.div_ceil(CHUNK))
                .map(|_| Mutex::new(vec![0xa5u8; CHUNK].into_boxed_slice()))
                .collect(),
        )
    }

    /// Calls `f(chunk, offset in chunk, offset in request, length)` for
    /// each chunk the range touches.
    fn each(&self, offset: u64, len: usize, mut f: impl FnMut(&mut [u8], usize, usize, usize)) {
        let mut done = 0;
        while done < len {
            let pos = offset as usize + done;
            let (c, at) = (pos / CHUNK, pos % CHUNK);
            let n = (CHUNK - at).min(len - done);
            let mut chunk = self.0[c].lock_or_recover();
            f(&mut chunk, at, done, n);
            done += n;
        }
    }
}

impl Backend for Memory {
    fn size(&self) -> u64 {
        (self.0.len() * CHUNK) as u64
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), i32> {
        delay("READ_DELAY_US");
        self.each(offset, buf.len(), |c, at, i, n| {
            buf[i..i + n].copy_from_slice(&c[at..at + n])
        });
        Ok(())
    }
    fn write(&self, data: &[u8], offset: u64) -> Result<(), i32> {
        delay("WRITE_DELAY_US");
        self.each(offset, data.len(), |c, at, i, n| {
            c[at..at + n].copy_from_slice(&data[i..i + n])
        });
        Ok(())
    }
    fn zero(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.each(offset, len as usize, |c, at, _, n| c[at..at + n].fill(0));
        Ok(())
    }
    fn trim(&self, len: u64, offset: u64) -> Result<(), i32> {
        self.zero(len, offset)
    }
    fn flush(&self) -> Result<(), i32> {
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(mountpoint), Some(mib)) = (args.get(1), args.get(2)) else {
        return Err("usage: fuse-memory MOUNTPOINT SIZE_MIB [fuse-uring|fuse]".into());
    };
    let size = mib
        .parse::<usize>()
        .map_err(|e| format!("SIZE_MIB {mib:?}: {e}"))?
        << 20;
    let transport = match args.get(3).map(String::as_str) {
        None | Some("fuse-uring") => Transport::Uring,
        Some("fuse") => Transport::Classic,
        Some(t) => return Err(format!("{t:?}: expected fuse-uring or fuse").into()),
    };
    netpager_util::process::lock_memory(netpager_util::process::Lock::Prefault)?;
    let memory = Memory::new(size);
    let opts = Options {
        transport,
        threads: std::env::var("THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4),
        ..Options::default()
    };
    let mount = Mount::start(memory, std::path::Path::new(mountpoint), &opts)?;
    eprintln!("serving {mountpoint}/device over {}", mount.transport());
    mount.wait()?;
    Ok(())
}
fn delay(var: &str) {
    let us: u64 = std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if us > 0 {
        std::thread::sleep(std::time::Duration::from_micros(us));
    }
}
