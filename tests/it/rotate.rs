//! Secrets rotate under a running bridge: the certificate, its key and the
//! bearer token are replaced on disk while a subscriber streams; the stream stays open, new
//! connections get the new certificate and must send the new token, and a broken file is
//! logged and ignored (the secrets in use are kept). The real binary, over real TLS.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use kvbridge::proto::common::SubscribeKvEventsRequest;
use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

const T: Duration = Duration::from_secs(20);

/// Replaces `path` the way rotation agents do: a new file renamed over the old one.
fn replace(path: &Path, contents: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn self_signed() -> (String, String) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    (ck.cert.pem(), ck.signing_key.serialize_pem())
}

/// A TLS channel to `port` that trusts only `ca` (so it connects only if the server presents it).
async fn connect(port: u16, ca: &str) -> Result<Channel, tonic::transport::Error> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    Endpoint::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
}

async fn subscribe_with(
    ch: &Channel,
    token: &str,
) -> Result<tonic::Streaming<kvbridge::proto::common::KvEventBatch>, tonic::Status> {
    let mut r = tonic::Request::new(SubscribeKvEventsRequest {
        start_sequence_number: 0,
        load_records_before_first_batch: false,
    });
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    VllmEngineClient::new(ch.clone())
        .subscribe_kv_events(r)
        .await
        .map(|r| r.into_inner())
}

/// Publishes `n` single-block stores with hashes from `seed` and returns those hashes.
fn publish(e: &Engine, seed: u64, n: usize) -> Vec<u64> {
    let mut want = Vec::new();
    for i in 0..n as u64 {
        let ev = store(seed + i, 1, None);
        if let kvbridge_tools::sim::SimEvent::Stored { hashes, .. } = &ev {
            want.extend(hashes.iter().copied());
        }
        e.publish(layout(i as usize), vec![ev], 0);
    }
    want
}

/// Polls `cond` until it holds or the deadline passes.
async fn eventually<F: std::future::Future<Output = bool>>(
    what: &str,
    mut cond: impl FnMut() -> F,
) {
    common::eventually_async(what, T, || {
        let c = cond();
        async move {
            if c.await {
                Ok(())
            } else {
                Err(())
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_and_token_rotate_under_live_subscribers() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, tok) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("token"),
    );
    let (old_cert, old_key) = self_signed();
    std::fs::write(&cert, &old_cert).unwrap();
    std::fs::write(&key, &old_key).unwrap();
    std::fs::write(&tok, "old-token\n").unwrap();
    let e = Engine::start(0);
    let mut args = vec![
        "--zmq".to_string(),
        e.endpoint.clone(),
        "--replay".into(),
        e.replay.clone(),
    ];
    for (f, p) in [
        ("--tls-cert", &cert),
        ("--tls-key", &key),
        ("--auth-token-file", &tok),
    ] {
        args.extend([f.to_string(), p.display().to_string()]);
    }
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    let port = bridge.grpc.port();

    // A live subscriber on the old certificate and token.
    let old_ch = connect(port, &old_cert)
        .await
        .expect("TLS with the old cert");
    let mut live = subscribe_with(&old_ch, "old-token")
        .await
        .expect("old token");
    // The SUB connects asynchronously: publish until the first batch arrives.
    let mut seen = Vec::new();
    let deadline = Instant::now() + T;
    for seed in 1000.. {
        assert!(Instant::now() < deadline, "no batch reached the subscriber");
        publish(&e, seed, 1);
        if let Ok(Ok(Some(b))) =
            tokio::time::timeout(Duration::from_millis(300), live.message()).await
        {
            seen.push(b);
            break;
        }
    }
    // Rotate all three while the stream is open.
    let (new_cert, new_key) = self_signed();
    replace(&cert, &new_cert);
    replace(&key, &new_key);
    replace(&tok, "new-token\n");

    // New connections are served the new certificate (a client trusting only it connects; one
    // trusting only the old one no longer does), and they need the new token.
    eventually("the new certificate is presented", || async {
        connect(port, &new_cert).await.is_ok()
    })
    .await;
    let refused = connect(port, &old_cert).await;
    assert!(
        refused.is_err(),
        "a new connection still got the old certificate"
    );
    let new_ch = connect(port, &new_cert).await.unwrap();
    eventually("the new token is accepted", || async {
        subscribe_with(&new_ch, "new-token").await.is_ok()
    })
    .await;
    let old_tok = subscribe_with(&new_ch, "old-token").await.unwrap_err();
    assert_eq!(old_tok.code(), tonic::Code::Unauthenticated, "{old_tok:?}");
    let mut fresh = subscribe_with(&new_ch, "new-token").await.unwrap();

    // The stream opened before the rotation is still open and complete (no hole), and the new
    // one gets the same records.
    let want = publish(&e, 2000, 5);
    let more = collect_until(&mut live, T, |b| stored_hashes(b).ends_with(&want)).await;
    seen.extend(more);
    assert_contiguous(&seen);
    // (A fresh subscriber starts at the oldest retained record: it replays the window first.)
    let more = collect_until(&mut fresh, T, |b| stored_hashes(b).ends_with(&want)).await;
    assert_contiguous(&more);

    // A broken certificate and an empty token file are refused (logged, on the change and on
    // SIGHUP); the secrets in use stay.
    replace(&cert, "not a certificate\n");
    replace(&tok, "\n");
    eventually("the bad certificate is reported", || async {
        bridge.log().contains("cannot reload the TLS certificate")
            && bridge.log().contains("cannot reload the bearer token")
    })
    .await;
    // SAFETY: kill(2) on our own child's pid, which has not been waited for.
    unsafe { libc::kill(bridge.child.id() as i32, libc::SIGHUP) };
    eventually("SIGHUP re-reads the files", || async {
        bridge
            .log()
            .lines()
            .any(|l| l.contains("SIGHUP") && l.contains("cannot reload the TLS certificate"))
    })
    .await;
    let ch = connect(port, &new_cert)
        .await
        .expect("the certificate in use was kept");
    let mut third = subscribe_with(&ch, "new-token")
        .await
        .expect("the token in use was kept");
    let want = publish(&e, 3000, 3);
    let more = collect_until(&mut live, T, |b| stored_hashes(b).len() >= want.len()).await;
    assert_eq!(stored_hashes(&more), want);
    seen.extend(more);
    assert_contiguous(&seen);
    for s in [&mut fresh, &mut third] {
        let got = collect_until(s, T, |b| stored_hashes(b).ends_with(&want)).await;
        assert_contiguous(&got);
    }
    let st = bridge.stop();
    assert!(st.success(), "kvbridge exited with {st:?}");
}
