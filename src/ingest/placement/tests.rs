//! The v2 answer as the branch's worker sends it (its test `TestSnapshotV2` and its indexer's
//! `replica_bridge.rs` read the same maps), built here with `rmp-serde` from JSON values.

use super::*;
use serde_json::{json, Value};

fn msg(kind: &[u8], payload: Vec<u8>) -> Vec<Vec<u8>> {
    vec![Vec::new(), kind.to_vec(), payload]
}

fn map(v: Value) -> Vec<u8> {
    rmp_serde::to_vec_named(&v).unwrap()
}

fn header(rank: u32, barrier: i64, count: u64) -> Vec<Vec<u8>> {
    msg(
        b"header",
        map(json!({
            "version": 2, "namespace": "model-a", "model": "m", "worker_id": "w",
            "dp_rank": rank, "worker_epoch": "e-1", "worker_generation": "g",
            "hash_schema_version": 1, "page_size": 4, "is_bigram": false,
            "barrier_seq": barrier, "resume_seq": barrier + 1, "barrier_id": "b-1",
            "record_count": count,
            "cache_spec": {"version": 1, "components": 1, "swa_window_tokens": 0},
        })),
    )
}

fn record(hash: i64, parent: Option<i64>, tier: i32) -> Value {
    json!({"namespace": "model-a", "block_hash": hash, "parent_block_hash": parent,
           "block_size": 4, "tier": tier, "component_mask": 1})
}

fn chunk(records: Vec<Value>) -> Vec<Vec<u8>> {
    msg(b"chunk", map(Value::Array(records)))
}

fn end() -> Vec<Vec<u8>> {
    msg(b"end", Vec::new())
}

/// Feeds `answer` and returns what the last message completed.
fn read(tokens_required: bool, answer: &[Vec<Vec<u8>>]) -> EngineSnapshot {
    let mut r = Reader::new(0, tokens_required);
    for (i, m) in answer.iter().enumerate() {
        if let Some(done) = r.feed(m) {
            assert_eq!(i + 1, answer.len(), "completed early: {done:?}");
            return done;
        }
    }
    panic!("never completed")
}

#[test]
fn an_answer_becomes_stores_at_the_barrier_in_sglangs_array_form() {
    let records: Vec<Value> = (0..300)
        .map(|i| record(-1 - i, (i > 0).then_some(-i), 1 + (i % 3) as i32))
        .collect();
    let answer = [
        header(0, 41, 300),
        chunk(records[..200].to_vec()),
        chunk(records[200..].to_vec()),
        end(),
    ];
    let EngineSnapshot::State { cut, epoch, chunks } = read(false, &answer) else {
        panic!("no state");
    };
    assert_eq!(cut, 41, "the cut is the barrier");
    assert_eq!(epoch, Epoch::of_text(b"e-1"), "the live topic's epoch");
    assert_eq!(chunks.len(), 2, "256 events per batch");
    let mut events = Vec::new();
    for c in &chunks {
        let batch: Value = rmp_serde::from_slice(c).unwrap();
        assert_eq!(batch[2], json!(0), "the rank");
        events.extend(batch[1].as_array().unwrap().iter().cloned());
    }
    assert_eq!(events.len(), 300);
    assert_eq!(
        events[0],
        json!(["BlockStored", [-1], null, [], 4, null, "GPU"])
    );
    assert_eq!(
        events[1],
        json!(["BlockStored", [-2], -1, [], 4, null, "CPU_PINNED"])
    );
    assert_eq!(events[2][6], json!("DISK"));
    // Negative hashes are written as negative ints (the decoder flags the batch signed).
    assert_eq!(chunks[0][..2], [0x93, 0xcb], "[ts (f64), …]");
}

#[test]
fn the_smg_profile_declines_a_state_without_tokens() {
    let got = read(true, &[header(0, 3, 1)]);
    assert!(
        matches!(got, EngineSnapshot::Unavailable(w) if w.contains("tokens")),
        "{got:?}"
    );
}

#[test]
fn an_empty_state_is_a_state() {
    let got = read(false, &[header(0, 0, 0), end()]);
    assert_eq!(
        got,
        EngineSnapshot::State {
            cut: 0,
            epoch: Epoch::of_text(b"e-1"),
            chunks: vec![]
        }
    );
}

#[test]
fn the_older_spelling_of_epoch_and_rank_is_read() {
    let h = msg(
        b"header",
        map(
            json!({"version": 2, "epoch": "e-1", "replica_rank": 0, "barrier_seq": 5,
                   "resume_seq": 6, "barrier_id": "b", "record_count": 0}),
        ),
    );
    assert!(matches!(
        read(false, &[h, end()]),
        EngineSnapshot::State { cut: 5, .. }
    ));
}

#[test]
fn a_malformed_or_refused_answer_is_unavailable() {
    let unavailable =
        |answer: &[Vec<Vec<u8>>]| matches!(read(false, answer), EngineSnapshot::Unavailable(_));
    // another rank; resume_seq not barrier + 1; fewer or more records than declared
    assert!(unavailable(&[header(1, 3, 0)]));
    let mut h = header(0, 3, 0);
    h[2] = map(
        json!({"version": 2, "worker_epoch": "e", "dp_rank": 0, "barrier_seq": 3,
                      "resume_seq": 5, "barrier_id": "b", "record_count": 0}),
    );
    assert!(unavailable(&[h]));
    assert!(unavailable(&[
        header(0, 3, 2),
        chunk(vec![record(1, None, 1)]),
        end()
    ]));
    assert!(unavailable(&[
        header(0, 3, 1),
        chunk(vec![record(1, None, 1), record(2, Some(1), 1)])
    ]));
    // a tier outside 1..=3; the worker's error; a chunk before the header; garbage
    assert!(unavailable(&[
        header(0, 3, 1),
        chunk(vec![record(1, None, 4)])
    ]));
    assert!(unavailable(&[msg(
        b"error",
        b"snapshot provider busy".to_vec()
    )]));
    assert!(unavailable(&[chunk(vec![])]));
    assert!(unavailable(&[msg(b"header", vec![0xc1])]));
}

#[test]
fn vllms_answer_is_not_taken_for_v2() {
    assert!(is_v2(&header(0, 1, 0)));
    assert!(is_v2(&msg(b"error", Vec::new())));
    let vllm = vec![Vec::new(), 7i64.to_be_bytes().to_vec(), vec![0; 16]];
    assert!(!is_v2(&vllm));
}
