//! Sidecar mode (`--engine-grpc`) to an engine that serves TLS: forwarded when its certificate
//! verifies, refused when it does not, and a cleartext sidecar fails against it; events keep
//! flowing either way.

use crate::common;
use crate::common::grpc_engine;

use std::sync::atomic::Ordering;

use bytes::Bytes;
use common::proxy::*;
use common::{metric, scrape};
use grpc_engine::GrpcEngine;
use tonic::transport::Channel;
use tonic::{Code, Request};

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
                &[("method", "other"), ("code", "ok")]
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
