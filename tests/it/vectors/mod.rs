//! The engine vectors of `tests/data/engine-vectors.json` (payloads encoded by the engines' own
//! msgspec encoders, see `tests/data/README.md`), shared by the decoder tests.
#![allow(dead_code)]

/// The vector file, embedded at build time from the repository's own test data.
pub const VECTORS: &str = include_str!("../../data/engine-vectors.json");

/// Hex to bytes.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
