//! Donors' lanes over their lives: one [`DonorLane`] per life of a donor,
//! and a status poller per donor that has a status endpoint, following
//! [`crate::watch`]'s decisions.
//!
//! Each life of a donor is a lane with its own id (the engine's donor id,
//! its index here): a donor let go and taken back is a new lane with every
//! slot empty, so nothing decided for an earlier life can touch it, and no
//! page written in an earlier life is ever read.
//!
//! Donors join while the daemon runs (a line added to the donors file, a
//! donor discovered: [`crate::membership`]) and leave (a line removed): a
//! donor that leaves is let go as a draining one is, and never taken back.
//!
//! The lanes know the planner only as a [`Planner`]: a lane's life changes
//! what it knows in two ways, a donor forgotten and a donor added.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use netpager_proto::{auth::LabKey, DonorState, StatusClient};

use crate::disk::Disk;
use crate::donor::{DonorArg, DonorError, DonorLane};
use crate::plan::engine::DonorSpec;
use crate::plan::DonorId;
use crate::status::Lane;
use crate::watch::{Decision, LaneState, LaneWatch, Seen};

/// What the lanes ask of the planner (the daemon, which owns them).
pub(crate) trait Planner: Send + Sync {
    /// Forgets everything donor `id` holds; it gets no more requests.
    fn forget_donor(&self, id: DonorId);
    /// Adds a fresh donor; `register` files its lane under the new id
    /// before any request can be made of it.
    fn add_donor(self: Arc<Self>, spec: DonorSpec, register: Box<dyn FnOnce(DonorId) + '_>);
}

/// How a donor joined prefetchd's set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `--donor`.
    Command,
    /// A line of the donors file.
    File,
    /// Announced and verified.
    Discovered,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Command => "command",
            Source::File => "file",
            Source::Discovered => "discovered",
        }
    }
}

/// What starting a lane takes besides the donor's argument.
pub(crate) struct LaneKit {
    pub(crate) block_size: usize,
    /// Bytes of the data directory a donor's replica must hold.
    pub(crate) replica_size: u64,
    pub(crate) disk: Arc<Disk>,
    pub(crate) timeouts: netpager_nbd::Timeouts,
}

impl LaneKit {
    /// Starts lane `id` for donor `arg`.
    pub(crate) fn start(&self, id: usize, arg: &DonorArg) -> Result<Arc<DonorLane>, DonorError> {
        DonorLane::start(
            id,
            arg,
            self.block_size,
            self.replica_size,
            self.disk.clone(),
            self.timeouts,
        )
    }
}

/// A donor of the set, present or gone.
pub(crate) struct Member {
    pub(crate) arg: DonorArg,
    pub(crate) source: Source,
    /// Left the set: let go, polled no more, never taken back.
    pub(crate) removed: bool,
}

/// One life of a donor.
pub(crate) struct LaneRec {
    /// Index of the donor in the set (`--donor` order, then as they joined).
    donor: usize,
    /// 1 for the lane started with the daemon, then 2, 3, ...
    life: u32,
    pub(crate) lane: Arc<DonorLane>,
    /// Why the lane was stopped (None: it runs, or failed by itself).
    ended: Option<&'static str>,
}

/// Every lane, and the pollers.
pub(crate) struct Lanes {
    kit: LaneKit,
    /// The daemon that owns the lanes: weak, so that only its owner keeps
    /// it; a poller finding it gone stops.
    planner: Weak<dyn Planner>,
    members: Mutex<Vec<Member>>,
    recs: Mutex<Vec<LaneRec>>,
    /// Held while a lane is started or let go, so that a donor's poller
    /// and a change of the set never act on one donor at once.
    change: Mutex<()>,
    pub(crate) poll: Duration,
    stopping: Mutex<bool>,
    wake: Condvar,
    pollers: Mutex<Vec<JoinHandle<()>>>,
}

impl Lanes {
    /// The lanes started with the daemon, one per `--donor` in order.
    pub(crate) fn new(
        kit: LaneKit,
        planner: Weak<dyn Planner>,
        args: Vec<DonorArg>,
        first: Vec<Arc<DonorLane>>,
        poll: Duration,
    ) -> Lanes {
        let recs = first
            .into_iter()
            .enumerate()
            .map(|(donor, lane)| LaneRec {
                donor,
                life: 1,
                lane,
                ended: None,
            })
            .collect();
        let members = args
            .into_iter()
            .map(|arg| Member {
                arg,
                source: Source::Command,
                removed: false,
            })
            .collect();
        Lanes {
            kit,
            planner,
            members: Mutex::new(members),
            recs: Mutex::new(recs),
            change: Mutex::new(()),
            poll,
            stopping: Mutex::new(false),
            wake: Condvar::new(),
            pollers: Mutex::new(Vec::new()),
        }
    }

    fn recs(&self) -> std::sync::MutexGuard<'_, Vec<LaneRec>> {
        self.recs.lock().expect("donor lanes lock")
    }

    pub(crate) fn members(&self) -> std::sync::MutexGuard<'_, Vec<Member>> {
        self.members.lock().expect("donor set lock")
    }

    fn changing(&self) -> std::sync::MutexGuard<'_, ()> {
        self.change.lock().expect("donor set change lock")
    }

    /// Each engine donor id's donor name (a donor has one id per life).
    pub(crate) fn names(&self) -> Vec<String> {
        self.recs().iter().map(|r| r.lane.name.clone()).collect()
    }

    /// The lane of engine donor `id`.
    pub(crate) fn get(&self, id: DonorId) -> Arc<DonorLane> {
        self.recs()[id].lane.clone()
    }

    /// The current (latest) life of donor `donor`: its id, lane and state.
    fn current(&self, donor: usize) -> (DonorId, Arc<DonorLane>, LaneState) {
        let recs = self.recs();
        let (id, rec) = recs
            .iter()
            .enumerate()
            .rev()
            .find(|(_, r)| r.donor == donor)
            .expect("every donor has a lane");
        let state = match (rec.ended, rec.lane.failed()) {
            (Some(_), _) => LaneState::LetGo,
            (None, true) => LaneState::Failed,
            (None, false) => LaneState::Serving,
        };
        (id, rec.lane.clone(), state)
    }

    /// Waits `d`, or less if stopping; true when stopping.
    pub(crate) fn sleep(&self, d: Duration) -> bool {
        let stop = self.stopping.lock().expect("poller lock");
        let (stop, _) = self
            .wake
            .wait_timeout_while(stop, d, |s| !*s)
            .expect("poller lock");
        *stop
    }

    /// Stops the pollers, then every lane.
    pub(crate) fn stop(&self) {
        *self.stopping.lock().expect("poller lock") = true;
        self.wake.notify_all();
        for t in self.pollers.lock().expect("pollers lock").drain(..) {
            let _ = t.join();
        }
        let lanes: Vec<Arc<DonorLane>> = self.recs().iter().map(|r| r.lane.clone()).collect();
        for l in lanes {
            l.stop();
        }
    }

    /// Per-lane fields of the status: donor index, life, and state.
    pub(crate) fn describe(&self, id: DonorId, alive: bool) -> Lane {
        let recs = self.recs();
        let r = &recs[id];
        let state = match (r.ended, alive) {
            (Some(why), _) => format!("let go ({why})"),
            (None, true) => "serving".to_owned(),
            (None, false) => "failed".to_owned(),
        };
        let members = self.members();
        Lane {
            name: r.lane.name.clone(),
            donor: r.donor,
            life: r.life,
            state,
            status_endpoint: members[r.donor].arg.status.clone(),
            joined: members[r.donor].source.as_str(),
        }
    }
}

impl Lanes {
    /// Starts a status poller for each donor that has a status endpoint.
    pub(crate) fn start_pollers(self: &Arc<Self>) -> Result<(), DonorError> {
        let n = self.members().len();
        for donor in 0..n {
            self.start_poller(donor)?;
        }
        Ok(())
    }

    /// Starts donor `donor`'s status poller, if it has a status endpoint.
    fn start_poller(self: &Arc<Self>, donor: usize) -> Result<(), DonorError> {
        let arg = self.members()[donor].arg.clone();
        let Some(addr) = arg.status.clone() else {
            return Ok(());
        };
        let client = status_client(&arg, self.connect_timeout())?;
        let me = self.clone();
        let t = std::thread::Builder::new()
            .name(format!("donor{donor}-status"))
            .spawn(move || me.poll_donor(donor, &addr, &client))?;
        self.keep_thread(t);
        Ok(())
    }

    /// Hands a thread to the lanes, joined when they stop.
    pub(crate) fn keep_thread(&self, t: JoinHandle<()>) {
        self.pollers.lock().expect("pollers lock").push(t);
    }

    /// How long connecting to a donor may take.
    pub(crate) fn connect_timeout(&self) -> Duration {
        self.kit.timeouts.connect
    }

    /// Starts a lane for a donor joining the set; returns its index in it.
    pub(crate) fn add_member(
        self: &Arc<Self>,
        arg: DonorArg,
        source: Source,
    ) -> Result<usize, DonorError> {
        let Some(planner) = self.planner.upgrade() else {
            return Err(DonorError::Stopping);
        };
        let _changing = self.changing();
        let next = self.recs().len();
        let lane = self.kit.start(next, &arg)?;
        let donor = {
            let mut m = self.members();
            m.push(Member {
                arg,
                source,
                removed: false,
            });
            m.len() - 1
        };
        tracing::info!(
            "donor {} joined ({}): {} slots{}",
            lane.name,
            source.as_str(),
            lane.slots,
            if lane.has_replica {
                ", with a replica"
            } else {
                ""
            }
        );
        self.register(planner, donor, 1, lane);
        if let Err(e) = self.start_poller(donor) {
            tracing::warn!(
                "donor {donor}: no status poller: {}",
                crate::error_chain(&e)
            );
        }
        Ok(donor)
    }

    /// Tells the planner of life `life` of donor `donor`, filing its lane
    /// under the id the planner gives it.
    fn register(&self, planner: Arc<dyn Planner>, donor: usize, life: u32, lane: Arc<DonorLane>) {
        let spec = DonorSpec {
            slots: lane.slots,
            replica: lane.has_replica,
        };
        planner.add_donor(
            spec,
            Box::new(|id| {
                let mut recs = self.recs();
                debug_assert_eq!(recs.len(), id);
                recs.push(LaneRec {
                    donor,
                    life,
                    lane,
                    ended: None,
                });
            }),
        );
    }

    /// Donor `donor` leaves the set: its lane is let go as a draining
    /// donor's is (blocks forgotten, export trimmed), for good.
    pub(crate) fn remove_member(&self, donor: usize) {
        let Some(planner) = self.planner.upgrade() else {
            return;
        };
        let _changing = self.changing();
        self.members()[donor].removed = true;
        let (id, lane, state) = self.current(donor);
        if state == LaneState::LetGo {
            return;
        }
        self.let_go(&*planner, id, &lane, "removed", true);
    }

    fn poll_donor(self: &Arc<Self>, donor: usize, addr: &str, client: &StatusClient) {
        let mut watch = LaneWatch::default();
        while !self.sleep(self.poll) {
            if self.members()[donor].removed {
                return;
            }
            let seen = match client.query(addr) {
                Ok(s) => Seen::Status {
                    draining: s.state() == DonorState::Draining,
                    uptime_ms: s.uptime_ms,
                },
                Err(e) => {
                    tracing::debug!("donor status {addr}: {e}");
                    Seen::Unreachable
                }
            };
            let Some(planner) = self.planner.upgrade() else {
                return;
            };
            let _changing = self.changing();
            if self.members()[donor].removed {
                return;
            }
            let (id, lane, state) = self.current(donor);
            match watch.observe(state, seen) {
                Decision::Keep => {}
                Decision::Stop => self.let_go(&*planner, id, &lane, "draining", true),
                Decision::Start => self.take_back(planner, donor, &lane),
                Decision::Restart => {
                    self.let_go(&*planner, id, &lane, "restarted", false);
                    self.take_back(planner, donor, &lane);
                }
            }
        }
    }

    /// Stops lane `id`: its blocks are forgotten, what is queued on it
    /// fails (reads go to disk), and with `trim` its export is trimmed so
    /// the donor gets its memory back.
    fn let_go(
        &self,
        planner: &dyn Planner,
        id: DonorId,
        lane: &DonorLane,
        why: &'static str,
        trim: bool,
    ) {
        tracing::info!(
            "donor {}: {why}; its lane stops and its blocks are dropped",
            lane.name
        );
        planner.forget_donor(id);
        lane.stop();
        self.recs()[id].ended = Some(why);
        if trim {
            let bytes = u64::from(lane.slots) * self.kit.block_size as u64;
            if let Err(e) = lane.trim_all(bytes, self.kit.timeouts) {
                tracing::warn!("donor {}: trimming its export: {e}", lane.name);
            }
        }
    }

    /// Starts a fresh lane for donor `donor`, whose last lane is `old`.
    fn take_back(&self, planner: Arc<dyn Planner>, donor: usize, old: &DonorLane) {
        old.stop();
        let arg = self.members()[donor].arg.clone();
        let life = self.recs().iter().filter(|r| r.donor == donor).count() as u32 + 1;
        let next = self.recs().len();
        let lane = match self.kit.start(next, &arg) {
            Ok(l) => l,
            Err(e) => {
                tracing::info!(
                    "donor {}: not back yet: {}",
                    old.name,
                    crate::error_chain(&e)
                );
                return;
            }
        };
        tracing::info!(
            "donor {}: back, a fresh lane of {} empty slots (life {life})",
            lane.name,
            lane.slots
        );
        self.register(planner, donor, life, lane);
    }
}

/// A status client for a donor, with its lab key if it has one.
pub(crate) fn status_client(arg: &DonorArg, timeout: Duration) -> Result<StatusClient, DonorError> {
    let key = match &arg.memory.tls_psk_file {
        Some(psk) => Some(
            LabKey::from_psk_file(psk, arg.memory.tls_username.as_deref()).map_err(|source| {
                DonorError::LabKey {
                    status: arg.status.as_deref().unwrap_or("?").to_owned(),
                    psk: psk.clone(),
                    source,
                }
            })?,
        ),
        None => None,
    };
    Ok(StatusClient { timeout, key })
}
