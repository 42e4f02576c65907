//! The snapshot edge's series: table sizes, snapshots served, checkpoints (per ring).

use std::sync::Arc;

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts,
};

use crate::metrics::Metrics;

/// Snapshot metrics (registered once per process).
pub struct SnapshotMetrics {
    pub(super) blocks: IntGaugeVec,
    pub(super) bytes: IntGaugeVec,
    pub(super) unknown: IntGaugeVec,
    pub(super) served: IntCounterVec,
    pub(super) chunks: IntCounterVec,
    pub(super) seconds: HistogramVec,
    pub(super) checkpoints: IntCounterVec,
    pub(super) checkpoint_bytes: IntCounterVec,
    pub(super) checkpoint_errors: IntCounterVec,
    pub(super) checkpoint_lapped: IntCounterVec,
    pub(super) checkpoint_seconds: HistogramVec,
    pub(super) checkpoint_age: GaugeVec,
    pub(super) checkpoint_margin: IntGaugeVec,
    pub(super) write_rate: GaugeVec,
}

impl SnapshotMetrics {
    /// Registers the snapshot metrics on `m`'s registry.
    pub fn new(m: &Metrics) -> Arc<Self> {
        let gauge = |name: &str, help: &str, labels: &[&str]| m.gauge_vec(name, help, labels);
        let counter = |name: &str, help: &str, labels: &[&str]| m.counter_vec(name, help, labels);
        let fgauge = |name: &str, help: &str| {
            m.register(GaugeVec::new(Opts::new(name, help), &["ring"]).expect("valid metric"))
        };
        let histogram = |name: &str, help: &str| {
            let buckets = vec![0.0005, 0.002, 0.01, 0.05, 0.2, 1.0, 5.0];
            m.histogram_vec(name, help, &["ring"], buckets)
        };
        Arc::new(SnapshotMetrics {
            blocks: gauge(
                "snapshot_table_blocks",
                "blocks held by the snapshot table, per ring and rank",
                &["ring", "rank"],
            ),
            bytes: gauge(
                "snapshot_table_bytes",
                "bytes held by the snapshot table, per ring",
                &["ring"],
            ),
            unknown: gauge(
                "snapshot_table_unknown",
                "events the table could not follow since the last clear (0 = complete)",
                &["ring"],
            ),
            served: counter(
                "snapshots_served_total",
                "snapshots served, per ring and completeness",
                &["ring", "complete"],
            ),
            chunks: counter(
                "snapshot_chunks_total",
                "snapshot chunks served, per ring",
                &["ring"],
            ),
            seconds: histogram(
                "snapshot_serve_seconds",
                "time to build a snapshot (image copy under the lock + chunk encoding)",
            ),
            checkpoints: counter(
                "snapshot_checkpoints_total",
                "checkpoints written, per ring and reason (start, lap, interval, shutdown)",
                &["ring", "reason"],
            ),
            checkpoint_bytes: counter(
                "snapshot_checkpoint_bytes_total",
                "bytes of checkpoint files written, per ring",
                &["ring"],
            ),
            checkpoint_errors: counter(
                "snapshot_checkpoint_errors_total",
                "checkpoints that could not be written, per ring",
                &["ring"],
            ),
            checkpoint_lapped: counter(
                "snapshot_checkpoint_lapped_total",
                "times the ring lapped the checkpoint's cut (a restart then rebuilds the table incomplete)",
                &["ring"],
            ),
            checkpoint_seconds: histogram(
                "snapshot_checkpoint_seconds",
                "time to write a checkpoint (image copy + file write + rename)",
            ),
            checkpoint_age: fgauge(
                "snapshot_checkpoint_age_seconds",
                "age of the checkpoint on disk (since its image was taken)",
            ),
            checkpoint_margin: gauge(
                "snapshot_checkpoint_margin_bytes",
                "bytes the ring can still write before it laps the checkpoint's cut (negative: lapped)",
                &["ring"],
            ),
            write_rate: fgauge(
                "snapshot_ring_write_rate_bytes",
                "ring write rate the checkpoint margin is sized from (bytes/s, a decaying peak)",
            ),
        })
    }
}

/// One ring's checkpoint metrics, resolved once.
pub(super) struct CheckpointGauges {
    pub(super) bytes: IntCounter,
    pub(super) errors: IntCounter,
    pub(super) lapped: IntCounter,
    pub(super) seconds: Histogram,
    pub(super) age: Gauge,
    pub(super) margin: IntGauge,
    pub(super) rate: Gauge,
}

impl CheckpointGauges {
    pub(super) fn new(m: &SnapshotMetrics, label: &str) -> Self {
        let l = [label];
        CheckpointGauges {
            bytes: m.checkpoint_bytes.with_label_values(&l),
            errors: m.checkpoint_errors.with_label_values(&l),
            lapped: m.checkpoint_lapped.with_label_values(&l),
            seconds: m.checkpoint_seconds.with_label_values(&l),
            age: m.checkpoint_age.with_label_values(&l),
            margin: m.checkpoint_margin.with_label_values(&l),
            rate: m.write_rate.with_label_values(&l),
        }
    }
}
