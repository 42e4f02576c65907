//! The latency floor of a waiting ring reader: the smallest process of the required shape.
//!
//! ```text
//! floor_waiter RING RUN_S WARMUP_S COUNT_S [wait|spin]
//! ```
//!
//! It tails `RING` with the crate's own [`RingReader`], does nothing per record but take the
//! clock, and prints one JSON line with the commit → reader latency (`now − ingest_ns`, the
//! same number `python/bench/bench.py` reports for every reader) of the records that arrived
//! between `WARMUP_S` and `WARMUP_S + COUNT_S` after it started. `wait` (default) never spins:
//! it sleeps on the ring's futex for every record (`set_spin(0)`), so what it measures is the
//! bridge's ingest → commit time plus the machine's futex wake-up and scheduling latency under
//! whatever load runs beside it. Any waiting reader in any language pays at least that; what a
//! binding adds on top is the difference to this line in the same run. `spin` busy-polls
//! instead (no wake-up: ingest → commit plus cache transfer; it takes a whole core).
//!
//! Run beside the bench: `python/bench/bench.py --floor target/release/examples/floor_waiter`.

use hdrhistogram::Histogram;
use kvbridge_shm::{ReadOutcome, RingReader};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn secs(s: Option<String>, what: &str) -> Duration {
    let v: f64 = s.and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        panic!("usage: floor_waiter RING RUN_S WARMUP_S COUNT_S [wait|spin] (bad {what})")
    });
    Duration::from_secs_f64(v)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let ring = args
        .next()
        .expect("usage: floor_waiter RING RUN_S WARMUP_S COUNT_S [wait|spin]");
    let run = secs(args.next(), "RUN_S");
    let warmup = secs(args.next(), "WARMUP_S");
    let count = secs(args.next(), "COUNT_S");
    let spin = match args.next().as_deref() {
        None | Some("wait") => false,
        Some("spin") => true,
        Some(m) => panic!("mode must be wait or spin, not {m}"),
    };
    let mut r = RingReader::open(ring.as_ref()).expect("open ring");
    r.set_spin(Duration::ZERO);
    r.seek(r.newest() + 1).expect("seek to the tail");
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let (mut lost, mut last) = (0u64, None::<u64>);
    println!("ready");
    std::io::stdout().flush().expect("stdout");
    let start = Instant::now();
    while start.elapsed() < run {
        let out = if spin {
            r.next()
        } else {
            r.next_blocking(Duration::from_millis(100))
        };
        match out {
            ReadOutcome::Record(v) => {
                let lat = now_ns().saturating_sub(v.meta().ingest_ns);
                let t = start.elapsed();
                if t >= warmup && t < warmup + count {
                    h.record(lat.max(1)).expect("in range");
                    if let Some(l) = last {
                        lost += v.seq() - l - 1;
                    }
                }
                last = Some(v.seq());
            }
            ReadOutcome::Empty => {}
            ReadOutcome::Lapped { missed, .. } => lost += missed,
            o => panic!("unexpected {o:?}"),
        }
    }
    let us = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
    println!(
        "{{\"delivered\": {}, \"lost\": {lost}, \"ingest\": {{\"count\": {}, \"p50_us\": {:.3}, \"p99_us\": {:.3}, \"max_us\": {:.3}}}}}",
        h.len(),
        h.len(),
        us(0.5),
        us(0.99),
        h.max() as f64 / 1e3
    );
}
