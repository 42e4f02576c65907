//! The gRPC edge's settings: what `--grpc`, `--dp-mode`, `--send-dp-rank`, `--profile`,
//! `--max-subscribers`, `--max-streams-per-connection`, `--handshake-timeout-ms` and `--fanout-linger` (or the TOML
//! file) resolve to, and their defaults and limits. The edge owns them; `crate::config` only
//! parses and validates the flags into them.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::decode::Profile;

/// Default gRPC listen address (docs/smg-api.md: the worker's KV-event port).
pub const DEFAULT_GRPC: &str = "127.0.0.1:50061";
/// Default subscriber limit.
pub const DEFAULT_MAX_SUBSCRIBERS: usize = 10_000;
/// Default HTTP/2 stream limit per gRPC connection: far above what a gateway opens (SMG opens one
/// `SubscribeKvEvents` stream per worker on its connection to that worker), far below what would
/// let one connection pin much memory.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 100;
/// Default time a gRPC connection has to complete TLS and send the HTTP/2 preface and SETTINGS.
pub const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Default `--fanout-linger`: how long a stream's ready records wait for more before they are
/// written together. Chosen from measurement (docs/performance.md, "Bounded batching").
pub const DEFAULT_FANOUT_LINGER: Duration = Duration::from_millis(2);
/// Longest `--fanout-linger` accepted.
pub const MAX_FANOUT_LINGER: Duration = Duration::from_secs(1);
/// Longest handshake timeout accepted (ms).
pub const MAX_HANDSHAKE_TIMEOUT_MS: u64 = 600_000;

/// How multiple DP ranks are exposed (docs/smg-api.md §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DpMode {
    /// (a) All ranks feed one ring with one counter; `dp_rank` unset unless `--send-dp-rank`.
    #[default]
    Merged,
    /// (b) As merged, plus one ring per rank, selected by the `kvbridge-dp-rank` request header.
    Metadata,
}

/// The validated streaming settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FanoutConfig {
    /// gRPC listen address.
    pub grpc: SocketAddr,
    /// Multi-rank mode.
    pub dp_mode: DpMode,
    /// Send `dp_rank` on the merged stream.
    pub send_dp_rank: bool,
    /// Filter profile: what of the engines' events the records (hence the streams) carry.
    pub profile: Profile,
    /// Subscriber limit.
    pub max_subscribers: usize,
    /// HTTP/2 max concurrent streams per connection.
    pub max_streams_per_connection: u32,
    /// Time a gRPC connection has to complete TLS and send the HTTP/2 preface and SETTINGS.
    pub handshake_timeout: Duration,
    /// How long a stream's ready records wait for more before they are written together.
    pub linger: Duration,
}
