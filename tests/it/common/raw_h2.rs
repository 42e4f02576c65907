//! A raw HTTP/2 client for `SubscribeKvEvents` (the `h2` crate): it sees DATA frames one by one
//! and sets its own flow-control windows, which tonic's client hides.

use std::time::Duration;

use kvbridge::proto::common::{KvEventBatch, SubscribeKvEventsRequest};
use prost::Message;

/// One HTTP/2 connection to `grpc`, with `stream_window` per stream and `conn_window` for the
/// connection; the connection is driven by a task of its own.
pub async fn connect(
    grpc: std::net::SocketAddr,
    stream_window: u32,
    conn_window: u32,
) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(grpc).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(stream_window)
        .initial_connection_window_size(conn_window)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.ready().await.unwrap()
}

/// `SubscribeKvEvents` from `start` on `client`'s connection: the response body, once the
/// headers have come (the subscription is open).
pub async fn subscribe(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    grpc: std::net::SocketAddr,
    start: u64,
) -> h2::RecvStream {
    let path = kvbridge::proto::ENGINE_SERVICES[0].path;
    let req = http::Request::post(format!("http://{grpc}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut send) = client.send_request(req, false).unwrap();
    let msg = SubscribeKvEventsRequest {
        start_sequence_number: start,
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

/// The whole gRPC messages at the start of `b`, decoded.
pub fn batches(b: &[u8]) -> Vec<KvEventBatch> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 5 <= b.len() {
        let len = u32::from_be_bytes(b[at + 1..at + 5].try_into().unwrap()) as usize;
        if at + 5 + len > b.len() {
            break;
        }
        out.push(KvEventBatch::decode(&b[at + 5..at + 5 + len]).unwrap());
        at += 5 + len;
    }
    out
}

/// The trailers, if they have arrived (the status of a stream that ended).
pub fn trailers_of(body: &mut h2::RecvStream) -> Option<http::HeaderMap> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    match body.poll_trailers(&mut cx) {
        std::task::Poll::Ready(Ok(t)) => t,
        _ => None,
    }
}

/// Whole gRPC messages at the start of `b`.
pub fn count_messages(b: &[u8]) -> usize {
    batches(b).len()
}

/// What has arrived on `body` so far, without waiting and without giving flow-control
/// capacity back (the bytes stay counted against the stream's window).
pub fn arrived(body: &mut h2::RecvStream) -> Vec<u8> {
    use futures_util::FutureExt;
    let mut bytes = Vec::new();
    while let Some(Some(chunk)) = body.data().now_or_never() {
        bytes.extend_from_slice(&chunk.unwrap());
    }
    bytes
}

/// Reads DATA frames until at least `n` whole gRPC messages came: (frames, messages).
pub async fn read_messages(body: &mut h2::RecvStream, n: usize) -> (usize, usize) {
    let (frames, bytes) = read_after(body, Vec::new(), n).await;
    (frames, count_messages(&bytes))
}

/// Reads DATA frames, giving their capacity back, until `bytes` and what came hold at least
/// `n` whole gRPC messages: (frames read, all the bytes).
pub async fn read_after(
    body: &mut h2::RecvStream,
    mut bytes: Vec<u8>,
    n: usize,
) -> (usize, Vec<u8>) {
    let mut frames = 0usize;
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
    (frames, bytes)
}
