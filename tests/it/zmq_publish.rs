//! `serve --publish-zmq`: kvbridge re-publishing the ring on the engines' own ZMQ wire, checked
//! frame by frame against vLLM's own decoder (the `kv_events.py` classes of the pinned wheel,
//! scripts/vllm-events-venv.sh), with its replay protocol, across engine and kvbridge restarts,
//! and under bad input.

use crate::common;

use std::collections::{BTreeSet, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, metric, scrape, Bridge, Engine};
use serde_json::Value;

/// One message as a consumer receives it: topic, seq, payload.
#[derive(Clone, Debug)]
struct Msg {
    topic: Vec<u8>,
    seq: u64,
    payload: Vec<u8>,
}

fn seq_of(f: &[u8]) -> u64 {
    u64::from_be_bytes(f.try_into().expect("an 8-byte seq frame"))
}

/// A consumer's SUB on `endpoint`, every topic.
fn sub(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    sub_hwm(ctx, endpoint, 1000)
}

/// A SUB with receive high-water mark `hwm` (messages; 0: none, 1,000: libzmq's default).
fn sub_hwm(ctx: &zmq::Context, endpoint: &str, hwm: i32) -> zmq::Socket {
    let s = ctx.socket(zmq::SUB).unwrap();
    s.set_rcvhwm(hwm).unwrap();
    s.set_subscribe(b"").unwrap();
    s.set_rcvtimeo(100).unwrap();
    s.connect(endpoint).unwrap();
    s
}

/// The next live message, if one arrives within `wait`; asserts the engine's 3-frame form.
fn recv(s: &zmq::Socket, wait: Duration) -> Option<Msg> {
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        if let Ok(f) = s.recv_multipart(0) {
            assert_eq!(f.len(), 3, "a live message is [topic, seq, payload]: {f:?}");
            assert_eq!(f[1].len(), 8, "seq frame: 8 bytes");
            return Some(Msg {
                topic: f[0].clone(),
                seq: seq_of(&f[1]),
                payload: f[2].clone(),
            });
        }
    }
    None
}

/// Publishes `warm` on the engine until the SUB sees something (a PUB drops what it sends before
/// the subscription arrives), then drains it: the next message received is the next published.
fn warm_up(s: &zmq::Socket, mut warm: impl FnMut()) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last;
    loop {
        warm();
        if let Some(m) = recv(s, Duration::from_millis(300)) {
            last = m.seq;
            break;
        }
        assert!(Instant::now() < deadline, "the SUB never received anything");
    }
    while let Some(m) = recv(s, Duration::from_millis(300)) {
        last = m.seq;
    }
    last
}

/// A replay as a consumer asks for it (a DEALER): every reply up to the end marker.
fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> Vec<Msg> {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(20_000).unwrap();
    d.set_linger(0).unwrap();
    d.connect(endpoint).unwrap();
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let f = d.recv_multipart(0).unwrap_or_else(|e| {
            panic!(
                "replay from {start}: no end marker ({e}) after {} replies",
                out.len()
            )
        });
        assert_eq!(f.len(), 4, "a reply is [\"\", topic, seq, payload]: {f:?}");
        assert!(f[0].is_empty(), "empty delimiter frame");
        let seq = seq_of(&f[2]);
        if seq == u64::MAX {
            assert!(
                f[1].is_empty() && f[3].is_empty(),
                "end marker: empty topic and payload"
            );
            return out;
        }
        out.push(Msg {
            topic: f[1].clone(),
            seq,
            payload: f[3].clone(),
        });
    }
}

/// The bound endpoints, per rank: (PUB, replay), from the bridge's ready file.
fn endpoints(b: &Bridge, ranks: usize) -> Vec<(String, String)> {
    assert_eq!(b.publish_zmq.len(), ranks, "ranks in the ready file");
    b.publish_zmq
        .iter()
        .map(|(p, r)| (p.clone(), r.clone().unwrap_or_else(|| "off".into())))
        .collect()
}

/// vLLM's own decoding of each payload (tests/zmq_publish/vllm_decode.py).
fn vllm_decode(payloads: &[&[u8]]) -> Vec<Value> {
    let src = common::setup_script(
        "vllm-events-venv.sh",
        &[],
        "Python >= 3.10 and PyPI (vllm, msgspec)",
    );
    let python: PathBuf = src.parent().unwrap().join("bin/python");
    let script = common::repo().join("tests/zmq_publish/vllm_decode.py");
    let mut child = Command::new(python)
        .arg(&script)
        .arg(&src)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Written from a thread: the decoder's replies fill its stdout pipe meanwhile.
    let mut stdin = child.stdin.take().unwrap();
    let input: Vec<String> = payloads
        .iter()
        .map(|p| {
            let hex: String = p.iter().map(|b| format!("{b:02x}")).collect();
            serde_json::json!({ "payload": hex }).to_string()
        })
        .collect();
    let writer = std::thread::spawn(move || {
        for l in input {
            writeln!(stdin, "{l}").unwrap();
        }
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(
        out.status.success(),
        "vllm_decode.py: {}",
        common::show(&out)
    );
    let decoded: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(decoded.len(), payloads.len());
    for (d, p) in decoded.iter().zip(payloads) {
        assert!(
            d.get("error").is_none(),
            "vLLM's decoder rejects a payload: {d} ({p:02x?})"
        );
    }
    decoded
}

/// Block hash `0x8000_0000_0000_0000 + i`: above i64::MAX, as vLLM's u64 hashes often are.
fn h(i: u64) -> u64 {
    0x8000_0000_0000_0000 + i
}

/// An engine batch in vLLM 0.33's layout (map events) with every field kvbridge forwards.
/// The `ts` of [`full_batch`] before an engine restart; [`TS_RESTARTED`] after it.
const TS: f64 = 1_700_000_000.25;
/// An engine stamps its batches with the wall clock, so its next incarnation never publishes the
/// bytes of the last one at the same seq (docs/engine-wire.md §8: kvbridge tells them apart by
/// content).
const TS_RESTARTED: f64 = 1_700_000_100.25;

fn full_batch(rank: u32) -> Vec<u8> {
    full_batch_at(rank, TS)
}

fn full_batch_at(rank: u32, ts: f64) -> Vec<u8> {
    use rmp::encode::*;
    let mut o = Vec::new();
    let s = |o: &mut Vec<u8>, v: &str| write_str(o, v).unwrap();
    write_array_len(&mut o, 3).unwrap();
    write_f64(&mut o, ts).unwrap();
    write_array_len(&mut o, 3).unwrap();
    // BlockStored, 15 keys
    write_map_len(&mut o, 15).unwrap();
    s(&mut o, "type");
    s(&mut o, "BlockStored");
    s(&mut o, "block_hashes");
    write_array_len(&mut o, 2).unwrap();
    write_u64(&mut o, h(1)).unwrap();
    write_u64(&mut o, h(2)).unwrap();
    s(&mut o, "parent_block_hash");
    write_u64(&mut o, h(0)).unwrap();
    s(&mut o, "token_ids");
    write_array_len(&mut o, 8).unwrap();
    for t in [1u32, 2, 3, 4, 300, 70_000, 7, 8] {
        write_uint(&mut o, u64::from(t)).unwrap();
    }
    s(&mut o, "block_size");
    write_uint(&mut o, 4).unwrap();
    s(&mut o, "lora_id");
    write_uint(&mut o, 7).unwrap();
    s(&mut o, "medium");
    s(&mut o, "CPU");
    s(&mut o, "lora_name");
    s(&mut o, "adapter-a");
    s(&mut o, "extra_keys");
    write_array_len(&mut o, 2).unwrap();
    write_array_len(&mut o, 1).unwrap();
    s(&mut o, "adapter-a");
    write_nil(&mut o).unwrap();
    s(&mut o, "group_idx");
    write_uint(&mut o, 1).unwrap();
    s(&mut o, "kv_cache_spec_kind");
    s(&mut o, "sliding_window");
    s(&mut o, "kv_cache_spec_sliding_window");
    write_uint(&mut o, 128).unwrap();
    s(&mut o, "locality");
    s(&mut o, "REMOTE");
    s(&mut o, "ownership");
    s(&mut o, "tier-x");
    s(&mut o, "session_id");
    s(&mut o, "sess-1");
    // BlockRemoved, 6 keys
    write_map_len(&mut o, 6).unwrap();
    s(&mut o, "type");
    s(&mut o, "BlockRemoved");
    s(&mut o, "block_hashes");
    write_array_len(&mut o, 1).unwrap();
    write_u64(&mut o, h(2)).unwrap();
    s(&mut o, "medium");
    s(&mut o, "CPU");
    s(&mut o, "group_idx");
    write_uint(&mut o, 1).unwrap();
    s(&mut o, "locality");
    s(&mut o, "REMOTE");
    s(&mut o, "ownership");
    s(&mut o, "tier-x");
    // AllBlocksCleared
    write_map_len(&mut o, 1).unwrap();
    s(&mut o, "type");
    s(&mut o, "AllBlocksCleared");
    write_uint(&mut o, u64::from(rank)).unwrap();
    o
}

/// What vLLM's decoder must read from the batch above, as kvbridge re-publishes it.
fn full_batch_decoded(rank: u32) -> Value {
    full_batch_decoded_at(rank, TS)
}

fn full_batch_decoded_at(rank: u32, ts: f64) -> Value {
    serde_json::json!({
        "ts": ts,
        "rank": rank,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [h(1), h(2)],
                "parent_block_hash": h(0),
                "token_ids": [1, 2, 3, 4, 300, 70_000, 7, 8],
                "block_size": 4,
                "lora_id": 7,
                "medium": "CPU",
                "lora_name": "adapter-a",
                "extra_keys": [["adapter-a"], null],
                "group_idx": 1,
                "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": 128,
                "locality": "REMOTE",
                "ownership": "tier-x",
                "session_id": "sess-1",
            },
            {
                "type": "BlockRemoved",
                "block_hashes": [h(2)],
                "medium": "CPU",
                "group_idx": 1,
                "locality": "REMOTE",
                "ownership": "tier-x",
            },
            { "type": "AllBlocksCleared" },
        ],
    })
}

fn warm_batch(rank: u32) -> Vec<u8> {
    // A removal of a hash nobody holds: harmless to every consumer.
    kvbridge_tools::sim::encode_batch(
        kvbridge_tools::sim::Layout::Vllm033,
        1_700_000_000.0,
        &[kvbridge_tools::sim::SimEvent::Removed {
            hashes: vec![999_999],
            medium: Some("GPU".into()),
        }],
        rank,
    )
}

fn base_args(engines: &[&Engine]) -> Vec<String> {
    let mut a = Vec::new();
    for e in engines {
        a.extend(["--zmq".to_string(), e.endpoint.clone()]);
    }
    for e in engines {
        a.extend(["--replay".to_string(), e.replay.clone()]);
    }
    a.extend(["--profile", "all", "--seq-base", "1"].map(String::from));
    a
}

fn publish_args(publish: &str, replay: &str) -> Vec<String> {
    ["--publish-zmq", publish, "--publish-zmq-replay", replay]
        .map(String::from)
        .to_vec()
}

/// A port P with P + 1 free as well a moment ago (rank 1 binds P + 1). A rule fixes the ports
/// (PORT + rank), so port 0 cannot stand in: the caller starts again when one was taken
/// meanwhile ([`common::retry_on_taken_port`]).
fn free_port_pair() -> u16 {
    for _ in 0..200 {
        let p = free_port();
        if p < 65535 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports");
}

/// kvbridge over engines `e0` and `e1` (ranks 0 and 1, `--dp-mode metadata`), publishing rank r
/// on PUB port P + r and replay port R + r; returns (P, R, the bridge).
fn two_rank_bridge(
    dir: &std::path::Path,
    ring: &std::path::Path,
    e0: &Engine,
    e1: &Engine,
) -> (u16, u16, Bridge) {
    common::retry_on_taken_port(|| {
        let (p, r) = (free_port_pair(), free_port_pair());
        let mut args = base_args(&[e0, e1]);
        args.extend(publish_args(
            &format!("tcp://127.0.0.1:{p}"),
            &format!("tcp://127.0.0.1:{r}"),
        ));
        args.extend(["--dp-mode", "metadata"].map(String::from));
        Bridge::try_start(dir, ring, &args).map(|b| (p, r, b))
    })
}

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

/// The live block set a consumer holds after applying `batches` (vLLM-decoded) in order.
fn apply(decoded: &[Value]) -> BTreeSet<u64> {
    let mut held = BTreeSet::new();
    for b in decoded {
        for e in b["events"].as_array().unwrap() {
            match e["type"].as_str().unwrap() {
                "BlockStored" => held.extend(
                    e["block_hashes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| h.as_u64().unwrap()),
                ),
                "BlockRemoved" => {
                    for h in e["block_hashes"].as_array().unwrap() {
                        held.remove(&h.as_u64().unwrap());
                    }
                }
                _ => held.clear(),
            }
        }
    }
    held
}

/// The engine's own replay from 0 (its buffer of recent batches only).
fn engine_replay(ctx: &zmq::Context, endpoint: &str) -> Vec<Vec<u8>> {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(20_000).unwrap();
    d.connect(endpoint).unwrap();
    d.send_multipart([&b""[..], &0u64.to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let f = d.recv_multipart(0).expect("engine replay reply");
        let seq = seq_of(&f[f.len() - 2]);
        if seq == u64::MAX {
            return out;
        }
        out.push(f[f.len() - 1].clone());
    }
}

/// A consumer that joins after the ring wrapped, and after a kvbridge restart, still learns
/// every block the engine holds, with seqs continuing across the restart; the engine's own
/// replay from 0 (its last batches only) does not give it that.
#[test]
fn late_joiner_after_wrap_and_restart_gets_the_whole_state() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engine = Engine::start(0);
    let mut args = base_args(&[&engine]);
    args.extend(["--ring-size", "1MiB", "--snapshot-chunk-size", "16KiB"].map(String::from));
    // Port 0: the ready file says where; a restart comes back on the same endpoints.
    args.extend(publish_args("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"));
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    let (_, replay_ep) = endpoints(&bridge, 1).remove(0);
    // A short engine buffer, so that a test-sized churn rolls it.
    engine.with(|p| p.set_buffer_steps(200));
    // Long-lived blocks first, then churn (store then remove) until the ring wrapped and the
    // engine's own replay buffer no longer reaches the first stores. kvbridge is subscribed
    // before the first store, and has all 20 before the churn: a store it missed (slow joiner)
    // would come through the engine's replay, which the churn can roll first on a busy host
    // (then lost, in band).
    engine.wait_subscribed();
    let mut live = BTreeSet::new();
    for i in 0..20u64 {
        let ev = common::store(10_000 + i, 4, None);
        if let kvbridge_tools::sim::SimEvent::Stored { hashes, .. } = &ev {
            live.extend(hashes.iter().copied());
        }
        engine.publish(kvbridge_tools::sim::Layout::Vllm033, vec![ev], 0);
    }
    common::wait_metrics(maddr, Duration::from_secs(30), |p| {
        metric(p, "kvbridge_batches_received_total", &[("rank", "0")]) >= 20.0
    });
    let mut n = 0u64;
    let wrapped = || {
        let page = scrape(maddr);
        metric(&page, "kvbridge_ring_oldest_seq", &[("ring", "merged")]) > 1.0
    };
    while !wrapped() {
        for _ in 0..50 {
            let ev = common::store(1_000_000 + n, 8, None);
            let hashes = match &ev {
                kvbridge_tools::sim::SimEvent::Stored { hashes, .. } => hashes.clone(),
                _ => unreachable!(),
            };
            engine.publish(
                kvbridge_tools::sim::Layout::Vllm033,
                vec![
                    ev,
                    kvbridge_tools::sim::SimEvent::Removed {
                        hashes,
                        medium: Some("GPU".into()),
                    },
                ],
                0,
            );
            n += 1;
        }
        assert!(n < 1_000_000, "the ring never wrapped");
    }
    let ctx = zmq::Context::new();
    let decode_state = |ep: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = replay(&ctx, ep, 0);
            let d = vllm_decode(
                &state
                    .iter()
                    .map(|m| m.payload.as_slice())
                    .collect::<Vec<_>>(),
            );
            let held = apply(&d);
            if held == live || Instant::now() > deadline {
                return (state, held);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let (state, held) = decode_state(&replay_ep);
    assert_eq!(
        held, live,
        "kvbridge's replay from 0 gives every block the engine holds"
    );
    let page = scrape(maddr);
    assert!(
        metric(&page, "kvbridge_zmq_snapshot_replays_total", &[]) >= 1.0,
        "{page}"
    );
    // The engine's own replay from 0 does not (the test's reason to exist).
    let from_engine = engine_replay(&ctx, &engine.replay);
    let d = vllm_decode(&from_engine.iter().map(|p| p.as_slice()).collect::<Vec<_>>());
    assert_ne!(
        apply(&d),
        live,
        "the engine's buffer still reaches the first stores: churn more"
    );

    // kvbridge restarts under the consumer: numbering continues from the ring.
    let last = state.last().unwrap().seq;
    let bridge = bridge.restart(dir.path());
    let (pub_ep, replay_ep) = endpoints(&bridge, 1).remove(0);
    let s = sub(&ctx, &pub_ep);
    let first_live = warm_up(&s, || {
        engine.with(|p| p.publish(warm_batch(0)));
    });
    assert!(
        first_live > last,
        "seq continues across a kvbridge restart ({first_live} ≤ {last})"
    );
    let tail = replay(&ctx, &replay_ep, last + 1);
    let seqs: Vec<u64> = tail.iter().map(|m| m.seq).collect();
    assert_eq!(
        seqs,
        (last + 1..=last + seqs.len() as u64).collect::<Vec<_>>()
    );
    let (_, held) = decode_state(&replay_ep);
    assert_eq!(held, live, "the state after the restart");
    drop(bridge);
}

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// The highest `VmRSS` of a process while it runs (sampled every 20 ms): the peak of one phase
/// of a test, which `VmHWM` (the peak since the start) does not give once an earlier phase
/// peaked higher.
struct RssSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(status_kib(pid, "VmRSS"));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak.max(status_kib(pid, "VmRSS"))
        });
        RssSampler { stop, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Records of the memory phase of [`bad_consumers_do_not_hold_anyone_else`], and blocks each.
const BIG_RECORDS: u64 = 10_000;
const BIG_BLOCKS: usize = 24;
/// Consumers that ask for those records and never read.
const DEAF: usize = 5;

/// Garbage and oversized replay requests, 1,000 replay requests at once and a consumer that
/// never reads: ingest, gRPC and the other consumers carry on. Then memory: 10,000 records of
/// 24 blocks (about 2 KB each on the wire, 20 MB in all) published while the SUB that never
/// reads stays connected, and replayed to 5 consumers that never read: kvbridge's resident
/// memory grows by less than what its limits allow (the ring pages written, the snapshot table's
/// growth, the stuck SUB's PUB pipe, 17 messages per deaf consumer, 16 MiB for the rest).
/// Measured: +95 MiB of a 140 MiB bound; with the ROUTER's high-water mark removed, +188 MiB
/// (each deaf consumer holding the whole window), and before the ROUTER's options were set
/// before its bind (libzmq's default mark of 1,000 messages applied), +108 MiB.
#[test]
fn bad_consumers_do_not_hold_anyone_else() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engine = Engine::start(0);
    let mut args = base_args(&[&engine]);
    args.extend(publish_args("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"));
    // The ROUTER's high-water mark follows from the ring's size (replay::configure): 16
    // messages per consumer with 64 MiB.
    args.extend(["--ring-size", "64MiB"].map(String::from));
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    let (pub_ep, replay_ep) = endpoints(&bridge, 1).remove(0);
    let ctx = zmq::Context::new();
    for i in 0..200u64 {
        engine.publish(
            kvbridge_tools::sim::Layout::Vllm033,
            vec![common::store(i, 4, None)],
            0,
        );
    }
    // A SUB that never reads, with a tiny pipe.
    let stuck = ctx.socket(zmq::SUB).unwrap();
    stuck.set_rcvhwm(1).unwrap();
    stuck.set_rcvbuf(4096).unwrap();
    stuck.set_subscribe(b"").unwrap();
    stuck.connect(&pub_ep).unwrap();
    // Garbage: wrong frame counts, a short seq, a non-empty delimiter; and an oversized one.
    let g = ctx.socket(zmq::DEALER).unwrap();
    g.connect(&replay_ep).unwrap();
    g.send(&b"x"[..], 0).unwrap();
    g.send_multipart([&b""[..], &[1u8, 2, 3][..]], 0).unwrap();
    g.send_multipart([&b"junk"[..], &0u64.to_be_bytes()[..]], 0)
        .unwrap();
    g.send_multipart([&b""[..], &0u64.to_be_bytes()[..], b"extra"], 0)
        .unwrap();
    let big = ctx.socket(zmq::DEALER).unwrap();
    big.connect(&replay_ep).unwrap();
    big.send_multipart([&b""[..], &vec![0u8; 1 << 20][..]], 0)
        .unwrap();
    // 1,000 requests at once: 50 consumers asking 20 times each, half of them from 0 (the
    // state), half inside the window; and some that never read their replies.
    let dealers: Vec<zmq::Socket> = (0..50)
        .map(|_| {
            let d = ctx.socket(zmq::DEALER).unwrap();
            d.set_rcvtimeo(30_000).unwrap();
            d.set_rcvhwm(0).unwrap();
            d.connect(&replay_ep).unwrap();
            d
        })
        .collect();
    let deaf: Vec<zmq::Socket> = (0..5)
        .map(|_| {
            let d = ctx.socket(zmq::DEALER).unwrap();
            d.set_rcvhwm(1).unwrap();
            d.connect(&replay_ep).unwrap();
            d.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
                .unwrap();
            d
        })
        .collect();
    for (i, d) in dealers.iter().enumerate() {
        for k in 0..20u64 {
            let start: u64 = if (i as u64 + k) % 2 == 0 { 0 } else { 150 };
            d.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
                .unwrap();
        }
    }
    // Meanwhile ingest goes on, and a gRPC subscriber and a well-behaved SUB see it. The good SUB
    // queues whatever arrives (no receive high-water mark): the test reads the 10,000 records of
    // the memory phase only after publishing them all, and a SUB with libzmq's default mark of
    // 1,000 would leave them to the PUB's mark of 10,000, which a PUB meets by dropping (seen on
    // a busy machine).
    let good = sub_hwm(&ctx, &pub_ep, 0);
    let before = warm_up(&good, || {
        engine.with(|p| p.publish(warm_batch(0)));
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    for i in 0..300u64 {
        engine.publish(
            kvbridge_tools::sim::Layout::Vllm033,
            vec![common::store(5_000 + i, 4, None)],
            0,
        );
    }
    let mut seen = HashSet::new();
    while seen.len() < 300 {
        let m = recv(&good, Duration::from_secs(20)).expect("the good SUB keeps receiving");
        assert!(m.seq > before);
        seen.insert(m.seq);
    }
    let grpc = rt.block_on(async {
        let mut stream = common::subscribe(&bridge.url(), 0)
            .await
            .expect("subscribe");
        // (collect_until, with what the bridge was doing if the stream stalls: seen once under
        // the stress script, 364 batches in 30 s)
        let mut got: Vec<kvbridge::proto::common::KvEventBatch> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while common::stored_hashes(&got).len() < 500 * 4 {
            match tokio::time::timeout_at(deadline, stream.message()).await {
                Ok(Ok(Some(b))) => got.push(b),
                end => {
                    let page = scrape(maddr);
                    let lines: Vec<&str> = page
                        .lines()
                        .filter(|l| {
                            !l.starts_with('#')
                                && ["ring_newest", "batches_sent", "subscriber", "zmq_replay"]
                                    .iter()
                                    .any(|k| l.contains(k))
                        })
                        .collect();
                    panic!(
                        "gRPC stream: {} batches (last seq {:?}), then {end:?}\n{}\nthe bridge's log:\n{}",
                        got.len(),
                        got.last().map(|b| b.sequence_number),
                        lines.join("\n"),
                        bridge.log()
                    );
                }
            }
        }
        got
    });
    assert!(
        common::stored_hashes(&grpc).len() >= 500 * 4,
        "gRPC gets every store"
    );
    // Every one of the 1,000 requests is answered, with an end marker each.
    for d in &dealers {
        let mut ends = 0;
        while ends < 20 {
            let f = d
                .recv_multipart(0)
                .expect("a reply to each of the 1,000 requests");
            if seq_of(&f[2]) == u64::MAX {
                ends += 1;
            }
        }
    }
    let page = scrape(maddr);
    assert!(
        metric(
            &page,
            "kvbridge_zmq_replay_requests_total",
            &[("outcome", "malformed")]
        ) >= 3.0,
        "{page}"
    );
    assert!(
        metric(
            &page,
            "kvbridge_zmq_replay_requests_total",
            &[("outcome", "state")]
        ) >= 500.0,
        "{page}"
    );
    assert!(
        metric(&page, "kvbridge_zmq_published_total", &[]) >= 500.0,
        "{page}"
    );
    // Memory: a window of records larger than any pipe may hold, published while the stuck SUB
    // stays connected, then replayed to consumers that never read.
    let pid = bridge.child.id();
    let table = || metric(&scrape(maddr), "kvbridge_snapshot_table_bytes", &[]) as u64;
    let table_before = table();
    let rss_before = status_kib(pid, "VmRSS");
    let sampler = RssSampler::start(pid);
    for i in 0..BIG_RECORDS {
        engine.publish(
            kvbridge_tools::sim::Layout::Vllm033,
            vec![common::store(100_000 + i, BIG_BLOCKS, None)],
            0,
        );
    }
    let mut first = None;
    let mut largest = 0;
    let mut got = 0;
    while got < BIG_RECORDS {
        let m = recv(&good, Duration::from_secs(20)).expect("the good SUB keeps receiving");
        if m.payload.len() > 1_000 {
            first.get_or_insert(m.seq);
            largest = largest.max(m.payload.len() as u64);
            got += 1;
        }
    }
    let first = first.expect("the big records");
    let sent = || metric(&scrape(maddr), "kvbridge_zmq_replay_bytes_total", &[]);
    let sent0 = sent();
    let deaf_window: Vec<zmq::Socket> = (0..DEAF)
        .map(|_| {
            let d = ctx.socket(zmq::DEALER).unwrap();
            d.set_rcvhwm(1).unwrap();
            d.set_rcvbuf(4096).unwrap();
            d.connect(&replay_ep).unwrap();
            d.send_multipart([&b""[..], &first.to_be_bytes()[..]], 0)
                .unwrap();
            d
        })
        .collect();
    // They stop when their pipes are full: the replay bytes sent stop growing, past what the
    // pipes take at least.
    let mut last = -1.0;
    common::eventually(
        "the deaf consumers' replays blocked",
        Duration::from_secs(60),
        || {
            std::thread::sleep(Duration::from_millis(500));
            let now = sent();
            let steady = now == last && now - sent0 >= (DEAF as u64 * 16 * largest) as f64;
            last = now;
            if steady {
                Ok(())
            } else {
                Err(now - sent0)
            }
        },
    );
    let peak = sampler.finish();
    let grew = peak.saturating_sub(rss_before);
    // What the limits let kvbridge hold here (KiB): the ring pages the records were written to
    // (shared memory counts in RSS), the snapshot table's growth (the blocks stored: twice what
    // it counts, as its maps grow by doubling), the stuck SUB's PUB pipe (its high-water mark,
    // 100,000 messages, is more than these records), each deaf consumer's reply pipe (the
    // ROUTER's high-water mark, 16 messages with a 64 MiB ring, plus the one its replay holds
    // back), and 16 MiB for the rest (allocator, sockets, threads).
    let table_kib = 2 * table().saturating_sub(table_before) / 1024;
    let ring_kib = BIG_RECORDS * largest * 2 / 1024;
    let stuck_kib = BIG_RECORDS * largest / 1024;
    let deaf_kib = DEAF as u64 * 17 * largest / 1024;
    let bound = ring_kib + table_kib + stuck_kib + deaf_kib + (16 << 10);
    eprintln!(
        "bad consumers: RSS {rss_before} KiB, peak +{grew} KiB (bound {bound} KiB: ring {ring_kib}, table {table_kib}, stuck SUB {stuck_kib}, {DEAF} deaf replays {deaf_kib}); largest message {largest} B; VmHWM {} KiB",
        status_kib(pid, "VmHWM")
    );
    assert!(
        grew < bound,
        "kvbridge's resident memory grew by {grew} KiB, more than the {bound} KiB its limits allow"
    );
    // Consumers that never read do not keep their replay slots: each is given up.
    common::eventually(
        "the deaf consumers' replays given up",
        Duration::from_secs(60),
        || {
            let n = metric(
                &scrape(maddr),
                "kvbridge_zmq_replay_requests_total",
                &[("outcome", "stalled")],
            );
            if n >= DEAF as f64 {
                Ok(())
            } else {
                Err(n)
            }
        },
    );
    drop((stuck, deaf, deaf_window, g, big));
    let st = bridge.stop();
    assert!(st.success(), "kvbridge exited with {st:?}");
}

/// Dynamo's standalone KV indexer (`python -m dynamo.indexer`, scripts/dynamo-venv.sh), a child
/// process on port 0, driven over its HTTP API.
struct Indexer {
    child: std::process::Child,
    port: u16,
}

impl Indexer {
    fn start(dir: &std::path::Path) -> Indexer {
        let python = common::setup_script(
            "dynamo-venv.sh",
            &[],
            "Python >= 3.10 and PyPI (ai-dynamo-runtime)",
        );
        let log_path = dir.join("indexer.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Command::new(python)
            .args(["-m", "dynamo.indexer", "--port", "0"])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        // It logs the port as given (0), not as bound: the bound one is its listening socket.
        let pid = child.id();
        let port = common::eventually(
            "the indexer listens",
            Duration::from_secs(30),
            || match child.try_wait() {
                Ok(Some(st)) => panic!(
                    "the indexer exited ({st}):\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ),
                _ => match common::listening_ports(pid).as_slice() {
                    [p] => Ok(*p),
                    other => Err(other.to_vec()),
                },
            },
        );
        let ix = Indexer { child, port };
        common::eventually("the indexer answers", Duration::from_secs(30), || {
            ix.try_http("GET", "/workers", "").ok_or(port)
        });
        ix
    }

    fn try_http(&self, method: &str, path: &str, body: &str) -> Option<String> {
        use std::io::Read;
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let (head, body) = out.split_once("\r\n\r\n")?;
        assert!(
            head.starts_with("HTTP/1.1 2"),
            "{method} {path} {body}: {head}\n{body}"
        );
        Some(body.to_string())
    }

    fn post(&self, path: &str, body: Value) -> Value {
        let text = self
            .try_http("POST", path, &body.to_string())
            .expect("indexer HTTP");
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }

    /// Registers `instance` (rank `dp_rank`) at these endpoints, block size 16, model `m`.
    fn register(&self, instance: u64, dp_rank: u32, endpoint: &str, replay: &str) {
        self.post(
            "/register",
            serde_json::json!({
                "instance_id": instance, "endpoint": endpoint, "replay_endpoint": replay,
                "model_name": "m", "block_size": 16, "dp_rank": dp_rank,
            }),
        );
    }

    /// Matched blocks per instance for a request with `tokens`.
    fn scores(&self, tokens: &[u32]) -> Value {
        self.post(
            "/query",
            serde_json::json!({ "token_ids": tokens, "model_name": "m" }),
        )
    }
}

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tokens_of(ev: &kvbridge_tools::sim::SimEvent) -> Vec<u32> {
    match ev {
        kvbridge_tools::sim::SimEvent::Stored { tokens, .. } => tokens.clone(),
        _ => unreachable!(),
    }
}

/// `scores[instance][rank]` of a `/query` answer: tokens matched (0: none).
fn score(v: &Value, instance: u64, rank: u32) -> u64 {
    v["scores"][instance.to_string()][rank.to_string()]
        .as_u64()
        .unwrap_or(0)
}

/// Publishes `marker` (a store, idempotent) until every instance of `instances` scores its 4
/// blocks: each has then applied everything published before it.
fn settle(
    ix: &Indexer,
    engine: &Engine,
    marker: &kvbridge_tools::sim::SimEvent,
    instances: &[u64],
) {
    let tokens = tokens_of(marker);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = marker.clone();
        engine.publish(kvbridge_tools::sim::Layout::Vllm033, vec![m], 0);
        let v = ix.scores(&tokens);
        if instances.iter().all(|i| score(&v, *i, 0) == 64) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the indexer never applied the marker: {v}"
        );
        // The poll interval of a wait that publishes the marker again each time.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Dynamo's real standalone indexer routes right through kvbridge where pointing it at the
/// engine goes wrong: an engine restart mid-run (the engine's instance keeps the dead engine's
/// blocks), an indexer registered after the engine published and after its replay buffer rolled
/// (the engine's instance never learns the old blocks), and kvbridge restarted under a
/// registered indexer (its instance carries on). Instances 1 and 3 read the engine itself, 2
/// and 4 read kvbridge: the same events, the same indexer.
#[test]
fn dynamo_indexer_scores_right_through_kvbridge_and_wrong_from_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engine = Engine::start(0);
    engine.with(|p| p.set_buffer_steps(200));
    let mut args = base_args(&[&engine]);
    args.extend(["--ring-size", "1MiB", "--snapshot-chunk-size", "16KiB"].map(String::from));
    // Port 0: the ready file says where; the restart below comes back on the same endpoints,
    // which the indexer has registered.
    args.extend(publish_args("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"));
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    let (pub_ep, replay_ep) = endpoints(&bridge, 1).remove(0);
    let ix = Indexer::start(dir.path());
    ix.register(1, 0, &engine.endpoint, &engine.replay);
    ix.register(2, 0, &pub_ep, &replay_ep);
    let a = common::store(1, 4, None);
    let ta = tokens_of(&a);
    engine.publish(kvbridge_tools::sim::Layout::Vllm033, vec![a], 0);
    settle(&ix, &engine, &common::store(2, 4, None), &[1, 2]);
    let v = ix.scores(&ta);
    assert_eq!((score(&v, 1, 0), score(&v, 2, 0)), (64, 64), "{v}");

    // 1. The engine restarts (empty cache, seq back to 0) on the same endpoints.
    let (ep, rp) = (engine.endpoint.clone(), engine.replay.clone());
    drop(engine);
    let engine = Engine::start_at(&ep, &rp);
    engine.with(|p| p.set_buffer_steps(200));
    settle(&ix, &engine, &common::store(3, 4, None), &[1, 2]);
    let v = ix.scores(&ta);
    assert_eq!(
        score(&v, 2, 0),
        0,
        "through kvbridge the restart cleared the old blocks: {v}"
    );
    assert_eq!(
        score(&v, 1, 0),
        64,
        "from the engine itself the indexer keeps the dead engine's blocks: {v}"
    );

    // 2. Long-lived blocks, then churn until the ring wrapped and the engine's buffer rolled;
    // then an indexer registration that has never seen this engine.
    let l = common::store(4, 4, None);
    let tl = tokens_of(&l);
    engine.publish(kvbridge_tools::sim::Layout::Vllm033, vec![l], 0);
    let mut n = 0u64;
    loop {
        let page = scrape(maddr);
        if n >= 300 && metric(&page, "kvbridge_ring_oldest_seq", &[("ring", "merged")]) > 1.0 {
            break;
        }
        for _ in 0..50 {
            let ev = common::store(2_000_000 + n, 8, None);
            let hashes = match &ev {
                kvbridge_tools::sim::SimEvent::Stored { hashes, .. } => hashes.clone(),
                _ => unreachable!(),
            };
            engine.publish(
                kvbridge_tools::sim::Layout::Vllm033,
                vec![
                    ev,
                    kvbridge_tools::sim::SimEvent::Removed {
                        hashes,
                        medium: Some("GPU".into()),
                    },
                ],
                0,
            );
            n += 1;
        }
    }
    ix.register(3, 0, &engine.endpoint, &engine.replay);
    ix.register(4, 0, &pub_ep, &replay_ep);
    settle(&ix, &engine, &common::store(5, 4, None), &[1, 2, 3, 4]);
    let v = ix.scores(&tl);
    assert_eq!(
        score(&v, 4, 0),
        64,
        "a late registration through kvbridge knows every block: {v}"
    );
    assert_eq!(
        score(&v, 3, 0),
        0,
        "the engine's replay no longer reaches the long-lived blocks: {v}"
    );

    // 3. kvbridge restarts under the registered indexer: its instances carry on.
    let bridge = bridge.restart(dir.path());
    assert_eq!(
        endpoints(&bridge, 1),
        [(pub_ep.clone(), replay_ep.clone())],
        "the same endpoints"
    );
    settle(&ix, &engine, &common::store(6, 4, None), &[2, 4]);
    let v = ix.scores(&tl);
    assert_eq!(
        (score(&v, 2, 0), score(&v, 4, 0)),
        (64, 64),
        "after a kvbridge restart: {v}"
    );
    drop(bridge);
}

/// Two DP ranks registered with Dynamo's indexer per rank, on kvbridge's PORT + r: each rank's
/// blocks score on that rank only.
#[test]
fn dynamo_indexer_reads_two_ranks_on_port_plus_rank() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let (e0, e1) = (Engine::start(0), Engine::start(1));
    let (p, r, bridge) = two_rank_bridge(dir.path(), &ring, &e0, &e1);
    let ix = Indexer::start(dir.path());
    for rank in 0..2u16 {
        ix.register(
            7,
            u32::from(rank),
            &format!("tcp://127.0.0.1:{}", p + rank),
            &format!("tcp://127.0.0.1:{}", r + rank),
        );
    }
    let (x, y) = (common::store(11, 4, None), common::store(12, 4, None));
    let (tx, ty) = (tokens_of(&x), tokens_of(&y));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        e0.publish(kvbridge_tools::sim::Layout::Vllm033, vec![x.clone()], 0);
        e1.publish(kvbridge_tools::sim::Layout::Vllm022, vec![y.clone()], 1);
        let (vx, vy) = (ix.scores(&tx), ix.scores(&ty));
        if score(&vx, 7, 0) == 64 && score(&vy, 7, 1) == 64 {
            assert_eq!(score(&vx, 7, 1), 0, "rank 0's blocks on rank 1: {vx}");
            assert_eq!(score(&vy, 7, 0), 0, "rank 1's blocks on rank 0: {vy}");
            break;
        }
        assert!(Instant::now() < deadline, "{vx} {vy}");
        // The poll interval of a wait that publishes the stores again each time.
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(bridge);
}
