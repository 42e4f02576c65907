//! Does a ZMQ snapshot replay stall ingest? A ring whose snapshot table holds 1,000,000 blocks
//! of 16 tokens (1,000 prompts of 1,000 blocks, as `benches/snapshot.rs`), published on the
//! engine ZMQ wire by the real edge (`publish_zmq::ZmqPublisher`, PUB and replay ROUTER on
//! loopback), one SUB reading the PUB, and ingest going on at a steady 2,000 batches a second of
//! the serving mix through the service's real ingest step (`RingHub::publish`), the ring on tmpfs as
//! `kvbridge serve` keeps it (`kvbridge_tools::bench::table_ring`).
//!
//! Windows alternate: in a "replay" window a DEALER asks the ROUTER for seq 0, so the edge
//! sends the whole block table (snapshot chunks, then the ring's tail) and the DEALER reads it
//! to the end marker while ingest goes on; the window lasts as long as that replay. The next
//! window publishes as many batches with no replay. Per window: the longest and p99.9
//! `RingHub::publish` (ingest); of the longest, how long the ingest thread ran on a CPU (its CPU
//! clock), the page faults it took, how long it was runnable but waiting for a CPU
//! (`/proc/thread-self/{schedstat,stat}`, read around each publish) and the steal
//! the hypervisor took from the machine's CPUs meanwhile (`/proc/stat`); how many
//! publishes slept (a voluntary context switch: blocked on a lock, a page read in) and the
//! longest of them; the latency from just before the publish to the SUB's
//! receipt of that batch (each batch's `ts` is its publish time) — commit → subscriber.
//!
//! `cargo bench --bench zmq_replay` (`-- --rounds N`, default 2; `-- --json FILE` also writes
//! the table as data for scripts/perf-tables.py).
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvbridge::decode::{DecodeConfig, Decoder};
use kvbridge::publish_zmq::{PublishZmqConfig, RankSource, TcpEndpoint, WireLayout, ZmqPublisher};
use kvbridge::ring::RingHub;
use kvbridge_tools::bench::proc_stats::thread_cpu_seconds;
use kvbridge_tools::bench::table_ring::{full_cache_ring, META};
use kvbridge_tools::sim::{encode_batch, Layout, Workload};

/// Ingest's pace: one batch every 500 µs.
const PERIOD: Duration = Duration::from_micros(500);

fn now() -> f64 {
    kvbridge::clock::unix_seconds()
}

/// One window's figures.
struct Window {
    replay: bool,
    publishes: usize,
    longest_us: f64,
    p999_us: f64,
    /// Of the longest publish: waiting for a CPU (µs); publishes that slept, and the longest
    /// of them (µs).
    longest_runnable_us: f64,
    longest_on_cpu_us: f64,
    longest_faults: u64,
    longest_steal_us: f64,
    slept: usize,
    longest_slept_us: f64,
    sub: Histogram<u64>,
    replay_s: f64,
    replay_msgs: u64,
    replay_mb: f64,
}

/// This thread's scheduler counters; zeros where the files are missing.
#[derive(Clone, Copy, Default)]
struct Sched {
    /// Time on a CPU (ns, the thread's CPU clock) and time runnable but waiting for one (ns,
    /// `/proc/thread-self/schedstat`).
    ran: u64,
    waited: u64,
    /// Voluntary context switches (`/proc/thread-self/status`: each is a sleep — a lock waited
    /// for, a page read in).
    slept: u64,
    /// Page faults, minor + major (`/proc/thread-self/stat`): fresh memory touched.
    faults: u64,
}

fn sched() -> Sched {
    let read =
        |f: &str| std::fs::read_to_string(format!("/proc/thread-self/{f}")).unwrap_or_default();
    let stat = read("schedstat");
    let field = |i: usize| -> u64 {
        stat.split_whitespace()
            .nth(i)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let slept = read("status")
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    // after the `(comm)` field: state is field 3, minflt 10, majflt 12
    let st = read("stat");
    let rest: Vec<&str> = st
        .rsplit_once(')')
        .map_or("", |(_, r)| r)
        .split_whitespace()
        .collect();
    let num = |i: usize| -> u64 { rest.get(i).and_then(|v| v.parse().ok()).unwrap_or(0) };
    Sched {
        ran: (thread_cpu_seconds() * 1e9) as u64,
        waited: field(1),
        slept,
        faults: num(7) + num(9),
    }
}

/// Time the hypervisor ran something else on this machine's CPUs (steal, summed over them,
/// µs: `/proc/stat`, in clock ticks, so 10,000 µs steps).
fn steal_us() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: f64 = stat
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(8))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    ticks * 1e6 / 100.0
}

/// One publish: its time, how much of it the thread was runnable but waiting for a CPU (µs),
/// and whether it slept (blocked: neither running nor runnable).
#[derive(Clone, Copy, Default)]
struct Publish {
    us: f64,
    on_cpu_us: f64,
    faults: u64,
    runnable_us: f64,
    slept: bool,
    steal_us: f64,
}

/// Publishes the serving mix (each batch stamped with the time of its publish) until `done` or,
/// without it, `n` times; returns the publishes.
fn ingest(
    dec: &mut Decoder,
    ps: &mut [Vec<u8>],
    hub: &RingHub,
    done: Option<&AtomicBool>,
    n: usize,
) -> Vec<Publish> {
    let mut times = Vec::new();
    let mut due = Instant::now();
    for i in 0.. {
        let stop = match done {
            Some(d) => d.load(Ordering::Acquire),
            None => times.len() >= n,
        };
        if stop {
            break;
        }
        due += PERIOD;
        let p = &mut ps[i % ps.len()];
        p[2..10].copy_from_slice(&now().to_be_bytes());
        let plan = dec.plan(p).expect("valid batch");
        let s0 = sched();
        let steal0 = steal_us();
        let t = Instant::now();
        hub.publish(&dec.planned(&plan, p), None, META)
            .expect("publish");
        let us = t.elapsed().as_secs_f64() * 1e6;
        let s1 = sched();
        let steal = steal_us() - steal0;
        times.push(Publish {
            steal_us: steal,
            us,
            // reading the files around the publish is outside `us`: clamp to it
            on_cpu_us: ((s1.ran - s0.ran) as f64 / 1e3).min(us),
            faults: s1.faults - s0.faults,
            runnable_us: ((s1.waited - s0.waited) as f64 / 1e3).min(us),
            slept: s1.slept > s0.slept,
        });
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
    }
    times
}

/// A consumer's replay from seq 0, read to the end marker: (messages, payload bytes).
fn replay_from_0(ctx: &zmq::Context, endpoint: &str) -> (u64, u64) {
    let d = ctx.socket(zmq::DEALER).expect("dealer");
    d.set_rcvtimeo(120_000).expect("timeout");
    d.connect(endpoint).expect("connect");
    d.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
        .expect("request");
    let (mut n, mut bytes) = (0, 0);
    loop {
        let f = d.recv_multipart(0).expect("a reply within 120 s");
        if f[2][..] == u64::MAX.to_be_bytes() {
            return (n, bytes);
        }
        n += 1;
        bytes += f[3].len() as u64;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let rounds: usize = arg("--rounds").map_or(2, |r| r.parse().expect("--rounds N"));
    let json = arg("--json");

    let ring = full_cache_ring(256 << 20);
    let (hub, table, metrics) = (&ring.hub, &ring.table, &ring.metrics);
    let mut dec = Decoder::new(DecodeConfig::default());
    let blocks = table.with_table(|t| t.len());
    let any = TcpEndpoint {
        host: "127.0.0.1".into(),
        port: 0,
    };
    let cfg = PublishZmqConfig {
        publish: any.clone(),
        replay: Some(any),
        snapshot: None,
        topic: None,
        layout: WireLayout::Map,
        hwm: kvbridge::publish_zmq::DEFAULT_PUB_HWM,
    };
    let edge = ZmqPublisher::start_on(
        &cfg,
        "kv",
        vec![RankSource {
            rank: 0,
            hub: hub.clone(),
            table: Some(table.clone()),
        }],
        metrics,
    )
    .expect("the edge binds");
    let b = edge.bound[0].clone();
    let (pub_ep, replay_ep) = (b.publish, b.replay);
    let replay_ep = replay_ep.expect("replay bound");

    // The SUB: latency from each batch's publish (its `ts`) into the current window's histogram.
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("sub");
    sub.set_subscribe(b"").expect("subscribe");
    sub.set_rcvhwm(1_000_000).expect("hwm");
    sub.set_rcvtimeo(100).expect("timeout");
    sub.connect(&pub_ep).expect("connect");
    let window = Arc::new(AtomicUsize::new(usize::MAX));
    let received = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let windows = 2 * rounds;
    let sub_thread = {
        let (window, received, stop) = (window.clone(), received.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut hs: Vec<Histogram<u64>> = (0..windows)
                .map(|_| Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("bounds"))
                .collect();
            while !stop.load(Ordering::Relaxed) {
                let Ok(f) = sub.recv_multipart(0) else {
                    continue;
                };
                let t = now();
                received.fetch_add(1, Ordering::Relaxed);
                let w = window.load(Ordering::Relaxed);
                let p = &f[2];
                if w < windows && p.len() >= 10 && p[1] == 0xcb {
                    let ts = f64::from_be_bytes(p[2..10].try_into().expect("8 bytes"));
                    let _ = hs[w].record((((t - ts) * 1e9).max(1.0)) as u64);
                }
            }
            hs
        })
    };
    let mut ps: Vec<Vec<u8>> = {
        let mut w = Workload::new(7);
        (0..2000)
            .map(|_| encode_batch(Layout::Vllm0102, 0.0, &w.next_batch(), 0))
            .collect()
    };
    assert!(ps.iter().all(|p| p.len() >= 10 && p[1] == 0xcb));
    // Until the SUB's subscription is in place (a PUB drops what it sends before that).
    let deadline = Instant::now() + Duration::from_secs(20);
    while received.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < deadline, "the SUB never received anything");
        ingest(&mut dec, &mut ps, hub, None, 10);
    }
    ingest(&mut dec, &mut ps, hub, None, 2000);

    let mut out: Vec<Window> = Vec::new();
    let mut last_n = 0;
    for w in 0..windows {
        let replay = w % 2 == 0;
        window.store(w, Ordering::SeqCst);
        let (times, replay_s, replay_msgs, replay_bytes) = if replay {
            let done = AtomicBool::new(false);
            std::thread::scope(|s| {
                let consumer = s.spawn(|| {
                    let t0 = Instant::now();
                    let r = replay_from_0(&ctx, &replay_ep);
                    done.store(true, Ordering::Release);
                    (t0.elapsed().as_secs_f64(), r)
                });
                let times = ingest(&mut dec, &mut ps, hub, Some(&done), 0);
                let (secs, (msgs, bytes)) = consumer.join().expect("replay thread");
                (times, secs, msgs, bytes)
            })
        } else {
            (ingest(&mut dec, &mut ps, hub, None, last_n), 0.0, 0, 0)
        };
        last_n = times.len();
        let longest = times
            .iter()
            .copied()
            .max_by(|a, b| a.us.total_cmp(&b.us))
            .unwrap_or_default();
        let slept: Vec<f64> = times.iter().filter(|p| p.slept).map(|p| p.us).collect();
        let mut sorted: Vec<f64> = times.iter().map(|p| p.us).collect();
        sorted.sort_by(f64::total_cmp);
        out.push(Window {
            replay,
            publishes: sorted.len(),
            longest_us: *sorted.last().unwrap_or(&0.0),
            p999_us: sorted
                .get((sorted.len() * 999 / 1000).min(sorted.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0),
            longest_runnable_us: longest.runnable_us,
            longest_on_cpu_us: longest.on_cpu_us,
            longest_faults: longest.faults,
            longest_steal_us: longest.steal_us,
            slept: slept.len(),
            longest_slept_us: slept.iter().copied().fold(0.0, f64::max),
            sub: Histogram::new(3).expect("placeholder"),
            replay_s,
            replay_msgs,
            replay_mb: replay_bytes as f64 / 1e6,
        });
    }
    // Let the last batches arrive, then stop the SUB.
    ingest(&mut dec, &mut ps, hub, None, 200);
    window.store(usize::MAX, Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    let hs = sub_thread.join().expect("SUB thread");
    for (w, h) in out.iter_mut().zip(hs) {
        w.sub = h;
    }
    edge.shutdown();

    println!(
        "zmq replay vs ingest: {blocks} blocks in the table; ingest at {} batches/s",
        1_000_000 / PERIOD.as_micros()
    );
    println!("window  replay   publishes  longest µs  (on CPU  faults  runnable  steal)  slept  (longest µs)  p99.9 µs   SUB p50 µs  p99 µs   max µs   replay s  msgs  MB");
    let q = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1e3;
    for (i, w) in out.iter().enumerate() {
        println!(
            "{:<7} {:<8} {:>9} {:>11.0} {:>8.0} {:>7} {:>9.0} {:>6.0} {:>6} {:>13.0} {:>9.0} {:>11.0} {:>7.0} {:>8.0} {:>10.2} {:>5} {:>5.0}",
            i + 1,
            if w.replay { "from 0" } else { "none" },
            w.publishes,
            w.longest_us,
            w.longest_on_cpu_us,
            w.longest_faults,
            w.longest_runnable_us,
            w.longest_steal_us,
            w.slept,
            w.longest_slept_us,
            w.p999_us,
            q(&w.sub, 0.5),
            q(&w.sub, 0.99),
            w.sub.max() as f64 / 1e3,
            w.replay_s,
            w.replay_msgs,
            w.replay_mb
        );
    }
    if let Some(path) = json {
        let rows: Vec<serde_json::Value> = out
            .iter()
            .enumerate()
            .map(|(i, w)| {
                serde_json::json!([
                    format!(
                        "{} {}",
                        i + 1,
                        if w.replay {
                            "replay from 0"
                        } else {
                            "no replay"
                        }
                    ),
                    w.publishes,
                    [w.longest_us, w.p999_us],
                    [
                        w.longest_on_cpu_us,
                        w.longest_faults as f64,
                        w.longest_runnable_us,
                        w.longest_steal_us
                    ],
                    [w.slept as f64, w.longest_slept_us],
                    [q(&w.sub, 0.5), q(&w.sub, 0.99), w.sub.max() as f64 / 1e3],
                    if w.replay {
                        serde_json::json!([w.replay_s, w.replay_msgs, w.replay_mb])
                    } else {
                        serde_json::Value::Null
                    },
                ])
            })
            .collect();
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let data = serde_json::json!({
            "title": "Ingest while a ZMQ replay streams a 1,000,000-block snapshot",
            "command": "cargo bench --bench zmq_replay -- --json FILE",
            "machine": format!(
                "{} CPUs, load average {} at the end",
                std::thread::available_parallelism().map_or(0, |n| n.get()),
                load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
            ),
            "when": std::env::var("PERF_WHEN").unwrap_or_default(),
            "columns": [
                {"name": "window"},
                {"name": "publishes", "format": "{:,}"},
                {"name": "ingest publish longest / p99.9 µs", "format": "{:,.0f} / {:,.0f}"},
                {"name": "of the longest: on a CPU µs / page faults / waiting for a CPU / machine's steal µs", "format": "{:,.0f} / {:,.0f} / {:,.0f} / {:,.0f}"},
                {"name": "publishes that slept / longest of them µs", "format": "{:,.0f} / {:,.0f}"},
                {"name": "publish → ZMQ SUB p50 / p99 / max µs", "format": "{:,.0f} / {:,.0f} / {:,.0f}"},
                {"name": "replay s / messages / MB", "format": "{:.2f} / {:,} / {:,.0f}"},
            ],
            "rows": rows,
        });
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&data).expect("json") + "\n",
        )
        .expect("--json FILE");
    }
}
