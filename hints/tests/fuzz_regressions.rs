//! The hint parsers' fuzz inputs kept in fuzz/regressions/ (see there).

include!("../../fuzz/checks/replay.rs");

mod text {
    include!("../../fuzz/checks/hints_text.rs");
}
mod binary {
    include!("../../fuzz/checks/hints_binary.rs");
}

#[test]
fn the_text_parsers_kept_fuzz_inputs() {
    replay("hints_text", text::check);
}

#[test]
fn the_binary_parsers_kept_fuzz_inputs() {
    replay("hints_binary", binary::check);
}
