//! Shared test harness: a simulated engine on its own thread, the real `kvbridge` binary as a
//! child process, and gRPC subscribers. The submodules hold what a family of test modules
//! shares (`ops` for `ops_*`, `proxy` for `proxy_*`, `zmq_publish` for `zmq_publish_*`, `nats`
//! for `nats_*`, `prop_batch` for `decode_prop_*`) or a peer the tests drive (`grpc_engine`,
//! `real_engine`, `smg`).

pub mod grpc_engine;
pub mod nats;
pub mod ops;
pub mod prop_batch;
pub mod proxy;
pub mod raw_h2;
pub mod real_engine;
pub mod smg;
pub mod zmq_publish;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvbridge::proto::common::{kv_cache_event::Data, KvEventBatch, SubscribeKvEventsRequest};
use kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient;
use kvbridge_tools::sim::{EnginePublisher, Layout, SimEvent, Workload};

/// A TCP port on loopback that was free a moment ago (bound and released): another process
/// can take it before the caller binds it. Only for a peer that cannot bind port 0 and say
/// where, or for a set of ports a rule fixes (PORT + rank); the caller starts again on fresh
/// ports when the start fails on a taken one ([`retry_on_taken_port`]).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `start` (which picks its ports with [`free_port`]) until it does not fail on a taken
/// port: `Err(reason)` whose reason says the address was in use is tried again, up to 10
/// times; any other `Err` fails the test.
pub fn retry_on_taken_port<T>(mut start: impl FnMut() -> Result<T, String>) -> T {
    let mut last = String::new();
    for _ in 0..10 {
        match start() {
            Ok(v) => return v,
            Err(e) if e.contains("in use") || e.contains("cannot bind") => last = e,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("10 starts failed on a taken port; the last:\n{last}")
}

/// The TCP ports process `pid` listens on (its sockets, from /proc): how the harness learns the
/// port of a peer that binds port 0 but does not say which port it got.
pub fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is f[1] (HEXIP:HEXPORT), st f[3] (0A: LISTEN), inode f[9].
            if f.len() > 9 && f[3] == "0A" && inodes.contains(f[9]) {
                if let Some(p) = f[1].rsplit(':').next() {
                    ports.push(u16::from_str_radix(p, 16).unwrap());
                }
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// How often the waits below look again: often enough not to add latency a test would notice,
/// rarely enough to cost nothing beside the processes under test.
const POLL: Duration = Duration::from_millis(10);

/// Waits for a state: calls `check` until it returns `Some` and returns that, or panics after
/// `timeout` with `what` and the last `Err` it gave. Every wait of the harness is one of these
/// (or [`eventually_async`]); none sleeps for a fixed time hoping the state has come.
pub fn eventually<T, E: std::fmt::Debug>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, E>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => {
                panic!("timed out after {timeout:?} waiting until {what}: {e:?}")
            }
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// [`eventually`] for a check that is a future (it yields to the runtime between looks).
pub async fn eventually_async<T, E: std::fmt::Debug, F>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> F,
) -> T
where
    F: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(e) if tokio::time::Instant::now() > deadline => {
                panic!("timed out after {timeout:?} waiting until {what}: {e:?}")
            }
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}

type Job = Box<dyn FnOnce(&mut EnginePublisher) + Send>;

/// A simulated engine rank (PUB + replay ROUTER) running on its own thread, like the engine's
/// publisher thread: it answers replay requests between publishes.
pub struct Engine {
    tx: mpsc::Sender<Job>,
    pub endpoint: String,
    pub replay: String,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Engine {
    /// A simulated engine on fresh loopback ports (bound to port 0 by ZMQ's `*`; the bound
    /// endpoints are read back, so no other process can take them in between).
    pub fn start(_rank: u32) -> Engine {
        Engine::start_at("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    }

    /// Runs `f` on the engine thread and returns its result.
    pub fn with<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut EnginePublisher) -> R + Send + 'static,
    ) -> R {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Box::new(move |p| tx.send(f(p)).unwrap()))
            .unwrap();
        rx.recv().unwrap()
    }

    /// Waits until more than `seen` subscriptions have reached this engine (0: until a first
    /// subscriber is subscribed), and returns how many have: publishing before that loses the
    /// batch for a subscriber whose subscription is still on its way.
    pub fn wait_subscribed_after(&self, seen: u64) -> u64 {
        let what = format!("a subscriber subscribed to {}", self.endpoint);
        eventually(&what, Duration::from_secs(30), || {
            let n = self.subscriptions();
            if n > seen {
                Ok(n)
            } else {
                Err(n)
            }
        })
    }

    /// How many subscriptions have reached this engine so far.
    pub fn subscriptions(&self) -> u64 {
        self.with(|p| p.subscriptions())
    }

    /// `kvbridge serve` flags for this engine as one rank: its PUB (kvbridge connects), its
    /// replay ROUTER, and ring numbers from 1.
    pub fn bridge_args(&self) -> Vec<String> {
        [
            "--zmq",
            &self.endpoint,
            "--replay",
            &self.replay,
            "--seq-base",
            "1",
        ]
        .map(String::from)
        .to_vec()
    }

    /// Waits until a first subscriber is subscribed to this engine.
    pub fn wait_subscribed(&self) {
        self.wait_subscribed_after(0);
    }

    /// Publishes a 2-block store per seed, one batch each (vLLM 0.33's layout); returns their
    /// block hashes, in order.
    pub fn publish_stores(&self, seeds: std::ops::Range<u64>) -> Vec<u64> {
        let mut hashes = Vec::new();
        for seed in seeds {
            let ev = store(seed, 2, None);
            if let SimEvent::Stored { hashes: h, .. } = &ev {
                hashes.extend(h);
            }
            self.publish(Layout::Vllm033, vec![ev], 0);
        }
        hashes
    }

    /// Publishes one batch of `events` in `layout`, stamped with the wall clock as the engines
    /// stamp theirs (so two incarnations never send the same bytes); returns its engine seq.
    /// kvbridge's flags for this engine: `--zmq` its PUB, `--replay` its ROUTER.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--zmq".to_string(),
            self.endpoint.clone(),
            "--replay".into(),
            self.replay.clone(),
        ]
    }

    pub fn publish(&self, layout: Layout, events: Vec<SimEvent>, rank: u32) -> u64 {
        self.with(move |p| p.publish_events(layout, now_ts(), &events, rank))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let (tx, _) = mpsc::channel();
        self.tx = tx;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Seconds since the Unix epoch, as the engines write a batch's `ts`.
pub fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A store of `blocks` fresh blocks (16 tokens each) chained to `parent`.
pub fn store(seed: u64, blocks: usize, parent: Option<u64>) -> SimEvent {
    let hashes = (0..blocks as u64)
        .map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i + 1))
        .collect();
    let tokens = (0..blocks * 16)
        .map(|i| ((seed as usize * 31 + i) % 150_000) as u32 + 1)
        .collect();
    SimEvent::Stored {
        hashes,
        parent,
        tokens,
        block_size: 16,
        medium: Some("GPU".into()),
    }
}

/// The real binary, running `serve`.
pub struct Bridge {
    pub child: Child,
    pub grpc: SocketAddr,
    pub shm: PathBuf,
    pub args: Vec<String>,
    pub stderr_log: PathBuf,
    /// The metrics address as bound (from the ready file); `None`: metrics off.
    pub metrics: Option<SocketAddr>,
    /// `--publish-zmq`: each rank's bound (PUB, replay) endpoints, by rank (from the ready file).
    pub publish_zmq: Vec<(String, Option<String>)>,
    /// `--publish-zmq-snapshot`: each rank's bound snapshot ROUTER, by rank.
    pub publish_zmq_snapshot: Vec<Option<String>>,
    /// The `--ready-file` the harness gave it (or the caller did).
    pub ready_file: PathBuf,
}

/// What `--ready-file` says.
struct Ready {
    grpc: SocketAddr,
    metrics: Option<SocketAddr>,
    publish_zmq: Vec<(String, Option<String>)>,
    publish_zmq_snapshot: Vec<Option<String>>,
}

impl Ready {
    /// The file written by process `pid`, or why not (yet).
    fn read(path: &Path, pid: u32) -> Result<Ready, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Written atomically (renamed into place): a file that is there is whole.
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("ready file {text:?}: {e}"));
        if v["pid"] != pid {
            return Err(format!("a ready file of another process: {text}"));
        }
        let addr = |v: &serde_json::Value| -> Option<SocketAddr> {
            v.as_str()
                .map(|a| a.parse().expect("an address in the ready file"))
        };
        let text_of = |v: &serde_json::Value| v.as_str().map(str::to_string);
        Ok(Ready {
            grpc: addr(&v["grpc"]).expect("grpc in the ready file"),
            metrics: addr(&v["metrics"]),
            publish_zmq: v["publish_zmq"]
                .as_array()
                .expect("publish_zmq in the ready file")
                .iter()
                .map(|r| (text_of(&r["publish"]).unwrap(), text_of(&r["replay"])))
                .collect(),
            publish_zmq_snapshot: v["publish_zmq"]
                .as_array()
                .expect("publish_zmq in the ready file")
                .iter()
                .map(|r| text_of(&r["snapshot"]))
                .collect(),
        })
    }
}

/// `serve --grpc GRPC --shm SHM --metrics METRICS EXTRA…`.
fn serve_args(grpc: SocketAddr, shm: &Path, metrics: &str, extra: &[String]) -> Vec<String> {
    let mut args = vec![
        "serve".to_string(),
        "--grpc".into(),
        grpc.to_string(),
        "--shm".into(),
    ];
    args.extend([
        shm.display().to_string(),
        "--metrics".into(),
        metrics.to_string(),
    ]);
    args.extend(extra.iter().cloned());
    args
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvbridge")
}

impl Bridge {
    /// Starts `kvbridge serve` with `extra` flags plus a fresh gRPC port and metrics off, and
    /// waits until gRPC accepts connections.
    pub fn start(dir: &Path, shm: &Path, extra: &[String]) -> Bridge {
        let grpc: SocketAddr = "127.0.0.1:0".parse().unwrap();
        Self::start_args(dir, grpc, shm, serve_args(grpc, shm, "off", extra))
    }

    pub fn start_args(dir: &Path, grpc: SocketAddr, shm: &Path, args: Vec<String>) -> Bridge {
        Self::start_limited(dir, grpc, shm, args, None)
    }

    /// As [`Bridge::start_args`], with `RLIMIT_NOFILE` set to `nofile` (soft and hard) in the
    /// child when given.
    pub fn start_limited(
        dir: &Path,
        grpc: SocketAddr,
        shm: &Path,
        args: Vec<String>,
        nofile: Option<u64>,
    ) -> Bridge {
        Self::try_start_limited(dir, grpc, shm, args, nofile).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Bridge::start`], but a bridge that exits during start-up (say, on a port taken
    /// meanwhile) is `Err` with its log, for the caller to handle.
    pub fn try_start(dir: &Path, shm: &Path, extra: &[String]) -> Result<Bridge, String> {
        let grpc: SocketAddr = "127.0.0.1:0".parse().unwrap();
        Self::try_start_limited(dir, grpc, shm, serve_args(grpc, shm, "off", extra), None)
    }

    fn try_start_limited(
        dir: &Path,
        grpc: SocketAddr,
        shm: &Path,
        mut args: Vec<String>,
        nofile: Option<u64>,
    ) -> Result<Bridge, String> {
        use std::os::unix::process::CommandExt;
        // Port 0: the bridge binds, and its ready file says where; a counter keeps such bridges'
        // logs and ready files apart.
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stderr_log = dir.join(format!("bridge-{}-{n}.log", grpc.port()));
        let ready_file = match args.iter().position(|a| a == "--ready-file") {
            Some(i) => PathBuf::from(&args[i + 1]),
            None => {
                let path = dir.join(format!("ready-{n}.json"));
                args.extend(["--ready-file".to_string(), path.display().to_string()]);
                path
            }
        };
        // A SIGKILLed predecessor's file must not pass for this start's (the pid tells too).
        let _ = std::fs::remove_file(&ready_file);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&stderr_log)
            .unwrap();
        let mut cmd = Command::new(bin());
        cmd.args(&args)
            .env(
                "RUST_LOG",
                std::env::var("KVB_TEST_LOG").unwrap_or("info".into()),
            )
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(n) = nofile {
            // SAFETY: runs in the forked child before exec and only calls setrlimit(2), which is
            // async-signal-safe; the struct lives on this closure's stack.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().expect("spawn kvbridge");
        let mut b = Bridge {
            child,
            grpc,
            shm: shm.to_owned(),
            args,
            stderr_log,
            metrics: None,
            publish_zmq: Vec::new(),
            publish_zmq_snapshot: Vec::new(),
            ready_file,
        };
        b.wait_ready()?;
        Ok(b)
    }

    /// Waits for the bridge's ready file: it is written once every listener is bound and
    /// start-up (ring recovery and its warnings included) is done, with the addresses as bound.
    /// Those replace port 0 in `args`, so that a restart comes back on the same addresses (as a
    /// real bridge behind a fixed worker URL does); `--publish-zmq`, `--publish-zmq-replay` and
    /// `--publish-zmq-snapshot` too when there is one rank (with several on port 0, each rank's port is its own).
    fn wait_ready(&mut self) -> Result<(), String> {
        let pid = self.child.id();
        let (child, file, log) = (&mut self.child, &self.ready_file, &self.stderr_log);
        let ready = eventually("kvbridge is ready", Duration::from_secs(60), || {
            let log = || std::fs::read_to_string(log).unwrap_or_default();
            if let Ok(Some(st)) = child.try_wait() {
                return Ok(Err(format!("kvbridge exited with {st:?}; log:\n{}", log())));
            }
            Ready::read(file, pid)
                .map(Ok)
                .map_err(|e| format!("{e}; log so far:\n{}", log()))
        })?;
        self.grpc = ready.grpc;
        self.metrics = ready.metrics;
        let mut set = |flag: &str, value: String| {
            if let Some(i) = self.args.iter().position(|a| a == flag) {
                self.args[i + 1] = value;
            }
        };
        set("--grpc", ready.grpc.to_string());
        if let Some(m) = ready.metrics {
            set("--metrics", m.to_string());
        }
        if let [(publish, replay)] = ready.publish_zmq.as_slice() {
            set("--publish-zmq", publish.clone());
            if let Some(r) = replay {
                set("--publish-zmq-replay", r.clone());
            }
        }
        if let [Some(snapshot)] = ready.publish_zmq_snapshot.as_slice() {
            set("--publish-zmq-snapshot", snapshot.clone());
        }
        self.publish_zmq = ready.publish_zmq;
        self.publish_zmq_snapshot = ready.publish_zmq_snapshot;
        Ok(())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// SIGTERM, then wait for the exit (and check that the ready file went with it).
    pub fn stop(mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid; it has not been waited for, so the pid is ours.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        let st = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("kvbridge did not stop on SIGTERM; log:\n{}", self.log());
            }
            std::thread::sleep(POLL);
        };
        if st.success() {
            assert!(
                !self.ready_file.exists(),
                "a clean exit left the ready file {}",
                self.ready_file.display()
            );
        }
        st
    }

    /// Stops it with SIGKILL: no shutdown path at all (the kernel releases the writer lock).
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Restarts with the same arguments (same addresses, same ring, same ready file).
    pub fn restart(self, dir: &Path) -> Bridge {
        let (grpc, shm, args) = (self.grpc, self.shm.clone(), self.args.clone());
        let st = self.stop();
        assert!(st.success(), "kvbridge exited with {st:?}");
        Self::start_args(dir, grpc, &shm, args)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tonic subscriber on the vLLM path.
pub async fn subscribe(
    url: &str,
    start: u64,
) -> Result<tonic::Streaming<KvEventBatch>, tonic::Status> {
    subscribe_with_ring_id(url, start).await.map(|(s, _)| s)
}

/// As [`subscribe`], with the `kvbridge-ring-id` the response headers carry.
pub async fn subscribe_with_ring_id(
    url: &str,
    start: u64,
) -> Result<(tonic::Streaming<KvEventBatch>, String), tonic::Status> {
    let mut c = VllmEngineClient::connect(url.to_string())
        .await
        .expect("connect");
    c.subscribe_kv_events(SubscribeKvEventsRequest {
        start_sequence_number: start,
        load_records_before_first_batch: true,
    })
    .await
    .map(|r| {
        let id = r
            .metadata()
            .get("kvbridge-ring-id")
            .expect("kvbridge-ring-id in the response headers")
            .to_str()
            .unwrap()
            .to_string();
        (r.into_inner(), id)
    })
}

/// Reads batches until `pred` holds for the collected list or `timeout` passes.
pub async fn collect_until(
    s: &mut tonic::Streaming<KvEventBatch>,
    timeout: Duration,
    mut pred: impl FnMut(&[KvEventBatch]) -> bool,
) -> Vec<KvEventBatch> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while !pred(&got) {
        match tokio::time::timeout_at(deadline, s.message()).await {
            Ok(Ok(Some(b))) => got.push(b),
            Ok(Ok(None)) => panic!("stream ended after {} batches", got.len()),
            Ok(Err(st)) => panic!("stream failed after {} batches: {st:?}", got.len()),
            Err(_) => panic!("timed out after {} batches", got.len()),
        }
    }
    got
}

/// Like [`collect_until`], but a stream error is returned instead of failing the test.
pub async fn try_collect_until(
    s: &mut tonic::Streaming<KvEventBatch>,
    timeout: Duration,
    mut pred: impl FnMut(&[KvEventBatch]) -> bool,
) -> Result<Vec<KvEventBatch>, tonic::Status> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while !pred(&got) {
        match tokio::time::timeout_at(deadline, s.message()).await {
            Ok(Ok(Some(b))) => got.push(b),
            Ok(Ok(None)) => panic!("stream ended after {} batches", got.len()),
            Ok(Err(st)) => return Err(st),
            Err(_) => panic!("timed out after {} batches", got.len()),
        }
    }
    Ok(got)
}

/// Stored block hashes of a batch list, in order (as u64 patterns).
pub fn stored_hashes(batches: &[KvEventBatch]) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|b| b.events.iter())
        .filter_map(|e| match &e.data {
            Some(Data::Stored(s)) => Some(
                s.blocks
                    .iter()
                    .map(|b| b.block_hash as u64)
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        })
        .flatten()
        .collect()
}

/// Number of `cleared` events in a batch list.
pub fn clears(batches: &[KvEventBatch]) -> usize {
    batches
        .iter()
        .flat_map(|b| b.events.iter())
        .filter(|e| matches!(e.data, Some(Data::Cleared(_))))
        .count()
}

/// Asserts sequence numbers are contiguous.
pub fn assert_contiguous(batches: &[KvEventBatch]) {
    for w in batches.windows(2) {
        assert_eq!(
            w[1].sequence_number,
            w[0].sequence_number + 1,
            "hole or duplicate"
        );
    }
    assert!(
        batches.iter().all(|b| b.sequence_number > 0),
        "sequence 0 sent"
    );
}

/// Every layout in turn.
pub fn layout(i: usize) -> Layout {
    Layout::ALL[i % Layout::ALL.len()]
}

/// A realistic workload for `n` batches, encoded in rotating layouts.
pub fn workload_batches(seed: u64, n: usize) -> Vec<Vec<SimEvent>> {
    let mut w = Workload::new(seed);
    (0..n).map(|_| w.next_batch()).collect()
}

// ---- operations helpers (the ops_* modules, tests/it/ops_*.rs) ----

impl Engine {
    /// A simulated engine bound at the given endpoints (e.g. to come back on the same port
    /// after a previous one at `endpoint` was dropped).
    pub fn start_at(endpoint: &str, replay: &str) -> Engine {
        Engine::try_start_at(endpoint, replay).expect("bind engine sockets")
    }

    /// A simulated engine whose PUB connects to `endpoint` (kvbridge binds it: `--zmq-bind`),
    /// with its replay ROUTER bound on a fresh loopback port.
    pub fn start_connecting(endpoint: &str) -> Engine {
        Engine::spawn(endpoint, "tcp://127.0.0.1:*", false).expect("open engine sockets")
    }

    /// Like [`Engine::start_at`], but an endpoint that cannot be bound (say, a port taken
    /// meanwhile) is an error for the caller to handle.
    pub fn try_start_at(endpoint: &str, replay: &str) -> Result<Engine, zmq::Error> {
        Engine::spawn(endpoint, replay, true)
    }

    fn spawn(endpoint: &str, replay: &str, bind: bool) -> Result<Engine, zmq::Error> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (ep, rp) = (endpoint.to_string(), replay.to_string());
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let open = if bind {
                EnginePublisher::bind
            } else {
                EnginePublisher::connect
            };
            let bound =
                open(&ctx, &ep, Some(&rp), "").and_then(|p| p.bound_endpoints().map(|e| (p, e)));
            let mut p = match bound {
                Ok((p, (pub_ep, replay_ep))) => {
                    // A connecting PUB is where it was told to connect.
                    let pub_ep = if bind { pub_ep } else { ep.clone() };
                    ready_tx
                        .send(Ok((pub_ep, replay_ep.unwrap_or_default())))
                        .unwrap();
                    p
                }
                Err(e) => return ready_tx.send(Err(e)).unwrap(),
            };
            loop {
                match rx.recv_timeout(Duration::from_millis(1)) {
                    Ok(job) => job(&mut p),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                p.serve_replay();
            }
        });
        let (endpoint, replay) = ready_rx.recv().unwrap()?;
        Ok(Engine {
            tx,
            endpoint,
            replay,
            thread: Some(thread),
        })
    }
}

impl Bridge {
    /// Starts `kvbridge serve` with `extra` flags, a fresh gRPC port and metrics on a fresh port
    /// (returned), and waits until gRPC accepts connections.
    pub fn start_with_metrics(dir: &Path, shm: &Path, extra: &[String]) -> (Bridge, SocketAddr) {
        Self::start_with_metrics_limited(dir, shm, extra, None)
    }

    /// As [`Bridge::start_with_metrics`], but a bridge that exits during start-up (say, on a
    /// port taken meanwhile) is `Err` with its log (see [`retry_on_taken_port`]).
    pub fn try_start_with_metrics(
        dir: &Path,
        shm: &Path,
        extra: &[String],
    ) -> Result<(Bridge, SocketAddr), String> {
        let grpc: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let args = serve_args(grpc, shm, "127.0.0.1:0", extra);
        let b = Self::try_start_limited(dir, grpc, shm, args, None)?;
        let metrics = b.metrics.expect("metrics address in the ready file");
        Ok((b, metrics))
    }

    /// As [`Bridge::start_with_metrics`], with `RLIMIT_NOFILE` = `nofile` when given.
    pub fn start_with_metrics_limited(
        dir: &Path,
        shm: &Path,
        extra: &[String],
        nofile: Option<u64>,
    ) -> (Bridge, SocketAddr) {
        // Both on port 0; the bound addresses come from the bridge's ready file.
        let grpc: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let args = serve_args(grpc, shm, "127.0.0.1:0", extra);
        let b = Self::start_limited(dir, grpc, shm, args, nofile);
        let metrics = b.metrics.expect("metrics address in the ready file");
        (b, metrics)
    }

    /// CPU time (user + system) the process has used so far.
    pub fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        // SAFETY: sysconf has no memory-safety preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        Duration::from_millis(ticks * 1000 / hz)
    }

    /// Open file descriptors of the process.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// GET /metrics (blocking).
pub fn scrape(addr: SocketAddr) -> String {
    http_get(addr, "/metrics")
}

/// GET `path` on the metrics listener (blocking); the body of a 200 answer.
pub fn http_get(addr: SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics listener");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// Sum of the samples of `name` whose labels include every `key="value"` in `labels`.
pub fn metric(page: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (lhs, value) = l.rsplit_once(' ')?;
            let (n, lab) = match lhs.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (lhs, ""),
            };
            if n != name {
                return None;
            }
            let ok = labels
                .iter()
                .all(|(k, v)| lab.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            ok.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// Polls `/metrics` until `pred` holds (or panics after `timeout` with the page).
pub fn wait_metrics(addr: SocketAddr, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
    eventually("the metrics condition holds", timeout, || {
        let page = scrape(addr);
        if pred(&page) {
            Ok(page)
        } else {
            Err(page)
        }
    })
}

/// The repository root (the parent of cli/, the package these tests belong to).
pub fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Cargo's target dir, from the path of the binary under test (`<target>/<profile>/kvbridge`):
/// the test process does not get `CARGO_TARGET_DIR` unless the caller exported it.
pub fn target_dir() -> PathBuf {
    Path::new(bin())
        .parent()
        .and_then(Path::parent)
        .expect("binary under <target>/<profile>/")
        .to_path_buf()
}

/// A finished child's stdout and stderr, for assertion messages.
pub fn show(o: &std::process::Output) -> String {
    format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `kvbridge ARGS` to completion (stdin closed) and asserts that it succeeded, showing its
/// output otherwise.
pub fn run_ok(args: &[&str]) -> std::process::Output {
    let out = std::process::Command::new(bin())
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("kvbridge {args:?}: {e}"));
    assert!(out.status.success(), "kvbridge {args:?}: {}", show(&out));
    out
}

/// Runs one of the repository's pinned, idempotent set-up scripts (`scripts/python-venv.sh`,
/// `scripts/smg-venv.sh`, `scripts/nats-server.sh`, …) with `CARGO_TARGET_DIR` pointing at this
/// build's target directory plus `env`, and returns the existing path it prints on its last line.
/// Fails, never skips, when the script cannot provide it: `needs` says what it requires.
pub fn setup_script(script: &str, env: &[(&str, PathBuf)], needs: &str) -> PathBuf {
    let out = Command::new("bash")
        .arg(repo().join("scripts").join(script))
        .env("CARGO_TARGET_DIR", target_dir())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap_or_else(|e| panic!("cannot run bash scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/{script} failed ({needs} required)\n{}",
        show(&out)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = PathBuf::from(
        stdout
            .lines()
            .last()
            .unwrap_or_else(|| panic!("scripts/{script} printed no path"))
            .trim(),
    );
    assert!(
        path.exists(),
        "scripts/{script} printed {path:?}, which does not exist"
    );
    path
}
