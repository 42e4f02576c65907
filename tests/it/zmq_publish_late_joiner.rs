//! `serve --publish-zmq`: a consumer that joins late, after the ring wrapped and kvbridge
//! restarted, rebuilds the whole state from replay plus the live stream (decoded by vLLM's own
//! classes, scripts/vllm-events-venv.sh).

use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::zmq_publish::*;
use common::{metric, scrape, Bridge, Engine};
use serde_json::Value;

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
