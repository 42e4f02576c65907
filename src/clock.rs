//! Wall-clock helpers shared by every stage (record ingest times, synthesized timestamps).

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall clock in seconds (timestamps of synthesized batches).
pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Wall clock in nanoseconds (record ingest time).
pub fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
