//! Append throughput of the ring versus a plain memcpy of the same bytes into
//! a buffer of the same size, in the same run.
//!
//! cargo bench -p kvbridge-shm --bench append
//! The ratio (ring time / memcpy time per record) is printed at the end. The
//! ring time includes the record checksum (CRC32C over header and payload).

use criterion::{black_box, criterion_group, Criterion, Throughput};
use kvbridge_shm::*;
use std::time::{Duration, Instant};

const CAP: usize = 64 << 20;

fn ring_path() -> (tempfile::TempDir, std::path::PathBuf) {
    let d = tempfile::Builder::new()
        .prefix("kvbshm-bench")
        .tempdir_in("/dev/shm")
        .unwrap();
    let p = d.path().join("bench.ring");
    (d, p)
}

fn bench(c: &mut Criterion) {
    let (_d, path) = ring_path();
    let opts = WriterOptions {
        capacity: CAP,
        seq_base: Some(1),
        group_read: false,
    };
    let mut w = RingWriter::open(&path, &opts).unwrap();
    // A reader exists (mapped) but does not sleep: the no-waiter fast path.
    let _r = RingReader::open(&path).unwrap();
    let mut g = c.benchmark_group("append");
    g.measurement_time(Duration::from_secs(2));
    g.warm_up_time(Duration::from_millis(500));
    for &len in &[64usize, 512, 4096] {
        let src = vec![0x5Au8; len];
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(format!("ring_{len}B"), |b| {
            b.iter(|| {
                let mut r = w.reserve(len).unwrap();
                r.buf().copy_from_slice(black_box(&src));
                r.commit(RecordMeta {
                    dp_rank: 0,
                    upstream_seq: 1,
                    flags: 0,
                    ingest_ns: 0,
                    upstream_digest: 0,
                });
            })
        });
        // The checksum alone (part of every ring append), over the same bytes.
        let meta = RecordMeta::default();
        g.bench_function(format!("crc_{len}B"), |b| {
            b.iter(|| record_crc(1, len, &meta, black_box(&src)))
        });
        let mut dst = vec![1u8; CAP];
        let mut off = 0usize;
        g.bench_function(format!("memcpy_{len}B"), |b| {
            b.iter(|| {
                if off + len > CAP {
                    off = 0;
                }
                dst[off..off + len].copy_from_slice(black_box(&src));
                off += layout::record_size(len) as usize;
            })
        });
    }
    g.finish();
    // Same-run ratio with a plain timing loop (what criterion measured, but
    // printed side by side).
    println!("\nlen    ring rec/s    ring GB/s   memcpy GB/s   ring/memcpy time");
    for &len in &[64usize, 512, 4096] {
        let src = vec![0x5Au8; len];
        let n = (256 << 20) / len.max(64);
        let t = Instant::now();
        for _ in 0..n {
            let mut r = w.reserve(len).unwrap();
            r.buf().copy_from_slice(black_box(&src));
            r.commit(RecordMeta::default());
        }
        let ring = t.elapsed();
        let mut dst = vec![1u8; CAP]; // pre-faulted, like the ring's pages
        let mut off = 0;
        let t = Instant::now();
        for _ in 0..n {
            if off + len > CAP {
                off = 0;
            }
            dst[off..off + len].copy_from_slice(black_box(&src));
            off += layout::record_size(len) as usize;
        }
        black_box(&dst);
        let mc = t.elapsed();
        let bytes = (n * len) as f64;
        println!(
            "{len:<6} {:>11.0} {:>11.2} {:>13.2} {:>17.2}",
            n as f64 / ring.as_secs_f64(),
            bytes / ring.as_secs_f64() / 1e9,
            bytes / mc.as_secs_f64() / 1e9,
            ring.as_secs_f64() / mc.as_secs_f64()
        );
    }
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
