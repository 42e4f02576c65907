//! Sidecar mode (`--engine-grpc`): the sidecar is the worker's front door. An HPACK bomb is
//! refused without memory growth or stalls; clients that never read, and uploads to an engine
//! that does not read, are held to the buffer budget.

use crate::common;
use crate::common::grpc_engine;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::proxy::*;
use common::{layout, metric, scrape, status_kib, store};
use grpc_engine::GrpcEngine;
use tonic::transport::Channel;
use tonic::Request;

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
