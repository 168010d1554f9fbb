// What the hints_binary fuzz target checks of one input, included by the
// target and by hints/tests/fuzz_regressions.rs: the binary (protobuf)
// hint parser turns any input into records or an error naming the byte
// offset, never a panic or unbounded memory.

const MAX_REFERENCES: usize = 10_000;

pub fn check(data: &[u8]) {
    let mut input = hints::BINARY_MAGIC.to_vec();
    input.extend_from_slice(data);
    if let Ok(reader) = hints::HintReader::from_reader(std::io::Cursor::new(input), "fuzz") {
        for r in reader.references().take(MAX_REFERENCES) {
            if r.is_err() {
                break;
            }
        }
    }
}
