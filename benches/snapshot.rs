//! The snapshot table's cost (issue 10), each against a baseline measured in the same run:
//!
//! * `ingest/decode` vs `ingest/decode+table`: 2,000 engine batches of the serving mix
//!   (`sim::Workload`: prefill stores, decode-time single-block stores, eviction sweeps) decoded
//!   and written into a buffer as the ring would, each record also copied into the shared
//!   `Bytes` the ring keeps for live subscribers (the ring does that with or without a table),
//!   without and with the table update (which copies new blocks out of those records).
//! * `publish/ring` vs `publish/ring+table`: the same batches published through the service's
//!   real ingest step, `RingHub::publish` into a shared-memory ring (record checksum, commit,
//!   the live-subscriber cache, metrics), without and with the snapshot table installed as the
//!   ring's hook (`RingTable`, as `kvbridge serve` does by default). This is the cost the table
//!   adds to ingest; `ingest/*` isolates it against the decoder alone.
//! * `snapshot_1m/image` and `snapshot_1m/chunks`: a table of 1,000,000 blocks of 16 tokens:
//!   the image copy (the only part done under the table lock, so the longest ingest can wait
//!   for a snapshot) and the whole build (image, parents-first order, 1 MiB chunks: every chunk
//!   is built before the first is sent, so this is the time to the first chunk). Bytes per block
//!   are printed once.
//!
//! `cargo bench --bench snapshot -- --warm-up-time 1 --measurement-time 3`
use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kvbridge::decode::{DecodeConfig, Decoder, RecordHeader};
use kvbridge::metrics::Metrics;
use kvbridge::ring::RingHub;
use kvbridge::sim::{encode_batch, Layout, Rng, SimEvent, Workload};
use kvbridge::snapshot::{RingTable, SnapshotConfig, SnapshotMetrics, Table, CHUNK_MAX};
use kvbridge_shm::{RecordMeta, WriterOptions};

fn payloads(n: usize) -> Vec<Vec<u8>> {
    let mut w = Workload::new(7);
    (0..n)
        .map(|_| encode_batch(Layout::Vllm0102, 1.7e9, &w.next_batch(), 0))
        .collect()
}

/// Decodes every payload and writes its records into `out` and into shared `Bytes` (the ring's
/// part of ingest); with `table`, also applies each batch to it. Returns the events seen.
fn ingest(dec: &mut Decoder, ps: &[Vec<u8>], out: &mut [u8], mut table: Option<&mut Table>) -> u64 {
    let mut seq = 1u64;
    let mut events = 0u64;
    let mut records: Vec<Bytes> = Vec::new();
    for p in ps {
        let plan = dec.plan(p).expect("valid batch");
        records.clear();
        for i in 0..plan.records {
            let hdr = RecordHeader {
                sequence_number: seq,
                first_event_id: 1,
                dp_rank: None,
            };
            let len = dec.record_len(i, &hdr);
            dec.write_record(p, i, &hdr, &mut out[..len]);
            records.push(Bytes::copy_from_slice(&out[..len]));
            events += dec.record_events(i);
            seq += 1;
        }
        if let Some(t) = table.as_deref_mut() {
            t.apply(&dec.planned(&plan, p), &records, 0, seq - 1);
        }
    }
    events
}

fn bench_ingest(c: &mut Criterion) {
    let ps = payloads(2000);
    let mut out = vec![0u8; 4 << 20];
    let mut dec = Decoder::new(DecodeConfig::default());
    let events = ingest(&mut dec, &ps, &mut out, None);
    println!(
        "ingest: {} batches, {events} events per iteration",
        ps.len()
    );
    let mut g = c.benchmark_group("ingest");
    g.bench_function("decode", |b| {
        b.iter(|| black_box(ingest(&mut dec, &ps, &mut out, None)))
    });
    let mut table = Table::new(usize::MAX, 1);
    g.bench_function("decode+table", |b| {
        b.iter(|| black_box(ingest(&mut dec, &ps, &mut out, Some(&mut table))))
    });
    g.finish();
}

/// Plans and publishes every payload into `hub`. Returns the records published.
fn publish(dec: &mut Decoder, ps: &[Vec<u8>], hub: &RingHub) -> u64 {
    let mut records = 0;
    for p in ps {
        let plan = dec.plan(p).expect("valid batch");
        let meta = RecordMeta {
            dp_rank: 0,
            upstream_seq: 1,
            flags: 0,
            ingest_ns: 1,
        };
        let out = hub
            .publish(&dec.planned(&plan, p), None, meta)
            .expect("publish");
        records += out.records as u64;
    }
    records
}

fn bench_publish(c: &mut Criterion) {
    let ps = payloads(2000);
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = Metrics::new();
    let opts = WriterOptions {
        capacity: 64 << 20,
        seq_base: Some(1),
        group_read: false,
    };
    let open = |name: &str| {
        RingHub::open(name, &dir.path().join(name), &opts, &metrics)
            .expect("ring")
            .0
    };
    let (plain, tabled) = (open("plain"), open("tabled"));
    let _table = RingTable::attach(
        &tabled,
        &dir.path().join("tabled"),
        false,
        None,
        &SnapshotConfig::default(),
        SnapshotMetrics::new(&metrics),
    );
    let mut dec = Decoder::new(DecodeConfig::default());
    let mut g = c.benchmark_group("publish");
    g.bench_function("ring", |b| {
        b.iter(|| black_box(publish(&mut dec, &ps, &plain)))
    });
    g.bench_function("ring+table", |b| {
        b.iter(|| black_box(publish(&mut dec, &ps, &tabled)))
    });
    g.finish();
}

fn big_table() -> Table {
    let mut rng = Rng::new(3);
    let mut dec = Decoder::new(DecodeConfig::default());
    let mut t = Table::new(usize::MAX, 1);
    // 1,000 prompts of 1,000 blocks, each a chain from the root
    for seq in 1..=1000 {
        let hashes: Vec<u64> = (0..1000).map(|_| rng.next_u64()).collect();
        let tokens: Vec<u32> = (0..16_000).map(|_| rng.range(1, 151_000) as u32).collect();
        let ev = SimEvent::Stored {
            hashes,
            parent: None,
            tokens,
            block_size: 16,
            medium: Some("GPU".into()),
        };
        let p = encode_batch(Layout::Vllm0102, 1.7e9, &[ev], 0);
        let plan = dec.plan(&p).expect("valid");
        t.apply(&dec.planned(&plan, &p), &[], 0, seq);
    }
    t
}

fn bench_snapshot(c: &mut Criterion) {
    let t = big_table();
    let mut img = Vec::new();
    t.image(&mut img);
    let chunks = t.chunks(CHUNK_MAX).expect("cut above the chunk count");
    println!(
        "snapshot_1m: {} blocks, table {:.1} B/block, image {:.1} B/block, {} chunks of ≤ {} B ({:.1} MB)",
        t.len(),
        t.bytes() as f64 / t.len() as f64,
        img.len() as f64 / t.len() as f64,
        chunks.chunks.len(),
        CHUNK_MAX,
        chunks.chunks.iter().map(|c| c.len()).sum::<usize>() as f64 / 1e6
    );
    let mut g = c.benchmark_group("snapshot_1m");
    g.sample_size(10);
    g.bench_function("image", |b| {
        b.iter(|| {
            let mut v = Vec::new();
            t.image(&mut v);
            black_box(v.len())
        })
    });
    g.bench_function("chunks", |b| {
        b.iter(|| black_box(t.chunks(CHUNK_MAX).map(|c| c.chunks.len())))
    });
    g.finish();
}

criterion_group!(benches, bench_ingest, bench_publish, bench_snapshot);
criterion_main!(benches);
