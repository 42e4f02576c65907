//! `serve --publish-zmq`: the wire, checked frame by frame against vLLM's own decoder (the
//! `kv_events.py` classes of the pinned wheel, scripts/vllm-events-venv.sh), with its replay
//! protocol, across an engine restart, and for two ranks on port + rank.

use crate::common;

use std::time::{Duration, Instant};

use common::zmq_publish::*;
use common::{Bridge, Engine};

/// Every field, frame by frame, through vLLM's decoder; the engine's restart becomes an
/// `AllBlocksCleared` in a sequence that never goes back; replay (window, state, future) ends
/// with the engine's end marker.
#[test]
fn wire_decodes_with_vllms_own_classes_and_survives_an_engine_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engine = Engine::start(0);
    let mut args = base_args(&[&engine]);
    args.extend(publish_args("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"));
    args.extend(["--publish-zmq-topic", "kv@pod-a@model"].map(String::from));
    let bridge = Bridge::start(dir.path(), &ring, &args);
    let (pub_ep, replay_ep) = endpoints(&bridge, 1).remove(0);
    let ctx = zmq::Context::new();
    let s = sub(&ctx, &pub_ep);
    let before = warm_up(&s, || {
        engine.with(|p| p.publish(warm_batch(0)));
    });

    engine.with(|p| p.publish(full_batch(0)));
    let full = recv(&s, Duration::from_secs(10)).expect("the full batch");
    assert_eq!(full.topic, b"kv@pod-a@model");
    assert_eq!(full.seq, before + 1, "contiguous");

    // The engine restarts on the same endpoints: its seq goes back to 0.
    let (ep, rp) = (engine.endpoint.clone(), engine.replay.clone());
    drop(engine);
    let engine = Engine::start_at(&ep, &rp);
    // (kvbridge's SUB reconnects in the background: publish until something arrives)
    let mut after = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while after.len() < 2 {
        assert!(
            Instant::now() < deadline,
            "nothing after the engine restart"
        );
        engine.with(|p| p.publish(full_batch_at(0, TS_RESTARTED)));
        while let Some(m) = recv(&s, Duration::from_millis(300)) {
            after.push(m);
        }
    }
    let seqs: Vec<u64> = after.iter().map(|m| m.seq).collect();
    assert_eq!(
        seqs,
        (full.seq + 1..=full.seq + after.len() as u64).collect::<Vec<_>>(),
        "kvbridge's own numbering: never reset by the engine"
    );
    let newest = after.last().unwrap().seq;

    // Replays: inside the window, from 0 (the state), and beyond the newest.
    let window = replay(&ctx, &replay_ep, full.seq);
    assert_eq!(
        window.iter().map(|m| m.seq).collect::<Vec<_>>(),
        (full.seq..=newest).collect::<Vec<_>>(),
        "exactly start … newest"
    );
    assert!(window.iter().all(|m| m.topic == b"kv@pod-a@model"));
    assert_eq!(window[0].payload, full.payload, "replay = the live bytes");
    let state = replay(&ctx, &replay_ep, 0);
    assert!(!state.is_empty());
    assert!(
        replay(&ctx, &replay_ep, full.seq + 1000).is_empty(),
        "a future start: end marker only"
    );

    let mut payloads: Vec<&[u8]> = vec![&full.payload];
    payloads.extend(after.iter().map(|m| m.payload.as_slice()));
    payloads.extend(state.iter().map(|m| m.payload.as_slice()));
    let d = vllm_decode(&payloads);
    assert_eq!(d[0], full_batch_decoded(0), "every field, as vLLM reads it");
    assert_eq!(
        d[1]["events"],
        serde_json::json!([{ "type": "AllBlocksCleared" }]),
        "the engine restart, in-band"
    );
    for v in &d[2..after.len() + 1] {
        assert_eq!(
            *v,
            full_batch_decoded_at(0, TS_RESTARTED),
            "after the restart"
        );
    }
    assert_eq!(
        d[after.len() + 1]["events"][0]["type"],
        "AllBlocksCleared",
        "a replay of the state starts with a clear"
    );
    for (m, w) in state.windows(2).map(|w| (&w[0], &w[1])) {
        assert_eq!(m.seq + 1, w.seq, "replayed seqs are contiguous");
    }
    assert_eq!(
        state.last().unwrap().seq,
        newest,
        "the state ends at the newest"
    );
    drop(bridge);
}

/// Two DP ranks: rank r on PORT + r and REPLAY + r, each with its own contiguous numbering and
/// its own rank in every batch.
#[test]
fn two_ranks_publish_on_port_plus_rank() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let (e0, e1) = (Engine::start(0), Engine::start(1));
    let (p, r, bridge) = two_rank_bridge(dir.path(), &ring, &e0, &e1);
    let eps = endpoints(&bridge, 2);
    assert_eq!(eps[0].0, format!("tcp://127.0.0.1:{p}"));
    assert_eq!(eps[1].0, format!("tcp://127.0.0.1:{}", p + 1));
    assert_eq!(eps[1].1, format!("tcp://127.0.0.1:{}", r + 1));
    let ctx = zmq::Context::new();
    let engines = [&e0, &e1];
    for (rank, e) in engines.iter().enumerate() {
        let rank = rank as u32;
        let s = sub(&ctx, &eps[rank as usize].0);
        warm_up(&s, || {
            e.with(move |p| p.publish(warm_batch(rank)));
        });
        for _ in 0..3 {
            e.with(move |p| p.publish(full_batch(rank)));
        }
        let got: Vec<Msg> = (0..3)
            .map(|_| recv(&s, Duration::from_secs(10)).unwrap())
            .collect();
        let d = vllm_decode(&got.iter().map(|m| m.payload.as_slice()).collect::<Vec<_>>());
        for v in &d {
            assert_eq!(*v, full_batch_decoded(rank));
        }
        let all = replay(&ctx, &eps[rank as usize].1, 1);
        let seqs: Vec<u64> = all.iter().map(|m| m.seq).collect();
        assert_eq!(
            seqs,
            (1..=seqs.len() as u64).collect::<Vec<_>>(),
            "rank {rank}: its own 1, 2, …"
        );
        assert_eq!(all.last().unwrap().seq, got[2].seq);
    }
}

/// The `block_hashes` and `parent_block_hash` values of every event of `payload`, in order, as
/// raw msgpack: marker and bytes, as the sender wrote them.
fn raw_hashes(payload: &[u8]) -> Vec<Vec<u8>> {
    use rmp::decode::{read_array_len, read_map_len, read_str_len};
    use rmp::Marker;
    // Walks `[ts, events, rank]` with map events, taking each hash value's bytes.
    fn value_len(b: &[u8]) -> usize {
        match Marker::from_u8(b[0]) {
            Marker::U64 | Marker::I64 | Marker::F64 => 9,
            Marker::U32 | Marker::I32 | Marker::F32 => 5,
            Marker::U16 | Marker::I16 => 3,
            Marker::U8 | Marker::I8 => 2,
            _ => 1,
        }
    }
    let mut out = Vec::new();
    let mut rd = payload;
    read_array_len(&mut rd).unwrap();
    rd = &rd[9..]; // ts: f64
    let n = read_array_len(&mut rd).unwrap() as usize;
    for _ in 0..n {
        let fields = read_map_len(&mut rd).unwrap();
        for _ in 0..fields {
            let klen = read_str_len(&mut rd).unwrap() as usize;
            let key = std::str::from_utf8(&rd[..klen]).unwrap().to_string();
            rd = &rd[klen..];
            // The rest of this field's value, re-measured by serde for anything but hashes.
            let start = payload.len() - rd.len();
            let mut cur = &payload[start..];
            let _: serde_json::Value = rmp_serde::from_read(&mut cur).unwrap();
            let whole = &payload[start..payload.len() - cur.len()];
            match key.as_str() {
                "block_hashes" => {
                    let mut h = whole;
                    let k = read_array_len(&mut h).unwrap();
                    for _ in 0..k {
                        let l = value_len(h);
                        out.push(h[..l].to_vec());
                        h = &h[l..];
                    }
                }
                "parent_block_hash" if whole[0] != 0xc0 => out.push(whole.to_vec()),
                _ => {}
            }
            rd = cur;
        }
    }
    out
}

/// SGLang sends its hashes as signed int64 (about half negative): the re-publish writes each one
/// in the engine's own integer form, byte for byte, where vLLM's unsigned ones stay `cf`.
#[test]
fn sglang_signed_hashes_are_republished_as_the_engine_wrote_them() {
    use kvbridge_tools::sim::{encode_batch, Layout, SimEvent};
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engine = Engine::start(0);
    let mut args = base_args(&[&engine]);
    args.extend(publish_args("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"));
    let bridge = Bridge::start(dir.path(), &ring, &args);
    let (pub_ep, _) = endpoints(&bridge, 1).remove(0);
    let ctx = zmq::Context::new();
    let s = sub(&ctx, &pub_ep);
    warm_up(&s, || {
        engine.with(|p| p.publish(warm_batch(0)));
    });
    // Hashes with the top bit set (negative as int64) and clear, a parent of each kind.
    let store = |parent: u64, hashes: Vec<u64>| SimEvent::Stored {
        tokens: (1..=hashes.len() as u32 * 4).collect(),
        hashes,
        parent: Some(parent),
        block_size: 4,
        medium: Some("GPU".into()),
    };
    for layout in [Layout::Sglang0523, Layout::Vllm033] {
        let events = vec![
            store(
                0xF000_0000_0000_0001,
                vec![0x8000_0000_0000_0002, 0x1234_5678_9ABC_DEF0],
            ),
            store(0x0FED_CBA9_8765_4321, vec![0xFFFF_FFFF_0000_0003]),
            SimEvent::Removed {
                hashes: vec![0x8000_0000_0000_0002, 0x2000_0000_0000_0004],
                medium: Some("GPU".into()),
            },
        ];
        let sent = encode_batch(layout, common::now_ts(), &events, 0);
        engine.with(move |p| p.publish(sent));
        let sent = encode_batch(layout, 0.0, &events, 0);
        let got = recv(&s, Duration::from_secs(10)).expect("the batch");
        let (want, have) = (raw_hashes(&sent), raw_hashes(&got.payload));
        assert_eq!(want.len(), 7, "{layout:?}: 5 block hashes and 2 parents");
        assert_eq!(
            have, want,
            "{layout:?}: every hash in the engine's own bytes"
        );
        let negative = want.iter().filter(|h| h[0] == 0xd3).count();
        match layout {
            Layout::Sglang0523 => assert_eq!(negative, 4, "SGLang's negative int64s"),
            _ => assert_eq!(negative, 0, "vLLM's unsigned hashes"),
        }
    }
    drop(bridge);
}
