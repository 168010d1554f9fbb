//! The status decoder's fuzz inputs kept in fuzz/regressions/ (see there).

include!("../../fuzz/checks/replay.rs");

mod status {
    include!("../../fuzz/checks/status_decode.rs");
}

#[test]
fn the_status_decoders_kept_fuzz_inputs() {
    replay("status_decode", status::check);
}
