//! Shared-memory reader processes for the bench (`kvbridge bench-reader`), so that ring
//! latency is measured across processes, as a co-located router would see it.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use kvbridge_shm::{ReadOutcome, RingReader};
use serde::{Deserialize, Serialize};

use super::{wire, Delivery};

/// What a reader process prints (one JSON line).
#[derive(Serialize, Deserialize)]
struct Report {
    delivered: u64,
    lost: u64,
    duplicates: u64,
    errors: u64,
    /// V2-serialized histogram (end to end), hex.
    hist_hex: String,
    /// V2-serialized histogram (ingest → reader: the ring alone), hex.
    ring_hex: String,
}

/// A reader process's result.
pub struct ReaderOut {
    /// Latency in ns from the scheduled send time.
    pub hist: Histogram<u64>,
    /// Latency in ns from the record's ingest (commit) time: the ring alone.
    pub ring: Histogram<u64>,
    /// Counts.
    pub delivery: Delivery,
}

/// Starts `kvbridge bench-reader` on `shm`.
pub fn spawn_process(
    shm: &Path,
    run_for: Duration,
    spin: bool,
    warmup: Duration,
    count_for: Duration,
) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = Command::new(exe);
    c.arg("bench-reader")
        .arg("--shm")
        .arg(shm)
        .arg("--run-ms")
        .arg(run_for.as_millis().to_string())
        .arg("--warmup-ms")
        .arg(warmup.as_millis().to_string())
        .arg("--count-ms")
        .arg(count_for.as_millis().to_string());
    if spin {
        c.arg("--spin");
    }
    c.stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start a reader process: {e}"))
}

/// Waits for a reader process and parses its report.
pub fn collect(mut child: Child) -> Result<ReaderOut, String> {
    let mut s = String::new();
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut s)
        .map_err(|e| e.to_string())?;
    let st = child.wait().map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("shm reader process failed: {st}"));
    }
    let r: Report =
        serde_json::from_str(s.trim()).map_err(|e| format!("bad reader report: {e}"))?;
    let hist = from_hex(&r.hist_hex)?;
    let ring = from_hex(&r.ring_hex)?;
    Ok(ReaderOut {
        hist,
        ring,
        delivery: Delivery {
            delivered: r.delivered,
            lost: r.lost,
            duplicates: r.duplicates,
            errors: r.errors,
        },
    })
}

fn from_hex(h: &str) -> Result<Histogram<u64>, String> {
    let bytes = (0..h.len() / 2)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|e| e.to_string())?;
    Deserializer::new()
        .deserialize(&mut bytes.as_slice())
        .map_err(|e| format!("{e:?}"))
}

fn to_hex(h: &Histogram<u64>) -> Result<String, String> {
    let mut buf = Vec::new();
    V2Serializer::new()
        .serialize(h, &mut buf)
        .map_err(|e| format!("{e:?}"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The body of `kvbridge bench-reader`: reads live records for `run_for`, counting from
/// `warmup` for `count_for` (the bench's measured window), and prints the report.
pub fn run_reader(
    shm: &Path,
    run_for: Duration,
    warmup: Duration,
    count_for: Duration,
    spin: bool,
) -> Result<(), String> {
    let mut reader = RingReader::open(shm).map_err(|e| format!("--shm {}: {e}", shm.display()))?;
    reader
        .seek(reader.newest() + 1)
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("bounds");
    let mut ring = hist.clone();
    let mut d = Delivery::default();
    let mut last: Option<u64> = None;
    let mut payload = Vec::new();
    while start.elapsed() < run_for {
        let t = start.elapsed();
        let counting = t >= warmup && t < warmup + count_for;
        let outcome = if spin {
            reader.next()
        } else {
            reader.next_blocking(Duration::from_millis(50))
        };
        match outcome {
            ReadOutcome::Record(v) => {
                let seq = v.seq();
                let ingest_ns = v.meta().ingest_ns;
                // A validated copy: `false` if the writer lapped this record meanwhile.
                let intact = v.copy_to(&mut payload);
                let head = wire::seq_and_ts(&payload);
                let now_ns = kvbridge::clock::unix_nanos();
                let now = now_ns as f64 / 1e9;
                if !intact {
                    continue;
                }
                if let Some(l) = last {
                    if seq <= l {
                        d.duplicates += counting as u64;
                        continue;
                    }
                    if seq > l + 1 && counting {
                        d.lost += seq - l - 1;
                    }
                }
                last = Some(seq);
                if counting {
                    d.delivered += 1;
                    let _ = ring.record(now_ns.saturating_sub(ingest_ns).max(1));
                    if let Some((_, ts)) = head {
                        let _ = hist.record((((now - ts) * 1e9).max(1.0)) as u64);
                    }
                }
            }
            ReadOutcome::Lapped { missed, .. } => {
                if counting {
                    d.lost += missed;
                }
                last = None;
            }
            ReadOutcome::Corrupt { .. } => {
                // Not served: a record lost to damage, counted like a lap's loss.
                if counting {
                    d.lost += 1;
                }
                last = None;
            }
            ReadOutcome::Empty => {
                if spin {
                    std::hint::spin_loop();
                }
            }
            ReadOutcome::WriterGone | ReadOutcome::RingReset { .. } | ReadOutcome::Truncated => {
                d.errors += 1;
                break;
            }
        }
    }
    let hist_hex = to_hex(&hist)?;
    let ring_hex = to_hex(&ring)?;
    let r = Report {
        delivered: d.delivered,
        lost: d.lost,
        duplicates: d.duplicates,
        errors: d.errors,
        hist_hex,
        ring_hex,
    };
    println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
    Ok(())
}
