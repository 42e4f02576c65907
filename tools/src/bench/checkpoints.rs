//! `kvbridge bench-checkpoints`: what the snapshot table and its checkpoints cost a bridge whose
//! engine's cache is full, measured as whole processes in one run.
//!
//! Several `kvbridge serve` processes run side by side, each fed the same batches by its own
//! simulated engine: `off` (`--snapshot off`: no table), `on` (the defaults: the table and its
//! checkpoint before the ring laps its cut, at most every `--checkpoint-interval`), `every-1s`
//! (`--checkpoint-interval 1s`: the whole image rewritten about once a second whenever the table
//! changed, which is what bridges did before the lap schedule) and, with `--baseline-exe`,
//! `baseline` (another kvbridge binary with its defaults, e.g. the previous release).
//!
//! 1. **Fill**: `--blocks` blocks held (stores of `--store-blocks` blocks of 16 tokens).
//! 2. **Memory**: each bridge's RSS once the fill is in; bytes per block = (RSS − RSS of `off`)
//!    ÷ blocks.
//! 3. **Churn**: the serving mix (prefill and decode stores, eviction sweeps; no clears) at
//!    `--churn-rate` batches/s, then one single-block store a second, each for `--window`
//!    seconds: each bridge's CPU (utime + stime of the whole process) over the window, the
//!    checkpoints it wrote; CPU of each bridge minus `off` is what the table costs.
//! 4. **Late joiner**: under the serving churn, a subscriber from 0 that takes snapshot chunks
//!    (`load_records_before_first_batch`), `--late-joins` times: time to its first message, and
//!    the worst latency a live subscriber on the same bridge sees meanwhile against a window of
//!    the same length with no late joiner (an ingest stall shows there).
//!
//! The window should span a few `--checkpoint-interval`s (default 1 min): a checkpoint a minute is
//! what the table costs at a steady churn, so a window shorter than the interval may hold none.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::proc_stats;
use crate::sim::{encode_batch, EnginePublisher, Layout, Rng, SimEvent, Workload};
use kvbridge::proto::common::SubscribeKvEventsRequest;

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    /// The kvbridge binary the `off`, `on` and `every-1s` bridges run.
    pub exe: PathBuf,
    /// Another kvbridge binary, run with its defaults as the `baseline` bridge.
    pub baseline: Option<PathBuf>,
    /// Blocks held after the fill.
    pub blocks: usize,
    /// Blocks per fill store.
    pub store_blocks: usize,
    /// Each churn phase's measured window.
    pub window: Duration,
    /// Serving-churn batches per second.
    pub churn_rate: u64,
    /// `--ring-size` of every bridge.
    pub ring_size: String,
    /// Late joiners per bridge with a table.
    pub late_joins: usize,
}

/// One bridge of the run.
#[derive(Clone, Debug, Serialize)]
pub struct BridgeInfo {
    /// Its name in the tables.
    pub name: String,
    /// The binary.
    pub exe: String,
    /// Its flags beyond the common ones.
    pub args: Vec<String>,
    /// RSS once the fill is in (KiB).
    pub rss_kib: u64,
    /// Blocks its table holds after the fill (`None`: no table).
    pub table_blocks: Option<u64>,
    /// (RSS − RSS of `off`) ÷ blocks.
    pub bytes_per_block: Option<f64>,
    /// What the table says it holds (`kvbridge_snapshot_table_bytes`) ÷ blocks: slots at the
    /// map's load, block bytes, attribute sets; not the allocator's own overhead or what it
    /// keeps of freed memory (the RSS figure has both, and the latter varies run to run).
    pub table_bytes_per_block: Option<f64>,
    /// Checkpoints it wrote during the fill and until the churn starts.
    pub fill_checkpoints: f64,
}

/// One bridge in one churn phase.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseBridge {
    /// The bridge.
    pub name: String,
    /// CPU seconds over the window.
    pub cpu_seconds: f64,
    /// % of a core over the window.
    pub cpu_percent: f64,
    /// % of a core above `off`.
    pub above_off_percent: f64,
    /// Checkpoints written in the window.
    pub checkpoints: f64,
    /// Checkpoint bytes written in the window.
    pub checkpoint_bytes: f64,
    /// Mean time a checkpoint took (image copy, write, rename), in ms.
    pub checkpoint_ms: Option<f64>,
}

/// One churn phase.
#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    /// What was published.
    pub name: String,
    /// Batches per second.
    pub rate: u64,
    /// The measured window (s).
    pub seconds: f64,
    /// Per bridge.
    pub bridges: Vec<PhaseBridge>,
}

/// Late joiners on one bridge.
#[derive(Clone, Debug, Serialize)]
pub struct LateJoin {
    /// The bridge.
    pub name: String,
    /// Time to the first message of each late joiner (ms).
    pub first_message_ms: Vec<f64>,
    /// Their median.
    pub first_message_median_ms: f64,
    /// Snapshots the bridge served them (its `snapshots_served_total`).
    pub snapshots_served: f64,
    /// Worst live-subscriber latency while the late joiners were served (ms).
    pub live_max_during_ms: f64,
    /// Worst live-subscriber latency over as long a window with no late joiner (ms).
    pub live_max_alone_ms: f64,
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Blocks held.
    pub blocks: usize,
    /// Blocks per fill store.
    pub store_blocks: usize,
    /// Ring size of every bridge.
    pub ring_size: String,
    /// The bridges and their memory.
    pub bridges: Vec<BridgeInfo>,
    /// The churn phases.
    pub phases: Vec<Phase>,
    /// The late joiners.
    pub late_joins: Vec<LateJoin>,
    /// Cores of the machine and its load average at the end (the run shares them).
    pub cores: usize,
    /// `/proc/loadavg` at the end.
    pub loadavg: String,
}

/// A `kvbridge serve` child with its own engine.
struct Bridge {
    name: String,
    exe: PathBuf,
    args: Vec<String>,
    child: Child,
    grpc: String,
    metrics: SocketAddr,
    shm: PathBuf,
}

impl Bridge {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn metric(&self, name: &str) -> Result<f64, String> {
        Ok(metric_sum(&scrape_page(self.metrics)?, name))
    }

    fn cpu(&self) -> Result<f64, String> {
        proc_stats::cpu_seconds(self.pid()).ok_or_else(|| format!("{}: no /proc stat", self.name))
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        super::stop_bridge(&mut self.child, &self.shm, Duration::from_secs(20));
    }
}

fn free_port() -> Result<SocketAddr, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("cannot find a free port: {e}"))
}

/// The text of `GET /metrics` at `addr`.
fn scrape_page(addr: SocketAddr) -> Result<String, String> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("metrics {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut page = String::new();
    s.read_to_string(&mut page)
        .map_err(|e| format!("metrics {addr}: {e}"))?;
    Ok(page)
}

/// The sum of every series of metric `name` on a Prometheus text page.
fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                return None;
            }
            l.rsplit_once(' ')?.1.parse::<f64>().ok()
        })
        .fold(0.0, |a, b| a + b)
}

/// Polls `f` until it holds or `limit` passes.
fn wait_for(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> Result<bool, String>,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        if f()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{what}: not within {} s", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn start_bridge(
    name: &str,
    exe: &PathBuf,
    args: &[&str],
    ring_size: &str,
    ctx: &zmq::Context,
) -> Result<(Bridge, EnginePublisher), String> {
    let engine = EnginePublisher::bind(ctx, "tcp://127.0.0.1:*", Some("tcp://127.0.0.1:*"), "")
        .map_err(|e| format!("cannot bind an engine: {e}"))?;
    let (ep, rep) = (
        engine.endpoint(),
        engine.replay_endpoint().unwrap_or_default(),
    );
    let (grpc, metrics) = (free_port()?, free_port()?);
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let shm = dir.join(format!("kvbridge-ckbench-{}-{name}", std::process::id()));
    let _ = kvbridge::ring::RingFiles::new(&shm).remove();
    let child = Command::new(exe)
        .args(["serve", "--zmq", &ep, "--replay", &rep, "--seq-base", "1"])
        .args(["--grpc", &grpc.to_string()])
        .args(["--metrics", &metrics.to_string()])
        .arg("--shm")
        .arg(&shm)
        .args(["--ring-size", ring_size])
        .args(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {} serve: {e}", exe.display()))?;
    let b = Bridge {
        name: name.to_string(),
        exe: exe.clone(),
        args: args.iter().map(|s| s.to_string()).collect(),
        child,
        grpc: grpc.to_string(),
        metrics,
        shm,
    };
    Ok((b, engine))
}

/// One fill store: `blocks` new blocks of 16 random tokens, a chain from the root.
fn fill_store(rng: &mut Rng, blocks: usize) -> Vec<u8> {
    super::table_ring::chain_store(rng, blocks, kvbridge::clock::unix_seconds())
}

/// What the load thread publishes.
const IDLE: u64 = 0;
const SERVING: u64 = 1;
const ONE_CHANGE: u64 = 2;

/// The load thread: publishes the same batch to every engine at `rate` batches/s of `kind`,
/// stamped with its scheduled time, and answers replay requests.
struct Load {
    kind: Arc<AtomicU64>,
    rate: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(mut engines: Vec<EnginePublisher>) -> Load {
        let kind = Arc::new(AtomicU64::new(IDLE));
        let rate = Arc::new(AtomicU64::new(1));
        let stop = Arc::new(AtomicBool::new(false));
        let (k, r, s) = (kind.clone(), rate.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut w = Workload::new(42);
            // a clear would empty the table the run measures
            w.p_clear = 0.0;
            let mut rng = Rng::new(9);
            let mut sched: Option<(u64, u64, Instant, u64)> = None;
            while !s.load(Ordering::Relaxed) {
                for e in &mut engines {
                    e.serve_replay();
                }
                let (kind, rate) = (k.load(Ordering::Relaxed), r.load(Ordering::Relaxed).max(1));
                if kind == IDLE {
                    sched = None;
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                let (_, _, start, i) = match sched {
                    Some(x) if x.0 == kind && x.1 == rate => x,
                    _ => (kind, rate, Instant::now(), 0),
                };
                let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                let now = Instant::now();
                if now < due {
                    std::thread::sleep((due - now).min(Duration::from_millis(10)));
                    sched = Some((kind, rate, start, i));
                    continue;
                }
                let ts = kvbridge::clock::unix_seconds() - now.duration_since(due).as_secs_f64();
                let events = if kind == SERVING {
                    w.next_batch()
                } else {
                    let ev = SimEvent::Stored {
                        hashes: vec![rng.next_u64()],
                        parent: None,
                        tokens: (0..16).map(|_| rng.range(1, 151_000) as u32).collect(),
                        block_size: 16,
                        medium: Some("GPU".into()),
                    };
                    vec![ev]
                };
                let b = encode_batch(Layout::Vllm0102, ts, &events, 0);
                for e in &mut engines {
                    e.publish(b.clone());
                }
                sched = Some((kind, rate, start, i + 1));
            }
        });
        Load {
            kind,
            rate,
            stop,
            thread: Some(thread),
        }
    }

    fn set(&self, kind: u64, rate: u64) {
        self.rate.store(rate, Ordering::Relaxed);
        self.kind.store(kind, Ordering::Relaxed);
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs the whole benchmark; `log` gets a line per step.
pub fn run(cfg: &Config, log: &mut dyn FnMut(&str)) -> Result<Report, String> {
    let ctx = zmq::Context::new();
    let mut specs: Vec<(&str, PathBuf, Vec<&str>)> = vec![
        ("off", cfg.exe.clone(), vec!["--snapshot", "off"]),
        ("on", cfg.exe.clone(), vec![]),
        (
            "every-1s",
            cfg.exe.clone(),
            vec!["--checkpoint-interval", "1s"],
        ),
    ];
    if let Some(b) = &cfg.baseline {
        specs.push(("baseline", b.clone(), vec![]));
    }
    let mut bridges = Vec::new();
    let mut engines = Vec::new();
    for (name, exe, args) in &specs {
        let (b, e) = start_bridge(name, exe, args, &cfg.ring_size, &ctx)?;
        bridges.push(b);
        engines.push(e);
    }
    for b in &bridges {
        wait_for(
            &format!("{} accepting gRPC", b.name),
            Duration::from_secs(30),
            || Ok(std::net::TcpStream::connect(&b.grpc).is_ok()),
        )?;
        wait_for(
            &format!("{} connected to its engine", b.name),
            Duration::from_secs(30),
            || Ok(b.metric("kvbridge_publisher_connects_total").unwrap_or(0.0) >= 1.0),
        )?;
    }
    // the subscription reaches the PUB shortly after the connect
    std::thread::sleep(Duration::from_millis(500));

    let stores = cfg.blocks.div_ceil(cfg.store_blocks.max(1));
    log(&format!(
        "fill: {stores} stores of {} blocks into {} bridges",
        cfg.store_blocks,
        bridges.len()
    ));
    let mut rng = Rng::new(1);
    let t0 = Instant::now();
    for i in 0..stores {
        let p = fill_store(&mut rng, cfg.store_blocks);
        for e in &mut engines {
            e.publish(p.clone());
            e.serve_replay();
        }
        // 250 stores/s: the bridges keep up, none drops at its socket
        let due = t0 + Duration::from_millis(4 * (i as u64 + 1));
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
    }
    let held = (stores * cfg.store_blocks) as f64;
    for b in &bridges {
        wait_for(
            &format!("{} took in the fill", b.name),
            Duration::from_secs(180),
            || {
                for e in &mut engines {
                    e.serve_replay();
                }
                let page = scrape_page(b.metrics)?;
                let got = metric_sum(&page, "kvbridge_batches_received_total");
                let blocks = metric_sum(&page, "kvbridge_snapshot_table_blocks");
                Ok(got >= stores as f64 && (b.name == "off" || blocks >= held))
            },
        )?;
    }
    // let the start-up / lap checkpoints of the fill finish (a table that does not change writes
    // none): the checkpoint count holds still for 3 s
    let mut last = Vec::new();
    wait_for("the fill's checkpoints", Duration::from_secs(120), || {
        let now: Vec<f64> = bridges
            .iter()
            .map(|b| b.metric("kvbridge_snapshot_checkpoints_total"))
            .collect::<Result<_, _>>()?;
        let same = now == last;
        last = now;
        if !same {
            std::thread::sleep(Duration::from_secs(3));
        }
        Ok(same)
    })?;
    let off_rss = proc_stats::status_kib(bridges[0].pid(), "VmRSS").unwrap_or(0);
    let mut infos = Vec::new();
    for b in &bridges {
        let rss = proc_stats::status_kib(b.pid(), "VmRSS").unwrap_or(0);
        let page = scrape_page(b.metrics)?;
        let has_table = b.name != "off";
        let table = metric_sum(&page, "kvbridge_snapshot_table_blocks");
        infos.push(BridgeInfo {
            name: b.name.clone(),
            exe: b.exe.display().to_string(),
            args: b.args.clone(),
            rss_kib: rss,
            table_blocks: has_table.then_some(table as u64),
            bytes_per_block: (has_table && table > 0.0)
                .then(|| (rss as f64 - off_rss as f64) * 1024.0 / table),
            table_bytes_per_block: (has_table && table > 0.0)
                .then(|| metric_sum(&page, "kvbridge_snapshot_table_bytes") / table),
            fill_checkpoints: metric_sum(&page, "kvbridge_snapshot_checkpoints_total"),
        });
    }
    log(&format!("fill done in {:.1} s", t0.elapsed().as_secs_f64()));

    let load = Load::start(engines);
    let mut phases = Vec::new();
    for (name, kind, rate) in [
        ("serving churn", SERVING, cfg.churn_rate),
        ("one change a second", ONE_CHANGE, 1),
    ] {
        log(&format!(
            "{name}: {rate} batches/s for {} s",
            cfg.window.as_secs()
        ));
        load.set(kind, rate);
        std::thread::sleep(Duration::from_secs(2));
        let sample = |b: &Bridge| -> Result<(f64, f64, f64, f64), String> {
            let page = scrape_page(b.metrics)?;
            Ok((
                b.cpu()?,
                metric_sum(&page, "kvbridge_snapshot_checkpoints_total"),
                metric_sum(&page, "kvbridge_snapshot_checkpoint_bytes_total"),
                metric_sum(&page, "kvbridge_snapshot_checkpoint_seconds_sum"),
            ))
        };
        let before: Vec<_> = bridges.iter().map(sample).collect::<Result<_, _>>()?;
        let t = Instant::now();
        std::thread::sleep(cfg.window);
        let after: Vec<_> = bridges.iter().map(sample).collect::<Result<_, _>>()?;
        let secs = t.elapsed().as_secs_f64();
        let off_cpu = after[0].0 - before[0].0;
        let rows = bridges
            .iter()
            .zip(before.iter().zip(&after))
            .map(|(b, (x, y))| PhaseBridge {
                name: b.name.clone(),
                cpu_seconds: y.0 - x.0,
                cpu_percent: 100.0 * (y.0 - x.0) / secs,
                above_off_percent: 100.0 * (y.0 - x.0 - off_cpu) / secs,
                checkpoints: y.1 - x.1,
                checkpoint_bytes: y.2 - x.2,
                checkpoint_ms: (y.1 > x.1).then(|| 1e3 * (y.3 - x.3) / (y.1 - x.1)),
            })
            .collect();
        phases.push(Phase {
            name: name.to_string(),
            rate,
            seconds: secs,
            bridges: rows,
        });
    }

    load.set(SERVING, cfg.churn_rate);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let mut late = Vec::new();
    for b in bridges.iter().filter(|b| b.name != "off") {
        log(&format!("late joiners on {}", b.name));
        let served0 = b.metric("kvbridge_snapshots_served_total")?;
        let (ms, alone, during) = rt.block_on(late_joins(&b.grpc, cfg.late_joins))?;
        let mut sorted = ms.clone();
        sorted.sort_by(f64::total_cmp);
        late.push(LateJoin {
            name: b.name.clone(),
            first_message_median_ms: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            first_message_ms: ms,
            snapshots_served: b.metric("kvbridge_snapshots_served_total")? - served0,
            live_max_during_ms: during,
            live_max_alone_ms: alone,
        });
    }
    drop(load);
    Ok(Report {
        blocks: stores * cfg.store_blocks,
        store_blocks: cfg.store_blocks,
        ring_size: cfg.ring_size.clone(),
        bridges: infos,
        phases,
        late_joins: late,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        loadavg: std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
            .to_string(),
    })
}

async fn channel(grpc: &str) -> Result<tonic::transport::Channel, String> {
    tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .map_err(|e| e.to_string())?
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(1 << 20))
        .initial_connection_window_size(Some(16 << 20))
        .connect()
        .await
        .map_err(|e| format!("{grpc}: cannot connect: {e}"))
}

/// A live subscriber's worst latency (ms) over `window`, while `during` runs.
async fn live_max<F: std::future::Future<Output = R>, R>(
    grpc: &str,
    during: impl FnOnce() -> F,
) -> Result<(f64, R), String> {
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let sub = tokio::spawn(super::wire::subscriber(
        channel(grpc).await?,
        stop.clone(),
        measuring.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    measuring.store(true, Ordering::SeqCst);
    let r = during().await;
    measuring.store(false, Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    let out = sub.await.map_err(|e| e.to_string())?;
    Ok((out.hist.max() as f64 / 1e6, r))
}

/// `n` late joiners one after the other on `grpc`: each one's time to its first message (ms),
/// and a live subscriber's worst latency (ms) alone and while they are served.
async fn late_joins(grpc: &str, n: usize) -> Result<(Vec<f64>, f64, f64), String> {
    let per = Duration::from_secs(3);
    let (alone, ()) = live_max(grpc, || tokio::time::sleep(per * n as u32)).await?;
    let (during, ms) = live_max(grpc, || async {
        let mut ms = Vec::new();
        for _ in 0..n {
            let t = Instant::now();
            ms.push(first_message(grpc).await?);
            tokio::time::sleep(per.saturating_sub(t.elapsed())).await;
        }
        Ok::<_, String>(ms)
    })
    .await?;
    Ok((ms?, alone, during))
}

/// Subscribes from 0 taking snapshot chunks; the time to the first message (ms).
async fn first_message(grpc: &str) -> Result<f64, String> {
    let ch = channel(grpc).await?;
    let mut grpc_c = tonic::client::Grpc::new(ch);
    grpc_c.ready().await.map_err(|e| e.to_string())?;
    let path = http::uri::PathAndQuery::from_static(kvbridge::proto::ENGINE_SERVICES[0].path);
    let req = SubscribeKvEventsRequest {
        start_sequence_number: 0,
        load_records_before_first_batch: true,
    };
    let t = Instant::now();
    let mut s = grpc_c
        .server_streaming(tonic::Request::new(req), path, super::RawCodec)
        .await
        .map_err(|e| format!("late joiner: {e}"))?
        .into_inner();
    s.message()
        .await
        .map_err(|e| format!("late joiner: {e}"))?
        .ok_or("late joiner: the stream ended at once")?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// The report as tables.
pub fn table(r: &Report) -> String {
    let mut s = format!(
        "{} blocks held ({} stores of {}), ring {}, {} cores, load {}\n",
        r.blocks,
        r.blocks / r.store_blocks.max(1),
        r.store_blocks,
        r.ring_size,
        r.cores,
        r.loadavg
    );
    s += "bridge      RSS MiB  table blocks  B/block (RSS − off)  B/block (table)  fill checkpoints\n";
    let per = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    for b in &r.bridges {
        s += &format!(
            "{:<10} {:>8.1} {:>13} {:>20} {:>16} {:>17}\n",
            b.name,
            b.rss_kib as f64 / 1024.0,
            b.table_blocks.map_or("-".into(), |n| n.to_string()),
            per(b.bytes_per_block),
            per(b.table_bytes_per_block),
            b.fill_checkpoints
        );
    }
    for p in &r.phases {
        s += &format!("{} at {}/s for {:.0} s\n", p.name, p.rate, p.seconds);
        s += "bridge      CPU % of a core  above off  checkpoints  checkpoint MB  ms each\n";
        for b in &p.bridges {
            s += &format!(
                "{:<10} {:>16.2} {:>10.2} {:>12} {:>14.1} {:>8}\n",
                b.name,
                b.cpu_percent,
                b.above_off_percent,
                b.checkpoints,
                b.checkpoint_bytes / 1e6,
                b.checkpoint_ms.map_or("-".into(), |v| format!("{v:.0}"))
            );
        }
    }
    s += "late joiner  first message ms (median; each)  snapshots  live max ms alone / during\n";
    for l in &r.late_joins {
        s += &format!(
            "{:<10} {:>8.1} {:?} {:>6} {:>10.1} / {:.1}\n",
            l.name,
            l.first_message_median_ms,
            l.first_message_ms
                .iter()
                .map(|v| (v * 10.0).round() / 10.0)
                .collect::<Vec<_>>(),
            l.snapshots_served,
            l.live_max_alone_ms,
            l.live_max_during_ms
        );
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn sums_every_series_of_one_metric() {
        let page = "# HELP x\nkvbridge_a_total{ring=\"r\",reason=\"lap\"} 2\nkvbridge_a_total{ring=\"r\",reason=\"start\"} 1\nkvbridge_a_total_bytes 9\nkvbridge_a_total 4\n";
        assert_eq!(super::metric_sum(page, "kvbridge_a_total"), 7.0);
        assert_eq!(super::metric_sum(page, "kvbridge_b"), 0.0);
    }
}
