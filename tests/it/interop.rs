//! Interop with SMG's published client stubs (PyPI `smg-grpc-proto`, pinned in
//! `scripts/python-venv.sh`): the real `kvbridge serve` binary, a simulated engine over real ZMQ,
//! and a Python subscriber that decodes with SMG's own generated classes
//! (`tests/interop/smg_stubs.py`).
//!
//! Our tonic client and our server share one `proto/`, so a shape error there (a wrong type,
//! label or number, written from the spec tables) would round-trip unnoticed in the Rust tests.
//! SMG's generated code is the independent decoder: the Python side compares descriptors, then
//! decodes every field of every batch the bridge sends on all four paths and checks them against
//! what tonic decoded here, plus the resume cases of docs/smg-api.md §6.2.
//!
//! These tests FAIL (never skip) when Python or pip is unusable: CI always has them, and a skip
//! would silently drop the only check against SMG's own code.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use kvbridge::proto::common::{
    kv_block_extra_key::Key, kv_cache_event::Data, KvBlock, KvBlockExtraKey, KvCacheEvent,
    KvEventBatch,
};
use kvbridge_tools::sim::{Layout, SimEvent};
use prost::Message;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(60);

/// Runs `scripts/python-venv.sh` (idempotent: a stamp in the venv skips pip when the pins are
/// already installed) and returns the venv's python.
fn venv_python() -> PathBuf {
    common::setup_script(
        "python-venv.sh",
        &[("INTEROP_VENV", common::target_dir().join("interop-venv"))],
        "Python >= 3.10 with pip and PyPI access",
    )
}

fn smg_stubs(py: &Path, args: &[&str]) -> Output {
    Command::new(py)
        .arg(repo().join("tests/interop/smg_stubs.py"))
        .args(args)
        .env("PYTHONUNBUFFERED", "1")
        .output()
        .expect("cannot run tests/interop/smg_stubs.py")
}

#[test]
fn our_proto_matches_the_published_smg_descriptors() {
    let py = venv_python();
    let out = smg_stubs(
        &py,
        &[
            "descriptors",
            "--proto",
            &repo().join("proto").display().to_string(),
        ],
    );
    println!("{}", show(&out));
    assert!(
        out.status.success(),
        "descriptor mismatch against smg-grpc-proto\n{}",
        show(&out)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(", 0 mismatches"), "{text}");
    // The methods a sidecar forwards by name (each a metric label from the start) are the
    // package's: every method of each engine service but `SubscribeKvEvents`.
    for s in kvbridge::proto::ENGINE_SERVICES {
        let line = format!("methods: {} ", s.service);
        let theirs: std::collections::BTreeSet<&str> = text
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no methods of {} from the package:\n{text}", s.service))
            .split(',')
            .filter(|m| *m != "SubscribeKvEvents")
            .collect();
        let ours: std::collections::BTreeSet<&str> = s.methods.iter().copied().collect();
        assert_eq!(ours, theirs, "{}'s methods", s.service);
    }
}

// ----- expectation JSON: the same shape as `batch_dict` in smg_stubs.py -----

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn extra_key_json(k: &KvBlockExtraKey) -> Value {
    match &k.key {
        None => json!({}),
        Some(Key::Text(s)) => json!({ "text": s }),
        Some(Key::Blob(b)) => json!({ "blob": hex(b) }),
        Some(Key::Number(n)) => json!({ "number": n }),
        Some(Key::Multimodal(m)) => {
            json!({ "multimodal": { "identifier": m.identifier, "offset": m.offset } })
        }
    }
}

fn block_json(k: &KvBlock) -> Value {
    json!({
        "block_hash": k.block_hash,
        "token_ids": k.token_ids,
        "block_size": k.block_size,
        "lora_id": k.lora_id,
        "cache_level": k.cache_level,
        "extra_keys": k.extra_keys.iter().map(extra_key_json).collect::<Vec<_>>(),
    })
}

fn event_json(e: &KvCacheEvent) -> Value {
    let mut v = json!({ "event_id": e.event_id });
    let (key, body) = match &e.data {
        None => return v,
        Some(Data::Stored(s)) => (
            "stored",
            json!({
                "blocks": s.blocks.iter().map(block_json).collect::<Vec<_>>(),
                "parent_block_hash": s.parent_block_hash,
                "tier": s.tier,
                "medium": s.medium,
                "group_idx": s.group_idx,
                "kv_cache_spec_kind": s.kv_cache_spec_kind,
                "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
                "locality": s.locality,
                "ownership": s.ownership,
                "session_id": s.session_id,
                "lora_name": s.lora_name,
                "cache_salt": s.cache_salt,
            }),
        ),
        Some(Data::Removed(r)) => (
            "removed",
            json!({
                "block_hashes": r.block_hashes,
                "cache_level": r.cache_level,
                "tier": r.tier,
                "medium": r.medium,
                "group_idx": r.group_idx,
                "locality": r.locality,
                "ownership": r.ownership,
            }),
        ),
        Some(Data::Cleared(c)) => ("cleared", json!({ "ownership": c.ownership })),
    };
    v[key] = body;
    v
}

/// One batch as plain data (absent optional fields are `null`), plus tonic's re-encoding, which
/// must equal the bytes SMG's classes re-encode from the same message.
fn batch_json(b: &KvEventBatch) -> Value {
    json!({
        "sequence_number": b.sequence_number,
        "timestamp": b.timestamp,
        "dp_rank": b.dp_rank,
        "events": b.events.iter().map(event_json).collect::<Vec<_>>(),
        "snapshot": b.snapshot.as_ref().map(|s| json!({
            "index": s.index, "count": s.count, "blocks": s.blocks, "unknown_before": s.unknown_before,
        })),
        // kvbridge has no load source and never sets `load`; only its presence is compared.
        "load": b.load.as_ref().map(|_| "present"),
        "bytes_hex": hex(&b.encode_to_vec()),
    })
}

// ----- what the engine publishes -----

/// Hashes with the top bit set for even `i`: as int64 they are negative, i.e. 10-byte varints on
/// the wire, as about half of real hashes are.
fn hash(seed: u64, i: u64) -> u64 {
    let h = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i * 0x1_0000_0001);
    if (seed + i) % 2 == 0 {
        h | 1 << 63
    } else {
        h & !(1 << 63)
    }
}

fn stored(seed: u64, blocks: u64, parent: Option<u64>, medium: Option<&str>) -> SimEvent {
    SimEvent::Stored {
        hashes: (0..blocks).map(|i| hash(seed, i)).collect(),
        parent,
        tokens: (0..blocks * 16)
            .map(|i| ((seed * 131 + i * 7) % 151_000) as u32 + 1)
            .collect(),
        block_size: 16,
        medium: medium.map(str::to_string),
    }
}

fn last_hash(e: &SimEvent) -> u64 {
    match e {
        SimEvent::Stored { hashes, .. } => *hashes.last().unwrap(),
        _ => unreachable!(),
    }
}

/// Batches covering every layout: root stores, chained stores (parent set), host-tier stores,
/// removals on both tiers, multi-event batches and an engine clear.
fn interesting_batches() -> Vec<(Layout, Vec<SimEvent>)> {
    let mut out = Vec::new();
    for (i, layout) in Layout::ALL.into_iter().enumerate() {
        let s = 10_000 + i as u64 * 100;
        let root = stored(s, 3, None, Some("GPU"));
        let child = stored(s + 1, 2, Some(last_hash(&root)), Some("CPU"));
        let first_root = hash(s, 0);
        let grandchild = stored(s + 2, 1, Some(last_hash(&child)), Some("GPU"));
        out.push((layout, vec![root]));
        out.push((layout, vec![child.clone()]));
        out.push((
            layout,
            vec![SimEvent::Removed {
                hashes: vec![first_root],
                medium: Some("GPU".into()),
            }],
        ));
        out.push((
            layout,
            vec![
                grandchild,
                SimEvent::Removed {
                    hashes: vec![hash(s + 1, 0), hash(s + 1, 1)],
                    medium: Some("CPU".into()),
                },
                stored(s + 3, 4, None, None),
            ],
        ));
        if matches!(layout, Layout::Vllm022 | Layout::Sglang0523) {
            out.push((
                layout,
                vec![SimEvent::Cleared, stored(s + 4, 2, None, Some("GPU"))],
            ));
        }
    }
    // The last batch: a store whose hash tells the collector that everything has arrived.
    out.push((Layout::Vllm033, vec![stored(99_999, 1, None, Some("GPU"))]));
    out
}

// Rich events: the sim's layouts leave most superset fields nil, so one batch is written by hand
// in the map form of vLLM >= 0.30 / SGLang >= 0.5.22 (docs/engine-wire.md §4, §5) with every optional
// field the engines can send, several of them explicitly zero (presence must survive: absent and
// 0 differ for G2).
const RICH_STORE: [u64; 2] = [0xF00D_0000_0000_0001, 0x7EED_0000_0000_0002];
const RICH_PARENT: u64 = 0x8000_0000_0000_0000; // i64::MIN: the longest varint

fn mp_str(o: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(o, s).unwrap();
}

fn rich_payload() -> Vec<u8> {
    use rmp::encode as enc;
    let o = &mut Vec::new();
    enc::write_array_len(o, 3).unwrap();
    enc::write_f64(o, 1_700_000_123.25).unwrap();
    enc::write_array_len(o, 2).unwrap();

    enc::write_map_len(o, 16).unwrap();
    mp_str(o, "type");
    mp_str(o, "BlockStored");
    mp_str(o, "block_hashes");
    enc::write_array_len(o, 2).unwrap();
    for h in RICH_STORE {
        enc::write_uint(o, h).unwrap();
    }
    mp_str(o, "parent_block_hash");
    enc::write_uint(o, RICH_PARENT).unwrap();
    mp_str(o, "token_ids");
    enc::write_array_len(o, 8).unwrap();
    for t in [0u64, 1, 127, 128, 65_535, 65_536, 151_000, u32::MAX as u64] {
        enc::write_uint(o, t).unwrap();
    }
    mp_str(o, "block_size");
    enc::write_uint(o, 4).unwrap();
    mp_str(o, "lora_id");
    enc::write_uint(o, 0).unwrap(); // present and zero
    mp_str(o, "medium");
    mp_str(o, "CPU_PINNED"); // HOST tier, cache_level 1
    mp_str(o, "lora_name");
    mp_str(o, "adapter-a");
    mp_str(o, "extra_keys");
    enc::write_array_len(o, 2).unwrap();
    // Block 0: text, blob, number, (identifier, offset); block 1: nil (no keys).
    enc::write_array_len(o, 4).unwrap();
    mp_str(o, "adapter-a");
    enc::write_bin(o, &[0x00, 0xFF, 0x10]).unwrap();
    enc::write_sint(o, -42).unwrap();
    enc::write_array_len(o, 2).unwrap();
    mp_str(o, "img-1");
    enc::write_uint(o, 3).unwrap();
    enc::write_nil(o).unwrap();
    mp_str(o, "group_idx");
    enc::write_uint(o, 0).unwrap();
    mp_str(o, "kv_cache_spec_kind");
    mp_str(o, "full_attention");
    mp_str(o, "kv_cache_spec_sliding_window");
    enc::write_uint(o, 0).unwrap();
    mp_str(o, "locality");
    mp_str(o, "LOCAL");
    mp_str(o, "ownership");
    mp_str(o, "engine");
    mp_str(o, "session_id");
    mp_str(o, ""); // present and empty
    mp_str(o, "cache_salt");
    mp_str(o, "salt-1");

    enc::write_map_len(o, 6).unwrap();
    mp_str(o, "type");
    mp_str(o, "BlockRemoved");
    mp_str(o, "block_hashes");
    enc::write_array_len(o, 2).unwrap();
    enc::write_uint(o, RICH_STORE[1]).unwrap();
    enc::write_uint(o, u64::MAX).unwrap(); // -1 as int64
    mp_str(o, "medium");
    mp_str(o, "CPU_PINNED");
    mp_str(o, "group_idx");
    enc::write_uint(o, 0).unwrap();
    mp_str(o, "locality");
    mp_str(o, "LOCAL");
    mp_str(o, "ownership");
    mp_str(o, "engine");

    enc::write_uint(o, 0).unwrap(); // rank
    std::mem::take(o)
}

/// The rich batch must carry every field it was given, or the Python comparison would only see
/// absent fields decode as absent.
fn assert_rich(b: &KvEventBatch) {
    assert_eq!(b.timestamp, 1_700_000_123.25);
    assert_eq!(b.events.len(), 2, "rich batch: {b:?}");
    let Some(Data::Stored(s)) = &b.events[0].data else {
        panic!("rich store: {b:?}")
    };
    let hs: Vec<u64> = s.blocks.iter().map(|k| k.block_hash as u64).collect();
    assert_eq!(hs, RICH_STORE);
    assert_eq!(s.parent_block_hash, Some(RICH_PARENT as i64));
    assert_eq!(s.blocks[0].token_ids, [0, 1, 127, 128]);
    assert_eq!(s.blocks[1].token_ids, [65_535, 65_536, 151_000, u32::MAX]);
    assert!(s
        .blocks
        .iter()
        .all(|k| k.block_size == 4 && k.lora_id == Some(0) && k.cache_level == Some(1)));
    assert_eq!(
        s.blocks[0].extra_keys.len(),
        4,
        "{:?}",
        s.blocks[0].extra_keys
    );
    assert!(s.blocks[1].extra_keys.is_empty());
    assert_eq!(s.tier, Some(2));
    assert_eq!(s.medium.as_deref(), Some("CPU_PINNED"));
    assert_eq!(s.group_idx, Some(0));
    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(s.kv_cache_spec_sliding_window, Some(0));
    assert_eq!(s.locality, Some(1));
    assert_eq!(s.ownership.as_deref(), Some("engine"));
    assert_eq!(s.session_id.as_deref(), Some(""));
    assert_eq!(s.lora_name.as_deref(), Some("adapter-a"));
    assert_eq!(s.cache_salt.as_deref(), Some("salt-1"));
    let Some(Data::Removed(r)) = &b.events[1].data else {
        panic!("rich removal: {b:?}")
    };
    assert_eq!(r.block_hashes, [RICH_STORE[1] as i64, -1]);
    assert_eq!(
        (r.cache_level, r.tier, r.group_idx, r.locality),
        (Some(1), Some(2), Some(0), Some(1))
    );
    assert_eq!(
        (r.medium.as_deref(), r.ownership.as_deref()),
        (Some("CPU_PINNED"), Some("engine"))
    );
}

/// Sanity check on the Rust side, so the Python comparison is not garbage against garbage: the
/// decoded batch carries exactly the engine's events.
fn assert_batch_matches(b: &KvEventBatch, layout: Layout, events: &[SimEvent]) {
    assert_eq!(
        b.events.len(),
        events.len(),
        "{layout:?} seq {}: event count",
        b.sequence_number
    );
    for (got, want) in b.events.iter().zip(events) {
        match (&got.data, want) {
            (
                Some(Data::Stored(s)),
                SimEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    ..
                },
            ) => {
                let hs: Vec<u64> = s.blocks.iter().map(|k| k.block_hash as u64).collect();
                assert_eq!(&hs, hashes, "{layout:?}: stored hashes");
                assert_eq!(
                    s.parent_block_hash,
                    parent.map(|p| p as i64),
                    "{layout:?}: parent"
                );
                let ts: Vec<u32> = s
                    .blocks
                    .iter()
                    .flat_map(|k| k.token_ids.iter().copied())
                    .collect();
                assert_eq!(&ts, tokens, "{layout:?}: tokens");
                assert!(
                    s.blocks.iter().all(|k| k.block_size == *block_size as i32),
                    "{layout:?}: block size"
                );
            }
            (Some(Data::Removed(r)), SimEvent::Removed { hashes, .. }) => {
                let hs: Vec<u64> = r.block_hashes.iter().map(|&h| h as u64).collect();
                assert_eq!(&hs, hashes, "{layout:?}: removed hashes");
            }
            (Some(Data::Cleared(c)), SimEvent::Cleared) => assert!(c.ownership.is_none()),
            (g, w) => panic!(
                "{layout:?} seq {}: decoded {g:?}, published {w:?}",
                b.sequence_number
            ),
        }
    }
}

const DP_RANK_HEADER: &str = "kvbridge-dp-rank";

/// A tonic subscriber (S = 0) on rank `rank`'s own ring, selected by request metadata.
async fn subscribe_rank(url: &str, rank: u32) -> tonic::Streaming<KvEventBatch> {
    use kvbridge::proto::common::SubscribeKvEventsRequest;
    use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;
    let mut c = VllmEngineClient::connect(url.to_string())
        .await
        .expect("connect");
    let mut req = tonic::Request::new(SubscribeKvEventsRequest {
        start_sequence_number: 0,
        load_records_before_first_batch: true,
    });
    req.metadata_mut()
        .insert(DP_RANK_HEADER, rank.to_string().parse().unwrap());
    c.subscribe_kv_events(req)
        .await
        .expect("subscribe with the rank header")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_smg_stubs_decode_every_field_on_all_four_paths() {
    // The venv first: without Python there is nothing to compare against (fail, don't skip).
    let py = venv_python();

    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let args: Vec<String> = [
        "--zmq",
        &e.endpoint,
        "--replay",
        &e.replay,
        "--seq-base",
        "1",
        // The smallest ring, so that the filler below wraps it and an old cursor is out of range.
        "--ring-size",
        "1MiB",
        // Also a per-rank ring selected by request metadata (docs/smg-api.md §7 (b)): its batches
        // carry `dp_rank`, the one KvEventBatch field the merged stream leaves unset.
        "--dp-mode",
        "metadata",
        // The retained window's wire format is checked here (a Rust subscriber sets field 2,
        // which would get snapshot chunks after the wrap: tests/it/snapshot.rs covers those).
        "--snapshot",
        "off",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    // The SUB subscribed before the first publish (an earlier one would be lost to it).
    e.wait_subscribed();

    // Filler: ~6.6 KB per batch, 260 batches ≈ 1.7 MB through a 1 MiB ring; chained stores in
    // every layout, so the retained window the Python side checks is varied throughout.
    let mut parent = None;
    let filler = 260u64;
    for i in 0..filler {
        let ev = stored(
            i + 1,
            100,
            if i % 2 == 1 { parent } else { None },
            Some("GPU"),
        );
        parent = Some(last_hash(&ev));
        e.publish(layout(i as usize), vec![ev], 0);
    }
    // The hand-written rich batch, then the sim's batches in every layout.
    e.with(|p| p.publish(rich_payload()));
    let batches = interesting_batches();
    let sentinel = last_hash(&batches.last().unwrap().1[0]);
    for (layout, events) in &batches {
        e.publish(*layout, events.clone(), 0);
    }
    let published = filler + 1 + batches.len() as u64;

    // Wait until ingest has written the last batch to both rings. Only then is the window
    // stable: a subscriber that starts while ingest still writes sees an O that the rest of the
    // burst then overwrites (and, reading from O of a ring that is still wrapping, can be lapped:
    // DATA_LOSS). So the state is read from the ring files' own counters, without reading
    // records: newest = one record per engine batch, numbered from 1.
    let merged = dir.path().join("ring");
    let rank0 = dir.path().join("ring-rank0");
    let deadline = std::time::Instant::now() + T;
    for ring in [&merged, &rank0] {
        let what = format!("{} reaches record {published}", ring.display());
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        common::eventually_async(&what, left, || async {
            match kvbridge_shm::RingReader::open(ring).map(|r| r.newest()) {
                Ok(n) if n >= published => Ok(()),
                other => Err(other.map_err(|e| e.to_string())),
            }
        })
        .await;
    }

    // The retained window, as tonic decodes it (vLLM path, S = 0 → from O).
    let mut s = subscribe(&bridge.url(), 0).await.expect("subscribe S=0");
    let window = collect_until(&mut s, T, |b| stored_hashes(b).contains(&sentinel)).await;
    drop(s);
    assert_contiguous(&window);
    let (oldest, newest) = (
        window[0].sequence_number,
        window.last().unwrap().sequence_number,
    );
    assert_eq!(
        newest, published,
        "one record per engine batch, numbered from 1"
    );
    assert!(
        oldest > 2,
        "the 1 MiB ring must have wrapped (oldest {oldest}) for the too-old case"
    );
    let tail = &window[window.len() - batches.len()..];
    assert_rich(&window[window.len() - batches.len() - 1]);
    for (b, (layout, events)) in tail.iter().zip(&batches) {
        assert_batch_matches(b, *layout, events);
    }

    // Rank 0's own ring, as tonic decodes it with the selection header.
    let mut s = subscribe_rank(&bridge.url(), 0).await;
    let rank_window = collect_until(&mut s, T, |b| stored_hashes(b).contains(&sentinel)).await;
    drop(s);
    assert_contiguous(&rank_window);
    assert!(
        rank_window.iter().all(|b| b.dp_rank == Some(0)),
        "per-rank stream sets dp_rank"
    );
    assert_eq!(
        stored_hashes(&rank_window[rank_window.len() - batches.len()..]),
        stored_hashes(tail)
    );

    let expect = json!({
        "oldest": oldest,
        "newest": newest,
        "batches": window.iter().map(batch_json).collect::<Vec<_>>(),
        "rank_stream": {
            "metadata": [[DP_RANK_HEADER, "0"]],
            "oldest": rank_window[0].sequence_number,
            "newest": rank_window.last().unwrap().sequence_number,
            "batches": rank_window.iter().map(batch_json).collect::<Vec<_>>(),
        },
        "resume": {
            "in_window": [oldest - 1, oldest, (oldest + newest) / 2, newest - 1],
            "at_head": [newest],
            "too_old": [1, oldest - 2],
            "future": [newest + 1, newest + 2, newest + 1000, u64::MAX],
        },
    });
    let expect_path = dir.path().join("expect.json");
    std::fs::write(&expect_path, serde_json::to_vec(&expect).unwrap()).unwrap();

    let grpc = bridge.grpc.to_string();
    let out = tokio::task::spawn_blocking(move || {
        smg_stubs(
            &py,
            &[
                "subscribe",
                "--grpc",
                &grpc,
                "--expect",
                &expect_path.display().to_string(),
            ],
        )
    })
    .await
    .unwrap();
    println!("{}", show(&out));
    assert!(
        out.status.success(),
        "SMG stubs disagree with kvbridge\n{}\nbridge log:\n{}",
        show(&out),
        bridge.log()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or("");
    assert!(
        last.starts_with("interop: ") && last.ends_with(" passed, 0 failed"),
        "{last}"
    );
    assert!(bridge.stop().success());
}
