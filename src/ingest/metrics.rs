//! Ingest's series: per DP rank, what arrived from the engine, what was dropped, repaired or
//! synthesized, and whether the rank's output is exact. Registered once by the service
//! ([`IngestMetrics::new`]); each rank thread holds its [`RankMetrics`] handles, resolved once.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use crate::metrics::Metrics;

/// Ingest's series, per rank.
pub struct IngestMetrics {
    pub(super) batches_received: IntCounterVec,
    pub(super) frames_dropped: IntCounterVec,
    pub(super) upstream_gaps: IntCounterVec,
    pub(super) replays: IntCounterVec,
    pub(super) replayed_batches: IntCounterVec,
    pub(super) engine_restarts: IntCounterVec,
    pub(super) synthesized_clears: IntCounterVec,
    pub(super) decode_errors: IntCounterVec,
    pub(super) publisher_connects: IntCounterVec,
    pub(super) publisher_disconnects: IntCounterVec,
    pub(super) upstream_connected: IntGaugeVec,
    pub(super) publisher_rejoins: IntCounterVec,
    pub(super) rank_exact: IntGaugeVec,
    pub(super) rank_degraded: IntGaugeVec,
    pub(super) duplicates_dropped: IntCounterVec,
    pub(super) repeated_frames: IntCounterVec,
    pub(super) rank_mismatch: IntCounterVec,
    pub(super) last_upstream_seq: IntGaugeVec,
    pub(super) decoder: IntCounterVec,
}

impl IngestMetrics {
    /// Registers ingest's series on `m`'s registry.
    pub fn new(m: &Metrics) -> Self {
        let rank = &["rank"];
        IngestMetrics {
            batches_received: m.counter_vec("batches_received_total", "Engine batches received", rank),
            frames_dropped: m.counter_vec(
                "frames_dropped_total",
                "ZMQ messages dropped before decoding",
                &["rank", "reason"],
            ),
            upstream_gaps: m.counter_vec("upstream_gaps_total", "Engine sequence gaps detected", rank),
            replays: m.counter_vec(
                "replays_total",
                "Replay requests by outcome",
                &["rank", "outcome"],
            ),
            replayed_batches: m.counter_vec(
                "replayed_batches_total",
                "Batches recovered by replay",
                rank,
            ),
            engine_restarts: m.counter_vec("engine_restarts_total", "Engine restarts detected", rank),
            synthesized_clears: m.counter_vec(
                "synthesized_clears_total",
                "In-band cleared events",
                &["rank", "cause"],
            ),
            decode_errors: m.counter_vec(
                "decode_errors_total",
                "Batches that could not be decoded, by error kind",
                &["rank", "kind"],
            ),
            publisher_connects: m.counter_vec(
                "publisher_connects_total",
                "Engine publisher connections established",
                rank,
            ),
            publisher_disconnects: m.counter_vec(
                "publisher_disconnects_total",
                "Engine publisher disconnects",
                rank,
            ),
            publisher_rejoins: m.counter_vec(
                "publisher_rejoins_total",
                "Publisher connections kvbridge re-established after libzmq dropped them for a protocol error (e.g. a message above --max-engine-message)",
                rank,
            ),
            upstream_connected: m.gauge_vec(
                "upstream_connected",
                "Engine publisher connections currently up",
                rank,
            ),
            rank_exact: m.gauge_vec(
                "rank_exact",
                "1 while a rank's output is the engine's whole cache state, 0 while degraded (kvbridge_rank_degraded says why)",
                rank,
            ),
            rank_degraded: m.gauge_vec(
                "rank_degraded",
                "1 for the cause a rank's output is degraded by (until the engine's next cache reset or restart), else 0",
                &["rank", "cause"],
            ),
            duplicates_dropped: m.counter_vec(
                "duplicates_dropped_total",
                "Duplicate batches dropped",
                rank,
            ),
            repeated_frames: m.counter_vec(
                "repeated_frames_total",
                "Live frames repeating the last applied engine batch, same seq and bytes (dropped)",
                rank,
            ),
            rank_mismatch: m.counter_vec(
                "rank_mismatch_total",
                "Batches whose rank differs from the socket's",
                rank,
            ),
            last_upstream_seq: m.gauge_vec("last_upstream_seq", "Last engine sequence applied", rank),
            decoder: m.counter_vec(
                "decoder_events_total",
                "Decoder counters by kind (events by type, skipped keys/tags, filtered, splits)",
                &["rank", "kind"],
            ),
        }
    }

    /// Counter handles for one ingest rank.
    pub fn rank(&self, rank: u32) -> RankMetrics {
        let r = rank.to_string();
        let l = [r.as_str()];
        RankMetrics {
            label: r.clone(),
            batches: self.batches_received.with_label_values(&l),
            gaps: self.upstream_gaps.with_label_values(&l),
            restarts: self.engine_restarts.with_label_values(&l),
            decode_errors: self.decode_errors.clone(),
            connects: self.publisher_connects.with_label_values(&l),
            disconnects: self.publisher_disconnects.with_label_values(&l),
            connected: self.upstream_connected.with_label_values(&l),
            rejoins: self.publisher_rejoins.with_label_values(&l),
            duplicates: self.duplicates_dropped.with_label_values(&l),
            repeated: self.repeated_frames.with_label_values(&l),
            replayed: self.replayed_batches.with_label_values(&l),
            rank_mismatch: self.rank_mismatch.with_label_values(&l),
            last_seq: self.last_upstream_seq.with_label_values(&l),
            frames_dropped: self.frames_dropped.clone(),
            replays: self.replays.clone(),
            clears: self.synthesized_clears.clone(),
            decoder: self.decoder.clone(),
            exact: self.rank_exact.with_label_values(&l),
            degraded: self.rank_degraded.clone(),
        }
    }
}

/// Per-rank handles (resolved once).
#[derive(Clone)]
pub struct RankMetrics {
    /// Rank label.
    pub label: String,
    /// Batches received.
    pub batches: IntCounter,
    /// Gaps.
    pub gaps: IntCounter,
    /// Restarts.
    pub restarts: IntCounter,
    /// Publisher connections established.
    pub connects: IntCounter,
    /// Publisher disconnects.
    pub disconnects: IntCounter,
    /// Publisher connections up.
    pub connected: IntGauge,
    /// Publisher connections re-established after libzmq gave them up.
    pub rejoins: IntCounter,
    /// Duplicates dropped.
    pub duplicates: IntCounter,
    /// Live frames repeating the last applied seq (dropped).
    pub repeated: IntCounter,
    /// Batches recovered by replay.
    pub replayed: IntCounter,
    /// Rank element differs from the socket's rank.
    pub rank_mismatch: IntCounter,
    /// Last engine seq.
    pub last_seq: IntGauge,
    pub(super) decode_errors: IntCounterVec,
    pub(super) frames_dropped: IntCounterVec,
    pub(super) replays: IntCounterVec,
    pub(super) clears: IntCounterVec,
    pub(super) decoder: IntCounterVec,
    exact: IntGauge,
    pub(super) degraded: IntGaugeVec,
}

impl RankMetrics {
    /// Counts a message dropped before decoding.
    pub fn frame_dropped(&self, reason: &str) {
        self.frames_dropped
            .with_label_values(&[self.label.as_str(), reason])
            .inc();
    }
    /// Counts an undecodable batch by error kind.
    pub fn decode_error(&self, kind: &str) {
        self.decode_errors
            .with_label_values(&[self.label.as_str(), kind])
            .inc();
    }
    /// Counts a replay outcome (`requested`, `succeeded`, `history_missing`, `timed_out`, …).
    pub fn replay(&self, outcome: &str) {
        self.replays
            .with_label_values(&[self.label.as_str(), outcome])
            .inc();
    }
    /// Creates the synthesized-clear series for `cause` (at 0) without counting one.
    pub fn clear_series(&self, cause: &str) {
        self.clears.with_label_values(&[self.label.as_str(), cause]);
    }
    /// Creates the series of every dropped-frame reason, replay outcome and decode-error kind
    /// given (at 0), so that rates and `increase()` are defined before the first one.
    pub fn input_series(&self, drops: &[&str], replays: &[&str], decode_errors: &[&str]) {
        let r = self.label.as_str();
        for d in drops {
            self.frames_dropped.with_label_values(&[r, d]);
        }
        for o in replays {
            self.replays.with_label_values(&[r, o]);
        }
        for k in decode_errors {
            self.decode_errors.with_label_values(&[r, k]);
        }
    }
    /// Counts a synthesized clear.
    pub fn clear(&self, cause: &str) {
        self.clears
            .with_label_values(&[self.label.as_str(), cause])
            .inc();
    }
    /// Sets the freshness series: `exact` 1 and every cause 0, or `exact` 0 and each active
    /// cause 1. Every label value exists from the first call on.
    pub fn set_freshness(&self, active: crate::health::Causes) {
        self.exact.set(active.is_exact() as i64);
        for c in crate::health::Degraded::ALL {
            self.degraded
                .with_label_values(&[self.label.as_str(), c.label()])
                .set(active.contains(c) as i64);
        }
    }
    /// Brings a decoder counter up to `value` (the decoder's own running total).
    pub fn decoder_set(&self, kind: &str, value: u64) {
        let c = self.decoder.with_label_values(&[self.label.as_str(), kind]);
        let cur = c.get();
        if value > cur {
            c.inc_by(value - cur);
        }
    }
}

#[cfg(test)]
impl IngestMetrics {
    /// Ingest's series on a registry of their own.
    pub(crate) fn for_tests() -> Self {
        IngestMetrics::new(&Metrics::new())
    }
}
