//! The NBD client against real nbdkit servers: every request kind on both
//! transports (plain and TLS with a pre-shared key), export names, parallel
//! batches, and timeouts on a hung (SIGSTOPped) server.

use std::time::Duration;

use netpager_nbd::{self as nbd, Connection, Endpoint, NbdError, Op, Pool, Timeouts};
use netpager_test_support::{Nbdkit, PSK_USER};
use netpager_util::HostPort;

/// Healthy requests and connects: a bound a loaded machine never reaches.
const T: Duration = Duration::from_secs(30);

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
    let (d, psk) = Nbdkit::memory_tls("1M", dir.path());
    let mut ep = endpoint(&d.addr, "");
    assert!(
        Connection::connect(&ep, T).is_err(),
        "plain NBD must be refused"
    );
    ep.tls_psk_file = Some(psk.clone());
    ep.tls_username = Some(PSK_USER.into());
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

/// One batch reading offset 0 of each pool into its buffer.
fn read_both(pa: &Pool, ra: &mut [u8], pb: &Pool, rb: &mut [u8]) -> Vec<Result<(), NbdError>> {
    nbd::run(&mut [
        nbd::Request {
            pool: pa,
            offset: 0,
            op: Op::Read(ra),
        },
        nbd::Request {
            pool: pb,
            offset: 0,
            op: Op::Read(rb),
        },
    ])
}

#[test]
fn batches_run_on_several_donors_and_report_each_result() {
    let a = Nbdkit::memory("1M");
    let mut b = Nbdkit::memory("1M");
    // Only the donor that hangs may time out: the other's timeout is one a
    // loaded machine never reaches.
    let t = |request| Timeouts {
        connect: T,
        request,
        spin: Duration::from_micros(50),
    };
    let pa = Pool::new(0, endpoint(&a.addr, ""), t(Duration::from_secs(30)), 2);
    let pb = Pool::new(1, endpoint(&b.addr, ""), t(Duration::from_secs(2)), 2);
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
    assert!(read_both(&pa, &mut ra, &pb, &mut rb)
        .iter()
        .all(|r| r.is_ok()));
    assert_eq!(
        (&ra[..4096], &ra[4096..], &rb[..]),
        (&x[..], &y[..], &y[..])
    );
    // One donor hangs: only its request fails, by timeout.
    b.stop();
    let (mut ra, mut rb) = ([0u8; 4096], [0u8; 4096]);
    let res = read_both(&pa, &mut ra, &pb, &mut rb);
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
    // nbdkit's info plugin serves the export name it was asked for.
    let d = Nbdkit::with_args(&["info", "mode=exportname"]);
    let name = "client7@2M";
    let mut c = Connection::connect(&endpoint(&d.addr, name), T).unwrap();
    assert_eq!(c.size(), name.len() as u64);
    let mut b = vec![0u8; name.len()];
    c.pread(&mut b, 0, T).unwrap();
    assert_eq!(b, name.as_bytes());
}

#[test]
fn a_returned_lease_wakes_a_waiting_checkout() {
    let a = Nbdkit::memory("1M");
    let t = Timeouts {
        connect: T,
        request: T,
        spin: Duration::ZERO,
    };
    let pool = Pool::new(0, endpoint(&a.addr, ""), t, 1);
    // Every slot of the pool's only connection.
    let mut held: Vec<_> = (0..nbd::REQUESTS_PER_CONNECTION)
        .map(|_| pool.checkout().unwrap())
        .collect();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let pool = &pool;
        s.spawn(move || {
            if let Ok(mut lease) = pool.checkout() {
                lease.run(0, Op::Write(&[5u8; 4096])).unwrap();
                tx.send(()).unwrap();
            }
        });
        // The pool's only connection is full: the waiter must still wait.
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        held.pop();
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

#[test]
fn large_requests_cross_a_full_socket_buffer() {
    // 8 MiB does not fit a loopback socket's buffer: the write is sent in
    // parts as the server drains it, and the read arrives in parts.
    let d = Nbdkit::memory("16M");
    let mut c = Connection::connect(&endpoint(&d.addr, ""), T).unwrap();
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i % 253) as u8).collect();
    c.pwrite(&data, 4096, T).unwrap();
    let mut b = vec![0u8; data.len()];
    c.pread(&mut b, 4096, T).unwrap();
    assert!(b == data, "8 MiB read back differs");
}

#[test]
fn unix_sockets_connect_and_probe() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let _d = Nbdkit::unix(&sock, &["memory", "1M"]);
    Connection::probe_unix(&sock, T).unwrap();
    let mut c = Connection::connect_unix(&sock, "", T).unwrap();
    assert_eq!(c.size(), 1 << 20);
    c.pwrite(&[9u8; 4096], 0, T).unwrap();
    c.flush(T).unwrap();
    let mut b = [0u8; 4096];
    c.pread(&mut b, 0, T).unwrap();
    assert_eq!(b, [9u8; 4096]);
    let missing = dir.path().join("none.sock");
    let err = Connection::probe_unix(&missing, T).unwrap_err();
    assert!(err.to_string().contains("none.sock"), "{err}");
}

/// Builds a scripted server's reply to the request with this cookie.
type Reply = fn(u64) -> Vec<u8>;

/// A scripted NBD server on a unix socket: a correct handshake, then
/// `reply(cookie)` to the first request, then it hangs up.
fn scripted_server(
    sock: &std::path::Path,
    reply: fn(u64) -> Vec<u8>,
) -> std::thread::JoinHandle<()> {
    use std::io::{Read, Write};
    let l = std::os::unix::net::UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut greeting = b"NBDMAGIC".to_vec();
        greeting.extend_from_slice(&nbd::wire::IHAVEOPT.to_be_bytes());
        greeting.extend_from_slice(&3u16.to_be_bytes());
        s.write_all(&greeting).unwrap();
        let mut hello = [0u8; 4 + 16];
        s.read_exact(&mut hello).unwrap();
        let len = u32::from_be_bytes(hello[16..20].try_into().unwrap());
        let mut opt = vec![0u8; len as usize];
        s.read_exact(&mut opt).unwrap();
        let rep = |kind: u32, data: &[u8]| {
            let mut m = nbd::wire::OPT_REPLY_MAGIC.to_be_bytes().to_vec();
            m.extend_from_slice(&nbd::wire::OPT_GO.to_be_bytes());
            m.extend_from_slice(&kind.to_be_bytes());
            m.extend_from_slice(&(data.len() as u32).to_be_bytes());
            m.extend_from_slice(data);
            m
        };
        let mut info = vec![0u8, 0];
        info.extend_from_slice(&(1u64 << 20).to_be_bytes());
        info.extend_from_slice(&0x6du16.to_be_bytes());
        s.write_all(&rep(nbd::wire::REP_INFO, &info)).unwrap();
        s.write_all(&rep(nbd::wire::REP_ACK, &[])).unwrap();
        let mut req = [0u8; nbd::wire::REQUEST_LEN];
        s.read_exact(&mut req).unwrap();
        let cookie = u64::from_be_bytes(req[8..16].try_into().unwrap());
        s.write_all(&reply(cookie)).unwrap();
    })
}

#[test]
fn a_reply_out_of_step_fails_the_request_and_the_connection() {
    let cases: [(&str, Reply); 3] = [
        ("bad reply magic", |c| {
            let mut r = vec![0u8; 8];
            r.extend_from_slice(&c.to_be_bytes());
            r
        }),
        ("for cookie", |c| {
            let mut r = nbd::wire::SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
            r.extend_from_slice(&0u32.to_be_bytes());
            r.extend_from_slice(&(c + 1).to_be_bytes());
            r
        }),
        ("closed the connection", |c| {
            // A read's reply header, then half its data, then the end.
            let mut r = nbd::wire::SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
            r.extend_from_slice(&0u32.to_be_bytes());
            r.extend_from_slice(&c.to_be_bytes());
            r.extend_from_slice(&[1u8; 2048]);
            r
        }),
    ];
    for (i, (want, reply)) in cases.into_iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join(format!("s{i}.sock"));
        let server = scripted_server(&sock, reply);
        let mut c = Connection::connect_unix(&sock, "", T).unwrap();
        let mut b = [0u8; 4096];
        let err = c.pread(&mut b, 0, T).unwrap_err();
        assert!(err.to_string().contains(want), "{want}: {err}");
        let again = c.pread(&mut b, 0, T).unwrap_err();
        assert!(again.to_string().contains("abandoned"), "{again}");
        drop(c);
        server.join().unwrap();
    }
}

#[test]
fn an_error_reply_fails_only_that_request() {
    let d = Nbdkit::with_args(&[
        "--filter=error",
        "memory",
        "1M",
        "error-pread=EIO",
        "error-pread-rate=1",
    ]);
    let mut c = Connection::connect(&endpoint(&d.addr, ""), T).unwrap();
    let mut b = [0u8; 4096];
    match c.pread(&mut b, 0, T).unwrap_err() {
        NbdError::Request { errno, .. } => assert_eq!(errno, libc::EIO),
        e => panic!("{e}"),
    }
    // Writes still work on the same connection: it stayed in step.
    c.pwrite(&[1u8; 4096], 0, T).unwrap();
}

/// Issue 25, hazard 6: a batch groups its requests by pool order, so two
/// pools sharing one would have sent one donor's requests on the other's
/// connection. It is refused loudly instead.
#[test]
#[should_panic(expected = "share order 3")]
fn two_pools_with_one_order_are_refused_in_a_batch() {
    let (a, b) = (Nbdkit::memory("1M"), Nbdkit::memory("1M"));
    let t = Timeouts {
        connect: T,
        request: T,
        spin: Duration::ZERO,
    };
    let pa = Pool::new(3, endpoint(&a.addr, ""), t, 1);
    let pb = Pool::new(3, endpoint(&b.addr, ""), t, 1);
    let x = [1u8; 4096];
    nbd::run(&mut [
        nbd::Request {
            pool: &pa,
            offset: 0,
            op: Op::Write(&x),
        },
        nbd::Request {
            pool: &pb,
            offset: 0,
            op: Op::Write(&x),
        },
    ]);
}

/// A socket handed over after the handshake is what the kernel's nbd
/// driver gets: requests written on it as the kernel writes them (a
/// simple request header, a write's data after it) are answered.
#[test]
fn a_handed_over_socket_answers_requests_sent_as_the_kernel_sends_them() {
    use nbd::wire::{self, Command};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let _d = Nbdkit::unix(&sock, &["memory", "1M"]);
    let n = Connection::handover_unix(&sock, "", T).unwrap();
    assert_eq!(n.size, 1 << 20);
    assert_ne!(n.flags & wire::TX_HAS_FLAGS, 0, "flags {:#x}", n.flags);
    assert_ne!(n.flags & wire::TX_SEND_FLUSH, 0, "flags {:#x}", n.flags);
    let mut s = UnixStream::from(n.fd);
    // The kernel relies on blocking reads and writes.
    s.set_read_timeout(Some(T)).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8).collect();
    let mut write = wire::request(Command::Write, 0, 0x11, 8192, 4096).to_vec();
    write.extend_from_slice(&data);
    s.write_all(&write).unwrap();
    let mut reply = [0u8; wire::REPLY_LEN];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(wire::reply(&reply, 0x11).unwrap(), 0);
    s.write_all(&wire::request(Command::Read, 0, 0x12, 8192, 4096))
        .unwrap();
    s.read_exact(&mut reply).unwrap();
    assert_eq!(wire::reply(&reply, 0x12).unwrap(), 0);
    let mut back = vec![0u8; 4096];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, data);
}

/// TLS connections given up while their replies are on their way (a
/// request that timed out as the donor answered): the donor must not die
/// of the hang-up. nbdkit 1.32 (Debian 12) sends its TLS goodbye from the
/// thread that saw the client go, while another thread encrypts a reply
/// on the same session: "nettle_chacha_poly1305_encrypt: Assertion ...
/// failed" and the donor aborted with every page it held (the nemesis,
/// mirror seed 8000004).
#[test]
fn tls_connections_given_up_mid_reply_do_not_kill_the_donor() {
    let dir = tempfile::tempdir().unwrap();
    let (mut d, psk) = Nbdkit::memory_tls("64M", dir.path());
    let mut ep = endpoint(&d.addr, "");
    ep.tls_psk_file = Some(psk);
    ep.tls_username = Some(PSK_USER.into());
    // Every byte the given-up reads cover is known, so a donor that
    // survives but serves or keeps the wrong bytes fails too.
    let region = 8usize << 22;
    let data: Vec<u8> = (0..region)
        .map(|i| (i / 4096 * 31 + i % 251) as u8)
        .collect();
    Connection::connect(&ep, T)
        .and_then(|mut c| c.pwrite(&data, 0, T))
        .unwrap();
    for round in 0..40 {
        let mut conns: Vec<Connection> = (0..8)
            .map(|_| Connection::connect(&ep, T))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("round {round}: {e}: {}", d.log()));
        std::thread::scope(|s| {
            for (i, c) in conns.iter_mut().enumerate() {
                s.spawn(move || {
                    let mut b = vec![0u8; 4 << 20];
                    // Given up at once: the reply is still being sent.
                    let _ = c.pread(&mut b, (i as u64) << 22, Duration::from_micros(500));
                });
            }
        });
        drop(conns);
        // The donor answers a new connection once it has dealt with the
        // old ones' hang-ups, with the bytes written before.
        let at = round * 811 * 4096 % region;
        let mut b = [0u8; 4096];
        let served = Connection::connect(&ep, T).and_then(|mut c| c.pread(&mut b, at as u64, T));
        let exited = d.exited();
        assert!(
            served.is_ok() && exited.is_none(),
            "round {round}: the donor died ({exited:?}, {served:?}): {}",
            d.log()
        );
        assert!(
            b[..] == data[at..at + 4096],
            "round {round}: wrong bytes at {at}"
        );
    }
    let mut all = vec![0u8; region];
    Connection::connect(&ep, T)
        .and_then(|mut c| c.pread(&mut all, 0, T))
        .unwrap();
    let bad = (0..region / 4096).find(|p| all[p * 4096..][..4096] != data[p * 4096..][..4096]);
    assert_eq!(bad, None, "the first page read back wrong after 40 rounds");
}
