//! `kvbridge bench`: whole-system figures under an open-loop load.
//!
//! The publisher sends batch *i* at `start + i / R` by the clock and stamps it with that
//! **scheduled** time; every reader measures latency from the stamp. A stall anywhere (the
//! publisher, the bridge, a reader) therefore shows up in the latency instead of silently
//! lowering the offered rate (no coordinated omission).
//!
//! Readers: N gRPC subscribers spread over C HTTP/2 connections (each parses only the sequence
//! number and timestamp of each batch, so the client side stays cheap enough to run on the same
//! machine), and K shared-memory reader processes (`kvbridge bench-reader`). Each counts
//! delivered, lost (sequence holes) and duplicate batches. The bridge's CPU time and peak RSS
//! come from `/proc/<pid>` of the `serve` process.

pub mod checkpoints;
pub mod floor;
pub mod floor_h2;
mod floor_msg;
pub mod nats;
pub mod proc_stats;
pub mod reader;
pub mod table_ring;
mod wire;
pub mod zmq_column;

pub use wire::RawCodec;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::sim::{encode_batch, EnginePublisher, Layout, SimEvent, Workload};

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Engine batches per second (all ranks together).
    pub rate: u64,
    /// Measured duration.
    pub duration: Duration,
    /// Warm-up before measuring (not recorded).
    pub warmup: Duration,
    /// gRPC subscribers.
    pub subscribers: usize,
    /// HTTP/2 connections they share.
    pub connections: usize,
    /// Shared-memory reader processes.
    pub shm_readers: usize,
    /// Shared-memory readers busy-poll instead of waiting on the futex.
    pub shm_spin: bool,
    /// Batch mix.
    pub mix: Mix,
    /// gRPC address of the bridge.
    pub grpc: String,
    /// Ring file of the bridge.
    pub shm: std::path::PathBuf,
    /// PID of the bridge process, for CPU and RSS.
    pub serve_pid: Option<u32>,
    /// Count the bridge's system calls in the measured window (with `perf`).
    pub count_syscalls: bool,
}

/// The batch mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mix {
    /// vLLM-like: prefill stores of 1–400 blocks, decode stores, eviction sweeps.
    Serving,
    /// One single-block store per batch (smallest batches, highest per-batch overhead).
    Small,
    /// One 64-block store per batch (token-heavy).
    Large,
}

/// Latency percentiles in microseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Maximum.
    pub max_us: f64,
}

impl Latency {
    /// Percentiles of a histogram recorded in nanoseconds.
    pub fn from_ns(h: &Histogram<u64>) -> Self {
        let us = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
        Latency {
            count: h.len(),
            p50_us: us(0.5),
            p90_us: us(0.9),
            p99_us: us(0.99),
            p999_us: us(0.999),
            max_us: h.max() as f64 / 1e3,
        }
    }
}

/// One reader's delivery counts.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Delivery {
    /// Batches received in the measured window.
    pub delivered: u64,
    /// Sequence numbers skipped.
    pub lost: u64,
    /// Sequence numbers received twice or out of order.
    pub duplicates: u64,
    /// Streams that ended with an error status.
    pub errors: u64,
}

/// The result, also written as JSON.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BenchResult {
    /// Offered rate.
    pub rate: u64,
    /// Batches the publisher sent in the measured window.
    pub published: u64,
    /// Measured seconds.
    pub seconds: f64,
    /// Subscribers, connections and shm readers.
    pub subscribers: usize,
    /// HTTP/2 connections.
    pub connections: usize,
    /// Shared-memory reader processes.
    pub shm_readers: usize,
    /// Mix.
    pub mix: Option<Mix>,
    /// End-to-end latency over gRPC (all subscribers).
    pub grpc_latency: Latency,
    /// End-to-end latency over shared memory (all readers).
    pub shm_latency: Latency,
    /// Ring latency: record commit (ingest) → shm reader, the ring alone.
    pub shm_ring_latency: Latency,
    /// Totals over all gRPC subscribers.
    pub grpc: Delivery,
    /// Per-subscriber minimum delivered (a starved subscriber shows here).
    pub grpc_min_delivered: u64,
    /// Totals over all shm readers.
    pub shm: Delivery,
    /// Bridge CPU seconds in the measured window.
    pub bridge_cpu_seconds: Option<f64>,
    /// Bridge CPU as % of one core.
    pub bridge_cpu_percent: Option<f64>,
    /// Bridge peak resident set (KiB).
    pub bridge_peak_rss_kib: Option<u64>,
    /// Encoded bytes delivered to subscribers (MB).
    pub delivered_mb: f64,
    /// Bridge CPU milliseconds per delivered MB.
    pub cpu_ms_per_delivered_mb: Option<f64>,
    /// Bridge CPU microseconds per batch delivered to a gRPC subscriber (the fan-out's unit
    /// cost: one batch to one subscriber).
    pub cpu_us_per_delivered_batch: Option<f64>,
    /// Bridge system calls in the measured window (all threads; `--syscalls`).
    pub bridge_syscalls: Option<u64>,
    /// Bridge system calls per batch delivered to a gRPC subscriber (`--syscalls`).
    pub syscalls_per_delivered_batch: Option<f64>,
    /// Bridge socket writes (`sendto` of more than one byte) per batch published
    /// (`--syscalls`): per connection when there is one, the multiplexed shape's question.
    pub socket_writes_per_batch: Option<f64>,
    /// `--floor`: the same shape without gRPC, HTTP/2 or the bridge, measured right after
    /// (see [`floor`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub floor: Vec<floor::FloorResult>,
    /// `--zmq-subscribers`: the `--publish-zmq` column and its bare-relay floor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zmq: Option<zmq_column::ZmqResult>,
    /// `--zmq-alternate`: the gRPC column per window, without and with ZMQ subscribers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub zmq_alternation: Vec<zmq_column::AltWindow>,
}

/// The publisher thread: open loop, stamps each batch with its scheduled send time.
pub struct Publisher {
    /// Sent in the measured window.
    pub published: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn mix_batch(mix: Mix, w: &mut Workload, seed: &mut u64) -> Vec<SimEvent> {
    let mut store = |blocks: usize| {
        *seed += 1;
        let hashes = (0..blocks as u64)
            .map(|i| seed.wrapping_mul(0x9E37_79B9).wrapping_add(i))
            .collect();
        let tokens = (0..blocks * 16)
            .map(|i| (i as u32 * 7919) % 151_000 + 1)
            .collect();
        SimEvent::Stored {
            hashes,
            parent: None,
            tokens,
            block_size: 16,
            medium: Some("GPU".into()),
        }
    };
    match mix {
        Mix::Serving => w.next_batch(),
        Mix::Small => vec![store(1)],
        Mix::Large => vec![store(64)],
    }
}

impl Publisher {
    /// Binds the engine side (PUB + replay ROUTER) at `endpoint` / `replay`.
    pub fn bind(
        ctx: &zmq::Context,
        endpoint: &str,
        replay: &str,
    ) -> Result<(EnginePublisher, String, String), String> {
        let p = EnginePublisher::bind(ctx, endpoint, Some(replay), "")
            .map_err(|e| format!("cannot bind the bench engine at {endpoint}: {e}"))?;
        let (e, r) = (p.endpoint(), p.replay_endpoint().unwrap_or_default());
        Ok((p, e, r))
    }

    /// Starts publishing at `rate` per second; batches sent after `measure_from` are counted.
    pub fn start(mut p: EnginePublisher, rate: u64, mix: Mix, measure_from: Instant) -> Publisher {
        let published = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (pc, sc) = (published.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("bench-publisher".into())
            .spawn(move || {
                let mut w = Workload::new(42);
                let mut seed = 0u64;
                // Pre-encode a pool of batches so that encoding cost does not limit the rate;
                // the timestamp (`9x cb <f64>`: bytes 2..10) is patched per send.
                let pool: Vec<Vec<u8>> = (0..256)
                    .map(|i| {
                        encode_batch(
                            Layout::ALL[i % Layout::ALL.len()],
                            0.0,
                            &mix_batch(mix, &mut w, &mut seed),
                            0,
                        )
                    })
                    .collect();
                fine_timer_slack();
                let start = Instant::now();
                let wall0 = kvbridge::clock::unix_seconds();
                let period_ns = 1e9 / rate as f64;
                let mut i: u64 = 0;
                while !sc.load(Ordering::Relaxed) {
                    let due = start + Duration::from_nanos((i as f64 * period_ns) as u64);
                    loop {
                        let now = Instant::now();
                        if now >= due {
                            break;
                        }
                        let left = due - now;
                        // Sleep until just before the due time; spin only the last few µs, so the
                        // load generator does not take a core the bridge needs.
                        if left > Duration::from_micros(15) {
                            std::thread::sleep(left - Duration::from_micros(10));
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                    let mut b = pool[(i % pool.len() as u64) as usize].clone();
                    let scheduled = wall0 + (due - start).as_secs_f64();
                    wire::patch_ts(&mut b, scheduled);
                    p.publish(b);
                    if i % 64 == 0 {
                        p.serve_replay();
                    }
                    if due >= measure_from {
                        pc.fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                }
            })
            .expect("spawn publisher");
        Publisher {
            published,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops publishing.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs the gRPC subscribers and shm readers against a running bridge with a publisher already
/// started, for the measured window; returns the merged result.
pub async fn measure(
    cfg: &BenchConfig,
    publisher: &Publisher,
    progress: bool,
) -> Result<BenchResult, String> {
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    // HTTP/2 connections.
    let mut channels = Vec::new();
    for _ in 0..cfg.connections.max(1) {
        let url = if cfg.grpc.contains("://") {
            cfg.grpc.clone()
        } else {
            format!("http://{}", cfg.grpc)
        };
        let ch = tonic::transport::Endpoint::from_shared(url)
            .map_err(|e| e.to_string())?
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(1 << 20))
            .initial_connection_window_size(Some(16 << 20))
            .connect()
            .await
            .map_err(|e| format!("--grpc {}: cannot connect: {e}", cfg.grpc))?;
        channels.push(ch);
    }
    let mut subs = Vec::new();
    for i in 0..cfg.subscribers {
        let ch = channels[i % channels.len()].clone();
        subs.push(tokio::spawn(wire::subscriber(
            ch,
            stop.clone(),
            measuring.clone(),
        )));
    }
    let mut readers = Vec::new();
    for _ in 0..cfg.shm_readers {
        readers.push(reader::spawn_process(
            &cfg.shm,
            cfg.warmup + cfg.duration + Duration::from_millis(500),
            cfg.shm_spin,
            cfg.warmup,
            cfg.duration,
        )?);
    }
    tokio::time::sleep(cfg.warmup).await;
    measuring.store(true, Ordering::SeqCst);
    let cpu0 = cfg.serve_pid.and_then(proc_stats::cpu_seconds);
    let syscalls = match (cfg.count_syscalls, cfg.serve_pid) {
        (true, Some(pid)) => Some(proc_stats::SyscallCounter::start(pid)?),
        (true, None) => return Err("--syscalls needs the bridge's pid (--serve-pid)".into()),
        _ => None,
    };
    let p0 = publisher.published.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let mut last = 0;
    while t0.elapsed() < cfg.duration {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let s = t0.elapsed().as_secs();
        if progress && s != last {
            last = s;
            let sent = publisher.published.load(Ordering::Relaxed) - p0;
            eprint!(
                "\rbench: {s:>3}/{}s  published {sent}  ",
                cfg.duration.as_secs()
            );
        }
    }
    if progress {
        eprintln!();
    }
    measuring.store(false, Ordering::SeqCst);
    let seconds = t0.elapsed().as_secs_f64();
    let published = publisher.published.load(Ordering::Relaxed) - p0;
    let cpu1 = cfg.serve_pid.and_then(proc_stats::cpu_seconds);
    let syscalls = syscalls
        .map(proc_stats::SyscallCounter::finish)
        .transpose()?;
    // Let in-flight batches arrive before the readers stop counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);

    let mut r = BenchResult {
        rate: cfg.rate,
        published,
        seconds,
        subscribers: cfg.subscribers,
        connections: cfg.connections,
        shm_readers: cfg.shm_readers,
        mix: Some(cfg.mix),
        grpc_min_delivered: u64::MAX,
        ..Default::default()
    };
    let mut gh = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("bounds");
    let mut bytes = 0u64;
    for s in subs {
        let out = s.await.map_err(|e| e.to_string())?;
        gh.add(&out.hist).map_err(|e| e.to_string())?;
        r.grpc.delivered += out.delivery.delivered;
        r.grpc.lost += out.delivery.lost;
        r.grpc.duplicates += out.delivery.duplicates;
        r.grpc.errors += out.delivery.errors;
        r.grpc_min_delivered = r.grpc_min_delivered.min(out.delivery.delivered);
        bytes += out.bytes;
    }
    if cfg.subscribers == 0 {
        r.grpc_min_delivered = 0;
    }
    r.grpc_latency = Latency::from_ns(&gh);
    let mut sh = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("bounds");
    let mut rh = sh.clone();
    for p in readers {
        let out = reader::collect(p)?;
        sh.add(&out.hist).map_err(|e| e.to_string())?;
        rh.add(&out.ring).map_err(|e| e.to_string())?;
        r.shm.delivered += out.delivery.delivered;
        r.shm.lost += out.delivery.lost;
        r.shm.duplicates += out.delivery.duplicates;
        r.shm.errors += out.delivery.errors;
    }
    r.shm_latency = Latency::from_ns(&sh);
    r.shm_ring_latency = Latency::from_ns(&rh);
    r.delivered_mb = bytes as f64 / 1e6;
    if let (Some(a), Some(b)) = (cpu0, cpu1) {
        let cpu = b - a;
        r.bridge_cpu_seconds = Some(cpu);
        r.bridge_cpu_percent = Some(100.0 * cpu / seconds);
        if r.delivered_mb > 0.0 {
            r.cpu_ms_per_delivered_mb = Some(cpu * 1e3 / r.delivered_mb);
        }
        if r.grpc.delivered > 0 {
            r.cpu_us_per_delivered_batch = Some(cpu * 1e6 / r.grpc.delivered as f64);
        }
    }
    r.bridge_syscalls = syscalls.map(|c| c.all);
    if let (Some(c), true) = (syscalls, r.grpc.delivered > 0) {
        r.syscalls_per_delivered_batch = Some(c.all as f64 / r.grpc.delivered as f64);
    }
    if let (Some(c), true) = (syscalls, published > 0) {
        r.socket_writes_per_batch = Some(c.sends as f64 / published as f64);
    }
    r.bridge_peak_rss_kib = cfg.serve_pid.and_then(proc_stats::peak_rss_kib);
    Ok(r)
}

/// The result as a table.
pub fn table(r: &BenchResult) -> String {
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
    let mut s = String::new();
    s += &format!(
        "rate {}/s  for {:.1}s  published {}  subscribers {} over {} connections  shm readers {}\n",
        r.rate, r.seconds, r.published, r.subscribers, r.connections, r.shm_readers
    );
    s += "path   delivered      lost  dup  err     p50 µs     p90 µs     p99 µs   p99.9 µs     max µs\n";
    for (name, d, l) in [
        ("grpc", &r.grpc, &r.grpc_latency),
        ("shm", &r.shm, &r.shm_latency),
        ("ring", &r.shm, &r.shm_ring_latency),
    ] {
        s += &format!(
            "{name:<5} {:>10} {:>9} {:>4} {:>4} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}\n",
            d.delivered,
            d.lost,
            d.duplicates,
            d.errors,
            l.p50_us,
            l.p90_us,
            l.p99_us,
            l.p999_us,
            l.max_us
        );
    }
    s += &format!(
        "bridge CPU {}% of a core, peak RSS {} MiB, {:.1} MB delivered, {} CPU ms per delivered MB\n",
        f(r.bridge_cpu_percent),
        r.bridge_peak_rss_kib.map_or("-".into(), |k| format!("{:.1}", k as f64 / 1024.0)),
        r.delivered_mb,
        f(r.cpu_ms_per_delivered_mb)
    );
    s += &format!(
        "bridge CPU per delivered batch {} µs, syscalls per delivered batch {}, socket writes per batch {}\n",
        r.cpu_us_per_delivered_batch
            .map_or("-".into(), |v| format!("{v:.2}")),
        r.syscalls_per_delivered_batch
            .map_or("-".into(), |v| format!("{v:.2}")),
        r.socket_writes_per_batch
            .map_or("-".into(), |v| format!("{v:.2}")),
    );
    s
}

/// Sets the calling thread's timer slack to 1 µs (default 50 µs) so that the short sleeps of a
/// pacing loop end on time.
pub(crate) fn fine_timer_slack() {
    let _ = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1000));
}

/// Stops a `kvbridge serve` child the bench started: SIGTERM, up to `patience` for a clean exit
/// (so its shutdown path runs, as in production), then SIGKILL; then removes its ring with
/// everything beside it ([`kvbridge::ring::RingFiles::remove`]).
pub fn stop_bridge(child: &mut std::process::Child, shm: &std::path::Path, patience: Duration) {
    // At worst it already exited and the call fails.
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(child),
        rustix::process::Signal::TERM,
    );
    let deadline = Instant::now() + patience;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = kvbridge::ring::RingFiles::new(shm).remove();
}
