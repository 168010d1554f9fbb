//! prefetchd's status, as the control socket's `status` answers it
//! (`prefetchd status`): tests, pagerctl and Ansible read these field
//! names, so they stay as they are.

use std::path::PathBuf;

use serde::Serialize;

use crate::plan::engine::{DonorStatus as EngineDonor, JobStats, JobStatus as EngineJob};
use crate::plan::Nanos;

#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The served data directory.
    pub data: PathBuf,
    pub block_size: usize,
    pub uptime_s: f64,
    pub prefetch: bool,
    pub page_cache: bool,
    pub local: Local,
    pub costs_ns: Costs,
    pub pending_reads: usize,
    pub donors: Vec<Donor>,
    pub jobs: Vec<Job>,
    pub unhinted: JobStats,
}

/// The local level's blocks.
#[derive(Debug, Clone, Serialize)]
pub struct Local {
    pub blocks: u32,
    pub resident: u32,
    pub filling: u32,
}

/// The cost of a block read from each level.
#[derive(Debug, Clone, Serialize)]
pub struct Costs {
    pub local: Nanos,
    pub global: Nanos,
    pub disk: Nanos,
}

/// One lane of a donor: the engine's view and the lane's life.
#[derive(Debug, Clone, Serialize)]
pub struct Donor {
    #[serde(flatten)]
    pub engine: EngineDonor,
    #[serde(flatten)]
    pub lane: Lane,
}

/// Which donor a lane serves and in which life.
#[derive(Debug, Clone, Serialize)]
pub struct Lane {
    pub name: String,
    /// Index of the donor in the set.
    pub donor: usize,
    pub life: u32,
    /// serving, failed, or "let go (why)".
    pub state: String,
    pub status_endpoint: Option<String>,
    /// How it joined (lanes::Source).
    pub joined: &'static str,
}

/// One job: the engine's view and, while registered, its files.
#[derive(Debug, Clone, Serialize)]
pub struct Job {
    #[serde(flatten)]
    pub engine: EngineJob,
    #[serde(flatten)]
    pub registered: Option<Registered>,
}

/// A registered job's hint file, recording and what became of its hints.
#[derive(Debug, Clone, Serialize)]
pub struct Registered {
    pub hints: Option<PathBuf>,
    pub recording: Option<PathBuf>,
    pub record_error: Option<String>,
    /// The staleness check's findings: hints ignored as stale.
    pub stale: Vec<String>,
    pub hint_stream: HintStream,
}

/// What happened to a job's hints (crate::source::SourceReport).
#[derive(Debug, Clone, Serialize)]
pub struct HintStream {
    pub records: u64,
    pub ignored_stale: u64,
    pub ignored_unknown: u64,
    pub ignored_beyond_eof: u64,
    pub error: Option<String>,
}
