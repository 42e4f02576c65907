//! Runs the fuzz entry point (`kvbridge::decode::fuzz_entry`, also used by `fuzz/`) over the
//! checked-in malformed corpus, over every engine vector, and over deterministic byte-level
//! mutations of the vectors: no panic, no over-long record, every record decodes with prost
//! and is canonical.
use kvbridge::decode::{fuzz_entry, DecodeConfig, Decoder};

use crate::vectors;
use vectors::{unhex, VECTORS};

fn vectors() -> Vec<Vec<u8>> {
    let doc: serde_json::Value = serde_json::from_str(VECTORS).unwrap();
    doc["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| unhex(v["payload_hex"].as_str().unwrap()))
        .collect()
}

#[test]
fn malformed_corpus() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/corpus/decode-malformed"
    );
    let mut n = 0;
    let mut errors = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "bin") {
            continue;
        }
        let data = std::fs::read(&path).unwrap();
        fuzz_entry(&data);
        let mut d = Decoder::new(DecodeConfig::default());
        if let Err(e) = d.plan(&data) {
            errors += 1;
            assert!(e.offset <= data.len(), "{}: {e}", path.display());
        }
        n += 1;
    }
    assert!(n >= 30, "corpus has {n} files");
    assert!(
        errors * 2 > n,
        "most corpus inputs should be rejected ({errors}/{n})"
    );
}

#[test]
fn vectors_through_fuzz_entry() {
    for v in vectors() {
        fuzz_entry(&v);
    }
}

#[test]
fn mutated_vectors() {
    mutate(20_000, 0x9E37_79B9_7F4A_7C15);
}

/// A longer campaign: `DECODE_MUTATIONS=3000000 cargo test --release --test
/// decode_fuzz_corpus -- --ignored`.
#[test]
#[ignore]
fn mutated_vectors_long() {
    let n = std::env::var("DECODE_MUTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    mutate(n, 0xD1B5_4A32_D192_ED03);
}

fn mutate(iterations: u32, seed: u64) {
    let mut vs = vectors();
    // also mutate the corpus seeds (huge headers, deep nesting, …)
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/corpus/decode-malformed"
    );
    for e in std::fs::read_dir(dir).unwrap() {
        let d = std::fs::read(e.unwrap().path()).unwrap();
        if !d.is_empty() {
            vs.push(d);
        }
    }
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut planned = 0;
    let mut dec = Decoder::new(DecodeConfig::default());
    for _ in 0..iterations {
        let mut v = vs[(next() % vs.len() as u64) as usize].clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() % v.len() as u64) as usize;
            match next() % 4 {
                0 => v[i] = next() as u8,
                1 => v[i] ^= 1 << (next() % 8),
                2 => {
                    v.truncate(i);
                }
                _ => v.insert(i, next() as u8),
            }
            if v.is_empty() {
                break;
            }
        }
        fuzz_entry(&v);
        planned += dec.plan(&v).is_ok() as u32;
    }
    assert!(planned > iterations / 20, "{planned}");
    assert!(
        dec.stats().malformed_events + dec.stats().unknown_tags > 100,
        "{:?}",
        dec.stats()
    );
}
