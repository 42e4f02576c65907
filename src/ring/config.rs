//! The ring's settings: what `--shm`, `--ring-size`, `--seq-base`, `--split-threshold` and
//! `--shm-group-read` (or the TOML file) resolve to, and their defaults and limits. The ring owns
//! them; `crate::config` only parses and validates the flags into them.

use std::path::PathBuf;

/// Default ring size: 64 MiB.
pub const DEFAULT_RING_SIZE: u64 = 64 << 20;
/// Smallest ring accepted (tests use small rings).
pub const MIN_RING_SIZE: u64 = 1 << 20;
/// Largest ring accepted: 1 TiB.
pub const MAX_RING_SIZE: u64 = 1 << 40;
/// Default split threshold for one record (docs/smg-api.md §6.3).
pub const DEFAULT_SPLIT_THRESHOLD: u64 = 1 << 20;
/// Smallest split threshold accepted.
pub const MIN_SPLIT_THRESHOLD: u64 = 4096;
/// Records must stay below gRPC's default 4 MiB message limit (G1 gateways).
pub const MAX_SPLIT_THRESHOLD: u64 = (4 << 20) - 64 * 1024;

/// The validated ring settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Ring file given with `--shm`; see [`RingConfig::ring_path`].
    pub shm: Option<PathBuf>,
    /// Ring data size in bytes.
    pub size: u64,
    /// First number of a brand-new ring.
    pub seq_base: Option<u64>,
    /// Record split threshold in bytes.
    pub split_threshold: u64,
    /// Ring file mode 0640 instead of 0600.
    pub group_read: bool,
}

impl RingConfig {
    /// The ring file: `--shm`, else `/dev/shm/kvbridge-<grpc_port>` where `grpc_port` is the
    /// port gRPC is bound to (so that `--grpc …:0` still gives each bridge a ring of its own).
    pub fn ring_path(&self, grpc_port: u16) -> PathBuf {
        self.shm
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("/dev/shm/kvbridge-{grpc_port}")))
    }
}
