//! Sidecar mode (`--engine-grpc`): forwarding fidelity (docs/smg-api.md §2 "Proxy mode"). Unary,
//! server, client and bidi streaming calls, metadata, large messages, trailers, deadlines and
//! cancels reach the engine and come back unchanged.

use crate::common;
use crate::common::grpc_engine;

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::proxy::*;
use common::{metric, scrape};
use grpc_engine::{generate_message, path, raw_client, Raw, FAIL_DETAILS};
use tonic::{Code, Request};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_with_metadata_and_the_engines_own_health_checks() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let mut req = Request::new(Bytes::from_static(b"hello engine"));
    req.metadata_mut()
        .insert("x-request-id", "abc-123".parse().unwrap());
    req.metadata_mut().insert_bin(
        "x-trace-bin",
        tonic::metadata::MetadataValue::from_bytes(&[0, 255, 7]),
    );
    req.set_timeout(Duration::from_secs(20));
    let resp = unary(&ch, "any.pkg.Service", "Echo", req)
        .await
        .expect("Echo");
    assert_eq!(resp.get_ref(), &Bytes::from_static(b"hello engine"));
    let md = resp.metadata();
    assert_eq!(md.get("echo-x-request-id").unwrap(), "abc-123");
    assert_eq!(
        md.get_bin("echo-x-trace-bin").unwrap().to_bytes().unwrap(),
        Bytes::from_static(&[0, 255, 7])
    );
    assert!(
        md.get("echo-grpc-timeout").is_some(),
        "grpc-timeout reached the engine"
    );

    // Runtime detection lands on the real service: the engine answers its own HealthCheck and
    // refuses the others itself.
    let ok = unary(&ch, VLLM, "HealthCheck", Request::new(Bytes::new()))
        .await
        .expect("vLLM HealthCheck");
    assert_eq!(&ok.get_ref()[..2], &[0x08, 0x01], "healthy = true");
    for svc in [
        "sglang.grpc.scheduler.SglangScheduler",
        "trtllm.TrtllmService",
        "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
    ] {
        let st = unary(&ch, svc, "HealthCheck", Request::new(Bytes::new()))
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::Unimplemented, "{svc}");
        assert!(
            st.message().starts_with("test engine: no method"),
            "the engine's own answer: {st:?}"
        );
    }

    let page = scrape(s.metrics);
    assert_eq!(
        metric(
            &page,
            "kvbridge_proxy_calls_total",
            &[("method", "other"), ("code", "ok")]
        ),
        1.0,
        "a method of no engine service is `other`"
    );
    for (method, code) in [
        ("/vllm.grpc.engine.VllmEngine/HealthCheck", "ok"),
        ("/trtllm.TrtllmService/HealthCheck", "unimplemented"),
        // created at 0 before any call
        ("/sglang.grpc.scheduler.SglangScheduler/Generate", "ok"),
    ] {
        let want = if method.ends_with("Generate") {
            0.0
        } else {
            1.0
        };
        assert_eq!(
            metric(
                &page,
                "kvbridge_proxy_calls_total",
                &[("method", method), ("code", code)]
            ),
            want,
            "{method} {code}"
        );
    }
    assert!(metric(&page, "kvbridge_proxy_upstream_connections", &[]) >= 1.0);
    s.bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_stream_of_10000_messages_is_byte_identical() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    generate_and_check(&ch, 10_000, 100).await;
    s.bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_mib_messages_both_ways() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let big: Bytes = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
    let resp = unary(&ch, VLLM, "Echo", Request::new(big.clone()))
        .await
        .expect("8 MiB echo");
    assert!(resp.get_ref() == &big, "8 MiB came back identical");
    generate_and_check(&ch, 3, 8 << 20).await;
    s.bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_with_details_are_unchanged() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let mut stream = open_stream(&ch, "Fail", b"partial").await;
    let st = stream.message().await.unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition);
    assert_eq!(st.message(), "test engine: precondition failed");
    assert_eq!(st.details(), FAIL_DETAILS);
    assert_eq!(st.metadata().get("x-engine-trailer").unwrap(), "kept");
    s.bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_is_the_engines() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let mut req = Request::new(Bytes::new());
    req.set_timeout(Duration::from_millis(200));
    let st = unary(&ch, VLLM, "Slow", req).await.unwrap_err();
    assert_eq!(st.code(), Code::DeadlineExceeded, "{st:?}");
    assert_eq!(
        st.message(),
        "test engine: deadline exceeded",
        "answered by the engine"
    );
    s.bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cancel_reaches_the_engine() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let stream = open_stream(&ch, "Hang", b"first").await;
    assert_eq!(s.engine.stats.cancelled.load(Ordering::SeqCst), 0);
    drop(stream);
    let stats = s.engine.stats.clone();
    wait_until("the engine to see the cancel", || {
        stats.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    s.bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_and_bidi_streaming() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let mut c = raw_client(ch.clone());
    c.ready().await.unwrap();
    let msgs: Vec<Bytes> = (0..100u32).map(|i| generate_message(i, 1000 + i)).collect();
    let total: u64 = msgs.iter().map(|m| m.len() as u64).sum();
    let resp = c
        .client_streaming(
            Request::new(futures_util::stream::iter(msgs.clone())),
            path(VLLM, "Sum"),
            Raw,
        )
        .await
        .expect("Sum")
        .into_inner();
    assert_eq!(&resp[..8], &100u64.to_le_bytes());
    assert_eq!(&resp[8..], &total.to_le_bytes());

    // Bidi: each reply arrives before the next request is sent.
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    c.ready().await.unwrap();
    let mut replies = c
        .streaming(
            Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            path(VLLM, "Chat"),
            Raw,
        )
        .await
        .expect("Chat")
        .into_inner();
    for m in msgs.iter().take(20) {
        tx.send(m.clone()).await.unwrap();
        assert_eq!(&replies.message().await.unwrap().unwrap(), m);
    }
    drop(tx);
    assert!(replies.message().await.unwrap().is_none(), "ended OK");
    s.bridge.stop();
}
