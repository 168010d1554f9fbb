//! prefetchd: the cooperative prefetch daemon (docs/DESIGN.md "2.4 Prefetching
//! with hints").
//!
//! [`plan`] is the pure policy (hint cursors, timing, Forestall, values,
//! replacement, disk-to-global). The rest is the daemon around it:
//! [`files`] (the data directory), [`source`] (hint files as block
//! streams), [`disk`] (io_uring reads), [`donor`] (global memory over NBD),
//! [`daemon`] (the planner driving them), `lanes` (each donor's lives and
//! status pollers, which know the daemon only as a planner to tell),
//! [`membership`] (donors joining and leaving while it runs), [`fs`] (the
//! FUSE view), [`control`] (the control socket), [`status`] (the status as
//! typed structs), [`table`] (status output) and [`metrics`] (the
//! `/metrics` families).
//! All `unsafe` is in [`sys`].

pub mod control;
pub mod daemon;
pub mod disk;
pub mod donor;
pub mod files;
pub mod fs;
mod lanes;
pub mod membership;
pub mod metrics;
pub mod plan;
pub mod source;
pub mod status;
#[allow(unsafe_code)]
pub mod sys;
pub mod table;
pub mod watch;

/// An error and its causes, joined by ": " as anyhow's `{:#}` prints them:
/// for library errors whose text goes to a log, a status or a reply.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}
