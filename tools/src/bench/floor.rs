//! The fan-out's floor (`kvbridge bench --floor`): the same shape as the gRPC fan-out with no
//! gRPC, no HTTP/2, no ring and no bridge — C loopback TCP connections (`TCP_NODELAY`, as a
//! streaming server has) and, R times a second, one write of a delivered frame's size to each —
//! measured as the **sender process's** CPU per delivered batch.
//!
//! On loopback the sender's CPU includes the receiving side's TCP processing (softirq) and the
//! wake-up of the reader, exactly as the bridge's does, so the blocking sender below is what any
//! implementation that writes every batch promptly to every connection must spend at least:
//! one `write` per connection per batch and nothing else. The `tokio` sender adds the shape of
//! an async streaming server on top (one task per connection, woken per batch from a producer
//! thread, as kvbridge's ring commit wakes its subscribers), so the two rows split the bridge's
//! cost into the kernel's, the async runtime's and the rest (HTTP/2, gRPC, the ring). A third
//! sender, `h2-writev` (`--floor-senders`, [`super::floor_h2`]), is the blocking shape with real
//! HTTP/2 and gRPC framing written by hand: the prototype of a streaming path that costs
//! what the kernel costs.
//!
//! The sender is a child process (`kvbridge bench-floor`), so its CPU is measured alone; the
//! receiving side runs in the bench process, as the gRPC subscribers do. Each message carries
//! its batch number and scheduled send time, so loss and latency are measured like the bench's.

use std::io::Write;
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::io::AsyncReadExt;

use super::floor_msg::{clocked, stamp, Received, HEADER};
use super::{proc_stats, Latency};

/// How the floor's sender writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FloorSender {
    /// Two threads, each with half the connections: sleep until the batch is due, then one
    /// blocking `write` per connection. The bare kernel cost.
    Blocking,
    /// A two-worker tokio runtime with one task per connection, woken per batch (a `watch`
    /// channel) by a producer thread, each doing one `write`: the floor of an async server.
    Tokio,
    /// The blocking sender's shape with real HTTP/2 and gRPC framing written by hand: one
    /// non-blocking `writev` per connection per batch of a 14-byte header and the shared
    /// payload, within the client's flow-control windows (see [`super::floor_h2`]).
    H2Writev,
}

impl FloorSender {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            FloorSender::Blocking => "blocking",
            FloorSender::Tokio => "tokio",
            FloorSender::H2Writev => "h2-writev",
        }
    }
}

/// The floor senders to run, in order (`--floor-senders blocking,tokio,h2-writev`): inline, not a
/// `Vec`, so that the bench's flags stay small.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloorSenders([Option<FloorSender>; 3]);

impl FloorSenders {
    /// The senders, in the order given.
    pub fn iter(&self) -> impl Iterator<Item = FloorSender> + '_ {
        self.0.iter().flatten().copied()
    }
}

impl std::str::FromStr for FloorSenders {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut out = [None; 3];
        for (i, name) in s.split(',').enumerate() {
            let sender = <FloorSender as clap::ValueEnum>::from_str(name.trim(), false)?;
            *out.get_mut(i).ok_or("at most three floor senders")? = Some(sender);
        }
        Ok(FloorSenders(out))
    }
}

/// What the floor measures.
#[derive(Clone, Debug)]
pub struct FloorConfig {
    /// Batches per second.
    pub rate: u64,
    /// Measured duration.
    pub duration: Duration,
    /// Warm-up before measuring.
    pub warmup: Duration,
    /// TCP connections.
    pub connections: usize,
    /// Bytes written per connection per batch.
    pub message_bytes: usize,
    /// Batches a message stands for (subscribers per connection: a multiplexed connection
    /// carries one frame per subscriber per batch, in one write).
    pub batches_per_message: usize,
    /// The sender.
    pub sender: FloorSender,
    /// Count the sender's system calls (`perf`).
    pub count_syscalls: bool,
}

/// The floor's result (JSON field `floor` of the bench result).
#[derive(Clone, Debug, Serialize)]
pub struct FloorResult {
    /// The sender.
    pub sender: FloorSender,
    /// TCP connections.
    pub connections: usize,
    /// Batches per second.
    pub rate: u64,
    /// Bytes per write.
    pub message_bytes: usize,
    /// Measured seconds.
    pub seconds: f64,
    /// Messages received in the measured window (all connections).
    pub delivered_messages: u64,
    /// Batches those stand for (`delivered_messages × batches_per_message`).
    pub delivered_batches: u64,
    /// Messages missing (holes in a connection's batch numbers).
    pub lost: u64,
    /// Scheduled send time → received.
    pub latency: Latency,
    /// Sender CPU seconds in the window.
    pub sender_cpu_seconds: Option<f64>,
    /// Sender CPU as % of one core.
    pub sender_cpu_percent: Option<f64>,
    /// Sender CPU microseconds per delivered batch (comparable with the bench's
    /// `cpu_us_per_delivered_batch`).
    pub cpu_us_per_delivered_batch: Option<f64>,
    /// Sender system calls per delivered batch (`--syscalls`).
    pub syscalls_per_delivered_batch: Option<f64>,
    /// `h2-writev`: the sender's write, park and flow-control counters over its whole run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub h2: Option<super::floor_h2::H2Counters>,
}

/// The floor's sender (`kvbridge bench-floor`): connects `connections` times to `addr`, then
/// for `run` writes one `bytes`-long message per connection per batch at `rate` per second.
pub fn run_sender(
    addr: &str,
    connections: usize,
    rate: u64,
    bytes: usize,
    run: Duration,
    mode: FloorSender,
) -> Result<(), String> {
    let mut socks = Vec::with_capacity(connections);
    for _ in 0..connections {
        let s = TcpStream::connect(addr).map_err(|e| format!("{addr}: cannot connect: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        socks.push(s);
    }
    let bytes = bytes.max(HEADER);
    match mode {
        FloorSender::Blocking => blocking(socks, rate, bytes, run),
        FloorSender::Tokio => with_tokio(socks, rate, bytes, run),
        FloorSender::H2Writev => super::floor_h2::h2_writev(socks, rate, bytes, run),
    }
}

fn blocking(socks: Vec<TcpStream>, rate: u64, bytes: usize, run: Duration) -> Result<(), String> {
    // Two threads (as the bridge has two workers), each with half the connections, so that on a
    // busy machine the floor is not held back by having one thread where the bridge has two.
    let mut halves: [Vec<TcpStream>; 2] = [Vec::new(), Vec::new()];
    for (i, s) in socks.into_iter().enumerate() {
        halves[i % 2].push(s);
    }
    let threads: Vec<_> = halves
        .into_iter()
        .map(|mut socks| {
            std::thread::spawn(move || {
                let mut msg = vec![0u8; bytes];
                clocked(rate, run, |seq, at| {
                    stamp(&mut msg, seq, at);
                    for s in &mut socks {
                        s.write_all(&msg).map_err(|e| format!("write: {e}"))?;
                    }
                    Ok(())
                })
            })
        })
        .collect();
    for t in threads {
        t.join()
            .map_err(|_| "a sender thread panicked".to_string())??;
    }
    Ok(())
}

fn with_tokio(socks: Vec<TcpStream>, rate: u64, bytes: usize, run: Duration) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let period = 1.0 / rate.max(1) as f64;
    let (tx, rx) = tokio::sync::watch::channel((0u64, 0f64));
    let mut tasks = Vec::new();
    for s in socks {
        s.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut rx = rx.clone();
        tasks.push(rt.spawn(async move {
            let mut s = tokio::net::TcpStream::from_std(s)?;
            // A task that runs late finds several batches due: it writes them all, in one
            // write (as a streaming server joins what is ready), never skipping one.
            let (mut msg, mut next) = (Vec::new(), 0u64);
            while rx.changed().await.is_ok() {
                let (seq, at) = *rx.borrow_and_update();
                msg.clear();
                for i in next..=seq {
                    let start = msg.len();
                    msg.resize(start + bytes, 0);
                    stamp(&mut msg[start..], i, at - (seq - i) as f64 * period);
                }
                next = seq + 1;
                s.write_all(&msg).await?;
            }
            Ok::<_, std::io::Error>(())
        }));
    }
    drop(rx);
    let r = clocked(rate, run, |seq, at| {
        tx.send((seq, at))
            .map_err(|_| "every writer ended".to_string())
    });
    drop(tx);
    rt.block_on(async {
        for t in tasks {
            let _ = t.await;
        }
    });
    r
}

/// Starts the sender process against `addr`.
fn spawn_sender(addr: &str, cfg: &FloorConfig, run: Duration) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let sender = cfg.sender.name();
    Command::new(exe)
        .args(["bench-floor", "--connect", addr, "--sender", sender])
        .args(["--connections", &cfg.connections.to_string()])
        .args(["--rate", &cfg.rate.to_string()])
        .args(["--bytes", &cfg.message_bytes.to_string()])
        .args(["--run-ms", &run.as_millis().to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the floor's sender: {e}"))
}

/// Reads fixed-size messages until EOF, counting those received while `measuring`.
async fn receive(
    mut s: tokio::net::TcpStream,
    bytes: usize,
    measuring: Arc<AtomicBool>,
) -> Received {
    let mut out = Received::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut have = 0;
    loop {
        let n = match s.read(&mut buf[have..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        have += n;
        let now = kvbridge::clock::unix_seconds();
        let mut at = 0;
        let on = measuring.load(Ordering::Relaxed);
        while have - at >= bytes {
            out.note(&buf[at..at + bytes], now, on);
            at += bytes;
        }
        buf.copy_within(at..have, 0);
        have -= at;
        if buf.len() - have < bytes {
            buf.resize(have + bytes.max(64 * 1024), 0);
        }
    }
    out
}

/// Runs the floor: listens on loopback, starts the sender process, receives for the warm-up and
/// the measured window, and measures the sender's CPU (and system calls) in that window.
pub async fn measure(cfg: &FloorConfig) -> Result<FloorResult, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("floor: cannot listen: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| e.to_string())?
        .to_string();
    let bytes = cfg.message_bytes.max(HEADER);
    let run = cfg.warmup + cfg.duration + Duration::from_millis(500);
    let child = spawn_sender(&addr, cfg, run)?;
    let pid = child.id();
    let measuring = Arc::new(AtomicBool::new(false));
    let mut conns = Vec::new();
    for _ in 0..cfg.connections {
        let (s, _) = tokio::time::timeout(Duration::from_secs(20), listener.accept())
            .await
            .map_err(|_| "floor: the sender did not connect within 20 s".to_string())?
            .map_err(|e| format!("floor: accept: {e}"))?;
        let _ = s.set_nodelay(true);
        conns.push(match cfg.sender {
            FloorSender::H2Writev => tokio::spawn(super::floor_h2::receive(s, measuring.clone())),
            _ => tokio::spawn(receive(s, bytes, measuring.clone())),
        });
    }
    tokio::time::sleep(cfg.warmup).await;
    measuring.store(true, Ordering::SeqCst);
    let cpu0 = proc_stats::cpu_seconds(pid);
    let syscalls = if cfg.count_syscalls {
        Some(proc_stats::SyscallCounter::start(pid)?)
    } else {
        None
    };
    let t0 = Instant::now();
    tokio::time::sleep(cfg.duration).await;
    measuring.store(false, Ordering::SeqCst);
    let seconds = t0.elapsed().as_secs_f64();
    let cpu1 = proc_stats::cpu_seconds(pid);
    let syscalls = syscalls
        .map(proc_stats::SyscallCounter::finish)
        .transpose()?;
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("floor: sender: {e}"))?;
    if !output.status.success() {
        return Err(format!("floor: the sender failed ({})", output.status));
    }
    let h2 = String::from_utf8_lossy(&output.stdout)
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok());
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("bounds");
    let (mut delivered, mut lost) = (0, 0);
    for c in conns {
        let r = c.await.map_err(|e| e.to_string())?;
        delivered += r.delivered;
        lost += r.lost;
        h.add(&r.hist).map_err(|e| e.to_string())?;
    }
    let batches = delivered * cfg.batches_per_message.max(1) as u64;
    let cpu = cpu0.zip(cpu1).map(|(a, b)| b - a);
    Ok(FloorResult {
        sender: cfg.sender,
        connections: cfg.connections,
        rate: cfg.rate,
        message_bytes: bytes,
        seconds,
        delivered_messages: delivered,
        delivered_batches: batches,
        lost,
        latency: Latency::from_ns(&h),
        sender_cpu_seconds: cpu,
        sender_cpu_percent: cpu.map(|c| 100.0 * c / seconds),
        cpu_us_per_delivered_batch: cpu
            .filter(|_| batches > 0)
            .map(|c| c * 1e6 / batches as f64),
        syscalls_per_delivered_batch: syscalls
            .filter(|_| batches > 0)
            .map(|n| n.all as f64 / batches as f64),
        h2,
    })
}

/// One line per floor row, with the bridge's ratio to it.
pub fn table(r: &FloorResult, bridge_us: Option<f64>) -> String {
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    let ratio = match (bridge_us, r.cpu_us_per_delivered_batch) {
        (Some(b), Some(f)) if f > 0.0 => format!("{:.2}", b / f),
        _ => "-".into(),
    };
    format!(
        "floor ({:?} sender, {} connections, {} B per write): delivered {} lost {}  p50 {:.1} µs  p99 {:.1} µs  \
         sender CPU {}% of a core, {} µs per delivered batch (bridge / floor = {ratio}), syscalls per delivered batch {}\n",
        r.sender,
        r.connections,
        r.message_bytes,
        r.delivered_batches,
        r.lost,
        r.latency.p50_us,
        r.latency.p99_us,
        r.sender_cpu_percent.map_or("-".into(), |v| format!("{v:.1}")),
        f(r.cpu_us_per_delivered_batch),
        f(r.syscalls_per_delivered_batch),
    ) + &r.h2.map_or(String::new(), |n| {
        format!(
            "  h2-writev: {} writev, {} partial, {} EAGAIN, {} window stalls, {} reads\n",
            n.writes, n.partial_writes, n.would_block, n.window_stalls, n.reads
        )
    })
}

/// The floor rows side by side (CPU µs per delivered batch and latency), with each row's and the
/// bridge's ratio to the blocking floor (the prototype's question: is `h2-writev / blocking ≤ 1.2`?).
pub fn summary(rows: &[FloorResult], bridge_us: Option<f64>) -> String {
    let us = |s: FloorSender| {
        rows.iter()
            .find(|r| r.sender == s)
            .and_then(|r| r.cpu_us_per_delivered_batch)
    };
    let base = us(FloorSender::Blocking).filter(|b| *b > 0.0);
    let ratio = |x: Option<f64>| match (x, base) {
        (Some(x), Some(b)) => format!("{:.2}", x / b),
        _ => "-".into(),
    };
    let mut out = format!(
        "floor side by side (µs per delivered batch; ratio to blocking):  bridge {} ({})",
        bridge_us.map_or("-".into(), |v| format!("{v:.2}")),
        ratio(bridge_us)
    );
    for r in rows {
        out += &format!(
            "  {} {} ({}; p50 {:.1} µs p99 {:.1} µs)",
            r.sender.name(),
            r.cpu_us_per_delivered_batch
                .map_or("-".into(), |v| format!("{v:.2}")),
            ratio(r.cpu_us_per_delivered_batch),
            r.latency.p50_us,
            r.latency.p99_us
        );
    }
    out + "\n"
}
