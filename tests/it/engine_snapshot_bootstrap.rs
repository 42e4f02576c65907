//! `--engine-snapshot` (or `snapshot_endpoint` in `--kv-events-config`): where the engine's
//! replay cannot fill, kvbridge takes the rank's state from the engine's snapshot service (vLLM
//! #57789, unmerged; `vMaroon/vllm` @ 08ee3e5, docs/engine-wire.md §13) — one in-band clear, the
//! snapshot's chunks, then the live batches after its cut — and the rank is exact again. The
//! simulated engine answers as the PR's recorder does (`[cut, uuid, chunk, …]`, chunks a replay
//! program of its batches; `-2` when unavailable).
//!
//! SGLang #34407's placement snapshot (`snapshot-v2`, unmerged; `sgl-project/sglang` @
//! 3536c7c) is taken the same way; its state has no tokens, so it restores hash-only consumers
//! (`--profile all`) and is declined under `--profile smg`.

use crate::common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use common::zmq_publish::{apply_payloads, base_args, replay};
use common::{http_get, metric, wait_metrics, Bridge, Engine};
use kvbridge_tools::sim::{Identity, Layout, SimEvent};

const T: Duration = Duration::from_secs(30);

/// What the engine holds, as its batches built it.
struct Truth {
    live: BTreeSet<u64>,
    seed: u64,
    layout: Layout,
}

impl Default for Truth {
    fn default() -> Self {
        Truth {
            live: BTreeSet::new(),
            seed: 0,
            layout: Layout::Vllm033,
        }
    }
}

impl Truth {
    /// `n` batches: each stores 2 blocks, every third also removes the previous batch's.
    fn publish(&mut self, e: &Engine, n: usize) {
        let mut prev: Option<Vec<u64>> = None;
        for i in 0..n {
            self.seed += 1;
            let ev = common::store(self.seed * 104_729, 2, None);
            let SimEvent::Stored { hashes, .. } = &ev else {
                unreachable!()
            };
            self.live.extend(hashes.iter().copied());
            let mut events = vec![ev.clone()];
            if let Some(p) = prev.take().filter(|_| i % 3 == 2) {
                for h in &p {
                    self.live.remove(h);
                }
                events.push(SimEvent::Removed {
                    hashes: p,
                    medium: Some("GPU".into()),
                });
            }
            prev = Some(hashes.clone());
            e.publish(self.layout, events, 0);
        }
    }
}

impl Truth {
    /// Publishes 5 live batches and waits until the re-publish's consumer (`replay_ep`) holds
    /// what the engine holds.
    fn follow(&mut self, e: &Engine, replay_ep: &str, what: &str) {
        e.wait_subscribed();
        self.publish(e, 5);
        let want = self.live.clone();
        common::eventually(what, T, || {
            let h = held(replay_ep);
            if h == want {
                Ok(())
            } else {
                Err(h.len())
            }
        });
    }
}

/// The blocks a consumer of kvbridge's engine-wire re-publish holds after a replay from 0.
fn held(replay_ep: &str) -> BTreeSet<u64> {
    let ctx = zmq::Context::new();
    let msgs = replay(&ctx, replay_ep, 0);
    apply_payloads(msgs.iter().map(|m| m.payload.as_slice())).0
}

/// An engine on #57789's wire with a replay buffer of 10 batches and its snapshot service open;
/// returns it and the snapshot endpoint.
fn engine(unavailable: bool) -> (Engine, String) {
    let e = Engine::start(0);
    let snap = e.with(move |p| {
        p.identity = Some(Identity::VllmUuid([0x57; 16]));
        p.set_buffer_steps(10);
        p.snapshot_unavailable = unavailable;
        p.serve_snapshots_at("tcp://127.0.0.1:*").unwrap()
    });
    (e, snap)
}

/// kvbridge over `e`, with the engine's snapshot endpoint and the engine-wire re-publish (to
/// read what consumers hold).
fn bridge(dir: &std::path::Path, e: &Engine, snap: &str) -> (Bridge, SocketAddr, String) {
    let mut args = base_args(&[e]);
    args.extend(
        [
            "--engine-snapshot",
            snap,
            "--publish-zmq",
            "tcp://127.0.0.1:0",
            "--publish-zmq-replay",
            "tcp://127.0.0.1:0",
        ]
        .map(String::from),
    );
    let (b, maddr) = Bridge::start_with_metrics(dir, &dir.join("ring"), &args);
    let replay_ep = b.publish_zmq[0].1.clone().expect("replay bound");
    (b, maddr, replay_ep)
}

fn outcome(page: &str, o: &str) -> f64 {
    metric(
        page,
        "kvbridge_replays_total",
        &[("rank", "0"), ("outcome", o)],
    )
}

/// kvbridge started after the engine's replay buffer wrapped: the snapshot gives it the whole
/// state, the rank is exact, and live batches follow the snapshot's cut.
#[test]
fn a_late_start_past_the_replay_buffer_bootstraps_from_the_engines_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (e, snap) = engine(false);
    let mut truth = Truth::default();
    truth.publish(&e, 40);
    let (b, maddr, replay_ep) = bridge(dir.path(), &e, &snap);
    let page = wait_metrics(maddr, T, |p| outcome(p, "snapshot") >= 1.0);
    assert_eq!(outcome(&page, "snapshot_unavailable"), 0.0, "{page}");
    assert_eq!(
        metric(&page, "kvbridge_rank_exact", &[("rank", "0")]),
        1.0,
        "a snapshot makes the rank exact:\n{page}"
    );
    let health = http_get(maddr, "/health");
    assert!(health.contains(r#""freshness":"exact""#), "{health}");
    assert_eq!(held(&replay_ep), truth.live, "the snapshot's state");
    let clears = |page: &str, cause: &str| {
        metric(
            page,
            "kvbridge_synthesized_clears_total",
            &[("rank", "0"), ("cause", cause)],
        )
    };
    let page = common::scrape(maddr);
    assert_eq!(
        clears(&page, "missing_history"),
        1.0,
        "one clear, the snapshot's:\n{page}"
    );
    // kvbridge restarts before any live batch: the ring's record of the state carries the
    // digest of the engine's batch at the cut, so the engine's replay proves the incarnation
    // (no restart, no second clear).
    let b = b.restart(dir.path());
    let maddr = b.metrics.expect("metrics");
    let replay_ep = b.publish_zmq[0].1.clone().expect("replay bound");
    let page = wait_metrics(maddr, T, |p| outcome(p, "succeeded") >= 1.0);
    assert_eq!(
        metric(&page, "kvbridge_engine_restarts_total", &[("rank", "0")]),
        0.0,
        "{page}"
    );
    assert_eq!(
        metric(&page, "kvbridge_rank_exact", &[("rank", "0")]),
        1.0,
        "exact across the restart:\n{page}"
    );
    assert_eq!(
        held(&replay_ep),
        truth.live,
        "the state after kvbridge's restart"
    );
    // Live batches after the cut follow it.
    truth.follow(&e, &replay_ep, "the live batches after the snapshot");
    let page = common::scrape(maddr);
    for cause in ["missing_history", "engine_restart"] {
        assert_eq!(
            clears(&page, cause),
            0.0,
            "no clear after kvbridge's restart:\n{page}"
        );
    }
    drop(b);
}

/// An engine whose snapshot answers `-2`: the history is missing, as without a snapshot
/// service, and the rank says so.
#[test]
fn an_unavailable_snapshot_leaves_the_rank_degraded() {
    let dir = tempfile::tempdir().unwrap();
    let (e, snap) = engine(true);
    let mut truth = Truth::default();
    truth.publish(&e, 40);
    let (b, maddr, _) = bridge(dir.path(), &e, &snap);
    let page = wait_metrics(maddr, T, |p| {
        outcome(p, "snapshot_unavailable") >= 1.0
            && metric(
                p,
                "kvbridge_rank_degraded",
                &[("rank", "0"), ("cause", "missing_history")],
            ) == 1.0
    });
    assert_eq!(outcome(&page, "snapshot"), 0.0, "{page}");
    let health = http_get(maddr, "/health");
    assert!(
        health.contains(r#""freshness":"degraded","cause":"missing_history""#),
        "{health}"
    );
    drop(b);
}

/// The engine restarts (a new UUID) while kvbridge is down and publishes past its replay buffer:
/// kvbridge's start finds a new incarnation whose history is gone, and takes its snapshot.
#[test]
fn an_engine_restart_while_kvbridge_was_down_bootstraps_from_the_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (e, snap) = engine(false);
    let mut truth = Truth::default();
    let (b, maddr, _) = bridge(dir.path(), &e, &snap);
    e.wait_subscribed();
    truth.publish(&e, 5);
    wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_batches_received_total", &[("rank", "0")]) >= 5.0
    });
    b.kill();
    e.with(|p| {
        p.restart();
        p.identity = Some(Identity::VllmUuid([0x58; 16]));
    });
    truth.live.clear();
    truth.publish(&e, 40);
    let (b, maddr, replay_ep) = bridge(dir.path(), &e, &snap);
    let page = wait_metrics(maddr, T, |p| outcome(p, "snapshot") >= 1.0);
    assert_eq!(
        metric(&page, "kvbridge_rank_exact", &[("rank", "0")]),
        1.0,
        "{page}"
    );
    assert_eq!(held(&replay_ep), truth.live, "the new incarnation's state");
    drop(b);
}

/// An SGLang worker on #34407's wire (its epoch in the topic) with a replay buffer of 10 batches
/// and its placement snapshot service open, past its buffer (40 batches published); returns it,
/// the snapshot endpoint and what it holds.
fn sglang_worker() -> (Engine, String, Truth) {
    let e = Engine::start(0);
    let snap = e.with(move |p| {
        p.identity = Some(Identity::SglangEpoch("epoch-1".into()));
        p.set_buffer_steps(10);
        p.serve_placements_at("tcp://127.0.0.1:*").unwrap()
    });
    let mut truth = Truth {
        layout: Layout::Sglang0523,
        ..Truth::default()
    };
    truth.publish(&e, 40);
    (e, snap, truth)
}

/// kvbridge started after an SGLang worker's replay buffer wrapped takes the worker's placement
/// snapshot (barrier, header, chunks, end): hash-only consumers hold the worker's state, the
/// rank is exact, and the live batches after the barrier follow.
#[test]
fn a_late_start_past_an_sglang_workers_buffer_bootstraps_from_its_placement_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (e, snap, mut truth) = sglang_worker();
    let (b, maddr, replay_ep) = bridge(dir.path(), &e, &snap);
    let page = wait_metrics(maddr, T, |p| outcome(p, "snapshot") >= 1.0);
    assert_eq!(outcome(&page, "snapshot_unavailable"), 0.0, "{page}");
    assert_eq!(
        metric(&page, "kvbridge_rank_exact", &[("rank", "0")]),
        1.0,
        "a snapshot makes the rank exact:\n{page}"
    );
    assert_eq!(held(&replay_ep), truth.live, "the placement state");
    truth.follow(&e, &replay_ep, "the live batches after the barrier");
    let page = common::scrape(maddr);
    assert_eq!(
        metric(
            &page,
            "kvbridge_synthesized_clears_total",
            &[("rank", "0"), ("cause", "missing_history")]
        ),
        1.0,
        "one clear, the snapshot's:\n{page}"
    );
    assert_eq!(
        metric(&page, "kvbridge_engine_restarts_total", &[("rank", "0")]),
        0.0,
        "the barrier's epoch is the snapshot's:\n{page}"
    );
    drop(b);
}

/// Under `--profile smg` a state without tokens cannot rebuild an SMG consumer: kvbridge declines
/// the placement snapshot and the rank says its history is missing.
#[test]
fn the_smg_profile_declines_an_sglang_placement_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (e, snap, _truth) = sglang_worker();
    let mut args = base_args(&[&e]);
    let at = args.iter().position(|a| a == "all").expect("--profile all");
    args[at] = "smg".into();
    args.extend(["--engine-snapshot".to_string(), snap]);
    let (b, maddr) = Bridge::start_with_metrics(dir.path(), &dir.path().join("ring"), &args);
    let page = wait_metrics(maddr, T, |p| {
        outcome(p, "snapshot_unavailable") >= 1.0
            && metric(
                p,
                "kvbridge_rank_degraded",
                &[("rank", "0"), ("cause", "missing_history")],
            ) == 1.0
    });
    assert_eq!(outcome(&page, "snapshot"), 0.0, "{page}");
    drop(b);
}
