//! What the `zmq_publish_*` modules share: `serve --publish-zmq` (kvbridge re-publishing the ring
//! on the engines' own ZMQ wire) seen as a consumer sees it (SUB and replay DEALER), vLLM's own
//! decoding of its payloads (the `kv_events.py` classes of the pinned wheel,
//! scripts/vllm-events-venv.sh), the batches the tests publish and the bridges they start.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, Bridge, Engine};
use serde_json::Value;

/// One message as a consumer receives it: topic, seq, payload.
#[derive(Clone, Debug)]
pub struct Msg {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub payload: Vec<u8>,
}

pub fn seq_of(f: &[u8]) -> u64 {
    u64::from_be_bytes(f.try_into().expect("an 8-byte seq frame"))
}

/// A consumer's SUB on `endpoint`, every topic.
pub fn sub(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    sub_hwm(ctx, endpoint, 1000)
}

/// A SUB with receive high-water mark `hwm` (messages; 0: none, 1,000: libzmq's default).
pub fn sub_hwm(ctx: &zmq::Context, endpoint: &str, hwm: i32) -> zmq::Socket {
    let s = ctx.socket(zmq::SUB).unwrap();
    s.set_rcvhwm(hwm).unwrap();
    s.set_subscribe(b"").unwrap();
    s.set_rcvtimeo(100).unwrap();
    s.connect(endpoint).unwrap();
    s
}

/// The next live message, if one arrives within `wait`; asserts the engine's 3-frame form.
pub fn recv(s: &zmq::Socket, wait: Duration) -> Option<Msg> {
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
pub fn warm_up(s: &zmq::Socket, mut warm: impl FnMut()) -> u64 {
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
pub fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> Vec<Msg> {
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
pub fn endpoints(b: &Bridge, ranks: usize) -> Vec<(String, String)> {
    assert_eq!(b.publish_zmq.len(), ranks, "ranks in the ready file");
    b.publish_zmq
        .iter()
        .map(|(p, r)| (p.clone(), r.clone().unwrap_or_else(|| "off".into())))
        .collect()
}

/// The events of an engine-wire payload `[ts, events, rank]`, decoded as plain msgpack.
pub fn payload_events(payload: &[u8]) -> Vec<Value> {
    let v: Value = rmp_serde::from_slice(payload).expect("a msgpack EventBatch");
    v[1].as_array().expect("[ts, events, rank]").clone()
}

/// The blocks a consumer holds after applying `payloads` in order, and the clears among them.
pub fn apply_payloads<'a>(
    payloads: impl IntoIterator<Item = &'a [u8]>,
) -> (std::collections::BTreeSet<u64>, usize) {
    let (mut held, mut clears) = (std::collections::BTreeSet::new(), 0);
    for p in payloads {
        for e in payload_events(p) {
            let hashes = || {
                e["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect::<Vec<_>>()
            };
            match e["type"].as_str().unwrap() {
                "BlockStored" => held.extend(hashes()),
                "BlockRemoved" => {
                    for h in hashes() {
                        held.remove(&h);
                    }
                }
                _ => {
                    held.clear();
                    clears += 1;
                }
            }
        }
    }
    (held, clears)
}

/// vLLM's own decoding of each payload (tests/zmq_publish/vllm_decode.py).
pub fn vllm_decode(payloads: &[&[u8]]) -> Vec<Value> {
    let src = super::setup_script(
        "vllm-events-venv.sh",
        &[],
        "Python >= 3.10 and PyPI (vllm, msgspec)",
    );
    let python: PathBuf = src.parent().unwrap().join("bin/python");
    let script = super::repo().join("tests/zmq_publish/vllm_decode.py");
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
        super::show(&out)
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
pub fn h(i: u64) -> u64 {
    0x8000_0000_0000_0000 + i
}

/// An engine batch in vLLM 0.33's layout (map events) with every field kvbridge forwards.
/// The `ts` of [`full_batch`] before an engine restart; [`TS_RESTARTED`] after it.
pub const TS: f64 = 1_700_000_000.25;

/// An engine stamps its batches with the wall clock, so its next incarnation never publishes the
/// bytes of the last one at the same seq (docs/engine-wire.md §8: kvbridge tells them apart by
/// content).
pub const TS_RESTARTED: f64 = 1_700_000_100.25;

pub fn full_batch(rank: u32) -> Vec<u8> {
    full_batch_at(rank, TS)
}

pub fn full_batch_at(rank: u32, ts: f64) -> Vec<u8> {
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
pub fn full_batch_decoded(rank: u32) -> Value {
    full_batch_decoded_at(rank, TS)
}

pub fn full_batch_decoded_at(rank: u32, ts: f64) -> Value {
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

pub fn warm_batch(rank: u32) -> Vec<u8> {
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

pub fn base_args(engines: &[&Engine]) -> Vec<String> {
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

pub fn publish_args(publish: &str, replay: &str) -> Vec<String> {
    ["--publish-zmq", publish, "--publish-zmq-replay", replay]
        .map(String::from)
        .to_vec()
}

/// A port P with P + 1 free as well a moment ago (rank 1 binds P + 1). A rule fixes the ports
/// (PORT + rank), so port 0 cannot stand in: the caller starts again when one was taken
/// meanwhile ([`super::retry_on_taken_port`]).
pub fn free_port_pair() -> u16 {
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
pub fn two_rank_bridge(
    dir: &std::path::Path,
    ring: &std::path::Path,
    e0: &Engine,
    e1: &Engine,
) -> (u16, u16, Bridge) {
    super::retry_on_taken_port(|| {
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
