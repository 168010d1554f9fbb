//! The libnbd wrapper against real nbdkit servers: every request kind,
//! export names, TLS with a pre-shared key, parallel batches, and timeouts
//! on a hung (SIGSTOPped) server.

mod common;

use std::time::Duration;

use common::Nbdkit;
use netpager_util::HostPort;
use pager_client::nbd::{self, Connection, Endpoint, NbdError, Op, Pool, Timeouts};

const T: Duration = Duration::from_secs(2);

fn endpoint(addr: &str, export: &str) -> Endpoint {
    let HostPort { host, port } = HostPort::parse(addr).unwrap();
    Endpoint {
        host,
        port,
        export: export.into(),
        tls_psk_file: None,
        tls_username: None,
    }
}

#[test]
fn requests_of_every_kind() {
    let d = Nbdkit::memory("1M");
    let mut c = Connection::connect(&endpoint(&d.addr, ""), T).unwrap();
    assert_eq!(c.size(), 1 << 20);
    let data: Vec<u8> = (0..10000u32).map(|i| (i % 251) as u8).collect();
    c.pwrite(&data, 5000, T).unwrap();
    let mut b = vec![0u8; 10000];
    c.pread(&mut b, 5000, T).unwrap();
    assert_eq!(b, data);
    c.zero(100, 5000, T).unwrap();
    c.trim(4096, 8192, T).unwrap();
    c.flush(T).unwrap();
    c.pread(&mut b, 5000, T).unwrap();
    assert!(b[..100].iter().all(|&x| x == 0));
    assert_eq!(b[100..3192], data[100..3192]);
    let err = c.pread(&mut b, (1 << 20) - 10, T).unwrap_err();
    assert!(matches!(err, NbdError::Request { .. }), "{err}");
    assert!(err.to_string().contains(&d.addr), "{err}");
}

#[test]
fn tls_with_a_pre_shared_key() {
    let dir = tempfile::tempdir().unwrap();
    let psk = dir.path().join("keys.psk");
    std::fs::write(
        &psk,
        "alice:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n",
    )
    .unwrap();
    let psk_arg = format!("--tls-psk={}", psk.display());
    let d = Nbdkit::with_args(&["--tls=require", &psk_arg, "memory", "1M"]);
    let mut ep = endpoint(&d.addr, "");
    assert!(
        Connection::connect(&ep, T).is_err(),
        "plain NBD must be refused"
    );
    ep.tls_psk_file = Some(psk.clone());
    ep.tls_username = Some("alice".into());
    let mut c = Connection::connect(&ep, T).unwrap();
    c.pwrite(&[7u8; 512], 0, T).unwrap();
    let mut b = [0u8; 512];
    c.pread(&mut b, 0, T).unwrap();
    assert_eq!(b, [7u8; 512]);
    ep.tls_username = Some("mallory".into());
    assert!(
        Connection::connect(&ep, T).is_err(),
        "unknown PSK user must be refused"
    );
}

#[test]
fn a_hung_server_times_out_instead_of_blocking() {
    let mut d = Nbdkit::memory("1M");
    let mut c = Connection::connect(&endpoint(&d.addr, ""), T).unwrap();
    d.stop();
    let mut b = [0u8; 4096];
    let err = c.pread(&mut b, 0, Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, NbdError::Timeout { .. }), "{err}");
    // The abandoned connection is never used again.
    assert!(c.pread(&mut b, 0, T).is_err());
    // Connecting to it times out too (the kernel accepts, nbdkit is stopped).
    let err = Connection::connect(&endpoint(&d.addr, ""), Duration::from_millis(300))
        .err()
        .unwrap();
    assert!(matches!(err, NbdError::ConnectTimeout { .. }), "{err}");
}

#[test]
fn batches_run_on_several_donors_and_report_each_result() {
    let a = Nbdkit::memory("1M");
    let mut b = Nbdkit::memory("1M");
    let t = Timeouts {
        connect: T,
        request: Duration::from_millis(500),
    };
    let pa = Pool::new(0, endpoint(&a.addr, ""), t, 2);
    let pb = Pool::new(1, endpoint(&b.addr, ""), t, 2);
    let x = [1u8; 4096];
    let y = [2u8; 4096];
    let mut reqs = vec![
        nbd::Request {
            pool: &pa,
            offset: 0,
            op: Op::Write(&x),
        },
        nbd::Request {
            pool: &pb,
            offset: 0,
            op: Op::Write(&y),
        },
        nbd::Request {
            pool: &pa,
            offset: 4096,
            op: Op::Write(&y),
        },
    ];
    assert!(nbd::run(&mut reqs).iter().all(|r| r.is_ok()));
    let (mut ra, mut rb) = ([0u8; 8192], [0u8; 4096]);
    let mut reqs = vec![
        nbd::Request {
            pool: &pa,
            offset: 0,
            op: Op::Read(&mut ra),
        },
        nbd::Request {
            pool: &pb,
            offset: 0,
            op: Op::Read(&mut rb),
        },
    ];
    assert!(nbd::run(&mut reqs).iter().all(|r| r.is_ok()));
    assert_eq!(
        (&ra[..4096], &ra[4096..], &rb[..]),
        (&x[..], &y[..], &y[..])
    );
    // One donor hangs: only its request fails, by timeout.
    b.stop();
    let (mut ra, mut rb) = ([0u8; 4096], [0u8; 4096]);
    let mut reqs = vec![
        nbd::Request {
            pool: &pa,
            offset: 0,
            op: Op::Read(&mut ra),
        },
        nbd::Request {
            pool: &pb,
            offset: 0,
            op: Op::Read(&mut rb),
        },
    ];
    let res = nbd::run(&mut reqs);
    assert!(res[0].is_ok());
    assert!(
        matches!(res[1], Err(NbdError::Timeout { .. })),
        "{:?}",
        res[1]
    );
    pb.close();
    assert!(matches!(
        pb.checkout().err(),
        Some(NbdError::Unavailable { .. })
    ));
}

#[test]
fn export_names_reach_the_server() {
    let Some(d) = Nbdkit::pager_server(&["size=1M", "budget=4M"]) else {
        return;
    };
    let mut c = Connection::connect(&endpoint(&d.addr, "client7@2M"), T).unwrap();
    assert_eq!(c.size(), 2 << 20);
    c.pwrite(&[3u8; 4096], 4096, T).unwrap();
    let st = netpager_proto::query_status(d.status.as_deref().unwrap(), T).unwrap();
    let e = st
        .exports
        .iter()
        .find(|e| e.name == "client7")
        .expect("export listed");
    assert_eq!(e.used_bytes, 4096);
}

#[test]
fn a_returned_lease_wakes_a_waiting_checkout() {
    let a = Nbdkit::memory("1M");
    let t = Timeouts {
        connect: T,
        request: T,
    };
    let pool = Pool::new(0, endpoint(&a.addr, ""), t, 1);
    let held = pool.checkout().unwrap();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let pool = &pool;
        s.spawn(move || {
            if let Ok(mut lease) = pool.checkout() {
                lease.run(0, Op::Write(&[5u8; 4096])).unwrap();
                tx.send(()).unwrap();
            }
        });
        // The pool's only connection is leased: the waiter must still wait.
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        drop(held);
        let woken = rx.recv_timeout(Duration::from_secs(10));
        if woken.is_err() {
            // Frees the waiter, so that the test fails instead of hanging.
            pool.close();
        }
        assert!(
            woken.is_ok(),
            "the waiting checkout never got the returned connection"
        );
    });
}
