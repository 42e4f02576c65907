//! Operations: TLS and the bearer token, accepted and rejected, for tonic clients and the
//! `subscribe` command.

use crate::common;

use common::ops::*;
use common::*;
use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_bearer_token_accept_and_reject() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec![s("localhost")]).unwrap();
    let (cert_pem, key_pem) = (ck.cert.pem(), ck.signing_key.serialize_pem());
    let (cert, key, tok) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("token"),
    );
    std::fs::write(&cert, &cert_pem).unwrap();
    std::fs::write(&key, &key_pem).unwrap();
    std::fs::write(&tok, "s3cret-token\n").unwrap();
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    for (f, p) in [
        ("--tls-cert", &cert),
        ("--tls-key", &key),
        ("--auth-token-file", &tok),
    ] {
        args.extend([s(f), p.display().to_string()]);
    }
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    e.wait_subscribed();
    let url = format!("https://localhost:{}", bridge.grpc.port());
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&cert_pem))
        .domain_name("localhost");
    let ch = Endpoint::from_shared(url)
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("TLS connect");
    let call = |token: Option<&'static str>| {
        let ch = ch.clone();
        async move {
            let mut r = tonic::Request::new(req(0));
            if let Some(t) = token {
                r.metadata_mut().insert("authorization", t.parse().unwrap());
            }
            VllmEngineClient::new(ch).subscribe_kv_events(r).await
        }
    };
    let no = call(None).await.unwrap_err();
    assert_eq!(no.code(), tonic::Code::Unauthenticated, "{no:?}");
    let wrong = call(Some("Bearer s3cret-tokeX")).await.unwrap_err();
    assert_eq!(wrong.code(), tonic::Code::Unauthenticated, "{wrong:?}");
    let basic = call(Some("Basic s3cret-token")).await.unwrap_err();
    assert_eq!(basic.code(), tonic::Code::Unauthenticated);
    let mut sub = call(Some("Bearer s3cret-token"))
        .await
        .unwrap()
        .into_inner();
    let want = publish_stores(&e, 5, 3, 2);
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= want.len()).await;
    assert_eq!(stored_hashes(&got), want);
    // Health stays open without a token (documented).
    {
        use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
        let st = HealthClient::new(ch.clone())
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(st, tonic_health::ServingStatus::Serving as i32);
    }
    // Plaintext against the TLS port fails.
    let plain = tonic::transport::Endpoint::from_shared(bridge.url())
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        let r = VllmEngineClient::new(ch).subscribe_kv_events(req(0)).await;
        assert!(r.is_err(), "plaintext call succeeded against a TLS server");
    }
    assert_eq!(
        metric(&scrape(maddr), "kvbridge_auth_failures_total", &[]),
        3.0
    );
    // The `subscribe` command speaks TLS and sends the token too.
    let cli = |with_token: bool| {
        let mut c = std::process::Command::new(bin());
        c.args([
            "subscribe",
            "--grpc",
            &format!("localhost:{}", bridge.grpc.port()),
            "--count",
            "3",
        ])
        .arg("--tls-ca")
        .arg(&cert)
        .env_remove("KVBRIDGE_AUTH_TOKEN");
        if with_token {
            c.arg("--auth-token-file").arg(&tok);
        }
        c.output().unwrap()
    };
    let ok = cli(true);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&ok.stdout).lines().count(), 3);
    let denied = cli(false);
    assert_eq!(denied.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&denied.stderr).contains("Unauthenticated"));
    drop(sub);
    bridge.stop();
}
