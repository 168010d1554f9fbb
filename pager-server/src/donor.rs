//! The donor as a whole: resolved settings, the page pool, request
//! counters, state and utilisation, and the status it publishes. Free of
//! nbdkit so that tests drive it directly; logging goes through the
//! [`Logger`] it is given.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use netpager_metrics::{AtomicHistogram, HistogramSnapshot};
use netpager_proto::v1::{reply, request, Reply, Request};
use netpager_proto::{DonorState, DonorStatus, ExportUsage};
use netpager_util::{format_size, LockExt};

use crate::config::{whole_pages, Compress, Config, Recompress, PAGE_SIZE};
use crate::memwatch::{read_loadavg, read_meminfo, MemInfo};
use crate::ratio::{self, RecentRatio};
use crate::state::{Assessment, Observation, Policy, StateMachine, UtilWindow};
use crate::store::{Pool, StoreError, TICK_MS};

/// Exports one donor serves at most (each costs its shard table).
pub const MAX_EXPORTS: usize = 1024;
/// Pages a poll moves out of a slab being emptied: two slabs' worth (4 MiB
/// copied, about a millisecond of one CPU).
const EVACUATE_PAGES: u64 = 1024;

/// Where the donor's messages go (nbdkit's log in the plugin).
#[derive(Clone, Copy)]
pub struct Logger {
    pub debug: fn(&str),
    pub error: fn(&str),
}

/// Parameters with percentages and defaults resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub node_id: String,
    pub default_size: u64,
    /// Whole pages' worth of the budget= parameter.
    pub budget_bytes: u64,
    pub reserve_bytes: u64,
    pub mlock: bool,
    pub status: Option<String>,
    pub age_x: u64,
    pub u_star: f64,
    pub window: Duration,
    pub busy_load: f64,
    pub shed_load: f64,
    pub poll: Duration,
    pub meminfo: PathBuf,
    pub ncpu: usize,
    pub compress: Compress,
    /// What cold pages are packed again with (off: left as they are), and
    /// when a page is cold.
    pub recompress: Recompress,
    pub recompress_idle: Duration,
    pub recompress_rate: u64,
}

impl Settings {
    pub fn resolve(cfg: &Config, mem: MemInfo, hostname: &str, ncpu: usize) -> Self {
        Settings {
            node_id: cfg.node_id.clone().unwrap_or_else(|| hostname.to_string()),
            default_size: cfg.size,
            budget_bytes: whole_pages(cfg.budget.resolve(mem.total)) * PAGE_SIZE as u64,
            reserve_bytes: cfg.reserve.resolve(mem.total),
            mlock: cfg.mlock,
            status: cfg.status.clone(),
            age_x: cfg.age_x,
            u_star: cfg.u_star,
            window: cfg.window,
            busy_load: cfg.busy_load,
            shed_load: cfg.shed_load.unwrap_or(cfg.busy_load / 2.0),
            poll: cfg.poll,
            meminfo: cfg.meminfo.clone(),
            ncpu: ncpu.max(1),
            compress: cfg.compress,
            // config_complete has refused a recompress= compress= cannot take.
            recompress: cfg.recompressor().unwrap_or(Recompress::Off),
            recompress_idle: cfg.recompress_idle,
            recompress_rate: cfg.recompress_rate,
        }
    }

    /// Refuses a budget the node cannot give: less than a page, or more
    /// memory than the node has (MemTotal), which the donor would
    /// advertise as free and then fail on.
    pub fn check_budget(&self, mem: &MemInfo) -> Result<(), String> {
        if self.budget_bytes == 0 {
            return Err("budget: less than one 4 KiB page; nothing to donate".into());
        }
        if self.budget_bytes > mem.total {
            return Err(format!(
                "budget={} is more than this node's memory (MemTotal {}): it would be advertised as free and fail when used; give a size below MemTotal, or a share such as budget=50%",
                format_size(self.budget_bytes),
                format_size(mem.total)
            ));
        }
        Ok(())
    }

    fn policy(&self) -> Policy {
        Policy {
            reserve: self.reserve_bytes,
            busy_load: self.busy_load,
            shed_load: self.shed_load,
            ncpu: self.ncpu,
        }
    }
}

/// Kinds of request, for the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Trim,
    Zero,
}

impl Op {
    pub const ALL: [Op; 4] = [Op::Read, Op::Write, Op::Trim, Op::Zero];

    /// The lower-case word used in metrics labels.
    pub fn word(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Trim => "trim",
            Op::Zero => "zero",
        }
    }
}

/// Running totals since the donor started.
#[derive(Default)]
pub struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    trims: AtomicU64,
    zeroes: AtomicU64,
    enospc: AtomicU64,
    busy_ns: AtomicU64,
    requests: AtomicU64,
    /// Service time per kind of request, in [`Op::ALL`] order.
    service: [AtomicHistogram; 4],
}

struct Watch {
    machine: StateMachine,
    last: Observation,
    assessment: Assessment,
    util: UtilWindow,
    recent: RecentRatio,
}

pub struct Donor {
    settings: Settings,
    pool: Pool,
    counters: Counters,
    start: Instant,
    log: Logger,
    watch: Mutex<Watch>,
    /// NBD connections open per export name, for status: pages in an
    /// export nobody is connected to belong to a detached device.
    clients: Mutex<BTreeMap<String, u32>>,
}

/// One open NBD connection to an export, counted in the donor's status
/// while it lives.
pub struct Connected {
    donor: Arc<Donor>,
    export: String,
}

impl Drop for Connected {
    fn drop(&mut self) {
        let mut c = self.donor.clients.lock_or_recover();
        if let Some(n) = c.get_mut(&self.export) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.export);
            }
        }
    }
}

impl Donor {
    /// A donor with no pages, judged on `first` (the look taken at start).
    pub fn new(settings: Settings, first: Observation, at: Instant, log: Logger) -> Self {
        let mut machine = StateMachine::default();
        let assessment = machine.assess(&settings.policy(), &first);
        let pool = Pool::new(
            settings.budget_bytes / PAGE_SIZE as u64,
            MAX_EXPORTS,
            settings.compress,
        );
        pool.budget()
            .set_refusing(assessment.state == DonorState::Draining);
        let util = UtilWindow::new(settings.window, settings.ncpu, at, 0, 0);
        log_state(log, None, &assessment);
        Donor {
            settings,
            pool,
            counters: Counters::default(),
            start: at,
            log,
            watch: Mutex::new(Watch {
                machine,
                last: first,
                assessment,
                util,
                recent: RecentRatio::default(),
            }),
            clients: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn log(&self) -> Logger {
        self.log
    }

    /// Counts a connection to export `name` until the guard is dropped.
    pub fn connected(self: &Arc<Self>, name: &str) -> Connected {
        *self
            .clients
            .lock_or_recover()
            .entry(name.to_string())
            .or_default() += 1;
        Connected {
            donor: Arc::clone(self),
            export: name.to_string(),
        }
    }

    /// Age tick of an instant: page stamps are in these units.
    pub fn tick(&self, at: Instant) -> u32 {
        let ms = at.saturating_duration_since(self.start).as_millis() as u64;
        u32::try_from(ms / TICK_MS).unwrap_or(u32::MAX - 1)
    }

    /// Counts one finished request that took `took` to serve.
    pub fn record(&self, op: Op, bytes: u64, took: Duration, result: Result<(), &StoreError>) {
        let c = &self.counters;
        let ns = took.as_nanos() as u64;
        c.busy_ns.fetch_add(ns, Relaxed);
        c.requests.fetch_add(1, Relaxed);
        c.service[op as usize].observe(took);
        match op {
            Op::Read => {
                c.reads.fetch_add(1, Relaxed);
                if result.is_ok() {
                    c.bytes_read.fetch_add(bytes, Relaxed);
                }
            }
            Op::Write => {
                c.writes.fetch_add(1, Relaxed);
                if result.is_ok() {
                    c.bytes_written.fetch_add(bytes, Relaxed);
                }
            }
            Op::Trim => {
                c.trims.fetch_add(1, Relaxed);
            }
            Op::Zero => {
                c.zeroes.fetch_add(1, Relaxed);
            }
        }
        if let Err(e) = result {
            if e.errno() == libc::ENOSPC {
                c.enospc.fetch_add(1, Relaxed);
            }
        }
    }

    fn lock_watch(&self) -> std::sync::MutexGuard<'_, Watch> {
        self.watch.lock_or_recover()
    }

    fn reassess(&self, w: &mut Watch) {
        let next = w.machine.assess(&self.settings.policy(), &w.last);
        self.pool
            .budget()
            .set_refusing(next.state == DonorState::Draining);
        if next.state != w.assessment.state {
            log_state(self.log, Some(w.assessment.state), &next);
        }
        w.assessment = next;
    }

    /// A new look at the node (the watch thread, every poll).
    pub fn observe(&self, mem: MemInfo, load1: f64, at: Instant) {
        let state = {
            let mut w = self.lock_watch();
            w.last = Observation { mem, load1 };
            self.reassess(&mut w);
            self.sample(&mut w, at);
            w.assessment.state
        };
        // The node's owner needs its CPU back while it is busy.
        if self.settings.recompress != Recompress::Off && state != DonorState::Busy {
            self.recompress(at);
        }
        // After the pass: the classes its pages left are emptied into
        // fewer zspages.
        self.tidy();
    }

    /// Gives back the memory that freed pages leave: zspages emptied into
    /// others of their class, then a slab's pages moved into the free
    /// pages of lower slabs, so it is unmapped.
    fn tidy(&self) {
        self.pool.compact();
        self.pool.evacuate(EVACUATE_PAGES);
    }

    /// One pass of the recompressor: at most `recompress-rate` bytes of
    /// cold pages a second of the poll interval.
    fn recompress(&self, at: Instant) {
        let idle = (self.settings.recompress_idle.as_millis() as u64).div_ceil(TICK_MS);
        let Some(before) = u64::from(self.tick(at)).checked_sub(idle) else {
            return; // no page can be that old yet
        };
        let limit = (self.settings.recompress_rate * self.settings.poll.as_millis() as u64 / 1000)
            .div_ceil(PAGE_SIZE as u64)
            .max(1);
        self.pool
            .recompress(self.settings.recompress, before as u32 + 1, limit);
    }

    /// Advances the utilisation window (and tidies) without a new look at
    /// the node.
    pub fn sample_utilisation(&self, at: Instant) {
        self.tidy();
        self.sample(&mut self.lock_watch(), at);
    }

    fn sample(&self, w: &mut Watch, at: Instant) {
        let (busy, reqs) = self.totals();
        w.util.push(at, busy, reqs);
        let (pages, bytes) = self.pool.written();
        w.recent.sample(pages, bytes, PAGE_SIZE as u64);
    }

    /// Starts or lifts an admin drain (DrainCommand).
    pub fn set_admin_drain(&self, drain: bool) {
        let mut w = self.lock_watch();
        w.machine.set_admin_drain(drain);
        self.reassess(&mut w);
    }

    fn totals(&self) -> (u64, u64) {
        (
            self.counters.busy_ns.load(Relaxed),
            self.counters.requests.load(Relaxed),
        )
    }

    /// The status published on the endpoint.
    pub fn status(&self, at: Instant) -> DonorStatus {
        let (state, reason, last, util, recent) = {
            let w = self.lock_watch();
            let (busy, reqs) = self.totals();
            (
                w.assessment.state,
                w.assessment.reason.clone(),
                w.last,
                w.util.measure(at, busy, reqs),
                w.recent.get(),
            )
        };
        let mem_available = last.mem.available;
        let page = PAGE_SIZE as u64;
        let budget = self.pool.budget();
        let used_bytes = budget.used_pages() * page;
        let offer_bytes = crate::state::offer_bytes(
            &self.settings.policy(),
            &last,
            state,
            self.settings.budget_bytes,
            used_bytes,
        );
        let free_bytes = offer_bytes.saturating_sub(used_bytes);
        let usage = self.pool.usage();
        let logical_bytes: u64 = usage.iter().map(|u| u.logical_bytes).sum();
        let offered_ratio = ratio::offered(logical_bytes, used_bytes, recent);
        let now = self.tick(at);
        let age_x_ms = self
            .pool
            .xth_oldest_stamp(self.settings.age_x)
            .map_or(0, |s| u64::from(now.saturating_sub(s)) * TICK_MS);
        let c = &self.counters;
        let clients = self.clients.lock_or_recover().clone();
        let recompressed = self.pool.recompressed();
        DonorStatus {
            node_id: self.settings.node_id.clone(),
            state: state as i32,
            budget_bytes: self.settings.budget_bytes,
            used_bytes,
            free_bytes,
            offer_bytes: Some(offer_bytes),
            exports: usage
                .into_iter()
                .map(|u| ExportUsage {
                    clients: clients.get(&u.name).copied().unwrap_or(0),
                    name: u.name,
                    size_bytes: u.size,
                    used_bytes: u.stored_bytes,
                    logical_bytes: u.logical_bytes,
                    broken: u.broken.unwrap_or_default(),
                })
                .collect(),
            age_x: self.settings.age_x,
            age_x_ms,
            utilisation: util.fraction,
            u_star: self.settings.u_star,
            u_unused: (self.settings.u_star - util.fraction).max(0.0),
            reads: c.reads.load(Relaxed),
            writes: c.writes.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            bytes_written: c.bytes_written.load(Relaxed),
            trims: c.trims.load(Relaxed),
            zeroes: c.zeroes.load(Relaxed),
            enospc: c.enospc.load(Relaxed),
            reserve_bytes: self.settings.reserve_bytes,
            mem_available_bytes: mem_available,
            page_size: page,
            uptime_ms: at.saturating_duration_since(self.start).as_millis() as u64,
            mean_service_us: util.mean_service_us,
            state_reason: reason,
            logical_bytes,
            capacity_bytes: (free_bytes as f64 * offered_ratio) as u64,
            offered_ratio,
            compress: self.settings.compress.word().into(),
            recompress: match self.settings.recompress {
                Recompress::Off => "",
                r => r.word(),
            }
            .into(),
            recompressed_pages: recompressed.pages,
            recompress_saved_bytes: recompressed.saved_bytes,
        }
    }

    /// Service-time histograms, one per kind of request.
    pub fn service_times(&self) -> Vec<(Op, HistogramSnapshot)> {
        Op::ALL
            .iter()
            .map(|&op| (op, self.counters.service[op as usize].snapshot()))
            .collect()
    }

    /// Answers one status-endpoint request.
    pub fn handle(&self, req: Request, at: Instant) -> Reply {
        let body = match req.body {
            Some(request::Body::Status(_)) => reply::Body::Status(self.status(at)),
            Some(request::Body::Drain(d)) => {
                self.set_admin_drain(d.drain);
                reply::Body::Status(self.status(at))
            }
            None => reply::Body::Error(
                "request has no body: expected a status query or a drain command".into(),
            ),
        };
        Reply {
            body: Some(body),
            ..Default::default()
        }
    }
}

fn log_state(log: Logger, from: Option<DonorState>, to: &Assessment) {
    let budget_note = match to.state {
        DonorState::Draining => " (no new pages accepted; stored pages kept)",
        _ => "",
    };
    let msg = match from {
        Some(f) => format!(
            "state {} -> {}{budget_note}: {}",
            f.word(),
            to.state.word(),
            to.reason
        ),
        None => format!("state {}{budget_note}: {}", to.state.word(), to.reason),
    };
    (log.debug)(&msg);
}

/// How the start-up log line names the recompressor's setting.
fn recompress_word(s: &Settings) -> String {
    match s.recompress {
        Recompress::Off => String::new(),
        r => format!(
            " ({} once untouched {} s)",
            r.word(),
            s.recompress_idle.as_secs()
        ),
    }
}

/// Budget figures in words, for the start-up log line.
pub fn describe(s: &Settings) -> String {
    format!(
        "node {}: budget {}, reserve {}, default export size {}, mlock {}, compress {}{}, status {}",
        s.node_id,
        format_size(s.budget_bytes),
        format_size(s.reserve_bytes),
        format_size(s.default_size),
        s.mlock,
        s.compress.word(),
        recompress_word(s),
        s.status.as_deref().unwrap_or("off")
    )
}

/// Starts the watch thread: every poll it re-reads meminfo and the load
/// average and hands them to the donor. A file that cannot be read or
/// parsed (a test rewriting it, say) keeps the previous values and is
/// logged once until it reads well again.
pub fn spawn_watch(donor: Arc<Donor>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("pager-memwatch".into())
        .spawn(move || {
            let mut failing = false;
            loop {
                std::thread::sleep(donor.settings().poll);
                let sample =
                    read_meminfo(&donor.settings().meminfo).and_then(|m| Ok((m, read_loadavg()?)));
                match sample {
                    Ok((mem, load)) => {
                        failing = false;
                        donor.observe(mem, load, Instant::now());
                    }
                    Err(e) => {
                        if !failing {
                            (donor.log().error)(&format!(
                                "memory watch: {e}; keeping the last values"
                            ));
                        }
                        failing = true;
                        donor.sample_utilisation(Instant::now());
                    }
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests;
