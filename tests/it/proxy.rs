//! Sidecar mode (`--engine-grpc`): the real `kvbridge` binary in front of a test
//! engine gRPC server (`common/grpc_engine.rs`), checked for forwarding fidelity (docs/smg-api.md
//! §2 "Proxy mode"), failure handling, health and load records (§3.5).

use crate::common;
use crate::common::grpc_engine;

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
    tokio::task::spawn_blocking(move || {
        common::wait_metrics(metrics, T, |p| {
            common::metric(p, "kvbridge_subscribers", &[]) >= 1.0
        })
    })
    .await
    .unwrap();
    zmq.publish(layout(0), vec![store(1, 2, None)], 0);
    let b = tokio::time::timeout(T, sub.message())
        .await
        .expect("a batch in time")
        .expect("stream ok")
        .expect("a batch");
    assert!(!b.events.is_empty());

    // While the probe finds the engine down calls fail at once; once it finds it back (health
    // SERVING), calls go through again.
    let engine = GrpcEngine::start_with(addr, stats).await;
    wait_health(&ch, Serving).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"back")))
        .await
        .expect("the next call once the engine is back succeeds");
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
    live_subscription(s, ch).await;
}

/// A new SubscribeKvEvents stream that has received a batch (published until one arrived):
/// every batch published from now on reaches it.
async fn live_subscription(
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
async fn expect_batches(
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
    common::assert_contiguous(&got);
}

// ---- Faults and hostile clients: the sidecar is the worker's front door ----

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// What a [`Relay`] does with its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RelayMode {
    /// Bytes flow both ways.
    Pass,
    /// Connections stay open, no byte moves (a SIGSTOPped engine, seen from the network).
    Frozen,
    /// Every connection is closed and nothing new is accepted: the listener's backlog (0) fills
    /// and further SYNs are dropped, as by a port that drops SYNs.
    Dead,
}

/// A TCP relay in front of the test engine, whose behaviour the test switches.
struct Relay {
    addr: SocketAddr,
    mode: tokio::sync::watch::Sender<RelayMode>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(to: SocketAddr) -> Relay {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = sock.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, rx) = tokio::sync::watch::channel(RelayMode::Pass);
        let task = tokio::spawn(async move {
            let mut accepting = rx.clone();
            loop {
                if accepting.wait_for(|m| *m != RelayMode::Dead).await.is_err() {
                    return;
                }
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = accepting.wait_for(|m| *m == RelayMode::Dead) => continue,
                };
                let Ok((client, _)) = accepted else { continue };
                let Ok(engine) = tokio::net::TcpStream::connect(to).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), engine.set_nodelay(true));
                let (cr, cw) = client.into_split();
                let (er, ew) = engine.into_split();
                tokio::spawn(Self::pump(cr, ew, rx.clone()));
                tokio::spawn(Self::pump(er, cw, rx.clone()));
            }
        });
        Relay { addr, mode, task }
    }

    /// Copies `from` to `to` while the mode is `Pass`, holds while `Frozen`, ends when `Dead`.
    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut mode: tokio::sync::watch::Receiver<RelayMode>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match mode.wait_for(|m| *m != RelayMode::Frozen).await.map(|m| *m) {
                Ok(RelayMode::Pass) => {}
                _ => return,
            }
            let n = tokio::select! {
                r = from.read(&mut buf) => match r {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
                _ = mode.changed() => continue,
            };
            if !matches!(
                mode.wait_for(|m| *m != RelayMode::Frozen).await.map(|m| *m),
                Ok(RelayMode::Pass)
            ) {
                return;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    fn set(&self, mode: RelayMode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A sidecar whose `--engine-grpc` is a [`Relay`] in front of the test engine.
async fn relayed_sidecar() -> (Sidecar, Relay) {
    let engine = GrpcEngine::start("127.0.0.1:0".parse().unwrap()).await;
    let relay = Relay::start(engine.addr).await;
    let target = relay.addr.to_string();
    let s = sidecar_with(tempfile::tempdir().unwrap(), engine, &target, &[]).await;
    (s, relay)
}

/// `n` concurrent `Echo` calls without a deadline; the time each took to end, and its status.
async fn calls_without_deadline(ch: &Channel, n: usize) -> Vec<(Duration, Result<(), Code>)> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let ch = ch.clone();
        tasks.spawn(async move {
            let t = Instant::now();
            let r = unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"x"))).await;
            (t.elapsed(), r.map(|_| ()).map_err(|s| s.code()))
        });
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.push(r.unwrap());
    }
    out.sort_by_key(|(d, _)| *d);
    out
}

/// How long a call may take to fail when the engine cannot answer: the 1 s connect / SETTINGS
/// bound, the probe's 0.5 s period and its 1 s timeout, and room for a busy 2-core machine.
/// Before the fix these calls ended after 37–40 s (the engine connection's keepalive).
const FAIL_FAST: Duration = Duration::from_secs(6);

/// An engine that accepts TCP but never speaks HTTP/2: calls without a deadline end
/// `UNAVAILABLE` within about a second (the connection is used only once the engine's
/// SETTINGS arrive), naming the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_never_speaks_http2_fails_calls_fast() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = silent.local_addr().unwrap().to_string();
    // Its backlog completes TCP handshakes; nothing is ever accepted or sent.
    let engine = GrpcEngine::start("127.0.0.1:0".parse().unwrap()).await;
    let s = sidecar_with(tempfile::tempdir().unwrap(), engine, &target, &[]).await;
    let ch = channel(&s.bridge.url()).await;
    let ended = calls_without_deadline(&ch, 20).await;
    for (took, r) in &ended {
        assert_eq!(*r, Err(Code::Unavailable), "{ended:?}");
        assert!(*took < FAIL_FAST, "a call took {took:?}: {ended:?}");
    }
    let st = unary(&ch, VLLM, "Echo", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    // Why: the engine connection's missing SETTINGS, or — when the health probe (also 1 s)
    // has found the engine down first — the probe's reason; both name the engine.
    let why = st.message().contains("SETTINGS") || st.message().contains("did not answer");
    assert!(
        st.message().contains(&target) && why,
        "names the engine and why: {st:?}"
    );
    drop(silent);
    s.bridge.stop();
}

/// An engine that stops answering (SIGSTOP, seen from the network: connections open, no byte
/// moves) with a call waiting for its headers and more arriving: every call ends `UNAVAILABLE`
/// within about a second of the probe finding it down, not after the keepalive; health goes
/// NOT_SERVING; when the engine answers again, so does kvbridge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_engine_fails_waiting_and_new_calls_fast() {
    use tonic_health::ServingStatus::{NotServing, Serving};
    let (s, relay) = relayed_sidecar().await;
    let ch = channel(&s.bridge.url()).await;
    wait_health(&ch, Serving).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"up")))
        .await
        .expect("engine up");
    relay.set(RelayMode::Frozen);
    let ended = calls_without_deadline(&ch, 20).await;
    for (took, r) in &ended {
        assert_eq!(*r, Err(Code::Unavailable), "{ended:?}");
        assert!(*took < FAIL_FAST, "a call took {took:?}: {ended:?}");
    }
    wait_health(&ch, NotServing).await;
    let t = Instant::now();
    let st = unary(&ch, VLLM, "Echo", Request::new(Bytes::new()))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    assert!(
        st.message().contains(&relay.addr.to_string()),
        "names the engine: {st:?}"
    );
    assert!(t.elapsed() < FAIL_FAST, "while down: {:?}", t.elapsed());
    relay.set(RelayMode::Pass);
    wait_health(&ch, Serving).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"back")))
        .await
        .expect("the engine answers again");
    s.bridge.stop();
}

/// The engine's port starts dropping SYNs under 100 concurrent calls: they share one connect
/// per pool slot (each bounded by 1 s) instead of queueing one connect after another behind
/// the slot (before the fix: p50 13.5 s, max 25.5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_share_a_slots_connect_when_the_engine_drops_syns() {
    let (s, relay) = relayed_sidecar().await;
    let ch = channel(&s.bridge.url()).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"up")))
        .await
        .expect("engine up");
    relay.set(RelayMode::Dead);
    // Fill the relay's backlog (0: one connection; one more if the relay's accept raced the
    // switch), until a connect gets no answer: the port drops SYNs now.
    let mut queued = Vec::new();
    loop {
        assert!(queued.len() < 10, "the relay's port should drop SYNs now");
        let connect = tokio::net::TcpStream::connect(relay.addr);
        match tokio::time::timeout(Duration::from_millis(300), connect).await {
            Ok(sock) => queued.push(sock.unwrap()),
            Err(_) => break,
        }
    }
    let ended = calls_without_deadline(&ch, 100).await;
    let p50 = ended[ended.len() / 2].0;
    let max = ended.last().unwrap().0;
    for (_, r) in &ended {
        assert_eq!(*r, Err(Code::Unavailable), "{ended:?}");
    }
    assert!(max < FAIL_FAST, "p50 {p50:?}, max {max:?}");
    s.bridge.stop();
}

/// One HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(9 + payload.len());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK integer with an `n`-bit prefix under `first` (RFC 7541 §5.1).
fn hpack_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// An HPACK string literal, not Huffman-coded.
fn hpack_str(out: &mut Vec<u8>, s: &[u8]) {
    hpack_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// The HPACK bomb on one raw connection: the first stream adds a 4,000-byte header
/// to the dynamic table, each of the next `streams` references it `refs` times (a header block
/// of a few hundred bytes). Returns the bytes written; the connection is read until kvbridge
/// closes it (or 10 s pass).
async fn hpack_bomb(addr: SocketAddr, streams: u32, refs: usize) -> usize {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request_head = |out: &mut Vec<u8>| {
        out.extend_from_slice(&[0x83, 0x86]); // :method POST, :scheme http
        hpack_int(out, 0, 4, 4); // :path, literal without indexing
        hpack_str(out, format!("/{VLLM}/Echo").as_bytes());
        hpack_int(out, 0, 4, 1); // :authority
        hpack_str(out, b"kvbridge");
        hpack_int(out, 0, 4, 31); // content-type
        hpack_str(out, b"application/grpc");
        out.push(0);
        hpack_str(out, b"te");
        hpack_str(out, b"trailers");
    };
    let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    wire.extend(h2_frame(0x4, 0, 0, &[]));
    wire.extend(h2_frame(0x4, 0x1, 0, &[])); // ACK of kvbridge's SETTINGS
    let mut first = Vec::new();
    request_head(&mut first);
    first.push(0x40); // literal with incremental indexing, new name
    hpack_str(&mut first, b"x-bomb");
    hpack_str(&mut first, &[b'a'; 4000]);
    wire.extend(h2_frame(0x1, 0x5, 1, &first));
    let mut bomb = Vec::new();
    request_head(&mut bomb);
    bomb.extend(std::iter::repeat_n(0xbe, refs)); // dynamic table entry 62: x-bomb
    for i in 0..streams {
        wire.extend(h2_frame(0x1, 0x5, 3 + 2 * i, &bomb));
    }
    let (mut r, mut w) = sock.split();
    let reader = async {
        let mut buf = vec![0u8; 64 << 10];
        while matches!(r.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    let writer = async {
        let _ = w.write_all(&wire).await;
    };
    let _ = tokio::time::timeout(
        Duration::from_secs(10),
        futures_util::future::join(reader, writer),
    )
    .await;
    wire.len()
}

/// Health checks through kvbridge in a loop until `stop`; the slowest one.
async fn slowest_health_check(ch: Channel, stop: tokio::sync::watch::Receiver<bool>) -> Duration {
    let mut worst = Duration::ZERO;
    while !*stop.borrow() {
        let t = Instant::now();
        let h = tokio::time::timeout(T, health(&ch)).await;
        assert!(h.is_ok(), "a health check did not answer");
        worst = worst.max(t.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worst
}

/// The engine sends GOAWAY on its connections while a call is open on one of them (it shuts
/// down gracefully, or an h2 or grpcio server judged another client's burst of reset streams
/// abuse: "too_many_resets"). That connection lives on for its open call, but opens no stream:
/// it leaves its pool slot at the first call that finds so, and that call goes to a fresh
/// connection, so every call succeeds. Before, the slot kept handing out the draining
/// connection and every call routed to it failed UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_goaway_fails_no_later_call() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    wait_health(&ch, tonic_health::ServingStatus::Serving).await;
    let stats = s.engine.stats.clone();
    // One call held open on each of the pool's connections.
    let mut open = Vec::new();
    for i in 0..8u64 {
        open.push(open_stream(&ch, "Hang", b"first").await);
        let want = i + 1;
        common::eventually("the engine to hold the calls", T, || {
            match stats.calls.load(Ordering::SeqCst) {
                n if n >= want => Ok(()),
                n => Err(n),
            }
        });
    }
    stats.drain.notify_waiters();
    // Round-robin over the pool's slots: 5 calls per slot, every one of them answered.
    for i in 0..20 {
        unary(
            &ch,
            VLLM,
            "Echo",
            Request::new(Bytes::from_static(b"after")),
        )
        .await
        .unwrap_or_else(|e| panic!("call {i} after the GOAWAY: {e:?}"));
    }
    drop(open);
    s.bridge.stop();
}

/// The HPACK bomb: 1,000 streams of a few hundred bytes, each decoding to 1 MB of
/// headers. kvbridge accepts no larger header list than the engine (16 KiB here), so the
/// connection is closed at the first: resident memory stays bounded (before: 17 → 765 MiB),
/// health checks and a subscriber are unaffected, and a legitimate call works afterwards.
/// Then the same under the limit (3 references, 12 KB per stream): the header bytes the engine
/// gets stay within 16 × what the client sent (+ 64 KiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hpack_bomb_is_refused_without_memory_growth_or_stalls() {
    let s = sidecar(&[]).await;
    let ch = channel(&s.bridge.url()).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"warm")))
        .await
        .expect("engine up");
    let mut sub = live_subscription(&s, &ch).await;
    let pid = s.bridge.child.id();
    let peak_before = status_kib(pid, "VmHWM");

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let checks = tokio::spawn(slowest_health_check(ch.clone(), stopped));
    let addr = s.bridge.grpc;
    s.zmq.publish(layout(0), vec![store(900_001, 1, None)], 0);
    let sent = hpack_bomb(addr, 1000, 255).await;
    s.zmq.publish(layout(0), vec![store(900_002, 1, None)], 0);
    let before = s.engine.stats.header_bytes.load(Ordering::SeqCst);
    let sent_small = hpack_bomb(addr, 1000, 3).await;
    let to_engine = s.engine.stats.header_bytes.load(Ordering::SeqCst) - before;
    stop.send_replace(true);
    let worst = checks.await.unwrap();

    let grew = status_kib(pid, "VmHWM").saturating_sub(peak_before);
    assert!(
        grew < 64 << 10,
        "peak resident memory grew by {grew} KiB ({sent} bytes sent)"
    );
    assert!(
        to_engine <= 16 * sent_small as u64 + (64 << 10) + (16 << 10),
        "{to_engine} header bytes reached the engine from {sent_small} bytes sent"
    );
    // "Unaffected": a generous bound (the issue saw health checks time out for ~6 s).
    assert!(
        worst < Duration::from_secs(2),
        "slowest health check {worst:?}"
    );
    // The subscriber got both batches, in order, nothing lost.
    expect_batches(&mut sub, 2).await;
    unary(
        &ch,
        VLLM,
        "Echo",
        Request::new(Bytes::from_static(b"after")),
    )
    .await
    .expect("a legitimate call after the attack");
    s.bridge.stop();
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

// ---- The buffer budgets: what clients that never read can make kvbridge hold ----

/// The budgets both "never reads" tests run with: 16 MiB per client connection (2 MiB of it
/// the connection's request window, the rest 112 stream shares of 128 KiB), 40 MiB in all; a
/// stalled stream is reset after 1 s while another waits for a share.
const BUDGET_FLAGS: [&str; 6] = [
    "--sidecar-connection-buffer",
    "16MiB",
    "--sidecar-buffer",
    "40MiB",
    "--sidecar-stall-timeout-ms",
    "1000",
];
const BUDGET_KIB: u64 = 40 << 10;
/// Streams the budget lets through at once with [`HOSTILE`] connections (and the test's own
/// channel) open: 40 MiB less four 2 MiB windows, in 128 KiB shares.
const ADMITTED: u64 = (40 - 4 * 2) * 8;
/// Hostile connections per test.
const HOSTILE: usize = 3;

/// A raw HTTP/2 client connection to kvbridge with h2's default settings (64 KiB windows), its
/// connection driven in the background, its calls' responses never read; closed when dropped.
struct RawConn {
    send: h2::client::SendRequest<Bytes>,
    task: tokio::task::JoinHandle<()>,
    calls: Vec<(h2::client::ResponseFuture, h2::SendStream<Bytes>)>,
}

impl Drop for RawConn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawConn {
    async fn open(addr: SocketAddr) -> RawConn {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        RawConn {
            send,
            task,
            calls: Vec::new(),
        }
    }

    /// Starts `method` with `body` as its request (sent as fast as kvbridge takes it) and
    /// `grpc-timeout: 60S`; the response is never read.
    async fn call(&mut self, method: &str, body: Bytes) {
        let req = http::Request::post(format!("http://kvbridge/{VLLM}/{method}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("grpc-timeout", "60S")
            .body(())
            .unwrap();
        let mut send = self.send.clone().ready().await.expect("stream slot");
        let (resp, mut stream) = send.send_request(req, false).expect("request sent");
        stream.send_data(body, true).expect("request body queued");
        self.calls.push((resp, stream));
    }
}

/// `open` starts the hostile connections' calls; then, while they stay open: health checks
/// through kvbridge all answer within 2 s, a subscriber gets the batches published around the
/// attack, contiguous, and a legitimate forwarded call completes (once stalled streams are
/// reset for it). Peak resident memory grows by less than the budget plus 24 MiB. After the
/// clients leave, every byte of the budget they took is returned and resident memory falls back
/// to within [`RSS_SLACK_KIB`] of the baseline. Returns the peak growth and the resident memory
/// after the clients left, over the baseline, in KiB.
async fn hostile_clients_are_held_to_the_budget<F>(
    s: &Sidecar,
    open: impl FnOnce(SocketAddr) -> F,
    started: impl Fn() -> u64,
) -> (u64, i64)
where
    F: std::future::Future<Output = Vec<RawConn>>,
{
    let reserved = || {
        metric(
            &scrape(s.metrics),
            "kvbridge_proxy_buffer_reserved_bytes",
            &[],
        )
    };
    let ch = channel(&s.bridge.url()).await;
    unary(&ch, VLLM, "Echo", Request::new(Bytes::from_static(b"warm")))
        .await
        .expect("engine up");
    let mut sub = live_subscription(s, &ch).await;
    let pid = s.bridge.child.id();
    let (rss_before, peak_before, reserved_before) = (
        status_kib(pid, "VmRSS"),
        status_kib(pid, "VmHWM"),
        reserved(),
    );

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let checks = tokio::spawn(slowest_health_check(ch.clone(), stopped));
    s.zmq.publish(layout(0), vec![store(910_001, 1, None)], 0);
    let conns = open(s.bridge.grpc).await;
    wait_until("the budget's worth of calls reaching the engine", || {
        started() >= ADMITTED
    })
    .await;
    // The peers fill whatever kvbridge lets them: wait until the peak stops growing (or is
    // past the bound already).
    let bound = BUDGET_KIB + (24 << 10);
    let deadline = Instant::now() + T;
    let (mut last, mut unchanged) = (0, 0);
    while unchanged < 3 && last < peak_before + bound && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let peak = status_kib(pid, "VmHWM");
        unchanged = if peak == last { unchanged + 1 } else { 0 };
        last = peak;
    }
    let grew = status_kib(pid, "VmHWM").saturating_sub(peak_before);
    assert!(
        grew < bound,
        "peak resident memory grew by {grew} KiB with a {BUDGET_KIB} KiB budget"
    );
    tokio::time::timeout(T, generate_and_check(&ch, 20, 200))
        .await
        .expect("a legitimate call during the attack completes");
    s.zmq.publish(layout(0), vec![store(910_002, 1, None)], 0);
    stop.send_replace(true);
    let worst = checks.await.unwrap();
    eprintln!("slowest health check through kvbridge during the attack: {worst:?}");
    assert!(
        worst < Duration::from_secs(2),
        "slowest health check {worst:?}"
    );
    expect_batches(&mut sub, 2).await;
    let page = scrape(s.metrics);
    assert!(
        metric(
            &page,
            "kvbridge_proxy_buffer_events_total",
            &[("event", "stall_reset")]
        ) >= 1.0,
        "stalled streams were reset for the waiting call"
    );

    drop(conns);
    wait_until("the hostile connections' budget returned", || {
        reserved() == reserved_before
    })
    .await;
    // The memory goes back to the system (kvbridge trims the heap when such a connection
    // closes; glibc would keep it otherwise).
    let after = || status_kib(pid, "VmRSS") as i64 - rss_before as i64;
    wait_until("resident memory back near the baseline", || {
        after() < RSS_SLACK_KIB
    })
    .await;
    (grew, after())
}

/// How far above its resident memory before an attack kvbridge may stay after it.
const RSS_SLACK_KIB: i64 = 12 << 10;

/// Clients that never read their responses (before the budgets, 1.15 MiB held per stream; 400
/// streams on one connection → 477 MiB, kept after the client left): three connections of 400
/// `Generate` streams of 1.25 MiB each, with h2's default 64 KiB windows, never read. kvbridge
/// holds at most the budget (40 MiB here) while health checks, a subscriber and a legitimate
/// call go on; after they leave, every reserved byte is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_are_held_to_the_buffer_budget() {
    let s = sidecar(&BUDGET_FLAGS).await;
    let request = grpc_engine::frame(&generate_request(40, 32 << 10));
    let stats = s.engine.stats.clone();
    let (grew, after) = hostile_clients_are_held_to_the_budget(
        &s,
        |addr| async move {
            let mut conns = Vec::new();
            for _ in 0..HOSTILE {
                let mut c = RawConn::open(addr).await;
                for _ in 0..400 {
                    c.call("Generate", request.clone()).await;
                }
                conns.push(c);
            }
            conns
        },
        || stats.generates.load(Ordering::Relaxed),
    )
    .await;
    eprintln!("never-reading clients: peak RSS +{grew} KiB, after they left {after:+} KiB");
    s.bridge.stop();
}

/// Clients uploading to an engine that does not read (`Slow` never reads its request; the
/// engine's stream window is 64 KiB): three connections of 200 calls each sending a 2 MiB
/// message. Before, a connection could make kvbridge hold its whole 64 MiB window plus a chunk
/// per stream on each side; now the same bounds as for responses hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_to_an_engine_that_does_not_read_are_held_to_the_buffer_budget() {
    let engine = GrpcEngine::start("127.0.0.1:0".parse().unwrap()).await;
    engine.stats.stream_window.store(64 << 10, Ordering::SeqCst);
    let target = engine.addr.to_string();
    let s = sidecar_with(tempfile::tempdir().unwrap(), engine, &target, &BUDGET_FLAGS).await;
    let upload = grpc_engine::frame(&vec![7u8; 2 << 20]);
    let stats = s.engine.stats.clone();
    let (grew, after) = hostile_clients_are_held_to_the_budget(
        &s,
        |addr| async move {
            let mut conns = Vec::new();
            for _ in 0..HOSTILE {
                let mut c = RawConn::open(addr).await;
                for _ in 0..200 {
                    c.call("Slow", upload.clone()).await;
                }
                conns.push(c);
            }
            conns
        },
        || stats.slows.load(Ordering::Relaxed),
    )
    .await;
    eprintln!("uploads to an engine that does not read: peak RSS +{grew} KiB, after they left {after:+} KiB");
    s.bridge.stop();
}
