//! What the kernel says about a device or a mount point: mounted, swap on,
//! a loop device's backing file, and who holds a device open (as fuser(1)
//! finds it), for attach, detach and the holders.

use std::path::{Path, PathBuf};

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

/// Whether swap is on for `device` (from /proc/swaps).
pub fn swap_active(device: &Path) -> bool {
    std::fs::read_to_string("/proc/swaps")
        .map(|t| {
            t.lines()
                .skip(1)
                .any(|l| l.split_whitespace().next() == Some(&*device.to_string_lossy()))
        })
        .unwrap_or(false)
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
