//! Process set-up shared by every daemon and plugin on the swap path:
//! locking the process's memory so serving a page never waits for one of
//! its own pages to come back from swap, and keeping housekeeping threads
//! out of the request path's way.

use std::io;

/// How [`lock_memory`] locks pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// Every page now and future, faulted in at once: the serving process
    /// of a swap device must never take a page fault on its request path.
    Prefault,
    /// Pages are locked as they are touched (`MCL_ONFAULT`): for processes
    /// with many thread stacks (nbdkit) or large lazily used mappings,
    /// which would otherwise pin their full size; their hot buffers are
    /// touched when allocated, so those are resident and locked.
    OnFault,
}

/// `mlockall(MCL_CURRENT | MCL_FUTURE)`, with `MCL_ONFAULT` for
/// [`Lock::OnFault`].
pub fn lock_memory(how: Lock) -> io::Result<()> {
    let mut flags = libc::MCL_CURRENT | libc::MCL_FUTURE;
    if how == Lock::OnFault {
        flags |= libc::MCL_ONFAULT;
    }
    crate::sys::mlockall(flags)
}

/// Lowers the calling thread (and the threads it starts) to nice 19, for
/// periodic housekeeping (status polls, epochs) that shares a few CPUs with
/// the threads serving requests: a request woken while it runs should get
/// the CPU first.
pub fn background_thread() -> io::Result<()> {
    crate::sys::set_thread_nice(19)
}
