//! Snapshots for late joiners, validated into the snapshot edge's settings
//! ([`crate::snapshot::SnapshotConfig`]).

use std::time::Duration;

use serde::Deserialize;

use super::values::{parse_duration, ByteSize};
use super::{invalid, ConfigError, Merge};
use crate::ring::MAX_SPLIT_THRESHOLD;

concern! {
    /// Snapshots for late joiners (docs/smg-api.md §6.5).
    #[command(next_help_heading = "Snapshots")]
    pub struct SnapshotArgs {
        /// When a subscriber starting from 0 gets the live block table as snapshot chunks.
        #[arg(long, value_enum)]
        pub snapshot: Option<crate::snapshot::SnapshotMode>,
        /// Most blocks the table holds per ring; beyond, snapshots are marked incomplete.
        #[arg(long, value_name = "N")]
        pub snapshot_max_blocks: Option<usize>,
        /// Largest snapshot chunk (4KiB to 4MiB − 64KiB).
        #[arg(long, value_name = "BYTES")]
        pub snapshot_chunk_size: Option<ByteSize>,
        /// Least time between two checkpoints of the table beside the ring when the ring is not
        /// about to lap the last one (1s to 7d, e.g. 90s, 5m).
        #[arg(long, value_name = "DURATION")]
        pub checkpoint_interval: Option<String>,
    }
}

impl SnapshotArgs {
    pub(super) fn validate(self) -> Result<crate::snapshot::SnapshotConfig, ConfigError> {
        let max_blocks = self
            .snapshot_max_blocks
            .unwrap_or(crate::snapshot::DEFAULT_MAX_BLOCKS);
        if max_blocks == 0 {
            return Err(invalid(
                "--snapshot-max-blocks: must be at least 1 (use --snapshot off for no table)",
            ));
        }
        let chunk = match &self.snapshot_chunk_size {
            Some(s) => s.bytes("snapshot-chunk-size")?,
            None => crate::snapshot::CHUNK_MAX as u64,
        };
        if !(crate::snapshot::CHUNK_MIN as u64..=MAX_SPLIT_THRESHOLD).contains(&chunk) {
            return Err(invalid(format!(
                "--snapshot-chunk-size {chunk}: must be between {} and {MAX_SPLIT_THRESHOLD} bytes",
                crate::snapshot::CHUNK_MIN
            )));
        }
        let checkpoint_interval = match &self.checkpoint_interval {
            None => crate::snapshot::DEFAULT_CHECKPOINT_INTERVAL,
            Some(t) => {
                parse_duration(t).map_err(|e| invalid(format!("--checkpoint-interval: {e}")))?
            }
        };
        if checkpoint_interval > Duration::from_secs(7 * 86_400) {
            return Err(invalid(format!(
                "--checkpoint-interval {}: at most 7d",
                self.checkpoint_interval.as_deref().unwrap_or_default()
            )));
        }
        Ok(crate::snapshot::SnapshotConfig {
            mode: self.snapshot.unwrap_or_default(),
            max_blocks,
            chunk_bytes: chunk as usize,
            checkpoint_interval,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::flags;

    #[test]
    fn the_checkpoint_interval_is_a_duration_from_1s_to_7d() {
        let interval = |extra: &[&str]| {
            let mut a = vec!["--zmq", "tcp://*:5557"];
            a.extend(extra);
            flags(&a).resolve().map(|c| c.snapshot.checkpoint_interval)
        };
        assert_eq!(interval(&[]).unwrap(), Duration::from_secs(60));
        assert_eq!(
            interval(&["--checkpoint-interval", "90s"]).unwrap(),
            Duration::from_secs(90)
        );
        assert_eq!(
            interval(&["--checkpoint-interval", "7d"]).unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        for bad in ["0", "1w", "8d", "soon"] {
            let err = interval(&["--checkpoint-interval", bad]).unwrap_err();
            assert!(
                err.to_string().starts_with("--checkpoint-interval"),
                "{bad}: {err}"
            );
        }
    }
}
