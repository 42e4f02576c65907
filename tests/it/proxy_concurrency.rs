//! Sidecar mode (`--engine-grpc`): many calls at once. A thousand concurrent forwarded streams,
//! the engine's own concurrent-stream limit, and two hundred streaming calls for 30 s beside a
//! subscriber.

use crate::common;
use crate::common::grpc_engine;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::proxy::*;
use common::{layout, metric, store};
use grpc_engine::GrpcEngine;
use tonic::Request;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_forwarded_streams() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..1000 {
        let ch = ch.clone();
        tasks.spawn(async move { generate_and_check(&ch, 20, 200).await });
    }
    let mut done = 0;
    while let Some(r) = tasks.join_next().await {
        r.expect("stream task");
        done += 1;
    }
    assert_eq!(done, 1000);
    assert_eq!(s.engine.stats.generates.load(Ordering::Relaxed), 1000);
    s.bridge.stop();
}

/// kvbridge reads the engine's own `SETTINGS_MAX_CONCURRENT_STREAMS` from its connections
/// (metric) and warns when its client-facing limit, given explicitly, is lower: the sidecar must
/// not lower the engine's limit (docs/smg-api.md §2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_stream_limit_is_read_and_a_lower_client_limit_warned() {
    for (client_limit, warned) in [("10", true), ("100", false)] {
        let stats = std::sync::Arc::new(grpc_engine::Stats::default());
        stats.max_streams.store(50, Ordering::SeqCst);
        let engine = GrpcEngine::start_with("127.0.0.1:0".parse().unwrap(), stats).await;
        let target = engine.addr.to_string();
        let s = sidecar_with(
            tempfile::tempdir().unwrap(),
            engine,
            &target,
            &["--max-streams-per-connection", client_limit],
        )
        .await;
        let ch = channel(&s.bridge.url()).await;
        unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"x")))
            .await
            .unwrap();
        common::wait_metrics(s.metrics, T, |p| {
            metric(p, "kvbridge_proxy_engine_max_concurrent_streams", &[]) == 50.0
        });
        // The gauge is set just before the log line is written: wait for the line.
        let deadline = Instant::now() + T;
        let log = loop {
            let log = s.bridge.log();
            if log.contains("engine_max_streams=50") || Instant::now() > deadline {
                break log;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(
            log.contains("allows more concurrent streams per connection than kvbridge advertises"),
            warned,
            "client limit {client_limit}, engine 50: {log}"
        );
        assert!(log.contains("engine_max_streams=50"), "{log}");
    }
}

/// How long the soak below runs: long enough to cover many `GetLoads` polls (0.5 s), health
/// probes and HTTP/2 window cycles on every stream, short enough for the suite (about 40 s of
/// wall time with start-up).
const SOAK: Duration = Duration::from_secs(30);

/// 200 concurrent streaming calls, each a `Generate` of 50 × 1 KiB checked byte for byte, again
/// and again for [`SOAK`], while a subscriber takes a batch published every 10 ms: no call
/// fails, and the subscriber gets every batch, in order, no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_streaming_calls_for_30_s_with_a_subscriber() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let mut sub = live_subscription(&s, &ch).await;
    let end = Instant::now() + SOAK;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..200 {
        let ch = ch.clone();
        calls.spawn(async move {
            let mut n = 0u32;
            while Instant::now() < end {
                generate_and_check(&ch, 50, 1024).await;
                n += 1;
            }
            n
        });
    }
    let zmq = s.zmq;
    let publisher = tokio::task::spawn_blocking(move || {
        let mut seqs = Vec::new();
        let mut block = 1_000_000;
        while Instant::now() < end {
            block += 1;
            seqs.push(zmq.publish(layout(0), vec![store(block, 1, None)], 0));
            // Pacing: events keep flowing while the calls run.
            std::thread::sleep(Duration::from_millis(10));
        }
        (zmq, seqs.len())
    });
    let mut completed = 0;
    while let Some(n) = calls.join_next().await {
        completed += n.expect("every streaming call succeeds");
    }
    let (_zmq, published) = publisher.await.unwrap();
    expect_batches(&mut sub, published).await;
    assert!(completed >= 200, "{completed} calls completed");
    s.bridge.stop();
}
