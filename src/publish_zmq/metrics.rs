//! The engine-wire edge's series, registered in the process registry with every rank's label
//! values at zero from the start.

use prometheus::{IntCounterVec, IntGaugeVec};

use crate::metrics::Metrics;

/// The edge's metrics, registered in the process registry.
#[derive(Clone)]
pub(crate) struct ZmqMetrics {
    pub(super) published: IntCounterVec,
    pub(super) published_bytes: IntCounterVec,
    pub(super) cleared: IntCounterVec,
    pub(super) replay_requests: IntCounterVec,
    pub(super) snapshot_replays: IntCounterVec,
    pub(super) replay_bytes: IntCounterVec,
    pub(super) replays_active: IntGaugeVec,
    pub(super) replays_queued: IntGaugeVec,
    pub(super) snapshot_requests: IntCounterVec,
    pub(super) heartbeats: IntCounterVec,
}

impl ZmqMetrics {
    pub(super) fn new(m: &Metrics) -> Self {
        let counter = |name: &str, help: &str, labels: &[&str]| m.counter_vec(name, help, labels);
        let gauge = |name: &str, help: &str| m.gauge_vec(name, help, &["rank"]);
        ZmqMetrics {
            published: counter(
                "zmq_published_total",
                "Batches published on the engine ZMQ wire (one per ring record)",
                &["rank"],
            ),
            published_bytes: counter(
                "zmq_published_bytes_total",
                "Payload bytes published on the engine ZMQ wire",
                &["rank"],
            ),
            cleared: counter(
                "zmq_cleared_total",
                "AllBlocksCleared batches the ZMQ edge published for records it could not read from the ring",
                &["rank", "cause"],
            ),
            replay_requests: counter(
                "zmq_replay_requests_total",
                "Replay requests by outcome: window (start..newest from the ring), state (snapshot or clear, then the ring), future (end marker only), incomplete (peer gone or ring lapped mid-replay), stalled (the peer read nothing for 10 s), malformed and busy (dropped unanswered)",
                &["rank", "outcome"],
            ),
            snapshot_replays: counter(
                "zmq_snapshot_replays_total",
                "Replays that began with the rank's live block table (snapshot)",
                &["rank"],
            ),
            replay_bytes: counter(
                "zmq_replay_bytes_total",
                "Payload bytes sent in replay replies",
                &["rank"],
            ),
            replays_active: gauge("zmq_replays_active", "Replays being sent"),
            replays_queued: gauge(
                "zmq_replays_queued",
                "Replay requests waiting for a free replay slot",
            ),
            snapshot_requests: counter(
                "zmq_snapshot_requests_total",
                "Snapshot requests (vLLM #57789's wire) by outcome: served (the rank's table at a cut), unavailable (-2: no table, an incomplete one, or above the reply limit), dropped (the requester's pipe full)",
                &["rank", "outcome"],
            ),
            heartbeats: counter(
                "zmq_heartbeats_total",
                "Empty batches sent on vLLM #57789's wire after a second with nothing to publish",
                &["rank"],
            ),
        }
    }
}

/// Why the live publisher sent an `AllBlocksCleared` in place of ring records (the `cause` of
/// `kvbridge_zmq_cleared_total`).
#[derive(Clone, Copy, Debug)]
pub(super) enum ClearCause {
    RingLapped,
    Corrupt,
    RingReplaced,
    Undecodable,
}

impl ClearCause {
    const ALL: [ClearCause; 4] = [
        ClearCause::RingLapped,
        ClearCause::Corrupt,
        ClearCause::RingReplaced,
        ClearCause::Undecodable,
    ];

    pub(super) fn label(self) -> &'static str {
        match self {
            ClearCause::RingLapped => "ring_lapped",
            ClearCause::Corrupt => "corrupt",
            ClearCause::RingReplaced => "ring_replaced",
            ClearCause::Undecodable => "undecodable",
        }
    }
}

impl ZmqMetrics {
    /// Creates every series of rank `rank` at zero, so that a dashboard shows the edge before its
    /// first event and an alert's `increase()` counts the first clear or refused replay (a series
    /// that appears at 1 has no earlier sample to increase from).
    pub(super) fn init_rank(&self, rank: u32, replay: bool, snapshot: bool) {
        let r = rank.to_string();
        self.published.with_label_values(&[&r]);
        self.published_bytes.with_label_values(&[&r]);
        for cause in ClearCause::ALL {
            self.cleared.with_label_values(&[&r, cause.label()]);
        }
        if replay {
            for outcome in super::replay::Outcome::ALL {
                self.replay_requests
                    .with_label_values(&[&r, outcome.label()]);
            }
            self.snapshot_replays.with_label_values(&[&r]);
            self.replay_bytes.with_label_values(&[&r]);
            self.replays_active.with_label_values(&[&r]);
            self.replays_queued.with_label_values(&[&r]);
        }
        if snapshot {
            for outcome in super::snapshot::Outcome::ALL {
                self.snapshot_requests
                    .with_label_values(&[&r, outcome.label()]);
            }
            self.heartbeats.with_label_values(&[&r]);
        }
    }
}
