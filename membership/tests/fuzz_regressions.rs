//! The DNS message decoder's fuzz inputs kept in fuzz/regressions/ (see
//! there).

include!("../../fuzz/checks/replay.rs");

mod dns {
    include!("../../fuzz/checks/dns_message.rs");
}

#[test]
fn the_dns_decoders_kept_fuzz_inputs() {
    replay("dns_message", dns::check);
}
