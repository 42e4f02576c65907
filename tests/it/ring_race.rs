//! Several ranks feed one merged ring: some publish engine batches, others in-band clears (an
//! engine restart clears every rank at once, so this race is routine). Every record must become
//! visible in order: `newest` never moves backwards (each publisher sees at least its own last
//! record as newest after publishing), never lags the writer once the publishers are done, and
//! the most recent records are all served from the cache — otherwise a subscriber waiting for
//! the next record stalls until some later publish.
//!
//! Eight publishers on a two-core machine get preempted at arbitrary points, including between
//! a commit and the hand-off to subscribers, which is where a publish path that lets go of the
//! writer lock too early goes wrong.

use std::sync::{Arc, Barrier};

use kvbridge::decode::{ClearedBatch, DecodeConfig, Decoder};
use kvbridge::metrics::Metrics;
use kvbridge::ring::{ClearCause, Published, RingHub};
use kvbridge_shm::{RecordMeta, WriterOptions};
use kvbridge_tools::sim::{encode_batch, Layout, SimEvent};

const ROUNDS: u64 = 250_000;
const PUBLISHERS: u64 = 8;

/// Publishes `ROUNDS` records (engine batches when `batches`, else clears) as `rank`, checking
/// after each that `newest` has not fallen below the record just published.
fn publisher(hub: Arc<RingHub>, start: Arc<Barrier>, rank: u32, batches: bool) {
    let mut dec = Decoder::new(DecodeConfig::default());
    let payload = encode_batch(
        Layout::Vllm0102,
        1.0,
        &[SimEvent::Stored {
            hashes: vec![7],
            parent: None,
            tokens: vec![1, 2],
            block_size: 2,
            medium: None,
        }],
        0,
    );
    start.wait();
    for seq in 0..ROUNDS {
        let p: Published = if batches {
            let meta = RecordMeta {
                dp_rank: rank,
                upstream_seq: seq,
                flags: 0,
                ingest_ns: 1,
                upstream_digest: 0,
            };
            let plan = dec.plan(&payload).unwrap();
            hub.publish(&dec.planned(&plan, &payload), None, meta)
                .unwrap()
        } else {
            let meta = ClearCause::EngineRestart.meta(rank, seq);
            hub.publish(&ClearedBatch::new(1.0), None, meta).unwrap()
        };
        assert_eq!(p.records, 1);
        let newest = hub.newest();
        assert!(
            newest >= p.last_seq,
            "rank {rank}: published {} but newest is {newest}",
            p.last_seq
        );
    }
}

#[test]
fn clears_racing_batches_keep_newest_and_cache_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let opts = WriterOptions {
        capacity: 4 << 20,
        seq_base: Some(1),
        group_read: false,
    };
    let metrics = kvbridge::ring::RingMetrics::new(&Metrics::new());
    let (hub, _) = RingHub::open("merged", &dir.path().join("ring"), &opts, &metrics).unwrap();
    let start = Arc::new(Barrier::new(PUBLISHERS as usize));
    let threads: Vec<_> = (0..PUBLISHERS as u32)
        .map(|rank| {
            let (hub, start) = (hub.clone(), start.clone());
            std::thread::spawn(move || publisher(hub, start, rank, rank % 2 == 0))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (_, n) = hub.window();
    assert_eq!(n, PUBLISHERS * ROUNDS, "every record numbered once");
    assert_eq!(hub.newest(), n, "newest lags the ring's newest record");
    for seq in n - 100..=n {
        assert!(
            hub.cached_at(seq).is_some(),
            "record {seq} missing from the cache"
        );
    }
}
