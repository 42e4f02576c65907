//! The sink's settings: what `--nats*` (or the TOML file) resolve to, and their defaults. The
//! sink owns them; `crate::config` only parses and validates the flags into them.

use std::path::PathBuf;
use std::time::Duration;

/// Default subject prefix of the NATS sink: records go to `<prefix>.<worker-id>.<rank|merged>`.
pub const DEFAULT_NATS_SUBJECT_PREFIX: &str = "kv";
/// Default JetStream stream name.
pub const DEFAULT_NATS_STREAM: &str = "KV_EVENTS";
/// Default stream replicas: a JetStream cluster of three keeps the stream through one node's loss.
pub const DEFAULT_NATS_REPLICAS: usize = 3;
/// Default stream retention (`max_age`): an hour.
pub const DEFAULT_NATS_MAX_AGE: Duration = Duration::from_secs(3600);

/// The validated NATS sink settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsConfig {
    /// Server URLs.
    pub urls: Vec<String>,
    /// Subject prefix.
    pub subject_prefix: String,
    /// Stream name.
    pub stream: String,
    /// Stream replicas.
    pub replicas: usize,
    /// Stream max age.
    pub max_age: Duration,
    /// Worker id; `None`: `HOSTNAME-GRPCPORT`, decided at start.
    pub worker_id: Option<String>,
    /// Credentials file.
    pub creds: Option<PathBuf>,
    /// CA for TLS.
    pub tls_ca: Option<PathBuf>,
    /// Fail-fast start-up: no NATS, no kvbridge (`--nats-required`).
    pub required: bool,
}

/// Whether `s` is usable as one NATS subject token (and a stream name): non-empty, and only
/// letters, digits, `-` and `_` (no `.`, wildcards or whitespace).
pub fn is_subject_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
