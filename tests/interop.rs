//! Interop with SMG's published client stubs (PyPI `smg-grpc-proto`, pinned in
//! `scripts/python-venv.sh`): the real `kvbridge serve` binary, a simulated engine over real ZMQ,
//! and a Python subscriber that decodes with SMG's own generated classes
//! (`tests/interop/smg_stubs.py`).
//!
//! Our tonic client and our server share one `proto/`, so a shape error there (a wrong type,
//! label or number, written from the spec tables) would round-trip unnoticed in the Rust tests.
//! SMG's generated code is the independent decoder: the Python side compares descriptors, then
//! decodes every field of every batch the bridge sends on all four paths and checks them against
//! what tonic decoded here, plus the resume cases of smg-api.md §6.2.
//!
//! These tests FAIL (never skip) when Python or pip is unusable: CI always has them, and a skip
//! would silently drop the only check against SMG's own code.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use kvbridge::proto::common::{
    kv_block_extra_key::Key, kv_cache_event::Data, KvBlock, KvBlockExtraKey, KvCacheEvent,
    KvEventBatch,
};
use kvbridge::sim::{Layout, SimEvent};
use prost::Message;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Cargo's target dir, from the path of the binary under test (`<target>/<profile>/kvbridge`):
/// the test process does not get `CARGO_TARGET_DIR` unless the caller exported it.
fn target_dir() -> PathBuf {
    Path::new(bin())
        .parent()
        .and_then(Path::parent)
        .expect("binary under <target>/<profile>/")
        .to_path_buf()
}

fn show(o: &Output) -> String {
    format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `scripts/python-venv.sh` (idempotent: a stamp in the venv skips pip when the pins are
/// already installed) and returns the venv's python.
fn venv_python() -> PathBuf {
    let out = Command::new("bash")
        .arg(repo().join("scripts/python-venv.sh"))
        .env("CARGO_TARGET_DIR", target_dir())
        .env("INTEROP_VENV", target_dir().join("interop-venv"))
        .output()
        .expect("cannot run bash scripts/python-venv.sh");
    assert!(
        out.status.success(),
        "scripts/python-venv.sh failed (Python >= 3.10 with pip and PyPI access are required)\n{}",
        show(&out)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let py = PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("python-venv.sh printed no path")
            .trim(),
    );
    assert!(
        py.is_file(),
        "python-venv.sh printed {py:?}, which does not exist"
    );
    py
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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    // Let the SUB connect before the first publish.
    std::thread::sleep(Duration::from_millis(400));

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
    let batches = interesting_batches();
    let sentinel = last_hash(&batches.last().unwrap().1[0]);
    for (layout, events) in &batches {
        e.publish(*layout, events.clone(), 0);
    }
    let published = filler + batches.len() as u64;

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
    for (b, (layout, events)) in tail.iter().zip(&batches) {
        assert_batch_matches(b, *layout, events);
    }

    let expect = json!({
        "oldest": oldest,
        "newest": newest,
        "batches": window.iter().map(batch_json).collect::<Vec<_>>(),
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
