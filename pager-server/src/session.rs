//! Which client session owns a device's export. A device's serving
//! process asks for `CLIENT/DEVICE:SESSION.CONN`: SESSION counts up each
//! time the device is opened, CONN each time the process gives up on its
//! connections to this donor (a request timed out) and opens new ones.
//! The donor remembers the highest (SESSION, CONN) seen per export and
//! refuses the requests of any older one (EPERM), so neither a serving
//! process that was replaced (restarted, or stuck while a new one took
//! over) nor a request still queued on a connection its client gave up on
//! can ever write over newer pages. The model is Ceph's OSD map epochs and
//! md's event counters: the newest claim wins and the loser is told so.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use netpager_util::{LockExt, RwLockExt};

/// A session and connection round, as the export name carries them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Round {
    pub session: u64,
    pub conn: u64,
}

impl std::fmt::Display for Round {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.session, self.conn)
    }
}

/// A request of a session (or connection round) that a newer one replaced.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "export {export}: session {round} is fenced: session {owner} of the same device owns it now \
     (a newer serving process, or newer connections of the same one, took it over)"
)]
pub struct Fenced {
    pub export: String,
    pub round: Round,
    pub owner: Round,
}

impl Fenced {
    pub fn errno(&self) -> i32 {
        libc::EPERM
    }
}

/// The owning round of every export that was opened with one.
#[derive(Default)]
pub struct Sessions {
    owners: Mutex<HashMap<String, Arc<RwLock<Round>>>>,
}

/// One connection's claim on an export.
pub struct Claim {
    export: String,
    round: Round,
    owner: Arc<RwLock<Round>>,
}

impl Sessions {
    /// `round` opens `export`: it owns it from now on unless a newer one
    /// already does. Waits for requests of an older round under way, so
    /// none of them lands after this returns. An older round's connection
    /// opens all the same and has each request refused (EPERM): nbdkit
    /// answers a failed open with "no such export", which would tell its
    /// client nothing, while a refused request says it was replaced.
    pub fn claim(&self, export: &str, round: Round) -> Claim {
        let owner = Arc::clone(
            self.owners
                .lock_or_recover()
                .entry(export.to_string())
                .or_default(),
        );
        let mut o = owner.write_or_recover();
        if *o < round {
            *o = round;
        }
        drop(o);
        Claim {
            export: export.to_string(),
            round,
            owner,
        }
    }

    /// The owning round of each export that has one.
    pub fn owners(&self) -> Vec<(String, Round)> {
        let mut v: Vec<(String, Round)> = self
            .owners
            .lock_or_recover()
            .iter()
            .map(|(k, o)| (k.clone(), *o.read_or_recover()))
            .collect();
        v.sort();
        v
    }
}

impl Claim {
    /// Holds the export for one request if the round still owns it: a
    /// newer claim waits until the guard is dropped.
    pub fn hold(&self) -> Result<RwLockReadGuard<'_, Round>, Fenced> {
        let o = self.owner.read_or_recover();
        if *o > self.round {
            return Err(Fenced {
                export: self.export.clone(),
                round: self.round,
                owner: *o,
            });
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(session: u64, conn: u64) -> Round {
        Round { session, conn }
    }

    #[test]
    fn the_newest_round_wins_and_older_ones_are_told() {
        let s = Sessions::default();
        let old = s.claim("c/d", r(3, 0));
        let same = s.claim("c/d", r(3, 0));
        assert!(old.hold().is_ok() && same.hold().is_ok());
        let other = s.claim("c/e", r(1, 0));
        // New connections of the same session fence its old ones.
        let next = s.claim("c/d", r(3, 1));
        let f = old.hold().unwrap_err();
        assert_eq!((f.round, f.owner), (r(3, 0), r(3, 1)));
        assert!(next.hold().is_ok());
        let new = s.claim("c/d", r(4, 0));
        assert!(new.hold().is_ok() && next.hold().is_err());
        let f = old.hold().unwrap_err();
        assert!(
            f.to_string().contains("session 3.0 is fenced: session 4.0"),
            "{f}"
        );
        assert_eq!(f.errno(), libc::EPERM);
        // An older round opens but is refused every request; other exports
        // are untouched.
        let again = s.claim("c/d", r(3, 5)).hold().err().unwrap();
        assert_eq!((again.round, again.owner), (r(3, 5), r(4, 0)));
        assert!(other.hold().is_ok());
        assert_eq!(
            s.owners(),
            vec![("c/d".into(), r(4, 0)), ("c/e".into(), r(1, 0))]
        );
    }
}
