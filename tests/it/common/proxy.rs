//! What the `proxy_*` modules share: sidecar mode (`--engine-grpc`), the real `kvbridge` binary
//! in front of a test engine gRPC server ([`super::grpc_engine`]) and a simulated ZMQ publisher,
//! and raw gRPC calls through it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::grpc_engine::{generate_message, path, raw_client, GrpcEngine, Raw};
use super::{layout, metric, store, Bridge, Engine};
use bytes::{BufMut, Bytes, BytesMut};
use kvbridge::proto::common::SubscribeKvEventsRequest;
use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;
use tonic::transport::Channel;
use tonic::Request;

/// Generous bound for anything awaited (never a timing assertion).
pub const T: Duration = Duration::from_secs(30);

pub const VLLM: &str = "vllm.grpc.engine.VllmEngine";

pub struct Sidecar {
    pub _dir: tempfile::TempDir,
    pub zmq: Engine,
    pub engine: GrpcEngine,
    pub bridge: Bridge,
    pub metrics: SocketAddr,
}

/// A test engine, a simulated ZMQ publisher and `kvbridge serve --engine-grpc` in front of them.
pub async fn sidecar(extra: &[&str]) -> Sidecar {
    let engine = GrpcEngine::start("127.0.0.1:0".parse().unwrap()).await;
    let target = engine.addr.to_string();
    sidecar_with(tempfile::tempdir().unwrap(), engine, &target, extra).await
}

/// As [`sidecar`], in front of `engine` given as `--engine-grpc target`, files in `dir`.
pub async fn sidecar_with(
    dir: tempfile::TempDir,
    engine: GrpcEngine,
    target: &str,
    extra: &[&str],
) -> Sidecar {
    let zmq = Engine::start(0);
    let mut args: Vec<String> = vec![
        "--zmq".into(),
        zmq.endpoint.clone(),
        "--replay".into(),
        zmq.replay.clone(),
        "--seq-base".into(),
        "1".into(),
        "--engine-grpc".into(),
        target.into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let (bridge, metrics) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    // The publisher connected, so no test batch is published into the void.
    super::wait_metrics(metrics, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) >= 1.0
    });
    Sidecar {
        _dir: dir,
        zmq,
        engine,
        bridge,
        metrics,
    }
}

pub async fn channel(url: &str) -> Channel {
    // Windows as a G2 gateway's channel (docs/smg-api.md §3.1: 512 MiB per connection), which
    // also keeps h2's small-DATA-frame budget (half the connection window) out of the way.
    Channel::from_shared(url.to_string())
        .unwrap()
        .initial_connection_window_size(512 << 20)
        .initial_stream_window_size(256 << 10)
        .connect()
        .await
        .expect("connect to kvbridge")
}

pub fn generate_request(count: u32, size: u32) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u32_le(count);
    b.put_u32_le(size);
    b.freeze()
}

pub async fn unary(
    ch: &Channel,
    service: &str,
    method: &str,
    req: Request<Bytes>,
) -> Result<tonic::Response<Bytes>, tonic::Status> {
    let mut c = raw_client(ch.clone());
    c.ready().await.unwrap();
    c.unary(req, path(service, method), Raw).await
}

/// Opens the test engine's server stream `method` (an empty request) through `ch` and checks
/// that its first message is `first`.
pub async fn open_stream(
    ch: &Channel,
    method: &str,
    first: &'static [u8],
) -> tonic::Streaming<Bytes> {
    let mut c = raw_client(ch.clone());
    c.ready().await.unwrap();
    let mut stream = c
        .server_streaming(Request::new(Bytes::new()), path(VLLM, method), Raw)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        stream.message().await.unwrap().unwrap(),
        Bytes::from_static(first),
        "the first message of {method}"
    );
    stream
}

/// Reads a whole `Generate` stream of `count` × `size` and checks every message's bytes.
pub async fn generate_and_check(ch: &Channel, count: u32, size: u32) {
    let mut c = raw_client(ch.clone());
    c.ready().await.unwrap();
    let mut s = c
        .server_streaming(
            Request::new(generate_request(count, size)),
            path(VLLM, "Generate"),
            Raw,
        )
        .await
        .expect("Generate answered")
        .into_inner();
    let mut i = 0u32;
    while let Some(m) = s.message().await.expect("stream ok") {
        assert!(
            m == generate_message(i, size),
            "message {i} differs ({} bytes)",
            m.len()
        );
        i += 1;
    }
    assert_eq!(i, count, "messages received");
}

pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn health(ch: &Channel) -> i32 {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    HealthClient::new(ch.clone())
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("kvbridge answers health itself")
        .into_inner()
        .status
}

pub async fn wait_health(ch: &Channel, want: tonic_health::ServingStatus) {
    let deadline = Instant::now() + T;
    loop {
        let st = health(ch).await;
        if st == want as i32 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "health stuck at {st}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A new SubscribeKvEvents stream that has received a batch (published until one arrived):
/// every batch published from now on reaches it.
pub async fn live_subscription(
    s: &Sidecar,
    ch: &Channel,
) -> tonic::Streaming<kvbridge::proto::common::KvEventBatch> {
    let mut sub = VllmEngineClient::new(ch.clone())
        .subscribe_kv_events(SubscribeKvEventsRequest {
            start_sequence_number: 0,
            load_records_before_first_batch: false,
        })
        .await
        .expect("subscribe")
        .into_inner();
    let deadline = Instant::now() + T;
    for block in 1.. {
        assert!(Instant::now() < deadline, "no batch reached the subscriber");
        s.zmq.publish(layout(0), vec![store(block, 1, None)], 0);
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(500), sub.message()).await {
            let b = m.expect("stream ok").expect("a batch");
            assert!(!b.events.is_empty());
            return sub;
        }
    }
    unreachable!()
}

/// Reads `n` event batches from `sub` and checks that they are contiguous (the ring numbers
/// every batch, so a lost one is a gap).
pub async fn expect_batches(
    sub: &mut tonic::Streaming<kvbridge::proto::common::KvEventBatch>,
    n: usize,
) {
    let mut got: Vec<kvbridge::proto::common::KvEventBatch> = Vec::new();
    while got.len() < n {
        let b = tokio::time::timeout(T, sub.message())
            .await
            .expect("every batch in time")
            .expect("stream ok")
            .expect("a batch");
        if !b.events.is_empty() {
            got.push(b);
        }
    }
    super::assert_contiguous(&got);
}
