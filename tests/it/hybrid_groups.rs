//! A hybrid model's KV-cache groups (sliding window + full attention), shaped as vLLM 0.32
//! publishes them for a tiny Gemma-3: group 0 the sliding group, group 1 the full group, the
//! same block hash stored in both, removals that name their group but not its kind
//! (docs/engine-wire.md §7, "Groups and tiers").
//!
//! - `--profile smg` across a kvbridge SIGKILL: the sliding group's removal of a hash the full
//!   group still holds is not forwarded after the restart either (the group's kind is kept in
//!   the ring's writer notes), and a removal of a group no store was seen of is dropped and
//!   counted (`filtered_group_unknown`). Before, the restarted kvbridge had forgotten the kind
//!   and forwarded the removal: every gateway dropped a block the engine still held.
//! - `--profile all`: the snapshot (the checkpoint's chunks, what a late joiner gets) holds each
//!   group's copy of a hash apart: a sliding removal leaves the full group's block. Before, the
//!   table keyed blocks by (hash, tier) and listed a hash held by both groups once, under the
//!   group that stored it first.

use crate::common;

use std::collections::BTreeSet;

use common::*;
use kvbridge::proto::common::{kv_cache_event::Data, KvEventBatch};
use prost::Message;
use rmp::encode as enc;

const T: std::time::Duration = std::time::Duration::from_secs(30);
const BS: u32 = 16;
const SLIDING: u32 = 0;
const FULL: u32 = 1;

/// A vLLM 0.32 `BlockStored` (array form, 12 elements) of `hashes` in `group`.
fn stored(o: &mut Vec<u8>, hashes: &[u64], parent: Option<u64>, group: u32) {
    enc::write_array_len(o, 12).unwrap();
    enc::write_str(o, "BlockStored").unwrap();
    enc::write_array_len(o, hashes.len() as u32).unwrap();
    for &h in hashes {
        enc::write_uint(o, h).unwrap();
    }
    match parent {
        Some(p) => enc::write_uint(o, p).map(drop).unwrap(),
        None => enc::write_nil(o).unwrap(),
    }
    enc::write_array_len(o, BS * hashes.len() as u32).unwrap();
    for (i, &h) in hashes.iter().enumerate() {
        for t in 0..BS {
            enc::write_uint(o, (h * 31 + i as u64 * 7 + t as u64) % 500).unwrap();
        }
    }
    enc::write_uint(o, BS as u64).unwrap();
    enc::write_nil(o).unwrap(); // lora_id
    enc::write_str(o, "GPU").unwrap(); // medium
    enc::write_nil(o).unwrap(); // lora_name
    enc::write_nil(o).unwrap(); // extra_keys
    enc::write_uint(o, group as u64).unwrap();
    if group == SLIDING {
        enc::write_str(o, "sliding_window").unwrap();
        enc::write_uint(o, 64).unwrap();
    } else {
        enc::write_str(o, "full_attention").unwrap();
        enc::write_nil(o).unwrap();
    }
}

/// A vLLM 0.32 `BlockRemoved`: `[tag, hashes, medium, group_idx]`, no kind.
fn removed(o: &mut Vec<u8>, hashes: &[u64], group: u32) {
    enc::write_array_len(o, 4).unwrap();
    enc::write_str(o, "BlockRemoved").unwrap();
    enc::write_array_len(o, hashes.len() as u32).unwrap();
    for &h in hashes {
        enc::write_uint(o, h).unwrap();
    }
    enc::write_str(o, "GPU").unwrap();
    enc::write_uint(o, group as u64).unwrap();
}

/// One engine batch `[ts, events, rank 0]` of events written by `events`.
fn batch(n: u32, events: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut o = Vec::new();
    enc::write_array_len(&mut o, 3).unwrap();
    enc::write_f64(&mut o, now_ts()).unwrap();
    enc::write_array_len(&mut o, n).unwrap();
    events(&mut o);
    enc::write_uint(&mut o, 0).unwrap();
    o
}

fn publish(e: &Engine, payload: Vec<u8>) {
    e.with(move |p| p.publish(payload));
}

/// One op of a stream: (store or remove, group, hash).
type Op = (&'static str, Option<u32>, i64);

fn ops(batches: &[KvEventBatch]) -> Vec<Op> {
    let mut out = Vec::new();
    for b in batches {
        for ev in &b.events {
            match &ev.data {
                Some(Data::Stored(s)) => out.extend(
                    s.blocks
                        .iter()
                        .map(|k| ("store", s.group_idx, k.block_hash)),
                ),
                Some(Data::Removed(r)) => {
                    out.extend(r.block_hashes.iter().map(|&h| ("remove", r.group_idx, h)))
                }
                Some(Data::Cleared(_)) => out.push(("clear", None, 0)),
                _ => {}
            }
        }
    }
    out
}

fn decoder_count(page: &str, kind: &str) -> f64 {
    metric(
        page,
        "kvbridge_decoder_events_total",
        &[("rank", "0"), ("kind", kind)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smg_keeps_a_sliding_groups_removals_out_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let mut args = e.bridge_args();
    args.extend(["--profile".to_string(), "smg".to_string()]);
    let (bridge, _) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    e.wait_subscribed();
    // Both groups store blocks 1 and 2 (the same hashes), as vLLM does for a hybrid model.
    publish(
        &e,
        batch(2, |o| {
            stored(o, &[1, 2], None, SLIDING);
            stored(o, &[1, 2], None, FULL);
        }),
    );
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let first = collect_until(&mut s, T, |g| !ops(g).is_empty()).await;
    assert_eq!(
        ops(&first),
        [("store", Some(FULL), 1), ("store", Some(FULL), 2)],
        "smg forwards the full group only"
    );
    drop(s);
    let (grpc, args) = (bridge.grpc, bridge.args.clone());
    bridge.kill();

    let bridge = Bridge::start_args(dir.path(), grpc, &ring, args);
    let metrics = bridge.metrics.expect("metrics on");
    e.wait_subscribed_after(1);
    // The sliding group evicts block 1 (the full group still holds it); the full group evicts
    // block 2; a group never seen evicts block 3; then a marker store.
    publish(&e, batch(1, |o| removed(o, &[1], SLIDING)));
    publish(&e, batch(1, |o| removed(o, &[2], FULL)));
    publish(&e, batch(1, |o| removed(o, &[3], 7)));
    publish(&e, batch(1, |o| stored(o, &[9], Some(1), FULL)));
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let all = collect_until(&mut s, T, |g| ops(g).iter().any(|o| o.2 == 9)).await;
    assert_eq!(
        ops(&all),
        [
            ("store", Some(FULL), 1),
            ("store", Some(FULL), 2),
            ("remove", Some(FULL), 2),
            ("store", Some(FULL), 9),
        ],
        "after the restart, as before it: the sliding group's removal of block 1 stays out"
    );
    let page = wait_metrics(metrics, T, |p| {
        decoder_count(p, "filtered_group_unknown") >= 1.0
    });
    assert_eq!(decoder_count(&page, "filtered_group"), 1.0, "{page}");
    assert_eq!(decoder_count(&page, "filtered_group_unknown"), 1.0);
    assert_eq!(decoder_count(&page, "filtered_group_conflict"), 0.0);
    // No gateway can hold a block of a group no store was forwarded of (the groups learnt
    // before the restart came back from the ring): the dropped removal leaves nothing behind,
    // and the rank stays exact.
    assert_eq!(
        metric(&page, "kvbridge_rank_exact", &[("rank", "0")]),
        1.0,
        "{page}"
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_rank_degraded",
            &[("rank", "0"), ("cause", "unknown_group")]
        ),
        0.0,
        "{page}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_profile_snapshot_keeps_each_groups_copy_of_a_hash() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let mut args = e.bridge_args();
    args.extend(["--profile", "all"].map(String::from));
    let bridge = Bridge::start(dir.path(), &ring, &args);
    e.wait_subscribed();
    publish(
        &e,
        batch(2, |o| {
            stored(o, &[1, 2], None, SLIDING);
            stored(o, &[1, 2], None, FULL);
        }),
    );
    publish(&e, batch(1, |o| removed(o, &[1], SLIDING)));
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let got = collect_until(&mut s, T, |g| ops(g).iter().any(|o| o.0 == "remove")).await;
    assert_eq!(ops(&got).len(), 5, "{:?}", ops(&got));
    drop(s);
    assert!(
        bridge.stop().success(),
        "SIGTERM writes the checkpoint (the table is kept: --snapshot auto)"
    );

    let chunks = kvbridge::snapshot::from_checkpoint(&ring).expect("checkpoint");
    let mut held = BTreeSet::new();
    for c in &chunks.chunks {
        let b = KvEventBatch::decode(c.as_ref()).unwrap();
        for (op, group, hash) in ops(&[b]) {
            match op {
                "store" => assert!(held.insert((group, hash)), "({group:?}, {hash}) twice"),
                // chunk 0 begins with a clear
                "clear" => assert!(held.is_empty()),
                _ => panic!("{op} in a snapshot"),
            }
        }
    }
    let want: BTreeSet<_> = [(Some(FULL), 1), (Some(FULL), 2), (Some(SLIDING), 2)].into();
    assert_eq!(
        held, want,
        "the engine's live set per (group, hash): the sliding removal leaves the full group's block 1"
    );
    assert_eq!(chunks.unknown_before, 0);
}
