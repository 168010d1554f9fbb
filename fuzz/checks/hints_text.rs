// What the hints_text fuzz target checks of one input, included by the
// target and by hints/tests/fuzz_regressions.rs: the text hint parser turns
// any input into records or a located error, never a panic, a hang or
// unbounded memory.

/// References read per input at most: a valid header may promise many
/// passes, and the fuzzer wants to explore parsing, not loop.
const MAX_REFERENCES: usize = 10_000;

pub fn check(data: &[u8]) {
    let mut input = b"netpager-hints 1\n".to_vec();
    input.extend_from_slice(data);
    for raw in [data.to_vec(), input] {
        if let Ok(reader) = hints::HintReader::from_reader(std::io::Cursor::new(raw), "fuzz") {
            for r in reader.references().take(MAX_REFERENCES) {
                if r.is_err() {
                    break;
                }
            }
        }
    }
}
