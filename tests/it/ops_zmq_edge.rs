//! Operations: a hardened ZMQ edge. Fuzzed frames are counted and dropped while a valid stream
//! survives; a repeated engine seq is dropped, an empty payload does not move the last seq.

use crate::common;

use std::time::Duration;

use common::ops::*;
use common::*;
use kvbridge_tools::sim::{encode_batch, Rng, SimEvent};

/// Messages dropped for their shape (wrong frame count, seq frame neither 8 nor 24 bytes).
fn shape_drops(page: &str) -> f64 {
    metric(
        page,
        "kvbridge_frames_dropped_total",
        &[("rank", "0"), ("reason", "frame_count")],
    ) + metric(
        page,
        "kvbridge_frames_dropped_total",
        &[("rank", "0"), ("reason", "seq_length")],
    )
}

/// A valid-shape message with a valid seq whose payload can never decode.
fn bad_payload(rng: &mut Rng) -> Vec<u8> {
    match rng.range(0, 4) {
        // msgpack nil: a batch of the wrong type. (An empty payload is not garbage: it is dropped
        // before the state machine, leaving its seq to be filled.)
        0 => vec![0xc0],
        1 => {
            let mut v = vec![0xc1];
            v.extend((0..rng.range(0, 40)).map(|_| rng.next_u64() as u8));
            v
        }
        2 => b"\xa5hello".to_vec(),
        _ => {
            let full = encode_batch(L, 1.5, &[store(rng.next_u64() % 1000, 3, None)], 0);
            full[..full.len() / 2].to_vec()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_zmq_frames_are_counted_and_a_valid_stream_survives() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let (bridge, maddr) =
        Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &engine_args(&e));
    e.wait_subscribed();
    let mut sub = subscribe(&bridge.url(), 0).await.unwrap();
    const TOTAL: usize = 100_000;
    const CHUNK: usize = 5_000;
    let (mut invalid, mut garbage, mut valid) = (0usize, 0usize, 0usize);
    let mut want = Vec::new();
    let mut parent: Option<u64> = None;
    let mut sent = 0;
    let mut rng = Rng::new(42);
    while sent < TOTAL {
        // One chunk, decided here and sent on the engine thread.
        let mut plan: Vec<(u8, Vec<Vec<u8>>)> = Vec::with_capacity(CHUNK);
        for _ in 0..CHUNK {
            let roll = rng.range(0, 1000);
            if roll < 10 {
                let ev = store(
                    rng.next_u64() % 1_000_000,
                    1 + rng.range(0, 3) as usize,
                    parent,
                );
                if let SimEvent::Stored { hashes, .. } = &ev {
                    parent = hashes.last().copied();
                    want.extend(hashes.iter().copied());
                }
                plan.push((1, vec![encode_batch(L, 2.5, &[ev], 0)]));
                valid += 1;
            } else if roll < 60 {
                plan.push((1, vec![bad_payload(&mut rng)]));
                garbage += 1;
            } else {
                // Invalid shapes never consume a seq: 1, 2, 4 or 5 frames, or a seq frame that
                // is neither 8 bytes nor 24 (a seq and a publisher UUID, docs/engine-wire.md §13).
                let junk = |rng: &mut Rng| -> Vec<u8> {
                    (0..rng.range(0, 24))
                        .map(|_| rng.next_u64() as u8)
                        .collect()
                };
                let frames = match rng.range(0, 5) {
                    0 => vec![junk(&mut rng)],
                    1 => vec![junk(&mut rng), junk(&mut rng)],
                    2 => (0..4).map(|_| junk(&mut rng)).collect(),
                    3 => (0..5).map(|_| junk(&mut rng)).collect(),
                    _ => {
                        let mut seq = junk(&mut rng);
                        if seq.len() == 8 || seq.len() == 24 {
                            seq.push(0);
                        }
                        vec![b"".to_vec(), seq, junk(&mut rng)]
                    }
                };
                plan.push((0, frames));
                invalid += 1;
            }
        }
        sent += plan.len();
        e.with(move |p| {
            for (kind, frames) in plan {
                if kind == 1 {
                    p.publish(frames.into_iter().next().unwrap());
                } else {
                    let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
                    p.send_raw(&refs).unwrap();
                }
            }
        });
        // Pace: let the bridge take in this chunk before the next (a full pipe would make the
        // PUB drop, which is the engine's behaviour, not the bridge's).
        let (i, g) = (invalid as f64, (garbage + valid) as f64);
        wait_metrics(maddr, T, |p| {
            shape_drops(p) >= i
                && metric(p, "kvbridge_batches_received_total", &[("rank", "0")]) >= g
        });
    }
    let got = collect_until(&mut sub, T, |b| {
        stored_hashes(b).len() >= want.len() && clears(b) >= garbage
    })
    .await;
    assert_contiguous(&got);
    assert_eq!(
        stored_hashes(&got),
        want,
        "the valid stream, complete and in order"
    );
    assert_eq!(
        clears(&got),
        garbage,
        "one in-band clear per undecodable batch"
    );
    let page = scrape(maddr);
    assert_eq!(shape_drops(&page), invalid as f64);
    assert_eq!(
        metric(&page, "kvbridge_batches_received_total", &[("rank", "0")]),
        (garbage + valid) as f64
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_synthesized_clears_total",
            &[("cause", "undecodable")]
        ),
        garbage as f64
    );
    assert_eq!(metric(&page, "kvbridge_upstream_gaps_total", &[]), 0.0);
    assert!(metric(&page, "kvbridge_decode_errors_total", &[]) > 0.0);
    assert!(
        valid > 500 && garbage > 4000 && invalid > 90_000,
        "{valid} {garbage} {invalid}"
    );
    // Still up and serving.
    let more = publish_stores(&e, 77, 1, 1);
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= more.len()).await;
    assert_eq!(stored_hashes(&got), more);
    drop(sub);
    let st = bridge.stop();
    assert!(st.success(), "{st:?}");
}

/// The last engine seq sent again on the same connection is a repeated frame
/// (dropped, counted), not a restart; an empty payload does not move `last`, so the batch that
/// follows with its seq is applied; the last seq again after a reconnect is a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_engine_seq_is_dropped_and_an_empty_payload_does_not_move_last() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let (ep, rp) = (e.endpoint.clone(), e.replay.clone());
    let (bridge, maddr) =
        Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &engine_args(&e));
    e.wait_subscribed();
    // The start-up catch-up replay done first: frames that arrive while a replay runs are
    // merged with it, where a repeated seq counts as replay overlap, not as a repeated frame.
    wait_metrics(maddr, T, |p| {
        metric(
            p,
            "kvbridge_replays_total",
            &[("rank", "0"), ("outcome", "succeeded")],
        ) >= 1.0
    });
    let mut sub = subscribe(&bridge.url(), 0).await.unwrap();
    let batch = |seed: u64| {
        let ev = store(seed, 2, None);
        let SimEvent::Stored { hashes, .. } = &ev else {
            unreachable!()
        };
        (hashes.clone(), encode_batch(L, 1.5, &[ev], 0))
    };
    let (mut want, p0) = batch(31);
    e.with(move |p| p.publish(p0));
    // seq 1, then seq 1 again.
    let (h1, p1) = batch(32);
    want.extend(&h1);
    e.with(move |p| {
        let s = p.publish(p1.clone());
        p.send_raw(&[b"", &s.to_be_bytes(), &p1]).unwrap();
    });
    // An empty payload with seq 2, then the batch with seq 2, then seq 3.
    let (h2, p2) = batch(33);
    want.extend(&h2);
    e.with(move |p| {
        let s = p.next_seq();
        p.send_raw(&[b"", &s.to_be_bytes(), b""]).unwrap();
        p.publish(p2);
    });
    let (h3, p3) = batch(34);
    want.extend(&h3);
    e.with(move |p| p.publish(p3));
    let got = collect_until(&mut sub, T, |b| stored_hashes(b).len() >= want.len()).await;
    assert_eq!(stored_hashes(&got), want, "every batch once, in order");
    assert_eq!(clears(&got), 0, "no in-band clear");
    let page = wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_last_upstream_seq", &[("rank", "0")]) == 3.0
    });
    assert_eq!(
        metric(&page, "kvbridge_repeated_frames_total", &[("rank", "0")]),
        1.0
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_frames_dropped_total",
            &[("rank", "0"), ("reason", "empty_payload")]
        ),
        1.0
    );
    assert_eq!(metric(&page, "kvbridge_engine_restarts_total", &[]), 0.0);
    assert_eq!(metric(&page, "kvbridge_synthesized_clears_total", &[]), 0.0);
    assert_eq!(metric(&page, "kvbridge_upstream_gaps_total", &[]), 0.0);

    // The engine restarts and, on its new connection, its first batch the bridge sees has the
    // last seq (3): a restart, although the seq did not go down.
    drop(e);
    wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) == 0.0
    });
    let e = Engine::start_at(&ep, &rp);
    let mut want: Vec<u64> = Vec::new();
    let mut last = Vec::new();
    for seed in 41..45 {
        let (h, p) = batch(seed);
        want.extend(&h);
        last = p.clone();
        e.with(move |pb| pb.publish_dropped(p));
    }
    wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) == 1.0
    });
    // The PUB drops what it sends before the bridge's subscription reaches it: send seq 3 until
    // it arrives (any copy after the first is a repeat on the same connection).
    let got = loop {
        let p = last.clone();
        e.with(move |pb| pb.send_raw(&[b"", &3u64.to_be_bytes(), &p]).unwrap());
        match tokio::time::timeout(Duration::from_millis(200), sub.message()).await {
            Ok(Ok(Some(b))) => break vec![b],
            Ok(other) => panic!("stream ended: {other:?}"),
            Err(_) => continue,
        }
    };
    let mut got = got;
    got.extend(
        collect_until(&mut sub, T, |b| {
            stored_hashes(&[got.clone(), b.to_vec()].concat()).len() >= want.len()
        })
        .await,
    );
    assert_eq!(clears(&got), 1, "one clear for the restart");
    assert_eq!(
        stored_hashes(&got),
        want,
        "the new incarnation, replayed from 0"
    );
    let page = scrape(maddr);
    assert_eq!(metric(&page, "kvbridge_engine_restarts_total", &[]), 1.0);
    drop(sub);
    bridge.stop();
}
