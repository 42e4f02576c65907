//! The per-publisher state machine of docs/engine-wire.md §8, free of sockets so that it can be
//! tested exhaustively.
//!
//! One [`RankState`] follows one engine publisher (one DP rank). It sees each live batch's engine
//! sequence number and bytes and decides: apply it, drop it as a copy of a batch already applied,
//! fill a gap through the engine's replay service, or report a discontinuity in band (a
//! synthesized `cleared` event) before moving on. Nothing is ever skipped silently: every way of
//! losing batches ends in a clear that downstream indexes act on (docs/smg-api.md §6.4).
//!
//! **Same batch, or a new engine incarnation?** Where the publisher names its epoch (the
//! engines' next wire, docs/engine-wire.md §13: vLLM #57789's UUID, SGLang #34407's
//! `sgl-kv-epoch`), the epoch decides ([`RankState::on_live`]). Today's wire has no incarnation
//! id, and neither a sequence number going back nor a new connection proves a restart: a
//! publisher that connects to kvbridge re-delivers, after a reconnect, batches kvbridge already
//! applied through a replay, and a restarted engine that published more than kvbridge had seen
//! looks like a forward gap.
//! The bytes decide instead. Every batch carries the engine's wall-clock `ts`, so two
//! incarnations never publish the same bytes at the same seq: the state machine keeps a
//! [`digest`] of each applied batch (a window of the recent ones in memory; the last one in the
//! ring's records, so that it survives a kvbridge restart), and
//!
//! - a batch at a seq ≤ `last` whose digest matches what was applied there is a copy, dropped
//!   and counted, whatever the connection did; any other is a new incarnation;
//! - every replay asks from `last` itself, not `last + 1`, and compares: a different batch at
//!   `last`, or nothing at or after it, is a new incarnation (an in-band clear, then the new
//!   incarnation's history from 0);
//! - after a reconnect (or a kvbridge start on an adopted ring), the first batch past `last` is
//!   checked the same way before it is applied, when a replay endpoint is known.

mod fill;

use std::collections::VecDeque;

use crate::ingest::wire::Epoch;
use crate::ingest::RankMetrics;
use crate::ring::ClearCause;

/// The digest kept of an engine batch: CRC-32C of its bytes, never 0 (0 marks "not recorded" in
/// the ring's records, see shm/LAYOUT.md §4). Stable across builds and machines, because a
/// restarted kvbridge compares it with what the engine replays.
pub fn digest(payload: &[u8]) -> u32 {
    crc32c::crc32c(payload).max(1)
}

/// What the ring says was applied of one rank before this process started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// A new ring: nothing of this rank was ever delivered to anyone.
    New,
    /// An adopted ring that holds no engine batch of this rank (overwritten by other ranks, or
    /// never published): what readers hold of it is unknown, so the first batch applied is
    /// preceded by a clear.
    Unknown,
    /// The last engine batch applied: its seq and [`digest`] (0: not recorded, a ring written
    /// by a kvbridge that did not record digests: it cannot be proven, and is taken as different).
    Applied {
        /// Engine sequence number.
        seq: u64,
        /// Its digest.
        digest: u32,
    },
}

impl Resume {
    /// What the ring found at start-up holds of engine rank `rank`: its last batch; or, in an
    /// adopted ring that holds none (overwritten by other ranks), nothing known.
    pub fn from_ring(recovered: &crate::ring::Recovered, rank: u32) -> Resume {
        match recovered.last_upstream.get(&rank) {
            Some(&(seq, digest)) => Resume::Applied { seq, digest },
            None if recovered.adopted => Resume::Unknown,
            None => Resume::New,
        }
    }
}

/// Where the state machine stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pos {
    /// Nothing applied from this publisher incarnation yet; the next batch should be seq 0.
    Fresh,
    /// The last engine seq applied.
    Last(u64),
    /// A loss was just signalled in band: accept whatever batch comes next.
    AcceptAny,
    /// Nothing of this rank is known (see [`Resume::Unknown`]): the first batch applied is
    /// preceded by a clear.
    Unknown,
}

/// How a replay request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayEnd {
    /// The end marker arrived.
    Complete,
    /// No reply (or no further reply) within the timeout.
    TimedOut,
    /// A reply had the wrong shape; the replay is incomplete.
    Malformed,
    /// Shutdown was requested while waiting.
    Aborted,
}

/// Every `outcome` of `kvbridge_replays_total` (exported at 0 from the start).
pub const REPLAY_OUTCOMES: [&str; 11] = [
    "requested",
    "succeeded",
    "history_missing",
    "hole",
    "timed_out",
    "malformed",
    "gave_up",
    "live_overflow",
    "other_incarnation",
    "snapshot",
    "snapshot_unavailable",
];

/// Ingest's hand-off to the rings: what the state machine decided to apply, and the in-band
/// clears it signals (decode and ring write live behind it). Not to be confused with the NATS
/// sink edge (`crate::sink`), which reads the rings.
pub trait Handoff {
    /// Decodes and publishes the engine batch `seq`, whose [`digest`] is `digest`.
    fn apply(&mut self, seq: u64, digest: u32, payload: &[u8]);
    /// Publishes a synthesized `cleared` event for this rank. An engine restart's may be held
    /// until the new incarnation's first batch is seen, and then be that batch's own clear
    /// (never later than [`Handoff::settle`]).
    fn clear(&mut self, upstream_seq: u64, cause: ClearCause);
    /// Publishes whatever is held: called when the state machine has handled a message (or a
    /// catch-up), before it waits for the next one.
    fn settle(&mut self) {}
    /// The engine's snapshot was applied after a clear: what follows the clear is the engine's
    /// whole state again, so the rank is exact.
    fn restored(&mut self) {}
}

/// What the engine's snapshot service (vLLM #57789, docs/engine-wire.md §13) answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineSnapshot {
    /// The state at engine seq `cut` of publisher `epoch`: `chunks` (engine batches of stores
    /// and removals) build it from nothing, in order; live batches continue at `cut` + 1.
    State {
        /// The last engine seq the state includes.
        cut: u64,
        /// The publisher's UUID.
        epoch: Epoch,
        /// The chunks, in order.
        chunks: Vec<Vec<u8>>,
    },
    /// No state: `-1` (nothing recorded) or `-2` (unavailable), no reply, or a malformed one.
    Unavailable(&'static str),
}

/// The engine's replay service (a DEALER to its ROUTER).
pub trait ReplaySource {
    /// Asks for every buffered batch with seq ≥ `from`. Replayed batches go to `batch` in arrival
    /// order; live batches that arrive meanwhile go to `live`.
    fn replay(
        &mut self,
        from: u64,
        batch: &mut dyn FnMut(u64, &[u8]),
        live: &mut dyn FnMut(u64, Vec<u8>),
    ) -> ReplayEnd;

    /// Whether the engine names a snapshot service.
    fn has_snapshot(&self) -> bool {
        false
    }

    /// Asks the engine's snapshot service for the rank's state; live batches that arrive
    /// meanwhile go to `live`.
    fn snapshot(&mut self, _live: &mut dyn FnMut(u64, Vec<u8>)) -> EngineSnapshot {
        EngineSnapshot::Unavailable("no snapshot endpoint")
    }
}

/// Limits of the state machine.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Replay attempts per gap (the first included) before the gap is declared unfillable.
    pub replay_attempts: u32,
    /// Live batches buffered while a replay runs; more fail the replay.
    pub live_buffer: usize,
    /// Digests of recently applied batches kept to recognise copies (16 bytes each). A copy
    /// comes late by at most what a replay applied ahead of the live stream, which the engines'
    /// replay buffer bounds (10,000 by default).
    pub window: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            replay_attempts: 3,
            live_buffer: 100_000,
            window: 32_768,
        }
    }
}

/// Why a replay is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fill {
    /// At start-up, before the first live batch: everything after what the ring holds.
    CatchUp,
    /// A live batch showed a gap.
    Gap,
    /// The next batch in order, from a publisher not yet known to be the incarnation of `last`.
    Verify,
}

/// One publisher's state.
pub struct RankState {
    pos: Pos,
    limits: Limits,
    m: RankMetrics,
    /// Digests of the current incarnation's most recently applied batches, in seq order.
    applied: VecDeque<(u64, u32)>,
    /// The replay of the fill now draining its live batches returned `last` with the bytes
    /// applied there: the engine is, at this moment, the incarnation `last` came from, so a live
    /// batch queued behind that replay at a seq ≤ `last` is a late copy even where no digest of
    /// it is kept (declared lost, or older than the window). Set in `fill`'s replay, cleared when
    /// its drain ends: it proves nothing about any later batch.
    proven_by_replay: bool,
    /// The current publisher is known to be the incarnation `last` came from (a batch of it
    /// matched, or it was followed from its start). False after a reconnect, and for a `last`
    /// recovered from the ring.
    verified: bool,
    /// The epoch the publisher's messages last named (the engines' next wire): `None` on
    /// today's wire, and until the first such message after a kvbridge start.
    epoch: Option<Epoch>,
    /// The message being handled names the epoch of the incarnation `last` came from: that, not
    /// its bytes, makes a seq at or below `last` a copy.
    same_epoch: bool,
    /// The fill under way may take the engine's snapshot where its replay cannot fill (the
    /// engine has a snapshot service, and it has not answered without a state in this fill).
    snapshot_ok: bool,
}

impl RankState {
    /// A state machine that continues after what the ring holds of this rank.
    pub fn new(resume: Resume, limits: Limits, metrics: RankMetrics) -> Self {
        let mut st = RankState {
            pos: Pos::Fresh,
            limits,
            m: metrics,
            applied: VecDeque::new(),
            proven_by_replay: false,
            verified: true,
            epoch: None,
            same_epoch: false,
            snapshot_ok: false,
        };
        match resume {
            Resume::New => {}
            Resume::Unknown => st.pos = Pos::Unknown,
            Resume::Applied { seq, digest } => {
                st.pos = Pos::Last(seq);
                st.applied.push_back((seq, digest));
                st.verified = false;
            }
        }
        st
    }

    /// The publisher connection was (re)established (the SUB's socket monitor saw it): until a
    /// batch of it matches what was applied, it may be a new incarnation.
    pub fn on_reconnect(&mut self) {
        if matches!(self.pos, Pos::Last(_)) {
            self.verified = false;
        }
    }

    /// Current position.
    pub fn pos(&self) -> Pos {
        self.pos
    }

    /// On connect: with a replay endpoint, fetch everything from what the ring already holds on
    /// (that batch included, to compare it), so that a late-started or restarted bridge loses
    /// nothing the engine still buffers and notices an engine that restarted meanwhile.
    pub fn catch_up(&mut self, handoff: &mut dyn Handoff, rep: &mut dyn ReplaySource) {
        let from = match self.pos {
            Pos::Last(l) => l,
            _ => 0,
        };
        self.fill(from, VecDeque::new(), handoff, Some(rep), Fill::CatchUp);
        handoff.settle();
    }

    /// A tail probe after a publisher connection on which nothing arrived yet: the same as a
    /// catch-up (a batch published before the subscription took effect is only in the engine's
    /// replay buffer). Not right after an in-band loss, which accepts whatever comes next.
    pub fn probe(&mut self, handoff: &mut dyn Handoff, rep: &mut dyn ReplaySource) {
        if self.pos != Pos::AcceptAny {
            self.catch_up(handoff, rep);
        }
    }

    /// Handles one live batch, `epoch` its publisher's when the message names one. Where it does,
    /// the epoch decides the incarnation (docs/engine-wire.md §13): another one than the last
    /// seen is an engine restart (an in-band clear, then the new incarnation from its start),
    /// the same one proves the publisher the incarnation `last` came from. Without one (today's
    /// wire, or the first message after a kvbridge start) the bytes decide, as in the module
    /// doc.
    pub fn on_live(
        &mut self,
        s: u64,
        epoch: Option<Epoch>,
        payload: &[u8],
        handoff: &mut dyn Handoff,
        rep: Option<&mut dyn ReplaySource>,
    ) {
        if let Some(e) = epoch {
            match self.epoch {
                Some(cur) if cur != e => self.restart(handoff, s),
                Some(_) => {
                    self.verified = true;
                    self.same_epoch = true;
                }
                None => {}
            }
            self.epoch = Some(e);
        }
        self.step(s, payload, handoff, rep, true);
        self.same_epoch = false;
        handoff.settle();
    }

    fn step(
        &mut self,
        s: u64,
        payload: &[u8],
        handoff: &mut dyn Handoff,
        rep: Option<&mut dyn ReplaySource>,
        may_replay: bool,
    ) {
        if payload.is_empty() {
            // Dropped and counted before anything else: it never moves `last`, so a batch that
            // follows with the same seq is simply applied, and one with a later seq reveals the
            // lost batch as a gap (docs/engine-wire.md §1, §8).
            self.m.frame_dropped("empty_payload");
            return;
        }
        let d = digest(payload);
        match self.pos {
            Pos::AcceptAny | Pos::Unknown => self.apply(s, d, payload, handoff),
            Pos::Fresh if s == 0 => self.apply(s, d, payload, handoff),
            Pos::Last(l) if s <= l => self.behind(s, d, payload, handoff, rep, may_replay),
            Pos::Last(l) if s == l + 1 => match rep {
                Some(rep) if may_replay && !self.verified => {
                    // In order, but from a publisher that may be a new incarnation which
                    // happens to be one past `last`: check `last` first.
                    let live = VecDeque::from([(s, payload.to_vec())]);
                    self.fill(l, live, handoff, Some(rep), Fill::Verify)
                }
                _ => self.apply(s, d, payload, handoff),
            },
            Pos::Fresh | Pos::Last(_) => {
                let from = match self.pos {
                    // From `last` itself: the replay's copy of it tells whether the engine is
                    // still the incarnation it came from.
                    Pos::Last(l) => l,
                    _ => 0,
                };
                self.m.gaps.inc();
                match rep {
                    Some(rep) if may_replay => {
                        let live = VecDeque::from([(s, payload.to_vec())]);
                        self.fill(from, live, handoff, Some(rep), Fill::Gap)
                    }
                    _ => {
                        self.clear(handoff, s, ClearCause::UnfillableGap);
                        self.apply(s, d, payload, handoff)
                    }
                }
            }
        }
    }

    /// A batch at a seq ≤ `last`: a copy of what was applied there, or a new incarnation. Only
    /// a proof makes it a copy: the digest applied at its seq, or the engine's replay answering
    /// with `last` as applied. A seq whose digest is no longer kept (declared lost, or older than
    /// the window) proves nothing by itself, so it is checked against the engine first; where
    /// the engine cannot be asked, it is taken for a restart (an in-band clear costs a resync; a
    /// wrong drop costs a silent divergence).
    fn behind(
        &mut self,
        s: u64,
        d: u32,
        payload: &[u8],
        handoff: &mut dyn Handoff,
        rep: Option<&mut dyn ReplaySource>,
        may_replay: bool,
    ) {
        match self.applied_at(s) {
            Some(known) if known == d => {
                // The same bytes again (a replay applied it first, a relay repeated it, or the
                // publisher re-delivered it after a reconnect): this publisher is the
                // incarnation `last` came from.
                self.verified = true;
                if self.pos == Pos::Last(s) {
                    self.m.repeated.inc();
                } else {
                    self.m.duplicates.inc();
                }
            }
            _ if self.same_epoch => {
                // The publisher's epoch is the one `last` came from: a copy, whatever its bytes
                // (or whether a digest of it is still kept) say.
                self.m.duplicates.inc();
            }
            Some(_) => {
                // Other bytes where a batch was applied: the engine restarted, and its cache is
                // empty.
                self.restart(handoff, s);
                self.step(s, payload, handoff, rep, may_replay)
            }
            None => match (rep, self.pos) {
                (Some(rep), Pos::Last(l)) if may_replay => {
                    // Ask the engine for `last`: the same bytes there make this a late copy
                    // (dropped in the drain, `proven_by_replay`), other bytes or nothing at or
                    // after `last` a new incarnation.
                    let live = VecDeque::from([(s, payload.to_vec())]);
                    self.fill(l, live, handoff, Some(rep), Fill::Verify)
                }
                _ if self.proven_by_replay => self.m.duplicates.inc(),
                (rep, _) => {
                    self.restart(handoff, s);
                    self.step(s, payload, handoff, rep, may_replay)
                }
            },
        }
    }

    /// The engine restarted: signal it, and follow the new incarnation from its start.
    fn restart(&mut self, handoff: &mut dyn Handoff, upstream_seq: u64) {
        self.m.restarts.inc();
        self.clear(handoff, upstream_seq, ClearCause::EngineRestart);
        self.pos = Pos::Fresh;
        self.applied.clear();
        self.verified = true;
    }

    /// The digest of the batch applied at `s`, if it is still in the window.
    fn applied_at(&self, s: u64) -> Option<u32> {
        self.applied
            .binary_search_by_key(&s, |&(seq, _)| seq)
            .ok()
            .map(|i| self.applied[i].1)
    }

    fn apply(&mut self, s: u64, d: u32, payload: &[u8], handoff: &mut dyn Handoff) {
        match self.pos {
            Pos::Unknown => self.clear(handoff, s, ClearCause::MissingHistory),
            Pos::Fresh | Pos::AcceptAny => self.verified = true,
            Pos::Last(_) => {}
        }
        handoff.apply(s, d, payload);
        self.pos = Pos::Last(s);
        if self.applied.back().is_some_and(|&(last, _)| last >= s) {
            // Only after a loss accepted a lower seq (AcceptAny): keep the window ordered.
            self.applied.clear();
        }
        if self.applied.len() >= self.limits.window.max(1) {
            self.applied.pop_front();
        }
        self.applied.push_back((s, d));
        self.m.last_seq.set(s as i64);
    }

    fn clear(&mut self, handoff: &mut dyn Handoff, upstream_seq: u64, cause: ClearCause) {
        handoff.clear(upstream_seq, cause);
    }
}

#[cfg(test)]
mod tests;
