//! The sink's series, per subject: what was published and acknowledged, what failed, and whether
//! NATS is reachable. Every subject's series exist at 0 from the start.

use prometheus::{GaugeVec, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts};

use crate::metrics::Metrics;

/// The sink's metrics, registered in the process registry.
#[derive(Clone)]
pub(crate) struct SinkMetrics {
    pub(super) published: IntCounterVec,
    pub(super) cleared: IntCounterVec,
    pub(super) failures: IntCounterVec,
    pub(super) republished: IntCounterVec,
    pub(super) rejected_for_order: IntCounterVec,
    pub(super) config_errors: IntCounter,
    pub(super) connected: IntGauge,
    pub(super) lag: IntGaugeVec,
    pub(super) lag_seconds: GaugeVec,
    pub(super) acked_seq: IntGaugeVec,
    pub(super) latency: HistogramVec,
}

impl SinkMetrics {
    pub(super) fn new(m: &Metrics) -> Self {
        let subject = &["subject"];
        SinkMetrics {
            published: m.counter_vec(
                "nats_published_total",
                "Ring records acknowledged by JetStream",
                subject,
            ),
            cleared: m.counter_vec(
                "nats_cleared_total",
                "In-band cleared batches the sink published for records the ring no longer had",
                &["subject", "cause"],
            ),
            failures: m.counter_vec(
                "nats_publish_failures_total",
                "Batches not stored for want of NATS (unreachable, timed out, leader change); the sink resumes after the stream's last record",
                subject,
            ),
            republished: m.counter_vec(
                "nats_republished_total",
                "Records sent again after a batch that held them was not acknowledged",
                subject,
            ),
            rejected_for_order: m.counter_vec(
                "nats_rejected_for_order_total",
                "Records in batches JetStream refused because the subject's last message was not their predecessor",
                subject,
            ),
            config_errors: m.counter(
                "nats_config_errors_total",
                "Configuration errors the NATS server reported (stream settings, permissions): the sink retries, kvbridge serves on",
            ),
            connected: m.gauge("nats_connected", "1 while the sink's NATS connection is up"),
            lag: m.gauge_vec(
                "nats_lag_records",
                "Newest ring sequence minus the last one JetStream acknowledged",
                subject,
            ),
            lag_seconds: m.register(
                GaugeVec::new(
                    Opts::new(
                        "nats_lag_seconds",
                        "Age of the oldest ring record JetStream has not acknowledged (0: caught up)",
                    ),
                    subject,
                )
                .expect("valid metric"),
            ),
            acked_seq: m.gauge_vec(
                "nats_acked_sequence",
                "Last ring sequence JetStream acknowledged",
                subject,
            ),
            latency: m.histogram_vec(
                "nats_publish_lag_seconds",
                "Commit in the ring to JetStream acknowledgement, per published record",
                subject,
                prometheus::exponential_buckets(5e-5, 1.25, 56).expect("buckets"),
            ),
        }
    }
}

impl SinkMetrics {
    /// Creates every series of `subject` at 0.
    pub(super) fn series_at_zero(&self, subject: &str) {
        let l = [subject];
        self.published.with_label_values(&l);
        self.failures.with_label_values(&l);
        self.republished.with_label_values(&l);
        self.rejected_for_order.with_label_values(&l);
        self.lag.with_label_values(&l);
        self.lag_seconds.with_label_values(&l);
        self.acked_seq.with_label_values(&l);
        self.latency.with_label_values(&l);
    }
}
