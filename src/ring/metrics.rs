//! The ring's series, per ring (`merged`, `rank-<r>`): what was written (counted at commit), the
//! window and fill (sampled by the heartbeat), and what its in-process readers ran into.
//! Registered once by the service; each [`RingHub`](super::RingHub) resolves its own handles.

use prometheus::{GaugeVec, Histogram, IntCounterVec, IntGaugeVec, Opts};

use crate::metrics::Metrics;

/// The ring's series.
pub struct RingMetrics {
    pub(super) capacity: IntGaugeVec,
    pub(super) used: IntGaugeVec,
    pub(super) fill: GaugeVec,
    pub(super) reader_laps: IntCounterVec,
    pub(super) corrupt_records: IntCounterVec,
    pub(super) records: IntCounterVec,
    pub(super) bytes: IntCounterVec,
    pub(super) oldest: IntGaugeVec,
    pub(super) newest: IntGaugeVec,
    pub(super) record_size: Histogram,
}

impl RingMetrics {
    /// Registers the ring's series on `m`'s registry.
    pub fn new(m: &Metrics) -> Self {
        let ring = &["ring"];
        RingMetrics {
            capacity: m.gauge_vec("ring_capacity_bytes", "Ring data capacity", ring),
            used: m.gauge_vec(
                "ring_used_bytes",
                "Ring bytes holding retained records",
                ring,
            ),
            fill: m.register(
                GaugeVec::new(
                    Opts::new("ring_fill_ratio", "Retained bytes / capacity"),
                    ring,
                )
                .expect("valid metric"),
            ),
            reader_laps: m.counter_vec(
                "ring_reader_laps_total",
                "In-process readers (subscribers) overtaken by the writer",
                ring,
            ),
            corrupt_records: m.counter_vec(
                "ring_corrupt_records_total",
                "Records read from the ring with a bad checksum or damaged header (not served)",
                ring,
            ),
            records: m.counter_vec("ring_records_total", "Records written", ring),
            bytes: m.counter_vec("ring_bytes_total", "Record bytes written", ring),
            oldest: m.gauge_vec("ring_oldest_seq", "Oldest retained sequence", ring),
            newest: m.gauge_vec("ring_newest_seq", "Newest sequence", ring),
            record_size: m.histogram(
                "record_size_bytes",
                "Encoded KvEventBatch size",
                prometheus::exponential_buckets(64.0, 4.0, 10).expect("buckets"),
            ),
        }
    }
}
