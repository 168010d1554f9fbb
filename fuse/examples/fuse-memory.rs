//! A FUSE front end over plain memory: the floor of the client's kernel
//! path. `make bench-client` swaps through it, beside the client, to show
//! what the kernel, FUSE and a loop device cost with no donor behind them.
//!
//!     fuse-memory MOUNTPOINT SIZE_MIB [fuse-uring|fuse]
//!
//! Serves MOUNTPOINT/device until MOUNTPOINT is unmounted. Its memory is
//! locked and touched up front, as the client's is.

use pager_fuse::memory::Memory;
use pager_fuse::{Mount, Options, Transport};

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
    // Non-zero fill: every page is really there (and locked) now.
    let memory = Memory::new(size, 0xa5);
    let opts = Options {
        transport,
        ..Options::default()
    };
    let mount = Mount::start(memory, std::path::Path::new(mountpoint), &opts)?;
    eprintln!("serving {mountpoint}/device over {}", mount.transport());
    mount.wait()?;
    Ok(())
}
