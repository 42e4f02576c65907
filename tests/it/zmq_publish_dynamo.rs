//! `serve --publish-zmq` read by Dynamo's standalone KV indexer (PyPI `ai-dynamo-runtime`,
//! scripts/dynamo-venv.sh): it scores right through kvbridge (and wrong from the engine alone),
//! and reads two ranks on port + rank.

use crate::common;

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use common::zmq_publish::*;
use common::{metric, scrape, Bridge, Engine};
use serde_json::Value;

/// Dynamo's standalone KV indexer (`python -m dynamo.indexer`, scripts/dynamo-venv.sh), a child
/// process on port 0, driven over its HTTP API.
struct Indexer {
    child: std::process::Child,
    port: u16,
}

impl Indexer {
    fn start(dir: &std::path::Path) -> Indexer {
        let python = common::setup_script(
            "dynamo-venv.sh",
            &[],
            "Python >= 3.10 and PyPI (ai-dynamo-runtime)",
        );
        let log_path = dir.join("indexer.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Command::new(python)
            .args(["-m", "dynamo.indexer", "--port", "0"])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        // It logs the port as given (0), not as bound: the bound one is its listening socket.
        let pid = child.id();
        let port = common::eventually(
            "the indexer listens",
            Duration::from_secs(30),
            || match child.try_wait() {
                Ok(Some(st)) => panic!(
                    "the indexer exited ({st}):\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ),
                _ => match common::listening_ports(pid).as_slice() {
                    [p] => Ok(*p),
                    other => Err(other.to_vec()),
                },
            },
        );
        let ix = Indexer { child, port };
        common::eventually("the indexer answers", Duration::from_secs(30), || {
            ix.try_http("GET", "/workers", "").ok_or(port)
        });
        ix
    }

    fn try_http(&self, method: &str, path: &str, body: &str) -> Option<String> {
        use std::io::Read;
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let (head, body) = out.split_once("\r\n\r\n")?;
        assert!(
            head.starts_with("HTTP/1.1 2"),
            "{method} {path} {body}: {head}\n{body}"
        );
        Some(body.to_string())
    }

    fn post(&self, path: &str, body: Value) -> Value {
        let text = self
            .try_http("POST", path, &body.to_string())
            .expect("indexer HTTP");
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }

    /// Registers `instance` (rank `dp_rank`) at these endpoints, block size 16, model `m`.
    fn register(&self, instance: u64, dp_rank: u32, endpoint: &str, replay: &str) {
        self.post(
            "/register",
            serde_json::json!({
                "instance_id": instance, "endpoint": endpoint, "replay_endpoint": replay,
                "model_name": "m", "block_size": 16, "dp_rank": dp_rank,
            }),
        );
    }

    /// Matched blocks per instance for a request with `tokens`.
    fn scores(&self, tokens: &[u32]) -> Value {
        self.post(
            "/query",
            serde_json::json!({ "token_ids": tokens, "model_name": "m" }),
        )
    }
}

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tokens_of(ev: &kvbridge_tools::sim::SimEvent) -> Vec<u32> {
    match ev {
        kvbridge_tools::sim::SimEvent::Stored { tokens, .. } => tokens.clone(),
        _ => unreachable!(),
    }
}

/// `scores[instance][rank]` of a `/query` answer: tokens matched (0: none).
fn score(v: &Value, instance: u64, rank: u32) -> u64 {
    v["scores"][instance.to_string()][rank.to_string()]
        .as_u64()
        .unwrap_or(0)
}

/// Publishes `marker` (a store, idempotent) until every instance of `instances` scores its 4
/// blocks: each has then applied everything published before it.
fn settle(
    ix: &Indexer,
    engine: &Engine,
    marker: &kvbridge_tools::sim::SimEvent,
    instances: &[u64],
) {
    let tokens = tokens_of(marker);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = marker.clone();
        engine.publish(kvbridge_tools::sim::Layout::Vllm033, vec![m], 0);
        let v = ix.scores(&tokens);
        if instances.iter().all(|i| score(&v, *i, 0) == 64) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the indexer never applied the marker: {v}"
        );
        // The poll interval of a wait that publishes the marker again each time.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Dynamo's real standalone indexer routes right through kvbridge where pointing it at the
/// engine goes wrong: an engine restart mid-run (the engine's instance keeps the dead engine's
/// blocks), an indexer registered after the engine published and after its replay buffer rolled
/// (the engine's instance never learns the old blocks), and kvbridge restarted under a
/// registered indexer (its instance carries on). Instances 1 and 3 read the engine itself, 2
/// and 4 read kvbridge: the same events, the same indexer.
#[test]
fn dynamo_indexer_scores_right_through_kvbridge_and_wrong_from_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engine = Engine::start(0);
    engine.with(|p| p.set_buffer_steps(200));
    let mut args = base_args(&[&engine]);
    args.extend(["--ring-size", "1MiB", "--snapshot-chunk-size", "16KiB"].map(String::from));
    // Port 0: the ready file says where; the restart below comes back on the same endpoints,
    // which the indexer has registered.
    args.extend(publish_args("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"));
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    let (pub_ep, replay_ep) = endpoints(&bridge, 1).remove(0);
    let ix = Indexer::start(dir.path());
    ix.register(1, 0, &engine.endpoint, &engine.replay);
    ix.register(2, 0, &pub_ep, &replay_ep);
    let a = common::store(1, 4, None);
    let ta = tokens_of(&a);
    engine.publish(kvbridge_tools::sim::Layout::Vllm033, vec![a], 0);
    settle(&ix, &engine, &common::store(2, 4, None), &[1, 2]);
    let v = ix.scores(&ta);
    assert_eq!((score(&v, 1, 0), score(&v, 2, 0)), (64, 64), "{v}");

    // 1. The engine restarts (empty cache, seq back to 0) on the same endpoints.
    let (ep, rp) = (engine.endpoint.clone(), engine.replay.clone());
    drop(engine);
    let engine = Engine::start_at(&ep, &rp);
    engine.with(|p| p.set_buffer_steps(200));
    settle(&ix, &engine, &common::store(3, 4, None), &[1, 2]);
    let v = ix.scores(&ta);
    assert_eq!(
        score(&v, 2, 0),
        0,
        "through kvbridge the restart cleared the old blocks: {v}"
    );
    assert_eq!(
        score(&v, 1, 0),
        64,
        "from the engine itself the indexer keeps the dead engine's blocks: {v}"
    );

    // 2. Long-lived blocks, then churn until the ring wrapped and the engine's buffer rolled;
    // then an indexer registration that has never seen this engine.
    let l = common::store(4, 4, None);
    let tl = tokens_of(&l);
    engine.publish(kvbridge_tools::sim::Layout::Vllm033, vec![l], 0);
    let mut n = 0u64;
    loop {
        let page = scrape(maddr);
        if n >= 300 && metric(&page, "kvbridge_ring_oldest_seq", &[("ring", "merged")]) > 1.0 {
            break;
        }
        for _ in 0..50 {
            let ev = common::store(2_000_000 + n, 8, None);
            let hashes = match &ev {
                kvbridge_tools::sim::SimEvent::Stored { hashes, .. } => hashes.clone(),
                _ => unreachable!(),
            };
            engine.publish(
                kvbridge_tools::sim::Layout::Vllm033,
                vec![
                    ev,
                    kvbridge_tools::sim::SimEvent::Removed {
                        hashes,
                        medium: Some("GPU".into()),
                    },
                ],
                0,
            );
            n += 1;
        }
    }
    ix.register(3, 0, &engine.endpoint, &engine.replay);
    ix.register(4, 0, &pub_ep, &replay_ep);
    settle(&ix, &engine, &common::store(5, 4, None), &[1, 2, 3, 4]);
    let v = ix.scores(&tl);
    assert_eq!(
        score(&v, 4, 0),
        64,
        "a late registration through kvbridge knows every block: {v}"
    );
    assert_eq!(
        score(&v, 3, 0),
        0,
        "the engine's replay no longer reaches the long-lived blocks: {v}"
    );

    // 3. kvbridge restarts under the registered indexer: its instances carry on.
    let bridge = bridge.restart(dir.path());
    assert_eq!(
        endpoints(&bridge, 1),
        [(pub_ep.clone(), replay_ep.clone())],
        "the same endpoints"
    );
    settle(&ix, &engine, &common::store(6, 4, None), &[2, 4]);
    let v = ix.scores(&tl);
    assert_eq!(
        (score(&v, 2, 0), score(&v, 4, 0)),
        (64, 64),
        "after a kvbridge restart: {v}"
    );
    drop(bridge);
}

/// Two DP ranks registered with Dynamo's indexer per rank, on kvbridge's PORT + r: each rank's
/// blocks score on that rank only.
#[test]
fn dynamo_indexer_reads_two_ranks_on_port_plus_rank() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let (e0, e1) = (Engine::start(0), Engine::start(1));
    let (p, r, bridge) = two_rank_bridge(dir.path(), &ring, &e0, &e1);
    let ix = Indexer::start(dir.path());
    for rank in 0..2u16 {
        ix.register(
            7,
            u32::from(rank),
            &format!("tcp://127.0.0.1:{}", p + rank),
            &format!("tcp://127.0.0.1:{}", r + rank),
        );
    }
    let (x, y) = (common::store(11, 4, None), common::store(12, 4, None));
    let (tx, ty) = (tokens_of(&x), tokens_of(&y));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        e0.publish(kvbridge_tools::sim::Layout::Vllm033, vec![x.clone()], 0);
        e1.publish(kvbridge_tools::sim::Layout::Vllm022, vec![y.clone()], 1);
        let (vx, vy) = (ix.scores(&tx), ix.scores(&ty));
        if score(&vx, 7, 0) == 64 && score(&vy, 7, 1) == 64 {
            assert_eq!(score(&vx, 7, 1), 0, "rank 0's blocks on rank 1: {vx}");
            assert_eq!(score(&vy, 7, 0), 0, "rank 1's blocks on rank 0: {vy}");
            break;
        }
        assert!(Instant::now() < deadline, "{vx} {vy}");
        // The poll interval of a wait that publishes the stores again each time.
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(bridge);
}
