//! A built-in engine: a ZMQ publisher that behaves like a vLLM / SGLang / TokenSpeed worker.
//!
//! It exists so that `kvbridge demo`, `kvbridge bench` and the integration tests can drive the
//! whole path without an inference engine. It is faithful where kvbridge's behaviour depends on
//! it: the 3-frame message, the per-publisher counter from 0, a replay ROUTER answering
//! `[b"", start_seq]` with the old or new reply form and the end marker, restarts (the counter
//! goes back to 0), and the msgpack layouts of several real releases ([`Layout`]).
//!
//! The workload ([`Workload`]) mimics a serving engine: prefill stores of 1–400 blocks chained
//! to a parent, decode-time single-block stores, eviction sweeps of single-hash removals, and
//! an occasional `AllBlocksCleared`.

mod encode;
mod placement;

use std::collections::VecDeque;

pub use encode::{encode_batch, Layout, SimEvent};

/// A publisher socket plus the engine's replay service.
pub struct EnginePublisher {
    publisher: zmq::Socket,
    router: Option<zmq::Socket>,
    topic: Vec<u8>,
    seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    /// Subscribe messages the publisher has received so far (see [`subscriptions`](Self::subscriptions)).
    subscriptions: u64,
    /// Reply with the 4-frame form (vLLM ≥ 0.26, SGLang ≥ 0.5.22) instead of the 3-frame one.
    pub new_reply_form: bool,
    /// The publisher identity of the engines' next wire on every live message (`None`: today's
    /// wire). Replay replies keep 8-byte seqs and the bare topic, as in both branches.
    pub identity: Option<Identity>,
    ctx: zmq::Context,
    /// vLLM #57789's snapshot ROUTER, once opened ([`serve_snapshots_at`](Self::serve_snapshots_at)).
    snapshot: Option<zmq::Socket>,
    /// Every batch of this incarnation, while the snapshot service is open: its answer is this
    /// history, a replay program of stores and removals as the PR's recorder sends.
    history: Vec<Vec<u8>>,
    /// Answer snapshot requests `-2` (unavailable), as the PR's recorder does once a budget
    /// turned it off.
    pub snapshot_unavailable: bool,
    /// SGLang #34407's placement snapshot service, once opened
    /// ([`serve_placements_at`](Self::serve_placements_at)).
    placements: Option<placement::Placements>,
    /// The last snapshot barrier's number.
    barrier_id: u64,
}

/// A publisher identity as the engines' next wire carries it (both unmerged; kvbridge's
/// docs/engine-wire.md §13 has the source commits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Identity {
    /// vLLM #57789: the 8-byte seq frame followed by this 16-byte UUID (24 bytes).
    VllmUuid([u8; 16]),
    /// SGLang #34407: the topic frame followed by `\0sgl-kv-epoch=<epoch>`.
    SglangEpoch(String),
}

impl EnginePublisher {
    /// The endpoints the PUB and the replay ROUTER are bound to, as ZMQ reports them: binding
    /// `tcp://127.0.0.1:*` lets the kernel pick free ports, and this tells which.
    pub fn bound_endpoints(&self) -> Result<(String, Option<String>), zmq::Error> {
        let last = |s: &zmq::Socket| -> Result<String, zmq::Error> {
            Ok(s.get_last_endpoint()?.unwrap_or_default())
        };
        let replay = self.router.as_ref().map(last).transpose()?;
        Ok((last(&self.publisher)?, replay))
    }

    /// Binds a PUB at `endpoint` and, optionally, a replay ROUTER at `replay` (as engines do).
    pub fn bind(
        ctx: &zmq::Context,
        endpoint: &str,
        replay: Option<&str>,
        topic: &str,
    ) -> Result<Self, zmq::Error> {
        Self::open(ctx, endpoint, true, replay, topic)
    }

    /// Connects the PUB to `endpoint`, where kvbridge's SUB binds (an engine endpoint that names
    /// a host, docs/engine-wire.md §2.1), and binds the replay ROUTER at `replay` (engines bind
    /// it in every case). While the connection is down, what is published queues in the PUB
    /// (up to its high-water mark) and is delivered after the reconnect, as the engines' PUB
    /// does.
    pub fn connect(
        ctx: &zmq::Context,
        endpoint: &str,
        replay: Option<&str>,
        topic: &str,
    ) -> Result<Self, zmq::Error> {
        Self::open(ctx, endpoint, false, replay, topic)
    }

    fn open(
        ctx: &zmq::Context,
        endpoint: &str,
        bind: bool,
        replay: Option<&str>,
        topic: &str,
    ) -> Result<Self, zmq::Error> {
        // An XPUB publishes exactly as the engines' PUB does, and also hands over each
        // subscriber's subscription (verbose: every one, not only the first per topic), so a test
        // can wait until a subscriber is really subscribed instead of sleeping and hoping.
        let publisher = ctx.socket(zmq::XPUB)?;
        publisher.set_xpub_verbose(true)?;
        publisher.set_sndhwm(100_000)?;
        publisher.set_linger(0)?;
        if bind {
            publisher.bind(endpoint)?;
        } else {
            publisher.connect(endpoint)?;
        }
        let router = match replay {
            Some(r) => {
                let s = ctx.socket(zmq::ROUTER)?;
                s.set_linger(0)?;
                s.set_sndhwm(100_000)?;
                s.bind(r)?;
                Some(s)
            }
            None => None,
        };
        Ok(EnginePublisher {
            publisher,
            router,
            topic: topic.as_bytes().to_vec(),
            seq: 0,
            buffer: VecDeque::new(),
            buffer_steps: 10_000,
            subscriptions: 0,
            new_reply_form: true,
            identity: None,
            ctx: ctx.clone(),
            snapshot: None,
            history: Vec::new(),
            snapshot_unavailable: false,
            placements: None,
            barrier_id: 0,
        })
    }

    /// How many subscriptions have reached the publisher so far (each subscriber's, again after
    /// each reconnect). A message published before a subscriber's subscription arrived is not
    /// delivered to it (ZMQ's "slow joiner"), so this is what to wait for before publishing.
    pub fn subscriptions(&mut self) -> u64 {
        while let Ok(m) = self.publisher.recv_bytes(zmq::DONTWAIT) {
            if m.first() == Some(&1) {
                self.subscriptions += 1;
            }
        }
        self.subscriptions
    }

    /// The actual endpoint the PUB bound (resolves port 0).
    pub fn endpoint(&self) -> String {
        self.publisher
            .get_last_endpoint()
            .ok()
            .and_then(|r| r.ok())
            .unwrap_or_default()
    }

    /// The actual endpoint of the replay ROUTER.
    pub fn replay_endpoint(&self) -> Option<String> {
        self.router
            .as_ref()
            .and_then(|r| r.get_last_endpoint().ok())
            .and_then(|r| r.ok())
    }

    /// The seq the next batch gets.
    pub fn next_seq(&self) -> u64 {
        self.seq
    }

    /// Sets the topic of every message from now on (the first frame; `""` by default).
    pub fn set_topic(&mut self, topic: &str) {
        self.topic = topic.as_bytes().to_vec();
    }

    /// Sets how many recent batches the replay buffer keeps (the engines' `buffer_steps`,
    /// 10,000 by default).
    pub fn set_buffer_steps(&mut self, n: usize) {
        self.buffer_steps = n;
    }

    /// Publishes a batch with the next seq; returns that seq.
    pub fn publish(&mut self, payload: Vec<u8>) -> u64 {
        self.publish_inner(payload, true, None)
    }

    /// Publishes SGLang #34407's snapshot barrier: `payload` with the next seq, its topic
    /// carrying `\0sgl-kv-snapshot=<barrier_id>` after the epoch.
    fn publish_barrier(&mut self, payload: Vec<u8>, barrier_id: &str) -> u64 {
        self.publish_inner(payload, true, Some(barrier_id))
    }

    /// Consumes a seq and buffers the batch for replay without sending it: a batch the network
    /// (a full HWM) dropped.
    pub fn publish_dropped(&mut self, payload: Vec<u8>) -> u64 {
        self.publish_inner(payload, false, None)
    }

    /// Consumes a seq without sending or buffering anything: a batch the engine failed to encode.
    pub fn burn_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }

    /// Sends raw frames (tests of malformed input).
    pub fn send_raw(&self, frames: &[&[u8]]) -> Result<(), zmq::Error> {
        self.publisher.send_multipart(frames, 0)
    }

    fn publish_inner(&mut self, payload: Vec<u8>, send: bool, barrier: Option<&str>) -> u64 {
        let seq = self.seq;
        self.seq += 1;
        if send {
            let mut topic = self.topic.clone();
            let mut s = seq.to_be_bytes().to_vec();
            match &self.identity {
                None => {}
                Some(Identity::VllmUuid(u)) => s.extend_from_slice(u),
                Some(Identity::SglangEpoch(e)) => {
                    topic.extend_from_slice(b"\0sgl-kv-epoch=");
                    topic.extend_from_slice(e.as_bytes());
                }
            }
            if let Some(b) = barrier {
                topic.extend_from_slice(b"\0sgl-kv-snapshot=");
                topic.extend_from_slice(b.as_bytes());
            }
            let _ = self
                .publisher
                .send_multipart([&topic[..], &s[..], &payload[..]], 0);
        }
        if self.snapshot.is_some() {
            self.history.push(payload.clone());
        }
        if self.router.is_some() {
            self.buffer.push_back((seq, payload));
            while self.buffer.len() > self.buffer_steps {
                self.buffer.pop_front();
            }
        }
        seq
    }

    /// An engine restart: the counter starts again at 0 and the replay buffer is empty.
    pub fn restart(&mut self) {
        self.seq = 0;
        self.buffer.clear();
        self.history.clear();
        if let Some(p) = &mut self.placements {
            p.clear();
        }
    }

    /// Binds vLLM #57789's snapshot ROUTER at `endpoint` (unmerged; kvbridge's
    /// docs/engine-wire.md §13) and returns where it is bound. From now on this incarnation's
    /// batches are kept, and a request is answered `[cut, uuid, batch, …]` with all of them.
    pub fn serve_snapshots_at(&mut self, endpoint: &str) -> Result<String, zmq::Error> {
        let s = self.ctx.socket(zmq::ROUTER)?;
        s.set_linger(0)?;
        s.bind(endpoint)?;
        let at = s.get_last_endpoint()?.unwrap_or_default();
        self.snapshot = Some(s);
        Ok(at)
    }

    /// Answers every pending snapshot request (as the PR's recorder does, echoing the envelope
    /// up to its empty frame, else the identity alone).
    fn serve_snapshots(&mut self) {
        let Some(router) = &self.snapshot else { return };
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            let end = frames
                .iter()
                .position(|f| f.is_empty())
                .map_or(1, |i| i + 1);
            let mut reply: Vec<Vec<u8>> = frames[..end.min(frames.len())].to_vec();
            let uuid = match &self.identity {
                Some(Identity::VllmUuid(u)) => u.to_vec(),
                _ => vec![0; 16],
            };
            let cut = if self.snapshot_unavailable {
                -2
            } else {
                self.seq as i64 - 1
            };
            reply.push(cut.to_be_bytes().to_vec());
            reply.push(uuid);
            if !self.snapshot_unavailable {
                reply.extend(self.history.iter().cloned());
            }
            let _ = router.send_multipart(reply, 0);
        }
    }

    /// Answers every pending replay request (the engine does this on its publisher thread).
    /// Returns the number of requests answered.
    pub fn serve_replay(&mut self) -> usize {
        self.serve_snapshots();
        self.serve_placements();
        let Some(router) = &self.router else { return 0 };
        let mut answered = 0;
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            // identity + 2 frames, else never answered (as the engines do).
            let [id, delim, start] = frames.as_slice() else {
                continue;
            };
            let (true, Ok(start)) = (delim.is_empty(), <[u8; 8]>::try_from(start.as_slice()))
            else {
                continue;
            };
            let start = u64::from_be_bytes(start);
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let s = seq.to_be_bytes();
                let _ = if self.new_reply_form {
                    router.send_multipart([&id[..], b"", &self.topic[..], &s[..], &payload[..]], 0)
                } else {
                    router.send_multipart([&id[..], b"", &s[..], &payload[..]], 0)
                };
            }
            let end = u64::MAX.to_be_bytes();
            let _ = if self.new_reply_form {
                router.send_multipart([&id[..], b"", b"", &end[..], b""], 0)
            } else {
                router.send_multipart([&id[..], b"", &end[..], b""], 0)
            };
            answered += 1;
        }
        answered
    }
}

/// A small, fast, seedable PRNG (xorshift64*), so workloads are reproducible.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator (seed 0 is replaced by a constant).
    pub fn new(seed: u64) -> Self {
        Rng(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// The batch mix of a serving engine.
#[derive(Clone, Debug)]
pub struct Workload {
    rng: Rng,
    /// Tokens per block.
    pub block_size: usize,
    /// Largest prefill store, in blocks.
    pub max_prefill_blocks: usize,
    /// Hashes currently stored (candidates for eviction), newest last.
    live: VecDeque<u64>,
    /// Probability that a batch holds a prefill store.
    pub p_prefill: f64,
    /// Probability of an `AllBlocksCleared` in a batch.
    pub p_clear: f64,
}

impl Workload {
    /// A vLLM-like mix with block size 16.
    pub fn new(seed: u64) -> Self {
        Workload {
            rng: Rng::new(seed),
            block_size: 16,
            max_prefill_blocks: 400,
            live: VecDeque::new(),
            p_prefill: 0.3,
            p_clear: 0.0005,
        }
    }

    fn new_hash(&mut self) -> u64 {
        self.rng.next_u64()
    }

    fn store(&mut self, blocks: usize) -> SimEvent {
        let parent = if self.rng.chance(0.7) {
            self.live.back().copied()
        } else {
            None
        };
        let hashes: Vec<u64> = (0..blocks).map(|_| self.new_hash()).collect();
        let tokens: Vec<u32> = (0..blocks * self.block_size)
            .map(|_| self.rng.range(1, 151_000) as u32)
            .collect();
        self.live.extend(hashes.iter().copied());
        SimEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size: self.block_size as u32,
            medium: Some("GPU".into()),
        }
    }

    /// The events of one scheduler step.
    pub fn next_batch(&mut self) -> Vec<SimEvent> {
        let mut ev = Vec::new();
        if self.rng.chance(self.p_clear) {
            self.live.clear();
            ev.push(SimEvent::Cleared);
        }
        if self.rng.chance(self.p_prefill) {
            // Prefill lengths are skewed small: most prompts are short, a few are long.
            let r = self.rng.next_u64() % 100;
            let max = self.max_prefill_blocks as u64;
            let blocks = if r < 70 {
                self.rng.range(1, 8.min(max))
            } else if r < 95 {
                self.rng.range(1, 64.min(max))
            } else {
                self.rng.range(1, max)
            };
            ev.push(self.store(blocks as usize));
        }
        // Decode steps fill blocks one at a time.
        let decodes = self.rng.range(0, 3);
        for _ in 0..decodes {
            ev.push(self.store(1));
        }
        // Eviction keeps the cache bounded: sweeps of single-hash removals.
        while self.live.len() > 20_000 || (self.rng.chance(0.2) && self.live.len() > 64) {
            let n = self.rng.range(1, 16);
            for _ in 0..n {
                if let Some(h) = self.live.pop_front() {
                    ev.push(SimEvent::Removed {
                        hashes: vec![h],
                        medium: Some("GPU".into()),
                    });
                }
            }
            if self.live.len() <= 20_000 {
                break;
            }
        }
        if ev.is_empty() {
            ev.push(self.store(1));
        }
        ev
    }
}
