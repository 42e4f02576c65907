//! Model check of the publish / read / lap protocol with loom.
//!
//! RUSTFLAGS="--cfg loom" cargo test -p kvbridge-shm --release --test loom
//!
//! One writer appends to a 128-byte ring whose records are 56 bytes, so the
//! third record already overwrites the first: laps happen in most schedules.
//! Two readers read concurrently. For every interleaving (and every stale
//! value the memory model allows for our orderings) loom checks:
//! * no torn read: a record accepted (validated, then `intact` after reading
//!   the payload) has exactly the header, metadata and payload written for
//!   its sequence number;
//! * every lap is reported, never spurious: a reader's position only moves
//!   by +1 on a record or to `resume_at` on `Lapped`, and `Lapped` is only
//!   reported for a number the writer had really retired (`oldest > want`);
//! * sequence numbers are strictly monotonic per reader;
//! * a ring nobody corrupts never yields `Corrupt`: every failed check, and
//!   every checksum computed over bytes the writer was overwriting, is
//!   classified as a lap (the checksum is checked after the intactness check
//!   that tells "overwritten" from "changed by someone else").
#![cfg(loom)]

use kvbridge_shm::layout::RECORD_HEADER_LEN;
use kvbridge_shm::protocol::{record_crc, Read, RecordMeta, Ring, WriterCursor};
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;

const CAP: u64 = 128;
const SLOTS: u64 = 4;

struct Shared {
    cursors: [AtomicU64; 5], // tail, newest, intent, oldest, head
    index: Vec<AtomicU64>,
    data: Vec<AtomicU64>,
}

impl Shared {
    fn new() -> Shared {
        Shared {
            cursors: [
                AtomicU64::new(0),
                AtomicU64::new(0), // newest = seq_base - 1
                AtomicU64::new(0),
                AtomicU64::new(1), // oldest = seq_base
                AtomicU64::new(0),
            ],
            index: (0..SLOTS).map(|_| AtomicU64::new(u64::MAX)).collect(),
            data: (0..CAP / 8).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    fn ring(&self) -> Ring<'_> {
        Ring {
            cap: CAP,
            slots: SLOTS,
            max_payload: 8,
            tail: &self.cursors[0],
            newest: &self.cursors[1],
            intent: &self.cursors[2],
            oldest: &self.cursors[3],
            head: &self.cursors[4],
            index: &self.index,
            data: &self.data,
        }
    }
}

fn meta_for(seq: u64) -> RecordMeta {
    RecordMeta {
        dp_rank: seq as u32 + 10,
        upstream_seq: seq * 100,
        flags: seq as u32 + 20,
        ingest_ns: seq * 1000,
        upstream_digest: 0,
    }
}

fn payload_for(seq: u64) -> u64 {
    0xABCD_0000 + seq
}

fn new_cursor() -> WriterCursor {
    WriterCursor {
        tail: 0,
        head: 0,
        oldest: 1,
        intent: 0,
        next_seq: 1,
    }
}

fn writer(s: &Shared, cur: &mut WriterCursor, n: u64) {
    let ring = s.ring();
    let cur = cur;
    for _ in 0..n {
        let slot = ring.reserve(cur, 8);
        let p = slot.start + RECORD_HEADER_LEN as u64;
        ring.data_word(p)
            .store(payload_for(slot.seq), Ordering::Relaxed);
        let meta = meta_for(slot.seq);
        let crc = record_crc(slot.seq, 8, &meta, &payload_for(slot.seq).to_le_bytes());
        ring.commit(cur, slot, meta, crc);
    }
}

fn reader(s: &Shared, attempts: usize) {
    let ring = s.ring();
    let mut want = 1u64;
    let mut last_accepted = 0u64;
    for _ in 0..attempts {
        match ring.read(want) {
            Read::Record {
                pos,
                len,
                meta,
                crc,
            } => {
                assert_eq!(len, 8);
                assert_eq!(meta, meta_for(want), "torn header/metadata");
                let v = ring
                    .data_word(pos + RECORD_HEADER_LEN as u64)
                    .load(Ordering::Relaxed);
                let crc_ok = record_crc(want, len, &meta, &v.to_le_bytes()) == crc;
                match ring.verify(want, pos, crc_ok) {
                    Ok(()) => {
                        assert_eq!(v, payload_for(want), "torn payload accepted");
                        assert!(want > last_accepted, "not monotonic");
                        last_accepted = want;
                        want += 1;
                    }
                    Err(Read::Lapped { resume_at }) => {
                        // Overwritten while checksummed: the retirement must be visible.
                        assert!(resume_at > want);
                        assert!(ring.oldest.load(Ordering::Acquire) > want);
                        want = resume_at;
                    }
                    Err(other) => panic!("record {want}: {other:?} (nothing corrupts this ring)"),
                }
            }
            Read::Empty => loom::thread::yield_now(),
            Read::Lapped { resume_at } => {
                assert!(resume_at > want);
                assert!(
                    ring.oldest.load(Ordering::Acquire) > want,
                    "spurious lap report for {want}"
                );
                assert!(resume_at <= ring.newest.load(Ordering::Acquire) + 1);
                want = resume_at;
            }
            Read::Corrupt { .. } => panic!("record {want} reported corrupt in an intact ring"),
        }
    }
}

/// `prefill` records are written before the readers start (not explored),
/// `live` more while they run.
fn model(prefill: u64, live: u64, readers: &'static [usize], preemptions: usize) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(move || {
        let s = Arc::new(Shared::new());
        let mut cur = new_cursor();
        writer(&s, &mut cur, prefill);
        let hs: Vec<_> = readers
            .iter()
            .map(|&attempts| {
                let s = s.clone();
                loom::thread::spawn(move || reader(&s, attempts))
            })
            .collect();
        writer(&s, &mut cur, live);
        for h in hs {
            h.join().unwrap();
        }
        // Final state: every record published, the first one retired by the lap.
        let ring = s.ring();
        assert_eq!(ring.newest.load(Ordering::SeqCst), prefill + live);
        assert!(ring.oldest.load(Ordering::SeqCst) >= 2);
    });
}

/// Writer + one reader, deeper preemption bound.
#[test]
fn one_reader_deep() {
    model(0, 3, &[3], 2);
}

/// Writer + two readers (the protocol's multi-reader case).
#[test]
fn two_readers() {
    model(2, 1, &[1, 1], 1);
}

/// Writer laps a reader that is already mid-stream (two overwrites).
#[test]
fn one_reader_mid_stream_laps() {
    model(2, 2, &[3], 1);
}
