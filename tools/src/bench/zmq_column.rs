//! The ZMQ-subscriber column of `kvbridge bench --zmq-subscribers N`: N SUBs on the bridge's
//! `--publish-zmq` PUB, and, in the same run, the floor: the same engine batches through a bare
//! relay process (`kvbridge bench-zmq-relay`: one SUB on the bench's engine PUB re-sending every
//! message unchanged on a PUB of its own, no decoding, no ring) to N more SUBs. Both paths have
//! the same two ZMQ hops (engine → bridge or relay → subscriber) and the same process shape;
//! what the bridge adds is decode, ring commit, ring read and the msgpack re-encoding. Latency
//! is measured from each batch's scheduled send time (its `ts`), as for the other columns; CPU
//! per record over the measured window, of each whole process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::proc_stats::process_cpu_seconds;
use super::{Delivery, Latency};

/// One path's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ZmqColumn {
    /// Latency over all its subscribers.
    pub latency: Latency,
    /// Totals over its subscribers.
    pub delivery: Delivery,
}

/// The column and its floor.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ZmqResult {
    /// Subscribers per path.
    pub subscribers: usize,
    /// Through the bridge's `--publish-zmq`.
    pub bridge: ZmqColumn,
    /// Through the bare relay.
    pub floor: ZmqColumn,
    /// CPU the whole bridge process used per published record (µs), over the measured window.
    pub bridge_cpu_us_per_record: Option<f64>,
    /// CPU the whole relay process used per message it relayed (µs), over the same window: the
    /// floor's cost per record.
    pub floor_cpu_us_per_record: Option<f64>,
}

/// The `ts` of a batch (`9x cb <f64 BE>`), in seconds.
fn ts_of(payload: &[u8]) -> Option<f64> {
    match payload {
        [0x92 | 0x93, 0xcb, rest @ ..] if rest.len() >= 8 => {
            Some(f64::from_be_bytes(rest[..8].try_into().expect("8 bytes")))
        }
        _ => None,
    }
}

struct SubOut {
    hist: Histogram<u64>,
    delivery: Delivery,
}

/// The floor's relay process (`kvbridge bench-zmq-relay`, the bench binary re-run, a process
/// of its own as the bridge is): a SUB on `connect` re-sending every message unchanged on a PUB
/// it binds on loopback. It prints that PUB's endpoint, then relays until its stdin closes, and
/// then prints `relayed N cpu S`: the messages it relayed and the CPU its whole process used
/// (its ZMQ I/O thread included) while the wall clock was inside `from_unix` + `window`.
pub fn run_relay(connect: &str, from_unix: f64, window: Duration) -> Result<(), String> {
    use std::io::Write;
    let e = |e: zmq::Error| e.to_string();
    let ctx = zmq::Context::new();
    let rsub = ctx.socket(zmq::SUB).map_err(e)?;
    rsub.set_subscribe(b"").map_err(e)?;
    rsub.set_rcvhwm(100_000).map_err(e)?;
    rsub.set_rcvtimeo(100).map_err(e)?;
    rsub.connect(connect).map_err(e)?;
    let rpub = ctx.socket(zmq::PUB).map_err(e)?;
    rpub.set_sndhwm(100_000).map_err(e)?;
    rpub.bind("tcp://127.0.0.1:*").map_err(e)?;
    let ep = rpub
        .get_last_endpoint()
        .map_err(e)?
        .map_err(|_| "relay endpoint".to_string())?;
    println!("{ep}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // The parent closes stdin when the column is done.
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        st.store(true, Ordering::SeqCst);
    });
    let until = from_unix + window.as_secs_f64();
    let (mut relayed, mut cpu0, mut cpu) = (0u64, None, None);
    while !stop.load(Ordering::Relaxed) {
        let now = kvbridge::clock::unix_seconds();
        let inside = now >= from_unix && now < until;
        match cpu0 {
            None if inside => cpu0 = Some(process_cpu_seconds()),
            Some(c) if now >= until && cpu.is_none() => cpu = Some(process_cpu_seconds() - c),
            _ => {}
        }
        let Ok(f) = rsub.recv_multipart(0) else {
            continue;
        };
        let _ = rpub.send_multipart(f, 0);
        if inside {
            relayed += 1;
        }
    }
    println!("relayed {relayed} cpu {}", cpu.unwrap_or(0.0));
    Ok(())
}

/// The running relay process.
struct Relay {
    child: std::process::Child,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Relay {
    /// Starts the relay on `engine_pub`, measuring over `from_unix` + `window`; returns it and
    /// the endpoint of its PUB.
    fn spawn(
        engine_pub: &str,
        from_unix: f64,
        window: Duration,
    ) -> Result<(Relay, String), String> {
        use std::io::BufRead;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = std::process::Command::new(exe)
            .args(["bench-zmq-relay", "--connect", engine_pub])
            .args(["--from-unix", &format!("{from_unix:.6}")])
            .args(["--window-ms", &window.as_millis().to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the floor's relay: {e}"))?;
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
        let mut ep = String::new();
        stdout
            .read_line(&mut ep)
            .map_err(|e| format!("the floor's relay: {e}"))?;
        if ep.trim().is_empty() {
            let _ = child.wait();
            return Err("the floor's relay exited before binding its PUB".into());
        }
        Ok((Relay { child, stdout }, ep.trim().to_string()))
    }

    /// Stops it; returns what it relayed in the window and the CPU it used meanwhile (s).
    fn finish(mut self) -> Option<(u64, f64)> {
        use std::io::BufRead;
        drop(self.child.stdin.take());
        let mut line = String::new();
        let _ = self.stdout.read_line(&mut line);
        let _ = self.child.wait();
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next(), w.next()) {
            (Some("relayed"), Some(n), Some("cpu"), Some(c)) => {
                Some((n.parse().ok()?, c.parse().ok()?))
            }
            _ => None,
        }
    }
}

/// The running subscribers and relay.
pub struct ZmqReaders {
    stop: Arc<AtomicBool>,
    bridge: Vec<std::thread::JoinHandle<SubOut>>,
    floor: Vec<std::thread::JoinHandle<SubOut>>,
    relay: Option<Relay>,
}

fn subscriber(
    ctx: &zmq::Context,
    endpoint: &str,
    measuring: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<SubOut>, String> {
    let s = ctx.socket(zmq::SUB).map_err(|e| e.to_string())?;
    s.set_subscribe(b"").map_err(|e| e.to_string())?;
    s.set_rcvhwm(100_000).map_err(|e| e.to_string())?;
    s.set_rcvtimeo(100).map_err(|e| e.to_string())?;
    s.connect(endpoint)
        .map_err(|e| format!("{endpoint}: {e}"))?;
    Ok(std::thread::spawn(move || {
        let mut out = SubOut {
            hist: Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("bounds"),
            delivery: Delivery::default(),
        };
        let mut last: Option<u64> = None;
        while !stop.load(Ordering::Relaxed) {
            let Ok(f) = s.recv_multipart(0) else { continue };
            let now = kvbridge::clock::unix_seconds();
            if f.len() != 3 || f[1].len() != 8 {
                continue;
            }
            let seq = u64::from_be_bytes(f[1][..].try_into().expect("8 bytes"));
            let m = measuring.load(Ordering::Relaxed);
            if let Some(l) = last {
                if m && seq > l + 1 {
                    out.delivery.lost += seq - l - 1;
                } else if m && seq <= l {
                    out.delivery.duplicates += 1;
                }
            }
            last = Some(seq);
            if !m {
                continue;
            }
            out.delivery.delivered += 1;
            if let Some(ts) = ts_of(&f[2]) {
                let _ = out.hist.record((((now - ts) * 1e9).max(1.0)) as u64);
            }
        }
        out
    }))
}

impl ZmqReaders {
    /// Starts `n` SUBs on `bridge_pub` and, with `floor` (the engine's PUB and the measured
    /// window: its start as Unix time, its length), the relay on it and `n` SUBs on the relay.
    pub fn start(
        ctx: &zmq::Context,
        n: usize,
        bridge_pub: &str,
        floor: Option<(&str, f64, Duration)>,
        measuring: Arc<AtomicBool>,
    ) -> Result<ZmqReaders, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let (relay, floor_ep) = match floor {
            Some((engine_pub, from_unix, window)) => {
                let (r, ep) = Relay::spawn(engine_pub, from_unix, window)?;
                (Some(r), Some(ep))
            }
            None => (None, None),
        };
        let mut bridge = Vec::new();
        let mut floor = Vec::new();
        for _ in 0..n {
            bridge.push(subscriber(
                ctx,
                bridge_pub,
                measuring.clone(),
                stop.clone(),
            )?);
            if let Some(floor_ep) = &floor_ep {
                floor.push(subscriber(ctx, floor_ep, measuring.clone(), stop.clone())?);
            }
        }
        Ok(ZmqReaders {
            stop,
            bridge,
            floor,
            relay,
        })
    }

    /// Stops everything (after the measured window) and merges the figures.
    pub fn finish(self) -> ZmqResult {
        std::thread::sleep(Duration::from_millis(200));
        self.stop.store(true, Ordering::SeqCst);
        let merge = |hs: Vec<std::thread::JoinHandle<SubOut>>| {
            let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("bounds");
            let mut d = Delivery::default();
            for t in hs {
                if let Ok(o) = t.join() {
                    let _ = h.add(&o.hist);
                    d.delivered += o.delivery.delivered;
                    d.lost += o.delivery.lost;
                    d.duplicates += o.delivery.duplicates;
                }
            }
            ZmqColumn {
                latency: Latency::from_ns(&h),
                delivery: d,
            }
        };
        let subscribers = self.bridge.len();
        let bridge = merge(self.bridge);
        let floor = merge(self.floor);
        let (relayed, cpu) = self.relay.and_then(Relay::finish).unwrap_or((0, 0.0));
        ZmqResult {
            subscribers,
            bridge,
            floor,
            bridge_cpu_us_per_record: None,
            floor_cpu_us_per_record: (relayed > 0 && cpu > 0.0).then(|| cpu * 1e6 / relayed as f64),
        }
    }
}

/// The column as table rows.
pub fn table(r: &ZmqResult) -> String {
    let mut s = format!(
        "zmq: {} SUBs on --publish-zmq, {} on a bare relay process of the same engine messages (the floor)\n",
        r.subscribers, r.subscribers
    );
    s += "path        delivered      lost  dup     p50 µs     p99 µs   p99.9 µs     max µs\n";
    for (name, c) in [("zmq", &r.bridge), ("zmq-floor", &r.floor)] {
        s += &format!(
            "{name:<10} {:>10} {:>9} {:>4} {:>10.1} {:>10.1} {:>10.1} {:>10.1}\n",
            c.delivery.delivered,
            c.delivery.lost,
            c.delivery.duplicates,
            c.latency.p50_us,
            c.latency.p99_us,
            c.latency.p999_us,
            c.latency.max_us
        );
    }
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "-".into(),
    };
    let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    s += &format!(
        "zmq vs floor: p50 {}, p99 {}; CPU per published record (whole processes, ZMQ I/O threads included): the bridge {} µs, the relay {} µs, {}\n",
        ratio(Some(r.bridge.latency.p50_us), Some(r.floor.latency.p50_us)),
        ratio(Some(r.bridge.latency.p99_us), Some(r.floor.latency.p99_us)),
        us(r.bridge_cpu_us_per_record),
        us(r.floor_cpu_us_per_record),
        ratio(r.bridge_cpu_us_per_record, r.floor_cpu_us_per_record),
    );
    s
}

/// One window of `kvbridge bench --zmq-subscribers N --zmq-alternate K`: the gRPC column with
/// `zmq_subscribers` SUBs reading `--publish-zmq` meanwhile (0 or N).
#[derive(Clone, Debug, Default, Serialize)]
pub struct AltWindow {
    /// ZMQ SUBs reading in this window.
    pub zmq_subscribers: usize,
    /// gRPC subscribers' latency in this window.
    pub grpc_latency: Latency,
    /// gRPC subscribers' totals in this window.
    pub grpc: Delivery,
    /// The ZMQ SUBs' totals (while they read: the window and its warm-up).
    pub zmq: Delivery,
    /// Bridge CPU as % of one core in this window.
    pub bridge_cpu_percent: Option<f64>,
}

/// The alternation's summary: the median over the windows with and without ZMQ subscribers of
/// the gRPC p50 and p99 (µs), `(without, with)`.
pub fn alternation_medians(ws: &[AltWindow]) -> ((f64, f64), (f64, f64)) {
    let median = |with: bool, f: fn(&Latency) -> f64| {
        let mut v: Vec<f64> = ws
            .iter()
            .filter(|w| (w.zmq_subscribers > 0) == with)
            .map(|w| f(&w.grpc_latency))
            .collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => 0.0,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    (
        (median(false, |l| l.p50_us), median(false, |l| l.p99_us)),
        (median(true, |l| l.p50_us), median(true, |l| l.p99_us)),
    )
}

/// The alternation as table rows and its summary line.
pub fn alternation_table(ws: &[AltWindow]) -> String {
    let mut s = String::from(
        "window  zmq SUBs  grpc delivered  lost     p50 µs     p99 µs   p99.9 µs  zmq delivered  lost  bridge CPU %\n",
    );
    for (i, w) in ws.iter().enumerate() {
        s += &format!(
            "{:<7} {:>9} {:>15} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>14} {:>5} {:>13}\n",
            i + 1,
            w.zmq_subscribers,
            w.grpc.delivered,
            w.grpc.lost,
            w.grpc_latency.p50_us,
            w.grpc_latency.p99_us,
            w.grpc_latency.p999_us,
            w.zmq.delivered,
            w.zmq.lost,
            w.bridge_cpu_percent
                .map_or("-".into(), |v| format!("{v:.1}")),
        );
    }
    let ((a50, a99), (b50, b99)) = alternation_medians(ws);
    let ratio = |b: f64, a: f64| {
        if a > 0.0 {
            format!("{:.2}×", b / a)
        } else {
            "-".into()
        }
    };
    s += &format!(
        "grpc with / without ZMQ subscribers (medians of the windows): p50 {b50:.1} / {a50:.1} µs = {}, p99 {b99:.1} / {a99:.1} µs = {}\n",
        ratio(b50, a50),
        ratio(b99, a99)
    );
    s
}
