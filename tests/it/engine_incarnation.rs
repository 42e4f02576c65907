//! Same batch, or a new engine incarnation? Decided by what was applied (the batch's bytes), not
//! by sequence numbers or connection events (docs/engine-wire.md §8), in the two restart orders
//! where sequence numbers and connection events mislead:
//!
//! - the engine restarts while kvbridge is down, and its new incarnation has published more
//!   batches than kvbridge had applied: a forward "gap" that is really a restart;
//! - an engine that connects to kvbridge (kvbridge binds) re-delivers, after kvbridge restarts,
//!   what it published meanwhile: copies of what kvbridge's catch-up replay already applied, on
//!   a new connection, that are no restart.

use crate::common;

use common::*;
use kvbridge::proto::common::kv_cache_event::Data;

const T: std::time::Duration = std::time::Duration::from_secs(30);

/// The metric `name{rank="0"}` of the bridge at `addr`, once `pred` holds for it.
fn wait_rank_metric(addr: std::net::SocketAddr, name: &str, pred: impl Fn(f64) -> bool) -> f64 {
    let page = wait_metrics(addr, T, |p| pred(metric(p, name, &[("rank", "0")])));
    metric(&page, name, &[("rank", "0")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_while_kvbridge_was_down_is_a_clear_then_its_whole_history() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let args = e.bridge_args();
    let (bridge, _) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    e.wait_subscribed();
    let old = e.publish_stores(1..4);
    let (mut s, ring_id) = subscribe_with_ring_id(&bridge.url(), 0).await.unwrap();
    assert_eq!(ring_id.len(), 16, "{ring_id}");
    let before = collect_until(&mut s, T, |g| stored_hashes(g).len() >= old.len()).await;
    assert_eq!(stored_hashes(&before), old);
    let cursor = before.last().unwrap().sequence_number;
    drop(s);
    let (grpc, args) = (bridge.grpc, bridge.args.clone());
    assert!(bridge.stop().success());

    // While kvbridge is down: the engine restarts (its seq back to 0, its replay buffer empty)
    // and publishes more batches than kvbridge had applied (seqs 0..=4 against its last 2).
    e.with(|p| p.restart());
    let new = e.publish_stores(11..16);

    let bridge = Bridge::start_args(dir.path(), grpc, &ring, args);
    let metrics = bridge.metrics.expect("metrics on");
    let (mut s, same_ring) = subscribe_with_ring_id(&bridge.url(), cursor).await.unwrap();
    assert_eq!(
        same_ring, ring_id,
        "the same ring: the numbering continues (an engine restart is no ring reset)"
    );
    let after = collect_until(&mut s, T, |g| stored_hashes(g).len() >= new.len()).await;
    assert_contiguous(&after);
    assert!(
        matches!(after[0].events[0].data, Some(Data::Cleared(_))),
        "the restart is signalled before anything of the new incarnation: {after:?}"
    );
    assert_eq!(clears(&after), 1);
    assert_eq!(
        stored_hashes(&after),
        new,
        "the new incarnation's whole history, from its seq 0"
    );
    assert_eq!(
        wait_rank_metric(metrics, "kvbridge_engine_restarts_total", |v| v >= 1.0),
        1.0
    );
    // And live from there on.
    let more = e.publish_stores(21..23);
    let live = collect_until(&mut s, T, |g| stored_hashes(g).len() >= more.len()).await;
    assert_eq!(stored_hashes(&live), more);
    assert_eq!(clears(&live), 0);
    assert!(bridge.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connecting_engine_redelivering_after_a_kvbridge_restart_is_no_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    // kvbridge binds the address the engine's PUB connects to.
    let (e, bridge, metrics) = retry_on_taken_port(|| {
        let ep = format!("tcp://127.0.0.1:{}", free_port());
        let e = Engine::start_connecting(&ep);
        let args = vec![
            "--zmq-bind".to_string(),
            ep,
            "--replay".into(),
            e.replay.clone(),
            "--seq-base".into(),
            "1".into(),
        ];
        Bridge::try_start_with_metrics(dir.path(), &ring, &args).map(|(b, m)| (e, b, m))
    });
    e.wait_subscribed();
    let old = e.publish_stores(1..4);
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let before = collect_until(&mut s, T, |g| stored_hashes(g).len() >= old.len()).await;
    let cursor = before.last().unwrap().sequence_number;
    drop(s);
    let (grpc, args) = (bridge.grpc, bridge.args.clone());
    let _ = metrics;
    bridge.kill();

    // Published while kvbridge is dead: queued in the engine's PUB for the connection, and in
    // its replay buffer. The restarted kvbridge's catch-up replay applies them; the PUB then
    // delivers its queued copies on the new connection.
    let meanwhile = e.publish_stores(11..15);
    let subscribed = e.subscriptions();
    let bridge = Bridge::start_args(dir.path(), grpc, &ring, args);
    let metrics = bridge.metrics.expect("metrics on");
    e.wait_subscribed_after(subscribed);
    // The four copies reached kvbridge and were dropped as copies (3 duplicates and the last
    // batch repeated), whichever arrived before or after the catch-up ended.
    let page = wait_metrics(metrics, T, |p| {
        metric(p, "kvbridge_duplicates_dropped_total", &[("rank", "0")])
            + metric(p, "kvbridge_repeated_frames_total", &[("rank", "0")])
            >= 4.0
    });
    assert_eq!(
        metric(&page, "kvbridge_engine_restarts_total", &[("rank", "0")]),
        0.0,
        "copies on a new connection are no restart"
    );
    let live = e.publish_stores(21..23);
    let mut s = subscribe(&bridge.url(), cursor).await.unwrap();
    let want: Vec<u64> = meanwhile.iter().chain(&live).copied().collect();
    let after = collect_until(&mut s, T, |g| stored_hashes(g).len() >= want.len()).await;
    assert_contiguous(&after);
    assert_eq!(clears(&after), 0, "no spurious clear: {after:?}");
    assert_eq!(stored_hashes(&after), want, "each batch once, in order");
    assert!(bridge.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_names_the_ring_a_lost_ring_file_is_another_id() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let args = e.bridge_args();
    let bridge = Bridge::start(dir.path(), &ring, &args);
    let (_, first) = subscribe_with_ring_id(&bridge.url(), 0).await.unwrap();
    let bridge = bridge.restart(dir.path());
    let (_, adopted) = subscribe_with_ring_id(&bridge.url(), 0).await.unwrap();
    assert_eq!(adopted, first, "a restart on the ring continues it");
    let (grpc, args) = (bridge.grpc, bridge.args.clone());
    assert!(bridge.stop().success());
    std::fs::remove_file(&ring).unwrap();
    let bridge = Bridge::start_args(dir.path(), grpc, &ring, args);
    let (_, reset) = subscribe_with_ring_id(&bridge.url(), 0).await.unwrap();
    assert_ne!(reset, first, "a lost ring file: a new ring, a new id");
    assert!(bridge.stop().success());
}
