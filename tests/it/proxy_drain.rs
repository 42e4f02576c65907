//! Sidecar mode (`--engine-grpc`): shutting down. SIGTERM with a forwarded stream open exits
//! cleanly and ends the call; a call that arrives during the drain is refused at once.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::proxy::*;
use tonic::transport::Channel;
use tonic::Request;

/// SIGTERM with a forwarded stream open: kvbridge still exits cleanly (connections get a GOAWAY
/// and the drain period), the client's call ends instead of hanging, and the engine sees its
/// stream cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_forwarded_stream_open_exits_cleanly_and_ends_the_call() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let mut stream = open_stream(&ch, "Hang", b"first").await;
    let Sidecar {
        bridge,
        engine,
        _dir,
        zmq,
        ..
    } = s;
    let exit = tokio::task::spawn_blocking(move || bridge.stop());
    let ended = tokio::time::timeout(T, stream.message())
        .await
        .expect("the client's call ends when kvbridge stops");
    assert!(
        !matches!(ended, Ok(Some(_))),
        "no message after `first`: {ended:?}"
    );
    let status = exit.await.unwrap();
    assert!(status.success(), "kvbridge exited with {status:?}");
    let stats = engine.stats.clone();
    wait_until("the engine to see the cancel", || {
        stats.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    drop((engine, zmq, _dir));
}

/// SIGTERM with a forwarded stream open (so the drain lasts): from the start of the shutdown,
/// a call on a new connection is refused within 1 s rather than left in the listener's backlog
/// until its deadline or the exit (before the fix: 4 s, its deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_during_the_drain_is_refused_at_once() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    let _open = open_stream(&ch, "Hang", b"first").await;
    let url = s.bridge.url();
    // SAFETY: kill(2) on our own child's pid, not yet waited for.
    unsafe { libc::kill(s.bridge.child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + T;
    loop {
        assert!(Instant::now() < deadline, "never refused");
        let t = Instant::now();
        let attempt = tokio::time::timeout(Duration::from_secs(4), async {
            let ch = Channel::from_shared(url.clone()).unwrap().connect().await?;
            let mut req = Request::new(Bytes::from_static(b"drain"));
            req.set_timeout(Duration::from_secs(4));
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                unary(&ch, VLLM, "Echo", req).await.is_ok(),
            )
        })
        .await;
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "a call during the drain took {took:?}"
        );
        match attempt {
            // Served: the shutdown has not reached the listener yet.
            Ok(Ok(true)) => tokio::time::sleep(Duration::from_millis(20)).await,
            // Refused (connection refused, or the call failed at once).
            _ => break,
        }
    }
    let mut bridge = s.bridge;
    let status = tokio::task::spawn_blocking(move || bridge.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "kvbridge exited with {status:?}");
}
