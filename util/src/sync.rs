//! The one lock-poisoning policy: recover the guard and go on.
//!
//! A lock is poisoned when a thread panics while holding it. In netpager
//! that thread is one request (an nbdkit or FUSE worker, a maintenance
//! pass), and the data behind every lock is kept consistent at each step
//! (placements are journaled before they are published, counters are
//! advisory). Propagating the poison would turn one failed request into a
//! dead device: every later read or write of the swap path would panic too,
//! and a swap device that stops answering wedges the machine. So every
//! lock, read, write and wait takes the guard back from the poison error.

use std::any::Any;
use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// What a panic said (`panic!` with a literal or a formatted message), for
/// the log line or error that reports it; empty for any other payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or_default()
}

/// [`Mutex::lock`] that recovers a poisoned lock (see the module doc).
pub trait LockExt<T: ?Sized> {
    fn lock_or_recover(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn lock_or_recover(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// [`RwLock::read`] and [`RwLock::write`] that recover a poisoned lock.
pub trait RwLockExt<T: ?Sized> {
    fn read_or_recover(&self) -> RwLockReadGuard<'_, T>;
    fn write_or_recover(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_or_recover(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_or_recover(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// [`Condvar::wait`] and [`Condvar::wait_timeout`] that recover a poisoned
/// lock.
pub trait CondvarExt {
    fn wait_or_recover<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T>;
    /// The guard, and whether the wait timed out.
    fn wait_timeout_or_recover<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool);
}

impl CondvarExt for Condvar {
    fn wait_or_recover<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.wait(guard).unwrap_or_else(|p| p.into_inner())
    }

    fn wait_timeout_or_recover<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        let (g, r) = self
            .wait_timeout(guard, timeout)
            .unwrap_or_else(|p| p.into_inner());
        (g, r.timed_out())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    /// Poisons `m` by panicking in a thread that holds it.
    fn poison<T: Send + 'static>(m: &Arc<Mutex<T>>) {
        let m2 = Arc::clone(m);
        let r = thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poisoning the lock on purpose");
        })
        .join();
        assert!(r.is_err() && m.is_poisoned());
    }

    #[test]
    fn a_poisoned_mutex_still_locks_and_keeps_its_data() {
        let m = Arc::new(Mutex::new(7));
        poison(&m);
        *m.lock_or_recover() += 1;
        assert_eq!(*m.lock_or_recover(), 8);
    }

    #[test]
    fn a_poisoned_rwlock_still_reads_and_writes() {
        let l = Arc::new(RwLock::new(vec![1]));
        let l2 = Arc::clone(&l);
        let r = thread::spawn(move || {
            let _g = l2.write().unwrap();
            panic!("poisoning the lock on purpose");
        })
        .join();
        assert!(r.is_err() && l.is_poisoned());
        l.write_or_recover().push(2);
        assert_eq!(*l.read_or_recover(), vec![1, 2]);
    }

    #[test]
    fn waits_on_a_poisoned_mutex_return_the_guard() {
        let m = Arc::new(Mutex::new(false));
        poison(&m);
        let cv = Arc::new(Condvar::new());
        let (m2, cv2) = (Arc::clone(&m), Arc::clone(&cv));
        let setter = thread::spawn(move || {
            *m2.lock_or_recover() = true;
            cv2.notify_all();
        });
        let mut g = m.lock_or_recover();
        while !*g {
            g = cv.wait_or_recover(g);
        }
        drop(g);
        setter.join().unwrap();
        let (g, timed_out) = cv.wait_timeout_or_recover(m.lock_or_recover(), Duration::ZERO);
        assert!(*g && timed_out);
    }
}
