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
