//! `cargo +nightly fuzz run decode` from the repository root, optionally seeded:
//! `cargo +nightly fuzz run decode fuzz/corpus/decode tests/corpus/decode-malformed`. Plans and writes every record of arbitrary input under
//! both profiles and checks that each record has exactly `record_len` bytes, stays within the
//! split threshold, and decodes + re-encodes with prost to identical bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvbridge::decode::fuzz_entry(data);
});
