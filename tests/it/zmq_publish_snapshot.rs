//! `serve --publish-zmq-snapshot`: kvbridge serves vLLM #57789's wire (unmerged; `vMaroon/vllm`
//! @ 08ee3e5, docs/engine-wire.md §13) from its own table, so that a consumer written for it
//! (llm-d-router #2946, the PR's reference client `examples/others/kv_snapshot_poc/client.py`)
//! bootstraps from kvbridge whatever the engine behind it runs.
//!
//! Neither the branch's client nor llm-d's Go consumer can be fetched here (no route to GitHub),
//! so [`Consumer`] follows their handoff as their source states it (docs/testing.md): wait for a
//! live message (24-byte seq frame), ask the snapshot ROUTER from a REQ while buffering live
//! messages, check the reply's identity against the live one, apply the chunks and then the
//! buffered messages above the cut, contiguous; after that, a message of another identity or a
//! seq past the next one is a resync (bootstrap again), one below it is dropped. Payloads are
//! decoded as msgpack, and every one of them once more by vLLM's own classes at the end.

use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::zmq_publish::{apply_payloads, payload_events, vllm_decode};
use common::{Bridge, Engine};
use kvbridge_tools::sim::{Layout, SimEvent};

/// How long a consumer waits for the first live message, and for a snapshot reply.
const BOOTSTRAP_WAIT: Duration = Duration::from_secs(10);

/// A consumer of one rank on #57789's wire.
struct Consumer {
    ctx: zmq::Context,
    live: String,
    snapshot: String,
    sub: Option<zmq::Socket>,
    /// The publisher identity and the next seq, once bootstrapped.
    id: Option<[u8; 16]>,
    next: u64,
    /// What builds the consumer's index: the snapshot's chunks, then every live payload applied.
    program: Vec<Vec<u8>>,
    /// Every payload received or applied, for vLLM's decoder at the end.
    seen: Vec<Vec<u8>>,
    bootstraps: u32,
    heartbeats: u32,
    /// Most events in one snapshot chunk, and the tags snapshot chunks held.
    chunk_events: usize,
    chunk_tags: BTreeSet<String>,
}

/// One live message: identity, seq, payload.
type Live = ([u8; 16], u64, Vec<u8>);

impl Consumer {
    fn new(live: &str, snapshot: &str) -> Consumer {
        Consumer {
            ctx: zmq::Context::new(),
            live: live.into(),
            snapshot: snapshot.into(),
            sub: None,
            id: None,
            next: 0,
            program: Vec::new(),
            seen: Vec::new(),
            bootstraps: 0,
            heartbeats: 0,
            chunk_events: 0,
            chunk_tags: BTreeSet::new(),
        }
    }

    fn read(&mut self, wait: Duration) -> Result<Option<Live>, String> {
        let sub = self.sub.as_ref().expect("connected");
        if sub.poll(zmq::POLLIN, wait.as_millis() as i64).unwrap() == 0 {
            return Ok(None);
        }
        let f = sub.recv_multipart(0).unwrap();
        if f.len() != 3 || f[1].len() != 24 {
            return Err(format!("not [topic, 24-byte seq, payload]: {f:02x?}"));
        }
        let id: [u8; 16] = f[1][8..].try_into().unwrap();
        let seq = u64::from_be_bytes(f[1][..8].try_into().unwrap());
        if payload_events(&f[2]).is_empty() {
            self.heartbeats += 1;
        }
        self.seen.push(f[2].clone());
        Ok(Some((id, seq, f[2].clone())))
    }

    /// The handoff: a live message, the snapshot, the buffered suffix.
    fn bootstrap(&mut self) -> Result<(), String> {
        self.id = None;
        let sub = self.ctx.socket(zmq::SUB).unwrap();
        sub.set_linger(0).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.connect(&self.live).unwrap();
        self.sub = Some(sub);
        let first = self
            .read(BOOTSTRAP_WAIT)?
            .ok_or("no live message (an idle publisher sends heartbeats)")?;
        let mut buffered = vec![first];
        let req = self.ctx.socket(zmq::REQ).unwrap();
        req.set_linger(0).unwrap();
        req.connect(&self.snapshot).unwrap();
        req.send("snapshot", 0).unwrap();
        let deadline = Instant::now() + BOOTSTRAP_WAIT;
        let reply = loop {
            if Instant::now() > deadline {
                return Err("snapshot timed out".into());
            }
            if req.poll(zmq::POLLIN, 10).unwrap() > 0 {
                break req.recv_multipart(0).unwrap();
            }
            while let Some(m) = self.read(Duration::ZERO)? {
                buffered.push(m);
            }
        };
        if reply.len() < 2 || reply[0].len() != 8 || reply[1].len() != 16 {
            return Err(format!("invalid snapshot reply: {} frames", reply.len()));
        }
        let cut = i64::from_be_bytes(reply[0][..].try_into().unwrap());
        if cut < -1 {
            return Err("snapshot unavailable".into());
        }
        let id: [u8; 16] = reply[1][..].try_into().unwrap();
        if buffered.last().unwrap().0 != id {
            return Err("publisher restarted during bootstrap".into());
        }
        self.program.clear();
        for chunk in &reply[2..] {
            let ev = payload_events(chunk);
            self.chunk_events = self.chunk_events.max(ev.len());
            for e in ev {
                self.chunk_tags
                    .insert(e["type"].as_str().unwrap_or("?").into());
            }
            self.seen.push(chunk.clone());
            self.program.push(chunk.clone());
        }
        self.next = (cut + 1) as u64;
        for (bid, seq, payload) in buffered {
            if bid != id || seq < self.next {
                continue;
            }
            if seq != self.next {
                return Err(format!("gap during bootstrap: {seq} after {}", self.next));
            }
            self.program.push(payload);
            self.next += 1;
        }
        self.id = Some(id);
        self.bootstraps += 1;
        Ok(())
    }

    /// Follows the live stream for `wait` (bootstrapping again when it must).
    fn follow(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            if self.id.is_none() {
                if let Err(e) = self.bootstrap() {
                    eprintln!("consumer: {e}; bootstrapping again");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            match self.read(left.min(Duration::from_millis(50))) {
                Ok(Some((id, seq, payload))) => {
                    if Some(id) == self.id && payload_events(&payload).is_empty() {
                        // kvbridge's heartbeat repeats the last seq (module docs of
                        // src/publish_zmq): dropped as seen, whatever the consumer.
                        assert_eq!(seq + 1, self.next, "a heartbeat repeats the last seq");
                    }
                    if Some(id) != self.id || seq > self.next {
                        eprintln!("consumer: publisher restart or gap at {seq}: resync");
                        self.id = None;
                    } else if seq == self.next {
                        self.program.push(payload);
                        self.next += 1;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("consumer: {e}");
                    self.id = None;
                }
            }
        }
    }

    /// The blocks the consumer's index holds, and the clears it applied since its bootstrap.
    fn held(&self) -> (BTreeSet<u64>, usize) {
        apply_payloads(self.program.iter().map(Vec::as_slice))
    }

    /// Follows until the index holds `want` (or a minute passed), then returns what it holds.
    fn converge(&mut self, want: &BTreeSet<u64>) -> BTreeSet<u64> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.follow(Duration::from_millis(200));
            let (held, _) = self.held();
            if &held == want || Instant::now() > deadline {
                return held;
            }
        }
    }
}

/// The engine side of the test: what each rank's engine holds.
struct Truth {
    live: Vec<BTreeSet<u64>>,
    seed: u64,
}

impl Truth {
    /// A round of traffic on rank `rank`: stores 6 blocks in 3 batches, removes the first store.
    fn traffic(&mut self, engine: &Engine, rank: u32) {
        let mut first = None;
        for _ in 0..3 {
            self.seed += 1;
            let ev = common::store(self.seed * 7919, 2, None);
            if let SimEvent::Stored { hashes, .. } = &ev {
                self.live[rank as usize].extend(hashes.iter().copied());
                first.get_or_insert(hashes.clone());
            }
            engine.publish(Layout::Vllm033, vec![ev], rank);
        }
        let gone = first.unwrap();
        for h in &gone {
            self.live[rank as usize].remove(h);
        }
        engine.publish(
            Layout::Vllm033,
            vec![SimEvent::Removed {
                hashes: gone,
                medium: Some("GPU".into()),
            }],
            rank,
        );
    }
}

fn snapshot_args(engines: &[&Engine]) -> Vec<String> {
    let mut args = common::zmq_publish::base_args(engines);
    args.extend(
        [
            "--publish-zmq",
            "tcp://127.0.0.1:0",
            "--publish-zmq-snapshot",
            "tcp://127.0.0.1:0",
        ]
        .map(String::from),
    );
    if engines.len() > 1 {
        args.extend(["--dp-mode", "metadata"].map(String::from));
    }
    args
}

fn consumers(b: &Bridge) -> Vec<Consumer> {
    b.publish_zmq
        .iter()
        .zip(&b.publish_zmq_snapshot)
        .map(|((live, _), snap)| Consumer::new(live, snap.as_deref().expect("snapshot bound")))
        .collect()
}

/// The whole run for `ranks` engines: bootstrap from an idle kvbridge (heartbeats), follow live
/// traffic, an engine restart (one clear, same identity: no resync), a kvbridge restart (same
/// identity, numbering continued), each consumer equal to its engine after each step.
fn bootstrap_follow_and_restart(ranks: u32) {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let engines: Vec<Engine> = (0..ranks).map(Engine::start).collect();
    let refs: Vec<&Engine> = engines.iter().collect();
    let bridge = Bridge::start(dir.path(), &ring, &snapshot_args(&refs));
    let mut truth = Truth {
        live: vec![BTreeSet::new(); ranks as usize],
        seed: 0,
    };
    for e in &engines {
        e.wait_subscribed();
    }
    for (r, e) in engines.iter().enumerate() {
        for _ in 0..5 {
            truth.traffic(e, r as u32);
        }
    }
    // Bootstrapped from the table while idle: the first live message is a heartbeat.
    let mut cons = consumers(&bridge);
    for (r, c) in cons.iter_mut().enumerate() {
        let held = c.converge(&truth.live[r]);
        assert_eq!(
            held, truth.live[r],
            "rank {r}: the snapshot gives the engine's blocks"
        );
        let idle = Instant::now();
        while c.heartbeats < 2 && idle.elapsed() < Duration::from_secs(10) {
            c.follow(Duration::from_millis(200));
        }
        assert!(c.heartbeats >= 2, "rank {r}: an idle rank sends heartbeats");
        assert_eq!(
            c.held().0,
            truth.live[r],
            "rank {r}: a heartbeat is no event"
        );
        assert_eq!(c.bootstraps, 1);
        assert!(!c.program.is_empty());
        assert!(c.chunk_events <= 256, "at most 256 events a chunk");
        assert_eq!(
            c.chunk_tags,
            BTreeSet::from(["BlockStored".to_string()]),
            "a snapshot is stores"
        );
    }
    // Live traffic, followed.
    for (r, e) in engines.iter().enumerate() {
        truth.traffic(e, r as u32);
    }
    for (r, c) in cons.iter_mut().enumerate() {
        assert_eq!(c.converge(&truth.live[r]), truth.live[r], "rank {r} live");
        assert_eq!(c.bootstraps, 1, "rank {r}: followed without a resync");
    }
    // The engines restart: one in-band clear each, under the same identity.
    for (r, e) in engines.iter().enumerate() {
        e.with(|p| p.restart());
        truth.live[r].clear();
        truth.traffic(e, r as u32);
    }
    for (r, c) in cons.iter_mut().enumerate() {
        let before = c.held().1;
        assert_eq!(
            c.converge(&truth.live[r]),
            truth.live[r],
            "rank {r} after the engine's restart"
        );
        assert_eq!(
            c.held().1,
            before + 1,
            "rank {r}: exactly one clear for the restart"
        );
        assert_eq!(
            c.bootstraps, 1,
            "rank {r}: an engine restart needs no resync"
        );
    }
    // kvbridge restarts over the same ring: the same identity, seqs continued.
    let ids: Vec<_> = cons.iter().map(|c| c.id).collect();
    let bridge = bridge.restart(dir.path());
    let mut cons2 = consumers(&bridge);
    for (r, e) in engines.iter().enumerate() {
        truth.traffic(e, r as u32);
    }
    for (r, c) in cons2.iter_mut().enumerate() {
        assert_eq!(
            c.converge(&truth.live[r]),
            truth.live[r],
            "rank {r} after kvbridge's restart"
        );
        assert_eq!(
            c.id, ids[r],
            "rank {r}: the ring's identity survives a kvbridge restart"
        );
    }
    // Every payload sent, as vLLM's own classes decode it.
    let all: Vec<&[u8]> = cons
        .iter()
        .chain(&cons2)
        .flat_map(|c| c.seen.iter().map(Vec::as_slice))
        .collect();
    vllm_decode(&all);
    drop(bridge);
}

#[test]
fn one_rank_bootstraps_from_kvbridge_and_follows_across_restarts() {
    bootstrap_follow_and_restart(1);
}

#[test]
fn two_ranks_bootstrap_from_kvbridge_and_follow_across_restarts() {
    bootstrap_follow_and_restart(2);
}
