//! The gRPC edge's series: subscribers, what they were sent and how fast, how subscriptions
//! ended, and the listener's rejections. Registered once by the service with every path and
//! outcome at 0, so that a dashboard shows 0 and a rate is defined before the first subscriber.

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec};

use crate::metrics::Metrics;

/// The gRPC edge's series.
pub struct FanoutMetrics {
    /// Current subscribers, per path.
    pub subscribers: IntGaugeVec,
    /// Batches sent to subscribers.
    pub batches_sent: IntCounter,
    /// Bytes sent to subscribers (encoded batches).
    pub bytes_sent: IntCounter,
    /// Subscribe outcomes (fresh, in_window, at_head, out_of_range, data_loss, …).
    pub resumes: IntCounterVec,
    /// Statuses emitted, by gRPC code.
    pub statuses: IntCounterVec,
    /// Time from ingest to hand-off to the transport, seconds: live sends only (batches
    /// ingested after the subscriber subscribed).
    pub send_latency: HistogramVec,
    /// Batches a subscriber was sent from history it caught up on (ingested before it
    /// subscribed): not live sends, so not in `send_latency`.
    pub catchup_sends: IntCounterVec,
    /// Per-subscriber lag (N − the newest sequence just written), observed once per write.
    pub subscriber_lag: Histogram,
    /// Subscribers disconnected for being too slow (DATA_LOSS), per path.
    pub slow_disconnects: IntCounterVec,
    /// Calls rejected for a missing or wrong bearer token.
    pub auth_failures: IntCounter,
    /// gRPC connections closed for not completing TLS / the HTTP/2 preface in time.
    pub handshake_timeouts: IntCounter,
    /// The listeners' accept failures (the process's series, [`Metrics::accept_errors`]).
    pub accept_errors: IntCounterVec,
}

impl FanoutMetrics {
    /// Registers the edge's series on `m`'s registry, every path and outcome at 0.
    pub fn new(m: &Metrics) -> Self {
        let path = &["path"];
        let f = FanoutMetrics {
            subscribers: m.gauge_vec("subscribers", "Current subscribers", path),
            batches_sent: m.counter("batches_sent_total", "Batches sent to subscribers"),
            bytes_sent: m.counter("bytes_sent_total", "Encoded batch bytes sent to subscribers"),
            resumes: m.counter_vec(
                "subscribe_outcomes_total",
                "Subscribe requests by outcome",
                &["outcome"],
            ),
            statuses: m.counter_vec("statuses_total", "gRPC statuses emitted", &["code"]),
            send_latency: m.histogram_vec(
                "send_latency_seconds",
                "Ingest to transport hand-off, per live subscriber batch (ingested after the subscriber subscribed; catch-up is kvbridge_catchup_sends_total)",
                path,
                prometheus::exponential_buckets(5e-6, 2.5, 14).expect("buckets"),
            ),
            catchup_sends: m.counter_vec(
                "catchup_sends_total",
                "Batches sent to subscribers from history ingested before they subscribed (a new or resuming subscriber catching up)",
                path,
            ),
            subscriber_lag: m.histogram(
                "subscriber_lag_batches",
                "Newest sequence minus the newest one just written to a subscriber, per write (a write carries one record or several)",
                std::iter::once(0.0)
                    .chain(prometheus::exponential_buckets(1.0, 4.0, 10).expect("buckets"))
                    .collect(),
            ),
            slow_disconnects: m.counter_vec(
                "slow_subscriber_disconnects_total",
                "Subscribers ended with DATA_LOSS for falling a ring lap behind",
                path,
            ),
            auth_failures: m.counter(
                "auth_failures_total",
                "gRPC calls rejected with UNAUTHENTICATED",
            ),
            handshake_timeouts: m.counter(
                "handshake_timeouts_total",
                "gRPC connections closed for not completing TLS and the HTTP/2 preface in time",
            ),
            accept_errors: m.accept_errors.clone(),
        };
        for s in crate::proto::ENGINE_SERVICES {
            f.subscribers.with_label_values(&[s.path]);
            f.send_latency.with_label_values(&[s.path]);
            f.catchup_sends.with_label_values(&[s.path]);
            f.slow_disconnects.with_label_values(&[s.path]);
        }
        for outcome in super::SUBSCRIBE_OUTCOMES {
            f.resumes.with_label_values(&[outcome]);
        }
        f
    }
}
