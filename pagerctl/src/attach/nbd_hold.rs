//! What the holder of a kernel nbd device (`pagerctl hold-nbd`) does when
//! its serving process (nbdkit with the client plugin) serves, dies, is
//! replaced, or the device is detached. Pure, so that every case is a unit
//! test; the command carries the actions out.
//!
//! The kernel keeps `/dev/nbdN` configured while its connection is dead
//! (`drivers/block/nbd.c`): new requests wait up to the dead-conn timeout
//! for `NBD_CMD_RECONFIGURE` and fail with EIO after it; requests the dead
//! server had been sent are sent again on the new connection once the
//! request timeout (`--nbd-timeout`) passes. The driver marks a connection
//! dead when its server closes it, a send fails, or a request goes
//! unanswered for the request timeout, and says so with `NBD_CMD_LINK_DEAD`
//! on its multicast group; a socket given before that is dropped without
//! an error. So:
//!
//! - a serving process that exits is replaced at once (a crash loop slows
//!   down), and its successor's socket goes to the kernel only once the
//!   kernel has announced the old connection dead;
//! - a `NBD_CMD_LINK_DEAD` while nbdkit runs (it stalled past the request
//!   timeout: stopped, or stuck on a donor) is treated like its exit: it
//!   is killed, so that nothing it still holds lands after the kernel's
//!   retries, and the next one starts;
//! - a refused `NBD_CMD_RECONFIGURE` kills that nbdkit too, counted as a
//!   death at once (the crash-loop backoff applies);
//! - `pagerctl restart` shuts the kernel's socket for writing: nbdkit
//!   answers what it has read, sees the end of the stream and exits (a
//!   SIGTERM would fail what it has read with ESHUTDOWN);
//! - stopping (a restart or a detach) has a deadline, past which the
//!   serving process is killed, and the holder says so.

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
    /// `NBD_CMD_LINK_DEAD` for this device: the kernel marked its
    /// connection dead.
    LinkDead,
    /// The kernel's notices were lost (overrun, or the watch failed): the
    /// connection may have died unannounced.
    NoticesLost,
    /// The kernel took the socket (`NBD_CMD_RECONFIGURE` acknowledged).
    Reconfigured,
    /// The kernel refused the socket.
    ReconfigureFailed,
    /// `pagerctl restart`.
    Restart,
    /// Detach: disconnect the device and stop for good.
    Detach,
    /// Time passed (the holder wakes by [`Holder::deadline`]).
    Tick,
}

/// Why the serving process is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kill {
    /// The kernel gave up on its connection (`NBD_CMD_LINK_DEAD`).
    LinkDead,
    /// The kernel refused its socket.
    Refused,
    /// It did not stop within the stop deadline.
    StopTimedOut,
}

/// What the holder is to do, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `NBD_CMD_CONNECT` with the negotiated socket.
    Connect,
    /// `NBD_CMD_RECONFIGURE` with the negotiated socket; the outcome comes
    /// back as [`Event::Reconfigured`] or [`Event::ReconfigureFailed`].
    Reconfigure,
    /// The device serves again: requests were held `held`; `late`: the
    /// dead-conn timeout had passed, so the kernel failed some of them.
    Served { held: Duration, late: bool },
    /// Start the next serving process after `after`.
    Start { after: Duration },
    /// `pagerctl restart`: the kernel's socket shut for writing, so that
    /// the serving process answers what it has read and exits.
    Drain,
    /// SIGKILL to the serving process.
    Kill(Kill),
    /// The dead-conn timeout passed with no serving process: the kernel
    /// now fails the device's requests (swapped pages are lost to the
    /// jobs that read them) until one serves. Log and record it.
    Expired { down: Duration },
    /// `NBD_CMD_DISCONNECT`.
    Disconnect,
    /// Stop the serving process (if one runs).
    StopServer,
    /// Done: exit.
    Exit,
    /// The first serving process never served: there is no device to
    /// keep; exit with an error (the attach fails).
    Fail,
    /// `pagerctl restart` while nothing serves: say so.
    RefuseRestart,
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
        /// The kernel announced the connection dead: a socket given now
        /// replaces it.
        kernel_dead: bool,
        /// A negotiated socket waits for the kernel.
        socket: bool,
        /// The serving process that served before is still running
        /// (killed or draining): the next starts once it has exited.
        old: bool,
    },
    Detaching,
}

/// The holder's state.
#[derive(Debug, Clone)]
pub struct Holder {
    phase: Phase,
    dead_conn: Duration,
    stop_grace: Duration,
    /// Serving processes that died at once, in a row.
    quick: u32,
    /// Since when the serving process has been asked to stop (a restart's
    /// drain or a detach), and whether it was killed for taking too long.
    stopping: Option<(Instant, bool)>,
}

impl Holder {
    /// `dead_conn`: the kernel's dead-conn timeout; `stop_grace`: how long
    /// a serving process asked to stop may take before it is killed.
    pub fn new(dead_conn: Duration, stop_grace: Duration) -> Holder {
        Holder {
            phase: Phase::Starting,
            dead_conn,
            stop_grace,
            quick: 0,
            stopping: None,
        }
    }

    /// When to send [`Event::Tick`] at the latest: the dead-conn
    /// timeout's end while the connection is down, the stop deadline while
    /// the serving process is asked to stop.
    pub fn deadline(&self) -> Option<Instant> {
        let down = match self.phase {
            Phase::Down {
                since,
                expired: false,
                ..
            } => Some(since + self.dead_conn),
            _ => None,
        };
        let stop = match self.stopping {
            Some((since, false)) => Some(since + self.stop_grace),
            _ => None,
        };
        down.into_iter().chain(stop).min()
    }

    /// Whether the kernel's device is connected to a live serving process.
    pub fn serving(&self) -> bool {
        self.phase == Phase::Serving
    }

    pub fn on(&mut self, ev: Event, now: Instant) -> Vec<Action> {
        if let Event::ServerExited { .. } = ev {
            self.stopping = None;
        }
        let mut actions = match (self.phase, ev) {
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
                self.stopping = Some((now, false));
                vec![Action::StopServer]
            }
            (Phase::Serving | Phase::Down { .. }, Event::Detach) => {
                self.phase = Phase::Detaching;
                self.stopping = Some((now, false));
                vec![Action::Disconnect, Action::StopServer]
            }
            (Phase::Starting | Phase::Down { .. }, Event::Restart) => vec![Action::RefuseRestart],
            (Phase::Serving, Event::Restart) if self.stopping.is_some() => vec![],
            (Phase::Serving, Event::Restart) => {
                self.stopping = Some((now, false));
                vec![Action::Drain]
            }
            (Phase::Serving, Event::ServerExited { lived, asked }) => {
                self.phase = Phase::Down {
                    since: now,
                    expired: false,
                    kernel_dead: false,
                    socket: false,
                    old: false,
                };
                vec![Action::Start {
                    after: self.died(lived, asked),
                }]
            }
            (Phase::Serving, Event::LinkDead) => {
                // A draining server is on its way out: let it answer what
                // it has read. Any other is stuck: kill it.
                let draining = self.stopping.is_some();
                self.phase = Phase::Down {
                    since: now,
                    expired: false,
                    kernel_dead: true,
                    socket: false,
                    old: true,
                };
                if draining {
                    vec![]
                } else {
                    vec![Action::Kill(Kill::LinkDead)]
                }
            }
            // A socket of the server being replaced is not the kernel's.
            (Phase::Down { old: true, .. }, Event::Negotiated) => vec![],
            (Phase::Down { .. }, Event::Negotiated) => {
                self.set_down(|_, socket, _| *socket = true);
                self.reconfigure_if_ready()
            }
            (Phase::Down { .. }, Event::LinkDead | Event::NoticesLost) => {
                self.set_down(|kernel_dead, _, _| *kernel_dead = true);
                self.reconfigure_if_ready()
            }
            (Phase::Down { since, expired, .. }, Event::Reconfigured) => {
                self.phase = Phase::Serving;
                vec![Action::Served {
                    held: now.saturating_duration_since(since),
                    late: expired || now >= since + self.dead_conn,
                }]
            }
            (Phase::Down { .. }, Event::ReconfigureFailed) => {
                self.set_down(|_, socket, _| *socket = false);
                vec![Action::Kill(Kill::Refused)]
            }
            (Phase::Down { since, old, .. }, Event::ServerExited { lived, asked }) => {
                self.set_down(|_, socket, old| {
                    *socket = false;
                    *old = false;
                });
                // One that never served died at once, however long it ran.
                let lived = if old { lived } else { Duration::ZERO };
                let mut actions = self.expiry(since, now);
                actions.push(Action::Start {
                    after: self.died(lived, asked),
                });
                actions
            }
            (Phase::Down { since, .. }, Event::Tick) => self.expiry(since, now),
            // Nothing to do: a second socket while one serves, the outcome
            // of a reconfigure nobody asked for, lost notices while the
            // connection serves, time passing.
            (Phase::Starting | Phase::Serving, _) => vec![],
        };
        if let Some((since, false)) = self.stopping {
            if now >= since + self.stop_grace {
                self.stopping = Some((since, true));
                actions.push(Action::Kill(Kill::StopTimedOut));
            }
        }
        actions
    }

    fn set_down(&mut self, f: impl FnOnce(&mut bool, &mut bool, &mut bool)) {
        if let Phase::Down {
            kernel_dead,
            socket,
            old,
            ..
        } = &mut self.phase
        {
            f(kernel_dead, socket, old);
        }
    }

    /// [`Action::Reconfigure`] once the kernel has announced the old
    /// connection dead and a socket waits.
    fn reconfigure_if_ready(&self) -> Vec<Action> {
        match self.phase {
            Phase::Down {
                kernel_dead: true,
                socket: true,
                ..
            } => vec![Action::Reconfigure],
            _ => vec![],
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
    const STOP: Duration = Duration::from_secs(30);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn ms(m: u64) -> Duration {
        Duration::from_millis(m)
    }

    fn exited(lived: u64) -> Event {
        Event::ServerExited {
            lived: secs(lived),
            asked: false,
        }
    }

    fn start(after_ms: u64) -> Action {
        Action::Start {
            after: ms(after_ms),
        }
    }

    /// A holder whose first serving process serves since `t0`.
    fn serving(t0: Instant) -> Holder {
        let mut h = Holder::new(DEAD, STOP);
        assert_eq!(h.on(Event::Tick, t0), []);
        assert_eq!(h.on(Event::Negotiated, t0), [Action::Connect]);
        assert!(h.serving());
        assert_eq!(h.deadline(), None);
        h
    }

    #[test]
    fn backoff_lets_a_crash_restart_at_once_and_slows_a_crash_loop() {
        assert_eq!(backoff(0), Duration::ZERO);
        assert_eq!(backoff(1), Duration::ZERO);
        assert_eq!(backoff(2), Duration::ZERO);
        assert_eq!(backoff(3), ms(250));
        assert_eq!(backoff(4), ms(500));
        assert_eq!(backoff(8), secs(8));
        assert_eq!(backoff(100), secs(8));
    }

    #[test]
    fn a_death_reconfigures_once_the_kernel_has_announced_the_connection_dead() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        // A kill -9 after an hour: the next one starts at once.
        let t1 = t0 + secs(3600);
        assert_eq!(h.on(exited(3600), t1), [start(0)]);
        assert!(!h.serving());
        assert_eq!(h.deadline(), Some(t1 + DEAD));
        // Its socket waits for the kernel's notice: given earlier, the
        // kernel would drop it without an error.
        assert_eq!(h.on(Event::Negotiated, t1 + ms(200)), []);
        assert_eq!(h.on(Event::LinkDead, t1 + ms(250)), [Action::Reconfigure]);
        assert!(!h.serving(), "serving only once the kernel took the socket");
        assert_eq!(
            h.on(Event::Reconfigured, t1 + ms(300)),
            [Action::Served {
                held: ms(300),
                late: false
            }]
        );
        assert!(h.serving());

        // The notice first (the kernel saw the socket close before the
        // holder reaped nbdkit): a crash, not the kernel giving up, if the
        // command sees nbdkit exiting; otherwise the kill is harmless.
        let t2 = t1 + secs(10);
        assert_eq!(h.on(Event::LinkDead, t2), [Action::Kill(Kill::LinkDead)]);
        assert_eq!(h.on(exited(10), t2), [start(0)]);
        assert_eq!(h.on(Event::Negotiated, t2 + ms(100)), [Action::Reconfigure]);
        assert_eq!(
            h.on(Event::Reconfigured, t2 + ms(100)),
            [Action::Served {
                held: ms(100),
                late: false
            }]
        );
    }

    #[test]
    fn a_stall_past_the_request_timeout_kills_the_stuck_nbdkit_and_starts_the_next() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        let t1 = t0 + secs(100);
        // nbdkit stopped (or stuck on a donor) past --nbd-timeout: the
        // kernel marks the connection dead; the holder kills nbdkit so
        // that nothing it holds lands after the kernel's retries.
        assert_eq!(h.on(Event::LinkDead, t1), [Action::Kill(Kill::LinkDead)]);
        assert!(!h.serving());
        assert_eq!(h.deadline(), Some(t1 + DEAD));
        // Time passes until it has exited: nothing else to do, and no
        // socket of its own goes to the kernel.
        assert_eq!(h.on(Event::Tick, t1 + ms(10)), []);
        assert_eq!(h.on(Event::Negotiated, t1 + ms(10)), []);
        // It served 100 s: no backoff.
        assert_eq!(h.on(exited(100), t1 + ms(20)), [start(0)]);
        assert_eq!(h.on(Event::Negotiated, t1 + ms(900)), [Action::Reconfigure]);
        assert_eq!(
            h.on(Event::Reconfigured, t1 + ms(900)),
            [Action::Served {
                held: ms(900),
                late: false
            }]
        );
        // A notice while it serves, with nothing stuck, is the next stall.
        assert_eq!(
            h.on(Event::LinkDead, t1 + secs(5)),
            [Action::Kill(Kill::LinkDead)]
        );
    }

    #[test]
    fn a_refused_socket_kills_that_nbdkit_and_counts_as_a_death_at_once() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        h.on(exited(60), t0);
        h.on(Event::LinkDead, t0);
        let mut waits = vec![];
        for i in 0..4 {
            let t = t0 + secs(10 * (i + 1));
            assert_eq!(h.on(Event::Negotiated, t), [Action::Reconfigure]);
            assert_eq!(
                h.on(Event::ReconfigureFailed, t),
                [Action::Kill(Kill::Refused)]
            );
            // However long it took to start, it never served.
            waits.push(h.on(exited(9), t));
        }
        assert_eq!(waits, [[start(0)], [start(0)], [start(250)], [start(500)]]);
        // The kernel keeps the old connection dead: the next socket goes
        // in at once, and serving resets nothing but the phase.
        assert_eq!(
            h.on(Event::Negotiated, t0 + secs(50)),
            [Action::Reconfigure]
        );
        assert!(matches!(
            h.on(Event::Reconfigured, t0 + secs(50))[..],
            [Action::Served { .. }]
        ));
    }

    #[test]
    fn a_first_serving_process_that_never_serves_fails_the_attach() {
        let mut h = Holder::new(DEAD, STOP);
        assert_eq!(h.on(exited(0), Instant::now()), [Action::Fail]);
        // Nothing more after that.
        assert_eq!(h.on(Event::Negotiated, Instant::now()), []);
        assert_eq!(h.on(Event::LinkDead, Instant::now()), []);
    }

    #[test]
    fn the_dead_conn_timeout_is_reported_once_and_the_holder_keeps_trying() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        h.on(exited(100), t0);
        h.on(Event::LinkDead, t0);
        assert_eq!(h.on(Event::Tick, t0 + secs(119)), []);
        assert_eq!(
            h.on(Event::Tick, t0 + DEAD),
            [Action::Expired { down: DEAD }]
        );
        assert_eq!(h.deadline(), None, "reported once");
        assert_eq!(h.on(Event::Tick, t0 + secs(200)), []);
        assert_eq!(
            h.on(Event::Negotiated, t0 + secs(200)),
            [Action::Reconfigure]
        );
        assert_eq!(
            h.on(Event::Reconfigured, t0 + secs(200)),
            [Action::Served {
                held: secs(200),
                late: true
            }]
        );
    }

    #[test]
    fn a_crash_loop_backs_off_and_expires_on_a_death_past_the_deadline() {
        let t0 = Instant::now();
        let mut h = Holder::new(secs(5), STOP);
        h.on(Event::Negotiated, t0);
        let mut waits = vec![];
        for i in 0..5 {
            waits.push(h.on(exited(0), t0 + ms(i * 100)));
        }
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
        h.on(Event::LinkDead, t0 + secs(7));
        h.on(Event::Negotiated, t0 + secs(7));
        h.on(Event::Reconfigured, t0 + secs(7));
        assert_eq!(h.on(exited(60), t0 + secs(67)), [start(0)]);
    }

    #[test]
    fn a_restart_drains_the_server_and_is_no_crash() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        for i in 0..5 {
            let t = t0 + secs(i);
            assert_eq!(h.on(Event::Restart, t), [Action::Drain]);
            // A second request while it drains waits for the same one.
            assert_eq!(h.on(Event::Restart, t), []);
            assert_eq!(h.deadline(), Some(t + STOP));
            // The kernel notices first (its next send failed): the
            // draining nbdkit is let be.
            if i % 2 == 0 {
                assert_eq!(h.on(Event::LinkDead, t), []);
            }
            let acts = h.on(
                Event::ServerExited {
                    lived: ms(10),
                    asked: true,
                },
                t,
            );
            assert_eq!(acts, [start(0)]);
            if i % 2 == 1 {
                assert_eq!(h.on(Event::LinkDead, t), []);
            }
            assert_eq!(h.on(Event::Negotiated, t), [Action::Reconfigure]);
            h.on(Event::Reconfigured, t);
            assert!(h.serving());
        }
        // While down or starting there is nothing to restart.
        h.on(exited(100), t0 + secs(100));
        assert_eq!(
            h.on(Event::Restart, t0 + secs(100)),
            [Action::RefuseRestart]
        );
        let mut h = Holder::new(DEAD, STOP);
        assert_eq!(h.on(Event::Restart, t0), [Action::RefuseRestart]);
    }

    #[test]
    fn a_drain_that_takes_too_long_is_killed_once() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        assert_eq!(h.on(Event::Restart, t0), [Action::Drain]);
        assert_eq!(h.on(Event::Tick, t0 + secs(29)), []);
        assert_eq!(
            h.on(Event::Tick, t0 + STOP),
            [Action::Kill(Kill::StopTimedOut)]
        );
        assert_eq!(h.deadline(), None);
        assert_eq!(h.on(Event::Tick, t0 + secs(40)), []);
        let acts = h.on(
            Event::ServerExited {
                lived: secs(40),
                asked: true,
            },
            t0 + secs(40),
        );
        assert_eq!(acts, [start(0)]);
    }

    #[test]
    fn lost_notices_count_as_a_dead_connection_only_while_it_is_down() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        assert_eq!(h.on(Event::NoticesLost, t0), []);
        assert!(h.serving());
        h.on(exited(60), t0);
        h.on(Event::Negotiated, t0);
        assert_eq!(h.on(Event::NoticesLost, t0), [Action::Reconfigure]);
    }

    #[test]
    fn detach_disconnects_then_kills_a_server_that_does_not_stop() {
        let t0 = Instant::now();
        let mut h = serving(t0);
        assert_eq!(
            h.on(Event::Detach, t0),
            [Action::Disconnect, Action::StopServer]
        );
        // The serving process's exit is no crash now: nothing restarts.
        assert_eq!(h.on(Event::Tick, t0), []);
        assert_eq!(h.on(Event::LinkDead, t0), []);
        assert_eq!(h.deadline(), Some(t0 + STOP));
        assert_eq!(
            h.on(Event::Tick, t0 + STOP),
            [Action::Kill(Kill::StopTimedOut)]
        );
        assert_eq!(h.on(exited(1), t0 + STOP), [Action::Exit]);

        // Detached while down: still disconnected (requests fail at once
        // instead of waiting out the dead-conn timeout).
        let mut h = serving(t0);
        h.on(exited(100), t0);
        assert_eq!(
            h.on(Event::Detach, t0),
            [Action::Disconnect, Action::StopServer]
        );
        assert_eq!(h.deadline(), Some(t0 + STOP), "the stop deadline only");

        // Before anything was connected: only the server to stop.
        let mut h = Holder::new(DEAD, STOP);
        assert_eq!(h.on(Event::Detach, t0), [Action::StopServer]);
        assert_eq!(h.on(exited(0), t0), [Action::Exit]);
    }
}
