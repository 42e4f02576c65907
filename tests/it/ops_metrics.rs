//! Operations: the Prometheus metrics move as events flow, and count gaps, decode errors, dropped
//! frames, replays and catch-up sends. The real binary, a simulated engine over real ZMQ, tonic
//! clients.

use crate::common;

use common::ops::*;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_as_events_flow_and_count_gaps_and_decode_errors() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let (bridge, maddr) =
        Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &engine_args(&e));
    e.wait_subscribed();
    let mut sub = subscribe(&bridge.url(), 0).await.unwrap();
    // The engine sees the subscription before kvbridge's socket monitor reports the connection,
    // and the health gauge follows on its next tick (100 ms).
    let page = wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) == 1.0
            && metric(p, "kvbridge_health_serving", &[]) == 1.0
    });
    assert_eq!(metric(&page, "kvbridge_subscribers", &[]), 1.0);

    let want = publish_stores(&e, 100, 10, 3);
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= want.len()).await;
    assert_eq!(stored_hashes(&got), want);
    let page = wait_metrics(maddr, T, |p| {
        metric(
            p,
            "kvbridge_decoder_events_total",
            &[("rank", "0"), ("kind", "stored_events")],
        ) >= 10.0
    });
    assert_eq!(
        metric(&page, "kvbridge_batches_received_total", &[("rank", "0")]),
        10.0
    );
    assert_eq!(
        metric(&page, "kvbridge_last_upstream_seq", &[("rank", "0")]),
        9.0
    );
    assert_eq!(
        metric(&page, "kvbridge_ring_records_total", &[("ring", "merged")]),
        10.0
    );
    assert!(metric(&page, "kvbridge_ring_bytes_total", &[("ring", "merged")]) > 0.0);
    assert_eq!(metric(&page, "kvbridge_record_size_bytes_count", &[]), 10.0);
    assert!(metric(&page, "kvbridge_ring_capacity_bytes", &[("ring", "merged")]) > 0.0);
    let used = metric(&page, "kvbridge_ring_used_bytes", &[("ring", "merged")]);
    assert!(used >= metric(&page, "kvbridge_ring_bytes_total", &[("ring", "merged")]));
    let fill = metric(&page, "kvbridge_ring_fill_ratio", &[("ring", "merged")]);
    assert!(fill > 0.0 && fill < 0.01, "fill {fill}");
    assert_eq!(
        metric(&page, "kvbridge_ring_newest_seq", &[("ring", "merged")]),
        10.0
    );
    assert_eq!(metric(&page, "kvbridge_batches_sent_total", &[]), 10.0);
    // Observed once per write, and a write may carry several records.
    let lag_writes = metric(&page, "kvbridge_subscriber_lag_batches_count", &[]);
    assert!(
        (1.0..=10.0).contains(&lag_writes),
        "{lag_writes} lag observations"
    );
    assert!(metric(&page, "kvbridge_bytes_sent_total", &[]) > 0.0);
    assert_eq!(
        metric(
            &page,
            "kvbridge_send_latency_seconds_count",
            &[("path", VLLM)]
        ),
        10.0,
        "every hand-off observed"
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_subscribe_outcomes_total",
            &[("outcome", "fresh")]
        ),
        1.0
    );

    // Garbage msgpack with a valid seq: a decode error (by kind) and an in-band clear.
    e.with(|p| p.publish(vec![0xc1, 1, 2, 3]));
    // Not msgpack at all shape-wise: two frames, short seq.
    e.with(|p| p.send_raw(&[b"", &[0u8; 8]]).unwrap());
    e.with(|p| p.send_raw(&[b"", &[0u8; 3], b"x"]).unwrap());
    // A burned seq: the next batch reveals a gap, replay cannot fill it (history missing).
    e.with(|p| p.burn_seq());
    let after = publish_stores(&e, 900, 1, 2);
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= after.len()).await;
    assert_eq!(stored_hashes(&got), after);
    assert_eq!(clears(&got), 2, "undecodable + missing history");
    let page = wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_upstream_gaps_total", &[("rank", "0")]) >= 1.0
    });
    let kinds: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("kvbridge_decode_errors_total{kind="))
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    assert_eq!(
        kinds.len(),
        1,
        "decode errors are labelled by kind (every kind exported, one counted): {kinds:?}"
    );
    assert_eq!(
        metric(&page, "kvbridge_decode_errors_total", &[("rank", "0")]),
        1.0,
        "{kinds:?}"
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_frames_dropped_total",
            &[("reason", "frame_count")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_frames_dropped_total",
            &[("reason", "seq_length")]
        ),
        1.0
    );
    assert!(metric(&page, "kvbridge_replays_total", &[("outcome", "requested")]) >= 1.0);
    assert!(
        metric(
            &page,
            "kvbridge_replays_total",
            &[("outcome", "history_missing")]
        ) >= 1.0
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_synthesized_clears_total",
            &[("cause", "undecodable")]
        ),
        1.0
    );
    assert_eq!(
        metric(&page, "kvbridge_batches_received_total", &[("rank", "0")]),
        12.0
    );

    // A second subscriber from 0 catches up on that history: counted as catch-up, not timed as
    // a live send (its age would swamp the latency of live deliveries).
    let live = metric(
        &page,
        "kvbridge_send_latency_seconds_count",
        &[("path", VLLM)],
    );
    let mut late = subscribe(&bridge.url(), 0).await.unwrap();
    let want_all = stored_hashes(
        &collect_until(&mut late, T, |b| {
            stored_hashes(b).len() >= want.len() + after.len()
        })
        .await,
    );
    assert_eq!(want_all.len(), want.len() + after.len());
    let page = wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_catchup_sends_total", &[("path", VLLM)]) >= 12.0
    });
    assert_eq!(
        metric(
            &page,
            "kvbridge_send_latency_seconds_count",
            &[("path", VLLM)]
        ),
        live,
        "catch-up is not live latency"
    );
    drop(late);
    drop(sub);
    bridge.stop();
}
