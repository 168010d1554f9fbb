//! What the holder of a kernel nbd device (`pagerctl hold-nbd`) does when
//! its serving process (nbdkit with the client plugin) serves, dies, or
//! the device is detached. Pure, so that every case is a unit test; the
//! command carries the actions out.
//!
//! The kernel keeps `/dev/nbdN` configured while its connection is dead
//! (`drivers/block/nbd.c`): new requests wait up to the dead-conn timeout
//! for `NBD_CMD_RECONFIGURE` and fail with EIO after it; requests the dead
//! server had been sent are sent again on the new connection once the
//! request timeout (`--nbd-timeout`) passes. So on a death the holder
//! starts the next serving process at once (slowing down only a crash
//! loop), hands the kernel the new socket, and says so loudly when the
//! dead-conn timeout passed first: the kernel failed requests then.

use std::time::{Duration, Instant};

/// A serving process that lived less than this died "at once".
pub const QUICK_DEATH: Duration = Duration::from_secs(2);

/// How long to wait before the next start after `quick` serving processes
/// in a row died at once: nothing for the first two (a crash, then one
/// more chance), then doubling from 250 ms up to 8 s, so that a process
/// that cannot start does not spin while an operator looks.
pub fn backoff(quick: u32) -> Duration {
    match quick {
        0..=2 => Duration::ZERO,
        n => Duration::from_millis(250u64 << (n - 3).min(5)),
    }
}

/// Something the holder saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The serving process answered; a socket is negotiated for the kernel.
    Negotiated,
    /// The serving process exited after living `lived`; `asked`: the
    /// holder stopped it for `pagerctl restart` (no crash).
    ServerExited { lived: Duration, asked: bool },
    /// Detach: disconnect the device and stop for good.
    Detach,
    /// Time passed (the holder wakes by [`Holder::deadline`]).
    Tick,
}

/// What the holder is to do, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `NBD_CMD_CONNECT` with the negotiated socket.
    Connect,
    /// `NBD_CMD_RECONFIGURE` with the negotiated socket in place of the
    /// dead one: requests were held `held`; `late`: the dead-conn timeout
    /// had passed, so the kernel failed some of them.
    Reconfigure { held: Duration, late: bool },
    /// Start the next serving process after `after`.
    Start { after: Duration },
    /// The dead-conn timeout passed with no serving process: the kernel
    /// now fails the device's requests (swapped pages are lost to the
    /// jobs that read them) until one serves. Log and record it.
    Expired { down: Duration },
    /// `NBD_CMD_DISCONNECT`.
    Disconnect,
    /// Flush and stop the serving process (if one runs).
    StopServer,
    /// Done: exit.
    Exit,
    /// The first serving process never served: there is no device to
    /// keep; exit with an error (the attach fails).
    Fail,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The first serving process is starting: nothing connected yet.
    Starting,
    Serving,
    /// The connection is dead since `since`.
    Down {
        since: Instant,
        expired: bool,
    },
    Detaching,
}

/// The holder's state.
#[derive(Debug, Clone)]
pub struct Holder {
    phase: Phase,
    dead_conn: Duration,
    /// Serving processes that died at once, in a row.
    quick: u32,
}

impl Holder {
    pub fn new(dead_conn: Duration) -> Holder {
        Holder {
            phase: Phase::Starting,
            dead_conn,
            quick: 0,
        }
    }

    /// When to send [`Event::Tick`] at the latest: the dead-conn
    /// timeout's end while the connection is down.
    pub fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Down {
                since,
                expired: false,
            } => Some(since + self.dead_conn),
            _ => None,
        }
    }

    /// Whether the kernel's device is connected to a live serving process.
    pub fn serving(&self) -> bool {
        self.phase == Phase::Serving
    }

    pub fn on(&mut self, ev: Event, now: Instant) -> Vec<Action> {
        match (self.phase, ev) {
            (Phase::Detaching, Event::ServerExited { .. }) => vec![Action::Exit],
            (Phase::Detaching, _) => vec![],
            (Phase::Starting, Event::Negotiated) => {
                self.phase = Phase::Serving;
                vec![Action::Connect]
            }
            (Phase::Starting, Event::ServerExited { .. }) => {
                self.phase = Phase::Detaching;
                vec![Action::Fail]
            }
            (Phase::Starting, Event::Detach) => {
                self.phase = Phase::Detaching;
                vec![Action::StopServer]
            }
            (Phase::Serving | Phase::Down { .. }, Event::Detach) => {
                self.phase = Phase::Detaching;
                vec![Action::Disconnect, Action::StopServer]
            }
            (Phase::Serving, Event::ServerExited { lived, asked }) => {
                self.phase = Phase::Down {
                    since: now,
                    expired: false,
                };
                vec![Action::Start {
                    after: self.died(lived, asked),
                }]
            }
            (Phase::Down { since, expired }, Event::Negotiated) => {
                self.phase = Phase::Serving;
                vec![Action::Reconfigure {
                    held: now.saturating_duration_since(since),
                    late: expired || now >= since + self.dead_conn,
                }]
            }
            (Phase::Down { since, .. }, Event::ServerExited { lived, asked }) => {
                let mut actions = self.expiry(since, now);
                actions.push(Action::Start {
                    after: self.died(lived, asked),
                });
                actions
            }
            (Phase::Down { since, .. }, Event::Tick) => self.expiry(since, now),
            // A second socket while one serves, or time passing while
            // nothing is down: nothing to do.
            (Phase::Starting | Phase::Serving, Event::Negotiated | Event::Tick) => vec![],
        }
    }

    /// Counts a death; the wait before the next start.
    fn died(&mut self, lived: Duration, asked: bool) -> Duration {
        self.quick = if asked || lived >= QUICK_DEATH {
            0
        } else {
            self.quick + 1
        };
        backoff(self.quick)
    }

    /// [`Action::Expired`] once, when the dead-conn timeout has passed.
    fn expiry(&mut self, since: Instant, now: Instant) -> Vec<Action> {
        match &mut self.phase {
            Phase::Down { expired, .. } if !*expired && now >= since + self.dead_conn => {
                *expired = true;
                vec![Action::Expired {
                    down: now.saturating_duration_since(since),
                }]
            }
            _ => vec![],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEAD: Duration = Duration::from_secs(120);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn exited(lived: u64) -> Event {
        Event::ServerExited {
            lived: secs(lived),
            asked: false,
        }
    }

    #[test]
    fn backoff_lets_a_crash_restart_at_once_and_slows_a_crash_loop() {
        assert_eq!(backoff(0), Duration::ZERO);
        assert_eq!(backoff(1), Duration::ZERO);
        assert_eq!(backoff(2), Duration::ZERO);
        assert_eq!(backoff(3), Duration::from_millis(250));
        assert_eq!(backoff(4), Duration::from_millis(500));
        assert_eq!(backoff(8), Duration::from_secs(8));
        assert_eq!(backoff(100), Duration::from_secs(8));
    }

    #[test]
    fn the_first_socket_connects_and_a_death_then_reconfigures() {
        let t0 = Instant::now();
        let mut h = Holder::new(DEAD);
        assert_eq!(h.on(Event::Tick, t0), []);
        assert_eq!(h.on(Event::Negotiated, t0), [Action::Connect]);
        assert!(h.serving());
        assert_eq!(h.deadline(), None);
        // A kill -9 after an hour: the next one starts at once.
        let t1 = t0 + secs(3600);
        assert_eq!(
            h.on(exited(3600), t1),
            [Action::Start {
                after: Duration::ZERO
            }]
        );
        assert!(!h.serving());
        assert_eq!(h.deadline(), Some(t1 + DEAD));
        assert_eq!(
            h.on(Event::Negotiated, t1 + Duration::from_millis(300)),
            [Action::Reconfigure {
                held: Duration::from_millis(300),
                late: false
            }]
        );
        assert!(h.serving());
    }

    #[test]
    fn a_first_serving_process_that_never_serves_fails_the_attach() {
        let mut h = Holder::new(DEAD);
        assert_eq!(h.on(exited(0), Instant::now()), [Action::Fail]);
        // Nothing more after that.
        assert_eq!(h.on(Event::Negotiated, Instant::now()), []);
    }

    #[test]
    fn the_dead_conn_timeout_is_reported_once_and_the_holder_keeps_trying() {
        let t0 = Instant::now();
        let mut h = Holder::new(DEAD);
        h.on(Event::Negotiated, t0);
        h.on(exited(100), t0);
        assert_eq!(h.on(Event::Tick, t0 + secs(119)), []);
        assert_eq!(
            h.on(Event::Tick, t0 + DEAD),
            [Action::Expired { down: DEAD }]
        );
        assert_eq!(h.deadline(), None, "reported once");
        assert_eq!(h.on(Event::Tick, t0 + secs(200)), []);
        assert_eq!(
            h.on(Event::Negotiated, t0 + secs(200)),
            [Action::Reconfigure {
                held: secs(200),
                late: true
            }]
        );
    }

    #[test]
    fn a_crash_loop_backs_off_and_expires_on_a_death_past_the_deadline() {
        let t0 = Instant::now();
        let mut h = Holder::new(secs(5));
        h.on(Event::Negotiated, t0);
        let mut waits = vec![];
        for i in 0..5 {
            let acts = h.on(exited(0), t0 + Duration::from_millis(i * 100));
            waits.push(acts);
        }
        let start = |ms| Action::Start {
            after: Duration::from_millis(ms),
        };
        assert_eq!(waits[0], [start(0)]);
        assert_eq!(waits[1], [start(0)]);
        assert_eq!(waits[2], [start(250)]);
        assert_eq!(waits[3], [start(500)]);
        assert_eq!(waits[4], [start(1000)]);
        // Down since the first death, at t0: past the 5 s timeout now.
        assert_eq!(
            h.on(exited(0), t0 + secs(6)),
            [Action::Expired { down: secs(6) }, start(2000)]
        );
        // One that served a while resets the count.
        h.on(Event::Negotiated, t0 + secs(7));
        assert_eq!(h.on(exited(60), t0 + secs(67)), [start(0)]);
    }

    #[test]
    fn a_restart_is_no_crash() {
        let t0 = Instant::now();
        let mut h = Holder::new(DEAD);
        h.on(Event::Negotiated, t0);
        for _ in 0..5 {
            let acts = h.on(
                Event::ServerExited {
                    lived: Duration::from_millis(10),
                    asked: true,
                },
                t0,
            );
            assert_eq!(
                acts,
                [Action::Start {
                    after: Duration::ZERO
                }]
            );
            h.on(Event::Negotiated, t0);
        }
    }

    #[test]
    fn detach_disconnects_a_connected_device_then_waits_for_the_server() {
        let t0 = Instant::now();
        let mut h = Holder::new(DEAD);
        h.on(Event::Negotiated, t0);
        assert_eq!(
            h.on(Event::Detach, t0),
            [Action::Disconnect, Action::StopServer]
        );
        // The serving process's exit is no crash now: nothing restarts.
        assert_eq!(h.on(Event::Tick, t0), []);
        assert_eq!(h.on(exited(1), t0), [Action::Exit]);

        // Detached while down: still disconnected (requests fail at once
        // instead of waiting out the dead-conn timeout).
        let mut h = Holder::new(DEAD);
        h.on(Event::Negotiated, t0);
        h.on(exited(100), t0);
        assert_eq!(
            h.on(Event::Detach, t0),
            [Action::Disconnect, Action::StopServer]
        );
        assert_eq!(h.deadline(), None);

        // Before anything was connected: only the server to stop.
        let mut h = Holder::new(DEAD);
        assert_eq!(h.on(Event::Detach, t0), [Action::StopServer]);
        assert_eq!(h.on(exited(0), t0), [Action::Exit]);
    }
}
