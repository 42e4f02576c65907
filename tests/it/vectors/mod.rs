//! The engine vectors of `tests/data/engine-vectors.json` (payloads encoded by the engines' own
//! msgspec encoders, see `tests/data/README.md`), shared by the decoder tests.
#![allow(dead_code)]

use kvbridge::decode::{DecodeConfig, Decoder, Profile, RecordHeader};
use kvbridge::proto::common::{KvBlocksRemoved, KvBlocksStored, KvEventBatch};
use prost::Message;
use serde_json::Value;

/// The vector file, embedded at build time from the repository's own test data.
pub const VECTORS: &str = include_str!("../../data/engine-vectors.json");

/// Hex to bytes.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Plans + writes every record; checks canonical bytes; returns the decoded batches.
pub fn run(dec: &mut Decoder, payload: &[u8]) -> Vec<KvEventBatch> {
    let plan = dec.plan(payload).expect("plan");
    let mut out = Vec::new();
    let mut eid = 1;
    for i in 0..plan.records {
        let hdr = RecordHeader {
            sequence_number: 7 + i as u64,
            first_event_id: eid,
            dp_rank: None,
        };
        let len = dec.record_len(i, &hdr);
        let mut buf = vec![0u8; len];
        assert_eq!(dec.write_record(payload, i, &hdr, &mut buf), len);
        let msg = KvEventBatch::decode(&buf[..]).expect("prost decode");
        assert_eq!(msg.encode_to_vec(), buf, "not canonical");
        assert_eq!(msg.sequence_number, 7 + i as u64);
        for (k, e) in msg.events.iter().enumerate() {
            assert_eq!(e.event_id, eid + k as u64);
        }
        eid += dec.record_events(i);
        out.push(msg);
    }
    out
}

pub fn all_dec() -> Decoder {
    Decoder::new(DecodeConfig {
        split_threshold: 1 << 30,
        profile: Profile::All,
        ..Default::default()
    })
}

pub fn tier_of(m: &str) -> Option<i32> {
    match m.to_ascii_uppercase().as_str() {
        "GPU" => Some(1),
        "CPU" | "CPU_PINNED" => Some(2),
        "DISK" | "FS" | "STORAGE" => Some(3),
        "OBJ" | "EXTERNAL" => Some(4),
        _ => None,
    }
}

pub fn opt_str(v: &Value, k: &str) -> Option<String> {
    v.get(k).and_then(|x| x.as_str()).map(str::to_owned)
}
pub fn opt_i64(v: &Value, k: &str) -> Option<i64> {
    v.get(k).and_then(|x| x.as_i64())
}

pub fn check_store(exp: &Value, s: &KvBlocksStored, ctx: &str) {
    let hashes: Vec<i64> = exp["block_hashes_i64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_i64().unwrap())
        .collect();
    let toks: Vec<u32> = exp["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let bs = exp["block_size"].as_u64().unwrap() as usize;
    assert_eq!(
        s.blocks.iter().map(|b| b.block_hash).collect::<Vec<_>>(),
        hashes,
        "{ctx}"
    );
    assert_eq!(
        s.parent_block_hash,
        opt_i64(exp, "parent_block_hash_i64"),
        "{ctx}"
    );
    let pairable = bs > 0 && toks.len() == hashes.len() * bs;
    let lora = opt_i64(exp, "lora_id");
    let medium = opt_str(exp, "medium");
    let tier = medium.as_deref().and_then(tier_of);
    for (i, b) in s.blocks.iter().enumerate() {
        if pairable {
            assert_eq!(b.token_ids, toks[i * bs..(i + 1) * bs], "{ctx} block {i}");
            assert_eq!(b.block_size as usize, bs, "{ctx}");
        } else {
            assert!(b.token_ids.is_empty(), "{ctx}");
            assert_eq!(b.block_size, 0, "{ctx}");
        }
        assert_eq!(b.lora_id, lora, "{ctx}");
        assert_eq!(b.cache_level, tier.map(|t| t - 1), "{ctx}");
    }
    assert_eq!(s.medium, medium, "{ctx}");
    assert_eq!(s.tier, tier, "{ctx}");
    assert_eq!(s.lora_name, opt_str(exp, "lora_name"), "{ctx}");
    assert_eq!(
        s.group_idx,
        exp.get("group_idx")
            .and_then(|g| g.as_u64())
            .map(|g| g as u32),
        "{ctx}"
    );
    assert_eq!(
        s.kv_cache_spec_kind,
        opt_str(exp, "kv_cache_spec_kind"),
        "{ctx}"
    );
    assert_eq!(
        s.kv_cache_spec_sliding_window,
        exp.get("kv_cache_spec_sliding_window")
            .and_then(|g| g.as_u64())
            .map(|g| g as u32),
        "{ctx}"
    );
    let loc = opt_str(exp, "locality").map(|l| match l.as_str() {
        "LOCAL" => 1,
        "REMOTE" => 2,
        _ => panic!("unexpected locality"),
    });
    assert_eq!(s.locality, loc, "{ctx}");
    assert_eq!(s.ownership, opt_str(exp, "ownership"), "{ctx}");
    assert_eq!(s.session_id, opt_str(exp, "session_id"), "{ctx}");
    assert_eq!(s.cache_salt, opt_str(exp, "cache_salt"), "{ctx}");
    let has_ek = exp["has_extra_keys"].as_bool().unwrap();
    assert_eq!(
        s.blocks.iter().any(|b| !b.extra_keys.is_empty()),
        has_ek,
        "{ctx}"
    );
}

pub fn check_removal(exp: &Value, r: &KvBlocksRemoved, ctx: &str) {
    let hashes: Vec<i64> = exp["block_hashes_i64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_i64().unwrap())
        .collect();
    assert_eq!(r.block_hashes, hashes, "{ctx}");
    let medium = opt_str(exp, "medium");
    let tier = medium.as_deref().and_then(tier_of);
    assert_eq!(r.medium, medium, "{ctx}");
    assert_eq!(r.tier, tier, "{ctx}");
    assert_eq!(r.cache_level, tier.map(|t| t - 1), "{ctx}");
    assert_eq!(
        r.group_idx,
        exp.get("group_idx")
            .and_then(|g| g.as_u64())
            .map(|g| g as u32),
        "{ctx}"
    );
    assert_eq!(r.ownership, opt_str(exp, "ownership"), "{ctx}");
    assert_eq!(
        r.locality,
        opt_str(exp, "locality").map(|l| if l == "LOCAL" { 1 } else { 2 }),
        "{ctx}"
    );
}
