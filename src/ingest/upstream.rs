//! The per-publisher state machine of docs/engine-wire.md §8, free of sockets so that it can be
//! tested exhaustively.
//!
//! One [`RankState`] follows one engine publisher (one DP rank). It sees each live batch's engine
//! sequence number and bytes and decides: apply it, drop it as a copy of a batch already applied,
//! fill a gap through the engine's replay service, or report a discontinuity in band (a
//! synthesized `cleared` event) before moving on. Nothing is ever skipped silently: every way of
//! losing batches ends in a clear that downstream indexes act on (docs/smg-api.md §6.4).
//!
//! **Same batch, or a new engine incarnation?** The wire has no incarnation id, and neither a
//! sequence number going back nor a new connection proves a restart: a publisher that connects
//! to kvbridge re-delivers, after a reconnect, batches kvbridge already applied through a replay,
//! and a restarted engine that published more than kvbridge had seen looks like a forward gap.
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

use std::collections::VecDeque;

use super::metrics::RankMetrics;
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
pub const REPLAY_OUTCOMES: [&str; 9] = [
    "requested",
    "succeeded",
    "history_missing",
    "hole",
    "timed_out",
    "malformed",
    "gave_up",
    "live_overflow",
    "other_incarnation",
];

/// Applies batches and in-band clears (decode + ring write live behind it).
pub trait Sink {
    /// Decodes and publishes the engine batch `seq`, whose [`digest`] is `digest`.
    fn apply(&mut self, seq: u64, digest: u32, payload: &[u8]);
    /// Publishes a synthesized `cleared` event for this rank.
    fn clear(&mut self, upstream_seq: u64, cause: ClearCause);
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
    /// The most recent seqs of this incarnation declared lost (inclusive): a late live copy of
    /// one of them is dropped, not taken for a restart.
    lost: Option<(u64, u64)>,
    /// The current publisher is known to be the incarnation `last` came from (a batch of it
    /// matched, or it was followed from its start). False after a reconnect, and for a `last`
    /// recovered from the ring.
    verified: bool,
}

impl RankState {
    /// A state machine that continues after what the ring holds of this rank.
    pub fn new(resume: Resume, limits: Limits, metrics: RankMetrics) -> Self {
        let mut st = RankState {
            pos: Pos::Fresh,
            limits,
            m: metrics,
            applied: VecDeque::new(),
            lost: None,
            verified: true,
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
    pub fn catch_up(&mut self, sink: &mut dyn Sink, rep: &mut dyn ReplaySource) {
        let from = match self.pos {
            Pos::Last(l) => l,
            _ => 0,
        };
        self.fill(from, VecDeque::new(), sink, Some(rep), Fill::CatchUp);
    }

    /// Handles one live batch.
    pub fn on_live(
        &mut self,
        s: u64,
        payload: &[u8],
        sink: &mut dyn Sink,
        rep: Option<&mut dyn ReplaySource>,
    ) {
        self.step(s, payload, sink, rep, true)
    }

    fn step(
        &mut self,
        s: u64,
        payload: &[u8],
        sink: &mut dyn Sink,
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
            Pos::AcceptAny | Pos::Unknown => self.apply(s, d, payload, sink),
            Pos::Fresh if s == 0 => self.apply(s, d, payload, sink),
            Pos::Last(l) if s <= l => self.behind(s, d, payload, sink, rep, may_replay),
            Pos::Last(l) if s == l + 1 => match rep {
                Some(rep) if may_replay && !self.verified => {
                    // In order, but from a publisher that may be a new incarnation which
                    // happens to be one past `last`: check `last` first.
                    let live = VecDeque::from([(s, payload.to_vec())]);
                    self.fill(l, live, sink, Some(rep), Fill::Verify)
                }
                _ => self.apply(s, d, payload, sink),
            },
            Pos::Fresh | Pos::Last(_) => {
                let (from, first_missing) = match self.pos {
                    // From `last` itself: the replay's copy of it tells whether the engine is
                    // still the incarnation it came from.
                    Pos::Last(l) => (l, l + 1),
                    _ => (0, 0),
                };
                self.m.gaps.inc();
                match rep {
                    Some(rep) if may_replay => {
                        let live = VecDeque::from([(s, payload.to_vec())]);
                        self.fill(from, live, sink, Some(rep), Fill::Gap)
                    }
                    _ => {
                        self.lost = Some((first_missing, s - 1));
                        self.clear(sink, s, ClearCause::UnfillableGap);
                        self.apply(s, d, payload, sink)
                    }
                }
            }
        }
    }

    /// A batch at a seq ≤ `last`: a copy of what was applied there, or a new incarnation.
    fn behind(
        &mut self,
        s: u64,
        d: u32,
        payload: &[u8],
        sink: &mut dyn Sink,
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
            None if self.lost.is_some_and(|(a, b)| a <= s && s <= b) => {
                // A late copy of a batch already declared lost (and cleared for).
                self.m.duplicates.inc();
            }
            _ => {
                // Other bytes where a batch was applied, or a seq below everything known of
                // this incarnation: the engine restarted, and its cache is empty.
                self.restart(sink, s);
                self.step(s, payload, sink, rep, may_replay)
            }
        }
    }

    /// The engine restarted: signal it, and follow the new incarnation from its start.
    fn restart(&mut self, sink: &mut dyn Sink, upstream_seq: u64) {
        self.m.restarts.inc();
        self.clear(sink, upstream_seq, ClearCause::EngineRestart);
        self.pos = Pos::Fresh;
        self.applied.clear();
        self.lost = None;
        self.verified = true;
    }

    /// The digest of the batch applied at `s`, if it is still in the window.
    fn applied_at(&self, s: u64) -> Option<u32> {
        self.applied
            .binary_search_by_key(&s, |&(seq, _)| seq)
            .ok()
            .map(|i| self.applied[i].1)
    }

    fn apply(&mut self, s: u64, d: u32, payload: &[u8], sink: &mut dyn Sink) {
        match self.pos {
            Pos::Unknown => self.clear(sink, s, ClearCause::MissingHistory),
            Pos::Fresh | Pos::AcceptAny => self.verified = true,
            Pos::Last(_) => {}
        }
        sink.apply(s, d, payload);
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

    fn clear(&mut self, sink: &mut dyn Sink, upstream_seq: u64, cause: ClearCause) {
        sink.clear(upstream_seq, cause);
    }

    /// Replays from `from`, merging the live batches that arrive meanwhile (`live` holds those
    /// that arrived before), then drains the merged live batches.
    fn fill(
        &mut self,
        from: u64,
        mut live: VecDeque<(u64, Vec<u8>)>,
        sink: &mut dyn Sink,
        mut rep: Option<&mut dyn ReplaySource>,
        why: Fill,
    ) {
        let Some(source) = rep.as_mut() else {
            return;
        };
        let mut overflow = false;
        let mut want = from;
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.m.replay("requested");
            let mut first = true;
            // Batches received, and whether one contradicted what was applied at its seq.
            let mut received = 0u64;
            let mut other_incarnation = false;
            let limit = self.limits.live_buffer;
            let end = {
                let this = &mut *self;
                let sink = &mut *sink;
                source.replay(
                    want,
                    &mut |rs, rp| {
                        if other_incarnation {
                            // The rest of a new incarnation's answer: asked again from 0 below.
                            return;
                        }
                        received += 1;
                        let d = digest(rp);
                        let expected = match this.pos {
                            Pos::Last(l) if rs <= l => {
                                match this.applied_at(rs) {
                                    Some(known) if known != d => other_incarnation = true,
                                    Some(_) => {
                                        this.verified = true;
                                        // (the copy of `last` asked for, to compare, is no
                                        // duplicate: anything else at or below it is)
                                        if rs != want {
                                            this.m.duplicates.inc();
                                        }
                                    }
                                    // Older than the window: nothing to compare with.
                                    None => this.m.duplicates.inc(),
                                }
                                // (`first` stays: it means the first batch after `last`)
                                return;
                            }
                            Pos::Last(l) => l + 1,
                            // Unknown: whatever comes first is preceded by a clear anyway.
                            Pos::Unknown => rs,
                            _ => want,
                        };
                        if rs > expected {
                            // The engine no longer has (or never had: burned seqs) what we
                            // asked for; or it no longer has `last`, which then cannot be
                            // compared: either way, what it held is gone.
                            this.m
                                .replay(if first { "history_missing" } else { "hole" });
                            this.lost = Some((expected, rs - 1));
                            this.clear(sink, rs, ClearCause::MissingHistory);
                            this.pos = Pos::AcceptAny;
                        }
                        first = false;
                        this.m.replayed.inc();
                        this.apply(rs, d, rp, sink);
                    },
                    &mut |ls, lp| {
                        if live.len() >= limit {
                            overflow = true;
                        } else {
                            live.push_back((ls, lp));
                        }
                    },
                )
            };
            let nothing_at_last = end == ReplayEnd::Complete
                && received == 0
                && matches!(self.pos, Pos::Last(l) if l == want);
            if other_incarnation || nothing_at_last {
                // A different batch where `last` was applied, or nothing at or after it (the
                // engine's newest is below `last`): a new incarnation. Its whole history, from 0.
                self.m.replay("other_incarnation");
                self.restart(sink, want);
                want = 0;
                attempt -= 1;
                continue;
            }
            match end {
                ReplayEnd::Complete => {
                    self.m.replay("succeeded");
                    break;
                }
                ReplayEnd::Aborted => return,
                ReplayEnd::TimedOut | ReplayEnd::Malformed => {
                    self.m.replay(if end == ReplayEnd::TimedOut {
                        "timed_out"
                    } else {
                        "malformed"
                    });
                    if attempt >= self.limits.replay_attempts {
                        if why == Fill::Gap {
                            self.m.replay("gave_up");
                            self.clear(sink, want, ClearCause::UnfillableGap);
                            self.pos = Pos::AcceptAny;
                        }
                        // On start-up, a silent replay endpoint only means we cannot prove what
                        // we missed, and a check of the next batch in order that cannot be made
                        // is no loss: the live stream decides (a gap in it is still reported).
                        break;
                    }
                    want = match self.pos {
                        Pos::Last(l) if self.verified => l + 1,
                        Pos::Last(l) => l,
                        _ => want,
                    };
                }
            }
        }
        if overflow {
            self.m.replay("live_overflow");
            self.clear(sink, want, ClearCause::ReplayOverflow);
            self.pos = Pos::AcceptAny;
            live.clear();
        }
        while let Some((s, p)) = live.pop_front() {
            // One replay per gap: a gap still open after it is reported, not replayed again;
            // a copy of a replayed batch is recognised by its bytes.
            self.step(s, &p, sink, None, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::metrics::IngestMetrics;

    #[derive(Default)]
    struct Rec(Vec<String>);
    impl Sink for Rec {
        fn apply(&mut self, seq: u64, _digest: u32, payload: &[u8]) {
            self.0
                .push(format!("{seq}:{}", String::from_utf8_lossy(payload)));
        }
        fn clear(&mut self, _s: u64, cause: ClearCause) {
            self.0.push(format!("clear:{}", cause.label()));
        }
    }

    /// An engine replay buffer holding `have`, answering with `end`; `live` arrives meanwhile.
    struct Engine {
        have: Vec<u64>,
        end: ReplayEnd,
        live: Vec<u64>,
        requests: Vec<u64>,
        /// The bytes of every batch it buffers: `b"r"`, or another incarnation's.
        bytes: &'static [u8],
    }
    impl Engine {
        /// An engine whose replay buffer holds `have` and ends with `end`.
        fn new(have: &[u64], end: ReplayEnd) -> Self {
            Self::with_live(have, end, &[])
        }
        /// As [`Engine::new`], with `live` batches arriving while it replays.
        fn with_live(have: &[u64], end: ReplayEnd, live: &[u64]) -> Self {
            Engine {
                have: have.to_vec(),
                end,
                live: live.to_vec(),
                requests: vec![],
                bytes: b"r",
            }
        }
        /// A restarted engine: it buffers `have`, each batch `b"n"`.
        fn restarted(have: &[u64]) -> Self {
            Engine {
                bytes: b"n",
                ..Self::new(have, ReplayEnd::Complete)
            }
        }
    }
    impl ReplaySource for Engine {
        fn replay(
            &mut self,
            from: u64,
            batch: &mut dyn FnMut(u64, &[u8]),
            live: &mut dyn FnMut(u64, Vec<u8>),
        ) -> ReplayEnd {
            self.requests.push(from);
            for s in std::mem::take(&mut self.live) {
                // One engine: a live batch it also buffers has the bytes its replay sends.
                let bytes: &[u8] = if self.have.contains(&s) {
                    self.bytes
                } else {
                    b"l"
                };
                live(s, bytes.to_vec());
            }
            for &s in self.have.iter().filter(|&&s| s >= from) {
                batch(s, self.bytes);
            }
            self.end
        }
    }

    /// A state machine resuming after engine seq `last` whose batch was `b"r"` (as the test
    /// engine replays it), or on a new ring.
    fn state(last: Option<u64>) -> RankState {
        RankState::new(
            resume(last),
            Limits::default(),
            IngestMetrics::for_tests().rank(0),
        )
    }

    fn resume(last: Option<u64>) -> Resume {
        match last {
            Some(seq) => Resume::Applied {
                seq,
                digest: digest(b"r"),
            },
            None => Resume::New,
        }
    }

    /// A state machine and the registry its counters live in.
    fn state_with_metrics() -> (RankState, IngestMetrics) {
        let m = IngestMetrics::for_tests();
        (RankState::new(Resume::New, Limits::default(), m.rank(0)), m)
    }

    #[test]
    fn a_repeated_seq_on_the_same_connection_is_dropped_not_a_restart() {
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        st.on_reconnect();
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(1, b"b", &mut sink, None);
        st.on_live(1, b"b", &mut sink, None);
        st.on_live(2, b"c", &mut sink, None);
        assert_eq!(sink.0, ["0:a", "1:b", "2:c"]);
        assert_eq!(m.repeated_frames.with_label_values(&["0"]).get(), 1);
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
        assert_eq!(st.pos(), Pos::Last(2));
    }

    #[test]
    fn the_last_seq_again_after_a_reconnect_is_a_restart() {
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(1, b"b", &mut sink, None);
        st.on_reconnect();
        st.on_live(1, b"n", &mut sink, None);
        assert_eq!(
            sink.0,
            [
                "0:a",
                "1:b",
                "clear:engine_restart",
                "clear:unfillable_gap",
                "1:n"
            ]
        );
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
        assert_eq!(m.repeated_frames.with_label_values(&["0"]).get(), 0);
        // The reconnect is used up once a batch is applied: a repeat now is a repeat.
        st.on_live(1, b"n", &mut sink, None);
        assert_eq!(sink.0.len(), 5);
        assert_eq!(m.repeated_frames.with_label_values(&["0"]).get(), 1);
    }

    #[test]
    fn a_lower_seq_is_a_restart_with_or_without_a_reconnect() {
        let mut st = state(None);
        let mut sink = Rec::default();
        for s in 0..4 {
            st.on_live(s, b"x", &mut sink, None);
        }
        st.on_live(0, b"n", &mut sink, None);
        assert_eq!(sink.0[4..], ["clear:engine_restart", "0:n"]);
        st.on_live(1, b"n", &mut sink, None);
        st.on_reconnect();
        st.on_live(0, b"m", &mut sink, None);
        assert_eq!(sink.0[7..], ["clear:engine_restart", "0:m"]);
    }

    #[test]
    fn an_empty_payload_never_moves_last() {
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(1, b"", &mut sink, None);
        assert_eq!(st.pos(), Pos::Last(0));
        // The same seq with a payload is the batch itself: applied, nothing cleared.
        st.on_live(1, b"b", &mut sink, None);
        assert_eq!(sink.0, ["0:a", "1:b"]);
        let dropped = m
            .frames_dropped
            .with_label_values(&["0", "empty_payload"])
            .get();
        assert_eq!(dropped, 1);
        assert_eq!(m.batches_received.with_label_values(&["0"]).get(), 0);
        // An empty payload at the start does not make the first batch look like a restart.
        let (mut st, _) = state_with_metrics();
        let mut sink = Rec::default();
        st.on_live(0, b"", &mut sink, None);
        assert_eq!(st.pos(), Pos::Fresh);
        st.on_live(0, b"a", &mut sink, None);
        assert_eq!(sink.0, ["0:a"]);
    }

    #[test]
    fn an_empty_live_payload_during_a_replay_does_not_move_last_either() {
        // Live 2 reveals the gap at 1; live 3 (empty) and 3 (the batch) arrive while the
        // replay of 1 runs.
        struct Rep;
        impl ReplaySource for Rep {
            fn replay(
                &mut self,
                from: u64,
                batch: &mut dyn FnMut(u64, &[u8]),
                live: &mut dyn FnMut(u64, Vec<u8>),
            ) -> ReplayEnd {
                live(3, Vec::new());
                live(3, b"c".to_vec());
                // From `last` (0) on, as engines replay: its copy first.
                assert_eq!(from, 0);
                batch(0, b"a");
                batch(1, b"r");
                ReplayEnd::Complete
            }
        }
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(2, b"b", &mut sink, Some(&mut Rep));
        assert_eq!(sink.0, ["0:a", "1:r", "2:b", "3:c"]);
        let dropped = m
            .frames_dropped
            .with_label_values(&["0", "empty_payload"])
            .get();
        assert_eq!(dropped, 1);
    }

    #[test]
    fn an_empty_payload_followed_by_the_next_seq_is_a_lost_batch() {
        let mut st = state(None);
        let mut sink = Rec::default();
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(1, b"", &mut sink, None);
        st.on_live(2, b"c", &mut sink, None);
        assert_eq!(sink.0, ["0:a", "clear:unfillable_gap", "2:c"]);
        // With a replay endpoint the engine's copy of the batch fills the gap.
        let mut st = state(None);
        let mut sink = Rec::default();
        st.on_live(0, b"r", &mut sink, None);
        st.on_live(1, b"", &mut sink, None);
        let mut eng = Engine::new(&[0, 1], ReplayEnd::Complete);
        st.on_live(2, b"c", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [0], "from `last`, to compare it");
        assert_eq!(sink.0, ["0:r", "1:r", "2:c"]);
    }

    #[test]
    fn contiguous_stream_applies_in_order() {
        let mut st = state(None);
        let mut sink = Rec::default();
        for s in 0..3 {
            st.on_live(s, b"x", &mut sink, None);
        }
        assert_eq!(sink.0, ["0:x", "1:x", "2:x"]);
        assert_eq!(st.pos(), Pos::Last(2));
    }

    #[test]
    fn gap_without_replay_is_signalled_in_band() {
        let mut st = state(None);
        let mut sink = Rec::default();
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(5, b"b", &mut sink, None);
        assert_eq!(sink.0, ["0:a", "clear:unfillable_gap", "5:b"]);
    }

    #[test]
    fn restart_clears_then_applies() {
        let mut st = state(Some(41));
        let mut sink = Rec::default();
        st.on_live(0, b"n", &mut sink, None);
        assert_eq!(sink.0, ["clear:engine_restart", "0:n"]);
    }

    #[test]
    fn gap_is_filled_by_replay_and_merged_without_duplicates() {
        let mut st = state(None);
        let mut sink = Rec::default();
        st.on_live(0, b"r", &mut sink, None);
        // Live 4 arrives after a drop of 1..=3; meanwhile 5 and 6 arrive live, and the replay
        // returns 0..=5 (its copy of 0 first, then 1..=5, overlapping live 4 and 5).
        let mut eng = Engine::with_live(&[0, 1, 2, 3, 4, 5], ReplayEnd::Complete, &[5, 6]);
        st.on_live(4, b"r", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [0]);
        assert_eq!(sink.0, ["0:r", "1:r", "2:r", "3:r", "4:r", "5:r", "6:l"]);
    }

    #[test]
    fn live_copies_arriving_after_the_replay_that_applied_them_are_duplicates() {
        // A slow joiner sees live 1 first; the replay from 0 returns 0..=4 and ends before the
        // live copies of 2..=4 arrive (two connections, no order between them).
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
        st.on_live(1, b"r", &mut sink, Some(&mut eng));
        for s in 2..=4 {
            st.on_live(s, b"r", &mut sink, Some(&mut eng));
        }
        st.on_live(5, b"l", &mut sink, Some(&mut eng));
        assert_eq!(sink.0, ["0:r", "1:r", "2:r", "3:r", "4:r", "5:l"]);
        assert_eq!(eng.requests, [0], "one replay");
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
        // 1 (overtaken while the replay ran), 2, 3 dropped as copies; 4 repeats `last`.
        assert_eq!(m.duplicates_dropped.with_label_values(&["0"]).get(), 3);
        assert_eq!(m.repeated_frames.with_label_values(&["0"]).get(), 1);
    }

    #[test]
    fn copies_of_replayed_batches_after_a_reconnect_are_copies_not_a_restart() {
        // A publisher that connects to kvbridge queues what it publishes while kvbridge is down
        // and delivers it after the reconnect; the replay applied those batches first.
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
        st.catch_up(&mut sink, &mut eng);
        st.on_reconnect();
        for s in 2..=4 {
            st.on_live(s, b"r", &mut sink, Some(&mut eng));
        }
        st.on_live(5, b"l", &mut sink, Some(&mut eng));
        assert_eq!(sink.0, ["0:r", "1:r", "2:r", "3:r", "4:r", "5:l"]);
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
        assert_eq!(
            eng.requests,
            [0],
            "a copy proves the incarnation: no check replay"
        );
    }

    #[test]
    fn other_bytes_at_an_applied_seq_are_a_restart_whatever_the_connection() {
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
        st.on_live(1, b"r", &mut sink, Some(&mut eng));
        // No reconnect seen (the monitor can lag): the bytes decide.
        st.on_live(0, b"n", &mut sink, None);
        st.on_live(1, b"n", &mut sink, None);
        assert_eq!(
            sink.0,
            [
                "0:r",
                "1:r",
                "2:r",
                "3:r",
                "4:r",
                "clear:engine_restart",
                "0:n",
                "1:n"
            ]
        );
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
    }

    #[test]
    fn a_lower_seq_with_other_bytes_after_a_replay_is_still_a_restart() {
        let mut st = state(None);
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[0, 1, 2, 3], ReplayEnd::Complete);
        st.on_live(1, b"r", &mut sink, Some(&mut eng));
        // Live 2 (a late copy), then the engine restarts before live 3's copy came.
        st.on_live(2, b"r", &mut sink, None);
        st.on_live(0, b"n", &mut sink, None);
        assert_eq!(
            sink.0,
            ["0:r", "1:r", "2:r", "3:r", "clear:engine_restart", "0:n"]
        );
        // A copy of the old 3 that would still come is not the new incarnation's business:
        // it is judged against the new seqs (here a gap without a replay endpoint).
        st.on_live(1, b"n", &mut sink, None);
        assert_eq!(sink.0.last().unwrap(), "1:n");
    }

    #[test]
    fn missing_history_clears_before_the_first_replayed_batch() {
        let mut st = state(Some(10));
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[20, 21], ReplayEnd::Complete);
        st.on_live(22, b"l", &mut sink, Some(&mut eng));
        assert_eq!(sink.0, ["clear:missing_history", "20:r", "21:r", "22:l"]);
    }

    #[test]
    fn burned_seq_inside_replay_is_a_hole() {
        let mut st = state(Some(0));
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[1, 3], ReplayEnd::Complete);
        st.on_live(4, b"l", &mut sink, Some(&mut eng));
        assert_eq!(sink.0, ["1:r", "clear:missing_history", "3:r", "4:l"]);
    }

    #[test]
    fn timed_out_replay_retries_then_gives_up_in_band() {
        let mut st = state(Some(0));
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[], ReplayEnd::TimedOut);
        st.on_live(3, b"l", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [0, 0, 0]);
        assert_eq!(sink.0, ["clear:unfillable_gap", "3:l"]);
    }

    #[test]
    fn truncated_replay_continues_from_first_missing() {
        // First attempt returns 1,2 and no end marker; the second returns the rest.
        struct Trunc(u32, Vec<u64>);
        impl ReplaySource for Trunc {
            fn replay(
                &mut self,
                from: u64,
                batch: &mut dyn FnMut(u64, &[u8]),
                _l: &mut dyn FnMut(u64, Vec<u8>),
            ) -> ReplayEnd {
                self.0 += 1;
                self.1.push(from);
                if self.0 == 1 {
                    batch(1, b"r");
                    batch(2, b"r");
                    ReplayEnd::TimedOut
                } else {
                    for s in from..=4 {
                        batch(s, b"r");
                    }
                    ReplayEnd::Complete
                }
            }
        }
        let mut st = state(Some(0));
        let mut sink = Rec::default();
        let mut eng = Trunc(0, vec![]);
        st.on_live(5, b"l", &mut sink, Some(&mut eng));
        // `last` (0) never came back to compare with, so the retry asks from the new `last`.
        assert_eq!(eng.1, [0, 2]);
        assert_eq!(sink.0, ["1:r", "2:r", "3:r", "4:r", "5:l"]);
    }

    #[test]
    fn slow_joiner_replays_from_zero() {
        let mut st = state(None);
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[0, 1], ReplayEnd::Complete);
        st.on_live(2, b"l", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [0]);
        assert_eq!(sink.0, ["0:r", "1:r", "2:l"]);
    }

    #[test]
    fn catch_up_on_connect_asks_after_what_the_ring_holds() {
        let mut st = state(Some(7));
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[6, 7, 8, 9], ReplayEnd::Complete);
        st.catch_up(&mut sink, &mut eng);
        assert_eq!(eng.requests, [7], "from `last`, to compare it");
        assert_eq!(sink.0, ["8:r", "9:r"]);
        // A silent replay endpoint at start-up is not itself a loss.
        let mut st = state(None);
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[], ReplayEnd::TimedOut);
        st.catch_up(&mut sink, &mut eng);
        assert!(sink.0.is_empty());
        assert_eq!(st.pos(), Pos::Fresh);
    }

    #[test]
    fn an_engine_restarted_while_kvbridge_was_down_and_now_past_last_is_a_restart() {
        // The ring's last batch is seq 3; the new incarnation has published 0..=6 since.
        let m = IngestMetrics::for_tests();
        let mut st = RankState::new(resume(Some(3)), Limits::default(), m.rank(0));
        let mut sink = Rec::default();
        let mut eng = Engine::restarted(&[0, 1, 2, 3, 4, 5, 6]);
        st.catch_up(&mut sink, &mut eng);
        assert_eq!(
            eng.requests,
            [3, 0],
            "compare at `last`, then the whole new history"
        );
        let mut want = vec!["clear:engine_restart".to_string()];
        want.extend((0..=6).map(|s| format!("{s}:n")));
        assert_eq!(sink.0, want);
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
        // Live copies of what the replay applied are copies of the new incarnation.
        st.on_live(6, b"n", &mut sink, Some(&mut eng));
        st.on_live(7, b"m", &mut sink, Some(&mut eng));
        assert_eq!(sink.0.last().unwrap(), "7:m");
        assert_eq!(sink.0.len(), 9);
    }

    #[test]
    fn an_engine_whose_newest_is_below_last_is_a_restart() {
        let (mut st, mut sink) = (state(Some(10)), Rec::default());
        let mut eng = Engine::restarted(&[0, 1, 2]);
        st.catch_up(&mut sink, &mut eng);
        assert_eq!(eng.requests, [10, 0]);
        assert_eq!(sink.0, ["clear:engine_restart", "0:n", "1:n", "2:n"]);
        // Nothing published yet by the new incarnation: the same verdict, and nothing to apply.
        let (mut st, mut sink) = (state(Some(10)), Rec::default());
        let mut eng = Engine::restarted(&[]);
        st.catch_up(&mut sink, &mut eng);
        assert_eq!(sink.0, ["clear:engine_restart"]);
        assert_eq!(st.pos(), Pos::Fresh);
    }

    #[test]
    fn an_engine_that_no_longer_has_last_cannot_be_compared_history_is_missing() {
        let m = IngestMetrics::for_tests();
        let mut st = RankState::new(resume(Some(3)), Limits::default(), m.rank(0));
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[5, 6], ReplayEnd::Complete);
        st.catch_up(&mut sink, &mut eng);
        assert_eq!(sink.0, ["clear:missing_history", "5:r", "6:r"]);
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
        // A late live copy of a batch declared lost is dropped, not taken for a restart.
        st.on_live(4, b"r", &mut sink, None);
        assert_eq!(sink.0.len(), 3);
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
    }

    #[test]
    fn a_digest_the_ring_did_not_record_is_not_taken_as_proof() {
        let mut st = RankState::new(
            Resume::Applied { seq: 2, digest: 0 },
            Limits::default(),
            IngestMetrics::for_tests().rank(0),
        );
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[0, 1, 2, 3], ReplayEnd::Complete);
        st.catch_up(&mut sink, &mut eng);
        assert_eq!(sink.0, ["clear:engine_restart", "0:r", "1:r", "2:r", "3:r"]);
    }

    #[test]
    fn an_adopted_ring_without_the_rank_clears_before_its_first_batch() {
        let mut st = RankState::new(
            Resume::Unknown,
            Limits::default(),
            IngestMetrics::for_tests().rank(0),
        );
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[4, 5], ReplayEnd::Complete);
        st.catch_up(&mut sink, &mut eng);
        assert_eq!(sink.0, ["clear:missing_history", "4:r", "5:r"]);
        let mut st = RankState::new(
            Resume::Unknown,
            Limits::default(),
            IngestMetrics::for_tests().rank(0),
        );
        let mut sink = Rec::default();
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(1, b"b", &mut sink, None);
        assert_eq!(sink.0, ["clear:missing_history", "0:a", "1:b"]);
    }

    #[test]
    fn after_a_reconnect_the_next_batch_in_order_is_checked_first() {
        let m = IngestMetrics::for_tests();
        let mut st = RankState::new(Resume::New, Limits::default(), m.rank(0));
        let mut sink = Rec::default();
        for s in 0..=3 {
            st.on_live(s, b"r", &mut sink, None);
        }
        // The same publisher again: its replay's copy of 3 matches; 4 is applied once.
        st.on_reconnect();
        let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
        st.on_live(4, b"r", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [3]);
        assert_eq!(sink.0[4..], ["4:r"]);
        // A new incarnation that happens to be one past `last`: caught by the comparison.
        st.on_reconnect();
        let mut eng = Engine::restarted(&[0, 1, 2, 3, 4, 5]);
        st.on_live(5, b"n", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [4, 0]);
        assert_eq!(
            sink.0[5..],
            [
                "clear:engine_restart",
                "0:n",
                "1:n",
                "2:n",
                "3:n",
                "4:n",
                "5:n"
            ]
        );
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
        // No further check once a batch of it was followed.
        st.on_live(6, b"n", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [4, 0]);
    }

    #[test]
    fn live_overflow_fails_the_replay_in_band() {
        let mut st = RankState::new(
            resume(Some(0)),
            Limits {
                replay_attempts: 1,
                live_buffer: 2,
                ..Limits::default()
            },
            IngestMetrics::for_tests().rank(0),
        );
        let mut sink = Rec::default();
        let mut eng = Engine::with_live(&[1, 2], ReplayEnd::Complete, &[4, 5, 6]);
        st.on_live(3, b"l", &mut sink, Some(&mut eng));
        assert_eq!(sink.0, ["1:r", "2:r", "clear:replay_overflow"]);
        assert_eq!(st.pos(), Pos::AcceptAny);
    }
}
