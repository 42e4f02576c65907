//! A `SubscribeKvEvents` request that is not a gRPC call is refused with the HTTP status gRPC's
//! HTTP/2 protocol asks for, before any subscription is opened: `405` for a method other than
//! `POST`, `415` for a content type that does not begin with `application/grpc`. A gRPC call
//! with a subtype (`application/grpc+proto`) is served.

use crate::common;

use common::*;

/// The response status to a request with `method` and `content_type` on the vLLM path.
async fn status_of(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    grpc: std::net::SocketAddr,
    method: &str,
    content_type: Option<&str>,
) -> u16 {
    let path = kvbridge::proto::ENGINE_SERVICES[0].path;
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{grpc}{path}"))
        .header("te", "trailers");
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    let (resp, mut send) = client.send_request(req.body(()).unwrap(), false).unwrap();
    // An empty SubscribeKvEventsRequest (start at 0). A refused request may already be over
    // (its response sent, the stream reset with NO_ERROR) when this goes: that is no failure.
    let _ = send.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true);
    resp.await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_is_not_a_grpc_call_is_refused_with_its_http_status() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let args = e.args();
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    let mut client = raw_h2::connect(bridge.grpc, 1 << 20, 1 << 20).await;
    let grpc = bridge.grpc;
    assert_eq!(
        status_of(&mut client, grpc, "GET", Some("application/grpc")).await,
        405
    );
    assert_eq!(
        status_of(&mut client, grpc, "PUT", Some("application/grpc")).await,
        405
    );
    assert_eq!(
        status_of(&mut client, grpc, "POST", Some("text/plain")).await,
        415
    );
    assert_eq!(status_of(&mut client, grpc, "POST", None).await, 415);
    let page = scrape(maddr);
    assert_eq!(
        metric(&page, "kvbridge_subscribers", &[]),
        0.0,
        "no subscription was opened:\n{page}"
    );
    assert_eq!(
        status_of(&mut client, grpc, "POST", Some("application/grpc+proto")).await,
        200
    );
    bridge.stop();
}
