//! `serve --publish-zmq` under bad input: garbage and oversized replay requests, a flood of
//! replay requests and consumers that never read hold no one else back, and kvbridge's memory
//! stays within what its limits allow.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use common::zmq_publish::*;
use common::{metric, scrape, status_kib, Bridge, Engine};

/// The highest `VmRSS` of a process while it runs (sampled every 20 ms): the peak of one phase
/// of a test, which `VmHWM` (the peak since the start) does not give once an earlier phase
/// peaked higher.
struct RssSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(status_kib(pid, "VmRSS"));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak.max(status_kib(pid, "VmRSS"))
        });
        RssSampler { stop, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Records of the memory phase of [`bad_consumers_do_not_hold_anyone_else`], and blocks each.
const BIG_RECORDS: u64 = 10_000;

const BIG_BLOCKS: usize = 24;

/// Consumers that ask for those records and never read.
const DEAF: usize = 5;

/// Garbage and oversized replay requests, 1,000 replay requests at once and a consumer that
/// never reads: ingest, gRPC and the other consumers carry on. Then memory: 10,000 records of
/// 24 blocks (about 2 KB each on the wire, 20 MB in all) published while the SUB that never
/// reads stays connected, and replayed to 5 consumers that never read: kvbridge's resident
/// memory grows by less than what its limits allow (the ring pages written, the snapshot table's
/// growth, the stuck SUB's PUB pipe, 17 messages per deaf consumer, 16 MiB for the rest).
/// Measured: +95 MiB of a 140 MiB bound; with the ROUTER's high-water mark removed, +188 MiB
/// (each deaf consumer holding the whole window), and before the ROUTER's options were set
/// before its bind (libzmq's default mark of 1,000 messages applied), +108 MiB.
#[test]
fn bad_consumers_do_not_hold_anyone_else() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engine = Engine::start(0);
    let mut args = base_args(&[&engine]);
    args.extend(publish_args("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"));
    // The ROUTER's high-water mark follows from the ring's size (replay::configure): 16
    // messages per consumer with 64 MiB.
    args.extend(["--ring-size", "64MiB"].map(String::from));
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    let (pub_ep, replay_ep) = endpoints(&bridge, 1).remove(0);
    let ctx = zmq::Context::new();
    for i in 0..200u64 {
        engine.publish(
            kvbridge_tools::sim::Layout::Vllm033,
            vec![common::store(i, 4, None)],
            0,
        );
    }
    // A SUB that never reads, with a tiny pipe.
    let stuck = ctx.socket(zmq::SUB).unwrap();
    stuck.set_rcvhwm(1).unwrap();
    stuck.set_rcvbuf(4096).unwrap();
    stuck.set_subscribe(b"").unwrap();
    stuck.connect(&pub_ep).unwrap();
    // Garbage: wrong frame counts, a short seq, a non-empty delimiter; and an oversized one.
    let g = ctx.socket(zmq::DEALER).unwrap();
    g.connect(&replay_ep).unwrap();
    g.send(&b"x"[..], 0).unwrap();
    g.send_multipart([&b""[..], &[1u8, 2, 3][..]], 0).unwrap();
    g.send_multipart([&b"junk"[..], &0u64.to_be_bytes()[..]], 0)
        .unwrap();
    g.send_multipart([&b""[..], &0u64.to_be_bytes()[..], b"extra"], 0)
        .unwrap();
    let big = ctx.socket(zmq::DEALER).unwrap();
    big.connect(&replay_ep).unwrap();
    big.send_multipart([&b""[..], &vec![0u8; 1 << 20][..]], 0)
        .unwrap();
    // 1,000 requests at once: 50 consumers asking 20 times each, half of them from 0 (the
    // state), half inside the window; and some that never read their replies.
    let dealers: Vec<zmq::Socket> = (0..50)
        .map(|_| {
            let d = ctx.socket(zmq::DEALER).unwrap();
            d.set_rcvtimeo(30_000).unwrap();
            d.set_rcvhwm(0).unwrap();
            d.connect(&replay_ep).unwrap();
            d
        })
        .collect();
    let deaf: Vec<zmq::Socket> = (0..5)
        .map(|_| {
            let d = ctx.socket(zmq::DEALER).unwrap();
            d.set_rcvhwm(1).unwrap();
            d.connect(&replay_ep).unwrap();
            d.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
                .unwrap();
            d
        })
        .collect();
    for (i, d) in dealers.iter().enumerate() {
        for k in 0..20u64 {
            let start: u64 = if (i as u64 + k) % 2 == 0 { 0 } else { 150 };
            d.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
                .unwrap();
        }
    }
    // Meanwhile ingest goes on, and a gRPC subscriber and a well-behaved SUB see it. The good SUB
    // queues whatever arrives (no receive high-water mark): the test reads the 10,000 records of
    // the memory phase only after publishing them all, and a SUB with libzmq's default mark of
    // 1,000 would leave them to the PUB's mark of 10,000, which a PUB meets by dropping (seen on
    // a busy machine).
    let good = sub_hwm(&ctx, &pub_ep, 0);
    let before = warm_up(&good, || {
        engine.with(|p| p.publish(warm_batch(0)));
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    for i in 0..300u64 {
        engine.publish(
            kvbridge_tools::sim::Layout::Vllm033,
            vec![common::store(5_000 + i, 4, None)],
            0,
        );
    }
    let mut seen = HashSet::new();
    while seen.len() < 300 {
        let m = recv(&good, Duration::from_secs(20)).expect("the good SUB keeps receiving");
        assert!(m.seq > before);
        seen.insert(m.seq);
    }
    let grpc = rt.block_on(async {
        let mut stream = common::subscribe(&bridge.url(), 0)
            .await
            .expect("subscribe");
        // (collect_until, with what the bridge was doing if the stream stalls: seen once under
        // the stress script, 364 batches in 30 s)
        let mut got: Vec<kvbridge::proto::common::KvEventBatch> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while common::stored_hashes(&got).len() < 500 * 4 {
            match tokio::time::timeout_at(deadline, stream.message()).await {
                Ok(Ok(Some(b))) => got.push(b),
                end => {
                    let page = scrape(maddr);
                    let lines: Vec<&str> = page
                        .lines()
                        .filter(|l| {
                            !l.starts_with('#')
                                && ["ring_newest", "batches_sent", "subscriber", "zmq_replay"]
                                    .iter()
                                    .any(|k| l.contains(k))
                        })
                        .collect();
                    panic!(
                        "gRPC stream: {} batches (last seq {:?}), then {end:?}\n{}\nthe bridge's log:\n{}",
                        got.len(),
                        got.last().map(|b| b.sequence_number),
                        lines.join("\n"),
                        bridge.log()
                    );
                }
            }
        }
        got
    });
    assert!(
        common::stored_hashes(&grpc).len() >= 500 * 4,
        "gRPC gets every store"
    );
    // Every one of the 1,000 requests is answered, with an end marker each.
    for d in &dealers {
        let mut ends = 0;
        while ends < 20 {
            let f = d
                .recv_multipart(0)
                .expect("a reply to each of the 1,000 requests");
            if seq_of(&f[2]) == u64::MAX {
                ends += 1;
            }
        }
    }
    let page = scrape(maddr);
    assert!(
        metric(
            &page,
            "kvbridge_zmq_replay_requests_total",
            &[("outcome", "malformed")]
        ) >= 3.0,
        "{page}"
    );
    assert!(
        metric(
            &page,
            "kvbridge_zmq_replay_requests_total",
            &[("outcome", "state")]
        ) >= 500.0,
        "{page}"
    );
    assert!(
        metric(&page, "kvbridge_zmq_published_total", &[]) >= 500.0,
        "{page}"
    );
    // Memory: a window of records larger than any pipe may hold, published while the stuck SUB
    // stays connected, then replayed to consumers that never read.
    let pid = bridge.child.id();
    let table = || metric(&scrape(maddr), "kvbridge_snapshot_table_bytes", &[]) as u64;
    let table_before = table();
    let rss_before = status_kib(pid, "VmRSS");
    let sampler = RssSampler::start(pid);
    for i in 0..BIG_RECORDS {
        engine.publish(
            kvbridge_tools::sim::Layout::Vllm033,
            vec![common::store(100_000 + i, BIG_BLOCKS, None)],
            0,
        );
    }
    let mut first = None;
    let mut largest = 0;
    let mut got = 0;
    while got < BIG_RECORDS {
        let m = recv(&good, Duration::from_secs(20)).expect("the good SUB keeps receiving");
        if m.payload.len() > 1_000 {
            first.get_or_insert(m.seq);
            largest = largest.max(m.payload.len() as u64);
            got += 1;
        }
    }
    let first = first.expect("the big records");
    let sent = || metric(&scrape(maddr), "kvbridge_zmq_replay_bytes_total", &[]);
    let sent0 = sent();
    let deaf_window: Vec<zmq::Socket> = (0..DEAF)
        .map(|_| {
            let d = ctx.socket(zmq::DEALER).unwrap();
            d.set_rcvhwm(1).unwrap();
            d.set_rcvbuf(4096).unwrap();
            d.connect(&replay_ep).unwrap();
            d.send_multipart([&b""[..], &first.to_be_bytes()[..]], 0)
                .unwrap();
            d
        })
        .collect();
    // They stop when their pipes are full: the replay bytes sent stop growing, past what the
    // pipes take at least.
    let mut last = -1.0;
    common::eventually(
        "the deaf consumers' replays blocked",
        Duration::from_secs(60),
        || {
            std::thread::sleep(Duration::from_millis(500));
            let now = sent();
            let steady = now == last && now - sent0 >= (DEAF as u64 * 16 * largest) as f64;
            last = now;
            if steady {
                Ok(())
            } else {
                Err(now - sent0)
            }
        },
    );
    let peak = sampler.finish();
    let grew = peak.saturating_sub(rss_before);
    // What the limits let kvbridge hold here (KiB): the ring pages the records were written to
    // (shared memory counts in RSS), the snapshot table's growth (the blocks stored: twice what
    // it counts, as its maps grow by doubling), the stuck SUB's PUB pipe (its high-water mark,
    // 100,000 messages, is more than these records), each deaf consumer's reply pipe (the
    // ROUTER's high-water mark, 16 messages with a 64 MiB ring, plus the one its replay holds
    // back), and 16 MiB for the rest (allocator, sockets, threads).
    let table_kib = 2 * table().saturating_sub(table_before) / 1024;
    let ring_kib = BIG_RECORDS * largest * 2 / 1024;
    let stuck_kib = BIG_RECORDS * largest / 1024;
    let deaf_kib = DEAF as u64 * 17 * largest / 1024;
    let bound = ring_kib + table_kib + stuck_kib + deaf_kib + (16 << 10);
    eprintln!(
        "bad consumers: RSS {rss_before} KiB, peak +{grew} KiB (bound {bound} KiB: ring {ring_kib}, table {table_kib}, stuck SUB {stuck_kib}, {DEAF} deaf replays {deaf_kib}); largest message {largest} B; VmHWM {} KiB",
        status_kib(pid, "VmHWM")
    );
    assert!(
        grew < bound,
        "kvbridge's resident memory grew by {grew} KiB, more than the {bound} KiB its limits allow"
    );
    // Consumers that never read do not keep their replay slots: each is given up.
    common::eventually(
        "the deaf consumers' replays given up",
        Duration::from_secs(60),
        || {
            let n = metric(
                &scrape(maddr),
                "kvbridge_zmq_replay_requests_total",
                &[("outcome", "stalled")],
            );
            if n >= DEAF as f64 {
                Ok(())
            } else {
                Err(n)
            }
        },
    );
    drop((stuck, deaf, deaf_window, g, big));
    let st = bridge.stop();
    assert!(st.success(), "kvbridge exited with {st:?}");
}
