//! DNS-SD over multicast DNS on the local segment, through the `mdns-sd`
//! crate: [`Browser`] keeps what is announced now, [`Announcer`] announces
//! a donor until dropped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mdns_sd::{DaemonEvent, Receiver, ServiceDaemon, ServiceEvent, ServiceInfo};
use netpager_util::LockExt;

use super::{txt_record, Announced, DiscoveryError, Seen, SERVICE_TYPE};

/// How long [`Browser`]'s drop and [`Announcer`]'s drop wait for the mDNS
/// thread to say goodbye.
const STOP_WAIT: Duration = Duration::from_secs(2);
/// How often the browser's thread looks whether it should stop.
const POLL: Duration = Duration::from_millis(200);

/// Browses [`SERVICE_TYPE`] on every non-loopback interface until dropped.
pub struct Browser {
    daemon: ServiceDaemon,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Browser {
    pub fn start() -> Result<Browser, DiscoveryError> {
        let daemon = ServiceDaemon::new().map_err(|e| DiscoveryError::Start(e.to_string()))?;
        let events = daemon
            .browse(SERVICE_TYPE)
            .map_err(|e| DiscoveryError::Browse(e.to_string()))?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (Arc::clone(&seen), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("discovery".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    match events.recv_timeout(POLL) {
                        Ok(ev) => apply(&s, ev),
                        Err(mdns_sd::RecvTimeoutError::Timeout) => {}
                        Err(mdns_sd::RecvTimeoutError::Disconnected) => break,
                    }
                }
            })
            .map_err(|e| DiscoveryError::Start(e.to_string()))?;
        Ok(Browser {
            daemon,
            seen,
            stop,
            thread: Some(thread),
        })
    }

    /// Donors announced now, one per node id (latest address), without blocking.
    pub fn announced(&self) -> Vec<Announced> {
        self.seen.lock_or_recover().announced()
    }
}

fn apply(seen: &Mutex<Seen>, ev: ServiceEvent) {
    match ev {
        ServiceEvent::ServiceResolved(r) => {
            let txt = r.txt_properties.clone().into_property_map_str();
            let addrs = r.addresses.iter().map(|a| a.to_ip_addr());
            if let Err(e) = seen.lock_or_recover().resolved(&r.fullname, &txt, addrs) {
                tracing::warn!("discovery: ignored: {e}");
            }
        }
        ServiceEvent::ServiceRemoved(_, fullname) => seen.lock_or_recover().removed(&fullname),
        _ => {}
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Ok(done) = self.daemon.shutdown() {
            let _ = done.recv_timeout(STOP_WAIT);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long [`Announcer`]'s drop waits for an announcement still being
/// probed (three probes 250 ms apart, then the announcement).
const ANNOUNCE_WAIT: Duration = Duration::from_secs(3);
/// mdns-sd probes and announces on each interface (loopback too) on its
/// own schedule, each started with up to 250 ms of jitter: an interface
/// not announced this long after the last one was is taken as done.
const ANNOUNCE_SPREAD: Duration = Duration::from_millis(500);

/// A donor's announcement, withdrawn (a goodbye packet) when dropped.
pub struct Announcer {
    daemon: ServiceDaemon,
    fullname: String,
    /// The daemon's events: whether the announcement has gone out.
    events: Option<Receiver<DaemonEvent>>,
    started: Instant,
}

impl Announcer {
    /// Announces donor `node_id` with its NBD and status ports, on every
    /// non-loopback interface and the addresses they have now and later.
    pub fn start(
        node_id: &str,
        nbd_port: u16,
        status_port: u16,
    ) -> Result<Announcer, DiscoveryError> {
        let failed = |why: String| DiscoveryError::Announce {
            instance: node_id.to_string(),
            why,
        };
        let daemon = ServiceDaemon::new().map_err(|e| DiscoveryError::Start(e.to_string()))?;
        let txt = txt_record(node_id, nbd_port, status_port);
        let info = ServiceInfo::new(
            SERVICE_TYPE,
            node_id,
            &host_label(node_id),
            (),
            nbd_port,
            &txt[..],
        )
        .map_err(|e| failed(e.to_string()))?
        .enable_addr_auto();
        let fullname = info.get_fullname().to_string();
        let events = daemon.monitor().ok();
        let started = Instant::now();
        if let Err(e) = daemon.register(info) {
            let _ = daemon.shutdown();
            return Err(failed(e.to_string()));
        }
        Ok(Announcer {
            daemon,
            fullname,
            events,
            started,
        })
    }

    /// Waits, at most [`ANNOUNCE_WAIT`], until the announcement has gone
    /// out on every interface. A goodbye sent while the daemon still
    /// probes withdraws records no browser has; mdns-sd's browser caches
    /// them for a second, and takes an announcement in that second (the
    /// donor started again at once) as a refresh of them: the instance is
    /// never resolved, and the donor stays unseen for as long as its
    /// records live (the nemesis's "announce-stranger; unannounce aw;
    /// announce-stranger"). The daemon reports one announcement per
    /// interface, and the interfaces are its own to list: after the first,
    /// the others are waited for until none came for [`ANNOUNCE_SPREAD`].
    fn wait_announced(&mut self) {
        let Some(events) = self.events.take() else {
            return;
        };
        let end = self.started + ANNOUNCE_WAIT;
        let mut deadline = end;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match events.recv_timeout(left) {
                // This daemon announces only this donor.
                Ok(DaemonEvent::Announce(..)) => {
                    deadline = end.min(Instant::now() + ANNOUNCE_SPREAD);
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }
}

impl Drop for Announcer {
    fn drop(&mut self) {
        self.wait_announced();
        if let Ok(done) = self.daemon.unregister(&self.fullname) {
            let _ = done.recv_timeout(STOP_WAIT);
        }
        if let Ok(done) = self.daemon.shutdown() {
            let _ = done.recv_timeout(STOP_WAIT);
        }
    }
}

/// The host name in the SRV record, in `.local.`. Browsers reach the donor
/// by the addresses announced with it, not by this name.
fn host_label(node_id: &str) -> String {
    format!("{}-netpager.local.", super::node_label(node_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_labels_are_dns_labels() {
        assert_eq!(host_label("idle1"), "idle1-netpager.local.");
        assert_eq!(host_label("rack2.d_1"), "rack2-d-1-netpager.local.");
    }
}
