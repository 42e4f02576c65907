//! How records are framed on the wire: a subscriber that is behind — here
//! resuming from the start of a full window — gets many records per HTTP/2 DATA frame (one
//! write carries many), instead of one frame per record; with `--fanout-linger`, so do live
//! records that come close together. Seen with a raw HTTP/2 client, which receives DATA frames
//! one by one.

use crate::common;

use std::time::{Duration, Instant};

use common::raw_h2::{self, read_messages};
use common::*;

const RECORDS: usize = 300;

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

/// `SubscribeKvEvents` from 0 on a connection of its own (4 MiB windows).
async fn raw_subscribe(grpc: std::net::SocketAddr) -> h2::RecvStream {
    let mut client = raw_h2::connect(grpc, 4 << 20, 4 << 20).await;
    raw_h2::subscribe(&mut client, grpc, 0).await
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
