//! One rank's replay ROUTER: the vLLM protocol (docs/engine-wire.md §7), served from the ring
//! and the snapshot table on a thread of its own, with a ZMQ I/O thread of its own,
//! so that neither ingest nor the live PUB ever waits for a replay.
//!
//! A request is `[identity, "", start_seq (8 bytes BE)]`; every reply is
//! `[identity, "", topic, seq, payload]`, and the last one the end marker `[identity, "", "",
//! ff×8, ""]`. What a start gets, against the ring's window O … N at the time the replay begins:
//!
//! * O ≤ start ≤ N: exactly start … N;
//! * start > N: the end marker alone (as the engine answers a future start);
//! * start < O (a fresh consumer asks from 0, or one that was away while the ring wrapped): the
//!   rank's current state — the snapshot table's chunks at its cut C (an `AllBlocksCleared`,
//!   then the live block table as `BlockStored` batches, parents first, numbered up to C), then
//!   C + 1 … N from the ring. Without a table: an `AllBlocksCleared` numbered O − 1, then O … N.
//!
//! Bounds: at most [`MAX_ACTIVE`] replays are sent at once (at most [`MAX_SNAPSHOTS`] of them
//! still sending table chunks), at most [`MAX_QUEUED`] more wait (beyond that a request is
//! dropped unanswered and counted `busy`, as an engine drops what it cannot take); each peer's
//! reply pipe holds at most the ROUTER's send high-water mark, sized so that a consumer that does
//! not read has at most [`REPLY_BYTES_IN_FLIGHT`] queued (plus the one message its replay holds
//! back), and the ROUTER refuses (disconnects) peers that send messages larger than a request.
//! A replay whose peer went away, or whose tail the ring overwrote meanwhile, ends without an end
//! marker (counted `incomplete`): the consumer asks again. So does one whose peer read nothing
//! for [`STALL`] (counted `stalled`), so that consumers that never read cannot hold every slot.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvbridge_shm::{ReadOutcome, RingReader, SeekError};

use super::{seq_frame, translate, wire, RankSource, WireLayout, ZmqMetrics};
use crate::ring::RingHub;
use crate::snapshot::{Chunks, RingTable};

/// Replays sent at once, per rank.
pub const MAX_ACTIVE: usize = 16;
/// Of those, replays still sending snapshot chunks (each holds the chunks it shares).
pub const MAX_SNAPSHOTS: usize = 4;
/// Requests waiting for a slot, per rank; more are dropped (`busy`).
pub const MAX_QUEUED: usize = 4096;
/// Reply bytes one consumer can have queued in its pipe (sets the send high-water mark).
pub const REPLY_BYTES_IN_FLIGHT: usize = 32 << 20;
/// Messages a replay sends before the next one gets its turn.
const BURST: usize = 256;
/// Largest request accepted on the socket (libzmq disconnects a peer that sends more).
const MAX_REQUEST_BYTES: i64 = 64;
/// The end marker's seq.
const END_SEQ: u64 = u64::MAX;
/// How long a replay may find its peer's pipe full before it is given up (`stalled`): a
/// consumer that never reads would otherwise hold a replay slot, and a snapshot, for good.
const STALL: std::time::Duration = std::time::Duration::from_secs(10);

/// Socket options of a replay ROUTER: mandatory routing (a full peer pipe is `EAGAIN`, not a
/// silent drop, so the replay waits for it), a small message limit, and a send high-water mark
/// of [`REPLY_BYTES_IN_FLIGHT`] over the ring's largest record. Set before the socket is bound
/// (the connections it accepts take the options it had then).
pub(super) fn configure(s: &zmq::Socket, hub: &RingHub) -> zmq::Result<()> {
    s.set_router_mandatory(true)?;
    s.set_maxmsgsize(MAX_REQUEST_BYTES)?;
    // A record is at most a quarter of the ring (the split threshold is at most that).
    let largest = (hub.position().capacity as usize / 4).max(1);
    let hwm = (REPLY_BYTES_IN_FLIGHT / largest).clamp(16, 10_000);
    s.set_sndhwm(hwm as i32)?;
    s.set_rcvhwm(MAX_QUEUED as i32)?;
    Ok(())
}

/// How a replay request ended (the `outcome` of `kvbridge_zmq_replay_requests_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// start … newest from the ring.
    Window,
    /// The rank's state (snapshot or clear), then the ring.
    State,
    /// A start beyond newest: the end marker only.
    Future,
    /// The peer left, or the ring overwrote the tail, mid-replay: no end marker.
    Incomplete,
    /// The peer read nothing for [`STALL`].
    Stalled,
    /// Not `["", 8 bytes]`: dropped.
    Malformed,
    /// Every slot and the queue full: dropped unanswered.
    Busy,
}

impl Outcome {
    pub(super) const ALL: [Outcome; 7] = [
        Outcome::Window,
        Outcome::State,
        Outcome::Future,
        Outcome::Incomplete,
        Outcome::Stalled,
        Outcome::Malformed,
        Outcome::Busy,
    ];

    pub(super) fn label(self) -> &'static str {
        match self {
            Outcome::Window => "window",
            Outcome::State => "state",
            Outcome::Future => "future",
            Outcome::Incomplete => "incomplete",
            Outcome::Stalled => "stalled",
            Outcome::Malformed => "malformed",
            Outcome::Busy => "busy",
        }
    }
}

struct Request {
    id: Vec<u8>,
    start: u64,
}

/// One replay in progress.
struct Replay {
    id: Vec<u8>,
    /// Snapshot chunks still to send (`seq` of the first one, and the shared chunks).
    chunks: Option<(u64, usize, Arc<Chunks>)>,
    /// The ring records `next ..= end` still to send.
    next: u64,
    end: u64,
    reader: RingReader,
    /// A message the peer's pipe did not take yet.
    held: Option<(u64, Vec<u8>)>,
    /// Since when the peer's pipe has been full (no message taken).
    full_since: Option<std::time::Instant>,
    /// An `AllBlocksCleared` to send first (no table), numbered so.
    clear_first: Option<u64>,
    outcome: Outcome,
}

enum Step {
    /// Sent its burst; more to send.
    More,
    /// The peer's pipe is full.
    Blocked,
    /// Finished (end marker sent, or given up).
    Done,
}

pub(super) struct Server {
    rank: u32,
    label: String,
    hub: Arc<RingHub>,
    table: Option<Arc<RingTable>>,
    sock: zmq::Socket,
    topic: Vec<u8>,
    layout: WireLayout,
    metrics: ZmqMetrics,
    stop: Arc<AtomicBool>,
    queue: VecDeque<Request>,
    active: Vec<Replay>,
    /// The last snapshot built, reused while the table's cut has not moved.
    last_snapshot: Option<Arc<Chunks>>,
}

impl Server {
    pub(super) fn new(
        src: RankSource,
        sock: zmq::Socket,
        topic: Vec<u8>,
        layout: WireLayout,
        metrics: ZmqMetrics,
        stop: Arc<AtomicBool>,
    ) -> Self {
        Server {
            rank: src.rank,
            label: src.rank.to_string(),
            hub: src.hub,
            table: src.table,
            sock,
            topic,
            layout,
            metrics,
            stop,
            queue: VecDeque::new(),
            active: Vec::new(),
            last_snapshot: None,
        }
    }

    fn count(&self, outcome: Outcome) {
        self.metrics
            .replay_requests
            .with_label_values(&[&self.label, outcome.label()])
            .inc();
    }

    pub(super) fn run(mut self) {
        let mut blocked = false;
        while !self.stop.load(Ordering::Relaxed) && self.hub.failure().is_none() {
            let wait_ms = if self.active.is_empty() {
                100
            } else if blocked {
                1
            } else {
                0
            };
            if self.sock.poll(zmq::POLLIN, wait_ms).unwrap_or(0) > 0 {
                self.take_requests();
            }
            self.activate();
            blocked = !self.active.is_empty();
            let mut i = 0;
            while i < self.active.len() {
                match self.step(i) {
                    Step::More => {
                        blocked = false;
                        i += 1;
                    }
                    Step::Blocked
                        if self.active[i]
                            .full_since
                            .is_some_and(|t| t.elapsed() > STALL) =>
                    {
                        tracing::debug!(
                            rank = self.rank,
                            "ZMQ replay given up: the peer read nothing for 10 s"
                        );
                        self.count(Outcome::Stalled);
                        self.active.swap_remove(i);
                    }
                    Step::Blocked => i += 1,
                    Step::Done => {
                        self.active.swap_remove(i);
                    }
                }
            }
            self.metrics
                .replays_active
                .with_label_values(&[&self.label])
                .set(self.active.len() as i64);
            self.metrics
                .replays_queued
                .with_label_values(&[&self.label])
                .set(self.queue.len() as i64);
        }
    }

    /// Reads every waiting request: well-formed ones are queued, the rest counted and dropped.
    fn take_requests(&mut self) {
        while let Ok(frames) = self.sock.recv_multipart(zmq::DONTWAIT) {
            match frames.as_slice() {
                [id, empty, start] if empty.is_empty() && start.len() == 8 => {
                    if self.queue.len() >= MAX_QUEUED {
                        self.count(Outcome::Busy);
                        continue;
                    }
                    let start = u64::from_be_bytes(start[..].try_into().expect("8 bytes"));
                    self.queue.push_back(Request {
                        id: id.clone(),
                        start,
                    });
                }
                _ => {
                    self.count(Outcome::Malformed);
                    tracing::debug!(
                        rank = self.rank,
                        frames = frames.len(),
                        "malformed ZMQ replay request dropped"
                    );
                }
            }
        }
    }

    /// Starts queued replays while slots are free (a replay that needs the table waits while
    /// [`MAX_SNAPSHOTS`] others send chunks).
    fn activate(&mut self) {
        if self.active.len() >= MAX_ACTIVE || self.queue.is_empty() {
            return;
        }
        // One view of the window for the whole pass (it takes the writer lock ingest takes):
        // the queue can hold thousands of requests, most of them skipped while the snapshot
        // slots are full, and this runs on every turn of the loop.
        let (oldest, newest) = self.hub.window();
        let oldest = self.hub.readable_from(oldest);
        let mut i = 0;
        while self.active.len() < MAX_ACTIVE && i < self.queue.len() {
            let start = self.queue[i].start;
            let needs_state = start < oldest && start <= newest;
            let snapshots = self.active.iter().filter(|r| r.chunks.is_some()).count();
            if needs_state && self.table.is_some() && snapshots >= MAX_SNAPSHOTS {
                i += 1;
                continue;
            }
            let req = self.queue.remove(i).expect("index in range");
            let mut r = Replay {
                id: req.id,
                chunks: None,
                next: start,
                end: newest,
                reader: self.hub.reader(),
                held: None,
                full_since: None,
                clear_first: None,
                outcome: Outcome::Window,
            };
            if start > newest {
                r.outcome = Outcome::Future;
            } else if needs_state {
                r.outcome = Outcome::State;
                match self.snapshot() {
                    Some(c) => {
                        self.metrics
                            .snapshot_replays
                            .with_label_values(&[&self.label])
                            .inc();
                        let first = c.cut + 1 - c.chunks.len() as u64;
                        r.next = c.cut + 1;
                        r.end = self.hub.newest().max(c.cut);
                        r.chunks = Some((first, 0, c));
                    }
                    None => {
                        r.clear_first = Some(oldest - 1);
                        r.next = oldest;
                    }
                }
            }
            self.active.push(r);
        }
    }

    /// The table's snapshot at its current cut (shared with replays that took it at the same
    /// cut); `None` without a table or when the table cannot be cut into numbered chunks.
    fn snapshot(&mut self) -> Option<Arc<Chunks>> {
        let table = self.table.as_ref()?;
        let cut = table.with_table(|t| t.cut());
        if let Some(c) = &self.last_snapshot {
            if c.cut == cut {
                return Some(c.clone());
            }
        }
        let c = Arc::new(table.snapshot()?);
        self.last_snapshot = Some(c.clone());
        Some(c)
    }

    /// The next message of replay `i`: `None` when only the end marker is left; `Err` when the
    /// ring no longer holds what it must send.
    fn produce(&mut self, i: usize) -> Result<Option<(u64, Vec<u8>)>, &'static str> {
        let (rank, layout) = (self.rank, self.layout);
        let r = &mut self.active[i];
        let mut out = Vec::new();
        if let Some(seq) = r.clear_first {
            wire::encode_cleared(
                crate::clock::unix_seconds(),
                i64::from(rank),
                layout,
                &mut out,
            );
            return Ok(Some((seq, out)));
        }
        if let Some((first, k, c)) = &r.chunks {
            // (a state from the table: the engine's form is not kept per block)
            translate(&c.chunks[*k], 0, rank, layout, &mut out);
            return Ok(Some((first + *k as u64, out)));
        }
        let seq = r.next;
        if seq > r.end {
            return Ok(None);
        }
        if r.reader.position() != seq {
            if let Err(SeekError::TooOld { .. }) = r.reader.seek(seq) {
                return Err("lapped");
            }
        }
        let mut record = Vec::new();
        loop {
            match r.reader.next() {
                ReadOutcome::Record(v) => {
                    let flags = v.meta().flags;
                    if !v.copy_to(&mut record) {
                        return Err("lapped");
                    }
                    translate(&record, flags, rank, layout, &mut out);
                    return Ok(Some((seq, out)));
                }
                ReadOutcome::Corrupt { .. } => {
                    wire::encode_cleared(
                        crate::clock::unix_seconds(),
                        i64::from(rank),
                        layout,
                        &mut out,
                    );
                    return Ok(Some((seq, out)));
                }
                ReadOutcome::RingReset { .. } => continue,
                _ => return Err("lapped"),
            }
        }
    }

    /// Advances replay `i` past the message just sent.
    fn advance(&mut self, i: usize) {
        let r = &mut self.active[i];
        if r.clear_first.take().is_some() {
            return;
        }
        if let Some((_, k, c)) = &mut r.chunks {
            *k += 1;
            if *k == c.chunks.len() {
                r.chunks = None;
            }
            return;
        }
        r.next += 1;
    }

    /// Sends up to [`BURST`] messages of replay `i`.
    fn step(&mut self, i: usize) -> Step {
        for _ in 0..BURST {
            let msg = match self.active[i].held.take() {
                Some(m) => Ok(Some(m)),
                None => self.produce(i),
            };
            let (seq, payload) = match msg {
                Ok(Some(m)) => m,
                Ok(None) => (END_SEQ, Vec::new()),
                Err(why) => {
                    tracing::debug!(rank = self.rank, why, "ZMQ replay ended incomplete");
                    self.count(Outcome::Incomplete);
                    return Step::Done;
                }
            };
            let end = seq == END_SEQ;
            let r = &self.active[i];
            let topic: &[u8] = if end { b"" } else { &self.topic };
            let frames: [&[u8]; 5] = [&r.id, b"", topic, &seq_frame(seq), &payload];
            match self.sock.send_multipart(frames, zmq::DONTWAIT) {
                Ok(()) => {
                    if end {
                        let outcome = r.outcome;
                        self.count(outcome);
                        return Step::Done;
                    }
                    self.metrics
                        .replay_bytes
                        .with_label_values(&[&self.label])
                        .inc_by(payload.len() as u64);
                    self.active[i].full_since = None;
                    self.advance(i);
                }
                Err(zmq::Error::EAGAIN) => {
                    let r = &mut self.active[i];
                    r.held = Some((seq, payload));
                    r.full_since.get_or_insert_with(std::time::Instant::now);
                    return Step::Blocked;
                }
                Err(e) => {
                    // EHOSTUNREACH: the peer is gone.
                    tracing::debug!(rank = self.rank, error = %e, "ZMQ replay peer gone");
                    self.count(Outcome::Incomplete);
                    return Step::Done;
                }
            }
        }
        Step::More
    }
}
