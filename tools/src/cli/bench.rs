//! `kvbridge bench` and its helper `kvbridge bench-reader`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::bench::{self, BenchConfig, Mix, Publisher};
use kvbridge::cli::CliError;

/// `kvbridge bench` flags.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Engine batches per second (open loop, scheduled by the clock).
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Measured seconds.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Warm-up seconds before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// gRPC subscribers.
    #[arg(long, default_value_t = 1)]
    subscribers: usize,
    /// HTTP/2 connections the subscribers share (default: one per subscriber, as N SMG gateways
    /// hold N connections; `--connections 1` multiplexes them all on one).
    #[arg(long)]
    connections: Option<usize>,
    /// Also count the bridge's system calls in the measured window (`perf stat -e
    /// raw_syscalls:sys_enter -p PID`; needs `perf` and permission to trace the process).
    #[arg(long)]
    syscalls: bool,
    /// After the run, measure the floor of the same shape with no gRPC, HTTP/2 or bridge: a
    /// sender process writing one message of a delivered frame's mean size per connection per
    /// batch, at the same rate, over as many loopback TCP connections; once with blocking writes
    /// from one thread (the bare kernel cost) and once from one tokio task per connection
    /// (the senders are `--floor-senders`).
    #[arg(long)]
    floor: bool,
    /// With --floor: the floor senders to run, in this order (`h2-writev`: the blocking shape
    /// with hand-written HTTP/2 and gRPC framing, one `writev` per connection per batch).
    #[arg(
        long = "floor-senders",
        default_value = "blocking,tokio",
        requires = "floor"
    )]
    floor_senders: bench::floor::FloorSenders,
    /// Shared-memory reader processes.
    #[arg(long = "shm-readers", default_value_t = 1)]
    shm_readers: usize,
    /// Shared-memory readers busy-poll instead of waiting on the futex.
    #[arg(long = "shm-spin")]
    shm_spin: bool,
    /// Batch mix.
    #[arg(long, value_enum, default_value = "serving")]
    mix: Mix,
    /// Write the result as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Target an already-running bridge at this gRPC address instead of starting one.
    #[arg(long, value_name = "ADDR", requires = "engine_bind")]
    grpc: Option<String>,
    /// The running bridge's ring file (for the shm readers).
    #[arg(long, value_name = "PATH")]
    shm: Option<PathBuf>,
    /// With --grpc: where the bench's engine PUB binds (the running bridge must `--zmq` connect to it).
    #[arg(long = "engine-bind", value_name = "ENDPOINT")]
    engine_bind: Option<String>,
    /// With --grpc: PID of the running bridge, for CPU and RSS.
    #[arg(long = "serve-pid")]
    serve_pid: Option<u32>,
    /// Ring size of the bridge the bench starts.
    #[arg(long = "ring-size", default_value = "64MiB")]
    ring_size: String,
    /// `--fanout-linger` of the bridge the bench starts (its default when not given).
    #[arg(
        long = "fanout-linger",
        value_name = "DURATION",
        conflicts_with = "grpc"
    )]
    fanout_linger: Option<String>,
    /// The bridge the bench starts also publishes to these NATS servers (stream `KVBENCH_R<n>`,
    /// subjects `kvbench_r<n>.>`, n = --nats-replicas); the result adds the sink's rate, publish
    /// lag and CPU per batch.
    #[arg(long, value_name = "URL[,URL…]", conflicts_with = "grpc")]
    nats: Option<String>,
    /// With --nats: the stream's replicas.
    #[arg(long = "nats-replicas", default_value_t = 3)]
    nats_replicas: usize,
    /// With --nats: the bridge runs WITHOUT the sink, and a bare async-nats JetStream publisher
    /// (a separate process, no kvbridge in its path) publishes the same payloads with the same
    /// headers and in-flight bound at the same rate into the same stream: the floor of the
    /// sink's publish lag on this machine, and the cluster's own effect on the gRPC rows.
    #[arg(long = "nats-floor", requires = "nats")]
    nats_floor: bool,
    /// The bridge the bench starts also publishes on the engine ZMQ wire (`--publish-zmq`), read
    /// by this many SUBs; as many more read the same engine messages through a bare relay (the
    /// floor), in the same run.
    #[arg(long = "zmq-subscribers", default_value_t = 0, conflicts_with = "grpc")]
    zmq_subscribers: usize,
    /// With --zmq-subscribers N: instead of the ZMQ column, measure the gRPC column in 2 × K
    /// windows of --duration (each after its own --warmup), alternately with no ZMQ subscriber
    /// and with N SUBs reading --publish-zmq (no floor), so that the machine's noise falls on
    /// both; prints each window and the medians' ratio.
    #[arg(long = "zmq-alternate", value_name = "K")]
    zmq_alternate: Option<usize>,
}

/// `kvbridge bench-nats-floor` (internal: the floor publisher process of `bench --nats-floor`).
#[derive(clap::Args, Debug)]
pub struct BenchNatsFloorArgs {
    #[arg(long)]
    nats: String,
    #[arg(long)]
    rate: u64,
    #[arg(long)]
    duration: u64,
    #[arg(long)]
    warmup: u64,
    #[arg(long)]
    replicas: usize,
    #[arg(long, value_enum)]
    mix: Mix,
}

pub(super) fn run_nats_floor(a: BenchNatsFloorArgs) -> Result<(), CliError> {
    let rt = kvbridge::cli::runtime()?;
    let cfg = bench::nats::floor::FloorConfig {
        urls: a.nats.split(',').map(str::to_string).collect(),
        rate: a.rate.max(1),
        warmup: Duration::from_secs(a.warmup),
        duration: Duration::from_secs(a.duration.max(1)),
        replicas: a.replicas,
        mix: a.mix,
    };
    let f = rt
        .block_on(bench::nats::floor::run(cfg))
        .map_err(CliError::Failed)?;
    print!("{}", f.table(a.replicas));
    Ok(())
}

/// `kvbridge bench-reader` (internal: one shared-memory reader process of the bench).
#[derive(clap::Args, Debug)]
pub struct BenchReaderArgs {
    #[arg(long)]
    shm: PathBuf,
    #[arg(long = "run-ms")]
    run_ms: u64,
    #[arg(long = "warmup-ms", default_value_t = 0)]
    warmup_ms: u64,
    #[arg(long = "count-ms")]
    count_ms: u64,
    #[arg(long)]
    spin: bool,
}

/// `kvbridge bench-floor` (internal: the sender process of `bench --floor`).
#[derive(clap::Args, Debug)]
pub struct BenchFloorArgs {
    #[arg(long)]
    connect: String,
    #[arg(long)]
    connections: usize,
    #[arg(long)]
    rate: u64,
    #[arg(long)]
    bytes: usize,
    #[arg(long = "run-ms")]
    run_ms: u64,
    #[arg(long, value_enum)]
    sender: bench::floor::FloorSender,
}

/// `kvbridge bench-zmq-relay` (internal: the floor's relay process of `bench --zmq-subscribers`).
#[derive(clap::Args, Debug)]
pub struct BenchZmqRelayArgs {
    #[arg(long)]
    connect: String,
    #[arg(long = "from-unix")]
    from_unix: f64,
    #[arg(long = "window-ms")]
    window_ms: u64,
}

pub(super) fn run_zmq_relay(a: BenchZmqRelayArgs) -> Result<(), CliError> {
    bench::zmq_column::run_relay(&a.connect, a.from_unix, Duration::from_millis(a.window_ms))
        .map_err(CliError::Failed)
}

pub(super) fn run_floor_sender(a: BenchFloorArgs) -> Result<(), CliError> {
    bench::floor::run_sender(
        &a.connect,
        a.connections,
        a.rate,
        a.bytes,
        Duration::from_millis(a.run_ms),
        a.sender,
    )
    .map_err(CliError::Failed)
}

pub(super) fn run_reader(a: BenchReaderArgs) -> Result<(), CliError> {
    bench::reader::run_reader(
        &a.shm,
        Duration::from_millis(a.run_ms),
        Duration::from_millis(a.warmup_ms),
        Duration::from_millis(a.count_ms),
        a.spin,
    )
    .map_err(CliError::Failed)
}

/// A bridge the bench started (`kvbridge serve` as a child process).
struct OwnBridge {
    child: Child,
    shm: PathBuf,
}

impl Drop for OwnBridge {
    fn drop(&mut self) {
        crate::bench::stop_bridge(&mut self.child, &self.shm, Duration::from_secs(10));
    }
}

/// The bridge a bench measures: its gRPC address, ring, pid, the engine's publisher, and the
/// process when the bench started it.
struct Target {
    grpc: String,
    shm: PathBuf,
    pid: Option<u32>,
    engine: crate::sim::EnginePublisher,
    own: Option<OwnBridge>,
    /// The sink's metrics address, when the bench started a bridge with `--nats`.
    nats_metrics: Option<std::net::SocketAddr>,
    /// (kvbridge's --publish-zmq endpoint, the bench engine's PUB) with --zmq-subscribers.
    zmq_pub: Option<(String, String)>,
}

pub(super) fn run(a: BenchArgs) -> Result<(), CliError> {
    if a.rate == 0 || a.duration == 0 {
        return Err(CliError::Setup("--rate and --duration must be > 0".into()));
    }
    if a.zmq_alternate
        .is_some_and(|k| k == 0 || a.zmq_subscribers == 0)
    {
        return Err(CliError::Setup(
            "--zmq-alternate K needs K > 0 and --zmq-subscribers N > 0".into(),
        ));
    }
    let rt = kvbridge::cli::runtime()?;
    let ctx = zmq::Context::new();
    let target = match &a.grpc {
        Some(g) => running_bridge(&a, &ctx, g)?,
        None => start_bridge(&a, &ctx)?,
    };
    // The floor publisher sets itself up while the bridge's SUB connects.
    let floor = start_nats_floor(&a)?;
    // Give the bridge's SUB time to connect before the clock starts.
    std::thread::sleep(Duration::from_millis(300));
    let Target {
        grpc,
        shm,
        pid,
        engine,
        own,
        nats_metrics,
        zmq_pub,
    } = target;
    let cfg = BenchConfig {
        rate: a.rate,
        duration: Duration::from_secs(a.duration),
        warmup: Duration::from_secs(a.warmup),
        subscribers: a.subscribers,
        connections: a.connections.unwrap_or(a.subscribers).max(1),
        count_syscalls: a.syscalls,
        shm_readers: a.shm_readers,
        shm_spin: a.shm_spin,
        mix: a.mix,
        grpc,
        shm,
        serve_pid: pid,
    };
    let measure_from = Instant::now() + cfg.warmup;
    let zmq_readers = match zmq_pub.as_ref().filter(|_| a.zmq_alternate.is_none()) {
        Some((bridge_pub, engine_pub)) => Some(zmq_column(
            &ctx,
            a.zmq_subscribers,
            bridge_pub,
            engine_pub,
            measure_from,
            cfg.duration,
        )?),
        None => None,
    };
    let publisher = Publisher::start(engine, cfg.rate, cfg.mix, measure_from);
    if let (Some(k), Some((bridge_pub, _))) = (a.zmq_alternate, &zmq_pub) {
        let result = alternate(
            &rt,
            &ctx,
            &cfg,
            &publisher,
            a.zmq_subscribers,
            bridge_pub,
            k,
        );
        publisher.stop();
        let result = result?;
        print!(
            "{}",
            bench::zmq_column::alternation_table(&result.zmq_alternation)
        );
        return write_json(a.json.as_deref(), &result);
    }
    let progress = a.duration > 3 && std::io::IsTerminal::is_terminal(&std::io::stderr());
    // The sink's counters at the start of the measured window, read beside the run ...
    let sink_before = nats_metrics.map(|m| scrape_at(m, measure_from));
    // ... and at its end (not after `measure` returns, which drains for a while longer).
    let sink_after = nats_metrics.map(|m| scrape_at(m, measure_from + cfg.duration));
    let result = rt.block_on(bench::measure(&cfg, &publisher, progress));
    publisher.stop();
    let mut result = result.map_err(CliError::Failed)?;
    print!("{}", bench::table(&result));
    if let Some(z) = zmq_readers {
        let mut z = z.finish();
        z.bridge_cpu_us_per_record = result
            .bridge_cpu_seconds
            .filter(|_| result.published > 0)
            .map(|c| c * 1e6 / result.published as f64);
        print!("{}", bench::zmq_column::table(&z));
        result.zmq = Some(z);
    }
    if let (Some(before), Some(after)) = (sink_before, sink_after) {
        let join = |h: std::thread::JoinHandle<Result<_, String>>| {
            h.join()
                .map_err(|_| CliError::Failed("metrics scrape".into()))?
                .map_err(CliError::Failed)
        };
        let s = crate::bench::nats::SinkFigures::between(
            &join(before)?,
            &join(after)?,
            cfg.duration.as_secs_f64(),
            result.bridge_cpu_seconds,
        );
        print!("{}", s.table(a.nats_replicas));
    }
    if let Some(child) = floor {
        let out = child
            .wait_with_output()
            .map_err(|e| CliError::Failed(format!("floor publisher: {e}")))?;
        if !out.status.success() {
            return Err(CliError::Failed(format!(
                "the floor publisher failed ({})",
                out.status
            )));
        }
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
    if a.floor {
        // The bridge this bench started is stopped first: the floor runs alone.
        drop(own);
        grpc_floor(&rt, &cfg, a.floor_senders, &mut result)?;
    }
    write_json(a.json.as_deref(), &result)
}

/// `--grpc`: a bridge that is already running, fed by an engine publisher bound at
/// `--engine-bind`.
fn running_bridge(a: &BenchArgs, ctx: &zmq::Context, grpc: &str) -> Result<Target, CliError> {
    let ep = a
        .engine_bind
        .clone()
        .expect("clap requires --engine-bind with --grpc");
    let (engine, _, _) = Publisher::bind(ctx, &ep, "tcp://127.0.0.1:*").map_err(CliError::Setup)?;
    if a.shm_readers > 0 && a.shm.is_none() {
        return Err(CliError::Setup(
            "--shm-readers needs --shm PATH of the running bridge".into(),
        ));
    }
    Ok(Target {
        grpc: grpc.to_string(),
        shm: a.shm.clone().unwrap_or_default(),
        pid: a.serve_pid,
        engine,
        own: None,
        nats_metrics: None,
        zmq_pub: None,
    })
}

/// Starts `kvbridge serve` (this executable) on the bench's engine: gRPC, metrics and
/// `--publish-zmq` on ports it binds itself, read back from its `--ready-file` once it serves.
fn start_bridge(a: &BenchArgs, ctx: &zmq::Context) -> Result<Target, CliError> {
    let (engine, ep, rep) =
        Publisher::bind(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*").map_err(CliError::Setup)?;
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let shm = dir.join(format!("kvbridge-bench-{}", std::process::id()));
    let _ = kvbridge::ring::RingFiles::new(&shm).remove();
    let ready = std::env::temp_dir().join(format!("kvbridge-bench-{}.ready", std::process::id()));
    let _ = std::fs::remove_file(&ready);
    let exe = std::env::current_exe().map_err(|e| CliError::Setup(e.to_string()))?;
    let mut args: Vec<String> = [
        "serve",
        "--zmq",
        &ep,
        "--replay",
        &rep,
        "--grpc",
        "127.0.0.1:0",
        "--seq-base",
        "1",
        "--ring-size",
        &a.ring_size,
    ]
    .map(str::to_string)
    .to_vec();
    args.extend(["--shm".into(), shm.display().to_string()]);
    args.extend(["--ready-file".into(), ready.display().to_string()]);
    if let Some(l) = &a.fanout_linger {
        args.extend(["--fanout-linger".into(), l.clone()]);
    }
    if a.zmq_subscribers > 0 {
        args.extend(["--publish-zmq".into(), "tcp://127.0.0.1:0".into()]);
    }
    let with_sink = a.nats.as_ref().filter(|_| !a.nats_floor);
    match with_sink {
        Some(urls) => args.extend(
            [
                "--nats",
                urls,
                "--nats-stream",
                &bench::nats::bench_stream(a.nats_replicas),
                "--nats-subject-prefix",
                &bench::nats::bench_prefix(a.nats_replicas),
                "--nats-max-age",
                "10m",
                "--nats-worker-id",
                &format!("bench-{}", std::process::id()),
                "--nats-replicas",
                &a.nats_replicas.to_string(),
                // The bench measures the sink: no NATS, no bench (one clear line).
                "--nats-required",
                "--metrics",
                "127.0.0.1:0",
            ]
            .map(str::to_string),
        ),
        None => args.extend(["--metrics".into(), "off".into()]),
    }
    let child = Command::new(exe)
        .args(&args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| CliError::Setup(format!("cannot start kvbridge serve: {e}")))?;
    let pid = child.id();
    let mut own = OwnBridge {
        child,
        shm: shm.clone(),
    };
    let bound = wait_ready(&mut own.child, &ready, Duration::from_secs(20))?;
    let _ = std::fs::remove_file(&ready);
    let addr = |key: &str| bound[key].as_str().map(str::to_string);
    let grpc = addr("grpc").ok_or_else(|| CliError::Failed("no grpc in the ready file".into()))?;
    let nats_metrics = match with_sink {
        Some(_) => Some(
            addr("metrics")
                .and_then(|m| m.parse().ok())
                .ok_or_else(|| CliError::Failed("no metrics in the ready file".into()))?,
        ),
        None => None,
    };
    let zmq_pub = bound["publish_zmq"][0]["publish"]
        .as_str()
        .map(|p| (p.to_string(), ep.clone()));
    Ok(Target {
        grpc,
        shm,
        pid: Some(pid),
        engine,
        own: Some(own),
        nats_metrics,
        zmq_pub,
    })
}

/// Waits for a bridge's `--ready-file` and returns its contents; fails if the bridge exits
/// first or does not get ready in `patience`.
fn wait_ready(
    child: &mut Child,
    ready: &std::path::Path,
    patience: Duration,
) -> Result<serde_json::Value, CliError> {
    let deadline = Instant::now() + patience;
    loop {
        if let Ok(text) = std::fs::read_to_string(ready) {
            return serde_json::from_str(&text)
                .map_err(|e| CliError::Failed(format!("the bridge's ready file: {e}")));
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(CliError::Failed(format!("the bridge exited ({st})")));
        }
        if Instant::now() > deadline {
            return Err(CliError::Failed(format!(
                "the bridge did not start within {} s",
                patience.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--nats-floor`: the bare JetStream publisher (`kvbridge bench-nats-floor`) as a child.
fn start_nats_floor(a: &BenchArgs) -> Result<Option<Child>, CliError> {
    let (Some(urls), true) = (&a.nats, a.nats_floor) else {
        return Ok(None);
    };
    let exe = std::env::current_exe().map_err(|e| CliError::Setup(e.to_string()))?;
    let mix = clap::ValueEnum::to_possible_value(&a.mix)
        .map(|v| v.get_name().to_string())
        .unwrap_or_else(|| "serving".into());
    let child = Command::new(exe)
        .arg("bench-nats-floor")
        .args(["--nats", urls, "--mix", &mix])
        .args(["--rate", &a.rate.to_string()])
        .args(["--duration", &a.duration.to_string()])
        .args(["--warmup", &a.warmup.to_string()])
        .args(["--replicas", &a.nats_replicas.to_string()])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| CliError::Setup(format!("cannot start the floor publisher: {e}")))?;
    Ok(Some(child))
}

/// `--zmq-subscribers N`: N SUBs on the bridge's `--publish-zmq` and N on the engine's own PUB
/// through a bare relay (the floor), counting only the measured window.
fn zmq_column(
    ctx: &zmq::Context,
    n: usize,
    bridge_pub: &str,
    engine_pub: &str,
    measure_from: Instant,
    duration: Duration,
) -> Result<bench::zmq_column::ZmqReaders, CliError> {
    let measuring = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let from_unix = kvbridge::clock::unix_seconds()
        + measure_from
            .saturating_duration_since(Instant::now())
            .as_secs_f64();
    let r = bench::zmq_column::ZmqReaders::start(
        ctx,
        n,
        bridge_pub,
        Some((engine_pub, from_unix, duration)),
        measuring.clone(),
    )
    .map_err(CliError::Setup)?;
    std::thread::spawn(move || {
        std::thread::sleep(measure_from.saturating_duration_since(Instant::now()));
        measuring.store(true, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(duration);
        measuring.store(false, std::sync::atomic::Ordering::SeqCst);
    });
    Ok(r)
}

/// Scrapes the sink's metrics at `at`, on a thread of its own.
fn scrape_at(
    m: std::net::SocketAddr,
    at: Instant,
) -> std::thread::JoinHandle<Result<crate::bench::nats::SinkSample, String>> {
    std::thread::spawn(move || {
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        crate::bench::nats::scrape(m)
    })
}

/// `--floor`: the same deliveries as bare loopback TCP writes (the `--floor-senders`), one
/// message per connection per batch, after the bridge stopped. The `h2-writev` sender carries
/// the same bytes per connection per batch as one gRPC message in one DATA frame.
fn grpc_floor(
    rt: &tokio::runtime::Runtime,
    cfg: &BenchConfig,
    senders: bench::floor::FloorSenders,
    result: &mut bench::BenchResult,
) -> Result<(), CliError> {
    // A gRPC frame on the wire: the record, its 5-byte gRPC prefix and the 9-byte HTTP/2 DATA
    // frame header; a connection carries one per subscriber on it per batch.
    let per_conn = cfg.subscribers.div_ceil(cfg.connections).max(1);
    let record = (result.delivered_mb * 1e6 / result.grpc.delivered.max(1) as f64).round();
    for sender in senders.iter() {
        let f = bench::floor::FloorConfig {
            rate: cfg.rate,
            duration: cfg.duration,
            warmup: cfg.warmup,
            connections: cfg.connections,
            message_bytes: per_conn * (record as usize + 14),
            batches_per_message: per_conn,
            sender,
            count_syscalls: cfg.count_syscalls,
        };
        let r = rt
            .block_on(bench::floor::measure(&f))
            .map_err(CliError::Failed)?;
        print!(
            "{}",
            bench::floor::table(&r, result.cpu_us_per_delivered_batch)
        );
        result.floor.push(r);
    }
    print!(
        "{}",
        bench::floor::summary(&result.floor, result.cpu_us_per_delivered_batch)
    );
    Ok(())
}

/// `--json PATH`: the whole result, for the docs' data files.
fn write_json(path: Option<&std::path::Path>, result: &bench::BenchResult) -> Result<(), CliError> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(result).expect("serializable");
        std::fs::write(path, text)
            .map_err(|e| CliError::Failed(format!("--json {}: {e}", path.display())))?;
    }
    Ok(())
}

/// `--zmq-alternate K`: 2 × K measured windows, the first and every other one with no ZMQ
/// subscriber, the others with `n` SUBs on `bridge_pub`; the result is the first window's with
/// every window in `zmq_alternation`.
fn alternate(
    rt: &tokio::runtime::Runtime,
    ctx: &zmq::Context,
    cfg: &BenchConfig,
    publisher: &Publisher,
    n: usize,
    bridge_pub: &str,
    k: usize,
) -> Result<bench::BenchResult, CliError> {
    let mut windows = Vec::new();
    let mut first = None;
    for i in 0..2 * k {
        let with = i % 2 == 1;
        let readers = if with {
            let counting = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
            Some(
                bench::zmq_column::ZmqReaders::start(ctx, n, bridge_pub, None, counting)
                    .map_err(CliError::Setup)?,
            )
        } else {
            None
        };
        let r = rt
            .block_on(bench::measure(cfg, publisher, false))
            .map_err(CliError::Failed)?;
        let zmq = readers.map(|z| z.finish().bridge.delivery);
        let w = bench::zmq_column::AltWindow {
            zmq_subscribers: if with { n } else { 0 },
            grpc_latency: r.grpc_latency.clone(),
            grpc: r.grpc.clone(),
            zmq: zmq.unwrap_or_default(),
            bridge_cpu_percent: r.bridge_cpu_percent,
        };
        eprintln!(
            "bench: window {}/{}: {} ZMQ SUBs, gRPC p50 {:.1} µs p99 {:.1} µs",
            i + 1,
            2 * k,
            w.zmq_subscribers,
            w.grpc_latency.p50_us,
            w.grpc_latency.p99_us
        );
        windows.push(w);
        first.get_or_insert(r);
    }
    let mut result = first.expect("K > 0 windows");
    result.zmq_alternation = windows;
    Ok(result)
}

/// `kvbridge bench-checkpoints` flags.
#[derive(clap::Args, Debug)]
pub struct BenchCheckpointsArgs {
    /// Blocks held before the churn.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// Blocks per store of the fill.
    #[arg(long = "store-blocks", default_value_t = 400)]
    store_blocks: usize,
    /// Seconds each churn phase is measured (span a few --checkpoint-interval: 1 min).
    #[arg(long, default_value_t = 180)]
    window: u64,
    /// Batches per second of the serving churn.
    #[arg(long = "churn-rate", default_value_t = 20)]
    churn_rate: u64,
    /// `--ring-size` of every bridge.
    #[arg(long = "ring-size", default_value = "64MiB")]
    ring_size: String,
    /// Late joiners per bridge with a table.
    #[arg(long = "late-joins", default_value_t = 5)]
    late_joins: usize,
    /// Another kvbridge binary (e.g. the previous release), run with its defaults beside this one's.
    #[arg(long = "baseline-exe", value_name = "PATH")]
    baseline_exe: Option<PathBuf>,
    /// Write the result as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

pub(super) fn run_checkpoints(a: BenchCheckpointsArgs) -> Result<(), CliError> {
    if a.blocks == 0 || a.store_blocks == 0 || a.window == 0 || a.churn_rate == 0 {
        return Err(CliError::Setup(
            "--blocks, --store-blocks, --window and --churn-rate must be > 0".into(),
        ));
    }
    if let Some(b) = a.baseline_exe.as_ref().filter(|b| !b.is_file()) {
        return Err(CliError::Setup(format!(
            "--baseline-exe {}: no such file",
            b.display()
        )));
    }
    let cfg = bench::checkpoints::Config {
        exe: std::env::current_exe().map_err(|e| CliError::Setup(e.to_string()))?,
        baseline: a.baseline_exe,
        blocks: a.blocks,
        store_blocks: a.store_blocks,
        window: Duration::from_secs(a.window),
        churn_rate: a.churn_rate,
        ring_size: a.ring_size,
        late_joins: a.late_joins,
    };
    let r = bench::checkpoints::run(&cfg, &mut |l| eprintln!("bench-checkpoints: {l}"))
        .map_err(CliError::Failed)?;
    print!("{}", bench::checkpoints::table(&r));
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&r).expect("serializable");
        std::fs::write(path, text + "\n")
            .map_err(|e| CliError::Failed(format!("--json {}: {e}", path.display())))?;
    }
    Ok(())
}
