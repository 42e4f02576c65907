//! `kvbridge demo`: the whole path in one process, no engine needed.
//!
//! Two simulated engine ranks (vLLM-like workload, rotating release layouts, replay enabled)
//! publish over real ZMQ on loopback; the bridge decodes into a ring under `/dev/shm`; one
//! shared-memory reader and a few gRPC subscribers read it; a one-screen summary refreshes every
//! second. Latency is measured end to end: gRPC from the engine's own batch timestamp, shm from
//! the record's ingest time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use prost::Message;

use crate::sim::{encode_batch, EnginePublisher, Layout, Workload};
use kvbridge::cli::CliError;
use kvbridge::config::{ByteSize, LogFormat, ServeArgs};
use kvbridge::proto::common::{KvEventBatch, SubscribeKvEventsRequest};

/// `kvbridge demo` flags.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    duration: Option<u64>,
    /// Engine batches per second, per rank.
    #[arg(long, default_value_t = 500)]
    rate: u64,
    /// Simulated DP ranks.
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    /// gRPC subscribers.
    #[arg(long, default_value_t = 4)]
    subscribers: usize,
    /// gRPC listen address (port 0 = any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    grpc: String,
}

/// Latency and counts of one reader kind, reset each screen refresh.
struct Lane {
    hist: Mutex<Histogram<u64>>,
    batches: AtomicU64,
    losses: AtomicU64,
}

impl Lane {
    fn new() -> Arc<Self> {
        Arc::new(Lane {
            hist: Mutex::new(
                Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds"),
            ),
            batches: AtomicU64::new(0),
            losses: AtomicU64::new(0),
        })
    }
    fn record(&self, us: u64) {
        let _ = self.hist.lock().record(us.clamp(1, 60_000_000));
        self.batches.fetch_add(1, Ordering::Relaxed);
    }
    /// (p50 µs, p99 µs, count) since the last call.
    fn take(&self) -> (u64, u64, u64) {
        let mut h = self.hist.lock();
        let r = (h.value_at_quantile(0.5), h.value_at_quantile(0.99), h.len());
        h.reset();
        r
    }
}

fn now_secs() -> f64 {
    kvbridge::clock::unix_seconds()
}

pub(super) fn run(a: DemoArgs) -> Result<(), CliError> {
    if a.rate == 0 || a.ranks == 0 || a.ranks > 16 {
        return Err(CliError::Setup(
            "--rate must be > 0 and --ranks between 1 and 16".into(),
        ));
    }
    kvbridge::cli::init_tracing(LogFormat::Text);
    let rt = kvbridge::cli::runtime()?;
    rt.block_on(demo(a))
}

async fn demo(a: DemoArgs) -> Result<(), CliError> {
    let mut signals = kvbridge::cli::StopSignals::install()?;
    let stop = Arc::new(AtomicBool::new(false));
    // Engines first: they bind, so their ports are known before the bridge connects.
    let ctx = zmq::Context::new();
    let engines = bind_engines(&ctx, a.ranks)?;
    let shm = demo_ring_path();
    // The demo's ring is its own: removed (with its wake file and checkpoint) however the demo
    // ends.
    struct RemoveRing(std::path::PathBuf);
    impl Drop for RemoveRing {
        fn drop(&mut self) {
            let _ = kvbridge::ring::RingFiles::new(&self.0).remove();
        }
    }
    let _remove_ring = RemoveRing(shm.clone());
    let mut args = ServeArgs::default();
    args.engine.zmq = engines.iter().map(|(_, p)| p.endpoint()).collect();
    args.engine.replay = engines
        .iter()
        .map(|(_, p)| p.replay_endpoint().unwrap_or_default())
        .collect();
    args.streaming.grpc = Some(a.grpc.clone());
    args.ring.shm = Some(shm.clone());
    args.ring.ring_size = Some(ByteSize::Bytes(64 << 20));
    args.ops.metrics = Some("127.0.0.1:0".into());
    let cfg = args.resolve().map_err(|e| CliError::Setup(e.to_string()))?;
    let service = kvbridge::service::run_service(&cfg).await?;
    let grpc = service.grpc_addr;
    // Sequence numbers on screen count from the ring's first record of this run (its base is a 16-digit
    // number, the Unix µs at which it was created).
    let base = service.merged.window().1 + 1;

    // Engine threads: paced by the clock, one batch per tick, answering replay requests.
    let published = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for (rank, p) in engines {
        threads.push(spawn_engine(
            rank,
            p,
            stop.clone(),
            published.clone(),
            a.rate,
        ));
    }

    // gRPC subscribers measure from the engine's timestamp.
    let grpc_lane = Lane::new();
    for _ in 0..a.subscribers {
        tokio::spawn(grpc_subscriber(grpc_lane.clone(), format!("http://{grpc}")));
    }

    // One shared-memory reader, in a thread of its own, measures from the ingest time.
    let shm_lane = Lane::new();
    threads.push(spawn_shm_reader(
        shm_lane.clone(),
        stop.clone(),
        service.merged.clone(),
    ));

    // What a newcomer needs stays on every screen: where things are and what to try.
    let ring = shm.display();
    let mut guide = format!(
        "{} engine rank(s) at {} batches/s each → ring → gRPC\n\
         gRPC      {grpc}\n\
         ring      {ring}\n",
        a.ranks, a.rate
    );
    if let Some(m) = service.metrics_addr {
        guide.push_str(&format!("metrics   http://{m}/metrics\n"));
    }
    guide.push_str(&format!(
        "try       kvbridge subscribe --grpc {grpc} --count 3\n          \
         kvbridge tail --shm {ring} --count 3\n"
    ));
    println!("kvbridge demo: {guide}");
    let started = Instant::now();
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last_pub = 0;
    let mut last_sent = 0;
    let mut fatal = service.failure();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = signals.recv() => break,
            _ = fatal.changed() => break,
        }
        let pubd = published.load(Ordering::Relaxed);
        let sent = service.fanout.metrics.batches_sent.get();
        let (o, n) = service.merged.window();
        let (gp50, gp99, gn) = grpc_lane.take();
        let (sp50, sp99, sn) = shm_lane.take();
        let frames_dropped = frames_dropped(&service.metrics);
        let screen = format!(
            "kvbridge demo — {:>4}s\n\
             engine in     {:>8} batches/s   ({} ranks)\n\
             ring          #{}..#{} of this run  ({} records retained; #1 = seq {base})\n\
             gRPC out      {:>8} batches/s   to {} subscribers   p50 {} µs  p99 {} µs  ({} samples)\n\
             shm reader    p50 {} µs  p99 {} µs  ({} samples)\n\
             loss          gRPC resubscribes {}   shm laps {}   malformed frames {}\n",
            started.elapsed().as_secs(),
            pubd - last_pub,
            a.ranks,
            (o + 1).saturating_sub(base),
            (n + 1).saturating_sub(base),
            n.saturating_sub(o) + u64::from(n >= o),
            sent - last_sent,
            service.fanout.active(),
            gp50,
            gp99,
            gn,
            sp50,
            sp99,
            sn,
            grpc_lane.losses.load(Ordering::Relaxed),
            shm_lane.losses.load(Ordering::Relaxed),
            frames_dropped,
        );
        if tty {
            println!("\x1b[H\x1b[2J{screen}\n{guide}\n(Ctrl-C to stop)");
        } else {
            println!("{screen}");
        }
        last_pub = pubd;
        last_sent = sent;
        if a.duration
            .is_some_and(|d| started.elapsed() >= Duration::from_secs(d))
        {
            break;
        }
    }
    // The bridge first: engines that went away under a running bridge would be (rightly) logged
    // as upstream disconnects, which a normal stop is not.
    service.shutdown().await;
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        let _ = t.join();
    }
    let failed = fatal.borrow().clone();
    if let Some(why) = failed {
        return Err(CliError::Failed(why));
    }
    println!("demo stopped cleanly");
    Ok(())
}

/// One simulated engine per rank, bound on loopback with a replay ROUTER.
fn bind_engines(ctx: &zmq::Context, ranks: u32) -> Result<Vec<(u32, EnginePublisher)>, CliError> {
    (0..ranks)
        .map(|r| {
            EnginePublisher::bind(ctx, "tcp://127.0.0.1:*", Some("tcp://127.0.0.1:*"), "")
                .map(|p| (r, p))
                .map_err(|e| CliError::Setup(format!("cannot bind the demo engine: {e}")))
        })
        .collect()
}

/// The demo's own ring: in /dev/shm when there is one, else the temp dir.
fn demo_ring_path() -> std::path::PathBuf {
    let name = format!("kvbridge-demo-{}", std::process::id());
    if std::path::Path::new("/dev/shm").is_dir() {
        std::path::Path::new("/dev/shm").join(name)
    } else {
        std::env::temp_dir().join(name)
    }
}

/// An engine thread: paced by the clock, one batch per tick (rotating release layouts),
/// answering replay requests, until `stop`.
fn spawn_engine(
    rank: u32,
    mut p: EnginePublisher,
    stop: Arc<AtomicBool>,
    published: Arc<AtomicU64>,
    rate: u64,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut w = Workload::new(0xC0FFEE + rank as u64);
        let period = Duration::from_nanos(1_000_000_000 / rate);
        let start = Instant::now();
        let mut i: u64 = 0;
        while !stop.load(Ordering::Relaxed) {
            let due = start + period * (i as u32);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let layout = Layout::ALL[(i as usize + rank as usize) % Layout::ALL.len()];
            let events = w.next_batch();
            p.publish(encode_batch(layout, now_secs(), &events, rank));
            p.serve_replay();
            published.fetch_add(1, Ordering::Relaxed);
            i += 1;
        }
    })
}

/// A gRPC subscriber measuring from the engine's timestamp; it resumes with its cursor after a
/// transient error and starts over (counted as a loss) after `DATA_LOSS` / `OUT_OF_RANGE`.
async fn grpc_subscriber(lane: Arc<Lane>, url: String) {
    let Ok(mut c) =
        kvbridge::proto::vllm::grpc::engine::vllm_engine_client::VllmEngineClient::connect(url)
            .await
    else {
        return;
    };
    let mut cursor = 0;
    loop {
        let req = SubscribeKvEventsRequest {
            start_sequence_number: cursor,
            load_records_before_first_batch: false,
        };
        let Ok(resp) = c.subscribe_kv_events(req).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let mut s = resp.into_inner();
        loop {
            match s.message().await {
                Ok(Some(b)) => {
                    cursor = b.sequence_number;
                    lane.record(((now_secs() - b.timestamp).max(0.0) * 1e6) as u64);
                }
                Ok(None) => return,
                Err(st) => {
                    if st.code() == tonic::Code::DataLoss || st.code() == tonic::Code::OutOfRange {
                        lane.losses.fetch_add(1, Ordering::Relaxed);
                        cursor = 0;
                    } else {
                        // Transient (e.g. shutdown): back off, resume with the cursor.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    break;
                }
            }
        }
    }
}

/// One shared-memory reader, in a thread of its own, measuring from the ingest time.
fn spawn_shm_reader(
    lane: Arc<Lane>,
    stop: Arc<AtomicBool>,
    hub: Arc<kvbridge::ring::RingHub>,
) -> std::thread::JoinHandle<()> {
    let mut reader = hub.reader();
    std::thread::spawn(move || {
        use kvbridge_shm::ReadOutcome;
        let _ = reader.seek(reader.newest() + 1);
        let mut payload = Vec::new();
        // A ring that became unusable (truncated) must not be read any more.
        while !stop.load(Ordering::Relaxed) && hub.failure().is_none() {
            match reader.next_blocking(Duration::from_millis(100)) {
                ReadOutcome::Record(v) => {
                    let ingest = v.meta().ingest_ns;
                    let ok = v.copy_to(&mut payload) && KvEventBatch::decode(&payload[..]).is_ok();
                    if ok {
                        lane.record(kvbridge::clock::unix_nanos().saturating_sub(ingest) / 1000);
                    }
                }
                ReadOutcome::Lapped { .. } | ReadOutcome::Corrupt { .. } => {
                    lane.losses.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
    })
}

/// Engine messages dropped before decoding, over every rank and reason (ingest's
/// `kvbridge_frames_dropped_total`, read from the registry as a scrape would).
fn frames_dropped(metrics: &kvbridge::metrics::Metrics) -> u64 {
    metrics
        .registry
        .gather()
        .iter()
        .filter(|f| f.name() == "kvbridge_frames_dropped_total")
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}
