//! Every engine vector (docs/engine-wire.md, 18 releases) decodes to its `expected` meaning, and the
//! two worked examples of engine-wire §11 encode byte-identically to prost.
use kvbridge::decode::{DecodeConfig, Decoder, RecordHeader};
use kvbridge::proto::common::{
    kv_block_extra_key, kv_cache_event::Data, KvBlock, KvBlocksRemoved, KvBlocksStored,
    KvCacheCleared, KvCacheEvent, KvEventBatch,
};
use prost::Message;
use serde_json::Value;

use crate::vectors;
use vectors::{all_dec, check_removal, check_store, run, unhex, VECTORS};

#[test]
fn all_vectors_profile_all() {
    let doc: Value = serde_json::from_str(VECTORS).unwrap();
    let vectors = doc["vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 85);
    let mut dec = all_dec();
    for v in vectors {
        let ctx = format!(
            "{} {}",
            v["release"].as_str().unwrap(),
            v["case"].as_str().unwrap()
        );
        let payload = unhex(v["payload_hex"].as_str().unwrap());
        let plan = dec.plan(&payload).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let exp = &v["expected"];
        assert_eq!(plan.ts, exp["ts"].as_f64().unwrap(), "{ctx}");
        assert_eq!(plan.rank, exp["dp_rank"].as_i64(), "{ctx}");
        let recs = run(&mut dec, &payload);
        let exp_events = exp["events"].as_array().unwrap();
        if exp_events.is_empty() {
            assert!(recs.is_empty(), "{ctx}");
            continue;
        }
        assert_eq!(recs.len(), 1, "{ctx}");
        let got = &recs[0];
        assert_eq!(got.timestamp, exp["ts"].as_f64().unwrap(), "{ctx}");
        assert_eq!(got.dp_rank, None);
        assert_eq!(got.events.len(), exp_events.len(), "{ctx}");
        for (e, g) in exp_events.iter().zip(&got.events) {
            match (e["type"].as_str().unwrap(), &g.data) {
                ("BlockStored", Some(Data::Stored(s))) => check_store(e, s, &ctx),
                ("BlockRemoved", Some(Data::Removed(r))) => check_removal(e, r, &ctx),
                ("AllBlocksCleared", Some(Data::Cleared(c))) => assert_eq!(c.ownership, None),
                (t, d) => panic!("{ctx}: expected {t}, got {d:?}"),
            }
        }
    }
    let st = dec.stats();
    assert_eq!(st.malformed_events, 0);
    assert_eq!(st.unknown_tags, 0);
    assert_eq!(st.err_truncated + st.err_shape + st.err_length, 0);
    // the lookahead_token_ids field is known (skipped), not an unknown key
    assert_eq!(st.unknown_keys, 0, "{st:?}");
}

#[test]
fn extra_keys_shapes() {
    // vLLM 0.17: extra_keys = [("adapter-a", [("mm-hash-1", 3)], "salt")]
    let doc: Value = serde_json::from_str(VECTORS).unwrap();
    let v = doc["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["release"] == "vllm-0.17.0" && v["case"] == "store_with_extra_keys")
        .unwrap();
    let payload = unhex(v["payload_hex"].as_str().unwrap());
    let mut dec = all_dec();
    let recs = run(&mut dec, &payload);
    let Some(Data::Stored(s)) = &recs[0].events[0].data else {
        panic!()
    };
    use kv_block_extra_key::Key;
    let keys: Vec<_> = s.blocks[0]
        .extra_keys
        .iter()
        .map(|k| k.key.clone().unwrap())
        .collect();
    assert_eq!(
        keys,
        vec![
            Key::Text("adapter-a".into()),
            Key::Multimodal(kvbridge::proto::common::KvMultimodalKey {
                identifier: "mm-hash-1".into(),
                offset: 3
            }),
            Key::Text("salt".into()),
        ]
    );
    assert_eq!(dec.stats().extra_key_shapes_skipped, 0);
}

#[test]
fn placeholders_profile_smg() {
    let doc: Value = serde_json::from_str(VECTORS).unwrap();
    let mut n = 0;
    for v in doc["vectors"].as_array().unwrap() {
        if v["case"] != "placeholder_cpu_store" {
            continue;
        }
        n += 1;
        let payload = unhex(v["payload_hex"].as_str().unwrap());
        let mut dec = Decoder::new(DecodeConfig::default());
        let plan = dec.plan(&payload).unwrap();
        assert_eq!(plan.records, 0, "{}", v["release"]);
        let st = dec.stats();
        assert_eq!(
            (st.placeholders, st.filtered_unpairable, st.emptied_batches),
            (1, 1, 1)
        );
        // Profile::All forwards it hash-only
        let mut all = all_dec();
        let recs = run(&mut all, &payload);
        let Some(Data::Stored(s)) = &recs[0].events[0].data else {
            panic!()
        };
        assert!(s
            .blocks
            .iter()
            .all(|b| b.token_ids.is_empty() && b.block_size == 0));
        assert_eq!(s.tier, Some(2)); // CPU → HOST
        assert_eq!(all.stats().hash_only_stores, 1);
    }
    assert!(n >= 10);
}

#[test]
fn smg_profile_keeps_main_vectors() {
    // every non-placeholder vector passes the SMG filter unchanged (GPU / no medium, main groups)
    let doc: Value = serde_json::from_str(VECTORS).unwrap();
    for v in doc["vectors"].as_array().unwrap() {
        if v["case"] == "placeholder_cpu_store" {
            continue;
        }
        let payload = unhex(v["payload_hex"].as_str().unwrap());
        let mut smg = Decoder::new(DecodeConfig::default());
        let mut all = all_dec();
        assert_eq!(
            run(&mut smg, &payload),
            run(&mut all, &payload),
            "{}",
            v["release"]
        );
    }
}

const EX_V7: &str = "93cb41d954fc40200000939cab426c6f636b53746f72656491cfdeadbeefcafef00dc0940102030404c0a3475055c091c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cfdeadbeefcafef00da34750550091b0416c6c426c6f636b73436c656172656400";
const EX_V12: &str = "93cb41d954fc4020000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfdeadbeefcafef00db1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfdeadbeefcafef00da66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";

fn worked_expected(seq: u64, eid: u64) -> KvEventBatch {
    let h = 0xDEADBEEFCAFEF00Du64 as i64;
    assert_eq!(h, -2401053089206439923);
    KvEventBatch {
        sequence_number: seq,
        timestamp: 1700000000.5,
        events: vec![
            KvCacheEvent {
                event_id: eid,
                data: Some(Data::Stored(KvBlocksStored {
                    blocks: vec![KvBlock {
                        block_hash: h,
                        token_ids: vec![1, 2, 3, 4],
                        block_size: 4,
                        lora_id: None,
                        cache_level: Some(0),
                        extra_keys: vec![],
                    }],
                    parent_block_hash: None,
                    tier: Some(1),
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                    ..Default::default()
                })),
            },
            KvCacheEvent {
                event_id: eid + 1,
                data: Some(Data::Removed(KvBlocksRemoved {
                    block_hashes: vec![h],
                    cache_level: Some(0),
                    tier: Some(1),
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                    ..Default::default()
                })),
            },
            KvCacheEvent {
                event_id: eid + 2,
                data: Some(Data::Cleared(KvCacheCleared { ownership: None })),
            },
        ],
        dp_rank: Some(0),
        snapshot: None,
        load: None,
    }
}

#[test]
fn worked_examples_byte_identical() {
    for (hex, len) in [(EX_V7, 114), (EX_V12, 277)] {
        let payload = unhex(hex);
        assert_eq!(payload.len(), len);
        let mut dec = Decoder::new(DecodeConfig::default());
        let plan = dec.plan(&payload).unwrap();
        assert_eq!(plan.records, 1);
        assert_eq!(plan.rank, Some(0));
        assert_eq!(plan.ts, 1700000000.5);
        for (seq, eid) in [(1u64, 1u64), (300, 1 << 40), (u64::MAX, u64::MAX - 2)] {
            let hdr = RecordHeader {
                sequence_number: seq,
                first_event_id: eid,
                dp_rank: Some(0),
            };
            let mut buf = vec![0u8; dec.record_len(0, &hdr)];
            dec.write_record(&payload, 0, &hdr, &mut buf);
            assert_eq!(buf, worked_expected(seq, eid).encode_to_vec());
        }
    }
}

#[test]
fn encode_cleared_matches_prost() {
    for (seq, eid, rank) in [
        (1u64, 1u64, None),
        (0, 0, Some(-1)),
        (u64::MAX, 12345, Some(3)),
    ] {
        let hdr = RecordHeader {
            sequence_number: seq,
            first_event_id: eid,
            dp_rank: rank,
        };
        let mut out = vec![1, 2, 3];
        let n = kvbridge::decode::encode_cleared(&hdr, 1700000000.25, &mut out);
        let exp = KvEventBatch {
            sequence_number: seq,
            timestamp: 1700000000.25,
            events: vec![KvCacheEvent {
                event_id: eid,
                data: Some(Data::Cleared(KvCacheCleared { ownership: None })),
            }],
            dp_rank: rank,
            snapshot: None,
            load: None,
        };
        assert_eq!(n, out.len());
        assert_eq!(out, exp.encode_to_vec());
    }
}
