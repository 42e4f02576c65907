//! The snapshot table's cost, each against a baseline measured in the same run:
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
//!   are printed once: what the table counts (`Table::bytes`) and the process's RSS growth
//!   while it is built (the same payloads held before and after).
//!
//! * printed once: the longest a `RingHub::publish` (ingest) waits while snapshots of those
//!   1,000,000 blocks are taken back to back on another thread, against the longest in the same
//!   number of publishes with no snapshot (same run).
//!
//! `cargo bench --bench snapshot -- --warm-up-time 1 --measurement-time 3`
use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kvbridge::decode::{DecodeConfig, Decoder, RecordHeader};
use kvbridge::ring::RingHub;
use kvbridge::snapshot::{Table, CHUNK_MAX};
use kvbridge_shm::WriterOptions;
use kvbridge_tools::bench::table_ring::{big_payloads, full_cache_ring, TableRing, META};
use kvbridge_tools::sim::{encode_batch, Layout, Workload};

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
        let meta = META;
        let out = hub
            .publish(&dec.planned(&plan, p), None, meta)
            .expect("publish");
        records += out.records as u64;
    }
    records
}

fn bench_publish(c: &mut Criterion) {
    let ps = payloads(2000);
    // the plain ring beside the one with a table, in the same directory (on tmpfs)
    let tabled = TableRing::open("tabled", 64 << 20);
    let opts = WriterOptions {
        capacity: 64 << 20,
        seq_base: Some(1),
        group_read: false,
    };
    let plain = RingHub::open(
        "plain",
        &tabled.dir().join("plain"),
        &opts,
        &tabled.ring_metrics,
    )
    .expect("ring")
    .0;
    let tabled = &tabled.hub;
    let mut dec = Decoder::new(DecodeConfig::default());
    let mut g = c.benchmark_group("publish");
    g.bench_function("ring", |b| {
        b.iter(|| black_box(publish(&mut dec, &ps, &plain)))
    });
    g.bench_function("ring+table", |b| {
        b.iter(|| black_box(publish(&mut dec, &ps, tabled)))
    });
    g.finish();
}

/// 1,000 prompts of 1,000 blocks of 16 tokens, each a chain from the root.
fn table_of(ps: &[Vec<u8>]) -> Table {
    let mut dec = Decoder::new(DecodeConfig::default());
    let mut t = Table::new(usize::MAX, 1);
    for (seq, p) in ps.iter().enumerate() {
        let plan = dec.plan(p).expect("valid");
        t.apply(&dec.planned(&plan, p), &[], 0, seq as u64 + 1);
    }
    t
}

/// Longest and 99.9th-percentile publish time (µs) over `ps` cycled until `done` (or `n`
/// publishes when `done` is `None`), and the number of publishes.
fn publish_times(
    dec: &mut Decoder,
    ps: &[Vec<u8>],
    hub: &RingHub,
    done: Option<&std::sync::atomic::AtomicBool>,
    n: usize,
) -> (f64, f64, usize) {
    let mut times = Vec::new();
    let meta = META;
    for p in ps.iter().cycle() {
        let stop = match done {
            Some(d) => d.load(std::sync::atomic::Ordering::Acquire),
            None => times.len() >= n,
        };
        if stop {
            break;
        }
        let plan = dec.plan(p).expect("valid batch");
        let t = std::time::Instant::now();
        hub.publish(&dec.planned(&plan, p), None, meta)
            .expect("publish");
        times.push(t.elapsed().as_secs_f64() * 1e6);
        // a steady 20,000 batches/s, not a flat-out loop
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    times.sort_by(f64::total_cmp);
    let p999 = times[(times.len() * 999 / 1000).min(times.len() - 1)];
    (*times.last().expect("published"), p999, times.len())
}

/// How long ingest waits while snapshots of 1,000,000 blocks are taken (printed).
fn ingest_during_snapshots() {
    let ring = full_cache_ring(256 << 20);
    let (hub, rt) = (&ring.hub, &ring.table);
    let mut dec = Decoder::new(DecodeConfig::default());
    let blocks = rt.with_table(|t| t.len());
    let ps = payloads(2000);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (during, snaps) = std::thread::scope(|s| {
        let taker = s.spawn(|| {
            let t0 = std::time::Instant::now();
            for _ in 0..3 {
                black_box(rt.snapshot().map(|c| c.chunks.len()));
            }
            done.store(true, std::sync::atomic::Ordering::Release);
            t0.elapsed()
        });
        let during = publish_times(&mut dec, &ps, hub, Some(&done), 0);
        (during, taker.join().expect("snapshot thread"))
    });
    let alone = publish_times(&mut dec, &ps, hub, None, during.2);
    println!(
        "ingest during snapshots: {blocks} blocks, 3 snapshots in {:.2} s; {} publishes: longest {:.0} µs, p99.9 {:.0} µs (same number with no snapshot: longest {:.0} µs, p99.9 {:.0} µs)",
        snaps.as_secs_f64(),
        during.2,
        during.0,
        during.1,
        alone.0,
        alone.1
    );
}

fn bench_snapshot(c: &mut Criterion) {
    ingest_during_snapshots();
    // the payloads exist before and after: the RSS difference is the table's (with the
    // allocator's overhead, which `Table::bytes` leaves out)
    let ps = big_payloads();
    let rss = || kvbridge::metrics::process::status_kib(std::process::id(), "VmRSS").unwrap_or(0);
    let rss0 = rss();
    let t = table_of(&ps);
    let rss1 = rss();
    drop(ps);
    let mut img = Vec::new();
    t.image(&mut img);
    let chunks = t.chunks(CHUNK_MAX).expect("cut above the chunk count");
    println!(
        "snapshot_1m: {} blocks, table {:.1} B/block (RSS {:.1} B/block), image {:.1} B/block, {} chunks of ≤ {} B ({:.1} MB)",
        t.len(),
        t.bytes() as f64 / t.len() as f64,
        (rss1 - rss0) as f64 * 1024.0 / t.len() as f64,
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
