//! What the kernel says is set up: mount points (`/proc/self/mountinfo`),
//! active swap (`/proc/swaps`), loop devices' backing files and free nbd
//! devices (`/sys/block`).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use pagerctl::attach::commands;

pub fn free_nbd_device() -> Result<PathBuf> {
    let mut devs = Vec::new();
    for entry in std::fs::read_dir("/sys/block").context("cannot list /sys/block")? {
        let entry = entry.context("cannot list /sys/block")?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("nbd") {
            let connected = entry.path().join("pid").exists();
            devs.push((name, connected));
        }
    }
    if devs.is_empty() {
        bail!("no kernel nbd devices (/sys/block/nbdN): load the nbd module (modprobe nbd) or use --via nbdfuse");
    }
    commands::first_free_nbd(&devs)
        .map(PathBuf::from)
        .ok_or_else(|| {
            anyhow!(
                "no free /dev/nbdN: all {} kernel nbd devices are connected",
                devs.len()
            )
        })
}

/// Whether `path` is a mount point (from /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let target = path.to_string_lossy();
    // Field 5 is the mount point, with spaces etc. octal-escaped.
    info.lines().any(|l| {
        l.split(' ')
            .nth(4)
            .is_some_and(|m| unescape_mountinfo(m) == target)
    })
}

fn unescape_mountinfo(field: &str) -> String {
    let mut out = Vec::new();
    let b = field.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push(u8::from_str_radix(&field[i + 1..i + 4], 8).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The processes using something under `mountpoint` (their working or
/// root directory, or an open file), as "COMMAND (pid N)".
pub fn mount_users(mountpoint: &Path) -> Vec<String> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let inside = |link: PathBuf| std::fs::read_link(link).is_ok_and(|t| t.starts_with(mountpoint));
    procs
        .flatten()
        .filter(|p| p.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|p| {
            let dir = p.path();
            inside(dir.join("cwd"))
                || inside(dir.join("root"))
                || std::fs::read_dir(dir.join("fd"))
                    .map(|fds| fds.flatten().any(|fd| inside(fd.path())))
                    .unwrap_or(false)
        })
        .map(|p| {
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            format!("{} (pid {})", comm.trim(), p.file_name().to_string_lossy())
        })
        .collect()
}

/// Whether swap is on for `device` (from /proc/swaps).
pub fn swap_active(device: &Path) -> bool {
    swap_used(device).is_some()
}

/// KiB of swap in use on `device`, if swap is on there (from /proc/swaps:
/// name, type, size, used, priority).
pub fn swap_used(device: &Path) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/swaps").ok()?;
    let name = device.to_string_lossy();
    text.lines().skip(1).find_map(|l| {
        let mut f = l.split_whitespace();
        if f.next() != Some(&*name) {
            return None;
        }
        Some(f.nth(2).and_then(|u| u.parse().ok()).unwrap_or(0))
    })
}

/// The file a loop device is backed by, if it is set up.
pub fn loop_backing(device: &Path) -> Option<PathBuf> {
    let name = device.file_name()?.to_string_lossy().into_owned();
    let text = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(text.trim_end()))
}

/// Who keeps `device` busy, in words: processes with it open (their pid
/// and name; found through /proc/PID/fd, as fuser(1) does), mount points
/// of file systems on it, and swap on it. This process is left out.
pub fn holders(device: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let me = std::process::id().to_string();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            let pid = p.file_name().to_string_lossy().into_owned();
            if !pid.bytes().all(|b| b.is_ascii_digit()) || pid == me {
                continue;
            }
            let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
                continue;
            };
            if fds
                .flatten()
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == device))
            {
                let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
                out.push(format!("pid {pid} ({}) has it open", comm.trim()));
            }
        }
    }
    if let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") {
        let dev = device.to_string_lossy();
        for l in info.lines() {
            // Fields after " - ": type, source, options.
            let source = l.split(" - ").nth(1).and_then(|t| t.split(' ').nth(1));
            if source == Some(&*dev) {
                if let Some(m) = l.split(' ').nth(4) {
                    out.push(format!("mounted on {}", unescape_mountinfo(m)));
                }
            }
        }
    }
    if swap_active(device) {
        out.push("swap is on on it".into());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_with_a_directory_open_uses_its_mount() {
        let dir = std::env::temp_dir().join(format!("np-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let me = format!("(pid {})", std::process::id());
        assert!(!mount_users(&dir).iter().any(|u| u.ends_with(&me)));
        let open = std::fs::File::open(&dir).unwrap();
        assert!(mount_users(&dir).iter().any(|u| u.ends_with(&me)));
        drop(open);
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/tmp/a\\040b"), "/tmp/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/end\\04"), "/end\\04");
    }

    #[test]
    fn a_file_held_open_is_found_with_its_process() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("dev");
        std::fs::write(&f, b"x").unwrap();
        assert_eq!(holders(&f), Vec::<String>::new());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::fs::File::open(&f).unwrap())
            .spawn()
            .unwrap();
        let found = holders(&f);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found, [format!("pid {} (sleep) has it open", child.id())]);
    }
}
