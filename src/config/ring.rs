//! The ring: its file, size and numbering, validated into the ring's settings ([`RingConfig`]).

use std::path::PathBuf;

use serde::Deserialize;

use super::values::ByteSize;
use super::{invalid, ConfigError, Merge};
use crate::ring::{
    RingConfig, DEFAULT_RING_SIZE, DEFAULT_SPLIT_THRESHOLD, MAX_RING_SIZE, MAX_SPLIT_THRESHOLD,
    MIN_RING_SIZE, MIN_SPLIT_THRESHOLD,
};

concern! {
    /// The ring: its file, size and numbering.
    #[command(next_help_heading = "Ring")]
    pub struct RingArgs {
        /// Ring file.
        #[arg(long, value_name = "PATH")]
        pub shm: Option<PathBuf>,
        /// Ring data size, e.g. `64MiB`, `1048576`.
        #[arg(long, value_name = "BYTES")]
        pub ring_size: Option<ByteSize>,
        /// First sequence number of a brand-new ring.
        #[arg(long, value_name = "N")]
        pub seq_base: Option<u64>,
        /// Engine batches encoding above this become several records, each under 4MiB.
        #[arg(long, value_name = "BYTES")]
        pub split_threshold: Option<ByteSize>,
        /// Make the ring file group-readable (0640 instead of 0600).
        #[arg(long)]
        pub shm_group_read: bool,
    }
}

impl RingArgs {
    pub(super) fn validate(self) -> Result<RingConfig, ConfigError> {
        let ring_size = match &self.ring_size {
            Some(s) => s.bytes("ring-size")?,
            None => DEFAULT_RING_SIZE,
        };
        if ring_size < MIN_RING_SIZE {
            return Err(invalid(format!(
                "--ring-size {ring_size}: must be at least 1MiB ({MIN_RING_SIZE})"
            )));
        }
        if ring_size > MAX_RING_SIZE {
            return Err(invalid(format!(
                "--ring-size {ring_size}: must be at most 1TiB"
            )));
        }
        let split_threshold = match &self.split_threshold {
            Some(s) => s.bytes("split-threshold")?,
            // Small rings (tests) get a proportionally smaller default.
            None => DEFAULT_SPLIT_THRESHOLD.min(ring_size / 4),
        };
        if !(MIN_SPLIT_THRESHOLD..=MAX_SPLIT_THRESHOLD).contains(&split_threshold) {
            return Err(invalid(format!(
                "--split-threshold {split_threshold}: must be between {MIN_SPLIT_THRESHOLD} and {MAX_SPLIT_THRESHOLD} (records stay under gRPC's 4 MiB limit)"
            )));
        }
        if split_threshold > ring_size / 4 {
            return Err(invalid(format!(
                "--split-threshold {split_threshold}: must be at most a quarter of --ring-size ({ring_size})"
            )));
        }
        if self.seq_base == Some(0) {
            return Err(invalid(
                "--seq-base: sequence numbers start at 1 (0 is never sent)",
            ));
        }
        Ok(RingConfig {
            shm: self.shm,
            size: ring_size,
            seq_base: self.seq_base,
            split_threshold,
            group_read: self.shm_group_read,
        })
    }
}
