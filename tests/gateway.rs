//! The real gateway end to end (issue 9): PyPI `smg` 1.13.0 (pinned in `scripts/smg-venv.sh`)
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
//!
//! FAILS (never skips) when the wheel cannot be installed.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, layout, metric, scrape, wait_metrics, Bridge, Engine};
use kvbridge::sim::SimEvent;

const T: Duration = Duration::from_secs(60);
const BLOCK: usize = 16;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `scripts/smg-venv.sh` (idempotent); the `smg` command beside the python it prints.
fn smg_command() -> PathBuf {
    let out = Command::new("bash")
        .arg(repo().join("scripts/smg-venv.sh"))
        .env("CARGO_TARGET_DIR", target_dir())
        .output()
        .expect("cannot run bash scripts/smg-venv.sh");
    assert!(
        out.status.success(),
        "scripts/smg-venv.sh failed (Python >= 3.10 with pip and PyPI access are required)\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let py = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .expect("smg-venv.sh printed no path")
        .trim()
        .to_string();
    let smg = Path::new(&py).with_file_name("smg");
    assert!(smg.exists(), "no smg command beside {py}");
    smg
}

/// The target directory this test binary was built into (the venv lives there).
fn target_dir() -> PathBuf {
    if let Ok(d) = std::env::var("CARGO_TARGET_DIR") {
        return d.into();
    }
    // …/target/release/deps/gateway-HASH → …/target
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_path_buf()
}

/// A child process killed (by its own id) when dropped.
struct Proc(Child, PathBuf);

impl Proc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(name: &'static str, dir: &Path, cmd: &mut Command) -> Proc {
    let log = dir.join(format!("{name}.log"));
    let f = std::fs::File::create(&log).unwrap();
    let child = cmd
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    Proc(child, log)
}

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

/// POST `body` (JSON) to the gateway; (status, body).
fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// The gateway's Prometheus page.
fn get_metrics(port: u16) -> String {
    let Ok(mut c) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    c.set_read_timeout(Some(T)).unwrap();
    let _ = write!(
        c,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    );
    let mut page = String::new();
    let _ = c.read_to_string(&mut page);
    page
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

fn worker(name: &'static str, dir: &Path, py: &Path, tok: &Path, gen_log: &Path) -> Worker {
    let port = free_port();
    let engine = spawn(
        if name == "A" { "engine-a" } else { "engine-b" },
        dir,
        Command::new(py).args([
            repo().join("tests/interop/smg_engine.py").to_str().unwrap(),
            &port.to_string(),
            name,
            tok.to_str().unwrap(),
            gen_log.to_str().unwrap(),
        ]),
    );
    let deadline = Instant::now() + T;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "engine {name} did not start:\n{}",
            engine.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let zmq = Engine::start(0);
    let args: Vec<String> = [
        "--zmq",
        &zmq.endpoint,
        "--replay",
        &zmq.replay,
        "--seq-base",
        "1",
        "--engine-grpc",
        &format!("127.0.0.1:{port}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (bridge, metrics) =
        Bridge::start_with_metrics(dir, &dir.join(format!("ring-{name}")), &args);
    wait_metrics(metrics, T, |p| {
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

#[test]
fn smg_gateway_routes_through_sidecars_to_the_worker_holding_the_prefix() {
    let smg = smg_command();
    let py = smg.with_file_name("python");
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer");
    write_tokenizer(&tok);
    let gen_log = dir.path().join("generate.jsonl");
    let a = worker("A", dir.path(), &py, &tok, &gen_log);
    let b = worker("B", dir.path(), &py, &tok, &gen_log);

    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let prom = free_port();
    let gateway = spawn(
        "smg",
        dir.path(),
        Command::new(&smg).args([
            "launch",
            "--worker-urls",
            &format!("grpc://{}", a.bridge.grpc),
            &format!("grpc://{}", b.bridge.grpc),
            "--policy",
            "cache_aware",
            "--host",
            "127.0.0.1",
            "--port",
            &http.port().to_string(),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &prom.to_string(),
            "--block-size",
            &BLOCK.to_string(),
            // The gateway's own GetLoads polling once an hour: what it learns about load
            // during the test comes from kvbridge's load records.
            "--load-monitor-interval",
            "3600",
        ]),
    );
    let fail = |what: &str| -> ! {
        panic!(
            "{what}\n--- smg ---\n{}\n--- kvbridge A ---\n{}\n--- kvbridge B ---\n{}",
            gateway.log(),
            a.bridge.log(),
            b.bridge.log()
        )
    };

    // The gateway subscribes to KV events on each worker URL, i.e. on kvbridge.
    let sub_path = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents";
    for w in [&a, &b] {
        let deadline = Instant::now() + T;
        while metric(
            &scrape(w.metrics),
            "kvbridge_subscribers",
            &[("path", sub_path)],
        ) < 1.0
        {
            if Instant::now() > deadline {
                fail(&format!(
                    "the gateway never subscribed to worker {}",
                    w.name
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    // Requests pass through and back: a short prompt (under one block) until the gateway
    // answers 200 with the engine's token ("w7").
    let warm: Vec<u32> = (900..905).collect();
    let deadline = Instant::now() + T;
    loop {
        let (status, body) = completion(http, &warm);
        if status == 200 {
            assert!(
                body.contains("\"w7\""),
                "the engine's answer came back: {body}"
            );
            break;
        }
        if Instant::now() > deadline {
            fail(&format!(
                "no completion through the sidecars: {status} {body}"
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        engine_of(&gen_log, &warm).is_some(),
        "a Generate reached an engine"
    );

    // Four prompts of four blocks each, stored on B, A, B, A: each goes to its holder.
    let mut applied = [0.0f64; 2];
    for k in 0..4u32 {
        let tokens: Vec<u32> = (0..(4 * BLOCK) as u32).map(|i| 100 + 150 * k + i).collect();
        let holder = if k % 2 == 0 { &b } else { &a };
        let idx = usize::from(k % 2 == 0);
        holder
            .zmq
            .publish(layout(0), vec![store_of(&tokens, k as u64 + 1)], 0);
        // Applied by the gateway, by its own count, for the holder's worker URL (the
        // gateway's KV subscription is served by the holder's kvbridge).
        applied[idx] += 1.0;
        let want = applied[idx];
        let worker_url = format!("grpc://{}", holder.bridge.grpc);
        let deadline = Instant::now() + T;
        while metric(
            &get_metrics(prom),
            "smg_kv_event_batches_total",
            &[("worker", &worker_url), ("disposition", "applied")],
        ) < want
        {
            if Instant::now() > deadline {
                fail(&format!(
                    "the gateway never applied the store of prompt {k}"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Routed to the holder.
        let mut prompt = tokens.clone();
        prompt.extend([990, 991, 992]);
        let (status, body) = completion(http, &prompt);
        if status != 200 {
            fail(&format!("prompt {k}: {status} {body}"));
        }
        let got = engine_of(&gen_log, &prompt).unwrap_or_default();
        if got != holder.name {
            fail(&format!(
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
    let before = get_metrics(prom);
    assert_eq!(gauge(&before), 0.0, "B idle before");
    std::fs::write(gen_log.with_extension("jsonl.running-B"), "37").unwrap();
    let changed = Instant::now();
    let page = loop {
        let page = get_metrics(prom);
        if gauge(&page) == 37.0 {
            break page;
        }
        if changed.elapsed() > T {
            fail("the gateway's view of B's load never followed the engine's");
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
    drop(gateway);
    a.bridge.stop();
    b.bridge.stop();
}
