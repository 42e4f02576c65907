//! A ring writer alone, for measuring readers without the bridge around them.
//!
//! ```text
//! paced_writer RING RATE SECONDS
//! ```
//!
//! Creates (or replaces) the ring `RING`, prints `ready`, then appends 64-byte records at
//! `RATE` per second for `SECONDS`, each stamped with `ingest_ns` = the clock just before its
//! commit, pacing by sleeping (it leaves the cores to the readers), and removes the ring.
//! Readers started after `ready` (e.g. `floor_waiter`, or `python/bench/bench.py --role shm`)
//! then measure commit → reader for the ring mechanism alone: the futex wake-up and whatever
//! the reader adds.

use kvbridge_shm::{remove_ring, RecordMeta, RingWriter, WriterOptions};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn main() {
    let usage = "usage: paced_writer RING RATE SECONDS";
    let mut args = std::env::args().skip(1);
    let ring = args.next().expect(usage);
    let rate: f64 = args.next().and_then(|s| s.parse().ok()).expect(usage);
    let secs: f64 = args.next().and_then(|s| s.parse().ok()).expect(usage);
    let opts = WriterOptions {
        capacity: 16 << 20,
        seq_base: Some(1),
        group_read: false,
    };
    let mut w = RingWriter::open(ring.as_ref(), &opts).expect("create ring");
    println!("ready");
    std::io::stdout().flush().expect("stdout");
    // 1 µs timer slack (default 50 µs) so that the pacing sleeps end on time.
    // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64, 0u64, 0u64, 0u64) };
    let period = Duration::from_secs_f64(1.0 / rate);
    let n = (rate * secs) as u32;
    let start = Instant::now() + Duration::from_millis(200);
    let mut last_beat = Instant::now();
    for i in 0..n {
        let due = start + period * i;
        if let Some(left) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(left);
        }
        let meta = RecordMeta {
            dp_rank: 0,
            upstream_seq: i as u64,
            flags: 0,
            ingest_ns: now_ns(),
            upstream_digest: 0,
        };
        w.append(&[0x5a; 64], meta).expect("append");
        if last_beat.elapsed() >= Duration::from_millis(100) {
            w.heartbeat().expect("heartbeat");
            last_beat = Instant::now();
        }
    }
    // Let the readers see the last records before the ring goes.
    std::thread::sleep(Duration::from_millis(300));
    drop(w);
    let _ = remove_ring(ring.as_ref());
}
