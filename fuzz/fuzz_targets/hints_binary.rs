//! Fuzzes what fuzz/checks/hints_binary.rs checks of one input.
#![no_main]
include!("../checks/hints_binary.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
