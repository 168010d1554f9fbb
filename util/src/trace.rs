//! A request's clock: the instants at which it passed each hop the serving
//! process sees, kept per thread, since a request runs start to end on the
//! thread that took it from the kernel. The front end starts it
//! ([`start`]), the layers below mark what they see ([`mark`], [`sent`],
//! [`replied`]) and the front end takes the marks at the end ([`finish`])
//! to count each stage's time (`pager_client::stages`). A thread with no
//! clock started pays one thread-local load per mark.

use std::cell::Cell;
use std::time::Instant;

/// The hops of a request, in the order it passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// Taken from the kernel (off the FUSE ring, or read from /dev/fuse).
    Taken = 0,
    /// Handed to the layer below the front end (the write-back buffer, or
    /// the device).
    Device,
    /// Its first request to a donor went out.
    Sent,
    /// Its last donor reply was read off the socket (by whichever thread
    /// read replies then).
    Replied,
    /// The thread that waits for that reply runs again.
    Resumed,
    /// The device (or the buffer) returned.
    Done,
    /// Its reply is committed to the kernel.
    Committed,
}

/// How many marks a request has.
pub const MARKS: usize = 7;

/// The instants a request passed each mark at (`None`: it did not pass
/// it, e.g. a read of a page nobody wrote never reaches a donor).
pub type Marks = [Option<Instant>; MARKS];

struct Clock {
    on: Cell<bool>,
    at: [Cell<Option<Instant>>; MARKS],
}

thread_local! {
    static CLOCK: Clock = const {
        Clock {
            on: Cell::new(false),
            at: [const { Cell::new(None) }; MARKS],
        }
    };
}

/// Starts this thread's clock for a request taken from the kernel at `taken`.
pub fn start(taken: Instant) {
    CLOCK.with(|c| {
        for a in &c.at {
            a.set(None);
        }
        c.at[Mark::Taken as usize].set(Some(taken));
        c.on.set(true);
    });
}

/// Marks `m` now, if a clock runs on this thread.
pub fn mark(m: Mark) {
    CLOCK.with(|c| {
        if c.on.get() {
            c.at[m as usize].set(Some(Instant::now()));
        }
    });
}

/// A request to a donor went out: marks [`Mark::Sent`] the first time.
pub fn sent() {
    CLOCK.with(|c| {
        let s = &c.at[Mark::Sent as usize];
        if c.on.get() && s.get().is_none() {
            s.set(Some(Instant::now()));
        }
    });
}

/// A donor's reply read at `read_at` reached its waiter, now: marks
/// [`Mark::Replied`] and [`Mark::Resumed`] (the last reply's count).
pub fn replied(read_at: Instant) {
    CLOCK.with(|c| {
        if c.on.get() {
            c.at[Mark::Replied as usize].set(Some(read_at));
            c.at[Mark::Resumed as usize].set(Some(Instant::now()));
        }
    });
}

/// Whether a clock runs on this thread (the mux stamps a reply's read
/// time only for a waiter that will take it).
pub fn running() -> bool {
    CLOCK.with(|c| c.on.get())
}

/// Stops this thread's clock and returns its marks (`None` if none ran).
pub fn finish() -> Option<Marks> {
    CLOCK.with(|c| {
        if !c.on.replace(false) {
            return None;
        }
        Some(std::array::from_fn(|i| c.at[i].get()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_only_while_started() {
        mark(Mark::Device);
        sent();
        assert_eq!(finish(), None);
        let t0 = Instant::now();
        start(t0);
        mark(Mark::Device);
        sent();
        let first = CLOCK.with(|c| c.at[Mark::Sent as usize].get());
        sent();
        replied(t0);
        let m = finish().expect("started");
        assert_eq!(m[Mark::Taken as usize], Some(t0));
        assert_eq!(m[Mark::Sent as usize], first, "the first send counts");
        assert_eq!(m[Mark::Replied as usize], Some(t0));
        assert!(m[Mark::Resumed as usize].is_some());
        assert_eq!(m[Mark::Committed as usize], None);
        assert_eq!(finish(), None, "finish stops the clock");
        start(t0);
        assert_eq!(
            finish().unwrap()[Mark::Device as usize],
            None,
            "start clears"
        );
    }
}
