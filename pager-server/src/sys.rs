//! Every `unsafe` of the crate: nbdkit's logging functions, the client's
//! address, memory locking, malloc's mmap threshold, a thread's CPU clock,
//! liblz4's high-compression mode, the slabs donated pages live in ([`Slab`],
//! [`Page`]), and the plugin registration struct.
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

use std::cell::RefCell;
use std::ffi::CString;
use std::io;
use std::mem::{offset_of, size_of};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ops::{Deref, DerefMut};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::NonNull;

// Builds and links liblz4, whose HC functions below its bindings lack.
use lz4_sys as _;

use crate::access::Peer;
use crate::config::PAGE_SIZE;

extern "C" {
    fn nbdkit_debug(fmt: *const c_char, ...);
    fn nbdkit_error(fmt: *const c_char, ...);
    fn nbdkit_peer_name(addr: *mut libc::sockaddr, addrlen: *mut libc::socklen_t) -> c_int;
    // lz4hc.h: a state the caller keeps, reset cheaply for each call.
    fn LZ4_sizeofStateHC() -> c_int;
    fn LZ4_initStreamHC(state: *mut c_void, size: usize) -> *mut c_void;
    fn LZ4_compress_HC_extStateHC_fastReset(
        state: *mut c_void,
        src: *const c_char,
        dst: *mut c_char,
        src_size: c_int,
        dst_capacity: c_int,
        level: c_int,
    ) -> c_int;
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

// One LZ4-HC state per thread, made on first use: it is 256 KiB, which
// `LZ4_compress_HC` would allocate and clear for every page.
thread_local! {
    static LZ4HC_STATE: RefCell<Option<Box<[u64]>>> = const { RefCell::new(None) };
}

/// Compresses `src` into `dst` with LZ4's high-compression mode at
/// `level`: an LZ4 block, which `lz4_flex::block::decompress_into` reads.
/// `None` when it does not fit in `dst`.
pub fn lz4hc_compress(src: &[u8], dst: &mut [u8], level: i32) -> Option<usize> {
    let src_len = c_int::try_from(src.len()).ok()?;
    let dst_len = c_int::try_from(dst.len()).ok()?;
    LZ4HC_STATE.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            // SAFETY: no arguments; returns the size of LZ4_streamHC_t.
            let size = usize::try_from(unsafe { LZ4_sizeofStateHC() }).ok()?;
            // u64s: the struct holds pointers and sizes, 8-byte aligned.
            let mut state = vec![0u64; size.div_ceil(8)].into_boxed_slice();
            // SAFETY: `state` is at least `size` bytes, aligned for the
            // struct, and lives past the call.
            let made = unsafe { LZ4_initStreamHC(state.as_mut_ptr().cast(), size) };
            if made.is_null() {
                return None;
            }
            *slot = Some(state);
        }
        let state = slot.as_mut()?;
        // SAFETY: the state was initialised by LZ4_initStreamHC and is this
        // thread's alone; `src` and `dst` are valid for their lengths during
        // the call, and liblz4 writes at most `dst_len` bytes to `dst`.
        let n = unsafe {
            LZ4_compress_HC_extStateHC_fastReset(
                state.as_mut_ptr().cast(),
                src.as_ptr().cast(),
                dst.as_mut_ptr().cast(),
                src_len,
                dst_len,
                level,
            )
        };
        usize::try_from(n).ok().filter(|&n| n > 0)
    })
}

/// This thread's CPU time so far (CLOCK_THREAD_CPUTIME_ID: exact to the
/// nanosecond, the running slice included), for the replay's costs.
pub fn thread_cpu_time() -> io::Result<std::time::Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid struct we pass.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(std::time::Duration::new(
        ts.tv_sec as u64,
        ts.tv_nsec as u32,
    ))
}

/// One anonymous private mapping of `pages` pages, handed out page by page
/// as [`Page`]s. The pages a slab has never handed out are untouched, so
/// they are zeros and cost no memory; returned pages are handed out again
/// first (last in, first out: the most recently used are warm in cache).
///
/// The mapping is unmapped when the slab is dropped with no page out, which
/// returns its memory to the kernel and ends its lock under mlockall; a
/// slab dropped with pages still out leaks its mapping rather than leave
/// them dangling.
pub struct Slab {
    base: NonNull<u8>,
    pages: u16,
    /// Pages handed out at least once: `0..fresh_from`.
    fresh_from: u16,
    /// Returned pages, by index.
    free: Vec<u16>,
    id: u32,
}

// SAFETY: a Slab owns its mapping exclusively; the raw pointer is only an
// address, never shared with another Slab.
unsafe impl Send for Slab {}

/// One page of a [`Slab`]: the only handle to it while it is out, so it
/// derefs to the page's bytes like a `Box<[u8; PAGE_SIZE]>`.
pub struct Page {
    ptr: NonNull<[u8; PAGE_SIZE]>,
    slab: u32,
}

// SAFETY: a Page is the unique owner of its bytes (no other Page or Slab
// hands out the same address while it lives), like a Box.
unsafe impl Send for Page {}
// SAFETY: `&Page` only gives `&[u8]`; mutation needs `&mut Page`.
unsafe impl Sync for Page {}

impl Page {
    /// The id of the slab this page belongs to.
    pub fn slab(&self) -> u32 {
        self.slab
    }
}

impl Deref for Page {
    type Target = [u8; PAGE_SIZE];
    fn deref(&self) -> &[u8; PAGE_SIZE] {
        // SAFETY: the page lies in a mapping that stays mapped while any of
        // its pages is out (see Slab's Drop), and this Page is its only
        // handle, so no `&mut` to it exists while this borrow lives.
        unsafe { self.ptr.as_ref() }
    }
}

impl DerefMut for Page {
    fn deref_mut(&mut self) -> &mut [u8; PAGE_SIZE] {
        // SAFETY: as for Deref; `&mut self` makes this borrow exclusive.
        unsafe { self.ptr.as_mut() }
    }
}

impl Slab {
    /// Maps a slab of `pages` pages (at most 65535), asking for transparent
    /// huge pages (a 2 MiB slab is then one page fault and one TLB entry,
    /// where the kernel has them; refused advice changes nothing else).
    /// Under `mlockall(MCL_FUTURE|MCL_ONFAULT)` the mapping is locked as it
    /// is touched.
    pub fn map(pages: u16, id: u32) -> io::Result<Slab> {
        let len = usize::from(pages) * PAGE_SIZE;
        // SAFETY: a fresh anonymous private mapping at an address of the
        // kernel's choosing overlaps no memory Rust knows about.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: advice on the mapping just made; MADV_HUGEPAGE changes how
        // it is backed, never its contents.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        Ok(Slab {
            base: NonNull::new(p.cast()).expect("mmap succeeded, so not NULL"),
            pages,
            fresh_from: 0,
            free: Vec::new(),
            id,
        })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// Pages out.
    pub fn in_use(&self) -> usize {
        usize::from(self.fresh_from) - self.free.len()
    }

    pub fn is_full(&self) -> bool {
        self.in_use() == usize::from(self.pages)
    }

    /// A page and whether it is fresh (never handed out, so all zeros);
    /// `None` when all are out.
    pub fn take(&mut self) -> Option<(Page, bool)> {
        let (i, fresh) = match self.free.pop() {
            Some(i) => (i, false),
            None if self.fresh_from < self.pages => {
                self.fresh_from += 1;
                (self.fresh_from - 1, true)
            }
            None => return None,
        };
        // SAFETY: i < pages, so the page lies inside the mapping.
        let p = unsafe { self.base.as_ptr().add(usize::from(i) * PAGE_SIZE) };
        let ptr = NonNull::new(p.cast()).expect("inside a mapping, so not NULL");
        Some((Page { ptr, slab: self.id }, fresh))
    }

    /// Takes back a page this slab handed out.
    ///
    /// # Panics
    /// If the page belongs to another slab (a bug of the caller).
    pub fn give(&mut self, page: Page) {
        let off = (page.ptr.as_ptr() as usize).wrapping_sub(self.base.as_ptr() as usize);
        assert!(
            page.slab == self.id && off < usize::from(self.pages) * PAGE_SIZE,
            "page of slab {} given back to slab {}",
            page.slab,
            self.id
        );
        self.free.push((off / PAGE_SIZE) as u16);
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        if self.in_use() > 0 {
            return;
        }
        // SAFETY: no Page of this mapping is out, so nothing refers to it.
        unsafe {
            libc::munmap(
                self.base.as_ptr().cast(),
                usize::from(self.pages) * PAGE_SIZE,
            )
        };
    }
}

/// Pins glibc's mmap threshold at `bytes`, so that every larger block
/// (nbdkit's per-thread request buffers of up to 64 MiB) gets a mapping of
/// its own that `free` unmaps. Left dynamic, glibc raises the threshold to
/// the size of the first such block freed and serves the next ones from
/// its arenas, which keep what they grew to: under mlockall they cannot
/// even advise free memory away. Returns false if glibc refused.
pub fn fix_mmap_threshold(bytes: c_int) -> bool {
    // SAFETY: mallopt only changes malloc's tunables; any value is safe.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) == 1 }
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
pub const BLOCK_PREFERRED: u32 = PAGE_SIZE as u32;
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
