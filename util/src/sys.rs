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

/// `setpriority(PRIO_PROCESS, gettid(), nice)`: on Linux a thread's nice
/// value is its own, and threads it starts inherit it.
pub(crate) fn set_thread_nice(nice: libc::c_int) -> io::Result<()> {
    // SAFETY: gettid and setpriority take integers only and have no
    // memory-safety preconditions.
    let r = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
