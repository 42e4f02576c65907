//! The ring's own metrics: what it wrote (counted at commit) and its window and fill (sampled by
//! the heartbeat thread, which also keeps the writer's heartbeat fresh for readers).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus::{Gauge, Histogram, IntCounter, IntGauge};

use super::{RingHub, RingMetrics};

/// Pre-resolved handles for one ring (label = the hub's label), so a commit hashes no labels.
pub(super) struct RingGauges {
    pub(super) records: IntCounter,
    pub(super) bytes: IntCounter,
    /// Only the merged ring feeds the record-size histogram (per-rank rings hold copies).
    pub(super) record_size: Option<Histogram>,
    pub(super) reader_laps: IntCounter,
    pub(super) corrupt_records: IntCounter,
    oldest: IntGauge,
    newest: IntGauge,
    used: IntGauge,
    fill: Gauge,
}

impl RingGauges {
    pub(super) fn new(m: &RingMetrics, label: &str, capacity: u64, record_size: bool) -> Self {
        let l = [label];
        m.capacity.with_label_values(&l).set(capacity as i64);
        RingGauges {
            records: m.records.with_label_values(&l),
            bytes: m.bytes.with_label_values(&l),
            record_size: record_size.then(|| m.record_size.clone()),
            // At 0 from the start, so that alerts see the first one (`increase()`).
            reader_laps: m.reader_laps.with_label_values(&l),
            corrupt_records: m.corrupt_records.with_label_values(&l),
            oldest: m.oldest.with_label_values(&l),
            newest: m.newest.with_label_values(&l),
            used: m.used.with_label_values(&l),
            fill: m.fill.with_label_values(&l),
        }
    }

    fn sample(&self, hub: &RingHub) {
        let p = hub.position();
        self.oldest.set(p.oldest as i64);
        self.newest.set(p.newest as i64);
        self.used.set(p.used() as i64);
        if p.capacity > 0 {
            self.fill.set(p.used() as f64 / p.capacity as f64);
        }
    }
}

/// Keeps every ring's heartbeat fresh and its gauges current (every 100 ms), until `stop`.
///
/// The heartbeat is also where a ring file truncated under the writer is noticed (touching it
/// would be `SIGBUS`): that ring stops being written or read, an ERROR names the problem, and
/// `fatal` is set to the reason so that the service shuts down cleanly.
pub fn spawn_heartbeat(
    hubs: Vec<Arc<RingHub>>,
    stop: Arc<AtomicBool>,
    fatal: tokio::sync::watch::Sender<Option<String>>,
) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name("ring-heartbeat".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for h in &hubs {
                    if h.failure().is_some() {
                        continue;
                    }
                    if let Err(e) = h.heartbeat() {
                        tracing::error!(ring = h.label(), error = %e,
                            "ring file unusable: writing stopped, kvbridge is shutting down (restart it to re-create the ring)");
                        fatal.send_replace(Some(format!("ring {}: {e}", h.label())));
                        continue;
                    }
                    h.metrics.sample(h);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .expect("spawn heartbeat thread")
}
