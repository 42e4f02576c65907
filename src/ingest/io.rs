//! A rank's sockets and settings: what the receive loop (`rank.rs`) and the replay client
//! (`replay.rs`) share. Apart from both, so that each depends on it and neither on the other.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::metrics::RankMetrics;
use super::RankEndpoint;

/// A rank's sockets and settings: what the receive loop and the replay client share.
pub(super) struct RankIo {
    pub(super) rank: RankEndpoint,
    pub(super) ctx: zmq::Context,
    pub(super) sub: zmq::Socket,
    pub(super) topic: Vec<u8>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) replay_timeout: Duration,
    /// `ZMQ_MAXMSGSIZE` for the SUB and the replay DEALER.
    pub(super) max_message: i64,
    /// The decoder drops stores without tokens (`--profile smg`): a snapshot of placements
    /// (SGLang #34407's, hashes only) cannot rebuild what consumers hold.
    pub(super) tokens_required: bool,
    pub(super) m: RankMetrics,
}
