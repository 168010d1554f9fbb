use super::*;
use std::path::PathBuf;

fn p(x: &str) -> PathBuf {
    PathBuf::from(x)
}

#[test]
fn a_swap_device_is_restartable_unless_asked_or_its_front_end_cannot() {
    let r = |f: Frontend, asked, swap| f.resolve_attach(asked, swap, true, true, true);
    let served = |s: Served| (s.frontend, s.restartable, s.not_restartable.is_some());
    // The default: swap is restartable (classic FUSE), a block device not.
    assert_eq!(
        served(r(Frontend::Auto, None, true).unwrap()),
        (Frontend::Fuse, true, false)
    );
    assert_eq!(
        served(r(Frontend::Fuse, None, true).unwrap()),
        (Frontend::Fuse, true, false)
    );
    assert_eq!(
        served(r(Frontend::Auto, None, false).unwrap()),
        (Frontend::FuseUring, false, false)
    );
    // --no-restartable asks for the last 10%: fuse-uring where it exists.
    assert_eq!(
        served(r(Frontend::Auto, Some(false), true).unwrap()),
        (Frontend::FuseUring, false, false)
    );
    // A front end that cannot restart stays as asked, and says so.
    let s = r(Frontend::FuseUring, None, true).unwrap();
    assert_eq!(served(s), (Frontend::FuseUring, false, true));
    assert!(s.not_restartable.unwrap().contains("io_uring"));
    let s = r(Frontend::Nbd, None, true).unwrap();
    assert_eq!(served(s), (Frontend::Nbd, false, true));
    // Asked for, it is refused where it cannot be.
    assert!(r(Frontend::FuseUring, Some(true), true).is_err());
    assert!(Frontend::Nbd
        .resolve_attach(Some(true), true, true, false, true)
        .is_err());
    // Without nbd-client, plain nbd goes through nbdfuse: auto is fuse.
    assert_eq!(
        Frontend::Auto
            .resolve_attach(None, false, false, true, false)
            .unwrap()
            .frontend,
        Frontend::Fuse
    );
}

#[test]
fn frontend_auto_prefers_io_uring_then_kernel_nbd() {
    assert_eq!(Frontend::Auto.resolve(true, true), Frontend::FuseUring);
    assert_eq!(Frontend::Auto.resolve(false, true), Frontend::Nbd);
    assert_eq!(Frontend::Auto.resolve(false, false), Frontend::Fuse);
    assert_eq!(Frontend::Fuse.resolve(true, true), Frontend::Fuse);
    let r = |f: Frontend, on| f.resolve_restartable(on, true, true);
    assert_eq!(r(Frontend::Auto, true).unwrap(), Frontend::Fuse);
    assert_eq!(r(Frontend::Fuse, true).unwrap(), Frontend::Fuse);
    assert!(r(Frontend::FuseUring, true).is_err());
    // Kernel nbd reconnects; without it nbd cannot be restartable.
    assert_eq!(r(Frontend::Nbd, true).unwrap(), Frontend::Nbd);
    let e = Frontend::Nbd
        .resolve_restartable(true, true, false)
        .unwrap_err();
    assert!(e.to_string().contains("modprobe nbd"), "{e}");
    // auto stays fuse with --restartable, kernel nbd or not.
    assert_eq!(
        Frontend::Auto
            .resolve_restartable(true, false, true)
            .unwrap(),
        Frontend::Fuse
    );
    assert_eq!(r(Frontend::Auto, false).unwrap(), Frontend::FuseUring);
    let serve = ServeOptions {
        threads: 2,
        writeback: "1M".into(),
        ack_late: false,
    };
    assert_eq!(
        held_serve_command(&p("/bin/pagerctl"), &p("/st"), &serve)[5..],
        [
            "fuse",
            "--threads",
            "2",
            "--writeback-buffer",
            "1M",
            "--held"
        ]
    );
    assert_eq!(
        hold_command(&p("/bin/pagerctl"), &p("/st"), &serve)[1..],
        [
            "hold",
            "--state-dir",
            "/st",
            "--threads",
            "2",
            "--writeback-buffer",
            "1M"
        ]
    );
    for f in ["auto", "fuse-uring", "fuse", "nbd"] {
        assert_eq!(f.parse::<Frontend>().unwrap().to_string(), f);
    }
    assert!("uring".parse::<Frontend>().is_err());
    assert_eq!(
        serve_command(&p("/bin/pagerctl"), &p("/st"), Frontend::FuseUring),
        [
            "/bin/pagerctl",
            "serve",
            "--state-dir",
            "/st",
            "--transport",
            "fuse-uring"
        ]
    );
}

#[test]
fn the_nbd_holder_runs_nbdkit_in_the_foreground_on_the_state_socket() {
    assert_eq!(
        hold_nbd_command(
            &p("/bin/pagerctl"),
            &p("/st"),
            &p("/dev/nbd2"),
            &p("/lib/plugin.so"),
            "c1",
            std::time::Duration::from_secs(10),
            std::time::Duration::from_secs(120),
        )[1..],
        [
            "hold-nbd",
            "--state-dir",
            "/st",
            "--device",
            "/dev/nbd2",
            "--plugin",
            "/lib/plugin.so",
            "--export",
            "c1",
            "--nbd-timeout",
            "10",
            "--dead-conn-timeout",
            "120"
        ]
    );
    assert_eq!(
        held_nbdkit_command(
            &p("nbdkit"),
            &p("/lib/plugin.so"),
            &p("/st/sock"),
            &p("/st")
        ),
        [
            "nbdkit",
            "--foreground",
            "--log=stderr",
            "--unix",
            "/st/sock",
            "--filter=exitlast",
            "/lib/plugin.so",
            "state=/st"
        ]
    );
    assert_eq!(nbd_index(&p("/dev/nbd12")).unwrap(), 12);
    assert!(nbd_index(&p("/dev/loop0")).is_err());
    assert!(nbd_index(&p("/dev/nbd")).is_err());
}

#[test]
fn nbd_client_line_follows_nbd_client_3_24() {
    assert_eq!(
        nbd_client_command(&p("/var/lib/np/sock"), &p("/dev/nbd3"), "pager", 4096, true),
        [
            "nbd-client",
            "-unix",
            "/var/lib/np/sock",
            "/dev/nbd3",
            "-name",
            "pager",
            "-block-size",
            "4096",
            "-swap"
        ]
    );
    assert_eq!(
        nbd_client_command(&p("/s"), &p("/dev/nbd0"), "", 512, false),
        [
            "nbd-client",
            "-unix",
            "/s",
            "/dev/nbd0",
            "-name",
            "",
            "-block-size",
            "512"
        ]
    );
    assert_eq!(
        nbd_client_disconnect(&p("/dev/nbd3")),
        ["nbd-client", "-d", "/dev/nbd3"]
    );
}

#[test]
fn free_nbd_device_is_the_lowest_unconnected() {
    let devs = |v: &[(&str, bool)]| {
        v.iter()
            .map(|(n, c)| (n.to_string(), *c))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        first_free_nbd(&devs(&[
            ("nbd10", false),
            ("nbd0", true),
            ("nbd2", false),
            ("loop0", false)
        ])),
        Some("/dev/nbd2".into())
    );
    assert_eq!(first_free_nbd(&devs(&[("nbd0", true)])), None);
    assert_eq!(first_free_nbd(&[]), None);
}

#[test]
fn via_auto_prefers_the_kernel_module() {
    assert_eq!(Via::Auto.resolve(true, true), Via::NbdClient);
    assert_eq!(Via::Auto.resolve(false, true), Via::Nbdfuse);
    assert_eq!(Via::Auto.resolve(true, false), Via::Nbdfuse);
    assert_eq!(Via::NbdClient.resolve(false, false), Via::NbdClient);
    assert_eq!("nbdfuse".parse::<Via>().unwrap(), Via::Nbdfuse);
    assert!("fuse".parse::<Via>().is_err());
}

#[test]
fn nbdfuse_and_loop_lines() {
    assert_eq!(
        nbdfuse_command(
            &p("/st/fuse/device"),
            &p("/st/nbd.sock"),
            "pager",
            &p("/st/nbdfuse.pid")
        ),
        [
            "nbdfuse",
            "--pidfile",
            "/st/nbdfuse.pid",
            "/st/fuse/device",
            "nbd+unix:///pager?socket=/st/nbd.sock"
        ]
    );
    assert_eq!(
        fuse_unmount(&p("/st/fuse")),
        ["fusermount3", "-u", "/st/fuse"]
    );
    assert_eq!(
        losetup_attach(&p("/st/fuse/device"), true),
        [
            "losetup",
            "--find",
            "--show",
            "--direct-io=on",
            "/st/fuse/device"
        ]
    );
    assert_eq!(
        losetup_attach(&p("/f"), false),
        ["losetup", "--find", "--show", "/f"]
    );
    assert_eq!(
        losetup_detach(&p("/dev/loop4")),
        ["losetup", "--detach", "/dev/loop4"]
    );
}

#[test]
fn uri_escapes_odd_paths() {
    assert_eq!(
        unix_uri(&p("/tmp/a b?c.sock"), "x/y"),
        "nbd+unix:///x/y?socket=/tmp/a%20b%3Fc.sock"
    );
}

#[test]
fn swap_lines() {
    assert_eq!(
        mkswap(&p("/dev/loop4"), "netpager"),
        ["mkswap", "--label", "netpager", "/dev/loop4"]
    );
    assert_eq!(
        swapon(&p("/dev/loop4"), 100, false),
        ["swapon", "--priority", "100", "/dev/loop4"]
    );
    assert_eq!(
        swapon(&p("/dev/loop4"), 100, true),
        [
            "swapon",
            "--priority",
            "100",
            "--discard=pages",
            "/dev/loop4"
        ]
    );
    assert_eq!(swapoff(&p("/dev/loop4")), ["swapoff", "/dev/loop4"]);
    assert_eq!(
        blockdev_flush(&p("/dev/loop4")),
        ["blockdev", "--flushbufs", "/dev/loop4"]
    );
}

#[test]
fn queue_depth_lives_in_sysfs() {
    assert_eq!(
        nr_requests_path(&p("/dev/loop4")),
        p("/sys/block/loop4/queue/nr_requests")
    );
    assert_eq!(
        nr_requests_path(&p("/dev/nbd0")),
        p("/sys/block/nbd0/queue/nr_requests")
    );
}

#[test]
fn nbdkit_line() {
    assert_eq!(
        nbdkit_command(
            &p("nbdkit"),
            &p("/t/libpager_client_plugin.so"),
            &p("/st/nbd.sock"),
            &p("/st/nbdkit.pid"),
            &p("/st")
        ),
        [
            "setsid",
            "--fork",
            "--wait",
            "nbdkit",
            "--foreground",
            "--log=stderr",
            "--unix",
            "/st/nbd.sock",
            "--pidfile",
            "/st/nbdkit.pid",
            "/t/libpager_client_plugin.so",
            "state=/st"
        ]
    );
}
