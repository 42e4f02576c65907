//! Rings for the in-process benches of ingest beside the snapshot table (`benches/snapshot.rs`,
//! `benches/zmq_replay.rs`), set up as `kvbridge serve` sets them up.
//!
//! The ring file lives on tmpfs (`/dev/shm`), where `kvbridge serve` puts it by default. On a
//! disk file system the first write to each fresh page of the (sparse) ring file takes a page
//! fault that reads ahead and zeroes a large folio: 20 ms on one publish, measured on ext4,
//! which is the file system's cost and not kvbridge's.
use std::path::PathBuf;
use std::sync::Arc;

use kvbridge::decode::{DecodeConfig, Decoder};
use kvbridge::metrics::Metrics;
use kvbridge::ring::{RingHub, RingMetrics};
use kvbridge::snapshot::{RingTable, SnapshotConfig, SnapshotMetrics};
use kvbridge_shm::{RecordMeta, WriterOptions};

use crate::sim::{encode_batch, Layout, Rng, SimEvent};

/// Ring metadata of every bench record (rank 0; the values do not matter here).
pub const META: RecordMeta = RecordMeta {
    dp_rank: 0,
    upstream_seq: 1,
    flags: 0,
    ingest_ns: 1,
    upstream_digest: 0,
};

/// A temporary directory on tmpfs (`/dev/shm`), or the system's temporary directory where
/// there is none.
pub fn shm_tempdir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    let b = tempfile::Builder::new()
        .prefix("kvbridge-bench-")
        .to_owned();
    if shm.is_dir() {
        if let Ok(d) = b.tempdir_in(shm) {
            return d;
        }
    }
    b.tempdir().expect("a temporary directory")
}

/// A ring with the snapshot table installed as its publish hook, in its own temporary
/// directory (removed on drop, after the ring).
pub struct TableRing {
    /// The ring, as ingest publishes into it.
    pub hub: Arc<RingHub>,
    /// Its table.
    pub table: Arc<RingTable>,
    /// The registry both report to.
    pub metrics: Metrics,
    /// The ring's series on it (for more rings beside this one).
    pub ring_metrics: RingMetrics,
    /// The ring file.
    pub path: PathBuf,
    dir: tempfile::TempDir,
}

impl TableRing {
    /// Opens a ring of `capacity` bytes named `label` and attaches its table.
    pub fn open(label: &str, capacity: usize) -> TableRing {
        let dir = shm_tempdir();
        let metrics = Metrics::new();
        let ring_metrics = RingMetrics::new(&metrics);
        let opts = WriterOptions {
            capacity,
            seq_base: Some(1),
            group_read: false,
        };
        let path = dir.path().join(label);
        let hub = RingHub::open(label, &path, &opts, &ring_metrics)
            .expect("ring")
            .0;
        let table = RingTable::attach(
            &hub,
            &path,
            false,
            None,
            &[0],
            &SnapshotConfig::default(),
            SnapshotMetrics::new(&metrics),
        );
        TableRing {
            hub,
            table,
            metrics,
            ring_metrics,
            path,
            dir,
        }
    }

    /// Publishes engine payloads (`sim::encode_batch`) through ingest's step
    /// (`RingHub::publish`).
    pub fn publish_all(&self, dec: &mut Decoder, ps: &[Vec<u8>]) {
        for p in ps {
            let plan = dec.plan(p).expect("valid batch");
            self.hub
                .publish(&dec.planned(&plan, p), None, META)
                .expect("publish");
        }
    }

    /// The directory the ring file is in.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}

/// 1,000 prompts of 1,000 blocks of 16 tokens, each a chain from the root: 1,000,000 blocks,
/// the benches' full cache.
pub fn big_payloads() -> Vec<Vec<u8>> {
    let mut rng = Rng::new(3);
    (0..1000)
        .map(|_| chain_store(&mut rng, 1000, 1.7e9))
        .collect()
}

/// One engine batch (vLLM layout) of one store: `blocks` new blocks of 16 random tokens, a chain
/// from the root, stamped `ts`.
pub fn chain_store(rng: &mut Rng, blocks: usize, ts: f64) -> Vec<u8> {
    let hashes: Vec<u64> = (0..blocks).map(|_| rng.next_u64()).collect();
    let tokens: Vec<u32> = (0..blocks * 16)
        .map(|_| rng.range(1, 151_000) as u32)
        .collect();
    let ev = SimEvent::Stored {
        hashes,
        parent: None,
        tokens,
        block_size: 16,
        medium: Some("GPU".into()),
    };
    encode_batch(Layout::Vllm0102, ts, &[ev], 0)
}

/// A ring whose table holds [`big_payloads`] (1,000,000 blocks).
pub fn full_cache_ring(capacity: usize) -> TableRing {
    let r = TableRing::open("merged", capacity);
    r.publish_all(&mut Decoder::new(DecodeConfig::default()), &big_payloads());
    r
}
