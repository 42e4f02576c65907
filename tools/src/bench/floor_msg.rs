//! The floor's messages, shared by its senders (`floor.rs`, `floor_h2.rs`) and its receivers: a
//! header of batch number and scheduled send time, the clock that paces the sends, and what a
//! receiving connection counts. A leaf, so the two sender files do not import each other.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Size of a message's header: batch number and scheduled send time.
pub(super) const HEADER: usize = 16;

pub(super) fn stamp(msg: &mut [u8], seq: u64, scheduled: f64) {
    msg[..8].copy_from_slice(&seq.to_le_bytes());
    msg[8..16].copy_from_slice(&scheduled.to_le_bytes());
}

/// Sleeps until each batch is due (no spinning: spinning would be charged to the floor) and
/// calls `send(seq, scheduled unix seconds)`.
pub(super) fn clocked(
    rate: u64,
    run: Duration,
    mut send: impl FnMut(u64, f64) -> Result<(), String>,
) -> Result<(), String> {
    super::fine_timer_slack();
    let start = Instant::now();
    let wall0 = kvbridge::clock::unix_seconds();
    let period_ns = 1e9 / rate.max(1) as f64;
    for i in 0u64.. {
        let offset = Duration::from_nanos((i as f64 * period_ns) as u64);
        if offset > run {
            break;
        }
        let due = start + offset;
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        send(i, wall0 + offset.as_secs_f64())?;
    }
    Ok(())
}

/// What one receiving connection saw.
pub(super) struct Received {
    pub(super) delivered: u64,
    pub(super) lost: u64,
    last: Option<u64>,
    pub(super) hist: Histogram<u64>,
}

impl Received {
    pub(super) fn new() -> Received {
        Received {
            delivered: 0,
            lost: 0,
            last: None,
            hist: Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("bounds"),
        }
    }

    /// One message (its batch number and scheduled send time first), received at `now`,
    /// counted if `measuring`.
    pub(super) fn note(&mut self, m: &[u8], now: f64, measuring: bool) {
        let seq = u64::from_le_bytes(m[..8].try_into().expect("8 bytes"));
        let ts = f64::from_le_bytes(m[8..16].try_into().expect("8 bytes"));
        if measuring {
            self.delivered += 1;
            self.lost += self.last.map_or(0, |l| seq.saturating_sub(l + 1));
            let _ = self.hist.record((((now - ts) * 1e9).max(1.0)) as u64);
        }
        self.last = Some(seq);
    }
}
