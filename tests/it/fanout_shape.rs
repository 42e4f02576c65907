//! How records are framed on the wire: a subscriber that is behind — here
//! resuming from the start of a full window — gets many records per HTTP/2 DATA frame (one
//! write carries many), instead of one frame per record; with `--fanout-linger`, so do live
//! records that come close together. Seen with a raw HTTP/2 client, which receives DATA frames
//! one by one.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use kvbridge::proto::common::SubscribeKvEventsRequest;
use prost::Message;

const RECORDS: usize = 300;

/// The trailers, if they have arrived (the status of a stream that ended).
fn trailers_of(body: &mut h2::RecvStream) -> Option<http::HeaderMap> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    match body.poll_trailers(&mut cx) {
        std::task::Poll::Ready(Ok(t)) => t,
        _ => None,
    }
}

/// Whole gRPC messages at the start of `b`.
fn count_messages(b: &[u8]) -> usize {
    let (mut n, mut at) = (0, 0);
    while at + 5 <= b.len() {
        let len = u32::from_be_bytes(b[at + 1..at + 5].try_into().unwrap()) as usize;
        if at + 5 + len > b.len() {
            break;
        }
        at += 5 + len;
        n += 1;
    }
    n
}

/// A simulated engine and a bridge fed by it, with `extra` flags.
fn engine_and_bridge(extra: &[&str]) -> (tempfile::TempDir, Engine, Bridge) {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let mut args = vec![
        "--zmq".to_string(),
        e.endpoint.clone(),
        "--replay".into(),
        e.replay.clone(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    (dir, e, bridge)
}

/// Reads DATA frames until at least `n` whole gRPC messages came: (frames, messages).
async fn read_messages(body: &mut h2::RecvStream, n: usize) -> (usize, usize) {
    let (mut frames, mut bytes) = (0usize, Vec::new());
    while count_messages(&bytes) < n {
        let chunk = tokio::time::timeout(Duration::from_secs(30), body.data())
            .await
            .unwrap_or_else(|_| panic!("timed out: {} of {n} messages", count_messages(&bytes)))
            .unwrap_or_else(|| panic!("stream ended: {:?}", trailers_of(body)))
            .unwrap();
        body.flow_control().release_capacity(chunk.len()).unwrap();
        frames += 1;
        bytes.extend_from_slice(&chunk);
    }
    (frames, count_messages(&bytes))
}

/// `SubscribeKvEvents` from 0 over a raw HTTP/2 client, which sees DATA frames one by one: the
/// response body, once the headers have come (the subscription is open).
async fn raw_subscribe(grpc: std::net::SocketAddr) -> h2::RecvStream {
    let tcp = tokio::net::TcpStream::connect(grpc).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(4 << 20)
        .initial_connection_window_size(4 << 20)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let path = kvbridge::proto::ENGINE_SERVICES[0].path;
    let req = http::Request::post(format!("http://{grpc}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut send) = client.send_request(req, false).unwrap();
    let msg = SubscribeKvEventsRequest {
        start_sequence_number: 0,
        load_records_before_first_batch: false,
    }
    .encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend((msg.len() as u32).to_be_bytes());
    framed.extend(msg);
    send.send_data(framed.into(), true).unwrap();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body()
}

/// With `--fanout-linger`, a live record waits for the ones that follow it within the linger,
/// and they go out as one DATA frame (one write) instead of one each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_linger_live_records_that_come_together_go_out_together() {
    const BURST: usize = 6;
    // The longest linger accepted: the burst below comes within it even on a busy machine.
    let (_dir, e, bridge) = engine_and_bridge(&["--fanout-linger", "1s"]);
    // Subscribed (headers received) before anything is published: every record is live.
    let mut body = raw_subscribe(bridge.grpc).await;
    for i in 0..BURST {
        e.publish(layout(i), vec![store(i as u64 + 1, 1, None)], 0);
    }
    let (frames, records) = read_messages(&mut body, BURST).await;
    assert_eq!(records, BURST);
    assert!(
        frames < BURST,
        "{BURST} records published together came in {frames} DATA frames: none waited"
    );
    bridge.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_is_behind_gets_many_records_per_data_frame() {
    let (_dir, e, bridge) = engine_and_bridge(&[]);
    // Fill the window: a live subscriber tells when every record is in the ring.
    let mut live = subscribe(&bridge.url(), 0).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = 0;
    let mut sent = 0;
    while got < RECORDS {
        assert!(Instant::now() < deadline, "only {got} records arrived");
        if sent < RECORDS + 50 {
            e.publish(layout(sent), vec![store(sent as u64 + 1, 1, None)], 0);
            sent += 1;
        }
        if let Ok(Ok(Some(_))) =
            tokio::time::timeout(Duration::from_millis(5), live.message()).await
        {
            got += 1;
        }
    }

    // A fresh subscriber (start 0) starts at the oldest retained record: the whole window is
    // behind it. Over raw HTTP/2 and count DATA frames and gRPC messages.
    let mut body = raw_subscribe(bridge.grpc).await;
    let (frames, records) = read_messages(&mut body, RECORDS).await;
    // Every record was ready when the stream started: they go out back to back, as many per
    // frame as fit. One record per frame would be `records` frames.
    assert!(
        frames * 8 <= records,
        "{records} records came in {frames} DATA frames: not coalesced"
    );
    drop(live);
    bridge.stop();
}
