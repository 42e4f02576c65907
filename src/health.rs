//! Upstream health: which engine publishers are connected (from ZMQ socket monitor events on each
//! rank's SUB), and the `grpc.health.v1.Health` status derived from it.
//!
//! The bridge is SERVING while at least one publisher is connected, and during a grace period
//! after start-up and after the last disconnect (an engine restart, a rolling update); otherwise
//! NOT_SERVING. The status is set for the whole server (`""`) and for each of the four
//! `SubscribeKvEvents` services.
//!
//! In sidecar mode (`--engine-grpc`) SERVING also needs the engine's gRPC server to answer
//! (see [`UpstreamState::gate_on_engine`]): the worker URL is then both the event feed and the
//! engine, and a load balancer must not send traffic to either half that is down.
//!
//! **Freshness.** Connected is not the same as complete: each rank is also `exact` (what
//! kvbridge served is the engine's whole cache state) or `degraded` ([`Degraded`]: kvbridge
//! knows its output may miss blocks the engine holds, or hold ones it dropped), so that an
//! operator can tell an idle engine from one kvbridge no longer follows. Ingest sets it
//! (docs/operations.md, "Freshness"); it is exported as a metric, logged on every change and
//! listed on the metrics listener's `/health` page. It does not change SERVING: a degraded
//! stream is still the best there is, and the gateways recover at the next clear.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::metrics::Metrics;

/// Why a rank's output may not be the engine's whole state. Each lasts until the engine's own
/// cache reset (`AllBlocksCleared`) or its restart, after which the engine's state is again
/// exactly what kvbridge served from then on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Degraded {
    /// The engine's replay buffer no longer held the batches kvbridge missed (a late start, a
    /// long outage): blocks stored before are unknown to every consumer.
    MissingHistory = 1,
    /// A gap no replay could fill: its stores and removals are unknown.
    UnfillableGap = 2,
    /// A batch that could not be decoded took its sequence number.
    Undecodable = 3,
    /// Live batches overflowed what was kept during a replay.
    ReplayOverflow = 4,
    /// A `BlockRemoved` could not be decoded.
    LostRemoval = 5,
    /// Under `--profile smg`, removals of a KV-cache group whose kind is not known were
    /// dropped (docs/engine-wire.md §9.1): a gateway may keep a block the engine evicted.
    UnknownGroup = 6,
}

impl Degraded {
    /// Every cause (the metric's label values).
    pub const ALL: [Degraded; 6] = [
        Degraded::MissingHistory,
        Degraded::UnfillableGap,
        Degraded::Undecodable,
        Degraded::ReplayOverflow,
        Degraded::LostRemoval,
        Degraded::UnknownGroup,
    ];

    /// Metric label and log value.
    pub fn label(self) -> &'static str {
        match self {
            Degraded::MissingHistory => "missing_history",
            Degraded::UnfillableGap => "unfillable_gap",
            Degraded::Undecodable => "undecodable",
            Degraded::ReplayOverflow => "replay_overflow",
            Degraded::LostRemoval => "lost_removal",
            Degraded::UnknownGroup => "unknown_group",
        }
    }

    /// The cause with this code (`self as u8`).
    pub fn from_code(code: u8) -> Option<Degraded> {
        Degraded::ALL.into_iter().find(|d| *d as u8 == code)
    }
}

/// The set of [`Degraded`] causes active on one rank (empty: exact). Several can hold at once
/// (a missing history, then an undecodable batch): each is listed, none hides another, and all
/// end together at the engine's next cache reset or restart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Causes(u8);

impl Causes {
    /// No cause: the rank is exact.
    pub const EXACT: Causes = Causes(0);

    /// Just `d`.
    pub fn of(d: Degraded) -> Causes {
        Causes(1 << (d as u8 - 1))
    }

    /// These causes and `d`.
    #[must_use]
    pub fn with(self, d: Degraded) -> Causes {
        Causes(self.0 | Causes::of(d).0)
    }

    /// True when no cause is active.
    pub fn is_exact(self) -> bool {
        self.0 == 0
    }

    /// Whether `d` is among them.
    pub fn contains(self, d: Degraded) -> bool {
        self.0 & Causes::of(d).0 != 0
    }

    /// The active causes, in [`Degraded::ALL`]'s order.
    pub fn iter(self) -> impl Iterator<Item = Degraded> {
        Degraded::ALL.into_iter().filter(move |d| self.contains(*d))
    }

    /// Their labels, in [`Degraded::ALL`]'s order.
    pub fn labels(self) -> Vec<&'static str> {
        self.iter().map(Degraded::label).collect()
    }
}

/// Connection state of every rank's publisher(s), shared by the rank threads and the health task.
///
/// Each atomic here is a value of its own: no other memory is published through one, so every
/// access is `Relaxed` (a reader needs only that location's latest value, which coherence gives).
pub struct UpstreamState {
    connected: Vec<AtomicI64>,
    /// Per rank: its [`Causes`] bits (0: exact).
    freshness: Vec<AtomicU8>,
    start: Instant,
    /// Milliseconds after `start` of the last disconnect, plus one (0: none yet).
    last_disconnect_ms: AtomicU64,
    /// Sidecar mode: true while the engine's gRPC server answers.
    engine: OnceLock<Arc<AtomicBool>>,
}

impl UpstreamState {
    /// State for `ranks` ranks, nothing connected yet.
    pub fn new(ranks: usize) -> Arc<Self> {
        Arc::new(UpstreamState {
            connected: (0..ranks).map(|_| AtomicI64::new(0)).collect(),
            freshness: (0..ranks).map(|_| AtomicU8::new(0)).collect(),
            start: Instant::now(),
            last_disconnect_ms: AtomicU64::new(0),
            engine: OnceLock::new(),
        })
    }

    /// A publisher connection of `rank` came up.
    pub fn on_connect(&self, rank: u32) -> i64 {
        match self.connected.get(rank as usize) {
            Some(c) => c.fetch_add(1, Ordering::Relaxed) + 1,
            None => 0,
        }
    }

    /// A publisher connection of `rank` went down.
    pub fn on_disconnect(&self, rank: u32) -> i64 {
        let ms = self.start.elapsed().as_millis() as u64 + 1;
        self.last_disconnect_ms.fetch_max(ms, Ordering::Relaxed);
        match self.connected.get(rank as usize) {
            Some(c) => {
                // Never below zero: a DISCONNECTED without a matching CONNECTED (a handshake
                // that failed half-way) must not hide a later connection.
                let mut cur = c.load(Ordering::Relaxed);
                loop {
                    let next = (cur - 1).max(0);
                    match c.compare_exchange(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                        Ok(_) => return next,
                        Err(v) => cur = v,
                    }
                }
            }
            None => 0,
        }
    }

    /// Sets `rank`'s causes ([`Causes::EXACT`]: exact); returns the previous ones. Ingest is
    /// the one writer of a rank's causes; readers (the health page, the metrics) only load.
    pub fn set_causes(&self, rank: u32, causes: Causes) -> Causes {
        self.freshness
            .get(rank as usize)
            .map_or(Causes::EXACT, |f| {
                Causes(f.swap(causes.0, Ordering::Relaxed))
            })
    }

    /// `rank`'s active causes (empty: exact).
    pub fn causes(&self, rank: u32) -> Causes {
        self.freshness
            .get(rank as usize)
            .map_or(Causes::EXACT, |f| Causes(f.load(Ordering::Relaxed)))
    }

    /// The `/health` page: status, then one object per rank (connections, freshness). JSON.
    /// A rank's `causes` lists every active cause; `cause` is the first of them (or `null`), as
    /// the page had before several could be listed.
    pub fn detail_json(&self, grace: Duration) -> String {
        let ranks: Vec<String> = (0..self.connected.len())
            .map(|r| {
                let causes = self.causes(r as u32);
                let state = if causes.is_exact() { "exact" } else { "degraded" };
                let first = causes
                    .iter()
                    .next()
                    .map_or("null".to_string(), |d| format!("\"{}\"", d.label()));
                let all: Vec<String> = causes.labels().iter().map(|l| format!("\"{l}\"")).collect();
                format!(
                    "{{\"rank\":{r},\"connected\":{},\"freshness\":\"{state}\",\"cause\":{first},\"causes\":[{}]}}",
                    self.connected[r].load(Ordering::Relaxed),
                    all.join(",")
                )
            })
            .collect();
        let engine = match self.engine_answers() {
            None => "null",
            Some(true) => "true",
            Some(false) => "false",
        };
        format!(
            "{{\"serving\":{},\"feed_serving\":{},\"engine_answers\":{engine},\"ranks\":[{}]}}\n",
            self.serving(grace),
            self.feed_serving(grace),
            ranks.join(",")
        )
    }

    /// Ranks with at least one publisher connected.
    pub fn connected_ranks(&self) -> usize {
        self.connected
            .iter()
            .filter(|c| c.load(Ordering::Relaxed) > 0)
            .count()
    }

    /// Sidecar mode: from now on SERVING also needs `answering` (the engine's gRPC server
    /// answers kvbridge's probe). Set once; later calls are ignored.
    pub fn gate_on_engine(&self, answering: Arc<AtomicBool>) {
        let _ = self.engine.set(answering);
    }

    /// Whether the engine's gRPC server answers (`None` outside sidecar mode).
    pub fn engine_answers(&self) -> Option<bool> {
        self.engine.get().map(|a| a.load(Ordering::Relaxed))
    }

    /// SERVING: the event feed is healthy (below) and, in sidecar mode, the engine answers.
    pub fn serving(&self, grace: Duration) -> bool {
        self.engine_answers().unwrap_or(true) && self.feed_serving(grace)
    }

    /// The event feed is healthy: a publisher is connected, or start-up / the last disconnect
    /// is within `grace`.
    pub fn feed_serving(&self, grace: Duration) -> bool {
        if self.connected_ranks() > 0 {
            return true;
        }
        let now = self.start.elapsed();
        let since = match self.last_disconnect_ms.load(Ordering::Relaxed) {
            0 => now,
            ms => now.saturating_sub(Duration::from_millis(ms - 1)),
        };
        since < grace
    }
}

/// Health's series.
#[derive(Clone)]
pub struct HealthMetrics {
    /// Health status served on grpc.health.v1 (1 SERVING, 0 NOT_SERVING).
    pub serving: prometheus::IntGauge,
}

impl HealthMetrics {
    /// Registers health's series on `m`'s registry.
    pub fn new(m: &Metrics) -> Self {
        HealthMetrics {
            serving: m.gauge(
                "health_serving",
                "grpc.health.v1 status: 1 SERVING, 0 NOT_SERVING",
            ),
        }
    }
}

/// Keeps `reporter` in line with `state` (checked every 100 ms) until the task is aborted.
pub async fn run_reporter(
    reporter: HealthReporter,
    state: Arc<UpstreamState>,
    grace: Duration,
    services: Vec<&'static str>,
    serving_gauge: HealthMetrics,
) {
    let mut last: Option<bool> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let serving = state.serving(grace);
        if last == Some(serving) {
            continue;
        }
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        tracing::info!(
            serving,
            connected_ranks = state.connected_ranks(),
            feed = state.feed_serving(grace),
            engine_answers = ?state.engine_answers(),
            "health status changed"
        );
        reporter.set_service_status("", status).await;
        for s in &services {
            reporter.set_service_status(*s, status).await;
        }
        serving_gauge.serving.set(serving as i64);
        last = Some(serving);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_follows_connections_and_grace() {
        let s = UpstreamState::new(2);
        assert!(s.serving(Duration::from_secs(60)), "start-up grace");
        assert!(!s.serving(Duration::ZERO), "no grace, nothing connected");
        assert_eq!(s.on_connect(1), 1);
        assert!(s.serving(Duration::ZERO));
        assert_eq!(s.on_disconnect(1), 0);
        assert!(s.serving(Duration::from_secs(60)), "grace after disconnect");
        assert!(!s.serving(Duration::ZERO));
        // A stray disconnect never makes the count negative.
        assert_eq!(s.on_disconnect(0), 0);
        assert_eq!(s.on_connect(0), 1);
        assert_eq!(s.connected_ranks(), 1);
        assert_eq!(s.on_connect(7), 0, "unknown rank ignored");
    }

    #[test]
    fn freshness_is_per_rank_and_lists_every_active_cause() {
        let s = UpstreamState::new(2);
        assert!(s.causes(0).is_exact());
        let two = Causes::of(Degraded::UnknownGroup).with(Degraded::MissingHistory);
        assert_eq!(s.set_causes(1, two), Causes::EXACT);
        assert_eq!(
            s.causes(1).labels(),
            ["missing_history", "unknown_group"],
            "neither hides the other"
        );
        assert!(s.causes(0).is_exact(), "the other rank stays exact");
        s.on_connect(0);
        let page = s.detail_json(Duration::ZERO);
        assert!(page.starts_with("{\"serving\":true,"), "{page}");
        assert!(
            page.contains(
                "{\"rank\":0,\"connected\":1,\"freshness\":\"exact\",\"cause\":null,\"causes\":[]}"
            ),
            "{page}"
        );
        assert!(page.contains("{\"rank\":1,\"connected\":0,\"freshness\":\"degraded\",\"cause\":\"missing_history\",\"causes\":[\"missing_history\",\"unknown_group\"]}"), "{page}");
        assert_eq!(s.set_causes(1, Causes::EXACT), two);
        for d in Degraded::ALL {
            assert_eq!(Degraded::from_code(d as u8), Some(d));
            assert_eq!(Causes::of(d).iter().collect::<Vec<_>>(), [d]);
        }
        assert_eq!(
            s.set_causes(9, Causes::of(Degraded::LostRemoval)),
            Causes::EXACT,
            "unknown rank ignored"
        );
    }

    #[test]
    fn sidecar_serving_needs_the_engine_too() {
        let s = UpstreamState::new(1);
        s.on_connect(0);
        assert_eq!(s.engine_answers(), None);
        let engine = Arc::new(AtomicBool::new(false));
        s.gate_on_engine(engine.clone());
        assert!(!s.serving(Duration::ZERO), "engine silent");
        engine.store(true, Ordering::Relaxed);
        assert!(s.serving(Duration::ZERO));
        s.on_disconnect(0);
        assert!(!s.serving(Duration::ZERO), "feed down");
    }
}
