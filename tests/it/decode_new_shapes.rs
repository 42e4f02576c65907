//! Event kinds and fields newer than the engine vectors (`tests/data/new-shapes.json`, written
//! by `tests/data/new_shapes.py`; each vector names its source and whether a release's classes
//! or an open pull request's schema encoded it): every one is tolerated, none loses an event.
//!
//! - `BlockInactive` (vLLM #50732) is skipped and counted apart (`inactive_events`);
//! - typed `extra_keys` (vLLM #55488, `event_version` 1) become the same keys as the untyped
//!   ones; a newer `event_version` is counted, the event still decoded;
//! - `remaining_copy_counts` (vLLM #48933) and SGLang's removal `reason` (#39620) are read past:
//!   the removal is forwarded, not lost (SGLang's `reason` sits where vLLM's array layout has
//!   `group_idx`: read as one, the removal failed validation and became an in-band clear);
//! - ROCm ATOM's trailing `token_offset`: an int where vLLM's short array layout has
//!   `lora_name` is read past; after the long layout it is an unknown trailing element;
//! - open medium strings are forwarded raw, mapped to a tier case-insensitively;
//! - vLLM 0.32's partial-block stores (a group, no kind, the partial length as `block_size`) do
//!   not pin their group's block size, so the full blocks after them are not a conflict.
use kvbridge::decode::{DecodeConfig, Decoder, Profile};
use kvbridge::proto::common::{kv_block_extra_key::Key, kv_cache_event::Data, KvMultimodalKey};
use serde_json::Value;

use crate::vectors::{all_dec, check_removal, check_store, run, unhex};

const NEW_SHAPES: &str = include_str!("../data/new-shapes.json");

fn vectors() -> Vec<Value> {
    let doc: Value = serde_json::from_str(NEW_SHAPES).unwrap();
    doc["vectors"].as_array().unwrap().clone()
}

fn vector(case: &str) -> Value {
    vectors()
        .into_iter()
        .find(|v| v["case"] == case)
        .unwrap_or_else(|| panic!("no vector {case}"))
}

fn counter(dec: &Decoder, name: &str) -> u64 {
    dec.stats()
        .counters()
        .find(|(k, _)| *k == name)
        .unwrap_or_else(|| panic!("no decoder counter {name}"))
        .1
}

#[test]
fn every_new_shape_decodes_to_its_meaning() {
    let vs = vectors();
    assert_eq!(vs.len(), 10);
    for v in &vs {
        let ctx = format!("{} ({}, {})", v["case"], v["source"], v["status"]);
        assert!(
            matches!(
                v["status"].as_str(),
                Some("open-pr-schema" | "release-classes" | "release-source")
            ),
            "{ctx}: every vector says what encoded it"
        );
        let mut dec = all_dec();
        let payload = unhex(v["payload_hex"].as_str().unwrap());
        let exp = &v["expected"];
        let recs = run(&mut dec, &payload);
        assert_eq!(
            counter(&dec, "malformed_removals"),
            0,
            "{ctx}: a removal lost"
        );
        assert_eq!(recs.len(), 1, "{ctx}");
        let want = exp["events"].as_array().unwrap();
        let got = &recs[0].events;
        assert_eq!(got.len(), want.len(), "{ctx}");
        for (e, g) in want.iter().zip(got) {
            match (e["type"].as_str().unwrap(), &g.data) {
                ("BlockStored", Some(Data::Stored(s))) => check_store(e, s, &ctx),
                ("BlockRemoved", Some(Data::Removed(r))) => check_removal(e, r, &ctx),
                (t, d) => panic!("{ctx}: expected {t}, got {d:?}"),
            }
        }
        for (name, want) in exp["stats"].as_object().unwrap() {
            assert_eq!(
                counter(&dec, name),
                want.as_u64().unwrap(),
                "{ctx}: counter {name}"
            );
        }
    }
}

/// Typed keys are the keys their untyped form gave: one shape for a router, whatever the release.
#[test]
fn typed_extra_keys_are_the_untyped_keys() {
    let v = vector("typed_extra_keys_event_version_1");
    let mut dec = all_dec();
    let recs = run(&mut dec, &unhex(v["payload_hex"].as_str().unwrap()));
    let Some(Data::Stored(s)) = &recs[0].events[0].data else {
        panic!("a store")
    };
    let got: Vec<Vec<Key>> = s
        .blocks
        .iter()
        .map(|b| {
            b.extra_keys
                .iter()
                .map(|k| k.key.clone().unwrap())
                .collect()
        })
        .collect();
    let want: Vec<Vec<Key>> = v["extra_keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|block| {
            block
                .as_array()
                .unwrap()
                .iter()
                .map(|k| {
                    if let Some(t) = k.get("text") {
                        Key::Text(t.as_str().unwrap().into())
                    } else if let Some(b) = k.get("blob") {
                        Key::Blob(unhex(b.as_str().unwrap()))
                    } else {
                        let mm = k["multimodal"].as_array().unwrap();
                        Key::Multimodal(KvMultimodalKey {
                            identifier: mm[0].as_str().unwrap().into(),
                            offset: mm[1].as_i64().unwrap(),
                        })
                    }
                })
                .collect()
        })
        .collect();
    assert_eq!(got, want);
}

/// Under `--profile smg` the removals with a reason or copy counts are forwarded like any other,
/// and a medium the tier table does not know is not taken for a lower tier.
#[test]
fn smg_profile_forwards_the_new_removals_and_unknown_media() {
    let smg = || {
        Decoder::new(DecodeConfig {
            split_threshold: 1 << 30,
            profile: Profile::Smg,
            ..Default::default()
        })
    };
    for case in [
        "sglang_removal_with_reason",
        "removal_with_remaining_copy_counts",
    ] {
        let v = vector(case);
        let mut dec = smg();
        let recs = run(&mut dec, &unhex(v["payload_hex"].as_str().unwrap()));
        let removals = recs[0]
            .events
            .iter()
            .filter(|e| matches!(e.data, Some(Data::Removed(_))))
            .count();
        let want = v["expected"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["type"] == "BlockRemoved")
            .count();
        assert_eq!(removals, want, "{case}");
    }
    let v = vector("open_medium_strings");
    let mut dec = smg();
    let recs = run(&mut dec, &unhex(v["payload_hex"].as_str().unwrap()));
    let media: Vec<String> = recs[0]
        .events
        .iter()
        .map(|e| match &e.data {
            Some(Data::Stored(s)) => s.medium.clone().unwrap(),
            Some(Data::Removed(r)) => r.medium.clone().unwrap(),
            d => panic!("{d:?}"),
        })
        .collect();
    // `Storage` is the disk tier, which SMG does not index (docs/engine-wire.md §9.1).
    assert_eq!(media, ["cpu", "cpu", "CXL", "CXL", "hbm3", "hbm3"]);
    assert_eq!(counter(&dec, "filtered_tier"), 2);

    // A partial-block store first does not pin its group's block size: the full blocks after
    // it are the group's, not another cache's. Before, both were dropped as a conflict.
    let v = vector("partial_block_store_before_full_blocks");
    let mut dec = smg();
    let recs = run(&mut dec, &unhex(v["payload_hex"].as_str().unwrap()));
    let stored: Vec<usize> = recs[0]
        .events
        .iter()
        .map(|e| match &e.data {
            Some(Data::Stored(s)) => s.blocks.len(),
            d => panic!("{d:?}"),
        })
        .collect();
    assert_eq!(stored, [1, 2]);
    assert_eq!(counter(&dec, "filtered_group_conflict"), 0);
}
