//! Ingest's settings: the engine publishers (one per DP rank), the topic, the replay timeout and
//! the largest engine message, as `--zmq`, `--zmq-bind`, `--replay`, `--topic`,
//! `--kv-events-config`, `--replay-timeout-ms` and `--max-engine-message` (or the TOML file)
//! resolve to, and their defaults and limits. Ingest owns them; `crate::config` only parses and
//! validates the flags into them.

use std::time::Duration;

/// Default wait for the first replay reply and between replies (ms).
pub const DEFAULT_REPLAY_TIMEOUT_MS: u64 = 2000;
/// Default largest engine message (ZMQ frame) accepted: 32 MiB. Real batches are far smaller
/// (a 100k-token prefill is about 0.5 MB, docs/engine-wire.md §13; a million tokens in one
/// step about 5 MB), and the cap bounds what one message can cost (about twice its size at
/// peak) and keeps one batch well inside the default ring.
pub const DEFAULT_MAX_ENGINE_MESSAGE: u64 = 32 << 20;
/// Smallest `--max-engine-message` accepted.
pub const MIN_MAX_ENGINE_MESSAGE: u64 = 4096;
/// Largest `--max-engine-message` accepted (the decoder addresses payloads with 32 bits).
pub const MAX_MAX_ENGINE_MESSAGE: u64 = 1 << 30;

/// One engine publisher (one DP rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEndpoint {
    /// Rank index (position in the configuration).
    pub rank: u32,
    /// Endpoint for the SUB (already rewritten from a wildcard when connecting).
    pub endpoint: String,
    /// True: the SUB binds (the engine's PUB connects).
    pub bind: bool,
    /// The engine's replay ROUTER for this rank, if any.
    pub replay: Option<String>,
    /// The engine's snapshot ROUTER for this rank (vLLM #57789, unmerged), if any: used where
    /// the replay cannot fill.
    pub snapshot: Option<String>,
}

/// The validated ingest settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngestConfig {
    /// One entry per DP rank.
    pub ranks: Vec<RankEndpoint>,
    /// ZMQ topic.
    pub topic: String,
    /// Replay reply timeout.
    pub replay_timeout: Duration,
    /// Largest engine message (ZMQ frame) accepted, in bytes; also the decoder's payload limit.
    pub max_engine_message: u64,
}
