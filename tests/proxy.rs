//! Sidecar mode (`--engine-grpc`, issue 9): the real `kvbridge` binary in front of a test
//! engine gRPC server (`common/grpc_engine.rs`), checked for forwarding fidelity (docs/smg-api.md
//! §2 "Proxy mode"), failure handling, health and load records (§3.5).

mod common;
#[path = "common/grpc_engine.rs"]
mod grpc_engine;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use common::{layout, metric, scrape, store, Bridge, Engine};
use grpc_engine::{generate_message, path, raw_client, GrpcEngine, Raw, FAIL_DETAILS};
use kvbridge::proto::common::SubscribeKvEventsRequest;
use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;
use tonic::transport::Channel;
use tonic::{Code, Request};

/// Generous bound for anything awaited (never a timing assertion).
const T: Duration = Duration::from_secs(30);
const VLLM: &str = "vllm.grpc.engine.VllmEngine";

struct Sidecar {
    _dir: tempfile::TempDir,
    zmq: Engine,
    engine: GrpcEngine,
    bridge: Bridge,
    metrics: SocketAddr,
}

/// A test engine, a simulated ZMQ publisher and `kvbridge serve --engine-grpc` in front of them.
async fn sidecar(extra: &[&str]) -> Sidecar {
    let engine = GrpcEngine::start("127.0.0.1:0".parse().unwrap()).await;
    let target = engine.addr.to_string();
    sidecar_with(tempfile::tempdir().unwrap(), engine, &target, extra).await
}

/// As [`sidecar`], in front of `engine` given as `--engine-grpc target`, files in `dir`.
async fn sidecar_with(
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
    common::wait_metrics(metrics, T, |p| {
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

async fn channel(url: &str) -> Channel {
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

fn generate_request(count: u32, size: u32) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u32_le(count);
    b.put_u32_le(size);
    b.freeze()
}

async fn unary(
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
async fn open_stream(ch: &Channel, method: &str, first: &'static [u8]) -> tonic::Streaming<Bytes> {
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
async fn generate_and_check(ch: &Channel, count: u32, size: u32) {
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

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

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
            &[("method", "/any.pkg.Service/Echo"), ("code", "ok")]
        ),
        1.0
    );
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

async fn health(ch: &Channel) -> i32 {
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

async fn wait_health(ch: &Channel, want: tonic_health::ServingStatus) {
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

/// Engine down: forwarded calls fail fast with UNAVAILABLE naming the engine, health turns
/// NOT_SERVING, SubscribeKvEvents keeps streaming; engine back on the same address: the next
/// call succeeds and health is SERVING again, without restarting kvbridge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_down_fails_fast_and_recovers_while_events_keep_flowing() {
    use tonic_health::ServingStatus::{NotServing, Serving};
    let s = sidecar(&["--load-interval-ms", "0"]).await;
    let ch = channel(&s.bridge.url()).await;
    wait_health(&ch, Serving).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"up")))
        .await
        .expect("engine up");

    let Sidecar {
        _dir,
        zmq,
        engine,
        bridge,
        metrics,
    } = s;
    let (addr, stats) = engine.stop();
    let started = Instant::now();
    let st = loop {
        // The first call may still find the dying connection; it must fail, never hang.
        let st = unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"down")))
            .await
            .unwrap_err();
        if st.message().contains("unreachable") {
            break st;
        }
        assert!(started.elapsed() < T, "never reported unreachable: {st:?}");
    };
    assert_eq!(st.code(), Code::Unavailable);
    assert!(
        st.message().contains(&addr.to_string()),
        "names the engine: {st:?}"
    );
    let t = Instant::now();
    let st = unary(&ch, VLLM, "Echo", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    // "Fails fast, not a hang": a generous bound, far below any client deadline.
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    wait_health(&ch, NotServing).await;

    // The event stream does not depend on the engine's gRPC server.
    let mut sub = VllmEngineClient::new(ch.clone())
        .subscribe_kv_events(SubscribeKvEventsRequest {
            start_sequence_number: 0,
            load_records_before_first_batch: true,
        })
        .await
        .expect("subscribe while the engine is down")
        .into_inner();
    tokio::time::sleep(Duration::from_millis(200)).await;
    zmq.publish(layout(0), vec![store(1, 2, None)], 0);
    let b = tokio::time::timeout(T, sub.message())
        .await
        .expect("a batch in time")
        .expect("stream ok")
        .expect("a batch");
    assert!(!b.events.is_empty());

    let engine = GrpcEngine::start_with(addr, stats).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"back")))
        .await
        .expect("the next call after the restart succeeds");
    wait_health(&ch, Serving).await;
    let page = scrape(metrics);
    assert!(
        metric(
            &page,
            "kvbridge_proxy_calls_total",
            &[
                ("method", "/vllm.grpc.engine.VllmEngine/Echo"),
                ("code", "unavailable")
            ]
        ) >= 2.0
    );
    drop(engine);
    bridge.stop();
}

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

/// A certificate and its private key, PEM.
struct Pem {
    cert: String,
    key: String,
}

/// A self-signed certificate with common name `cn` for the DNS names `names`.
fn self_signed(cn: &str, names: &[&str]) -> Pem {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut params = rcgen::CertificateParams::new(names).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// A CA's certificate (PEM) and a `localhost` certificate it signed: a deployment's usual chain.
fn ca_and_localhost_cert() -> (String, Pem) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kvbridge test CA");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca =
        rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
    let mut leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, "engine");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&key, &*ca).unwrap();
    (
        ca.pem(),
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        },
    )
}

/// kvbridge in front of a TLS test engine on 127.0.0.1 serving `engine`, with
/// `--engine-grpc https://localhost:PORT --engine-tls-ca CA`, CA = a file holding `ca`.
async fn tls_sidecar(engine: &Pem, ca: &str) -> Sidecar {
    let grpc =
        GrpcEngine::start_tls("127.0.0.1:0".parse().unwrap(), &engine.cert, &engine.key).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca).unwrap();
    let ca_file = ca_file.display().to_string();
    let target = format!("https://localhost:{}", grpc.addr.port());
    sidecar_with(dir, grpc, &target, &["--engine-tls-ca", &ca_file]).await
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

/// `--engine-grpc https://localhost:PORT --engine-tls-ca CA`, for a self-signed engine
/// certificate (its own CA) and for one signed by a CA: kvbridge verifies the engine, then
/// forwards unary calls and server streams over TLS byte for byte, and its health probe reaches
/// the engine the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_to_an_engine_that_serves_tls() {
    use tonic_health::ServingStatus::Serving;
    let own = self_signed("engine", &["localhost"]);
    let (ca, signed) = ca_and_localhost_cert();
    for (what, engine, ca) in [
        ("self-signed", &own, own.cert.as_str()),
        ("CA-signed", &signed, ca.as_str()),
    ] {
        let s = tls_sidecar(engine, ca).await;
        let ch = channel(&s.bridge.url()).await;
        let resp = unary(
            &ch,
            VLLM,
            "Echo",
            Request::new(Bytes::from_static(b"over TLS")),
        )
        .await
        .unwrap_or_else(|st| panic!("{what}: Echo over TLS: {st:?}"));
        assert_eq!(resp.get_ref(), &Bytes::from_static(b"over TLS"), "{what}");
        generate_and_check(&ch, 100, 1000).await;
        assert_eq!(
            s.engine.stats.generates.load(Ordering::Relaxed),
            1,
            "{what}: the engine served the stream"
        );
        assert_eq!(
            s.engine.stats.tls_failed.load(Ordering::SeqCst),
            0,
            "{what}"
        );
        wait_health(&ch, Serving).await;
        let page = scrape(s.metrics);
        assert_eq!(
            metric(
                &page,
                "kvbridge_proxy_calls_total",
                &[
                    ("method", "/vllm.grpc.engine.VllmEngine/Echo"),
                    ("code", "ok")
                ]
            ),
            1.0,
            "{what}"
        );
        s.bridge.stop();
    }
}

/// An engine certificate kvbridge cannot verify against `--engine-tls-ca` (issued by another CA;
/// by a CA of the same name with another key; or for another host name): no call reaches the
/// engine, and a forwarded call is answered UNAVAILABLE naming the engine and the certificate
/// problem. Health is NOT_SERVING, and SubscribeKvEvents (kvbridge's own) keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_certificate_the_ca_does_not_verify_is_refused() {
    use tonic_health::ServingStatus::NotServing;
    let localhost = self_signed("engine", &["localhost"]);
    let elsewhere = self_signed("engine", &["engine.example"]);
    let cases = [
        // rustls: UnknownIssuer
        (
            "another CA",
            &localhost,
            self_signed("other CA", &["localhost"]).cert,
        ),
        // rustls: BadSignature
        (
            "a CA of the same name with another key",
            &localhost,
            self_signed("engine", &["localhost"]).cert,
        ),
        // rustls: certificate not valid for name "localhost"
        (
            "a certificate for engine.example",
            &elsewhere,
            elsewhere.cert.clone(),
        ),
    ];
    for (i, (what, engine, ca)) in cases.iter().enumerate() {
        let s = tls_sidecar(engine, ca).await;
        let ch = channel(&s.bridge.url()).await;
        for method in ["Echo", "Generate"] {
            let st = unary(&ch, VLLM, method, Request::new(generate_request(1, 16)))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::Unavailable, "{what}: {method}: {st:?}");
            assert!(
                st.message()
                    .contains(&format!("localhost:{}", s.engine.addr.port())),
                "{what}: names the engine: {st:?}"
            );
            assert!(st.message().contains("TLS"), "{what}: says TLS: {st:?}");
            assert!(
                st.message().to_lowercase().contains("certificate"),
                "{what}: says certificate: {st:?}"
            );
        }
        let stats = s.engine.stats.clone();
        wait_until("the engine to see a failed handshake", || {
            stats.tls_failed.load(Ordering::SeqCst) >= 1
        })
        .await;
        assert_eq!(
            stats.calls.load(Ordering::SeqCst),
            0,
            "{what}: a call got through"
        );
        if i == 0 {
            wait_health(&ch, NotServing).await;
            events_still_flow(&s, &ch).await;
            assert_eq!(
                stats.calls.load(Ordering::SeqCst),
                0,
                "{what}: a call got through"
            );
        }
        s.bridge.stop();
    }
}

/// The TLS engine given as plain `--engine-grpc localhost:PORT`: kvbridge's cleartext HTTP/2
/// never gets through the engine's TLS, so a forwarded call fails instead of succeeding (the
/// engine's TLS is real, and the first test's success is TLS's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleartext_to_an_engine_that_serves_tls_fails() {
    let pem = self_signed("engine", &["localhost"]);
    let engine = GrpcEngine::start_tls("127.0.0.1:0".parse().unwrap(), &pem.cert, &pem.key).await;
    let target = format!("localhost:{}", engine.addr.port());
    let s = sidecar_with(tempfile::tempdir().unwrap(), engine, &target, &[]).await;
    let ch = channel(&s.bridge.url()).await;
    let st = unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"x")))
        .await
        .unwrap_err();
    // The engine answers the HTTP/2 preface with a TLS alert and closes with the rest of
    // kvbridge's bytes unread (so the kernel resets the connection). Whether kvbridge reads the
    // alert first (its HTTP/2 codec takes the alert's bytes as a frame header too large to be
    // one: a connection error) or meets the reset first, the engine is unusable: UNAVAILABLE, as
    // grpc-go answers in both cases. Only a stream the engine itself reset keeps the reset's
    // meaning.
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(
        st.message()
            .contains(&format!("localhost:{}", s.engine.addr.port())),
        "names the engine: {st:?}"
    );
    let stats = s.engine.stats.clone();
    wait_until("the engine to refuse a cleartext handshake", || {
        stats.tls_failed.load(Ordering::SeqCst) >= 1
    })
    .await;
    assert_eq!(stats.calls.load(Ordering::SeqCst), 0, "no call got through");
    s.bridge.stop();
}

/// A batch published on the ZMQ side reaches a new SubscribeKvEvents stream. Published until one
/// arrives, since when the new subscriber starts taking batches is not observable from outside.
async fn events_still_flow(s: &Sidecar, ch: &Channel) {
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
            return;
        }
    }
}
