//! `kvbridge bench --nats`: the NATS sink's figures, from the bridge's own metrics read at the
//! start and at the end of the measured window (so warm-up is excluded).
//!
//! Publish lag is the sink's `kvbridge_nats_publish_lag_seconds` histogram: a record's commit in
//! the ring to JetStream's acknowledgement of it. Its buckets grow by 25 %, so a percentile is
//! interpolated within one bucket (at most 25 % off).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

/// The bench's stream for `replicas` (one per replica count: streams may not share subjects,
/// and an existing stream with other replicas would be a mismatch).
pub fn bench_stream(replicas: usize) -> String {
    format!("KVBENCH_R{replicas}")
}

/// The bench's subject prefix for `replicas` (see [`bench_stream`]).
pub fn bench_prefix(replicas: usize) -> String {
    format!("kvbench_r{replicas}")
}

/// Samples of the sink's metrics: published count and the lag histogram's cumulative buckets.
#[derive(Clone, Debug, Default)]
pub struct SinkSample {
    published: f64,
    /// Upper bound (seconds) → cumulative count, summed over subjects.
    buckets: BTreeMap<u64, f64>,
}

/// GET /metrics and keep the sink's series.
pub fn scrape(addr: SocketAddr) -> Result<SinkSample, String> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("metrics {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut page = String::new();
    s.read_to_string(&mut page).map_err(|e| e.to_string())?;
    let mut out = SinkSample::default();
    for l in page.lines().filter(|l| !l.starts_with('#')) {
        let Some((lhs, v)) = l.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = v.parse::<f64>() else { continue };
        if lhs.starts_with("kvbridge_nats_published_total") {
            out.published += v;
        } else if lhs.starts_with("kvbridge_nats_publish_lag_seconds_bucket") {
            let le = lhs
                .split("le=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("+Inf");
            let bound = le.parse::<f64>().unwrap_or(f64::INFINITY);
            // Keyed by nanoseconds so that the map orders the bounds.
            let key = if bound.is_finite() {
                (bound * 1e9) as u64
            } else {
                u64::MAX
            };
            *out.buckets.entry(key).or_default() += v;
        }
    }
    Ok(out)
}

/// The sink over the measured window.
#[derive(Clone, Debug, Default)]
pub struct SinkFigures {
    /// Records JetStream acknowledged per second.
    pub published_per_s: f64,
    /// Publish lag percentiles (ms): p50, p99.
    pub lag_ms: (f64, f64),
    /// Bridge CPU per published batch (µs), the whole bridge's CPU divided by the sink's count.
    pub cpu_us_per_batch: Option<f64>,
}

impl SinkFigures {
    /// Figures between two samples `seconds` apart; `cpu_s` is the bridge's CPU time meanwhile.
    pub fn between(a: &SinkSample, b: &SinkSample, seconds: f64, cpu_s: Option<f64>) -> Self {
        let n = b.published - a.published;
        let diff: Vec<(u64, f64)> = b
            .buckets
            .iter()
            .map(|(k, v)| (*k, v - a.buckets.get(k).copied().unwrap_or(0.0)))
            .collect();
        let pct = |q: f64| -> f64 {
            let total = diff.last().map_or(0.0, |d| d.1);
            if total <= 0.0 {
                return f64::NAN;
            }
            let want = q * total;
            let mut prev = (0u64, 0.0);
            for &(k, c) in &diff {
                if c >= want {
                    if k == u64::MAX {
                        return prev.0 as f64 / 1e6;
                    }
                    let frac = if c > prev.1 {
                        (want - prev.1) / (c - prev.1)
                    } else {
                        1.0
                    };
                    return (prev.0 as f64 + frac * (k - prev.0) as f64) / 1e6;
                }
                prev = (k, c);
            }
            f64::NAN
        };
        SinkFigures {
            published_per_s: n / seconds.max(1e-9),
            lag_ms: (pct(0.5), pct(0.99)),
            cpu_us_per_batch: cpu_s.filter(|_| n > 0.0).map(|c| c * 1e6 / n),
        }
    }

    /// Rows printed after the bench table.
    pub fn table(&self, replicas: usize) -> String {
        format!(
            "nats sink ({replicas} replicas)   published/s {:.0}   publish lag p50 {:.2} ms  p99 {:.2} ms   bridge CPU/batch {}\n",
            self.published_per_s,
            self.lag_ms.0,
            self.lag_ms.1,
            self.cpu_us_per_batch
                .map_or("-".to_string(), |c| format!("{c:.1} µs")),
        )
    }
}

/// `kvbridge bench --nats-floor`: the floor under the sink's publish lag. A bare async-nats
/// JetStream publisher, no kvbridge in the path: the same `KvEventBatch` payloads (the bench mix
/// run through the decoder), the same headers (`Kvbridge-Seq`, `Kvbridge-Ring-Id`,
/// `Kvbridge-Dp-Rank`, `Nats-Msg-Id`), the same bound on acknowledgements in flight
/// ([`kvbridge::sink::MAX_IN_FLIGHT`], awaited in order), into the same stream, paced by the clock
/// at the bench rate. Its lag is measured from each message's scheduled time (the analogue of a
/// record's commit in the ring) to JetStream's acknowledgement, so whatever it shows is what the
/// NATS cluster on this machine costs any publisher of this shape.
pub mod floor {
    use std::collections::VecDeque;
    use std::future::IntoFuture;
    use std::time::{Duration, Instant};

    use async_nats::header::{HeaderMap, HeaderName};
    use async_nats::jetstream;

    use crate::bench::Mix;
    use crate::sim::{encode_batch, Layout, Workload};
    use kvbridge::decode::{DecodeConfig, Decoder};
    use kvbridge::ring::RecordHeader;
    use kvbridge::sink::NatsConfig;
    use kvbridge::sink::{HEADER_DP_RANK, HEADER_RING_ID, HEADER_SEQ, MAX_IN_FLIGHT};

    /// What the floor publisher does.
    #[derive(Clone, Debug)]
    pub struct FloorConfig {
        /// NATS URLs.
        pub urls: Vec<String>,
        /// Messages per second.
        pub rate: u64,
        /// Warm-up (not measured).
        pub warmup: Duration,
        /// Measured window.
        pub duration: Duration,
        /// Stream replicas.
        pub replicas: usize,
        /// Batch mix of the payloads.
        pub mix: Mix,
    }

    /// The floor over the measured window.
    #[derive(Clone, Debug, Default)]
    pub struct FloorFigures {
        /// Acknowledged per second.
        pub published_per_s: f64,
        /// Publish lag (scheduled → acknowledged), ms: p50, p99.
        pub lag_ms: (f64, f64),
        /// The publisher process's CPU per acknowledged message (µs).
        pub cpu_us_per_batch: Option<f64>,
        /// Mean payload bytes.
        pub payload_bytes: f64,
        /// Failed or unacknowledged publications.
        pub failures: u64,
    }

    impl FloorFigures {
        /// The row printed after the bench table.
        pub fn table(&self, replicas: usize) -> String {
            format!(
                "nats floor ({replicas} replicas, bare async-nats, ≤ {MAX_IN_FLIGHT} in flight)   published/s {:.0}   publish lag p50 {:.2} ms  p99 {:.2} ms   publisher CPU/batch {}   payload {:.0} B   failures {}\n",
                self.published_per_s,
                self.lag_ms.0,
                self.lag_ms.1,
                self.cpu_us_per_batch
                    .map_or("-".to_string(), |c| format!("{c:.1} µs")),
                self.payload_bytes,
                self.failures,
            )
        }
    }

    /// 256 `KvEventBatch` records as the bridge would put them in its ring for this mix.
    fn payloads(mix: Mix) -> Vec<bytes::Bytes> {
        let mut w = Workload::new(42);
        let mut seed = 0u64;
        let mut dec = Decoder::new(DecodeConfig::default());
        let mut out = Vec::new();
        let mut i = 0usize;
        while out.len() < 256 {
            let engine = encode_batch(
                Layout::ALL[i % Layout::ALL.len()],
                1.0,
                &super::super::mix_batch(mix, &mut w, &mut seed),
                0,
            );
            i += 1;
            let Ok(plan) = dec.plan(&engine) else {
                continue;
            };
            for r in 0..plan.records {
                let hdr = RecordHeader {
                    sequence_number: 1_000_000 + out.len() as u64,
                    first_event_id: 1_000_000,
                    dp_rank: None,
                };
                let mut buf = vec![0u8; dec.record_len(r, &hdr)];
                let n = dec.write_record(&engine, r, &hdr, &mut buf);
                buf.truncate(n);
                out.push(bytes::Bytes::from(buf));
            }
        }
        out
    }

    fn pct(sorted: &[u64], q: f64) -> f64 {
        if sorted.is_empty() {
            return f64::NAN;
        }
        let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
        sorted[i] as f64 / 1e6
    }

    /// Runs the floor publisher (inside a Tokio runtime) and returns its figures.
    pub async fn run(cfg: FloorConfig) -> Result<FloorFigures, String> {
        let ncfg = NatsConfig {
            urls: cfg.urls.clone(),
            subject_prefix: super::bench_prefix(cfg.replicas),
            stream: super::bench_stream(cfg.replicas),
            replicas: cfg.replicas,
            max_age: Duration::from_secs(600),
            worker_id: None,
            creds: None,
            tls_ca: None,
            required: false,
        };
        let client = kvbridge::sink::connect(&ncfg, "kvbridge bench floor")
            .await
            .map_err(|e| e.to_string())?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(kvbridge::sink::ACK_TIMEOUT);
        kvbridge::sink::ensure_stream(&js, &ncfg)
            .await
            .map_err(|e| e.to_string())?;
        let pool = payloads(cfg.mix);
        let payload_bytes =
            pool.iter().map(|b| b.len()).sum::<usize>() as f64 / pool.len().max(1) as f64;
        let pid = std::process::id();
        let subject =
            async_nats::Subject::from(format!("{}.floor-{pid}.merged", ncfg.subject_prefix));
        let ring_id = format!("{:016x}", kvbridge::clock::unix_nanos() ^ u64::from(pid));

        // The clock: a thread hands out (index, scheduled Unix ns) at the rate, like commits
        // in the ring wake the sink.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, u64)>();
        let total = cfg.rate * (cfg.warmup + cfg.duration).as_secs_f64() as u64;
        let rate = cfg.rate;
        let pacer = std::thread::Builder::new()
            .name("floor-pacer".into())
            .spawn(move || {
                crate::bench::fine_timer_slack();
                let start = Instant::now();
                let wall0 = kvbridge::clock::unix_nanos();
                let period_ns = 1e9 / rate as f64;
                for i in 0..total {
                    let off = Duration::from_nanos((i as f64 * period_ns) as u64);
                    let due = start + off;
                    // Sleep only (no spinning): the floor must not spend a core the cluster
                    // needs; lateness of the wake-up counts against the floor, not for it.
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    if tx.send((i, wall0 + off.as_nanos() as u64)).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        let measure_from = cfg.rate * cfg.warmup.as_secs_f64() as u64;

        struct Pending {
            i: u64,
            due_ns: u64,
            ack: std::pin::Pin<
                Box<
                    dyn std::future::Future<
                            Output = Result<
                                jetstream::publish::PublishAck,
                                jetstream::context::PublishError,
                            >,
                        > + Send,
                >,
            >,
        }
        let mut inflight: VecDeque<Pending> = VecDeque::with_capacity(MAX_IN_FLIGHT);
        let mut lags: Vec<u64> = Vec::with_capacity(total as usize);
        let mut failures = 0u64;
        let mut cpu0: Option<(Instant, Option<f64>)> = None;
        let mut last_ack = Instant::now();
        let mut closed = false;
        while !(closed && inflight.is_empty()) {
            tokio::select! {
                r = async { inflight.front_mut().expect("checked").ack.as_mut().await }, if !inflight.is_empty() => {
                    let done = inflight.pop_front().expect("checked");
                    match r {
                        Ok(_) if done.i >= measure_from => {
                            lags.push(kvbridge::clock::unix_nanos().saturating_sub(done.due_ns));
                            last_ack = Instant::now();
                        }
                        Ok(_) => {}
                        Err(_) => failures += 1,
                    }
                }
                m = rx.recv(), if !closed && inflight.len() < MAX_IN_FLIGHT => {
                    let Some((i, due_ns)) = m else {
                        closed = true;
                        continue;
                    };
                    if i == measure_from {
                        cpu0 = Some((Instant::now(), super::super::proc_stats::cpu_seconds(pid)));
                    }
                    let mut h = HeaderMap::new();
                    h.insert(HeaderName::from_static(HEADER_SEQ), i.to_string());
                    h.insert(HeaderName::from_static(HEADER_RING_ID), ring_id.as_str());
                    h.insert(HeaderName::from_static(HEADER_DP_RANK), "0");
                    h.insert(HeaderName::from_static(kvbridge::sink::HEADER_MSG_ID), format!("{ring_id}:{i}"));
                    let payload = pool[(i % pool.len() as u64) as usize].clone();
                    match js.publish_with_headers(subject.clone(), h, payload).await {
                        Ok(a) => inflight.push_back(Pending { i, due_ns, ack: a.into_future() }),
                        Err(_) => failures += 1,
                    }
                }
            }
        }
        let cpu_end = super::super::proc_stats::cpu_seconds(pid);
        let _ = pacer.join();
        let _ = client.flush().await;
        lags.sort_unstable();
        // From the first measured publication to the last measured acknowledgement: a publisher
        // that fell behind shows a lower rate here, not only a longer lag.
        let seconds = cpu0.map_or(cfg.duration.as_secs_f64(), |(t, _)| {
            last_ack.saturating_duration_since(t).as_secs_f64()
        });
        let cpu_us_per_batch = match (cpu0, cpu_end) {
            (Some((_, Some(a))), Some(b)) if !lags.is_empty() => {
                Some((b - a) * 1e6 / lags.len() as f64)
            }
            _ => None,
        };
        Ok(FloorFigures {
            published_per_s: lags.len() as f64 / seconds.max(1e-9),
            lag_ms: (pct(&lags, 0.5), pct(&lags, 0.99)),
            cpu_us_per_batch,
            payload_bytes,
            failures,
        })
    }

    #[cfg(test)]
    mod tests {
        use prost::Message;

        #[test]
        fn floor_payloads_are_the_records_the_bridge_would_publish() {
            let pool = super::payloads(super::Mix::Serving);
            assert!(pool.len() >= 256);
            for (i, b) in pool.iter().enumerate() {
                let batch = kvbridge::proto::common::KvEventBatch::decode(b.as_ref())
                    .expect("a KvEventBatch");
                assert_eq!(batch.sequence_number, 1_000_000 + i as u64);
                assert!(!batch.events.is_empty());
            }
        }

        #[test]
        fn percentiles_are_nearest_rank() {
            let v: Vec<u64> = (1..=100).map(|i| i * 1_000_000).collect();
            assert_eq!(super::pct(&v, 0.5), 50.0);
            assert_eq!(super::pct(&v, 0.99), 99.0);
            assert!(super::pct(&[], 0.5).is_nan());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_within_a_bucket() {
        let a = SinkSample::default();
        let mut b = SinkSample {
            published: 100.0,
            ..Default::default()
        };
        b.buckets.insert(1_000_000, 50.0); // ≤ 1 ms: 50
        b.buckets.insert(2_000_000, 100.0); // ≤ 2 ms: 100
        b.buckets.insert(u64::MAX, 100.0);
        let f = SinkFigures::between(&a, &b, 2.0, Some(0.01));
        assert_eq!(f.published_per_s, 50.0);
        assert!((f.lag_ms.0 - 1.0).abs() < 1e-9);
        assert!((f.lag_ms.1 - 1.98).abs() < 1e-9);
        assert!((f.cpu_us_per_batch.unwrap() - 100.0).abs() < 1e-9);
    }
}
