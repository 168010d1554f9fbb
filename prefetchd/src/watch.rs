//! Following a donor's life through its status endpoint (pure policy; the
//! daemon's poller threads feed it and carry out what it decides).
//!
//! - A donor that turns `draining` wants its memory back: its lane is
//!   stopped, its blocks forgotten and its export trimmed.
//! - A donor whose status answers again, not draining, after its lane
//!   stopped (drained, failed, or the donor died and came back) gets a
//!   fresh lane: its old pages are never trusted, the new lane starts with
//!   every slot empty.
//! - A donor whose uptime went backwards restarted under a running lane:
//!   the lane is replaced by a fresh one.
//!
//! An unreachable status endpoint decides nothing: a lane that can no
//! longer reach its donor fails by itself on its next request.

/// What one poll of the status endpoint found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Status { draining: bool, uptime_ms: u64 },
    Unreachable,
}

/// What to do with the donor's lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Keep,
    /// Stop the lane: the donor is draining.
    Stop,
    /// Start a fresh lane (none is running).
    Start,
    /// The donor restarted under the running lane: stop it, start a fresh one.
    Restart,
}

/// Where the donor's current lane is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneState {
    Serving,
    /// Failed by itself (an NBD error: the donor died, or refused a write
    /// because it is draining).
    Failed,
    /// Stopped on purpose.
    LetGo,
}

/// The last uptime seen, to notice restarts.
#[derive(Debug, Default, Clone)]
pub struct LaneWatch {
    uptime_ms: Option<u64>,
}

impl LaneWatch {
    /// Decides what a poll means for the donor's current lane.
    pub fn observe(&mut self, lane: LaneState, seen: Seen) -> Decision {
        let Seen::Status {
            draining,
            uptime_ms,
        } = seen
        else {
            return Decision::Keep;
        };
        let restarted = self.uptime_ms.is_some_and(|u| uptime_ms < u);
        self.uptime_ms = Some(uptime_ms);
        match (lane, draining) {
            // A lane that failed on a draining donor is let go too: its
            // export must still be trimmed.
            (LaneState::Serving | LaneState::Failed, true) => Decision::Stop,
            (LaneState::Serving, false) if restarted => Decision::Restart,
            (LaneState::Failed | LaneState::LetGo, false) => Decision::Start,
            _ => Decision::Keep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(draining: bool, uptime_ms: u64) -> Seen {
        Seen::Status {
            draining,
            uptime_ms,
        }
    }

    #[test]
    fn draining_stops_and_recovery_starts_a_fresh_lane() {
        let mut w = LaneWatch::default();
        assert_eq!(
            w.observe(LaneState::Serving, st(false, 1000)),
            Decision::Keep
        );
        assert_eq!(
            w.observe(LaneState::Serving, st(true, 2000)),
            Decision::Stop
        );
        assert_eq!(w.observe(LaneState::LetGo, st(true, 3000)), Decision::Keep);
        assert_eq!(
            w.observe(LaneState::LetGo, st(false, 4000)),
            Decision::Start
        );
        assert_eq!(
            w.observe(LaneState::Serving, st(false, 5000)),
            Decision::Keep
        );
    }

    #[test]
    fn a_donor_that_died_comes_back_when_its_status_answers() {
        let mut w = LaneWatch::default();
        assert_eq!(
            w.observe(LaneState::Serving, st(false, 9000)),
            Decision::Keep
        );
        // The lane failed on an NBD error; the endpoint is gone too.
        assert_eq!(
            w.observe(LaneState::Failed, Seen::Unreachable),
            Decision::Keep
        );
        assert_eq!(
            w.observe(LaneState::Failed, Seen::Unreachable),
            Decision::Keep
        );
        assert_eq!(
            w.observe(LaneState::Failed, st(false, 600)),
            Decision::Start
        );
        // Failed on a draining donor (a refused write): let go, trimmed.
        assert_eq!(w.observe(LaneState::Failed, st(true, 700)), Decision::Stop);
        assert_eq!(w.observe(LaneState::LetGo, st(true, 800)), Decision::Keep);
    }

    #[test]
    fn a_restart_between_two_polls_replaces_the_running_lane() {
        let mut w = LaneWatch::default();
        assert_eq!(
            w.observe(LaneState::Serving, st(false, 9000)),
            Decision::Keep
        );
        assert_eq!(
            w.observe(LaneState::Serving, st(false, 50)),
            Decision::Restart
        );
        assert_eq!(
            w.observe(LaneState::Serving, st(false, 1050)),
            Decision::Keep
        );
        // Unreachable for a while says nothing about a running lane.
        assert_eq!(
            w.observe(LaneState::Serving, Seen::Unreachable),
            Decision::Keep
        );
    }
}
