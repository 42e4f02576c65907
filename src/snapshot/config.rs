//! The snapshot edge's settings: what `--snapshot`, `--snapshot-max-blocks`,
//! `--snapshot-chunk-size` and `--checkpoint-interval` (or the TOML file) resolve to. The edge
//! owns them; `crate::config` only parses and validates the flags into them.

use std::time::Duration;

use super::{CHUNK_MAX, DEFAULT_CHECKPOINT_INTERVAL};

/// When a subscriber starting from 0 gets a snapshot (`--snapshot`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SnapshotMode {
    /// When the ring no longer reaches back to the last clear and the client set request
    /// field 2 (`load_records_before_first_batch`: it takes snapshot chunks; G2 gateways do).
    #[default]
    Auto,
    /// Every subscriber starting from 0, whatever the ring holds (operator's choice: G1 clients
    /// that disconnect mid-snapshot resume from a partial state).
    On,
    /// Never: the retained window, as without a table (no table is kept).
    Off,
}

/// Default `--snapshot-max-blocks`.
pub const DEFAULT_MAX_BLOCKS: usize = 4_000_000;

/// Snapshot settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotConfig {
    /// When snapshots are served.
    pub mode: SnapshotMode,
    /// Most blocks a table holds; beyond, snapshots are marked incomplete.
    pub max_blocks: usize,
    /// Largest snapshot chunk in bytes (below gRPC's 4 MiB default).
    pub chunk_bytes: usize,
    /// Least time between two checkpoints not forced by the ring lapping the last one's cut
    /// (`--checkpoint-interval`).
    pub checkpoint_interval: Duration,
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        SnapshotConfig {
            mode: SnapshotMode::Auto,
            max_blocks: DEFAULT_MAX_BLOCKS,
            chunk_bytes: CHUNK_MAX,
            checkpoint_interval: DEFAULT_CHECKPOINT_INTERVAL,
        }
    }
}
