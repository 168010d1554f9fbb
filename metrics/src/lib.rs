//! The `/metrics` endpoints of the donor, the client and prefetchd, which
//! Prometheus scrapes over HTTP.
//!
//! Each daemon builds an [`Exposition`] from a snapshot of its counters at
//! every scrape (the values already exist for `status`; nothing here sits
//! on an I/O path except [`AtomicHistogram::observe`], which only adds to
//! atomics). `prometheus-client` writes the OpenMetrics text; scrapers that
//! do not ask for OpenMetrics (curl, `promtool check metrics`) get the
//! same families in Prometheus's text format 0.0.4.
//!
//! Access follows the status endpoint's rule: loopback by default; on a
//! network address only with the lab key, whose derived bearer token
//! ([`LabKey::metrics_token`]) every request must present, or with an
//! explicit `insecure=true`.

use std::collections::HashSet;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry, Unit};

use netpager_proto::auth::{AuthError, LabKey};
use netpager_util::LockExt;

/// The base units families are in; each appends its name (`_bytes`...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseUnit {
    Bytes,
    Seconds,
    Ratio,
}

impl BaseUnit {
    fn unit(self) -> Unit {
        match self {
            BaseUnit::Bytes => Unit::Bytes,
            BaseUnit::Seconds => Unit::Seconds,
            BaseUnit::Ratio => Unit::Other("ratio".into()),
        }
    }
}

/// Label pairs of one sample.
pub type Labels = Vec<(String, String)>;

/// Connections served at once; more are closed unanswered.
pub const MAX_CONNECTIONS: usize = 8;
/// Longest request head accepted (request line and headers).
pub const MAX_HEAD_BYTES: usize = 8192;
/// Every read and write of a connection, and the connection as a whole.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(10);

/// Number of finite histogram buckets.
pub const BUCKETS: usize = 18;

/// Upper bounds of the histogram buckets in nanoseconds: 10 µs doubling to
/// 1.31 s, which spans a page served from a donor's RAM up to a request
/// that waits out a donor's failure.
pub const BUCKET_BOUNDS_NS: [u64; BUCKETS] = doubling(10_000);

/// `N` bounds from `first` nanoseconds, each twice the one before.
const fn doubling<const N: usize>(first: u64) -> [u64; N] {
    let mut b = [0u64; N];
    let mut i = 0;
    while i < N {
        b[i] = first << i;
        i += 1;
    }
    b
}

/// Finite buckets of a stage histogram ([`AtomicHistogram::stages`]).
pub const STAGE_BUCKETS: usize = 23;

/// Upper bounds of a stage histogram's buckets in nanoseconds: 250 ns
/// doubling to 1.05 s. A request's hops inside one process (a hand-off
/// between threads, a copy, a commit) take from a few hundred nanoseconds
/// to tens of microseconds, below the request histograms' first bucket.
pub const STAGE_BOUNDS_NS: [u64; STAGE_BUCKETS] = doubling(250);

/// A latency histogram that request threads update with relaxed atomic
/// adds only: no lock and no allocation, so it may sit on the swap path.
#[derive(Debug)]
pub struct AtomicHistogram {
    /// Upper bounds of the finite buckets.
    bounds: &'static [u64],
    /// Per bucket (not cumulative); the one after the last bound is +Inf.
    counts: [AtomicU64; STAGE_BUCKETS + 1],
    sum_ns: AtomicU64,
}

impl Default for AtomicHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl AtomicHistogram {
    /// A request histogram ([`BUCKET_BOUNDS_NS`]).
    pub const fn new() -> Self {
        Self::with_bounds(&BUCKET_BOUNDS_NS)
    }

    /// A stage histogram ([`STAGE_BOUNDS_NS`]).
    pub const fn stages() -> Self {
        Self::with_bounds(&STAGE_BOUNDS_NS)
    }

    const fn with_bounds(bounds: &'static [u64]) -> Self {
        AtomicHistogram {
            bounds,
            counts: [const { AtomicU64::new(0) }; STAGE_BUCKETS + 1],
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let i = self.bounds.partition_point(|&b| b < ns);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    /// The histogram as Prometheus shows it: cumulative buckets in seconds.
    /// Concurrent updates may land between loads; each count is still one
    /// that was true at some moment, which is all a scrape promises.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(self.bounds.len() + 1);
        for (i, c) in self.counts[..=self.bounds.len()].iter().enumerate() {
            cumulative += c.load(Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or(f64::INFINITY, |&ns| ns as f64 / 1e9);
            buckets.push((le, cumulative));
        }
        HistogramSnapshot {
            sum_seconds: self.sum_ns.load(Relaxed) as f64 / 1e9,
            count: cumulative,
            buckets,
        }
    }
}

const _: () = assert!(BUCKETS <= STAGE_BUCKETS, "counts hold either kind");

/// One histogram at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistogramSnapshot {
    pub sum_seconds: f64,
    pub count: u64,
    /// `(upper bound in seconds, cumulative count)`, the last bound +Inf.
    pub buckets: Vec<(f64, u64)>,
}

impl HistogramSnapshot {
    /// A histogram as a status file keeps it: cumulative counts within each
    /// of `bounds_ns`, then of all.
    pub fn from_counts(
        bounds_ns: &[u64],
        sum_seconds: f64,
        count: u64,
        cumulative: &[u64],
    ) -> Self {
        let bounds = bounds_ns
            .iter()
            .map(|&ns| ns as f64 / 1e9)
            .chain(std::iter::once(f64::INFINITY));
        HistogramSnapshot {
            sum_seconds,
            count,
            buckets: bounds.zip(cumulative.iter().copied()).collect(),
        }
    }

    /// The smallest bucket bound under which at least `q` (0..1) of the
    /// observations fall, in seconds: an upper estimate of that quantile.
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let want = (q * self.count as f64).ceil().max(1.0) as u64;
        self.buckets
            .iter()
            .find(|(_, c)| *c >= want)
            .map(|(le, _)| *le)
    }
}

/// A sample value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    Int(u64),
    Float(f64),
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Int(u64::from(v))
    }
}

/// The samples of one counter or gauge family, in the order given.
#[derive(Debug)]
struct Samples {
    kind: MetricType,
    values: Vec<(Labels, Value)>,
}

fn encode_value(e: &mut MetricEncoder, kind: MetricType, v: Value) -> fmt::Result {
    match (kind, v) {
        (MetricType::Counter, Value::Int(i)) => e.encode_counter::<NoLabelSet, _, u64>(&i, None),
        (MetricType::Counter, Value::Float(f)) => e.encode_counter::<NoLabelSet, _, f64>(&f, None),
        (_, Value::Int(i)) => e.encode_gauge(&i),
        (_, Value::Float(f)) => e.encode_gauge(&f),
    }
}

impl EncodeMetric for Samples {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        for (labels, v) in &self.values {
            if labels.is_empty() {
                encode_value(&mut encoder, self.kind, *v)?;
            } else {
                encode_value(&mut encoder.encode_family(labels)?, self.kind, *v)?;
            }
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

/// The histograms of one family, in the order given.
#[derive(Debug)]
struct Histograms(Vec<(Labels, HistogramSnapshot)>);

impl EncodeMetric for Histograms {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        for (labels, h) in &self.0 {
            // prometheus-client takes per-bucket counts and sums them up.
            let mut below = 0;
            let per_bucket: Vec<(f64, u64)> = h
                .buckets
                .iter()
                .map(|&(le, cumulative)| {
                    (le, cumulative - std::mem::replace(&mut below, cumulative))
                })
                .collect();
            let mut e = encoder.encode_family(labels)?;
            e.encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &per_bucket, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Builds `label=value` pairs.
pub fn labels<const N: usize>(pairs: [(&str, &str); N]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The metric families of one scrape, every name prefixed `netpager_`.
pub struct Exposition {
    registry: Registry,
}

impl Default for Exposition {
    fn default() -> Self {
        Self::new()
    }
}

impl Exposition {
    pub fn new() -> Self {
        Exposition {
            registry: Registry::with_prefix("netpager"),
        }
    }

    fn add(&mut self, name: &str, help: &str, unit: Option<BaseUnit>, metric: impl Metric) {
        // prometheus-client ends every help text with a period itself.
        let help = help.trim_end_matches('.');
        match unit {
            Some(u) => self
                .registry
                .register_with_unit(name, help, u.unit(), metric),
            None => self.registry.register(name, help, metric),
        }
    }

    /// A gauge family; `unit` appends `_bytes`, `_seconds`...
    pub fn gauge(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<BaseUnit>,
        values: Vec<(Labels, Value)>,
    ) {
        let kind = MetricType::Gauge;
        self.add(name, help, unit, Samples { kind, values });
    }

    /// A counter family; the samples are named `NAME[_UNIT]_total`.
    pub fn counter(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<BaseUnit>,
        values: Vec<(Labels, Value)>,
    ) {
        let kind = MetricType::Counter;
        self.add(name, help, unit, Samples { kind, values });
    }

    /// A histogram family in seconds (`NAME_seconds_bucket` ...).
    pub fn histogram(&mut self, name: &str, help: &str, values: Vec<(Labels, HistogramSnapshot)>) {
        self.add(name, help, Some(BaseUnit::Seconds), Histograms(values));
    }

    /// The OpenMetrics text (what Prometheus asks for).
    pub fn openmetrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Prometheus's text format 0.0.4.
    pub fn prometheus_text(&self) -> String {
        openmetrics_to_text(&self.openmetrics())
    }
}

/// OpenMetrics to text format 0.0.4. They differ, for what `Exposition`
/// writes, in three places: a counter family is named without `_total` in
/// OpenMetrics and with it in 0.0.4 (whose parsers otherwise take the
/// samples for an untyped family of their own), and 0.0.4 has no `# UNIT`
/// and no `# EOF`.
pub fn openmetrics_to_text(om: &str) -> String {
    let counters: HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((p, rest)) => {
                let name = rest.split(' ').next().unwrap_or(rest);
                if counters.contains(name) {
                    out.push_str(p);
                    out.push_str(name);
                    out.push_str("_total");
                    out.push_str(&rest[name.len()..]);
                } else {
                    out.push_str(line);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// True for addresses of this machine's loopback interface, IPv4-mapped
/// IPv6 (`::ffff:127.0.0.1`, as a dual-stack listener reports it) included.
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Why a metrics endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("{param}={addr}: cannot resolve the address")]
    Resolve { param: &'static str, addr: String },
    #[error("{param}={addr}: cannot listen: {source}")]
    Bind {
        param: &'static str,
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "{param}={addr} is not a loopback address and the endpoint would show this node's \
         state to anyone on the network: give the lab key (the scraper then presents its \
         bearer token), or set insecure=true"
    )]
    Open {
        param: &'static str,
        addr: SocketAddr,
    },
    #[error("{param}: lab key: {source}")]
    Key {
        param: &'static str,
        #[source]
        source: AuthError,
    },
}

/// An endpoint on a non-loopback address must be keyed, unless the admin
/// said `insecure=true`.
pub fn check_address(
    param: &'static str,
    addr: SocketAddr,
    keyed: bool,
    insecure: bool,
) -> Result<(), EndpointError> {
    if is_loopback(addr.ip()) || keyed || insecure {
        Ok(())
    } else {
        Err(EndpointError::Open { param, addr })
    }
}

/// Where and how an endpoint listens: `param` names the option in errors.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointConfig {
    pub param: &'static str,
    pub addr: String,
    /// The lab's TLS-PSK file: requests must carry its bearer token.
    pub key_file: Option<PathBuf>,
    pub insecure: bool,
}

/// The lab key, read again at each request so that a replaced key file
/// rotates the token without a restart; an unreadable file keeps the key
/// loaded before.
struct KeyFile {
    path: PathBuf,
    last: Mutex<LabKey>,
}

impl KeyFile {
    fn current(&self) -> LabKey {
        let mut last = self.last.lock_or_recover();
        match LabKey::from_psk_file(&self.path, None) {
            Ok(k) => *last = k,
            Err(e) => tracing::warn!("metrics: {e}; keeping the key loaded before"),
        }
        last.clone()
    }
}

/// A bound, checked endpoint, not yet serving (the donor binds before
/// nbdkit forks and serves after).
pub struct Bound {
    listener: TcpListener,
    key: Option<KeyFile>,
}

impl Bound {
    /// Checks the address against the access rule, loads the key and
    /// listens.
    pub fn new(cfg: &EndpointConfig) -> Result<Bound, EndpointError> {
        let param = cfg.param;
        let sa = resolve(param, &cfg.addr)?;
        check_address(param, sa, cfg.key_file.is_some(), cfg.insecure)?;
        let key = cfg
            .key_file
            .as_deref()
            .map(|p| load_key(param, p))
            .transpose()?;
        let listener = TcpListener::bind(sa).map_err(|source| EndpointError::Bind {
            param,
            addr: cfg.addr.clone(),
            source,
        })?;
        Ok(Bound { listener, key })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves `/metrics` on a thread of its own for the life of the
    /// process; `render` takes the snapshot at each scrape.
    pub fn spawn<F>(self, render: F) -> io::Result<()>
    where
        F: Fn() -> Exposition + Send + Sync + 'static,
    {
        let shared = Arc::new(Shared {
            key: self.key,
            render: Box::new(render),
            live: AtomicUsize::new(0),
        });
        let listener = self.listener;
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || accept_loop(listener, shared))?;
        Ok(())
    }
}

/// The socket address an `ADDR:PORT` names.
pub fn resolve(param: &'static str, addr: &str) -> Result<SocketAddr, EndpointError> {
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| EndpointError::Resolve {
            param,
            addr: addr.to_string(),
        })
}

fn load_key(param: &'static str, path: &Path) -> Result<KeyFile, EndpointError> {
    let key =
        LabKey::from_psk_file(path, None).map_err(|source| EndpointError::Key { param, source })?;
    Ok(KeyFile {
        path: path.to_path_buf(),
        last: Mutex::new(key),
    })
}

type Render = Box<dyn Fn() -> Exposition + Send + Sync>;

struct Shared {
    key: Option<KeyFile>,
    render: Render,
    live: AtomicUsize,
}

/// Gives back a connection slot when its thread ends.
struct Slot(Arc<Shared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Relaxed);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors and the like: wait rather than spin.
                tracing::debug!("metrics: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if shared.live.fetch_add(1, Relaxed) >= MAX_CONNECTIONS {
            shared.live.fetch_sub(1, Relaxed);
            continue;
        }
        let slot = Slot(Arc::clone(&shared));
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".into())
            .spawn(move || {
                let s = &slot.0;
                serve(stream, s.key.as_ref(), &s.render);
            });
        if let Err(e) = spawned {
            tracing::warn!("metrics: cannot start a connection thread: {e}");
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq)]
pub struct HttpRequest {
    pub method: String,
    pub path: String,
    /// The `Authorization: Bearer` token, if any.
    pub bearer: Option<String>,
    /// The `Accept` header names OpenMetrics.
    pub openmetrics: bool,
}

/// Parses a request head (request line and headers, without the body).
pub fn parse_head(head: &str) -> Option<HttpRequest> {
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, target, version) = (first.next()?, first.next()?, first.next()?);
    if !version.starts_with("HTTP/1.") || first.next().is_some() {
        return None;
    }
    let path = target.split('?').next().unwrap_or(target);
    let mut req = HttpRequest {
        method: method.to_string(),
        path: path.to_string(),
        bearer: None,
        openmetrics: false,
    };
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("authorization") {
            req.bearer = value
                .split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, t)| t.trim().to_string());
        } else if name.eq_ignore_ascii_case("accept") {
            req.openmetrics = value.contains("application/openmetrics-text");
        }
    }
    Some(req)
}

/// Status line, extra headers, content type and body of the answer.
pub struct HttpAnswer {
    pub status: &'static str,
    pub headers: &'static str,
    pub content_type: &'static str,
    pub body: String,
}

fn plain(status: &'static str, headers: &'static str, body: &str) -> HttpAnswer {
    HttpAnswer {
        status,
        headers,
        content_type: "text/plain; charset=utf-8",
        body: format!("{body}\n"),
    }
}

/// The answer to a parsed request: the token is checked before anything is
/// rendered.
pub fn answer(
    req: Option<&HttpRequest>,
    key: Option<&LabKey>,
    render: &dyn Fn() -> Exposition,
) -> HttpAnswer {
    let Some(req) = req else {
        return plain("400 Bad Request", "", "malformed request");
    };
    if req.method != "GET" {
        return plain("405 Method Not Allowed", "Allow: GET\r\n", "only GET");
    }
    if req.path != "/metrics" {
        return plain("404 Not Found", "", "only /metrics is served here");
    }
    if let Some(k) = key {
        if !req
            .bearer
            .as_deref()
            .is_some_and(|t| k.check_metrics_token(t))
        {
            return plain(
                "401 Unauthorized",
                "WWW-Authenticate: Bearer realm=\"netpager\"\r\n",
                "a bearer token derived from the lab key is required",
            );
        }
    }
    let e = render();
    if req.openmetrics {
        HttpAnswer {
            status: "200 OK",
            headers: "",
            content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
            body: e.openmetrics(),
        }
    } else {
        HttpAnswer {
            status: "200 OK",
            headers: "",
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            body: e.prometheus_text(),
        }
    }
}

/// Reads a request head within the connection's deadline; `None` if it is
/// too long, malformed or late.
fn read_head(stream: &TcpStream, deadline: Instant) -> Option<String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let mut reader = stream;
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || buf.len() > MAX_HEAD_BYTES {
            return None;
        }
        reader.set_read_timeout(Some(left.min(IO_TIMEOUT))).ok()?;
        let n = reader.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    String::from_utf8(buf[..end].to_vec()).ok()
}

fn serve(stream: TcpStream, key: Option<&KeyFile>, render: &Render) {
    let deadline = Instant::now() + CONNECTION_LIFETIME;
    if stream.set_write_timeout(Some(IO_TIMEOUT)).is_err() {
        return;
    }
    let head = read_head(&stream, deadline);
    let req = head.as_deref().and_then(parse_head);
    let key = key.map(KeyFile::current);
    let a = answer(req.as_ref(), key.as_ref(), render.as_ref());
    let mut w = &stream;
    let _ = write!(
        w,
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n{}",
        a.status,
        a.content_type,
        a.body.len(),
        a.headers,
        a.body
    )
    .and_then(|_| w.flush());
}

#[cfg(test)]
mod tests;
