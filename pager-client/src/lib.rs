//! netpager client library: donor selection, extent placement, reliability
//! modes, failover and the attach machinery behind `pagerctl`.

pub mod attach;
pub mod config;
pub mod device;
pub mod durability;
pub mod erasure;
pub mod extent_map;
pub mod metrics;
pub mod nbd;
pub mod page_log;
pub mod policy;
pub mod sim;
pub mod status;
pub mod top;
