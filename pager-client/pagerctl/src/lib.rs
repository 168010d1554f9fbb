//! The attach machinery and the donor-selection simulator behind `pagerctl`;
//! the device itself is the `pager-client` library.

pub mod attach;
pub mod sim;
