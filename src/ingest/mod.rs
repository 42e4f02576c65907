//! Ingest: one ZMQ SUB per engine publisher (= per DP rank), each on its own thread.
//!
//! Follow one batch through the files in this order:
//!
//! 1. `rank.rs` — the rank thread: creates the SUB (and its socket monitor), polls it, receives
//!    `[topic, seq, payload]` into reusable buffers and validates the frames ([`wire`]);
//! 2. [`upstream`] — the per-publisher state machine (docs/engine-wire.md §8): apply, fill a gap
//!    through the engine's replay (`upstream/fill.rs`; the requests go over `replay.rs`, a DEALER
//!    to the engine's ROUTER), or signal a discontinuity in band;
//! 3. `handoff.rs` — ingest's hand-off to the rings ([`upstream::Handoff`]): decodes the batch once ([`crate::decode`]) straight into ring records
//!    ([`crate::ring`]), on the same thread.
//!
//! Nothing downstream runs on a rank thread except that decode-and-commit, so the SUB is drained
//! as fast as the engine publishes (a full ZMQ pipe would make the engine's PUB drop silently).

mod config;
mod handoff;
mod io;
mod metrics;
mod placement;
mod rank;
mod replay;
pub mod upstream;
pub mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use thiserror::Error;

use crate::decode::{DecodeConfig, Decoder};
use crate::health::UpstreamState;
use crate::ring::{Recovered, RingHub};
pub use config::{
    IngestConfig, RankEndpoint, DEFAULT_MAX_ENGINE_MESSAGE, DEFAULT_REPLAY_TIMEOUT_MS,
    MAX_MAX_ENGINE_MESSAGE, MIN_MAX_ENGINE_MESSAGE,
};
use handoff::RingHandoff;
use io::RankIo;
pub use metrics::{IngestMetrics, RankMetrics};
use rank::RankWorker;
pub use upstream::Resume;
use upstream::{Limits, RankState};

/// Set-up failures (reported as one line, exit code 2).
#[derive(Debug, Error)]
pub enum IngestError {
    /// A socket could not be created or configured.
    #[error("rank {rank}: {what} {endpoint}: {source}")]
    Socket {
        /// Rank.
        rank: u32,
        /// What was attempted.
        what: &'static str,
        /// Endpoint.
        endpoint: String,
        /// ZMQ error.
        source: zmq::Error,
    },
}

/// The ring(s) a rank publishes into.
#[derive(Clone)]
pub struct Targets {
    /// The merged ring every rank feeds.
    pub merged: Arc<RingHub>,
    /// Send `dp_rank` on the merged ring.
    pub merged_sends_rank: bool,
    /// The rank's own ring (metadata mode).
    pub own: Option<Arc<RingHub>>,
}

/// Running ingest threads.
pub struct Ingest {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Ingest {
    /// Creates every socket (so that a bad endpoint fails here, before anything runs), then
    /// starts one thread per rank. `decode` shapes the records (split threshold, filter
    /// profile); its payload limit is `cfg.max_engine_message`, whatever it says. `recovered`
    /// is what the merged ring already holds: each rank's last batch ([`Resume::from_ring`])
    /// and the KV-cache groups learnt before (the ring's writer notes).
    pub fn start(
        cfg: &IngestConfig,
        decode: DecodeConfig,
        targets: Vec<Targets>,
        recovered: &Recovered,
        metrics: &IngestMetrics,
        upstream: Arc<UpstreamState>,
    ) -> Result<Ingest, IngestError> {
        let ctx = zmq::Context::new();
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for (rank, tgt) in cfg.ranks.iter().zip(targets) {
            let max_message = i64::try_from(cfg.max_engine_message).unwrap_or(i64::MAX);
            let (sub, monitor) = rank::open_sub(&ctx, rank, cfg.topic.as_bytes(), max_message)?;
            let m = metrics.rank(rank.rank);
            // Every clear cause at 0 from the start, so that a rate over it is defined before
            // the first clear (ingest is what inserts them).
            for cause in crate::ring::ClearCause::ALL {
                m.clear_series(cause.label());
            }
            m.input_series(
                &wire::FrameDrop::LABELS,
                &upstream::REPLAY_OUTCOMES,
                &crate::decode::DecodeErrorKind::LABELS,
            );
            let mut decoder = Decoder::new(DecodeConfig {
                // One limit: what ZMQ lets through, the decoder accepts.
                max_payload: cfg.max_engine_message as usize,
                ..decode.clone()
            });
            let groups = handoff::groups_of(&recovered.notes, rank.rank);
            // A ring holding this rank's batches but none of its groups: consumers may hold
            // blocks of groups this process will not know until it sees their stores.
            let groups_complete =
                !(groups.is_empty() && recovered.last_upstream.contains_key(&rank.rank));
            decoder.restore_groups(groups);
            let resume = Resume::from_ring(recovered, rank.rank);
            workers.push(RankWorker {
                state: RankState::new(resume, Limits::default(), m.clone()),
                handoff: RingHandoff::new(
                    rank.rank,
                    decoder,
                    tgt,
                    m.clone(),
                    upstream.clone(),
                    groups_complete,
                ),
                monitor,
                lost_since: None,
                handshake: None,
                probes_done: 0,
                upstream: upstream.clone(),
                io: RankIo {
                    rank: rank.clone(),
                    ctx: ctx.clone(),
                    sub,
                    topic: cfg.topic.as_bytes().to_vec(),
                    stop: stop.clone(),
                    replay_timeout: cfg.replay_timeout,
                    max_message,
                    tokens_required: decode.profile == crate::decode::Profile::Smg,
                    m,
                },
            });
        }
        let threads = workers
            .into_iter()
            .map(|w| {
                std::thread::Builder::new()
                    .name(format!("ingest-rank-{}", w.io.rank.rank))
                    .spawn(move || w.run())
                    .expect("spawn ingest thread")
            })
            .collect();
        Ok(Ingest { stop, threads })
    }

    /// Each rank's freshness as the last kvbridge on this ring left it (the writer notes), in
    /// the shared state and the metrics, with a log line per degraded rank. Called before
    /// anything serves (the `/health` page, the front door), so that no reader ever sees a
    /// rank exact that the ring knows is not.
    pub fn restore_freshness(
        cfg: &IngestConfig,
        recovered: &Recovered,
        metrics: &IngestMetrics,
        upstream: &UpstreamState,
    ) {
        for rank in &cfg.ranks {
            let causes = handoff::causes_of(&recovered.notes, rank.rank);
            upstream.set_causes(rank.rank, causes);
            metrics.rank(rank.rank).set_freshness(causes);
            if !causes.is_exact() {
                tracing::warn!(
                    rank = rank.rank,
                    causes = ?causes.labels(),
                    "rank output degraded (kept in the ring from before this start)"
                );
            }
        }
    }

    /// Stops every rank thread and waits for it (each notices within ~100 ms).
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
    }
}
