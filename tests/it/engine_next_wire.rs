//! The engines' next wire (both unmerged; docs/engine-wire.md §13), read by ingest: a publisher
//! epoch on every live message decides the incarnation, and an idle publisher's empty batches
//! are heartbeats that never reach a consumer as an event. The simulated engine sends the frames
//! as the branches' publishers build them:
//!
//! - vLLM #57789 (`vMaroon/vllm` @ 08ee3e5, `ZmqEventPublisher` with `snapshot_endpoint` set):
//!   the seq frame is the 8-byte seq and the publisher's 16-byte UUID; an idle publisher sends
//!   `KVEventBatch(events=[])` every second, with a seq of its own;
//! - SGLang #34407 (`sgl-project/sglang` @ 3536c7c, `replica_bridge.rs`): the topic frame is
//!   `<topic>\0sgl-kv-epoch=<epoch>`.
//!
//! Today's kvbridge dropped every such vLLM message as `seq_length` and every such SGLang one as
//! `topic`: an empty stream that looked healthy.

use crate::common;

use common::*;
use kvbridge_tools::sim::{Identity, Layout};

const T: std::time::Duration = std::time::Duration::from_secs(30);

/// One engine restart under kvbridge, the new identity `second`: the first incarnation's stores,
/// exactly one clear, the second's, in order; one restart counted; no frame dropped.
async fn a_publisher_restart_is_one_clear(first: Identity, second: Identity, topic: &str) {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let t = topic.to_string();
    e.with(move |p| {
        p.set_topic(&t);
        p.identity = Some(first);
    });
    let mut args = e.bridge_args();
    if !topic.is_empty() {
        args.extend(["--topic".to_string(), topic.to_string()]);
    }
    let (bridge, metrics) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    e.wait_subscribed();
    let old = e.publish_stores(1..4);
    // An idle publisher's heartbeat: an empty batch with a seq of its own.
    let heartbeat = e.publish(Layout::Vllm033, vec![], 0);
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let got = collect_until(&mut s, T, |g| stored_hashes(g).len() >= old.len()).await;
    assert_eq!(stored_hashes(&got), old);
    // The heartbeat moved the rank's seq (and reached no subscriber: below, the restart's clear
    // is the record right after the last store).
    wait_metrics(metrics, T, |p| {
        metric(p, "kvbridge_last_upstream_seq", &[("rank", "0")]) == heartbeat as f64
    });

    // The engine restarts: seq from 0, a new identity. Its first batches are one past what
    // kvbridge applied and beyond, so only the identity tells a restart from the next batches.
    e.with(move |p| {
        p.restart();
        p.identity = Some(second);
    });
    let filler = e.publish_stores(20..25);
    let new = e.publish_stores(11..14);
    let after = collect_until(&mut s, T, |g| {
        stored_hashes(g).len() >= filler.len() + new.len()
    })
    .await;
    assert_contiguous(&after);
    assert_eq!(
        after[0].sequence_number,
        got.last().unwrap().sequence_number + 1,
        "no record for the heartbeat"
    );
    assert_eq!(clears(&after), 1, "one clear for one restart: {after:?}");
    assert!(
        matches!(
            after[0].events[0].data,
            Some(kvbridge::proto::common::kv_cache_event::Data::Cleared(_))
        ),
        "the clear comes before the new incarnation's first batch"
    );
    assert_eq!(stored_hashes(&after), [filler, new].concat());
    let page = scrape(metrics);
    assert_eq!(
        metric(&page, "kvbridge_engine_restarts_total", &[("rank", "0")]),
        1.0
    );
    for reason in ["seq_length", "topic"] {
        assert_eq!(
            metric(
                &page,
                "kvbridge_frames_dropped_total",
                &[("rank", "0"), ("reason", reason)]
            ),
            0.0,
            "{reason}"
        );
    }
    bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_publisher_uuid_decides_the_incarnation() {
    a_publisher_restart_is_one_clear(
        Identity::VllmUuid([0x11; 16]),
        Identity::VllmUuid([0x22; 16]),
        "",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_epoch_in_the_topic_decides_the_incarnation() {
    a_publisher_restart_is_one_clear(
        Identity::SglangEpoch("1733580000-a".into()),
        Identity::SglangEpoch("1733580042-b".into()),
        "kv",
    )
    .await;
}
