//! Operations: connections that never finish their handshake (HTTP/2, or TLS and then HTTP/2)
//! are closed once `--handshake-timeout-ms` has passed; a real client is not.

use crate::common;

use std::time::Duration;

use common::ops::*;
use common::*;

/// Reads (discarding what the server sends, e.g. its SETTINGS) until the server closes the
/// connection; the time that took, or `None` if it is still open after `limit`.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    limit: Duration,
) -> Option<Duration> {
    use tokio::io::AsyncReadExt;
    let t0 = tokio::time::Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(t0 + limit, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(t0.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// The HTTP/2 client preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The handshake timeout the tests below give the bridge, and the margin they allow on top.
const HANDSHAKE_MS: u64 = 300;

const MARGIN: Duration = Duration::from_secs(5);

/// A client that sends nothing, half the preface, or the preface without SETTINGS
/// is disconnected once `--handshake-timeout-ms` has passed; a real client is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_finish_the_http2_handshake_are_closed() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    args.extend([s("--handshake-timeout-ms"), HANDSHAKE_MS.to_string()]);
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    e.wait_subscribed();
    // A subscriber that completed its handshake, idle past the timeout.
    let mut sub = subscribe(&bridge.url(), 0).await.unwrap();
    let limit = Duration::from_millis(HANDSHAKE_MS) + MARGIN;
    for (what, sent) in [
        ("nothing", &b""[..]),
        ("half the preface", &PREFACE[..12]),
        ("the preface without SETTINGS", PREFACE),
    ] {
        let mut c = tokio::net::TcpStream::connect(bridge.grpc).await.unwrap();
        c.write_all(sent).await.unwrap();
        let took = closed_within(&mut c, limit).await;
        eprintln!("sent {what}: closed after {took:?}");
        assert!(took.is_some(), "sent {what}: still open after {limit:?}");
    }
    let page = scrape(maddr);
    assert_eq!(metric(&page, "kvbridge_handshake_timeouts_total", &[]), 3.0);
    let want = publish_stores(&e, 515, 2, 2);
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= want.len()).await;
    assert_eq!(
        stored_hashes(&got),
        want,
        "the real subscriber was not cut off"
    );
    drop(sub);
    bridge.stop();
}

/// With TLS: a client that never starts TLS, and one that completes TLS but never
/// sends the HTTP/2 preface, are both disconnected once the handshake timeout has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections_that_never_finish_the_handshake_are_closed() {
    use std::sync::Arc;
    use tokio_rustls::rustls;
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec![s("localhost")]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    args.extend([s("--handshake-timeout-ms"), HANDSHAKE_MS.to_string()]);
    for (f, p) in [("--tls-cert", &cert), ("--tls-key", &key)] {
        args.extend([s(f), p.display().to_string()]);
    }
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    let limit = Duration::from_millis(HANDSHAKE_MS) + MARGIN;
    let mut silent = tokio::net::TcpStream::connect(bridge.grpc).await.unwrap();
    assert!(
        closed_within(&mut silent, limit).await.is_some(),
        "a client that never started TLS is still connected after {limit:?}"
    );
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ck.cert.der().clone()).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(bridge.grpc).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    assert!(
        closed_within(&mut tls, limit).await.is_some(),
        "a TLS client that never sent the HTTP/2 preface is still connected after {limit:?}"
    );
    bridge.stop();
}
