//! The engines' own ZMQ wire, re-published from the ring (`--publish-zmq`): a PUB per DP rank
//! and, with `--publish-zmq-replay`, a replay ROUTER per rank, so that a consumer configured
//! for the engine (Dynamo's KV router and standalone indexer, llm-d's router) reads kvbridge by
//! changing only host and port (docs/dynamo-llm-d.md).
//!
//! Like the JetStream sink this edge is a reader of the ring and nothing else: each rank's
//! publisher thread walks the rank's ring with its own [`kvbridge_shm::RingReader`], re-encodes
//! every record as a vLLM `EventBatch` (`wire.rs`) and sends `[topic, seq, payload]`. Nothing in
//! ingest waits for it; a PUB never blocks (a subscriber whose pipe is full loses messages, as
//! with the engine, and replays).
//!
//! **Sequence numbers are the ring's.** Message `seq` carries the ring record `seq` of the
//! rank's ring: contiguous, and continuing across engine restarts (an engine restart is an
//! in-band clear in the ring, not a reset) and kvbridge restarts (the ring is adopted). Records
//! the reader lost (lapped) or found corrupt become one `AllBlocksCleared` batch numbered as the
//! last one lost, as the sink and gRPC do.
//!
//! **Replay** (`replay.rs`): the vLLM protocol on its own thread per rank; a start inside the
//! ring's window gets exactly start … newest, an older one the rank's current state (the
//! snapshot table, as gRPC late joiners get it) and then the retained tail.
//!
//! **vLLM #57789's wire** (`--publish-zmq-snapshot`, `snapshot.rs`; unmerged): the live seq
//! frame grows to 24 bytes, the ring seq then the ring's 16-byte identity (the publisher UUID of
//! the PR: the same across kvbridge restarts that adopt the ring, and new with a new ring, which
//! is the only time the numbering starts again); a rank with nothing to publish for
//! [`HEARTBEAT`] sends an empty batch, numbered as the last message it sent (the engine spends a
//! seq on it; kvbridge's seqs are the ring's, so a heartbeat repeats one, which every consumer of
//! the PR drops as already seen and counts as liveness); and a snapshot ROUTER per rank answers
//! with the rank's table at a cut. Without the flag the edge is byte for byte today's.
//!
//! Ports follow the engines' rule (docs/engine-wire.md §2.2): rank r binds PORT + r.

mod config;
mod metrics;
mod replay;
mod snapshot;
pub mod wire;

pub use config::{PublishZmqConfig, TcpEndpoint, DEFAULT_PUB_HWM, MAX_PUB_HWM};
use metrics::ClearCause;
pub(crate) use metrics::ZmqMetrics;

pub use replay::{MAX_ACTIVE, MAX_QUEUED, MAX_SNAPSHOTS, REPLY_BYTES_IN_FLIGHT};
pub use snapshot::{EVENTS_PER_CHUNK, MAX_REPLY_BYTES};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvbridge_shm::{ReadOutcome, SeekError};
use prost::Message;
use thiserror::Error;

use crate::metrics::Metrics;
use crate::proto::common::KvEventBatch;
use crate::ring::{RingHub, RingSet};
use crate::snapshot::RingTable;
pub use wire::{HashForm, WireLayout};

/// Starting the edge failed (a port taken, an endpoint ZMQ refuses): one line.
#[derive(Debug, Error)]
#[error("{flag} {endpoint}: cannot bind: {why}")]
pub struct PublishZmqError {
    flag: &'static str,
    endpoint: String,
    why: String,
}

/// What one rank's edge reads.
#[derive(Clone)]
pub struct RankSource {
    /// Engine DP rank (sets the port offset and the batch's rank).
    pub rank: u32,
    /// The rank's ring (the merged ring when there is one rank).
    pub hub: Arc<RingHub>,
    /// The ring's snapshot table, if kept (`--snapshot` not off).
    pub table: Option<Arc<RingTable>>,
}

/// One rank's bound sockets.
struct RankSockets {
    publish: zmq::Socket,
    replay: Option<zmq::Socket>,
    snapshot: Option<zmq::Socket>,
}

impl RankSockets {
    /// Binds rank `r`'s sockets: the PUB on `ctx`, the ROUTERs on `replay_ctx` (replies go out
    /// on an I/O thread of their own, never in front of the live PUB's messages).
    fn bind(
        cfg: &PublishZmqConfig,
        ctx: &zmq::Context,
        replay_ctx: &zmq::Context,
        r: &RankSource,
    ) -> Result<(RankSockets, Bound), PublishZmqError> {
        let (publish, pub_at) = bind(
            ctx,
            zmq::PUB,
            "--publish-zmq",
            &cfg.publish.for_rank(r.rank),
            |s| s.set_sndhwm(cfg.hwm as i32),
        )?;
        let replay = match &cfg.replay {
            Some(e) => Some(bind(
                replay_ctx,
                zmq::ROUTER,
                "--publish-zmq-replay",
                &e.for_rank(r.rank),
                |s| replay::configure(s, r.hub.as_ref()),
            )?),
            None => None,
        };
        let snapshot = match &cfg.snapshot {
            Some(e) => Some(bind(
                replay_ctx,
                zmq::ROUTER,
                "--publish-zmq-snapshot",
                &e.for_rank(r.rank),
                snapshot::configure,
            )?),
            None => None,
        };
        let bound = Bound {
            rank: r.rank,
            publish: pub_at,
            replay: replay.as_ref().map(|(_, a)| a.clone()),
            snapshot: snapshot.as_ref().map(|(_, a)| a.clone()),
        };
        let socks = RankSockets {
            publish,
            replay: replay.map(|(s, _)| s),
            snapshot: snapshot.map(|(s, _)| s),
        };
        Ok((socks, bound))
    }
}

/// The running edge: its threads and their stop flag.
pub struct ZmqPublisher {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// What each rank bound.
    pub bound: Vec<Bound>,
}

/// What one rank's edge bound (as the sockets report it: port 0 resolved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound {
    /// Engine DP rank.
    pub rank: u32,
    /// The PUB.
    pub publish: String,
    /// The replay ROUTER, if served.
    pub replay: Option<String>,
    /// The snapshot ROUTER, if served.
    pub snapshot: Option<String>,
}

/// How long a publisher thread sleeps on the ring's futex before it looks at its stop flag.
const WAIT: Duration = Duration::from_millis(200);

/// With `--publish-zmq-snapshot`: how long a rank may publish nothing before it sends a
/// heartbeat (vLLM #57789 sends one after a second idle; its consumers call a publisher stale
/// after 5 s of silence).
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// Creates a socket, applies `setup` and binds it. Options must be set before `bind`: libzmq
/// gives the connections a listener accepts the options the socket had when it was bound.
fn bind(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    flag: &'static str,
    endpoint: &str,
    setup: impl FnOnce(&zmq::Socket) -> zmq::Result<()>,
) -> Result<(zmq::Socket, String), PublishZmqError> {
    let err = |e: zmq::Error| PublishZmqError {
        flag,
        endpoint: endpoint.to_string(),
        why: e.to_string(),
    };
    let s = ctx.socket(kind).map_err(err)?;
    s.set_linger(0).map_err(err)?;
    setup(&s).map_err(err)?;
    s.bind(endpoint).map_err(err)?;
    let bound = s
        .get_last_endpoint()
        .map_err(err)?
        .unwrap_or_else(|_| endpoint.to_string());
    Ok((s, bound))
}

impl RankSource {
    /// What each rank's edge reads of `rings`: rank r's own ring and table (`tables` holds the
    /// merged ring's first, then rank r's at r + 1), or the merged ring and its table when
    /// there is one rank and no rank rings.
    pub fn of(rings: &RingSet, tables: &[Arc<RingTable>]) -> Vec<RankSource> {
        if rings.rank_hubs.is_empty() {
            let rank = rings.ingest_ranks.first().copied().unwrap_or(0);
            return vec![RankSource {
                rank,
                hub: rings.merged.clone(),
                table: tables.first().cloned(),
            }];
        }
        rings
            .rank_hubs
            .iter()
            .zip(&rings.ingest_ranks)
            .enumerate()
            .map(|(i, (hub, &rank))| RankSource {
                rank,
                hub: hub.clone(),
                table: tables.get(i + 1).cloned(),
            })
            .collect()
    }
}

impl ZmqPublisher {
    /// Starts the edge on `rings` (with their snapshot tables, the merged ring's first; empty
    /// with `--snapshot off`): see [`start_on`](Self::start_on).
    pub fn start(
        cfg: &PublishZmqConfig,
        engine_topic: &str,
        rings: &RingSet,
        tables: &[Arc<RingTable>],
        metrics: &Metrics,
    ) -> Result<ZmqPublisher, PublishZmqError> {
        Self::start_on(cfg, engine_topic, RankSource::of(rings, tables), metrics)
    }

    /// Binds every rank's sockets (an error before anything runs) and starts the threads.
    /// `engine_topic` is the topic used unless `--publish-zmq-topic` is given.
    pub fn start_on(
        cfg: &PublishZmqConfig,
        engine_topic: &str,
        ranks: Vec<RankSource>,
        metrics: &Metrics,
    ) -> Result<ZmqPublisher, PublishZmqError> {
        let ctx = zmq::Context::new();
        // Replies go out on an I/O thread of their own (see `RankSockets::bind`).
        let replay_ctx = zmq::Context::new();
        let zm = ZmqMetrics::new(metrics);
        let topic = cfg
            .topic
            .clone()
            .unwrap_or_else(|| engine_topic.to_string());
        let stop = Arc::new(AtomicBool::new(false));
        let mut sockets = Vec::new();
        let mut bound = Vec::new();
        for r in &ranks {
            let (socks, b) = RankSockets::bind(cfg, &ctx, &replay_ctx, r)?;
            tracing::info!(rank = r.rank, publish = %b.publish,
                replay = %b.replay.as_deref().unwrap_or("off"),
                snapshot = %b.snapshot.as_deref().unwrap_or("off"),
                ring = r.hub.label(), layout = ?cfg.layout, topic = %topic,
                "publishing on the engine ZMQ wire");
            zm.init_rank(r.rank, b.replay.is_some(), b.snapshot.is_some());
            bound.push(b);
            sockets.push(socks);
        }
        let mut threads = Vec::new();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .expect("spawn a ZMQ edge thread")
        };
        for (r, socks) in ranks.into_iter().zip(sockets) {
            let p = Publisher {
                rank: r.rank,
                hub: r.hub.clone(),
                sock: socks.publish,
                topic: topic.clone().into_bytes(),
                layout: cfg.layout,
                metrics: zm.clone(),
                stop: stop.clone(),
                stream_id: socks.snapshot.is_some(),
            };
            threads.push(spawn(
                format!("zmq-pub-{}", r.rank),
                Box::new(move || p.run()),
            ));
            if let Some(sock) = socks.snapshot {
                let s =
                    snapshot::Server::new(r.clone(), sock, cfg.layout, zm.clone(), stop.clone());
                threads.push(spawn("zmq-snapshot".into(), Box::new(move || s.run())));
            }
            if let Some(sock) = socks.replay {
                let t = topic.clone().into_bytes();
                let s = replay::Server::new(r, sock, t, cfg.layout, zm.clone(), stop.clone());
                threads.push(spawn("zmq-replay".into(), Box::new(move || s.run())));
            }
        }
        Ok(ZmqPublisher {
            stop,
            threads,
            bound,
        })
    }

    /// Stops every thread and closes the sockets.
    pub fn shutdown(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// The message `seq` frame: 8 bytes, big-endian.
fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// What one ring record becomes on the wire.
pub(crate) enum Translated {
    /// The payload of record `seq` (its events re-encoded).
    Batch,
    /// The record could not be decoded: an `AllBlocksCleared` stands in for it.
    Undecodable,
}

/// The hash form of a ring record with flags `flags`.
fn form_of(flags: u32) -> HashForm {
    if flags & crate::ring::FLAG_SIGNED_HASHES != 0 {
        HashForm::Signed
    } else {
        HashForm::Unsigned
    }
}

/// Re-encodes ring record `bytes` (record flags `flags`) for rank `rank` into `out`.
pub(crate) fn translate(
    bytes: &[u8],
    flags: u32,
    rank: u32,
    layout: WireLayout,
    out: &mut Vec<u8>,
) -> Translated {
    match KvEventBatch::decode(bytes) {
        Ok(b) => {
            wire::encode_batch(&b, i64::from(rank), layout, form_of(flags), out);
            Translated::Batch
        }
        Err(_) => {
            wire::encode_cleared(crate::clock::unix_seconds(), i64::from(rank), layout, out);
            Translated::Undecodable
        }
    }
}

/// One rank's live publisher.
struct Publisher {
    rank: u32,
    hub: Arc<RingHub>,
    sock: zmq::Socket,
    topic: Vec<u8>,
    layout: WireLayout,
    metrics: ZmqMetrics,
    stop: Arc<AtomicBool>,
    /// vLLM #57789's wire: 24-byte seq frames with the ring's identity, and heartbeats.
    stream_id: bool,
}

impl Publisher {
    fn run(self) {
        let rank = self.rank.to_string();
        let published = self.metrics.published.with_label_values(&[&rank]);
        let bytes = self.metrics.published_bytes.with_label_values(&[&rank]);
        let mut reader = self.hub.reader();
        // No busy-spin before the futex sleep: what follows a record here is a hand-off to this
        // context's ZMQ I/O thread, and on a small machine a spinning reader takes the CPU that
        // thread (and the subscribers) need. Measured in `kvbridge bench --zmq-subscribers 10`
        // on 2 cores, three runs each way: p50 over the floor 1.26–1.30× without the spin,
        // 1.35–1.39× with it, and 10–20 % less CPU per published record.
        reader.set_spin(Duration::ZERO);
        // Live from now on: earlier records are what replay is for.
        let mut next = self.hub.newest() + 1;
        let _ = reader.seek(next);
        let mut record = Vec::new();
        let mut payload = Vec::new();
        let mut id = Identity {
            bytes: reader.identity(),
            last: next - 1,
            sent_at: std::time::Instant::now(),
        };
        while !self.stop.load(Ordering::Relaxed) && self.hub.failure().is_none() {
            if self.stream_id && id.sent_at.elapsed() >= HEARTBEAT {
                self.heartbeat(&mut id, &mut payload);
            }
            if reader.position() != next {
                if let Err(SeekError::TooOld { oldest, .. }) = reader.seek(next) {
                    self.clear(oldest - 1, ClearCause::RingLapped, &mut payload, &mut id);
                    next = oldest;
                    continue;
                }
            }
            let (seq, flags) = match reader.next_blocking(WAIT) {
                ReadOutcome::Record(v) => {
                    let (seq, flags) = (v.seq(), v.meta().flags);
                    if !v.copy_to(&mut record) {
                        continue; // overwritten during the copy: the seek reports it
                    }
                    (seq, flags)
                }
                ReadOutcome::Lapped { resume_at, .. } => {
                    self.clear(resume_at - 1, ClearCause::RingLapped, &mut payload, &mut id);
                    next = resume_at;
                    continue;
                }
                ReadOutcome::Corrupt { seq, resume_at } => {
                    self.hub.note_corrupt(seq);
                    self.clear(seq, ClearCause::Corrupt, &mut payload, &mut id);
                    next = resume_at;
                    continue;
                }
                ReadOutcome::Empty | ReadOutcome::WriterGone => continue,
                ReadOutcome::RingReset { .. } => {
                    // A new ring: a new identity, its numbering from its own start.
                    id.bytes = reader.identity();
                    next = reader.position();
                    self.clear(
                        next.saturating_sub(1),
                        ClearCause::RingReplaced,
                        &mut payload,
                        &mut id,
                    );
                    continue;
                }
                ReadOutcome::Truncated => break,
            };
            next = seq + 1;
            if let Translated::Undecodable =
                translate(&record, flags, self.rank, self.layout, &mut payload)
            {
                self.metrics
                    .cleared
                    .with_label_values(&[&rank, ClearCause::Undecodable.label()])
                    .inc();
            }
            self.send(seq, &payload, &mut id);
            published.inc();
            bytes.inc_by(payload.len() as u64);
        }
    }

    /// Publishes an `AllBlocksCleared` numbered `seq` for records this reader could not read.
    fn clear(&self, seq: u64, cause: ClearCause, payload: &mut Vec<u8>, id: &mut Identity) {
        let cause = cause.label();
        tracing::warn!(rank = self.rank, seq, cause,
            "ring records were never published on the ZMQ wire: publishing an AllBlocksCleared in their place");
        self.metrics
            .cleared
            .with_label_values(&[&self.rank.to_string(), cause])
            .inc();
        wire::encode_cleared(
            crate::clock::unix_seconds(),
            i64::from(self.rank),
            self.layout,
            payload,
        );
        self.send(seq, payload, id);
    }

    /// An empty batch numbered as the last message sent (see the module docs).
    fn heartbeat(&self, id: &mut Identity, payload: &mut Vec<u8>) {
        let empty = KvEventBatch {
            timestamp: crate::clock::unix_seconds(),
            ..Default::default()
        };
        wire::encode_batch(
            &empty,
            i64::from(self.rank),
            self.layout,
            HashForm::Unsigned,
            payload,
        );
        self.send(id.last, payload, id);
        self.metrics
            .heartbeats
            .with_label_values(&[&self.rank.to_string()])
            .inc();
    }

    fn send(&self, seq: u64, payload: &[u8], id: &mut Identity) {
        let mut frame = [0u8; 24];
        frame[..8].copy_from_slice(&seq_frame(seq));
        frame[8..].copy_from_slice(&id.bytes);
        let seq_bytes = if self.stream_id {
            &frame[..]
        } else {
            &frame[..8]
        };
        let frames: [&[u8]; 3] = [&self.topic, seq_bytes, payload];
        // A PUB never blocks; an error here is a closed context at shutdown.
        if let Err(e) = self.sock.send_multipart(frames, 0) {
            tracing::debug!(rank = self.rank, error = %e, "ZMQ publish failed");
        }
        id.last = seq;
        id.sent_at = std::time::Instant::now();
    }
}

/// What the live publisher's messages say of the stream on vLLM #57789's wire.
struct Identity {
    /// The ring's identity, the seq frame's last 16 bytes.
    bytes: [u8; 16],
    /// The seq of the last message sent (a heartbeat repeats it).
    last: u64,
    /// When the last message was sent.
    sent_at: std::time::Instant,
}
