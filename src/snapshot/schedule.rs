//! When a table's checkpoint is rewritten: the checkpoint exists only so that a
//! restart can rebuild the table from checkpoint + ring, so it must be rewritten before the ring
//! laps its cut, and otherwise rarely.
//!
//! * **Lap.** A checkpoint at cut C is usable while the ring still holds record C + 1. That record
//!   starts at byte `start` (the ring's tail when the image was taken, or later), and stays
//!   retained until the ring's tail passes `start + capacity`: the *margin* is
//!   `start + capacity − tail` bytes. A new checkpoint is due when the margin falls below what
//!   the ring writes while one is taken and renamed into place — the measured write rate times
//!   twice the last checkpoint's duration plus a wake-up allowance — plus a quarter of the ring.
//! * **Interval.** Otherwise at most every `--checkpoint-interval` (a floor), and only if the
//!   table changed: it bounds how much ring a restart decodes and how old `tail --snapshot` is.
//! * **Start.** Once at start-up when the file on disk is not exactly the table (new ring, ring
//!   catch-up applied, rebuilt from the ring): its ring position would be unknown otherwise.
//! * **Shutdown.** Once more, if the table changed.
//!
//! Nothing changed, nothing written: the ring moves only by publishing, and every publish
//! changes the table's generation.
use std::time::{Duration, Instant};

use crate::ring::RingPosition;

/// Default `--checkpoint-interval`.
pub const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(60);

/// Time allowed, beyond twice the last checkpoint's duration, between the margin falling below
/// its bound and a checkpoint starting (the checkpoint thread is woken by the publish that
/// crosses it; this covers scheduling delays on a busy host).
const WAKE_ALLOWANCE: Duration = Duration::from_millis(100);

/// The write rate is measured over spans of at least this long.
const RATE_SPAN: Duration = Duration::from_millis(100);

/// Half-life of the measured write rate's decay after a burst (the rate is a decaying peak, so
/// a burst keeps the margin wide for a while).
const RATE_HALF_LIFE: Duration = Duration::from_secs(5);

/// Why a checkpoint is written (the `reason` label of `kvbridge_snapshot_checkpoints_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// At start-up: the file on disk is not exactly the restored table.
    Start,
    /// The ring is about to lap the checkpoint's cut.
    Lap,
    /// The interval passed and the table changed.
    Interval,
    /// At shutdown, the table changed.
    Shutdown,
}

impl Reason {
    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Reason::Start => "start",
            Reason::Lap => "lap",
            Reason::Interval => "interval",
            Reason::Shutdown => "shutdown",
        }
    }
}

/// The checkpoint on disk.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OnDisk {
    /// Its cut.
    pub(crate) cut: u64,
    /// The table's generation in it.
    pub(crate) generation: u64,
    /// Ring byte position at or before the start of record `cut + 1`.
    pub(crate) start: u64,
    /// When its image was taken.
    pub(crate) at: Instant,
}

/// One table's checkpoint schedule.
#[derive(Debug)]
pub(crate) struct Schedule {
    interval: Duration,
    /// The checkpoint on disk (`None`: none the ring position of is known; one is due).
    pub(crate) disk: Option<OnDisk>,
    /// How long the last checkpoint took (image copy + write + rename).
    last_duration: Duration,
    /// Measured ring write rate, bytes per second (a decaying peak).
    rate: f64,
    /// Last rate sample: time and ring tail.
    sample: Option<(Instant, u64)>,
}

impl Schedule {
    /// A schedule with `interval` as its floor; `disk` when the file on disk is exactly the
    /// table at the ring's current tail.
    pub(crate) fn new(interval: Duration, disk: Option<OnDisk>) -> Self {
        Schedule {
            interval,
            disk,
            last_duration: Duration::ZERO,
            rate: 0.0,
            sample: None,
        }
    }

    /// The measured ring write rate in bytes per second.
    pub(crate) fn rate(&self) -> f64 {
        self.rate
    }

    /// Feeds a ring position seen at `now` to the write-rate measurement.
    pub(crate) fn observe(&mut self, now: Instant, pos: &RingPosition) {
        let Some((t0, tail0)) = self.sample else {
            self.sample = Some((now, pos.tail));
            return;
        };
        let dt = now.saturating_duration_since(t0);
        if dt < RATE_SPAN {
            return;
        }
        let inst = pos.tail.saturating_sub(tail0) as f64 / dt.as_secs_f64();
        let decay = 0.5f64.powf(dt.as_secs_f64() / RATE_HALF_LIFE.as_secs_f64());
        self.rate = inst.max(self.rate * decay);
        self.sample = Some((now, pos.tail));
    }

    /// Bytes the ring can still write before it laps the checkpoint's cut (negative: lapped;
    /// `None`: no checkpoint).
    pub(crate) fn margin(&self, pos: &RingPosition) -> Option<i64> {
        let d = self.disk?;
        if d.cut >= pos.newest {
            // nothing written after the cut: a whole ring to go
            return Some(pos.capacity as i64);
        }
        if d.cut + 1 < pos.oldest {
            return Some(-1);
        }
        Some((d.start + pos.capacity) as i64 - pos.tail as i64)
    }

    /// The margin below which a checkpoint is due.
    pub(crate) fn needed(&self, pos: &RingPosition) -> u64 {
        let lead = self.last_duration * 2 + WAKE_ALLOWANCE;
        (self.rate * lead.as_secs_f64()) as u64 + pos.capacity / 4
    }

    /// Whether a checkpoint is due at `now`, and why; `generation` is the table's.
    pub(crate) fn due(
        &self,
        now: Instant,
        pos: &RingPosition,
        generation: u64,
        stopping: bool,
    ) -> Option<Reason> {
        let Some(d) = self.disk else {
            return Some(if stopping {
                Reason::Shutdown
            } else {
                Reason::Start
            });
        };
        if d.generation == generation {
            return None;
        }
        if stopping {
            return Some(Reason::Shutdown);
        }
        let margin = self.margin(pos).unwrap_or(i64::MIN);
        // at most half the time spent checkpointing, even when the ring is too small for the
        // write rate
        let rested = now.saturating_duration_since(d.at) >= self.last_duration;
        if margin < self.needed(pos) as i64 && rested {
            return Some(Reason::Lap);
        }
        (now.saturating_duration_since(d.at) >= self.interval).then_some(Reason::Interval)
    }

    /// The sequence number whose publication should wake the checkpoint thread: about where the
    /// margin will fall below its bound, at the retained window's mean record size (`u64::MAX`:
    /// no wake-up by publication; the margin is below its bound already, see
    /// [`recheck`](Self::recheck), or there is no checkpoint).
    pub(crate) fn wake_at(&self, pos: &RingPosition) -> u64 {
        let Some(margin) = self.margin(pos) else {
            return u64::MAX;
        };
        let spare = margin - self.needed(pos) as i64;
        if spare <= 0 {
            return u64::MAX;
        }
        let records = pos.newest.saturating_sub(pos.oldest) + 1;
        let mean = (pos.used() / records).max(1);
        pos.newest.saturating_add((spare as u64 / mean).max(1))
    }

    /// When the margin is below its bound but a checkpoint waits for the last one's rest: how
    /// long until it may be taken (`None`: no such wait).
    pub(crate) fn recheck(&self, now: Instant, pos: &RingPosition) -> Option<Duration> {
        let d = self.disk?;
        let low = self
            .margin(pos)
            .is_some_and(|m| m < self.needed(pos) as i64);
        low.then(|| {
            (d.at + self.last_duration)
                .saturating_duration_since(now)
                .max(Duration::from_millis(1))
        })
    }

    /// Notes a checkpoint written: `disk`, taking `took`.
    pub(crate) fn written(&mut self, disk: OnDisk, took: Duration) {
        self.disk = Some(disk);
        self.last_duration = took;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: u64 = 1 << 20;

    fn pos(oldest: u64, newest: u64, head: u64, tail: u64) -> RingPosition {
        RingPosition {
            oldest,
            newest,
            head,
            tail,
            capacity: CAP,
        }
    }

    fn disk(cut: u64, generation: u64, start: u64, at: Instant) -> Option<OnDisk> {
        Some(OnDisk {
            cut,
            generation,
            start,
            at,
        })
    }

    #[test]
    fn a_start_checkpoint_is_due_when_none_is_known() {
        let t0 = Instant::now();
        let s = Schedule::new(DEFAULT_CHECKPOINT_INTERVAL, None);
        let p = pos(1, 0, 0, 0);
        assert_eq!(s.due(t0, &p, 0, false), Some(Reason::Start));
        assert_eq!(s.due(t0, &p, 0, true), Some(Reason::Shutdown));
    }

    #[test]
    fn no_change_no_checkpoint_whatever_the_time_or_shutdown() {
        let t0 = Instant::now();
        let s = Schedule::new(Duration::from_secs(1), disk(10, 7, 1000, t0));
        let p = pos(1, 10, 0, 1000);
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(s.due(later, &p, 7, false), None);
        assert_eq!(s.due(later, &p, 7, true), None);
    }

    #[test]
    fn changes_wait_for_the_interval_unless_the_ring_is_about_to_lap() {
        let t0 = Instant::now();
        let s = Schedule::new(Duration::from_secs(60), disk(10, 7, 1000, t0));
        // a little written since the cut: nothing due before the interval
        let p = pos(1, 20, 0, 5000);
        assert_eq!(s.due(t0 + Duration::from_secs(59), &p, 8, false), None);
        assert_eq!(
            s.due(t0 + Duration::from_secs(60), &p, 8, false),
            Some(Reason::Interval)
        );
        assert_eq!(
            s.due(t0 + Duration::from_secs(1), &p, 8, true),
            Some(Reason::Shutdown)
        );
        // three quarters of the ring written since the cut: due at once
        let p = pos(1, 900, 0, 1000 + CAP * 3 / 4 + 1);
        assert_eq!(s.due(t0, &p, 8, false), Some(Reason::Lap));
        // lapped already: still due (and the margin says so)
        let p = pos(12, 2000, 2000, 1000 + CAP + 10);
        assert_eq!(s.margin(&p), Some(-1));
        assert_eq!(s.due(t0, &p, 8, false), Some(Reason::Lap));
    }

    #[test]
    fn the_margin_grows_with_the_write_rate_and_the_checkpoint_duration() {
        let t0 = Instant::now();
        let mut s = Schedule::new(Duration::from_secs(60), disk(10, 7, 0, t0));
        let p0 = pos(1, 10, 0, 0);
        assert_eq!(s.needed(&p0), CAP / 4);
        s.observe(t0, &p0);
        // 1 MiB/s for a second
        let p1 = pos(1, 1000, 0, CAP);
        s.observe(t0 + Duration::from_secs(1), &p1);
        assert!((s.rate() - CAP as f64).abs() < 1.0, "{}", s.rate());
        s.written(disk(10, 7, 0, t0).unwrap(), Duration::from_millis(200));
        // 2 × 200 ms + 100 ms at 1 MiB/s, plus a quarter
        let want = CAP / 2 + CAP / 4;
        assert!(s.needed(&p1).abs_diff(want) < 16, "{}", s.needed(&p1));
        // the rate decays by half over a quiet half-life
        s.observe(t0 + Duration::from_secs(6), &p1);
        assert!((s.rate() - CAP as f64 / 2.0).abs() < 1.0, "{}", s.rate());
    }

    #[test]
    fn the_wake_up_lands_where_the_margin_reaches_its_bound() {
        let t0 = Instant::now();
        let s = Schedule::new(Duration::from_secs(60), disk(100, 7, 100_000, t0));
        // 1,000 retained records of 100 bytes; cut record 101 starts at 100,000
        let p = pos(1, 1000, 0, 100_000);
        let margin = CAP as i64;
        assert_eq!(s.margin(&p), Some(margin));
        let spare = margin as u64 - CAP / 4;
        assert_eq!(s.wake_at(&p), 1000 + spare / 100);
        assert_eq!(s.recheck(t0, &p), None);
        // below the bound: no wake-up by publication, a recheck instead
        let p = pos(1, 1000, 0, 100_000 + CAP * 3 / 4 + 1);
        assert_eq!(s.wake_at(&p), u64::MAX);
        assert!(s.recheck(t0, &p).is_some());
        assert_eq!(
            Schedule::new(Duration::from_secs(60), None).wake_at(&p),
            u64::MAX
        );
    }

    #[test]
    fn a_ring_too_small_for_the_rate_gets_at_most_half_the_time() {
        let t0 = Instant::now();
        let mut s = Schedule::new(Duration::from_secs(60), None);
        s.written(disk(10, 7, 0, t0).unwrap(), Duration::from_millis(300));
        let p = pos(5, 900, 0, CAP);
        assert_eq!(s.due(t0 + Duration::from_millis(100), &p, 8, false), None);
        assert_eq!(
            s.due(t0 + Duration::from_millis(300), &p, 8, false),
            Some(Reason::Lap)
        );
    }
}
