//! Every `unsafe` of the crate: nbdkit's logging functions, the client's
//! address, memory locking, and the plugin registration struct.
//!
//! Registration: the `nbdkit` crate 0.3 describes `struct nbdkit_plugin`
//! only up to `after_fork`, so it cannot declare `block_size`. We build its
//! struct with `nbdkit::Builder` (exactly what its `plugin!` macro expands
//! to), move it into [`PluginV2`], a `#[repr(C)]` struct that appends the
//! fields nbdkit >= 1.30 has after `after_fork` (`list_exports`,
//! `default_export`, `export_description`, `cleanup`, `block_size`), and
//! export our own `plugin_init` returning it with `_struct_size` set to
//! the larger size. nbdkit copies `min(_struct_size, its own size)` bytes,
//! so older servers simply ignore the tail.

use std::ffi::CString;
use std::io;
use std::mem::{offset_of, size_of};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::raw::{c_char, c_int, c_void};

use crate::access::Peer;

extern "C" {
    fn nbdkit_debug(fmt: *const c_char, ...);
    fn nbdkit_error(fmt: *const c_char, ...);
    fn nbdkit_peer_name(addr: *mut libc::sockaddr, addrlen: *mut libc::socklen_t) -> c_int;
}

fn c_message(msg: &str) -> CString {
    CString::new(msg.replace('\0', "\\0")).expect("NULs were replaced")
}

/// A debug line in nbdkit's log (shown with `nbdkit -v`). Only callable
/// inside nbdkit, which provides the symbol.
pub fn log_debug(msg: &str) {
    let m = c_message(msg);
    // SAFETY: "%s" with one NUL-terminated string argument matches the
    // variadic arguments; both pointers outlive the call.
    unsafe { nbdkit_debug(c"%s".as_ptr(), m.as_ptr()) }
}

/// An error line in nbdkit's log (always shown). Only inside nbdkit.
pub fn log_error(msg: &str) {
    let m = c_message(msg);
    // SAFETY: as in `log_debug`; nbdkit_error may be called from any thread.
    unsafe { nbdkit_error(c"%s".as_ptr(), m.as_ptr()) }
}

/// The address of the client on the current connection. Only callable
/// from an nbdkit callback of a connection (open, ...). A socket nbdkit
/// cannot name (it logs why) is `Peer::Other`, which needs TLS.
pub fn peer_name() -> Peer {
    // SAFETY: sockaddr_storage is plain old data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: nbdkit writes at most `len` bytes of the peer's address into
    // the storage we own and updates `len`; both outlive the call.
    let r = unsafe { nbdkit_peer_name(std::ptr::addr_of_mut!(ss).cast(), &mut len) };
    if r != 0 {
        return Peer::Other;
    }
    match c_int::from(ss.ss_family) {
        libc::AF_INET if len as usize >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the storage holds a sockaddr_in, `len`
            // says it was written in full, and sockaddr_storage is aligned
            // for every sockaddr type.
            let sin = unsafe { &*std::ptr::addr_of!(ss).cast::<libc::sockaddr_in>() };
            Peer::Ip(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))))
        }
        libc::AF_INET6 if len as usize >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &*std::ptr::addr_of!(ss).cast::<libc::sockaddr_in6>() };
            Peer::Ip(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
        }
        libc::AF_UNIX => Peer::Unix,
        _ => Peer::Other,
    }
}

/// The process's RLIMIT_MEMLOCK soft limit in bytes; `None` = unlimited.
pub fn memlock_limit() -> io::Result<Option<u64>> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur))
}

/// Locks all current and future memory of the process as it is touched
/// (MCL_ONFAULT: reserved but untouched mappings such as thread stacks and
/// malloc arenas are not populated).
pub fn lock_all_memory() -> io::Result<()> {
    // SAFETY: mlockall takes flags only and changes no Rust-visible memory.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `struct nbdkit_plugin` of nbdkit 1.30+: the crate's struct, then the
/// fields it lacks.
#[repr(C)]
pub struct PluginV2 {
    base: nbdkit::Plugin,
    list_exports: Option<extern "C" fn(c_int, c_int, *mut c_void) -> c_int>,
    default_export: Option<extern "C" fn(c_int, c_int) -> *const c_char>,
    export_description: Option<extern "C" fn(*mut c_void) -> *const c_char>,
    cleanup: Option<extern "C" fn()>,
    block_size: Option<extern "C" fn(*mut c_void, *mut u32, *mut u32, *mut u32) -> c_int>,
}

// The appended fields must start right after the crate's struct, at the
// offset nbdkit 1.32's header gives `list_exports` (344 on LP64), and end
// where its struct ends (384).
const _: () = assert!(offset_of!(PluginV2, list_exports) == size_of::<nbdkit::Plugin>());
#[cfg(target_pointer_width = "64")]
const _: () = assert!(size_of::<nbdkit::Plugin>() == 344 && size_of::<PluginV2>() == 384);

/// Block size hints: any alignment works (minimum 1), a page is the unit
/// without read-modify-write (preferred 4096), and nbdkit itself refuses
/// data requests above 64 MiB (maximum).
pub const BLOCK_MIN: u32 = 1;
pub const BLOCK_PREFERRED: u32 = crate::store::PAGE_SIZE as u32;
pub const BLOCK_MAX: u32 = 64 << 20;

extern "C" fn block_size(
    _handle: *mut c_void,
    minimum: *mut u32,
    preferred: *mut u32,
    maximum: *mut u32,
) -> c_int {
    // SAFETY: nbdkit passes three valid, writable uint32_t pointers.
    unsafe {
        *minimum = BLOCK_MIN;
        *preferred = BLOCK_PREFERRED;
        *maximum = BLOCK_MAX;
    }
    0
}

/// nbdkit's entry point: registers [`crate::PagerServer`].
#[no_mangle]
pub extern "C" fn plugin_init() -> *const PluginV2 {
    let mut b = nbdkit::Builder::new();
    crate::register(&mut b);
    let raw = b.into_ptr::<crate::PagerServer>() as *mut nbdkit::Plugin;
    // SAFETY: `into_ptr` returns `Box::into_raw` of a fresh Box<Plugin>
    // allocated by this same binary's allocator and owned by nobody else;
    // taking it back moves the (Drop-free) struct out and frees the box.
    let mut base = *unsafe { Box::from_raw(raw) };
    base._struct_size = size_of::<PluginV2>() as u64;
    let plugin = PluginV2 {
        base,
        list_exports: None,
        default_export: None,
        export_description: None,
        cleanup: None,
        block_size: Some(block_size),
    };
    // Leaked: nbdkit copies the struct and never gives it back.
    Box::into_raw(Box::new(plugin))
}
