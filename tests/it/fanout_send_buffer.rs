//! What a client that stops reading can make kvbridge hold: a connection whose streams advertise
//! the largest windows HTTP/2 allows and whose socket is then never read again. Each stream may
//! have at most the send buffer (128 KiB) plus one write queued in h2; the rest of what it is owed
//! waits in the ring. Measured on this test's shape (50 streams, each owed about 1.5 MiB): 9.96 MB
//! handed to h2 and the socket in all (about 199 KB a stream); with h2's default of 400 KiB per
//! stream, 25.7 MB, and the test fails.

use crate::common;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Streams on the one connection.
const STREAMS: usize = 50;
/// Records published: each stream is owed about 1.5 MiB, far more than any bound below.
const RECORDS: usize = 400;
/// What one stream may hold in h2: the send buffer, plus the write that crossed it (the fan-out
/// writes at most 64 KiB at a time, plus the record that crossed that).
const PER_STREAM: u64 = (128 + 64 + 16) << 10;
/// What the kernel may hold for the connection, on both sides, with the client's receive
/// buffer at its smallest.
const SOCKETS: u64 = 3 << 20;

/// A TCP stream whose reads stop for good once `stopped` is set (the client stops reading its
/// socket; its writes still go out).
struct StopReading {
    tcp: tokio::net::TcpStream,
    stopped: Arc<AtomicBool>,
}

impl AsyncRead for StopReading {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.stopped.load(Ordering::Relaxed) {
            return Poll::Pending;
        }
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for StopReading {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_holds_at_most_the_send_buffer_per_stream() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let args = e.args();
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);

    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let tcp = sock.connect(bridge.grpc).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let stopped = Arc::new(AtomicBool::new(false));
    let io = StopReading {
        tcp,
        stopped: stopped.clone(),
    };
    let max_window = (1u32 << 31) - 1;
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(max_window)
        .initial_connection_window_size(max_window)
        .handshake::<_, bytes::Bytes>(io)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let mut bodies = Vec::new();
    for _ in 0..STREAMS {
        bodies.push(raw_h2::subscribe(&mut client, bridge.grpc, 0).await);
    }
    stopped.store(true, Ordering::Relaxed);

    e.wait_subscribed();
    for i in 0..RECORDS {
        // 64 blocks of 16 tokens: about 4 KiB a record.
        e.publish(layout(i), vec![store(i as u64 + 1, 64, None)], 0);
    }
    let sent = |p: &str| metric(p, "kvbridge_bytes_sent_total", &[]);
    // Every stream stalls: what was sent stops growing (three scrapes alike, 300 ms apart).
    let mut last = -1.0;
    let mut alike = 0;
    common::eventually("the streams stall", Duration::from_secs(60), || {
        let now = sent(&scrape(maddr));
        alike = if now == last && now > 0.0 {
            alike + 1
        } else {
            0
        };
        last = now;
        std::thread::sleep(Duration::from_millis(300));
        if alike >= 3 {
            Ok(())
        } else {
            Err(now)
        }
    });
    eprintln!("{STREAMS} streams stalled after {last} bytes");
    let bound = STREAMS as u64 * PER_STREAM + SOCKETS;
    assert!(
        (last as u64) <= bound,
        "{STREAMS} streams that stopped reading were handed {last} bytes (bound {bound})"
    );
    assert!(
        last as u64 > STREAMS as u64 * (64 << 10),
        "each stream was handed at least a write before it stalled: {last} bytes"
    );
    drop(bodies);
    bridge.stop();
}
