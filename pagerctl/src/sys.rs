//! The only unsafe code of pagerctl: sending signals to processes it
//! started in an earlier invocation (their `Child` handles are long gone),
//! the signal mask of `pagerctl serve`, and SIGPIPE's default action for
//! the commands that only print.

use std::io;

/// Sends `signal` to `pid`.
pub fn signal(pid: u32, signal: libc::c_int) -> io::Result<()> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// SIGPIPE ends the process again (Rust starts with it ignored): a report
/// whose reader went away stops there, quietly.
pub fn default_sigpipe() {
    // SAFETY: installs the default action; no handler of ours is involved.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set is a live local.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGUSR1);
    }
    set
}

/// Blocks SIGTERM, SIGINT and SIGUSR1 (hand over to the next serving
/// process) in this thread and every thread it starts
/// later, so that only [`wait_stop_signal`] receives them.
pub fn block_stop_signals() -> io::Result<()> {
    let set = stop_signals();
    // SAFETY: the set is live for the call; the old mask is not wanted.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Waits for SIGTERM, SIGINT or SIGUSR1 (blocked by [`block_stop_signals`]).
pub fn wait_stop_signal() -> libc::c_int {
    let set = stop_signals();
    let mut sig: libc::c_int = 0;
    // SAFETY: both pointers are live locals for the call.
    while unsafe { libc::sigwait(&set, &mut sig) } != 0 {}
    sig
}
