//! The attach machinery, the donor-selection simulator and the drawing of
//! `pagerctl top` behind `pagerctl`; the device itself is the
//! `pager-client` library.

pub mod attach;
pub mod lost;
pub mod sim;
pub mod top;
