//! The binary (protobuf) hint parser must turn any input into records or an
//! error naming the byte offset, never a panic or unbounded memory.
#![no_main]
use libfuzzer_sys::fuzz_target;

const MAX_REFERENCES: usize = 10_000;

fuzz_target!(|data: &[u8]| {
    let mut input = hints::BINARY_MAGIC.to_vec();
    input.extend_from_slice(data);
    if let Ok(reader) = hints::HintReader::from_reader(std::io::Cursor::new(input), "fuzz") {
        for r in reader.references().take(MAX_REFERENCES) {
            if r.is_err() {
                break;
            }
        }
    }
});
