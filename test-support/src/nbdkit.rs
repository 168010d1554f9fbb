//! Real nbdkit servers for tests, on loopback addresses of this test
//! process's own block (127.N.x.y, [`crate::machine`]) with free ports,
//! stopped by pid when the guard drops.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static NEXT_IP: AtomicU32 = AtomicU32::new(0);

/// A loopback address of this process's block for the next donor: each
/// its own, so parallel tests never race for a port.
pub fn next_ip() -> String {
    let n = NEXT_IP.fetch_add(1, Ordering::Relaxed);
    format!(
        "127.{}.{}.{}",
        crate::machine::loopback_block(),
        1 + n / 250 % 255,
        2 + n % 250
    )
}

/// Two distinct ports free on `ip` now (held open together, so they differ).
pub fn free_ports(ip: &str) -> [u16; 2] {
    let bind = || TcpListener::bind((ip, 0)).expect("bind a free port");
    let held = [bind(), bind()];
    held.map(|l| l.local_addr().expect("bound").port())
}

/// The user name of [`Nbdkit::memory_tls`]'s key.
pub const PSK_USER: &str = "alice";

/// An nbdkit process started by a test; killed (by pid) when dropped.
pub struct Nbdkit {
    child: Child,
    pub addr: String,
    /// Status endpoint (pager-server donors).
    pub status: Option<String>,
    stopped: bool,
    dir: tempfile::TempDir,
}

impl Nbdkit {
    pub fn start(plugin_args: &[String], status_port: bool) -> Nbdkit {
        Nbdkit::start_on(&next_ip(), plugin_args, status_port)
    }

    /// [`Nbdkit::start`] on loopback address `ip` (127.0.0.1: a donor
    /// that `localhost` reaches too).
    pub fn start_on(ip: &str, plugin_args: &[String], status_port: bool) -> Nbdkit {
        let [port, status] = free_ports(ip);
        Nbdkit::start_at(ip, port, plugin_args, status_port.then_some(status))
    }

    fn start_at(ip: &str, port: u16, plugin_args: &[String], status_port: Option<u16>) -> Nbdkit {
        let listen = [
            "-i".into(),
            ip.to_string(),
            "--port".into(),
            port.to_string(),
        ];
        let status = status_port.map(|p| format!("{ip}:{p}"));
        Nbdkit::spawn(&listen, format!("{ip}:{port}"), plugin_args, status)
    }

    /// `nbdkit` on the unix socket `path` with `plugin_args`.
    pub fn unix(path: &std::path::Path, plugin_args: &[&str]) -> Nbdkit {
        let listen = ["-U".into(), path.display().to_string()];
        let args: Vec<String> = plugin_args.iter().map(|s| s.to_string()).collect();
        Nbdkit::spawn(&listen, path.display().to_string(), &args, None)
    }

    fn spawn(
        listen: &[String],
        addr: String,
        plugin_args: &[String],
        status: Option<String>,
    ) -> Nbdkit {
        let dir = tempfile::tempdir().expect("temporary directory");
        let pidfile = dir.path().join("nbdkit.pid");
        let log = std::fs::File::create(dir.path().join("nbdkit.log")).expect("nbdkit log file");
        let mut args: Vec<String> = vec!["-f".into()];
        args.extend(listen.iter().cloned());
        args.push("--pidfile".into());
        args.push(pidfile.display().to_string());
        args.extend(plugin_args.iter().cloned());
        if let Some(s) = &status {
            args.push(format!("status={s}"));
        }
        let child = Command::new("nbdkit")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nbdkit");
        let mut n = Nbdkit {
            child,
            addr,
            status,
            stopped: false,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !pidfile.exists() {
            if let Ok(Some(st)) = n.child.try_wait() {
                panic!("nbdkit {args:?} exited at start: {st}");
            }
            assert!(Instant::now() < deadline, "nbdkit {args:?} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        n
    }

    /// `nbdkit memory SIZE`: a donor without a status endpoint.
    pub fn memory(size: &str) -> Nbdkit {
        Nbdkit::start(&["memory".into(), size.into()], false)
    }

    /// `nbdkit` with extra server options before the plugin (e.g. TLS).
    pub fn with_args(args: &[&str]) -> Nbdkit {
        Nbdkit::start(
            &args.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            false,
        )
    }

    /// A fresh, empty `nbdkit memory SIZE` at `addr` (a donor coming back).
    pub fn memory_at(addr: &str, size: &str) -> Nbdkit {
        let (ip, port) = addr.rsplit_once(':').expect("host:port");
        Nbdkit::start_at(
            ip,
            port.parse().expect("port"),
            &["memory".into(), size.into()],
            None,
        )
    }

    /// How the process ended, if it has (a donor that aborted).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("wait for nbdkit")
    }

    /// What nbdkit and its plugin wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nbdkit.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill {sig} {}", self.pid());
    }

    /// kill -9, as a crash.
    pub fn kill9(&mut self) {
        self.signal("-KILL");
        let _ = self.child.wait();
    }

    /// SIGSTOP: the donor hangs without closing its connections. Returns
    /// once the kernel shows the process stopped.
    pub fn stop(&mut self) {
        self.signal("-STOP");
        self.stopped = true;
        let tasks = format!("/proc/{}/task", self.pid());
        let stopped = |stat: PathBuf| {
            // The state follows the parenthesised command name.
            std::fs::read_to_string(stat)
                .unwrap_or_default()
                .rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T'))
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let all = std::fs::read_dir(&tasks)
                .map(|d| d.flatten().all(|t| stopped(t.path().join("stat"))))
                .unwrap_or(false);
            if all {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nbdkit {} did not stop",
                self.pid()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Nbdkit {
    /// `nbdkit memory SIZE` requiring TLS with a pre-shared key for user
    /// [`PSK_USER`], whose key file it writes into `dir`; returns the file.
    pub fn memory_tls(size: &str, dir: &std::path::Path) -> (Nbdkit, PathBuf) {
        let psk = dir.join("keys.psk");
        std::fs::write(
            &psk,
            format!(
                "{PSK_USER}:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n"
            ),
        )
        .expect("write the PSK file");
        let psk_arg = format!("--tls-psk={}", psk.display());
        let d = Nbdkit::with_args(&["--tls=require", &psk_arg, "memory", size]);
        (d, psk)
    }

    /// SIGCONT after [`Nbdkit::stop`].
    pub fn cont(&mut self) {
        self.signal("-CONT");
        self.stopped = false;
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        if self.stopped {
            let _ = Command::new("kill")
                .args(["-CONT", &self.pid().to_string()])
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
