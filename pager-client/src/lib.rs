//! netpager client library: donor selection, extent placement, reliability
//! modes and failover. `pagerctl` (crate `pagerctl`) attaches it.

pub mod config;
pub mod device;
pub mod durability;
pub mod erasure;
pub mod extent_map;
pub mod metrics;
pub mod page_log;
pub mod page_table;
pub mod policy;
pub mod probe;
pub mod readahead;
pub mod stages;
pub mod status;
pub mod writeback;
pub mod zero_pages;
