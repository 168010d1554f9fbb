//! The attach machinery behind `pagerctl attach` / `detach`.
//!
//! Attaching a device is a short chain of steps (start the client's nbdkit,
//! connect a kernel nbd device or an nbdfuse file plus a loop device, make it
//! swap). This module holds everything about those steps that is pure and
//! testable: building each command line
//! ([`commands`]) and the record of steps done that `detach` undoes in
//! reverse ([`record`]), the device configuration built from attach's
//! options ([`device`]), and what the check of its donors concludes
//! ([`check`]). Running the commands is `pagerctl`'s thin layer.

pub mod check;
pub mod commands;
pub mod device;
pub mod nbd_hold;
pub mod record;

pub use commands::{Frontend, Via};
pub use device::{apply_options, build_config, differences, DeviceOptions, ModeChoice};
pub use netpager_membership::DonorSpec;
pub use record::{AttachRecord, Step};

/// Errors of parsing attach arguments and reading attach records.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("--via {0:?}: expected auto, nbd-client or nbdfuse")]
    BadVia(String),
    #[error("{option}: {reason}")]
    BadOption {
        option: &'static str,
        reason: String,
    },
    #[error("a new device needs {0}")]
    Missing(String),
    #[error(transparent)]
    Config(#[from] pager_client::config::ConfigError),
    #[error("reading attach record {path}: {source}")]
    ReadRecord {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("attach record {path} is malformed: {source}")]
    ParseRecord {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("writing attach record {path}: {source}")]
    WriteRecord {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}
