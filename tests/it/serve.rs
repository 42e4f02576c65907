//! End-to-end tests of `kvbridge serve`: the real binary, simulated engines over real ZMQ, and
//! gRPC subscribers (tonic and the `subscribe` CLI).

use crate::common;

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use common::*;
use kvbridge::proto::common::KvEventBatch;
use kvbridge_tools::sim::{encode_batch, Layout, SimEvent};
use prost::Message;

const T: Duration = Duration::from_secs(30);

fn rank_args(engines: &[&Engine]) -> Vec<String> {
    let mut a = Vec::new();
    for e in engines {
        a.extend(["--zmq".to_string(), e.endpoint.clone()]);
    }
    for e in engines {
        a.extend(["--replay".to_string(), e.replay.clone()]);
    }
    a.extend(["--seq-base".to_string(), "1".to_string()]);
    a
}

async fn subscribe_on(url: &str, path: usize, start: u64) -> tonic::Streaming<KvEventBatch> {
    use kvbridge::proto::*;
    let ch = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let req = common_req(start);
    match path {
        0 => sglang::grpc::scheduler::sglang_scheduler_client::SglangSchedulerClient::new(ch).subscribe_kv_events(req).await,
        1 => vllm::grpc::engine::vllm_engine_client::VllmEngineClient::new(ch).subscribe_kv_events(req).await,
        2 => tokenspeed::grpc::scheduler::token_speed_scheduler_client::TokenSpeedSchedulerClient::new(ch).subscribe_kv_events(req).await,
        _ => trtllm::trtllm_service_client::TrtllmServiceClient::new(ch).subscribe_kv_events(req).await,
    }
    .unwrap()
    .into_inner()
}

fn common_req(start: u64) -> kvbridge::proto::common::SubscribeKvEventsRequest {
    kvbridge::proto::common::SubscribeKvEventsRequest {
        start_sequence_number: start,
        load_records_before_first_batch: false,
    }
}

fn hashes_of(e: &SimEvent) -> Vec<u64> {
    match e {
        SimEvent::Stored { hashes, .. } => hashes.clone(),
        _ => vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_batch_in_order_to_every_subscriber_across_ranks_and_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let (e0, e1) = (Engine::start(0), Engine::start(1));
    let bridge = Bridge::start(
        dir.path(),
        &dir.path().join("ring"),
        &rank_args(&[&e0, &e1]),
    );
    e0.wait_subscribed();
    e1.wait_subscribed();
    let mut subs = Vec::new();
    for p in 0..4 {
        subs.push(subscribe_on(&bridge.url(), p, 0).await);
    }
    let mut expected: [Vec<u64>; 2] = [vec![], vec![]];
    let mut parent = [None, None];
    for i in 0..48u64 {
        for (r, e) in [&e0, &e1].into_iter().enumerate() {
            let ev = store(r as u64 * 10_000 + i, 1 + (i as usize % 5), parent[r]);
            let hs = hashes_of(&ev);
            parent[r] = hs.last().copied();
            expected[r].extend(&hs);
            e.publish(layout(i as usize + r), vec![ev], r as u32);
        }
    }
    let total = expected[0].len() + expected[1].len();
    let cli = run_ok(&[
        "subscribe",
        "--grpc",
        &bridge.grpc.to_string(),
        "--engine",
        "sglang",
        "--count",
        "96",
    ]);

    let mut encoded: Vec<Vec<Vec<u8>>> = Vec::new();
    for s in &mut subs {
        let got = collect_until(s, T, |b| stored_hashes(b).len() >= total).await;
        assert_contiguous(&got);
        assert_eq!(clears(&got), 0, "no discontinuity expected");
        let hs = stored_hashes(&got);
        for (r, want) in expected.iter().enumerate() {
            let mine: HashSet<u64> = want.iter().copied().collect();
            let seen: Vec<u64> = hs.iter().copied().filter(|h| mine.contains(h)).collect();
            assert_eq!(&seen, want, "rank {r} blocks in publish order");
        }
        assert!(
            got.iter().all(|b| b.dp_rank.is_none()),
            "merged stream leaves dp_rank unset"
        );
        // Per-block tokens and parents survive.
        for b in &got {
            for e in &b.events {
                if let Some(kvbridge::proto::common::kv_cache_event::Data::Stored(st)) = &e.data {
                    assert!(st
                        .blocks
                        .iter()
                        .all(|k| k.token_ids.len() == 16 && k.block_size == 16));
                }
            }
        }
        encoded.push(got.iter().map(|b| b.encode_to_vec()).collect());
    }
    // Encode once: every path got the same bytes.
    for e in &encoded[1..] {
        assert_eq!(e, &encoded[0]);
    }
    // Event ids are per ring, from 1, without holes.
    let stdout = String::from_utf8(cli.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 96);
    let first: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(first["sequenceNumber"], "1");
    assert_eq!(first["events"][0]["eventId"], "1");
    let last: serde_json::Value = serde_json::from_str(lines[95]).unwrap();
    assert_eq!(last["sequenceNumber"], "96");
    assert!(bridge.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_inside_window_and_out_of_range_outside() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let mut args = rank_args(&[&e]);
    args.extend(["--ring-size".into(), "1MiB".into()]);
    // This test is about the retained window: a fresh subscriber (which sets field 2) gets it
    // only without snapshots (tests/it/snapshot.rs covers those).
    args.extend(["--snapshot".into(), "off".into()]);
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    e.wait_subscribed();
    // ~6.6 KB per batch: 300 batches wrap a 1 MiB ring about twice.
    let n = 300u64;
    let mut last_hash = 0;
    for i in 0..n {
        let ev = store(i + 1, 100, None);
        last_hash = *hashes_of(&ev).last().unwrap();
        e.publish(layout(i as usize), vec![ev], 0);
    }
    // The bridge's newest record holds the last published block.
    // A fresh subscriber starts at O; while the bridge is still ingesting the burst it can be
    // lapped at once (DATA_LOSS), and then does what a gateway does: resubscribes from 0.
    let window = loop {
        let mut probe = subscribe(&bridge.url(), 0).await.unwrap();
        match try_collect_until(&mut probe, T, |b| stored_hashes(b).contains(&last_hash)).await {
            Ok(w) => break w,
            Err(st) => assert_eq!(st.code(), tonic::Code::DataLoss, "{st:?}"),
        }
    };
    assert_contiguous(&window);
    // Ingest is done: the window is stable now; read it whole once more.
    let mut probe = subscribe(&bridge.url(), 0).await.unwrap();
    let window = collect_until(&mut probe, T, |b| stored_hashes(b).contains(&last_hash)).await;
    assert_contiguous(&window);
    let (o, newest) = (
        window[0].sequence_number,
        window.last().unwrap().sequence_number,
    );
    assert!(o > 2, "the ring must have wrapped (oldest {o})");
    assert_eq!(newest, n, "one record per engine batch, numbered from 1");

    for s in [o - 1, o, (o + newest) / 2, newest - 1] {
        let mut st = subscribe(&bridge.url(), s).await.unwrap();
        let got = collect_until(&mut st, T, |b| {
            b.last().is_some_and(|l| l.sequence_number == newest)
        })
        .await;
        assert_eq!(got[0].sequence_number, s + 1, "resume from {s}");
        let idx = (s + 1 - o) as usize;
        let want: Vec<Vec<u8>> = window[idx..].iter().map(|b| b.encode_to_vec()).collect();
        let have: Vec<Vec<u8>> = got.iter().map(|b| b.encode_to_vec()).collect();
        assert_eq!(have, want, "resumed bytes equal the originals");
    }
    // At head: nothing until the next batch, which is newest + 1.
    let mut head = subscribe(&bridge.url(), newest).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), head.message())
            .await
            .is_err()
    );
    e.publish(Layout::Vllm033, vec![store(99_999, 1, None)], 0);
    let got = collect_until(&mut head, T, |b| !b.is_empty()).await;
    assert_eq!(got[0].sequence_number, newest + 1);

    for s in [1, o - 2, newest + 2, newest + 1000] {
        let err = subscribe(&bridge.url(), s)
            .await
            .expect_err("must be refused");
        assert_eq!(err.code(), tonic::Code::OutOfRange, "S = {s}: {err:?}");
    }
    let err = subscribe(&bridge.url(), 1).await.unwrap_err();
    assert!(
        err.message().contains("older than the retained window"),
        "{}",
        err.message()
    );
    let err = subscribe(&bridge.url(), newest + 1000).await.unwrap_err();
    assert!(
        err.message().contains("ahead of newest"),
        "{}",
        err.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_stops_reading_gets_data_loss_and_never_stalls_others() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let mut args = rank_args(&[&e]);
    args.extend(["--ring-size".into(), "2MiB".into()]);
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &args);
    e.wait_subscribed();
    e.publish(Layout::Vllm022, vec![store(1, 1, None)], 0);
    let mut stalled = subscribe(&bridge.url(), 0).await.unwrap();
    let first = collect_until(&mut stalled, T, |b| !b.is_empty()).await;
    let live = subscribe(&bridge.url(), first[0].sequence_number)
        .await
        .unwrap();
    // ~8 MB through a 2 MiB ring while `stalled` reads nothing; a second subscriber keeps up
    // (ingest is never blocked by the stalled one).
    let events: Vec<SimEvent> = (0..1200u64).map(|i| store(i + 10, 100, None)).collect();
    let last_hash = *hashes_of(events.last().unwrap()).last().unwrap();
    let reader = tokio::spawn(async move {
        let mut live = live;
        collect_until(&mut live, Duration::from_secs(90), |b| {
            stored_hashes(b).contains(&last_hash)
        })
        .await
    });
    for (i, ev) in events.into_iter().enumerate() {
        e.publish(layout(i), vec![ev], 0);
        if i % 2 == 1 {
            // Pacing: a steady stream through the ring, not one burst.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let got = reader.await.unwrap();
    assert_contiguous(&got);
    // Now the stalled subscriber reads again: contiguous batches (what was in flight), then
    // DATA_LOSS — never a silent skip.
    let mut prev = first[0].sequence_number;
    let status = loop {
        match tokio::time::timeout(T, stalled.message())
            .await
            .expect("stalled stream must end")
        {
            Ok(Some(b)) => {
                assert_eq!(b.sequence_number, prev + 1, "no silent skip");
                prev = b.sequence_number;
            }
            Ok(None) => panic!("ended without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), tonic::Code::DataLoss, "{status:?}");
    assert!(
        status.message().contains(&format!("last delivered {prev}")),
        "{}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_is_filled_by_replay_and_engine_restart_is_signalled() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &rank_args(&[&e]));
    e.wait_subscribed();
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let (a, b, c) = (store(1, 2, None), store(2, 2, None), store(3, 2, None));
    let (ha, hb, hc) = (hashes_of(&a), hashes_of(&b), hashes_of(&c));
    e.publish(Layout::Vllm0102, vec![a], 0);
    // `b` is lost on the wire (an HWM drop) but stays in the engine's replay buffer.
    e.with(move |p| p.publish_dropped(encode_batch(Layout::Vllm0102, 1.0, &[b], 0)));
    e.publish(Layout::Vllm0102, vec![c], 0);
    let got = collect_until(&mut s, T, |g| stored_hashes(g).len() >= 6).await;
    assert_eq!(
        stored_hashes(&got),
        [ha, hb, hc].concat(),
        "replay filled the gap in order"
    );
    assert_eq!(clears(&got), 0);

    // Engine restart: its counter goes back to 0; subscribers get a clear first.
    e.with(|p| p.restart());
    let d = store(4, 1, None);
    let hd = hashes_of(&d);
    e.publish(Layout::Vllm033, vec![d], 0);
    let got = collect_until(&mut s, T, |g| !stored_hashes(g).is_empty()).await;
    assert_eq!(clears(&got), 1, "a restart is signalled in band");
    assert!(
        matches!(got[0].events[0].data, Some(kvbridge::proto::common::kv_cache_event::Data::Cleared(ref c)) if c.ownership.is_none())
    );
    assert_eq!(stored_hashes(&got), hd);

    // A burned seq (never buffered) cannot be replayed: also signalled in band.
    e.with(|p| p.burn_seq());
    let f = store(5, 1, None);
    let hf = hashes_of(&f);
    e.publish(Layout::Vllm033, vec![f], 0);
    let got = collect_until(&mut s, T, |g| !stored_hashes(g).is_empty()).await;
    assert_eq!(clears(&got), 1, "an unfillable gap is signalled in band");
    assert_eq!(stored_hashes(&got), hf);
    assert_contiguous(&got);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_restart_continues_the_sequence_and_catches_up_from_replay() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let bridge = Bridge::start(dir.path(), &dir.path().join("ring"), &rank_args(&[&e]));
    e.wait_subscribed();
    let a = store(1, 3, None);
    let ha = hashes_of(&a);
    e.publish(Layout::Vllm022Bin, vec![a], 0);
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let got = collect_until(&mut s, T, |g| stored_hashes(g).len() >= 3).await;
    assert_eq!(stored_hashes(&got), ha);
    let cursor = got.last().unwrap().sequence_number;
    drop(s);

    let st = bridge.stop();
    assert!(st.success(), "clean exit on SIGTERM: {st:?}");
    // Published while the bridge is down: only the replay buffer has it.
    let b = store(2, 2, None);
    let hb = hashes_of(&b);
    e.publish(Layout::Vllm022Bin, vec![b], 0);

    // Another port (0: the bridge binds one): the cursor belongs to the ring, not the address.
    let grpc = "127.0.0.1:0".to_string();
    let mut args = vec![
        "serve".to_string(),
        "--grpc".into(),
        grpc.clone(),
        "--shm".into(),
        dir.path().join("ring").display().to_string(),
    ];
    args.extend(["--metrics".into(), "off".into()]);
    args.extend(rank_args(&[&e]));
    let bridge = Bridge::start_args(
        dir.path(),
        grpc.parse().unwrap(),
        &dir.path().join("ring"),
        args,
    );
    let mut s = subscribe(&bridge.url(), cursor)
        .await
        .expect("old cursor still valid after restart");
    let got = collect_until(&mut s, T, |g| stored_hashes(g).len() >= 2).await;
    assert_eq!(
        got[0].sequence_number,
        cursor + 1,
        "numbering continues after a restart"
    );
    assert_eq!(
        stored_hashes(&got),
        hb,
        "what the engine published meanwhile was replayed"
    );
    assert_eq!(clears(&got), 0);
    assert!(bridge.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_reads_the_ring_from_another_process_while_serving() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let ring = dir.path().join("ring");
    let bridge = Bridge::start(dir.path(), &ring, &rank_args(&[&e]));
    e.wait_subscribed();
    for i in 0..5 {
        e.publish(layout(i), vec![store(i as u64 + 1, 2, None)], 0);
    }
    let out = run_ok(&[
        "tail",
        "--shm",
        &ring.display().to_string(),
        "--count",
        "5",
        "--meta",
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["seq"], i as u64 + 1);
        assert_eq!(l["engineSeq"], i as u64);
        assert_eq!(l["batch"]["sequenceNumber"], (i + 1).to_string());
        assert_eq!(
            l["batch"]["events"][0]["stored"]["blocks"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
    }
    assert!(bridge.stop().success());
}

#[test]
fn setup_errors_are_one_line_and_exit_2() {
    let run = |args: &[&str]| {
        let o = Command::new(bin()).args(args).output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (code, err) = run(&["serve", "--bogus"]);
    assert_eq!(code, Some(2), "{err}");
    let ring = tempfile::tempdir().unwrap();
    let shm = ring.path().join("ring").display().to_string();
    let (code, err) = run(&[
        "serve",
        "--zmq",
        "udp://x:1",
        "--metrics",
        "off",
        "--grpc",
        "127.0.0.1:0",
        "--shm",
        &shm,
    ]);
    assert_eq!(code, Some(2));
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("--zmq"), "{err}");
    let occupied = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = occupied.local_addr().unwrap().port().to_string();
    let (code, err) = run(&[
        "serve",
        "--zmq",
        "tcp://127.0.0.1:5999",
        "--grpc",
        &format!("127.0.0.1:{port}"),
        "--metrics",
        "off",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--grpc"), "{err}");
    let (code, err) = run(&[
        "serve",
        "--zmq",
        "tcp://127.0.0.1:5999",
        "--grpc",
        "127.0.0.1:0",
        "--metrics",
        "off",
        "--shm",
        "/nonexistent-dir/ring",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--shm"), "{err}");
    // Port 1 (tcpmux): privileged, and nothing listens on it.
    let (code, err) = run(&["subscribe", "--grpc", "127.0.0.1:1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot connect"), "{err}");
    let (code, err) = run(&["tail", "--shm", "/nonexistent-dir/ring"]);
    assert_eq!(code, Some(2), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_killed_with_sigkill_restarts_on_its_ring_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let ring = dir.path().join("ring");
    let mut bridge = Bridge::start(dir.path(), &ring, &rank_args(&[&e]));
    e.wait_subscribed();
    let mut all = Vec::new();
    for i in 0..20u64 {
        let ev = store(i + 1, 2, None);
        all.extend(hashes_of(&ev));
        e.publish(layout(i as usize), vec![ev], 0);
    }
    let mut s = subscribe(&bridge.url(), 0).await.unwrap();
    let before = collect_until(&mut s, T, |g| stored_hashes(g).len() >= 40).await;
    let cursor = before.last().unwrap().sequence_number;
    // No shutdown path at all: the kernel releases the writer lock.
    bridge.child.kill().unwrap();
    bridge.child.wait().unwrap();
    // The engine goes on publishing while the bridge is dead.
    for i in 20..30u64 {
        let ev = store(i + 1, 2, None);
        all.extend(hashes_of(&ev));
        e.publish(layout(i as usize), vec![ev], 0);
    }
    let (grpc, args) = (bridge.grpc, bridge.args.clone());
    drop(bridge);
    let bridge = Bridge::start_args(dir.path(), grpc, &ring, args);
    let mut s = subscribe(&bridge.url(), cursor)
        .await
        .expect("the cursor survives a crash");
    let after = collect_until(&mut s, T, |g| stored_hashes(g).len() >= 20).await;
    assert_eq!(after[0].sequence_number, cursor + 1);
    assert_contiguous(&after);
    assert_eq!(
        clears(&after),
        0,
        "the engine's replay filled what the crash missed"
    );
    let mut seen = stored_hashes(&before);
    seen.extend(stored_hashes(&after));
    assert_eq!(seen, all);
    assert!(bridge.stop().success());
}
