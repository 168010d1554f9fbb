//! Fuzzes what fuzz/checks/status_decode.rs checks of one input.
#![no_main]
include!("../checks/status_decode.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
