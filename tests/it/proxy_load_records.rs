//! Sidecar mode (`--engine-grpc`): load records (docs/smg-api.md §3.5) follow the engine's
//! `GetLoads` for subscribers that ask for them (field 2) only.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Instant;

use common::proxy::*;
use common::{layout, store};
use kvbridge::proto::common::SubscribeKvEventsRequest;
use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;

/// Load records go only to subscribers that set request field 2, numbered 0 before the first
/// batch and with the last batch's number after it, and follow the engine's GetLoads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_records_follow_get_loads_for_field_2_subscribers_only() {
    let s = sidecar(&["--load-interval-ms", "100"]).await;
    s.engine.stats.running.store(7, Ordering::Relaxed);
    let ch = channel(&s.bridge.url()).await;
    let open = |field2: bool| {
        let ch = ch.clone();
        async move {
            VllmEngineClient::new(ch)
                .subscribe_kv_events(SubscribeKvEventsRequest {
                    start_sequence_number: 0,
                    load_records_before_first_batch: field2,
                })
                .await
                .unwrap()
                .into_inner()
        }
    };
    let mut with = open(true).await;
    let mut without = open(false).await;
    // Before the first batch: load records numbered 0, soon with the engine's 7.
    let load = loop {
        let first = tokio::time::timeout(T, with.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let load = first.load.expect("a load record");
        assert!(load.load_only && first.events.is_empty());
        assert_eq!(first.sequence_number, 0, "before the first batch");
        if load.running_requests == 7 {
            break load;
        }
    };
    assert_eq!(load.waiting_requests, 2);
    assert_eq!(load.max_running_requests, 128);
    assert_eq!(load.waiting_uncached_tokens, None, "vLLM has no such field");

    s.engine.stats.running.store(9, Ordering::Relaxed);
    s.zmq.publish(layout(0), vec![store(5, 1, None)], 0);
    let (mut batch_seq, mut saw_nine_after) = (None, false);
    let deadline = Instant::now() + T;
    while !saw_nine_after {
        assert!(Instant::now() < deadline, "no load record after the batch");
        let b = tokio::time::timeout(T, with.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        match (&b.load, batch_seq) {
            (None, _) => batch_seq = Some(b.sequence_number),
            (Some(l), Some(seq)) if l.running_requests == 9 => {
                assert_eq!(b.sequence_number, seq, "repeats the last number");
                saw_nine_after = true;
            }
            (Some(_), _) => {}
        }
    }
    // The plain subscriber gets the batch and never a load record.
    let b = tokio::time::timeout(T, without.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(b.load.is_none() && !b.events.is_empty());
    assert_eq!(Some(b.sequence_number), batch_seq);
    s.zmq.publish(layout(0), vec![store(6, 1, None)], 0);
    let b = tokio::time::timeout(T, without.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(b.load.is_none(), "no load records without field 2");
    s.bridge.stop();
}
