//! The engine's own truth and kvbridge's, as the same normalized [`Op`] list: the engine's replay
//! from 0, the truth SUB ([`LiveSub`]), kvbridge's gRPC stream from 0, each turned into ops with
//! kvbridge's own decoder, and their difference.

use super::*;

/// A replay request from `start` (a DEALER, the new 4-frame reply form): every reply up to the
/// end marker, or why not.
pub fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> Result<Vec<Batch>, String> {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(10_000).unwrap();
    d.set_linger(0).unwrap();
    d.connect(endpoint).unwrap();
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    loop {
        let f = d.recv_multipart(0).map_err(|e| {
            format!(
                "replay from {start} at {endpoint}: no end marker ({e}) after {} replies",
                out.len()
            )
        })?;
        if f.len() != 4 || !f[0].is_empty() || f[2].len() != 8 {
            return Err(format!(
                "replay at {endpoint}: a reply not [\"\", topic, seq, payload]: {f:?}"
            ));
        }
        let seq = u64::from_be_bytes(f[2][..].try_into().unwrap());
        if seq == u64::MAX {
            return Ok(out);
        }
        out.push((seq, f[3].clone()));
    }
}

/// The truth SUB: every message the engine's PUB sends, in order, split into incarnations (a
/// seq that does not go up starts a new one).
pub(super) struct LiveSub {
    got: Arc<Mutex<Vec<Vec<Batch>>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LiveSub {
    pub(super) fn start(ctx: &zmq::Context, endpoint: &str) -> LiveSub {
        let s = ctx.socket(zmq::SUB).unwrap();
        s.set_rcvhwm(0).unwrap();
        s.set_subscribe(b"").unwrap();
        s.set_rcvtimeo(100).unwrap();
        s.set_linger(0).unwrap();
        s.connect(endpoint).unwrap();
        let got: Arc<Mutex<Vec<Vec<Batch>>>> = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (g, st) = (got.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(f) = s.recv_multipart(0) else { continue };
                assert_eq!(f.len(), 3, "a live engine message is [topic, seq, payload]");
                let seq = u64::from_be_bytes(f[1][..].try_into().expect("8-byte seq"));
                let mut g = g.lock().unwrap();
                let new = g.last().and_then(|i| i.last()).is_none_or(|l| seq <= l.0);
                if new {
                    g.push(Vec::new());
                }
                g.last_mut().unwrap().push((seq, f[2].clone()));
            }
        });
        LiveSub {
            got,
            stop,
            thread: Some(thread),
        }
    }

    /// What the current (latest) incarnation has sent so far.
    pub(super) fn current(&self) -> Vec<Batch> {
        self.got.lock().unwrap().last().cloned().unwrap_or_default()
    }

    /// The current incarnation, once this SUB has received `newest` (that very batch, seq and
    /// bytes: a seq alone can be the incarnation before's).
    pub(super) fn until(&self, newest: &Batch) -> Vec<Batch> {
        eventually(
            "the truth SUB received the engine's newest batch",
            Duration::from_secs(30),
            || {
                let l = self.current();
                match l.last() {
                    Some(b) if b == newest => Ok(l),
                    _ => Err(l.last().map(|b| b.0)),
                }
            },
        )
    }
}

impl Drop for LiveSub {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One event, normalized: what a cache-aware router applies, and the KV-cache group it belongs
/// to (`group_idx`; a hybrid model has several, docs/engine-wire.md §9.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Store {
        group: Option<u32>,
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Remove {
        group: Option<u32>,
        hashes: Vec<u64>,
    },
    Clear,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let short = |h: &u64| format!("{:04x}", h >> 48);
        let group = |g: &Option<u32>| g.map(|g| format!("g{g} ")).unwrap_or_default();
        match self {
            Op::Store {
                group: g,
                hashes,
                parent,
                tokens,
            } => write!(
                f,
                "{}store[{}] parent {} tokens {}",
                group(g),
                hashes.iter().map(short).collect::<Vec<_>>().join(","),
                parent.as_ref().map(short).unwrap_or_else(|| "-".into()),
                tokens.len()
            ),
            Op::Remove { group: g, hashes } => write!(
                f,
                "{}remove[{}]",
                group(g),
                hashes.iter().map(short).collect::<Vec<_>>().join(",")
            ),
            Op::Clear => write!(f, "CLEAR"),
        }
    }
}

/// kvbridge's gRPC stream subscribed from 0, up to the newest record of its ring (read from its
/// metrics) when it was called: the whole window, as a subscriber from 0 gets it.
pub fn stream_from_0(
    rt: &tokio::runtime::Runtime,
    bridge: &Bridge,
    timeout: Duration,
) -> Vec<KvEventBatch> {
    let page = scrape(bridge.metrics.expect("kvbridge's metrics on"));
    let newest = metric(&page, "kvbridge_ring_newest_seq", &[]) as u64;
    if newest == 0 {
        return Vec::new();
    }
    let url = bridge.url();
    rt.block_on(async {
        let mut s = crate::common::subscribe(&url, 0)
            .await
            .unwrap_or_else(|st| panic!("subscribe from 0: {st:?}"));
        crate::common::try_collect_until(&mut s, timeout, |got| {
            got.last().is_some_and(|l| l.sequence_number >= newest)
        })
        .await
        .unwrap_or_else(|st| panic!("the stream from 0 failed: {st:?}"))
    })
}

/// Waits until kvbridge has applied the engine's batch `seq` (rank 0): every batch up to it is
/// in its ring, or filtered out.
pub fn wait_applied(bridge: &Bridge, seq: u64, timeout: Duration) {
    let m = bridge.metrics.expect("kvbridge's metrics on");
    crate::common::wait_metrics(m, timeout, |page| {
        metric(page, "kvbridge_last_upstream_seq", &[("rank", "0")]) >= seq as f64
    });
}

/// The ops of kvbridge's gRPC records (or of the engine's batches decoded into them), in order.
pub fn grpc_ops(batches: &[KvEventBatch]) -> Vec<Op> {
    let mut ops = Vec::new();
    for b in batches {
        assert!(
            b.snapshot.is_none(),
            "a snapshot chunk where the window was expected"
        );
        for e in &b.events {
            ops.push(match &e.data {
                Some(Data::Stored(s)) => Op::Store {
                    group: s.group_idx,
                    hashes: s.blocks.iter().map(|b| b.block_hash as u64).collect(),
                    parent: s.parent_block_hash.map(|p| p as u64),
                    tokens: s.blocks.iter().flat_map(|b| b.token_ids.clone()).collect(),
                },
                Some(Data::Removed(r)) => Op::Remove {
                    group: r.group_idx,
                    hashes: r.block_hashes.iter().map(|h| *h as u64).collect(),
                },
                Some(Data::Cleared(_)) => Op::Clear,
                None => panic!("an event without data in {b:?}"),
            });
        }
    }
    ops
}

/// The ops of engine payloads, decoded by kvbridge's own decoder (every event kept).
pub fn engine_ops(batches: &[Batch]) -> Vec<Op> {
    let mut dec = Decoder::new(DecodeConfig {
        split_threshold: 1 << 30,
        profile: Profile::All,
        ..Default::default()
    });
    let mut records = Vec::new();
    for (seq, payload) in batches {
        let plan = dec
            .plan(payload)
            .unwrap_or_else(|e| panic!("kvbridge's decoder rejects engine batch {seq}: {e:?}"));
        assert_eq!(plan.lost_removals, 0, "engine batch {seq} lost removals");
        for i in 0..plan.records {
            let hdr = RecordHeader {
                sequence_number: 1,
                first_event_id: 1,
                dp_rank: None,
            };
            let mut buf = vec![0u8; dec.record_len(i, &hdr)];
            dec.write_record(payload, i, &hdr, &mut buf);
            records.push(KvEventBatch::decode(&buf[..]).unwrap());
        }
    }
    grpc_ops(&records)
}

/// The blocks a router holds after applying `ops` from nothing (by hash alone, as SMG keys
/// them).
pub fn block_set(ops: &[Op]) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    for op in ops {
        match op {
            Op::Store { hashes, .. } => set.extend(hashes.iter().copied()),
            Op::Remove { hashes, .. } => {
                for h in hashes {
                    set.remove(h);
                }
            }
            Op::Clear => set.clear(),
        }
    }
    set
}

/// Where `got` and `want` differ, for a failure message: lengths, op counts, where the clears
/// are, and the ops around the first difference.
pub fn diff(got: &[Op], want: &[Op]) -> String {
    let counts = |ops: &[Op]| {
        let (mut s, mut r, mut c) = (0, 0, 0);
        for op in ops {
            match op {
                Op::Store { .. } => s += 1,
                Op::Remove { .. } => r += 1,
                Op::Clear => c += 1,
            }
        }
        format!("{} ops: {s} stores, {r} removals, {c} clears", ops.len())
    };
    let clears = |ops: &[Op]| {
        ops.iter()
            .enumerate()
            .filter(|(_, o)| **o == Op::Clear)
            .map(|(i, _)| i)
            .collect::<Vec<_>>()
    };
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let around = |ops: &[Op]| {
        let lo = first.saturating_sub(2);
        ops.iter()
            .enumerate()
            .skip(lo)
            .take(6)
            .map(|(i, o)| format!("      #{i}: {o}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!(
        "kvbridge: {} (clears at {:?})\n  expected: {} (clears at {:?})\n  first difference at op #{first}\n    kvbridge:\n{}\n    expected:\n{}",
        counts(got),
        clears(got),
        counts(want),
        clears(want),
        around(got),
        around(want)
    )
}
