//! The crate's only `unsafe`: the system calls of [`crate::process`].

use std::io;

pub(crate) fn mlockall(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: mlockall takes flags only and has no memory-safety
    // preconditions.
    if unsafe { libc::mlockall(flags) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
