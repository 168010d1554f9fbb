//! The only unsafe code of pagerctl: sending signals to processes it
//! started in an earlier invocation (their `Child` handles are long gone).

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
