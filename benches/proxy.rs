//! Sidecar mode (issue 9), side by side in one run: the same test engine (`tests/common/
//! grpc_engine.rs`, in this process) reached directly, through two trivial relays (the floor) and
//! through `kvbridge serve --engine-grpc` (the release binary, a child process).
//!
//! ```text
//! cargo bench --bench proxy              # about 20 s
//! PROXY_BENCH_TICKS=6000 PROXY_BENCH_MESSAGES=20000 cargo bench --bench proxy
//! ```
//!
//! Paths (columns):
//! - **direct**: the client's channel to the engine;
//! - **blocking relay**, the floor: a trivial opaque relay between the same client and engine,
//!   in a process of its own as kvbridge is (this binary, re-run as [`relay`]), copying bytes
//!   both ways with no HTTP/2 parsing, one blocking thread per direction. What it adds over
//!   direct is the cost of a second process hop on this machine (two more socket crossings and
//!   the wake-up of one more process);
//! - **event-loop relay**: the same relay on a one-thread tokio runtime ([`event_loop_relay`]),
//!   the floor for a sidecar that multiplexes many streams and connections on a few threads, as
//!   an HTTP/2 proxy with an engine connection pool must;
//! - **through kvbridge**.
//!
//! Rows:
//! - **latency per streamed message**: a `Ticks` stream (one 64-byte message per ms, stamped
//!   with the engine's send time); latency = receive time − send time, per message; p50 / p99
//!   on each path, and what each adds over direct (kvbridge's also over the event-loop relay);
//! - **CPU per paced message**: the relays' and kvbridge's on-CPU time (all threads) during
//!   their own paced streams, per message: the work each does per message, as opposed to the
//!   time it waits to be scheduled;
//! - **throughput at 64 concurrent streams**: 64 `Generate` streams of small (64-byte) messages
//!   read as fast as they come; messages/s on each path, and the ratio to direct;
//! - **sidecar CPU per forwarded message**: kvbridge's user + system CPU time over the
//!   throughput run divided by the messages it forwarded.

#[path = "../tests/common/mod.rs"]
#[allow(unreachable_pub, missing_docs)]
mod common;
#[path = "../tests/common/grpc_engine.rs"]
#[allow(unreachable_pub, missing_docs)]
mod grpc_engine;

use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use grpc_engine::{path, raw_client, unix_nanos, GrpcEngine, Raw};
use tonic::transport::Channel;
use tonic::Request;

const VLLM: &str = "vllm.grpc.engine.VllmEngine";
const STREAMS: usize = 64;

fn env_u32(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn request(a: u32, b: u32) -> Bytes {
    let mut r = BytesMut::new();
    r.put_u32_le(a);
    r.put_u32_le(b);
    r.freeze()
}

async fn channel(url: &str) -> Channel {
    // Windows as a G2 gateway's channel (docs/smg-api.md §3.1: 512 MiB per connection), which
    // also keeps h2's small-DATA-frame budget (half the connection window) out of the way.
    Channel::from_shared(url.to_string())
        .unwrap()
        .initial_connection_window_size(512 << 20)
        .initial_stream_window_size(256 << 10)
        .connect()
        .await
        .unwrap()
}

/// Per-message latencies (ns) of one paced `Ticks` stream of `count` messages.
async fn tick_latencies(ch: &Channel, count: u32) -> Vec<u64> {
    let mut c = raw_client(ch.clone());
    c.ready().await.unwrap();
    let mut s = c
        .server_streaming(Request::new(request(count, 1000)), path(VLLM, "Ticks"), Raw)
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::with_capacity(count as usize);
    while let Some(m) = s.message().await.unwrap() {
        let now = unix_nanos();
        let sent = u64::from_le_bytes(m[..8].try_into().unwrap());
        out.push(now.saturating_sub(sent));
    }
    out
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// Messages per second over `STREAMS` concurrent `Generate` streams of `per_stream` messages.
async fn throughput(url: &str, per_stream: u32) -> (f64, u64) {
    // A few connections, as a gateway multiplexes many streams over its channel.
    let mut chans = Vec::new();
    for _ in 0..4 {
        chans.push(channel(url).await);
    }
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..STREAMS {
        let ch = chans[i % chans.len()].clone();
        tasks.spawn(async move {
            let mut c = raw_client(ch);
            c.ready().await.unwrap();
            let mut s = c
                .server_streaming(
                    Request::new(request(per_stream, 64)),
                    path(VLLM, "Generate"),
                    Raw,
                )
                .await
                .unwrap()
                .into_inner();
            let mut n = 0u64;
            while s.message().await.unwrap().is_some() {
                n += 1;
            }
            n
        });
    }
    let mut total = 0;
    while let Some(n) = tasks.join_next().await {
        total += n.unwrap();
    }
    (total as f64 / started.elapsed().as_secs_f64(), total)
}

/// Environment variable under which this binary runs as [`relay`] (or [`event_loop_relay`])
/// instead of the benchmark.
const RELAY_ENV: &str = "PROXY_BENCH_RELAY_TO";
/// Set (to anything) with [`RELAY_ENV`]: the relay is [`event_loop_relay`].
const EVENT_LOOP_ENV: &str = "PROXY_BENCH_RELAY_EVENT_LOOP";

/// The floor for a sidecar built on an event loop, as kvbridge is: the same opaque relay on a
/// one-thread tokio runtime (`epoll`), `copy_bidirectional` per connection. What it adds over
/// [`relay`] is the event loop's price (an `epoll_wait` per wake-up); what kvbridge adds over it
/// is HTTP/2.
fn event_loop_relay(target: &str) {
    use std::io::Write;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap());
        std::io::stdout().flush().unwrap();
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                continue;
            };
            let Ok(mut engine) = tokio::net::TcpStream::connect(target).await else {
                continue;
            };
            client.set_nodelay(true).unwrap();
            engine.set_nodelay(true).unwrap();
            tokio::spawn(async move {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut engine).await;
            });
        }
    });
}

/// The floor: a trivial opaque TCP relay to the address in [`RELAY_ENV`]. It listens on an
/// ephemeral loopback port, prints it on stdout, and for each connection copies bytes
/// client → engine and engine → client, each direction on a blocking thread of its own (a
/// `read` wakes the thread that `write`s: no event loop, no HTTP/2, no buffering beyond one
/// read), with `TCP_NODELAY` on both sockets, as kvbridge sets.
fn relay(target: &str) {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("{}", listener.local_addr().unwrap());
    std::io::stdout().flush().unwrap();
    fn pump(mut from: TcpStream, mut to: TcpStream) {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    }
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let Ok(engine) = TcpStream::connect(target) else {
            continue;
        };
        client.set_nodelay(true).unwrap();
        engine.set_nodelay(true).unwrap();
        let (c2, e2) = (client.try_clone().unwrap(), engine.try_clone().unwrap());
        std::thread::spawn(move || pump(client, engine));
        std::thread::spawn(move || pump(e2, c2));
    }
}

/// A [`relay`] child process in front of `target`, killed when dropped.
struct RelayProcess {
    child: std::process::Child,
    addr: String,
}

impl RelayProcess {
    fn start(target: &str, event_loop: bool) -> RelayProcess {
        use std::io::BufRead;
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        if event_loop {
            cmd.env(EVENT_LOOP_ENV, "1");
        }
        let mut child = cmd
            .env(RELAY_ENV, target)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        RelayProcess {
            child,
            addr: line.trim().to_string(),
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time (ns, on-CPU time of all its threads, from `/proc/PID/task/*/schedstat`) process
/// `pid` has used so far: finer than `/proc/PID/stat`'s clock ticks, which a paced stream of a
/// few thousand messages barely moves.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Rounds the paced latency streams are split into, taken in turn on each path (direct, the
/// relays, kvbridge), so that a change in the machine's background load during the run falls on
/// all of them alike.
const ROUNDS: u32 = 3;

fn main() {
    if let Ok(target) = std::env::var(RELAY_ENV) {
        return if std::env::var_os(EVENT_LOOP_ENV).is_some() {
            event_loop_relay(&target)
        } else {
            relay(&target)
        };
    }
    // `cargo bench` passes `--bench`; nothing else is taken.
    let ticks = env_u32("PROXY_BENCH_TICKS", 3000);
    let per_stream = env_u32("PROXY_BENCH_MESSAGES", 10_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let bridge = rt.block_on(async move {
        let engine = GrpcEngine::start("127.0.0.1:0".parse().unwrap()).await;
        let zmq = common::Engine::start(0);
        let dir = tempfile::tempdir().unwrap();
        let args: Vec<String> = [
            "--zmq",
            &zmq.endpoint,
            "--engine-grpc",
            &engine.addr.to_string(),
            "--load-interval-ms",
            "0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let bridge = common::Bridge::start(dir.path(), &dir.path().join("ring"), &args);
        let relay = RelayProcess::start(&engine.addr.to_string(), false);
        let evloop = RelayProcess::start(&engine.addr.to_string(), true);
        let urls = [
            format!("http://{}", engine.addr),
            format!("http://{}", relay.addr),
            format!("http://{}", evloop.addr),
            bridge.url(),
        ];
        let mut chans = Vec::new();
        for u in &urls {
            chans.push(channel(u).await);
        }
        // Warm-up: connections, pools, allocator.
        for ch in &chans {
            tick_latencies(ch, 200).await;
        }
        let mut lat = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        // CPU the relays and kvbridge spend while their own paced stream runs.
        let pids = [
            None,
            Some(relay.child.id()),
            Some(evloop.child.id()),
            Some(bridge.child.id()),
        ];
        let mut cpu = [0u64; 4];
        let per_round = ticks.div_ceil(ROUNDS);
        for _ in 0..ROUNDS {
            for (i, ch) in chans.iter().enumerate() {
                let before = pids[i].map_or(0, cpu_ns);
                lat[i].extend(tick_latencies(ch, per_round).await);
                cpu[i] += pids[i].map_or(0, cpu_ns) - before;
            }
        }
        for l in &mut lat {
            l.sort_unstable();
        }
        let n = lat[0].len();
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!("sidecar benchmark ({cores} cores; engine and client in this process, kvbridge and the relays child processes)");
        println!();
        println!("| row | direct | blocking relay (floor) | event-loop relay | through kvbridge | blocking relay − direct | event-loop relay − direct | kvbridge − direct | kvbridge − event-loop relay |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for (name, p) in [("p50", 0.5), ("p99", 0.99)] {
            let v: Vec<f64> = lat.iter().map(|l| pct(l, p)).collect();
            println!(
                "| latency per streamed message, {name} ({n} msgs, 1/ms) | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:+.1} µs | {:+.1} µs | {:+.1} µs | {:+.1} µs |",
                v[0], v[1], v[2], v[3],
                v[1] - v[0],
                v[2] - v[0],
                v[3] - v[0],
                v[3] - v[2]
            );
        }
        let per_msg = |c: u64| c as f64 / 1e3 / n as f64;
        println!(
            "| CPU per paced message (all threads) | — | {:.1} µs | {:.1} µs | {:.1} µs | | | | {:+.1} µs |",
            per_msg(cpu[1]),
            per_msg(cpu[2]),
            per_msg(cpu[3]),
            per_msg(cpu[3]) - per_msg(cpu[2])
        );

        let mut rates = Vec::new();
        let mut sidecar = (0, std::time::Duration::ZERO);
        for (i, url) in urls.iter().enumerate() {
            let cpu0 = bridge.cpu_time();
            let (rate, forwarded) = throughput(url, per_stream).await;
            if i == 3 {
                sidecar = (forwarded, bridge.cpu_time() - cpu0);
            }
            rates.push(rate);
        }
        let pct_of = |r: f64| 100.0 * r / rates[0];
        println!(
            "| throughput, {STREAMS} concurrent Generate streams × {per_stream} × 64 B | {:.0} msg/s | {:.0} msg/s ({:.1} %) | {:.0} msg/s ({:.1} %) | {:.0} msg/s | | | {:.1} % of direct | |",
            rates[0],
            rates[1],
            pct_of(rates[1]),
            rates[2],
            pct_of(rates[2]),
            rates[3],
            pct_of(rates[3])
        );
        let (forwarded, cpu) = sidecar;
        println!(
            "| sidecar CPU per forwarded message | — | — | — | {:.2} µs | | | ({:.2} s CPU for {forwarded} messages) | |",
            cpu.as_secs_f64() * 1e6 / forwarded as f64,
            cpu.as_secs_f64()
        );
        drop(chans);
        drop(relay);
        drop(evloop);
        drop(engine);
        drop(zmq);
        bridge
    });
    drop(rt);
    bridge.stop();
}
