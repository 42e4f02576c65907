//! Cross-process one-way latency: a writer process appends 64-byte records
//! stamped with `ingest_ns`; a reader process (this binary re-executed with
//! `KVB_LAT_ROLE=reader`) measures `now - ingest_ns` into an HdrHistogram.
//! Two modes: a busy-polling reader (`next()` in a loop) and a futex-waiting
//! reader (`next_blocking`, spins ~20 µs then sleeps on the futex; the writer
//! paces records 200 µs apart so the reader really sleeps). The writer paces
//! by spinning (default: writer and reader each own one of the two cores) or,
//! with `KVB_LAT_PACE=sleep`, by sleeping (leaves a core free for others).
//!
//! cargo bench -p kvbridge-shm --bench latency

use hdrhistogram::Histogram;
use kvbridge_shm::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const FINAL: u32 = 1;
const WARMUP: u64 = 1000;

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn reader(path: &str, mode: &str) {
    let mut r = RingReader::open(path.as_ref()).unwrap();
    r.seek(r.newest() + 1).unwrap();
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    let mut n = 0u64;
    loop {
        let out = if mode == "busy" {
            r.next()
        } else {
            r.next_blocking(Duration::from_secs(5))
        };
        match out {
            ReadOutcome::Record(v) => {
                let lat = now_ns().saturating_sub(v.meta().ingest_ns);
                let fin = v.meta().flags & FINAL != 0;
                n += 1;
                if n > WARMUP {
                    h.record(lat.max(1)).unwrap();
                }
                if fin {
                    break;
                }
            }
            ReadOutcome::Empty => {}
            o => panic!("{o:?}"),
        }
    }
    println!(
        "LAT mode={mode} n={} p50={:.2}us p99={:.2}us p99.9={:.2}us max={:.2}us",
        h.len(),
        h.value_at_quantile(0.50) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.value_at_quantile(0.999) as f64 / 1000.0,
        h.max() as f64 / 1000.0
    );
}

fn run(mode: &str, records: u64, gap: Duration) {
    let d = tempfile::Builder::new()
        .prefix("kvbshm-lat")
        .tempdir_in("/dev/shm")
        .unwrap();
    let path = d.path().join("lat.ring");
    let opts = WriterOptions {
        capacity: 1 << 20,
        seq_base: Some(1),
        group_read: false,
    };
    let mut w = RingWriter::open(&path, &opts).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("KVB_LAT_ROLE", "reader")
        .env("KVB_LAT_MODE", mode)
        .env("KVB_LAT_PATH", &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "READY");
    std::thread::sleep(Duration::from_millis(50));
    let payload = [0x42u8; 64];
    let sleep_pace = std::env::var("KVB_LAT_PACE").as_deref() == Ok("sleep");
    let mut next = Instant::now();
    for i in 0..records {
        if sleep_pace {
            std::thread::sleep(gap);
        } else {
            while Instant::now() < next {
                std::hint::spin_loop();
            }
            next += gap;
        }
        let mut r = w.reserve(payload.len()).unwrap();
        r.buf().copy_from_slice(&payload);
        r.commit(RecordMeta {
            dp_rank: 0,
            upstream_seq: i,
            flags: if i + 1 == records { FINAL } else { 0 },
            ingest_ns: now_ns(),
            upstream_digest: 0,
        });
    }
    line.clear();
    out.read_line(&mut line).unwrap();
    println!("{}", line.trim());
    child.wait().unwrap();
}

fn main() {
    if let Ok(role) = std::env::var("KVB_LAT_ROLE") {
        assert_eq!(role, "reader");
        let mode = std::env::var("KVB_LAT_MODE").unwrap();
        let path = std::env::var("KVB_LAT_PATH").unwrap();
        reader(&path, &mode);
        return;
    }
    // `cargo test --benches` runs benches in test mode: keep that instant.
    if std::env::args().any(|a| a == "--test") {
        return;
    }
    run("busy", 50_000, Duration::from_micros(20));
    run("futex", 5_000, Duration::from_micros(200));
}
