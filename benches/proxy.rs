//! Sidecar mode, side by side in one run: the same test engine (`tests/it/common/
//! grpc_engine.rs`, in this process) reached directly, through three floors and through
//! `kvbridge serve --engine-grpc` (the release binary, a child process).
//!
//! ```text
//! cargo bench --bench proxy              # about 25 s
//! PROXY_BENCH_TICKS=6000 PROXY_BENCH_MESSAGES=20000 cargo bench --bench proxy
//! ```
//!
//! Paths (one row each), every floor a process of its own as kvbridge is (this binary, re-run):
//! - **direct**: the client's channel to the engine;
//! - **blocking relay** ([`relay`]): an opaque byte relay, no HTTP/2, one blocking thread per
//!   direction. What it adds over direct is the second process hop on this machine (two more
//!   socket crossings and the wake-up of one more process);
//! - **event-loop relay** ([`event_loop_relay`]): the same relay on a one-thread tokio runtime,
//!   the floor for a sidecar that multiplexes many streams and connections on one thread;
//! - **minimal h2 forwarder** ([`h2_forwarder`]): the smallest HTTP/2-terminating forwarder on
//!   kvbridge's own stack (`h2`, one thread) and nothing else. A sidecar must terminate HTTP/2
//!   (it answers some paths itself and multiplexes the rest onto its own engine connections),
//!   so this is the floor for the stack: what kvbridge adds over it is kvbridge's own code;
//! - **kvbridge**.
//!
//! Columns:
//! - **latency per streamed message**: a `Ticks` stream (one 64-byte message per ms, stamped
//!   with the engine's send time); latency = receive time − send time, per message; p50 / p99
//!   and what each path adds over direct, taken in [`ROUNDS`] rounds on each path in turn;
//! - **CPU per paced message**: each process's on-CPU time (all threads) during its own paced
//!   streams, per message: the work it does per message, as opposed to the time it waits;
//! - **throughput at 64 concurrent streams**: 64 `Generate` streams of small (64-byte) messages
//!   read as fast as they come, also in rounds; messages/s and the ratio to direct;
//! - **CPU per forwarded message**: each process's CPU time over its throughput runs divided by
//!   the messages it forwarded.

#[path = "../tests/it/common/mod.rs"]
#[allow(unreachable_pub, missing_docs, dead_code)]
mod common;

use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use common::grpc_engine::{path, raw_client, unix_nanos, GrpcEngine, Raw};
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

/// `STREAMS` concurrent `Generate` streams of `per_stream` messages: the seconds they took and
/// the messages received.
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
        let url = url.to_string();
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
                .unwrap_or_else(|e| panic!("{url}: {e}"))
                .into_inner();
            let mut n = 0u64;
            while s
                .message()
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"))
                .is_some()
            {
                n += 1;
            }
            n
        });
    }
    let mut total = 0;
    while let Some(n) = tasks.join_next().await {
        total += n.unwrap();
    }
    (started.elapsed().as_secs_f64(), total)
}

/// Environment variable under which this binary runs as one of the floors ([`Floor`]) in front
/// of the engine at the given address, instead of the benchmark.
const RELAY_ENV: &str = "PROXY_BENCH_RELAY_TO";
/// Which floor, with [`RELAY_ENV`]: [`Floor::env`].
const FLOOR_ENV: &str = "PROXY_BENCH_FLOOR";

/// The programs kvbridge is measured against, each a child process of this binary as kvbridge
/// is a process of its own.
#[derive(Clone, Copy)]
enum Floor {
    /// [`relay`]: bytes, blocking threads.
    Blocking,
    /// [`event_loop_relay`]: bytes, one-thread tokio.
    EventLoop,
    /// [`h2_forwarder`]: the smallest HTTP/2 forwarder on kvbridge's stack.
    H2,
}

impl Floor {
    fn env(self) -> &'static str {
        match self {
            Floor::Blocking => "blocking",
            Floor::EventLoop => "event-loop",
            Floor::H2 => "h2",
        }
    }
}

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

/// A floor's child process in front of `target`, killed when dropped.
struct RelayProcess {
    child: std::process::Child,
    addr: String,
}

impl RelayProcess {
    fn start(target: &str, floor: Floor) -> RelayProcess {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .env(RELAY_ENV, target)
            .env(FLOOR_ENV, floor.env())
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
        return match std::env::var(FLOOR_ENV).as_deref() {
            Ok("event-loop") => event_loop_relay(&target),
            Ok("h2") => h2_forwarder(&target),
            _ => relay(&target),
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
        // kvbridge needs a ZMQ endpoint to subscribe to: an idle publisher socket. (The
        // simulated engine of the tests would add a thread of this process waking every
        // millisecond, in step with the paced streams.)
        let zmq_ctx = zmq::Context::new();
        let zmq = zmq_ctx.socket(zmq::PUB).unwrap();
        zmq.bind("tcp://127.0.0.1:*").unwrap();
        let zmq_endpoint = zmq.get_last_endpoint().unwrap().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let args: Vec<String> = [
            "--zmq",
            &zmq_endpoint,
            "--engine-grpc",
            &engine.addr.to_string(),
            "--load-interval-ms",
            "0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let bridge = common::Bridge::start(dir.path(), &dir.path().join("ring"), &args);
        let target = engine.addr.to_string();
        let floors = [
            RelayProcess::start(&target, Floor::Blocking),
            RelayProcess::start(&target, Floor::EventLoop),
            RelayProcess::start(&target, Floor::H2),
        ];
        // (name, url, process whose CPU is counted); kvbridge last.
        let mut paths: Vec<(&str, String, Option<u32>)> =
            vec![("direct", format!("http://{}", engine.addr), None)];
        for (name, f) in [
            ("blocking relay", &floors[0]),
            ("event-loop relay", &floors[1]),
            ("minimal h2 forwarder", &floors[2]),
        ] {
            paths.push((name, format!("http://{}", f.addr), Some(f.child.id())));
        }
        paths.push(("kvbridge", bridge.url(), Some(bridge.child.id())));
        let k = paths.len() - 1;
        let h2 = k - 1;
        let mut chans = Vec::new();
        for (_, u, _) in &paths {
            chans.push(channel(u).await);
        }
        // Warm-up: connections, pools, allocator.
        for ch in &chans {
            tick_latencies(ch, 200).await;
        }
        let mut lat = vec![Vec::new(); paths.len()];
        // CPU the floors and kvbridge spend while their own paced stream runs.
        let mut cpu = vec![0u64; paths.len()];
        let per_round = ticks.div_ceil(ROUNDS);
        for _ in 0..ROUNDS {
            for (i, ch) in chans.iter().enumerate() {
                let before = paths[i].2.map_or(0, cpu_ns);
                lat[i].extend(tick_latencies(ch, per_round).await);
                cpu[i] += paths[i].2.map_or(0, cpu_ns) - before;
            }
        }
        for l in &mut lat {
            l.sort_unstable();
        }
        let n = lat[0].len();
        // Throughput in rounds too, taken in turn on each path: messages and busy time summed.
        let mut sent = vec![(0u64, 0f64, 0u64); paths.len()];
        for _ in 0..ROUNDS {
            for (i, (_, url, pid)) in paths.iter().enumerate() {
                let before = pid.map_or(0, cpu_ns);
                let (secs, forwarded) = throughput(url, per_stream.div_ceil(ROUNDS)).await;
                sent[i].0 += forwarded;
                sent[i].1 += secs;
                sent[i].2 += pid.map_or(0, cpu_ns) - before;
            }
        }
        let rates: Vec<f64> = sent.iter().map(|s| s.0 as f64 / s.1).collect();
        let cpu_fwd: Vec<f64> = sent.iter().map(|s| s.2 as f64 / 1e3 / s.0 as f64).collect();

        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!("sidecar benchmark ({cores} cores; engine and client in this process, the floors and kvbridge child processes)");
        println!();
        println!("| path | p50 per streamed message ({n} msgs, 1/ms) | p99 | p50 added over direct | p99 added over direct | CPU per paced message (all threads) | throughput, {STREAMS} concurrent Generate streams × {per_stream} × 64 B | CPU per forwarded message (throughput run) |");
        println!("|---|---|---|---|---|---|---|---|");
        let (p50, p99): (Vec<f64>, Vec<f64>) =
            lat.iter().map(|l| (pct(l, 0.5), pct(l, 0.99))).unzip();
        for (i, (name, _, pid)) in paths.iter().enumerate() {
            let (added50, added99, paced, fwd) = match pid {
                None => ("—".into(), "—".into(), "—".into(), "—".into()),
                Some(_) => (
                    format!("{:+.1} µs", p50[i] - p50[0]),
                    format!("{:+.1} µs", p99[i] - p99[0]),
                    format!("{:.1} µs", cpu[i] as f64 / 1e3 / n as f64),
                    format!("{:.2} µs", cpu_fwd[i]),
                ),
            };
            println!(
                "| {name} | {:.1} µs | {:.1} µs | {added50} | {added99} | {paced} | {:.0} msg/s ({:.1} % of direct) | {fwd} |",
                p50[i],
                p99[i],
                rates[i],
                100.0 * rates[i] / rates[0]
            );
        }
        println!();
        for (i, what) in [(h2, "the minimal h2 forwarder"), (h2 - 1, "the event-loop relay")] {
            println!(
                "kvbridge − {what}: p50 {:+.1} µs, p99 {:+.1} µs, CPU per paced message {:+.1} µs",
                p50[k] - p50[i],
                p99[k] - p99[i],
                (cpu[k] as f64 - cpu[i] as f64) / 1e3 / n as f64
            );
        }
        drop(chans);
        drop(floors);
        drop(engine);
        drop(zmq);
        bridge
    });
    drop(rt);
    bridge.stop();
}

/// The floor for an HTTP/2 forwarder on kvbridge's stack: the smallest program that terminates
/// HTTP/2 on both sides as the sidecar must (it multiplexes the client's streams onto a
/// connection of its own to the engine, so it parses and writes frames), on the same `h2` crate
/// and a one-thread tokio runtime, and nothing else: an engine connection per client connection,
/// no pool, no path routing, no metrics, no frame joining, no flow-control backpressure (every
/// DATA frame is sent on at once), no header filtering. What kvbridge adds over it is kvbridge's own code; what it adds over
/// [`event_loop_relay`] is HTTP/2.
fn h2_forwarder(target: &str) {
    use std::io::Write;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let target = target.to_string();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap());
        std::io::stdout().flush().unwrap();
        let base = format!("http://{target}");
        loop {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            client.set_nodelay(true).unwrap();
            let (target, base) = (target.clone(), base.clone());
            tokio::spawn(async move {
                // One engine connection per client connection.
                let Ok(tcp) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                tcp.set_nodelay(true).unwrap();
                let Ok((up, conn)) = h2::client::Builder::new()
                    .initial_window_size(1 << 20)
                    .initial_connection_window_size((1 << 31) - 1)
                    .handshake::<_, Bytes>(tcp)
                    .await
                else {
                    return;
                };
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                let Ok(mut conn) = h2::server::Builder::new()
                    .initial_window_size(1 << 20)
                    .initial_connection_window_size(64 << 20)
                    .handshake::<_, Bytes>(client)
                    .await
                else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    let (up, base) = (up.clone(), base.clone());
                    tokio::spawn(async move {
                        let _ = h2_forward(req, respond, up, &base).await;
                    });
                }
            });
        }
    });
}

/// One call through [`h2_forwarder`]: request body up and response down, concurrently.
async fn h2_forward(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    up: h2::client::SendRequest<Bytes>,
    base: &str,
) -> Result<(), h2::Error> {
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = format!("{base}{path}").parse().unwrap();
    let mut up = up.ready().await?;
    let end = body.is_end_stream();
    let (resp, up_body) = up.send_request(http::Request::from_parts(parts, ()), end)?;
    let request = async move {
        if end {
            return Ok::<_, h2::Error>(());
        }
        pump(body, up_body).await
    };
    let response = async move {
        let (parts, body) = resp.await?.into_parts();
        let down = respond.send_response(http::Response::from_parts(parts, ()), false)?;
        pump(body, down).await
    };
    let (a, b) = tokio::join!(request, response);
    a.and(b)
}

/// Sends every DATA frame of `body` on `send` as it comes, then its trailers (or the end).
async fn pump(mut body: h2::RecvStream, mut send: h2::SendStream<Bytes>) -> Result<(), h2::Error> {
    while let Some(d) = body.data().await {
        let d = d?;
        let _ = body.flow_control().release_capacity(d.len());
        send.send_data(d, false)?;
    }
    match body.trailers().await? {
        Some(t) => send.send_trailers(t),
        None => send.send_data(Bytes::new(), true),
    }
}
