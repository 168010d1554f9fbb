//! `attach.json`: the steps an attach did, so that `detach` undoes exactly
//! those, in reverse, and a failed attach rolls back what it had done.
//!
//! The record is rewritten after every step (and after every undo), so a
//! crash in the middle of either leaves a record that is still true.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{commands, AttachError, Frontend, Via};

/// Where things live in a client's state directory.
#[derive(Debug, Clone)]
pub struct StateLayout {
    pub dir: PathBuf,
}

/// Longest unix socket path Linux accepts (sun_path minus the final NUL).
pub const MAX_SOCKET_PATH: usize = 107;

impl StateLayout {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        StateLayout { dir: dir.into() }
    }
    /// The device's configuration (pager_client::config).
    pub fn device_toml(&self) -> PathBuf {
        self.dir.join("device.toml")
    }
    /// The steps done by the last attach.
    pub fn attach_json(&self) -> PathBuf {
        self.dir.join("attach.json")
    }
    /// Status the device writes while it runs (pager_client::status).
    pub fn status_json(&self) -> PathBuf {
        self.dir.join("status.json")
    }
    /// The client's nbdkit listens here.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }
    pub fn nbdkit_pidfile(&self) -> PathBuf {
        self.dir.join("nbdkit.pid")
    }
    pub fn nbdkit_log(&self) -> PathBuf {
        self.dir.join("nbdkit.log")
    }
    /// nbdfuse mounts over this directory...
    pub fn fuse_dir(&self) -> PathBuf {
        self.dir.join("fuse")
    }
    /// ...and presents the device as this file in it.
    pub fn fuse_file(&self) -> PathBuf {
        self.fuse_dir().join("device")
    }
    pub fn nbdfuse_pidfile(&self) -> PathBuf {
        self.dir.join("nbdfuse.pid")
    }
    pub fn nbdfuse_log(&self) -> PathBuf {
        self.dir.join("nbdfuse.log")
    }
    /// What `pagerctl serve` says while it serves ([`ServeInfo`]).
    pub fn serve_json(&self) -> PathBuf {
        self.dir.join("serve.json")
    }
    pub fn serve_log(&self) -> PathBuf {
        self.dir.join("serve.log")
    }
    /// What the holder of a restartable device's FUSE connection says
    /// ([`HolderInfo`]).
    pub fn holder_json(&self) -> PathBuf {
        self.dir.join("holder.json")
    }
    /// The holder hands the connection to serving processes here.
    pub fn holder_socket(&self) -> PathBuf {
        self.dir.join("holder.sock")
    }
    /// The socket path, refused when the kernel could not bind it.
    pub fn checked_socket(&self) -> Result<PathBuf, String> {
        let sock = self.socket();
        let len = sock.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(format!(
                "unix socket path {} is {len} bytes, more than the {MAX_SOCKET_PATH} Linux allows: use a shorter --state-dir",
                sock.display()
            ));
        }
        Ok(sock)
    }
}

/// One step of an attach, with what is needed to undo it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "step", rename_all = "kebab-case")]
pub enum Step {
    /// nbdkit serving the client plugin; `started` is its start time in
    /// clock ticks since boot, so a reused pid is never signalled. The
    /// keeper is its parent `setsid --fork --wait`, gone once nbdkit is.
    Nbdkit {
        pid: u32,
        started: u64,
        keeper_pid: u32,
        keeper_started: u64,
        socket: PathBuf,
        pidfile: PathBuf,
    },
    /// A kernel nbd device connected by nbd-client.
    NbdClient { device: PathBuf },
    /// nbdfuse presenting the export as `file` under `mountpoint`.
    Nbdfuse {
        pid: u32,
        started: u64,
        mountpoint: PathBuf,
        file: PathBuf,
        pidfile: PathBuf,
    },
    /// `pagerctl serve` serving the device as `file` on its own FUSE
    /// mount over `mountpoint`, over `transport` (fuse-uring or fuse).
    /// `restartable`: `pid` is the holder (`pagerctl hold`), which keeps
    /// the connection and starts serving processes one after another.
    FuseServer {
        pid: u32,
        started: u64,
        mountpoint: PathBuf,
        file: PathBuf,
        transport: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        restartable: bool,
    },
    /// A restartable kernel nbd device: `pagerctl hold-nbd` (`pid`) runs
    /// nbdkit and reconnects `device` to each new one.
    NbdHolder {
        pid: u32,
        started: u64,
        device: PathBuf,
    },
    /// The kernel's FUSE over io_uring switch, turned on from `old`.
    UringSwitch { path: PathBuf, old: String },
    /// A loop device over the FUSE file.
    LoopDevice { device: PathBuf, file: PathBuf },
    /// The device's request queue shortened from `old` to `new` requests.
    QueueDepth { device: PathBuf, old: u32, new: u32 },
    /// Swap enabled on the device.
    Swap { device: PathBuf, priority: i32 },
}

impl Step {
    /// The command that undoes this step, if a command does; nbdkit is
    /// stopped by signalling its pid (after a flush) and the queue depth is
    /// written back to sysfs instead.
    pub fn undo_command(&self) -> Option<Vec<String>> {
        match self {
            Step::Nbdkit { .. }
            | Step::QueueDepth { .. }
            | Step::FuseServer { .. }
            | Step::NbdHolder { .. }
            | Step::UringSwitch { .. } => None,
            Step::NbdClient { device } => Some(commands::nbd_client_disconnect(device)),
            Step::Nbdfuse { mountpoint, .. } => Some(commands::fuse_unmount(mountpoint)),
            Step::LoopDevice { device, .. } => Some(commands::losetup_detach(device)),
            Step::Swap { device, .. } => Some(commands::swapoff(device)),
        }
    }

    /// The process this step started (pid, start time) that must be gone
    /// once the step is undone.
    pub fn process(&self) -> Option<(u32, u64)> {
        match self {
            Step::Nbdkit { pid, started, .. }
            | Step::Nbdfuse { pid, started, .. }
            | Step::FuseServer { pid, started, .. }
            | Step::NbdHolder { pid, started, .. } => Some((*pid, *started)),
            _ => None,
        }
    }

    /// One line for humans.
    pub fn describe(&self) -> String {
        match self {
            Step::Nbdkit { pid, socket, .. } => format!("nbdkit pid {pid} on {}", socket.display()),
            Step::NbdClient { device } => format!("kernel nbd {}", device.display()),
            Step::Nbdfuse { pid, file, .. } => {
                format!("nbdfuse pid {pid} serving {}", file.display())
            }
            Step::FuseServer {
                pid,
                file,
                transport,
                restartable: false,
                ..
            } => format!(
                "pagerctl serve pid {pid} serving {} over {transport}",
                file.display()
            ),
            Step::FuseServer {
                pid,
                file,
                transport,
                restartable: true,
                ..
            } => format!(
                "pagerctl hold pid {pid} keeping the connection of {} (restartable, {transport})",
                file.display()
            ),
            Step::NbdHolder { pid, device, .. } => format!(
                "pagerctl hold-nbd pid {pid} keeping kernel nbd {} (restartable)",
                device.display()
            ),
            Step::UringSwitch { path, old } => {
                format!("{} turned on (was {old})", path.display())
            }
            Step::LoopDevice { device, file } => {
                format!("loop {} over {}", device.display(), file.display())
            }
            Step::QueueDepth { device, old, new } => {
                format!(
                    "queue of {} at {new} requests (was {old})",
                    device.display()
                )
            }
            Step::Swap { device, priority } => {
                format!("swap on {} priority {priority}", device.display())
            }
        }
    }
}

/// The content of `serve.json`, written by `pagerctl serve` once it serves
/// and removed when it stops.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ServeInfo {
    pub pid: u32,
    /// fuse-uring or fuse.
    pub transport: String,
    /// Why io_uring was wanted but not used.
    pub fallback: Option<String>,
}

impl ServeInfo {
    pub fn load(path: &Path) -> Option<ServeInfo> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }

    pub fn save(&self, path: &Path) -> Result<(), AttachError> {
        save_json(self, path)
    }
}

/// The content of `holder.json`, written by the holder of a restartable
/// device (`pagerctl hold`, `pagerctl hold-nbd`) and removed when it exits.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HolderInfo {
    pub pid: u32,
    /// Start time in clock ticks since boot.
    pub started: u64,
    /// The serving process now, if one runs.
    pub serve_pid: Option<u32>,
    /// The last serving process that said it serves (took the connection,
    /// asked for the resend).
    pub ready_pid: Option<u32>,
    /// The pagerctl the next serving process runs (kernel nbd: the client
    /// plugin the next nbdkit loads).
    pub binary: PathBuf,
    /// Serving processes started after the first.
    pub restarts: u32,
    /// Of those, how many followed a serving process that died (the others
    /// were asked to hand over: pagerctl restart).
    pub crashes: u32,
    /// How long the kernel's requests waited at the last restart: from the
    /// old process's end (or its hand-over) to the new one serving.
    pub last_held_ms: Option<u64>,
    /// Requests the newest serving process answered that a dead one had
    /// read and left unanswered (FUSE_NOTIFY_RESEND).
    pub resent_last: u64,
    /// The same over every restart.
    pub resent_total: u64,
    /// The serving process's start time (clock ticks since boot), so that
    /// a detach after the holder died stops only that process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serve_started: Option<u64>,
    /// Kernel nbd: times the dead-conn timeout passed with no serving
    /// process, the kernel failing the device's requests meanwhile.
    #[serde(default)]
    pub expired: u32,
    /// Kernel nbd: serving processes killed because the kernel had given
    /// up on their connection (`NBD_CMD_LINK_DEAD`: a stall past the
    /// request timeout).
    #[serde(default)]
    pub link_dead: u32,
    /// Kernel nbd: serving processes killed because the kernel refused
    /// their socket (`NBD_CMD_RECONFIGURE`).
    #[serde(default)]
    pub refused: u32,
}

impl HolderInfo {
    pub fn load(path: &Path) -> Option<HolderInfo> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }

    pub fn save(&self, path: &Path) -> Result<(), AttachError> {
        save_json(self, path)
    }
}

/// Writes `value` as JSON atomically (temporary file, fsync, rename), so a
/// crash leaves the old file or the new one.
fn save_json(value: &impl serde::Serialize, path: &Path) -> Result<(), AttachError> {
    let err = |source| AttachError::WriteRecord {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    let text = serde_json::to_vec_pretty(value).expect("plain data serialises");
    f.write_all(&text)
        .and_then(|_| f.write_all(b"\n"))
        .and_then(|_| f.sync_all())
        .map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// The content of `attach.json`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AttachRecord {
    /// How the kernel reaches the device (never `auto` once resolved);
    /// records written before the FUSE front end were all nbd.
    #[serde(default = "nbd_frontend")]
    pub frontend: Frontend,
    /// With the nbd front end: how the kernel reaches nbdkit (never `auto`
    /// once resolved).
    pub via: Via,
    /// NBD export name the kernel side asked for.
    pub export: String,
    /// Steps done, in order.
    pub steps: Vec<Step>,
}

fn nbd_frontend() -> Frontend {
    Frontend::Nbd
}

impl AttachRecord {
    pub fn new(frontend: Frontend, via: Via, export: &str) -> Self {
        AttachRecord {
            frontend,
            via,
            export: export.to_string(),
            steps: Vec::new(),
        }
    }

    /// The block device the attach produced (kernel nbd or loop), if any.
    pub fn device(&self) -> Option<&Path> {
        self.steps.iter().rev().find_map(|s| match s {
            Step::NbdClient { device }
            | Step::NbdHolder { device, .. }
            | Step::LoopDevice { device, .. } => Some(device.as_path()),
            _ => None,
        })
    }

    /// The holder of a restartable device (`pagerctl hold` or `pagerctl
    /// hold-nbd`) as (pid, start time), if it was attached so.
    pub fn holder(&self) -> Option<(u32, u64)> {
        self.steps.iter().find_map(|s| match s {
            Step::FuseServer {
                pid,
                started,
                restartable: true,
                ..
            }
            | Step::NbdHolder { pid, started, .. } => Some((*pid, *started)),
            _ => None,
        })
    }

    /// Whether swap was enabled on the device.
    pub fn swapping(&self) -> bool {
        self.steps.iter().any(|s| matches!(s, Step::Swap { .. }))
    }

    /// The process serving the device (the client's nbdkit, `pagerctl
    /// serve`, or a restartable device's holder) as (pid, start time), if
    /// started.
    pub fn server_process(&self) -> Option<(u32, u64)> {
        self.steps
            .iter()
            .find(|s| {
                matches!(
                    s,
                    Step::Nbdkit { .. } | Step::FuseServer { .. } | Step::NbdHolder { .. }
                )
            })
            .and_then(Step::process)
    }

    /// Reads a record; `Ok(None)` when there is none.
    pub fn load(path: &Path) -> Result<Option<Self>, AttachError> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|source| {
                AttachError::ParseRecord {
                    path: path.to_path_buf(),
                    source,
                }
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(AttachError::ReadRecord {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Writes the record atomically.
    pub fn save(&self, path: &Path) -> Result<(), AttachError> {
        save_json(self, path)
    }
}

/// How the kernel reaches the device in `dir`, as attach.json and
/// serve.json record it.
pub fn frontend_info(layout: &StateLayout) -> pager_client::metrics::FrontendInfo {
    let record = AttachRecord::load(&layout.attach_json()).ok().flatten();
    let serve = ServeInfo::load(&layout.serve_json());
    pager_client::metrics::FrontendInfo {
        frontend: record.map(|r| r.frontend.to_string()).unwrap_or_default(),
        transport: serve.as_ref().map(|s| s.transport.clone()),
        fallback: serve.and_then(|s| s.fallback),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AttachRecord {
        let l = StateLayout::new("/st");
        let mut r = AttachRecord::new(Frontend::Nbd, Via::Nbdfuse, "pager");
        r.steps.push(Step::Nbdkit {
            pid: 10,
            started: 100,
            keeper_pid: 9,
            keeper_started: 99,
            socket: l.socket(),
            pidfile: l.nbdkit_pidfile(),
        });
        r.steps.push(Step::Nbdfuse {
            pid: 11,
            started: 101,
            mountpoint: l.fuse_dir(),
            file: l.fuse_file(),
            pidfile: l.nbdfuse_pidfile(),
        });
        r.steps.push(Step::LoopDevice {
            device: "/dev/loop7".into(),
            file: l.fuse_file(),
        });
        r.steps.push(Step::QueueDepth {
            device: "/dev/loop7".into(),
            old: 128,
            new: 16,
        });
        r.steps.push(Step::Swap {
            device: "/dev/loop7".into(),
            priority: 100,
        });
        r
    }

    #[test]
    fn a_record_from_before_the_fuse_front_end_is_nbd() {
        let old = r#"{"via":"nbdfuse","export":"pager","steps":[]}"#;
        let r: AttachRecord = serde_json::from_str(old).unwrap();
        assert_eq!(r.frontend, Frontend::Nbd);
        let mut r = AttachRecord::new(Frontend::FuseUring, Via::Nbdfuse, "pager");
        let l = StateLayout::new("/st");
        r.steps.push(Step::FuseServer {
            pid: 5,
            started: 50,
            mountpoint: l.fuse_dir(),
            file: l.fuse_file(),
            transport: "fuse-uring".into(),
            restartable: false,
        });
        // Written before restartable devices: the field is absent.
        assert!(!serde_json::to_string(&r).unwrap().contains("restartable"));
        let back: AttachRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.steps[0].process(), Some((5, 50)));
        assert!(back.steps[0].undo_command().is_none());
    }

    #[test]
    fn a_restartable_kernel_nbd_device_is_its_holder() {
        let mut r = AttachRecord::new(Frontend::Nbd, Via::NbdClient, "pager");
        assert_eq!(r.holder(), None);
        r.steps.push(Step::NbdHolder {
            pid: 7,
            started: 70,
            device: "/dev/nbd3".into(),
        });
        r.steps.push(Step::Swap {
            device: "/dev/nbd3".into(),
            priority: 100,
        });
        let back: AttachRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.holder(), Some((7, 70)));
        assert_eq!(back.server_process(), Some((7, 70)));
        assert_eq!(back.device(), Some(Path::new("/dev/nbd3")));
        assert!(back.steps[0].undo_command().is_none());
        assert!(back.steps[0].describe().contains("hold-nbd pid 7"));
        // A holder.json from before kernel nbd holders reads as none expired.
        let h: HolderInfo = serde_json::from_str(
            r#"{"pid":1,"started":2,"serve_pid":null,"ready_pid":null,"binary":"/b","restarts":0,"crashes":0,"last_held_ms":null,"resent_last":0,"resent_total":0}"#,
        )
        .unwrap();
        assert_eq!((h.expired, h.serve_started), (0, None));
    }

    #[test]
    fn undo_plan_reverses_the_steps() {
        let r = sample();
        let undo: Vec<_> = r
            .steps
            .iter()
            .rev()
            .map(|s| (s.undo_command(), s.process()))
            .collect();
        assert_eq!(
            undo,
            vec![
                (Some(vec!["swapoff".to_string(), "/dev/loop7".into()]), None),
                (None, None),
                (
                    Some(vec![
                        "losetup".to_string(),
                        "--detach".into(),
                        "/dev/loop7".into()
                    ]),
                    None
                ),
                (
                    Some(vec![
                        "fusermount3".to_string(),
                        "-u".into(),
                        "/st/fuse".into()
                    ]),
                    Some((11, 101))
                ),
                (None, Some((10, 100))),
            ]
        );
        assert_eq!(
            Step::NbdClient {
                device: "/dev/nbd1".into()
            }
            .undo_command()
            .unwrap(),
            ["nbd-client", "-d", "/dev/nbd1"]
        );
    }

    #[test]
    fn record_answers_what_is_attached() {
        let r = sample();
        assert_eq!(r.device(), Some(Path::new("/dev/loop7")));
        assert!(r.swapping());
        assert_eq!(r.server_process(), Some((10, 100)));
        let empty = AttachRecord::new(Frontend::Nbd, Via::NbdClient, "x");
        assert_eq!(empty.device(), None);
        assert!(!empty.swapping());
    }

    #[test]
    fn record_round_trips_through_its_file() {
        let dir = std::env::temp_dir().join(format!("pager-attach-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("attach.json");
        assert_eq!(AttachRecord::load(&path).unwrap(), None);
        sample().save(&path).unwrap();
        assert_eq!(AttachRecord::load(&path).unwrap(), Some(sample()));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"step\": \"loop-device\""), "{text}");
        std::fs::write(&path, "{").unwrap();
        let e = AttachRecord::load(&path).unwrap_err().to_string();
        assert!(e.contains("attach.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn overlong_socket_paths_are_refused() {
        assert!(StateLayout::new("/var/lib/netpager")
            .checked_socket()
            .is_ok());
        let long = format!("/tmp/{}", "x".repeat(120));
        let e = StateLayout::new(long).checked_socket().unwrap_err();
        assert!(e.contains("shorter --state-dir"), "{e}");
    }
}
