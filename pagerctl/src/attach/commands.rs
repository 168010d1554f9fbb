//! Command lines of every attach and detach step, as pure functions.
//!
//! The kernel nbd path cannot run on machines without the nbd module, so its
//! command lines are checked here, in unit tests, against nbd-client 3.24's
//! documented options.

use std::path::Path;

use super::AttachError;

/// How the local kernel reaches the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Frontend {
    /// fuse-uring where the kernel has it, else nbd where kernel nbd
    /// exists, else fuse.
    Auto,
    /// `pagerctl serve`'s own FUSE mount over io_uring, plus a loop device.
    FuseUring,
    /// The same over classic `/dev/fuse`.
    Fuse,
    /// The client's nbdkit on a unix socket, reached through kernel nbd (or
    /// nbdfuse and a loop device, see [`Via`]): one socket hop more.
    Nbd,
}

impl std::str::FromStr for Frontend {
    type Err = AttachError;
    fn from_str(s: &str) -> Result<Self, AttachError> {
        match s {
            "auto" => Ok(Frontend::Auto),
            "fuse-uring" => Ok(Frontend::FuseUring),
            "fuse" => Ok(Frontend::Fuse),
            "nbd" => Ok(Frontend::Nbd),
            _ => Err(AttachError::BadOption {
                option: "--frontend",
                reason: format!("{s:?}: expected auto, fuse-uring, fuse or nbd"),
            }),
        }
    }
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Frontend::Auto => "auto",
            Frontend::FuseUring => "fuse-uring",
            Frontend::Fuse => "fuse",
            Frontend::Nbd => "nbd",
        })
    }
}

impl Frontend {
    /// Resolves `Auto` from what the machine has: FUSE over io_uring in
    /// the kernel (its switch exists), kernel nbd with nbd-client.
    pub fn resolve(self, kernel_uring: bool, kernel_nbd: bool) -> Frontend {
        match self {
            Frontend::Auto if kernel_uring => Frontend::FuseUring,
            Frontend::Auto if kernel_nbd => Frontend::Nbd,
            Frontend::Auto => Frontend::Fuse,
            f => f,
        }
    }

    /// [`Frontend::resolve`] for a device whose serving process is to
    /// survive its own crash and upgrades (`restartable`): that needs
    /// classic `/dev/fuse` or kernel nbd's reconnect, so `Auto` is `Fuse`
    /// then (kernel nbd is not tested here, and FUSE is everywhere);
    /// io_uring is refused with the reason, and so is nbd without kernel
    /// nbd (`kernel_nbd`: `/dev/nbd0` exists).
    pub fn resolve_restartable(
        self,
        restartable: bool,
        kernel_uring: bool,
        kernel_nbd: bool,
    ) -> Result<Frontend, AttachError> {
        if !restartable {
            return Ok(self.resolve(kernel_uring, kernel_nbd));
        }
        let refuse = |reason: &str| AttachError::BadOption {
            option: "--restartable",
            reason: reason.to_string(),
        };
        match self {
            Frontend::Auto | Frontend::Fuse => Ok(Frontend::Fuse),
            Frontend::FuseUring => Err(refuse(
                "needs --frontend fuse: the kernel resends the requests a dead server left in /dev/fuse, never those in its io_uring entries (pagerctl(1) RESTARTS); or attach --no-restartable",
            )),
            Frontend::Nbd if kernel_nbd => Ok(Frontend::Nbd),
            Frontend::Nbd => Err(refuse(
                "with --frontend nbd needs kernel nbd, whose reconnect keeps the device while nbdkit is replaced: there is no /dev/nbd0 (modprobe nbd); or use --frontend fuse, or --no-restartable",
            )),
        }
    }
}

/// The front end a device gets and whether it is restartable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub frontend: Frontend,
    pub restartable: bool,
    /// Why a swap device is not restartable although nobody asked for
    /// that: its front end cannot be (said as a warning).
    pub not_restartable: Option<&'static str>,
}

impl Frontend {
    /// The front end and whether the device is restartable: as asked
    /// (`--restartable`, `--no-restartable`: `asked`); else a swap device
    /// is restartable where its front end allows (its serving process
    /// would take every swapped page with it when it dies), over classic
    /// FUSE (`auto` means `fuse` then), and any other device is not.
    /// Kernel nbd's restarts are never the default: they have not run on a
    /// real /dev/nbd0. `nbd_module`: /dev/nbd0 exists; `nbd_client`:
    /// nbd-client is installed.
    pub fn resolve_attach(
        self,
        asked: Option<bool>,
        swap: bool,
        kernel_uring: bool,
        nbd_module: bool,
        nbd_client: bool,
    ) -> Result<Served, AttachError> {
        let served = |frontend, restartable, not_restartable| Served {
            frontend,
            restartable,
            not_restartable,
        };
        let plain = self.resolve(kernel_uring, nbd_module && nbd_client);
        Ok(match (asked, swap, self) {
            (Some(true), ..) => served(
                self.resolve_restartable(true, kernel_uring, nbd_module)?,
                true,
                None,
            ),
            (Some(false), ..) | (None, false, _) => served(plain, false, None),
            (None, true, Frontend::Auto | Frontend::Fuse) => served(Frontend::Fuse, true, None),
            (None, true, Frontend::FuseUring) => served(
                plain,
                false,
                Some("--frontend fuse-uring cannot be restartable: the kernel never resends the requests a dead server left in its io_uring entries (pagerctl(1) RESTARTS); if pagerctl serve dies, every process with pages on this swap device loses them (--frontend fuse makes it restartable)"),
            ),
            (None, true, Frontend::Nbd) => served(
                plain,
                false,
                Some("--frontend nbd is restartable only when asked (--restartable, kernel nbd's reconnect, which has not run on a real /dev/nbd0 yet): if nbdkit dies, every process with pages on this swap device loses them (--frontend fuse makes it restartable)"),
            ),
        })
    }
}

/// `pagerctl serve` for the FUSE front ends, run by `pagerctl` itself.
pub fn serve_command(pagerctl: &Path, state_dir: &Path, frontend: Frontend) -> Vec<String> {
    vec![
        s(pagerctl),
        "serve".into(),
        "--state-dir".into(),
        s(state_dir),
        "--transport".into(),
        frontend.to_string(),
    ]
}

/// What every serving process of a device is started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeOptions {
    /// Serving threads (per queue with io_uring).
    pub threads: usize,
    /// `--writeback-buffer`, as given.
    pub writeback: String,
    /// Buffered writes acknowledged only once on the donors: a block
    /// device keeps what it acknowledged if its serving process dies.
    pub ack_late: bool,
}

impl ServeOptions {
    fn args(&self) -> Vec<String> {
        let mut v = vec![
            "--threads".into(),
            self.threads.to_string(),
            "--writeback-buffer".into(),
            self.writeback.clone(),
        ];
        if self.ack_late {
            v.push("--writeback-ack-late".into());
        }
        v
    }
}

/// `pagerctl hold`: keeps a restartable device's FUSE connection and runs
/// `pagerctl serve --held` processes on it, one after another.
pub fn hold_command(pagerctl: &Path, state_dir: &Path, serve: &ServeOptions) -> Vec<String> {
    let mut cmd = vec![
        s(pagerctl),
        "hold".into(),
        "--state-dir".into(),
        s(state_dir),
    ];
    cmd.extend(serve.args());
    cmd
}

/// `pagerctl serve --held`: a serving process that takes the connection
/// from the holder (classic `/dev/fuse`: the only transport whose
/// unanswered requests the kernel resends).
pub fn held_serve_command(pagerctl: &Path, state_dir: &Path, serve: &ServeOptions) -> Vec<String> {
    let mut cmd = plain_serve_command(pagerctl, state_dir, Frontend::Fuse, serve);
    cmd.push("--held".into());
    cmd
}

/// [`serve_command`] with the serving options.
pub fn plain_serve_command(
    pagerctl: &Path,
    state_dir: &Path,
    frontend: Frontend,
    serve: &ServeOptions,
) -> Vec<String> {
    let mut cmd = serve_command(pagerctl, state_dir, frontend);
    cmd.extend(serve.args());
    cmd
}

/// `pagerctl hold-nbd`: holds a restartable kernel nbd device, running
/// nbdkit with the client plugin and reconnecting the device to each new
/// one.
pub fn hold_nbd_command(
    pagerctl: &Path,
    state_dir: &Path,
    device: &Path,
    plugin: &Path,
    export: &str,
    nbd_timeout: std::time::Duration,
    dead_conn_timeout: std::time::Duration,
) -> Vec<String> {
    vec![
        s(pagerctl),
        "hold-nbd".into(),
        "--state-dir".into(),
        s(state_dir),
        "--device".into(),
        s(device),
        "--plugin".into(),
        s(plugin),
        "--export".into(),
        export.to_string(),
        "--nbd-timeout".into(),
        nbd_timeout.as_secs_f64().to_string(),
        "--dead-conn-timeout".into(),
        dead_conn_timeout.as_secs_f64().to_string(),
    ]
}

/// nbdkit with the client plugin as `pagerctl hold-nbd`'s child: in the
/// foreground (the holder waits for it and starts the next), on the state
/// directory's unix socket, exiting once its last connection closes
/// (exitlast: the kernel's, after a disconnect, or after the holder shut
/// it for writing for `pagerctl restart`). A SIGTERM would make nbdkit
/// fail the requests it has read with ESHUTDOWN, errors the kernel hands
/// to the jobs; the end of the request stream lets it answer them first.
pub fn held_nbdkit_command(
    nbdkit: &Path,
    plugin: &Path,
    socket: &Path,
    state_dir: &Path,
) -> Vec<String> {
    vec![
        s(nbdkit),
        "--foreground".into(),
        "--log=stderr".into(),
        "--unix".into(),
        s(socket),
        "--filter=exitlast".into(),
        s(plugin),
        format!("state={}", state_dir.display()),
    ]
}

/// The index N of the kernel nbd device `/dev/nbdN`.
pub fn nbd_index(device: &Path) -> Result<u32, AttachError> {
    device
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("nbd"))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| AttachError::BadOption {
            option: "--device",
            reason: format!("{}: expected /dev/nbdN", device.display()),
        })
}

/// How the local kernel reaches the client's nbdkit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Via {
    /// Kernel nbd where `/dev/nbd0` exists and nbd-client is installed,
    /// nbdfuse otherwise.
    Auto,
    /// `nbd-client` and a `/dev/nbdN` device.
    NbdClient,
    /// `nbdfuse` file plus a loop device.
    Nbdfuse,
}

impl std::str::FromStr for Via {
    type Err = AttachError;
    fn from_str(s: &str) -> Result<Self, AttachError> {
        match s {
            "auto" => Ok(Via::Auto),
            "nbd-client" => Ok(Via::NbdClient),
            "nbdfuse" => Ok(Via::Nbdfuse),
            _ => Err(AttachError::BadVia(s.to_string())),
        }
    }
}

impl Via {
    /// Resolves `Auto` from what the machine has.
    pub fn resolve(self, nbd_module_loaded: bool, nbd_client_installed: bool) -> Via {
        match self {
            Via::Auto if nbd_module_loaded && nbd_client_installed => Via::NbdClient,
            Via::Auto => Via::Nbdfuse,
            v => v,
        }
    }
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// nbdkit serving the client plugin on a unix socket.
///
/// In the foreground, so that its log goes to the state directory (a
/// daemonised nbdkit sends stderr to /dev/null). Debian's nbdkit exits with
/// its parent in the foreground, and pagerctl exits right after the attach:
/// so its parent is `setsid --fork --wait`, which outlives pagerctl in a
/// session of its own and lives exactly as long as nbdkit.
pub fn nbdkit_command(
    nbdkit: &Path,
    plugin: &Path,
    socket: &Path,
    pidfile: &Path,
    state_dir: &Path,
) -> Vec<String> {
    vec![
        "setsid".into(),
        "--fork".into(),
        "--wait".into(),
        s(nbdkit),
        "--foreground".into(),
        "--log=stderr".into(),
        "--unix".into(),
        s(socket),
        "--pidfile".into(),
        s(pidfile),
        s(plugin),
        format!("state={}", state_dir.display()),
    ]
}

/// Connects a kernel nbd device to the client's unix socket
/// (`nbd-client -unix PATH DEVICE ...`, nbd-client(8) 3.24).
pub fn nbd_client_command(
    socket: &Path,
    device: &Path,
    export: &str,
    block_size: u32,
    swap: bool,
) -> Vec<String> {
    let mut c = vec![
        "nbd-client".into(),
        "-unix".into(),
        s(socket),
        s(device),
        "-name".into(),
        export.to_string(),
        "-block-size".into(),
        block_size.to_string(),
    ];
    if swap {
        // mlockall and oom-killer adjustment in nbd-client itself.
        c.push("-swap".into());
    }
    c
}

/// Disconnects a kernel nbd device.
pub fn nbd_client_disconnect(device: &Path) -> Vec<String> {
    vec!["nbd-client".into(), "-d".into(), s(device)]
}

/// Picks the first kernel nbd device not in use: `devices` are the names
/// under /sys/block (`nbd0`, `nbd1`, ...) with whether each has a `pid` file
/// (connected).
pub fn first_free_nbd(devices: &[(String, bool)]) -> Option<String> {
    let mut free: Vec<(u32, &str)> = devices
        .iter()
        .filter(|(_, connected)| !connected)
        .filter_map(|(name, _)| Some((name.strip_prefix("nbd")?.parse().ok()?, name.as_str())))
        .collect();
    free.sort();
    free.first().map(|(_, n)| format!("/dev/{n}"))
}

/// Percent-encodes everything outside RFC 3986's unreserved set and `/`.
fn uri_escape(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The NBD URI of an export on a unix socket (nbd_connect_uri(3)).
pub fn unix_uri(socket: &Path, export: &str) -> String {
    format!(
        "nbd+unix:///{}?socket={}",
        uri_escape(export),
        uri_escape(&s(socket))
    )
}

/// nbdfuse presenting the export as the regular file `file` (a FUSE mount
/// over its parent directory); nbdfuse writes `pidfile` once it serves.
pub fn nbdfuse_command(file: &Path, socket: &Path, export: &str, pidfile: &Path) -> Vec<String> {
    vec![
        "nbdfuse".into(),
        "--pidfile".into(),
        s(pidfile),
        s(file),
        unix_uri(socket, export),
    ]
}

/// Unmounts nbdfuse's mount point; nbdfuse then exits by itself.
pub fn fuse_unmount(mountpoint: &Path) -> Vec<String> {
    vec!["fusermount3".into(), "-u".into(), s(mountpoint)]
}

/// Sets up a loop device over `file` and prints its name. Direct I/O keeps
/// swapped pages out of the page cache of the FUSE file, where they would
/// take memory exactly when memory is short.
pub fn losetup_attach(file: &Path, direct_io: bool) -> Vec<String> {
    let mut c = vec!["losetup".into(), "--find".into(), "--show".into()];
    if direct_io {
        c.push("--direct-io=on".into());
    }
    c.push(s(file));
    c
}

/// Detaches a loop device.
pub fn losetup_detach(device: &Path) -> Vec<String> {
    vec!["losetup".into(), "--detach".into(), s(device)]
}

/// Writes a swap signature.
pub fn mkswap(device: &Path, label: &str) -> Vec<String> {
    vec![
        "mkswap".into(),
        "--label".into(),
        label.to_string(),
        s(device),
    ]
}

/// Enables swap on the device with the given priority (higher is used
/// first); with `discard`, the kernel trims each swap cluster it frees
/// (`--discard=pages`), so the donors free the memory behind it.
pub fn swapon(device: &Path, priority: i32, discard: bool) -> Vec<String> {
    let mut c = vec!["swapon".into(), "--priority".into(), priority.to_string()];
    if discard {
        c.push("--discard=pages".into());
    }
    c.push(s(device));
    c
}

/// Disables swap on the device (reads every swapped page back in).
pub fn swapoff(device: &Path) -> Vec<String> {
    vec!["swapoff".into(), s(device)]
}

/// The sysfs file holding how many requests a block device keeps in flight.
pub fn nr_requests_path(device: &Path) -> std::path::PathBuf {
    let name = device
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Path::new("/sys/block").join(name).join("queue/nr_requests")
}

/// Flushes a block device's buffers to its backend.
pub fn blockdev_flush(device: &Path) -> Vec<String> {
    vec!["blockdev".into(), "--flushbufs".into(), s(device)]
}

#[cfg(test)]
mod tests;
