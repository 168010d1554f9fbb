// What the dns_message fuzz target checks of one input, included by the
// target and by membership/tests/fuzz_regressions.rs: a client browsing the
// lab's DNS, or a donor updating it, decodes an answer (names with
// compression pointers, records of every type), checks its TSIG signature
// and reads its TXT records as an announcement's lease; any input ends in
// a message or an error, never a panic, a loop or a large allocation.

use netpager_membership::dns::{lease, tsig::Key, txt_map, wire::Message};

pub fn check(data: &[u8]) {
    let key = Key::parse("key \"k\" { algorithm hmac-sha256; secret \"c2VjcmV0\"; };").unwrap();
    if let Ok(m) = Message::decode(data) {
        let _ = key.verify(data, &m, &[0u8; 32]);
        // Written out again (names uncompressed), it still decodes.
        assert!(Message::decode(&m.encode()).is_ok());
        let _ = lease::parse(&txt_map(&m.answers));
    }
}
