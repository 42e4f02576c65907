//! One rank's snapshot ROUTER on vLLM #57789's wire (`--publish-zmq-snapshot`; unmerged, read at
//! `vMaroon/vllm` @ 08ee3e5, docs/engine-wire.md §13): the engine's snapshot service, answered
//! from kvbridge's snapshot table, so that a consumer written for it (llm-d-router #2946, the
//! PR's reference client) bootstraps from kvbridge in front of any engine release.
//!
//! A request is any message of one frame after its envelope (a REQ's `[identity, "", body]` or
//! a DEALER's `[identity, body]`); the body is not read. The reply is the envelope, then
//! `[cut (8 bytes, signed BE), identity (16), chunk, …]`:
//!
//! * `cut` is the ring record the state includes: the live PUB's messages continue at cut + 1,
//!   numbered as the ring numbers them, under the same identity (the ring's, [`RingReader::identity`]);
//! * each chunk is a `KVEventBatch` of at most [`EVENTS_PER_CHUNK`] events, `BlockStored`
//!   only: the table's blocks, every one after its parent where the table holds the parent, a
//!   further store per further physical copy. A state, not a history: nothing is removed, and
//!   the `AllBlocksCleared` a gRPC snapshot begins with is left out (a consumer builds the
//!   state into a fresh index);
//! * `-2` and no chunk: no state to give. There is no table (`--snapshot off`), the table is
//!   incomplete (rebuilt from the ring alone after a lost checkpoint, until the next clear), or
//!   the reply would pass [`MAX_REPLY_BYTES`]. kvbridge never answers `-1` (nothing recorded):
//!   a ring always has a cut, and an empty one is a state of no blocks.
//!
//! Requests that arrive together get one reply built once, and it is reused while the table's
//! cut has not moved. A requester whose pipe is full is
//! skipped (it asks again, as with the engine): nothing here waits for a consumer.
//!
//! [`RingReader::identity`]: kvbridge_shm::RingReader::identity

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use prost::Message;

use super::{wire, RankSource, WireLayout, ZmqMetrics};
use crate::proto::common::{kv_cache_event::Data, KvEventBatch};

/// Events per chunk, as the engine's recorder cuts them.
pub const EVENTS_PER_CHUNK: usize = 256;
/// Largest reply, as the engine's recorder bounds it; a larger state is answered `-2`.
pub const MAX_REPLY_BYTES: usize = 256 << 20;
/// Requests read per turn (and replies queued per requester: the send high-water mark).
const MAX_REQUESTS: usize = 32;
/// Largest request accepted (libzmq disconnects a peer that sends more).
const MAX_REQUEST_BYTES: i64 = 256;
/// The `cut` of a reply with no state.
const UNAVAILABLE: i64 = -2;

/// Socket options of a snapshot ROUTER, set before it binds.
pub(super) fn configure(s: &zmq::Socket) -> zmq::Result<()> {
    s.set_maxmsgsize(MAX_REQUEST_BYTES)?;
    s.set_sndhwm(MAX_REQUESTS as i32)?;
    s.set_rcvhwm(MAX_REQUESTS as i32 * 4)?;
    Ok(())
}

/// How a snapshot request was answered (the `outcome` of
/// `kvbridge_zmq_snapshot_requests_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The state at a cut.
    Served,
    /// `-2`: no table, an incomplete one, or a state above [`MAX_REPLY_BYTES`].
    Unavailable,
    /// The requester's pipe was full: not answered (it asks again).
    Dropped,
}

impl Outcome {
    pub(super) const ALL: [Outcome; 3] = [Outcome::Served, Outcome::Unavailable, Outcome::Dropped];

    pub(super) fn label(self) -> &'static str {
        match self {
            Outcome::Served => "served",
            Outcome::Unavailable => "unavailable",
            Outcome::Dropped => "dropped",
        }
    }
}

/// One rank's snapshot service.
pub(super) struct Server {
    /// The rank, its ring and its table.
    src: RankSource,
    label: String,
    sock: zmq::Socket,
    layout: WireLayout,
    metrics: ZmqMetrics,
    stop: Arc<AtomicBool>,
    /// The last state served (its frames after the envelope), reused while the table's cut and
    /// the ring's identity have not moved: an idle rank's bootstraps cost one build.
    last: Option<Vec<Vec<u8>>>,
}

impl Server {
    pub(super) fn new(
        src: RankSource,
        sock: zmq::Socket,
        layout: WireLayout,
        metrics: ZmqMetrics,
        stop: Arc<AtomicBool>,
    ) -> Self {
        Server {
            label: src.rank.to_string(),
            src,
            sock,
            layout,
            metrics,
            stop,
            last: None,
        }
    }

    pub(super) fn run(mut self) {
        while !self.stop.load(Ordering::Relaxed) && self.src.hub.failure().is_none() {
            if self.sock.poll(zmq::POLLIN, 100).unwrap_or(0) == 0 {
                continue;
            }
            let mut envelopes = Vec::new();
            while envelopes.len() < MAX_REQUESTS {
                let Ok(frames) = self.sock.recv_multipart(zmq::DONTWAIT) else {
                    break;
                };
                // The envelope: up to and including the REQ delimiter, else the identity alone.
                let end = frames
                    .iter()
                    .position(|f| f.is_empty())
                    .map_or(1, |i| i + 1);
                envelopes.push(frames[..end.min(frames.len())].to_vec());
            }
            if envelopes.is_empty() {
                continue;
            }
            let (reply, outcome) = self.reply();
            for env in &envelopes {
                let frames = env
                    .iter()
                    .map(Vec::as_slice)
                    .chain(reply.iter().map(Vec::as_slice));
                let sent = self.sock.send_multipart(frames, zmq::DONTWAIT);
                let outcome = if sent.is_ok() {
                    outcome
                } else {
                    Outcome::Dropped
                };
                self.metrics
                    .snapshot_requests
                    .with_label_values(&[&self.label, outcome.label()])
                    .inc();
            }
        }
    }

    /// The reply's frames after the envelope, and what it is.
    fn reply(&mut self) -> (Vec<Vec<u8>>, Outcome) {
        let identity = self.src.hub.reader().identity().to_vec();
        let unavailable = |why: &str| {
            tracing::info!(rank = self.src.rank, why, "ZMQ snapshot unavailable");
            (
                vec![UNAVAILABLE.to_be_bytes().to_vec(), identity.clone()],
                Outcome::Unavailable,
            )
        };
        let Some(table) = &self.src.table else {
            return unavailable("no snapshot table (--snapshot off)");
        };
        let cut = (table.with_table(|t| t.cut()) as i64).to_be_bytes();
        if let Some(last) = &self.last {
            if last[0] == cut && last[1] == identity {
                return (last.clone(), Outcome::Served);
            }
        }
        let state = table.state();
        if state.unknown_before != 0 {
            return unavailable("the table is incomplete until the next clear");
        }
        let mut out = vec![(state.cut as i64).to_be_bytes().to_vec(), identity.clone()];
        let mut size = 0;
        for chunk in program(&state.events, self.src.rank, self.layout) {
            size += chunk.len();
            if size > MAX_REPLY_BYTES {
                return unavailable("the state is above the reply limit");
            }
            out.push(chunk);
        }
        self.last = Some(out.clone());
        (out, Outcome::Served)
    }
}

/// The table's events as engine-wire `KVEventBatch`es of at most [`EVENTS_PER_CHUNK`] events
/// each, without the leading `cleared`.
pub(super) fn program(bodies: &[Vec<u8>], rank: u32, layout: WireLayout) -> Vec<Vec<u8>> {
    let ts = crate::clock::unix_seconds();
    let mut chunks = Vec::new();
    let mut cur = KvEventBatch {
        timestamp: ts,
        ..Default::default()
    };
    let mut count = 0;
    let mut flush = |cur: &mut KvEventBatch, count: &mut usize| {
        if !cur.events.is_empty() {
            let mut out = Vec::new();
            wire::encode_batch(
                cur,
                i64::from(rank),
                layout,
                wire::HashForm::Unsigned,
                &mut out,
            );
            chunks.push(out);
            cur.events.clear();
            *count = 0;
        }
    };
    for body in bodies {
        // A body is the `events` field of a `KvEventBatch`, and so a batch of its own.
        let Ok(batch) = KvEventBatch::decode(body.as_slice()) else {
            continue;
        };
        for ev in batch.events {
            let n = match &ev.data {
                Some(Data::Stored(s)) => wire::wire_events(s),
                _ => continue,
            };
            if count + n > EVENTS_PER_CHUNK {
                flush(&mut cur, &mut count);
            }
            count += n;
            cur.events.push(ev);
        }
    }
    flush(&mut cur, &mut count);
    chunks
}
