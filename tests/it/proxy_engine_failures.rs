//! Sidecar mode (`--engine-grpc`): engine failures. An engine that is down, stopped, never speaks
//! HTTP/2, drops SYNs or sends GOAWAY fails calls fast (within a bound, without deadlines), health
//! follows, and events keep flowing; the engine back, calls succeed again.

use crate::common;
use crate::common::grpc_engine;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::proxy::*;
use common::{layout, metric, scrape, store};
use grpc_engine::GrpcEngine;
use kvbridge::proto::common::SubscribeKvEventsRequest;
use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;
use tonic::transport::Channel;
use tonic::{Code, Request};

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
            &[("method", "other"), ("code", "unavailable")]
        ) >= 2.0
    );
    drop(engine);
    bridge.stop();
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
