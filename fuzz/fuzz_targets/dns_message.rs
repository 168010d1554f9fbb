//! Fuzzes what fuzz/checks/dns_message.rs checks of one input.
#![no_main]
include!("../checks/dns_message.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
