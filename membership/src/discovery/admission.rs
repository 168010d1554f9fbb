//! Checking announced donors off the epoch thread: an announcement costs a
//! status query (a connect timeout when nobody answers), so a flood of
//! bogus or unreachable announcements must not stretch the epochs that
//! drive heartbeats and failure detection. [`Admission`] runs the checks on
//! its own thread, several at once, and keeps a verdict per announced donor
//! ([`Verdicts`]): an admitted one is checked again after [`RECHECK`], a
//! refused one after a backoff that doubles with each refusal up to
//! [`MAX_RETRY`]. The epoch thread only reads the verdicts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netpager_util::LockExt;

use super::{Announced, Expired, Round};

/// Whether an announced donor may join, and why (`admit`'s answer).
pub type Verdict = Result<&'static str, String>;

/// An admitted donor is checked again this long after its last check.
pub const RECHECK: Duration = Duration::from_secs(60);
/// A refused donor's first retry; each further refusal doubles it.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);
pub const MAX_RETRY: Duration = Duration::from_secs(300);
/// Checks run at once.
const CHECKERS: usize = 8;
const CHECKER_STACK: usize = 256 << 10;

/// The wait before checking a donor again after `failures` refusals in a row.
pub fn backoff(failures: u32) -> Duration {
    FIRST_RETRY
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(MAX_RETRY)
}

#[derive(Debug, Clone)]
struct Entry {
    a: Announced,
    verdict: Verdict,
    failures: u32,
    due: Instant,
}

/// The verdict on each announced donor, by node id, and when it is due to
/// be checked again. Pure: the caller says what time it is.
#[derive(Debug, Default)]
pub struct Verdicts {
    by_node: BTreeMap<String, Entry>,
}

impl Verdicts {
    /// Of `announced`, those to check now: new ones first (never checked,
    /// or announced at another address since), then those due again.
    pub fn due(&self, announced: &[Announced], now: Instant) -> Vec<Announced> {
        let (mut new, mut again) = (Vec::new(), Vec::new());
        for a in announced {
            match self.by_node.get(&a.node_id) {
                Some(e) if e.a == *a => {
                    if now >= e.due {
                        again.push(a.clone());
                    }
                }
                _ => new.push(a.clone()),
            }
        }
        new.extend(again);
        new
    }

    /// The outcome of checking `a` at `now`.
    pub fn record(&mut self, a: Announced, verdict: Verdict, now: Instant) {
        let failures = match (&verdict, self.by_node.get(&a.node_id)) {
            (Ok(_), _) => 0,
            (Err(_), Some(e)) if e.a == a => e.failures.saturating_add(1),
            (Err(_), _) => 1,
        };
        let due = now
            + if failures == 0 {
                RECHECK
            } else {
                backoff(failures)
            };
        self.by_node.insert(
            a.node_id.clone(),
            Entry {
                a,
                verdict,
                failures,
                due,
            },
        );
    }

    /// An admitted donor that could not join (its NBD port did not answer,
    /// the set refused it): refused until it is checked again, with the
    /// backoff of a refusal.
    pub fn not_added(&mut self, node: &str, why: String, now: Instant) {
        if let Some(a) = self.by_node.get(node).map(|e| e.a.clone()) {
            self.record(a, Err(why), now);
        }
    }

    /// Forgets donors no longer announced.
    pub fn retain(&mut self, announced: &[Announced]) {
        self.by_node
            .retain(|node, _| announced.iter().any(|a| &a.node_id == node));
    }

    /// Every donor checked, with its verdict, by node id.
    pub fn current(&self) -> Vec<(Announced, Verdict)> {
        self.by_node
            .values()
            .map(|e| (e.a.clone(), e.verdict.clone()))
            .collect()
    }
}

#[derive(Debug, Default)]
struct State {
    verdicts: Verdicts,
    /// What the sources said went wrong in their last round.
    errors: Vec<String>,
    /// Records past their lease in the last round: never checked.
    expired: Vec<Expired>,
}

/// Checks announced donors on its own thread until dropped.
pub struct Admission {
    state: Arc<Mutex<State>>,
    /// Rounds completed (sources asked, due donors checked), and its signal.
    rounds: Arc<(Mutex<u64>, Condvar)>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Admission {
    /// Every `period`, asks `sources` what is announced (and what went
    /// wrong finding out, what is expired) and runs `check` on each donor
    /// that is due.
    pub fn start<S, R, C>(mut sources: S, check: C, period: Duration) -> std::io::Result<Admission>
    where
        S: FnMut() -> R + Send + 'static,
        R: Into<Round>,
        C: Fn(&Announced) -> Verdict + Send + Sync + 'static,
    {
        let state = Arc::new(Mutex::new(State::default()));
        let rounds = Arc::new((Mutex::new(0u64), Condvar::new()));
        let (stop, stopped) = mpsc::channel::<()>();
        let (st, done) = (Arc::clone(&state), Arc::clone(&rounds));
        let thread = std::thread::Builder::new()
            .name("admission".into())
            .spawn(move || loop {
                let round: Round = sources().into();
                let due = {
                    let mut s = st.lock_or_recover();
                    s.verdicts.retain(&round.announced);
                    s.errors = round.errors;
                    s.expired = round.expired;
                    s.verdicts.due(&round.announced, Instant::now())
                };
                run_checks(&due, &check, &st, &stopped);
                *done.0.lock_or_recover() += 1;
                done.1.notify_all();
                match stopped.recv_timeout(period) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    _ => break,
                }
            })?;
        Ok(Admission {
            state,
            rounds,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The verdict on each donor announced now and checked, by node id.
    pub fn verdicts(&self) -> Vec<(Announced, Verdict)> {
        self.state.lock_or_recover().verdicts.current()
    }

    /// See [`Verdicts::not_added`].
    pub fn not_added(&self, node: &str, why: String) {
        self.state
            .lock_or_recover()
            .verdicts
            .not_added(node, why, Instant::now());
    }

    /// What went wrong in the sources' last round (a DNS server that does
    /// not answer), empty when nothing did.
    pub fn source_errors(&self) -> Vec<String> {
        self.state.lock_or_recover().errors.clone()
    }

    /// Donors whose records were past their lease in the last round.
    pub fn expired(&self) -> Vec<Expired> {
        self.state.lock_or_recover().expired.clone()
    }

    /// Rounds completed so far: the sources asked and the donors due
    /// then checked.
    pub fn rounds(&self) -> u64 {
        *self.rounds.0.lock_or_recover()
    }

    /// Waits until more than `seen` rounds have completed, at most
    /// `timeout`; the rounds completed then.
    pub fn wait_round(&self, seen: u64, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.rounds;
        let mut n = lock.lock_or_recover();
        while *n <= seen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            n = match cv.wait_timeout(n, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        *n
    }
}

/// Checks `due` on up to [`CHECKERS`] threads, each taking the next donor
/// when done with one, until all are checked or the admission stops.
fn run_checks<C>(due: &[Announced], check: &C, st: &Mutex<State>, stopped: &mpsc::Receiver<()>)
where
    C: Fn(&Announced) -> Verdict + Sync,
{
    let next = AtomicUsize::new(0);
    let stopping = Mutex::new(false);
    let work = || {
        while let Some(a) = due.get(next.fetch_add(1, Ordering::Relaxed)) {
            if *stopping.lock_or_recover() {
                return;
            }
            let v = check(a);
            st.lock_or_recover()
                .verdicts
                .record(a.clone(), v, Instant::now());
        }
    };
    std::thread::scope(|s| {
        for _ in 0..CHECKERS.min(due.len()) {
            let spawned = std::thread::Builder::new()
                .name("admission-check".into())
                .stack_size(CHECKER_STACK)
                .spawn_scoped(s, work);
            if spawned.is_err() {
                work();
            }
        }
        // Stop taking new donors as soon as the admission is dropped.
        while next.load(Ordering::Relaxed) < due.len() {
            if !matches!(
                stopped.recv_timeout(Duration::from_millis(50)),
                Err(mpsc::RecvTimeoutError::Timeout)
            ) {
                *stopping.lock_or_recover() = true;
                break;
            }
        }
    });
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(node: &str, port: u16) -> Announced {
        Announced {
            node_id: node.into(),
            nbd: format!("127.0.0.1:{port}").parse().unwrap(),
            status: format!("127.0.0.1:{}", port + 1).parse().unwrap(),
        }
    }

    #[test]
    fn refused_donors_back_off_and_admitted_ones_wait_for_the_recheck() {
        let t0 = Instant::now();
        let (good, bad) = (a("good", 10), a("bad", 20));
        let mut v = Verdicts::default();
        let both = [good.clone(), bad.clone()];
        assert_eq!(v.due(&both, t0).len(), 2);
        v.record(good.clone(), Ok("verified"), t0);
        v.record(bad.clone(), Err("refused".into()), t0);
        assert!(v.due(&both, t0).is_empty());
        assert_eq!(v.due(&both, t0 + FIRST_RETRY), vec![bad.clone()]);
        // Each refusal doubles the wait, up to the cap.
        let mut at = t0;
        for n in 2..=12u32 {
            at += backoff(n - 1);
            v.record(bad.clone(), Err("refused".into()), at);
            assert_eq!(
                v.due(
                    std::slice::from_ref(&bad),
                    at + backoff(n) - Duration::from_millis(1)
                ),
                vec![]
            );
        }
        assert_eq!(backoff(2), 2 * FIRST_RETRY);
        assert_eq!(backoff(40), MAX_RETRY);
        assert_eq!(v.due(&both, t0 + RECHECK), vec![good.clone()]);
        // Announced at another address: checked at once, its count reset.
        let moved = a("bad", 30);
        assert_eq!(v.due(std::slice::from_ref(&moved), at), vec![moved.clone()]);
        v.record(moved.clone(), Err("refused".into()), at);
        assert_eq!(v.due(&[moved], at + FIRST_RETRY).len(), 1);
        // Admitted but not added: refused with a backoff, saying why.
        v.not_added("good", "connection refused".into(), t0);
        let cur = v.current();
        assert_eq!(cur[1].0.node_id, "good");
        assert_eq!(cur[1].1, Err("connection refused".into()));
        assert!(v.due(std::slice::from_ref(&good), t0).is_empty());
        v.retain(&[good]);
        assert_eq!(v.current().len(), 1);
    }

    #[test]
    fn checks_run_on_the_admission_thread_and_reading_verdicts_never_waits_for_one() {
        let flood: Vec<Announced> = (0..40)
            .map(|i| a(&format!("fake{i:02}"), 100 + 2 * i))
            .collect();
        // Every check blocks until the test lets them go: a donor that
        // never answers.
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let (g, src) = (Arc::clone(&gate), flood.clone());
        let adm = Admission::start(
            move || (src.clone(), vec!["dns: timed out".into()]),
            move |_| {
                let (open, cv) = &*g;
                let mut o = open.lock_or_recover();
                while !*o {
                    o = cv.wait(o).unwrap();
                }
                Err("no answer".into())
            },
            Duration::from_millis(10),
        )
        .unwrap();
        let wait = |what: &str, done: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !done() {
                assert!(Instant::now() < deadline, "{what}");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        wait("the sources' first round", &|| {
            !adm.source_errors().is_empty()
        });
        // A round ends once its checks are done: none has yet.
        assert_eq!(adm.rounds(), 0);
        assert_eq!(adm.wait_round(0, Duration::from_millis(1)), 0);
        // Checks are stuck, and the verdicts can still be read.
        assert!(adm.verdicts().is_empty());
        *gate.0.lock_or_recover() = true;
        gate.1.notify_all();
        wait("every donor checked", &|| {
            adm.verdicts().len() == flood.len()
        });
        assert!(adm.wait_round(0, Duration::from_secs(60)) >= 1);
        assert!(adm
            .verdicts()
            .iter()
            .all(|(_, v)| v == &Err("no answer".to_string())));
        assert_eq!(adm.source_errors(), vec!["dns: timed out".to_string()]);
        drop(adm);
    }
}
