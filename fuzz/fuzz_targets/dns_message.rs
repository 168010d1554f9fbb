//! What a client browsing the lab's DNS, or a donor updating it, does with
//! an answer from the network: decode it (names with compression pointers,
//! records of every type), check its TSIG signature and read its TXT
//! records as an announcement's lease. Any input must end in a message or
//! an error, never a panic, a loop or a large allocation.
#![no_main]
use libfuzzer_sys::fuzz_target;
use netpager_membership::dns::{lease, tsig::Key, txt_map, wire::Message};

fuzz_target!(|data: &[u8]| {
    let key = Key::parse("key \"k\" { algorithm hmac-sha256; secret \"c2VjcmV0\"; };").unwrap();
    if let Ok(m) = Message::decode(data) {
        let _ = key.verify(data, &m, &[0u8; 32]);
        // Written out again (names uncompressed), it still decodes.
        assert!(Message::decode(&m.encode()).is_ok());
        let _ = lease::parse(&txt_map(&m.answers));
    }
});
