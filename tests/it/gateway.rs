//! The real gateway end to end: PyPI `smg` 1.13.0 (pinned in `scripts/smg-venv.sh`)
//! with a `cache_aware` policy and two gRPC workers whose URLs are two `kvbridge serve
//! --engine-grpc` sidecars, each in front of its own engine (`tests/interop/smg_engine.py`, a
//! minimal vLLM-shaped gRPC server) and fed by its own simulated ZMQ publisher.
//!
//! Shown from the gateway's own behaviour:
//! - registration, runtime detection (vLLM), model info, `Generate` and its answer all pass
//!   through the sidecars (the HTTP completion comes back with the engine's token);
//! - the gateway subscribes to `SubscribeKvEvents` on each worker URL, i.e. on kvbridge;
//! - a prompt whose blocks were stored on worker X (events published into X's kvbridge) is
//!   routed to X: four prompts, stored alternately on B, A, B, A, each go to the engine that
//!   holds them (the engines log every `Generate`'s prompt tokens), each request sent once the
//!   gateway's own `smg_kv_event_batches_total{disposition="applied"}` for that worker URL shows
//!   the store applied;
//! - the gateway's view of a worker's load (`smg_engine_running_requests`) follows the engine's
//!   `GetLoads` through the sidecar's `load_only` records, which it counts as applied.
//! - a gateway started only after a worker's ring wrapped past the store of a prompt's blocks
//!   (1 MiB rings, filler traffic) learns them from that worker's snapshot chunks (its own
//!   `smg_kv_event_blocks_total{op="snapshot"}`) and routes the prompt there, although the
//!   other worker holds the prompt's first two blocks in its window (with `--snapshot off` on
//!   the holder the prompt goes to the other worker).
//!
//! FAILS (never skips) when the wheel cannot be installed.

use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::smg::{get_metrics, post, smg_command, spawn, Proc, Smg};
use common::{layout, metric, repo, store, Bridge, Engine};
use kvbridge_tools::sim::SimEvent;

const T: Duration = Duration::from_secs(60);
const BLOCK: usize = 16;

/// A word-level tokenizer: "wN" is token N (3 ≤ N < 1000), whitespace splits.
fn write_tokenizer(dir: &Path) {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    vocab.insert("<eos>".into(), 2.into());
    for i in 3..1000 {
        vocab.insert(format!("w{i}"), i.into());
    }
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<eos>", "model_max_length": 4096}"#,
    )
    .unwrap();
}

fn completion(addr: SocketAddr, tokens: &[u32]) -> (u16, String) {
    let prompt: Vec<String> = tokens.iter().map(|t| format!("w{t}")).collect();
    let body = serde_json::json!({
        "model": "kvbridge-test-model",
        "prompt": prompt.join(" "),
        "max_tokens": 1,
    });
    post(addr, "/v1/completions", &body.to_string())
}

/// The engine that received the Generate whose prompt is `tokens` (from the engines' log).
fn engine_of(log: &Path, tokens: &[u32]) -> Option<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().rev().find_map(|l| {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        let prompt: Vec<u32> = serde_json::from_value(v["prompt"].clone()).ok()?;
        (prompt == tokens).then(|| v["engine"].as_str().unwrap().to_string())
    })
}

/// A store of `tokens` (a whole number of blocks) as one chain from the root.
fn store_of(tokens: &[u32], seed: u64) -> SimEvent {
    SimEvent::Stored {
        hashes: (0..(tokens.len() / BLOCK) as u64)
            .map(|i| seed * 1_000 + i + 1)
            .collect(),
        parent: None,
        tokens: tokens.to_vec(),
        block_size: BLOCK as u32,
        medium: Some("GPU".into()),
    }
}

struct Worker {
    name: &'static str,
    zmq: Engine,
    bridge: Bridge,
    metrics: SocketAddr,
    _engine: Proc,
}

/// Engine `name` (its gRPC server) and its kvbridge sidecar (`extra`: more `serve` flags), fed
/// by its own simulated publisher.
fn worker(
    name: &'static str,
    dir: &Path,
    py: &Path,
    tok: &Path,
    gen_log: &Path,
    extra: &[&str],
) -> Worker {
    // Port 0: the engine's listening socket (the only one it has) says where it is.
    let mut engine = spawn(
        if name == "A" { "engine-a" } else { "engine-b" },
        dir,
        Command::new(py).args([
            repo().join("tests/interop/smg_engine.py").to_str().unwrap(),
            "0",
            name,
            tok.to_str().unwrap(),
            gen_log.to_str().unwrap(),
        ]),
    );
    let pid = engine.0.id();
    let port = common::eventually("the engine listens", T, || {
        if let Ok(Some(st)) = engine.0.try_wait() {
            panic!("engine {name} exited ({st}):\n{}", engine.log());
        }
        match common::listening_ports(pid).as_slice() {
            [p] => Ok(*p),
            other => Err(other.to_vec()),
        }
    });
    let zmq = Engine::start(0);
    let engine_grpc = format!("127.0.0.1:{port}");
    let args: Vec<String> = [
        "--zmq",
        &zmq.endpoint,
        "--replay",
        &zmq.replay,
        "--seq-base",
        "1",
        "--engine-grpc",
        &engine_grpc,
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    let (bridge, metrics) =
        Bridge::start_with_metrics(dir, &dir.join(format!("ring-{name}")), &args);
    common::wait_metrics(metrics, T, |p| {
        metric(p, "kvbridge_upstream_connected", &[("rank", "0")]) >= 1.0
    });
    Worker {
        name,
        zmq,
        bridge,
        metrics,
        _engine: engine,
    }
}

/// What every test starts with: the smg venv's python, a tokenizer, the engines' Generate log.
struct Setup {
    py: PathBuf,
    dir: tempfile::TempDir,
    tok: PathBuf,
    gen_log: PathBuf,
}

fn setup() -> Setup {
    let py = smg_command().with_file_name("python");
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer");
    write_tokenizer(&tok);
    let gen_log = dir.path().join("generate.jsonl");
    Setup {
        py,
        dir,
        tok,
        gen_log,
    }
}

impl Setup {
    fn worker(&self, name: &'static str, extra: &[&str]) -> Worker {
        worker(
            name,
            self.dir.path(),
            &self.py,
            &self.tok,
            &self.gen_log,
            extra,
        )
    }
}

/// The real gateway, `cache_aware`, over the two workers' sidecar URLs.
struct Gateway<'a> {
    smg: Smg,
    http: SocketAddr,
    prom: u16,
    workers: [&'a Worker; 2],
}

impl<'a> Gateway<'a> {
    fn launch(s: &Setup, workers: [&'a Worker; 2]) -> Gateway<'a> {
        let urls = workers.map(|w| format!("grpc://{}", w.bridge.grpc));
        let smg = Smg::launch(
            "smg",
            s.dir.path(),
            &urls,
            "cache_aware",
            BLOCK,
            // The gateway's own GetLoads polling once an hour: what it learns about load
            // during the test comes from kvbridge's load records.
            &["--load-monitor-interval", "3600"],
        );
        Gateway {
            http: smg.http,
            prom: smg.prom,
            smg,
            workers,
        }
    }

    /// Panics with `what` and every log.
    fn fail(&self, what: &str) -> ! {
        let [a, b] = self.workers;
        panic!(
            "{what}\n--- smg ---\n{}\n--- kvbridge {} ---\n{}\n--- kvbridge {} ---\n{}",
            self.smg.proc.log(),
            a.name,
            a.bridge.log(),
            b.name,
            b.bridge.log()
        )
    }

    /// Polls the gateway's own metric `name{labels}` until it reaches `want`.
    fn wait_metric(&self, name: &str, labels: &[(&str, &str)], want: f64, what: &str) {
        let deadline = Instant::now() + T;
        while metric(&get_metrics(self.prom), name, labels) < want {
            if Instant::now() > deadline {
                self.fail(what);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The gateway subscribes to KV events on each worker URL, i.e. on kvbridge; then a short
    /// prompt (under one block) passes through and back with the engine's token ("w7").
    fn wait_ready(&self, gen_log: &Path) {
        let sub_path = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents";
        for w in self.workers {
            let deadline = Instant::now() + T;
            while metric(
                &get_metrics(w.metrics.port()),
                "kvbridge_subscribers",
                &[("path", sub_path)],
            ) < 1.0
            {
                if Instant::now() > deadline {
                    self.fail(&format!(
                        "the gateway never subscribed to worker {}",
                        w.name
                    ));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let warm: Vec<u32> = (900..905).collect();
        let deadline = Instant::now() + T;
        loop {
            let (status, body) = completion(self.http, &warm);
            if status == 200 {
                assert!(
                    body.contains("\"w7\""),
                    "the engine's answer came back: {body}"
                );
                break;
            }
            if Instant::now() > deadline {
                self.fail(&format!(
                    "no completion through the sidecars: {status} {body}"
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        assert!(
            engine_of(gen_log, &warm).is_some(),
            "a Generate reached an engine"
        );
    }

    /// Sends `prompt`; the name of the engine that received it.
    fn route(&self, gen_log: &Path, prompt: &[u32]) -> String {
        let (status, body) = completion(self.http, prompt);
        if status != 200 {
            self.fail(&format!("{prompt:?}: {status} {body}"));
        }
        engine_of(gen_log, prompt).unwrap_or_default()
    }
}

/// The prompt `k`: four blocks of its own tokens.
fn blocks_of_prompt(k: u32) -> Vec<u32> {
    (0..(4 * BLOCK) as u32).map(|i| 100 + 150 * k + i).collect()
}

/// A block-aligned prompt plus a tail under one block (the gateway matches whole blocks).
fn with_tail(tokens: &[u32]) -> Vec<u32> {
    let mut prompt = tokens.to_vec();
    prompt.extend([990, 991, 992]);
    prompt
}

#[test]
fn smg_gateway_routes_through_sidecars_to_the_worker_holding_the_prefix() {
    let s = setup();
    let a = s.worker("A", &[]);
    let b = s.worker("B", &[]);
    let gw = Gateway::launch(&s, [&a, &b]);
    gw.wait_ready(&s.gen_log);

    // Four prompts of four blocks each, stored on B, A, B, A: each goes to its holder.
    let mut applied = [0.0f64; 2];
    for k in 0..4u32 {
        let tokens = blocks_of_prompt(k);
        let holder = if k % 2 == 0 { &b } else { &a };
        let idx = usize::from(k % 2 == 0);
        holder
            .zmq
            .publish(layout(0), vec![store_of(&tokens, k as u64 + 1)], 0);
        // Applied by the gateway, by its own count, for the holder's worker URL (the
        // gateway's KV subscription is served by the holder's kvbridge).
        applied[idx] += 1.0;
        let worker_url = format!("grpc://{}", holder.bridge.grpc);
        gw.wait_metric(
            "smg_kv_event_batches_total",
            &[("worker", &worker_url), ("disposition", "applied")],
            applied[idx],
            &format!("the gateway never applied the store of prompt {k}"),
        );
        // Routed to the holder.
        let got = gw.route(&s.gen_log, &with_tail(&tokens));
        if got != holder.name {
            gw.fail(&format!(
                "prompt {k} stored on {} was routed to {got:?}",
                holder.name
            ));
        }
    }
    // Load: the engine behind B reports 37 running requests; the gateway's view of B follows
    // from the sidecar's `load_only` records (G2 polls GetLoads itself every 10 s by default;
    // here once an hour).
    let b_url = format!("grpc://{}", b.bridge.grpc);
    let gauge = |page: &str| {
        metric(
            page,
            "smg_engine_running_requests",
            &[("worker", &b_url), ("dp_rank", "0")],
        )
    };
    let polls = |page: &str| {
        metric(
            page,
            "smg_engine_load_polls_total",
            &[("worker", &b_url), ("mode", "poll")],
        )
    };
    let before = get_metrics(gw.prom);
    assert_eq!(gauge(&before), 0.0, "B idle before");
    std::fs::write(s.gen_log.with_extension("jsonl.running-B"), "37").unwrap();
    let changed = Instant::now();
    let page = loop {
        let page = get_metrics(gw.prom);
        if gauge(&page) == 37.0 {
            break page;
        }
        if changed.elapsed() > T {
            gw.fail("the gateway's view of B's load never followed the engine's");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    println!(
        "gateway saw B's running requests change after {:?} (kvbridge --load-interval-ms 500)",
        changed.elapsed()
    );
    assert!(
        metric(
            &page,
            "smg_kv_event_batches_total",
            &[("worker", &b_url), ("disposition", "load_only")]
        ) >= 1.0,
        "load_only records applied by the gateway"
    );
    assert_eq!(
        polls(&page),
        polls(&before),
        "not from the gateway's own GetLoads poll"
    );
    drop(gw);
    a.bridge.stop();
    b.bridge.stop();
}

/// kvbridge's ring window (oldest, newest), from its metrics.
fn window(w: &Worker) -> (f64, f64) {
    let page = get_metrics(w.metrics.port());
    (
        metric(&page, "kvbridge_ring_oldest_seq", &[]),
        metric(&page, "kvbridge_ring_newest_seq", &[]),
    )
}

#[test]
fn smg_gateway_started_after_the_ring_wrapped_routes_to_the_worker_holding_the_prefix() {
    let s = setup();
    // The smallest ring kvbridge accepts, so that a few hundred batches wrap it.
    let a = s.worker("A", &["--ring-size", "1MiB"]);
    let b = s.worker("B", &["--ring-size", "1MiB"]);

    // B's engine stores the whole prompt (four blocks); A's engine its first two blocks, so
    // that a gateway that did not learn B's store routes the prompt to A (a match above the
    // cache_aware threshold there, nothing on B), never to B by a tie.
    let tokens = blocks_of_prompt(0);
    b.zmq.publish(layout(0), vec![store_of(&tokens, 1)], 0);
    common::eventually("B ingested the store", T, || {
        let w = window(&b);
        if w.1 >= 1.0 {
            Ok(())
        } else {
            Err(w)
        }
    });
    let stored_at = window(&b).1;

    // Unrelated traffic into B until its ring no longer holds the store: each batch stores
    // eight fresh 16-block chains and removes them again (B's block table stays one prompt).
    let mut seed = 100;
    let deadline = Instant::now() + T;
    while window(&b).0 <= stored_at {
        assert!(
            Instant::now() < deadline,
            "B's ring never wrapped past the store at {stored_at}: {:?}",
            window(&b)
        );
        for _ in 0..20 {
            let stores: Vec<SimEvent> = (0..8)
                .map(|_| {
                    seed += 1;
                    store(seed, 16, None)
                })
                .collect();
            let removes = stores.iter().map(|e| match e {
                SimEvent::Stored { hashes, .. } => SimEvent::Removed {
                    hashes: hashes.clone(),
                    medium: Some("GPU".into()),
                },
                _ => unreachable!(),
            });
            let batch = stores.clone().into_iter().chain(removes).collect();
            b.zmq.publish(layout(0), batch, 0);
        }
        // Pacing: 20 batches, then a look at the window, so that B's ingest keeps up with the
        // publisher (a ZMQ pipe never has to drop).
        std::thread::sleep(Duration::from_millis(50));
    }
    let (oldest, newest) = window(&b);
    println!("B's ring wrapped: the store is #{stored_at}, the window {oldest}..={newest}");

    // A holds the first two blocks, in its window.
    a.zmq
        .publish(layout(0), vec![store_of(&tokens[..2 * BLOCK], 2)], 0);
    common::eventually("A ingested its store", T, || {
        let w = window(&a);
        if w.1 >= 1.0 {
            Ok(())
        } else {
            Err(w)
        }
    });

    // Only now the gateway.
    let gw = Gateway::launch(&s, [&a, &b]);
    gw.wait_ready(&s.gen_log);
    // The gateway's own counts: B's four blocks arrived as a snapshot (B's ring no longer
    // holds their store), A's store as an ordinary batch from A's window.
    let b_url = format!("grpc://{}", b.bridge.grpc);
    gw.wait_metric(
        "smg_kv_event_blocks_total",
        &[("worker", &b_url), ("op", "snapshot")],
        4.0,
        "the gateway never applied B's snapshot of the four blocks",
    );
    gw.wait_metric(
        "smg_kv_event_batches_total",
        &[
            ("worker", &format!("grpc://{}", a.bridge.grpc)),
            ("disposition", "applied"),
        ],
        1.0,
        "the gateway never applied A's store",
    );
    let got = gw.route(&s.gen_log, &with_tail(&tokens));
    if got != "B" {
        gw.fail(&format!(
            "the prompt stored on B before the window was routed to {got:?}"
        ));
    }
    drop(gw);
    a.bridge.stop();
    b.bridge.stop();
}
