// What the status_decode fuzz target checks of one input, included by the
// target and by proto/tests/fuzz_regressions.rs: a donor's status endpoint
// frames, decodes and authenticates bytes from the network into a message
// or an error, never a panic or an allocation beyond the frame limit.

use netpager_proto::{auth::Verifier, read_message, v1, LabKey};

pub fn check(data: &[u8]) {
    let key_file = std::env::temp_dir().join("netpager-fuzz.psk");
    if !key_file.exists() {
        std::fs::write(&key_file, "fuzz:000102030405060708090a0b0c0d0e0f\n").unwrap();
    }
    let mut verifier = Verifier::new(LabKey::from_psk_file(&key_file, None).unwrap());
    let mut cursor = data;
    // A connection may carry several frames; decode until the bytes run out.
    while let Ok(Some(req)) = read_message::<v1::Request>(&mut cursor, "fuzz") {
        let _ = verifier.verify(&req);
    }
    let _ = read_message::<v1::Reply>(&mut &data[..], "fuzz");
}
