//! Operations: message sizes at both edges. An engine batch above a client's 4 MiB limit arrives
//! split and reassembles; an engine message above `--max-engine-message` is refused and the
//! stream goes on.

use crate::common;

use std::time::Duration;

use common::ops::*;
use common::*;
use kvbridge::proto::common::kv_cache_event::Data;
use kvbridge_tools::sim::{encode_batch, SimEvent};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_engine_batch_arrives_split_under_4mib_and_reassembles() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &engine_args(&e));
    e.wait_subscribed();
    // A client with the default 4 MiB decode limit, as G1 gateways have.
    let mut sub = subscribe(&bridge.url(), 0).await.unwrap();
    const BLOCKS: usize = 20_000;
    const BS: usize = 64;
    let hashes: Vec<u64> = (0..BLOCKS as u64)
        .map(|i| 0x5eed_0000_0000 + i * 7 + 1)
        .collect();
    // Tokens of 70k..150k encode as msgpack uint32 (5 bytes): the batch is over 6 MB.
    let tokens: Vec<u32> = (0..BLOCKS * BS)
        .map(|i| (i % 80_000) as u32 + 70_000)
        .collect();
    let parent = Some(0xabcdef);
    let ev = SimEvent::Stored {
        hashes: hashes.clone(),
        parent,
        tokens: tokens.clone(),
        block_size: BS as u32,
        medium: Some("GPU".into()),
    };
    let payload = encode_batch(L, 1_700_000_000.0, &[ev], 0);
    assert!(payload.len() > 4 << 20, "input is {} bytes", payload.len());
    e.with(move |p| p.publish(payload));
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= BLOCKS).await;
    assert!(
        got.len() >= 3,
        "expected several records, got {}",
        got.len()
    );
    assert_contiguous(&got);
    let mut blocks = Vec::new();
    let mut expect_parent = parent.map(|p| p as i64);
    for b in &got {
        assert!(prost::Message::encoded_len(b) < 4 << 20);
        for ev in &b.events {
            let Some(Data::Stored(st)) = &ev.data else {
                panic!("unexpected event {ev:?}")
            };
            assert_eq!(st.parent_block_hash, expect_parent, "parent chain broken");
            expect_parent = st.blocks.last().map(|b| b.block_hash);
            blocks.extend(st.blocks.iter().cloned());
        }
    }
    assert_eq!(blocks.len(), BLOCKS);
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b.block_hash as u64, hashes[i]);
        assert_eq!(
            b.token_ids,
            tokens[i * BS..(i + 1) * BS],
            "tokens of block {i}"
        );
    }
    drop(sub);
    bridge.stop();
}

/// A message above `--max-engine-message` is never delivered: ZMQ refuses it
/// before allocating it and drops the publisher connection; kvbridge connects again, the batch
/// becomes a gap that replay cannot fill (the replayed copy is refused too), which is signalled
/// in band, and later valid messages flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_message_above_the_limit_is_refused_and_the_stream_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    args.extend([
        s("--max-engine-message"),
        s("256KiB"),
        s("--replay-timeout-ms"),
        s("300"),
    ]);
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    e.wait_subscribed();
    let mut sub = subscribe(&bridge.url(), 0).await.unwrap();
    let first = publish_stores(&e, 500, 1, 2);
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= first.len()).await;
    assert_eq!(stored_hashes(&got), first);
    // One store of 6,000 blocks: about 400 KB of msgpack.
    let big = store(600, 6000, None);
    let SimEvent::Stored {
        hashes: big_hashes, ..
    } = &big
    else {
        unreachable!()
    };
    let big_hashes = big_hashes.clone();
    let payload = encode_batch(L, 1.5, &[big], 0);
    assert!(payload.len() > 256 << 10, "{} bytes", payload.len());
    e.with(move |p| p.publish(payload));
    wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_publisher_disconnects_total", &[("rank", "0")]) >= 1.0
    });
    // Until the bridge is subscribed again the PUB drops what it sends: publish small batches
    // until something arrives.
    let mut got = Vec::new();
    for seed in 700.. {
        publish_stores(&e, seed, 1, 1);
        match tokio::time::timeout(Duration::from_millis(300), sub.message()).await {
            Ok(Ok(Some(b))) => {
                got.push(b);
                break;
            }
            Ok(other) => panic!("stream ended: {other:?}"),
            Err(_) => assert!(seed < 800, "nothing delivered after the oversized message"),
        }
    }
    let last = publish_stores(&e, 900, 1, 3);
    got.extend(collect_until(&mut sub, T, |b| stored_hashes(b).ends_with(&last)).await);
    let delivered = stored_hashes(&got);
    assert!(delivered.ends_with(&last), "{delivered:?}");
    assert!(
        !delivered.iter().any(|h| big_hashes.contains(h)),
        "the oversized batch was delivered"
    );
    assert!(
        clears(&got) >= 1,
        "the lost batch was not signalled in band"
    );
    // the socket monitor reports the new connection on its own time
    let page = wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) == 1.0
    });
    let rejoins = metric(&page, "kvbridge_publisher_rejoins_total", &[("rank", "0")]);
    let timed_out = metric(&page, "kvbridge_replays_total", &[("outcome", "timed_out")]);
    eprintln!(
        "rejoins {rejoins}, replays timed out {timed_out}, clears {}",
        clears(&got)
    );
    assert!(rejoins >= 1.0, "kvbridge did not connect the SUB again");
    assert_eq!(
        metric(&page, "kvbridge_upstream_connected", &[("rank", "0")]),
        1.0
    );
    drop(sub);
    bridge.stop();
}
