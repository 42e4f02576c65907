//! The per-publisher state machine of docs/engine-wire.md §8, free of sockets so that it can be
//! tested exhaustively.
//!
//! One [`RankState`] follows one engine publisher (one DP rank). It sees each live batch's engine
//! sequence number and decides: apply it, fill a gap through the engine's replay service, or
//! report a discontinuity in band (a synthesized `cleared` event) before moving on. Nothing is
//! ever skipped silently: every way of losing batches ends in a clear that downstream indexes act
//! on (docs/smg-api.md §6.4).

use std::collections::VecDeque;

use crate::metrics::RankMetrics;
use crate::ring::ClearCause;

/// Where the state machine stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pos {
    /// Nothing applied from this publisher incarnation yet; the next batch should be seq 0.
    Fresh,
    /// The last engine seq applied.
    Last(u64),
    /// A loss was just signalled in band: accept whatever batch comes next.
    AcceptAny,
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

/// Applies batches and in-band clears (decode + ring write live behind it).
pub trait Sink {
    /// Decodes and publishes the engine batch `seq`.
    fn apply(&mut self, seq: u64, payload: &[u8]);
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
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            replay_attempts: 3,
            live_buffer: 100_000,
        }
    }
}

/// One publisher's state.
pub struct RankState {
    pos: Pos,
    limits: Limits,
    m: RankMetrics,
    /// The publisher (re)connected since `last` was applied: a seq ≤ `last` is then a restart,
    /// not a repeated frame (docs/engine-wire.md §8).
    reconnected: bool,
    /// Batches a replay applied whose live copies may still be on their way, oldest first, as
    /// (seq, payload digest). The live SUB and the replay DEALER are two connections, and
    /// nothing orders the one's deliveries against the other's: on a busy host the replay's end
    /// marker can arrive before live frames the engine sent earlier. Such a live frame has a seq
    /// ≤ `last` but is no restart: it is dropped as the duplicate it is when its seq and bytes
    /// match the replayed batch.
    replayed_ahead: VecDeque<(u64, u64)>,
}

/// A digest of a batch payload, to recognise a live copy of a replayed batch.
fn digest(payload: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

impl RankState {
    /// A state machine that continues after `last` (the newest engine seq this ring already
    /// holds for the rank), or starts fresh.
    pub fn new(last: Option<u64>, limits: Limits, metrics: RankMetrics) -> Self {
        let pos = last.map_or(Pos::Fresh, Pos::Last);
        RankState {
            pos,
            limits,
            m: metrics,
            reconnected: false,
            replayed_ahead: VecDeque::new(),
        }
    }

    /// The publisher connection was (re)established (the SUB's socket monitor saw it): until the
    /// next batch is applied, a seq ≤ `last` means the engine restarted.
    pub fn on_reconnect(&mut self) {
        self.reconnected = true;
    }

    /// Current position.
    pub fn pos(&self) -> Pos {
        self.pos
    }

    /// On connect: with a replay endpoint, fetch everything after what the ring already holds,
    /// so that a late-started or restarted bridge loses nothing the engine still buffers.
    pub fn catch_up(&mut self, sink: &mut dyn Sink, rep: &mut dyn ReplaySource) {
        let from = match self.pos {
            Pos::Last(l) => l + 1,
            _ => 0,
        };
        self.fill(from, VecDeque::new(), sink, Some(rep), true);
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
        if self.late_live_copy(s, payload) {
            self.m.duplicates.inc();
            return;
        }
        match self.pos {
            Pos::AcceptAny => self.apply(s, payload, sink),
            Pos::Fresh if s == 0 => self.apply(s, payload, sink),
            Pos::Last(l) if s == l + 1 => self.apply(s, payload, sink),
            Pos::Last(l) if s == l && !self.reconnected => {
                // The same connection delivered `last` again: a healthy publisher never does,
                // but relays and test tools can. Not a restart: drop it.
                self.m.repeated.inc();
            }
            Pos::Last(l) if s <= l => {
                // Going backwards (or repeating `last` on a new connection): the engine
                // restarted, and its cache is empty.
                self.m.restarts.inc();
                self.clear(sink, s, ClearCause::EngineRestart);
                self.pos = Pos::Fresh;
                self.replayed_ahead.clear();
                self.step(s, payload, sink, rep, may_replay)
            }
            Pos::Fresh | Pos::Last(_) => {
                let from = match self.pos {
                    Pos::Last(l) => l + 1,
                    _ => 0,
                };
                self.m.gaps.inc();
                match rep {
                    Some(rep) if may_replay => {
                        let live = VecDeque::from([(s, payload.to_vec())]);
                        self.fill(from, live, sink, Some(rep), false)
                    }
                    _ => {
                        self.clear(sink, s, ClearCause::UnfillableGap);
                        self.apply(s, payload, sink)
                    }
                }
            }
        }
    }

    /// Whether live batch `s` is the late live copy of a batch a replay applied already (see
    /// `replayed_ahead`). Forgets the replayed batches whose copies can no longer come: the live
    /// stream of one connection is in seq order, so once it shows `s`, copies of earlier seqs
    /// were lost, and once it passes the newest replayed seq, none is pending. A publisher that
    /// reconnected since is a new connection: what it sends is never a late copy of the old
    /// one's (a restarted engine can send the same bytes at the same seqs), so the list goes.
    fn late_live_copy(&mut self, s: u64, payload: &[u8]) -> bool {
        if self.reconnected {
            self.replayed_ahead.clear();
            return false;
        }
        while self.replayed_ahead.front().is_some_and(|&(r, _)| r < s) {
            self.replayed_ahead.pop_front();
        }
        match self.replayed_ahead.front() {
            Some(&(r, d)) if r == s => {
                self.replayed_ahead.pop_front();
                d == digest(payload)
            }
            _ => false,
        }
    }

    fn apply(&mut self, s: u64, payload: &[u8], sink: &mut dyn Sink) {
        sink.apply(s, payload);
        self.pos = Pos::Last(s);
        self.reconnected = false;
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
        catch_up: bool,
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
            let limit = self.limits.live_buffer;
            let end = {
                let this = &mut *self;
                let sink = &mut *sink;
                source.replay(
                    want,
                    &mut |rs, rp| {
                        let expected = match this.pos {
                            Pos::Last(l) if rs <= l => {
                                this.m.duplicates.inc();
                                return;
                            }
                            Pos::Last(l) => l + 1,
                            _ => want,
                        };
                        if rs > expected {
                            // The engine no longer has (or never had: burned seqs) what we asked for.
                            this.m
                                .replay(if first { "history_missing" } else { "hole" });
                            this.clear(sink, rs, ClearCause::MissingHistory);
                        }
                        first = false;
                        this.m.replayed.inc();
                        this.apply(rs, rp, sink);
                        this.replayed_ahead.push_back((rs, digest(rp)));
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
                        // On start-up catch-up, a silent replay endpoint only means we cannot
                        // prove what we missed; the live stream's first batch decides.
                        if !catch_up || matches!(self.pos, Pos::Last(_)) && !live.is_empty() {
                            self.m.replay("gave_up");
                            self.clear(sink, want, ClearCause::UnfillableGap);
                            self.pos = Pos::AcceptAny;
                        }
                        break;
                    }
                    want = match self.pos {
                        Pos::Last(l) => l + 1,
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
            if let Pos::Last(l) = self.pos {
                if s <= l {
                    // Replay overlaps live: not a restart, a duplicate.
                    self.m.duplicates.inc();
                    continue;
                }
            }
            // One replay per gap: a gap still open after it is reported, not replayed again.
            self.step(s, &p, sink, None, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[derive(Default)]
    struct Rec(Vec<String>);
    impl Sink for Rec {
        fn apply(&mut self, seq: u64, payload: &[u8]) {
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
                live(s, b"l".to_vec());
            }
            for &s in self.have.iter().filter(|&&s| s >= from) {
                batch(s, b"r");
            }
            self.end
        }
    }

    fn state(last: Option<u64>) -> RankState {
        RankState::new(last, Limits::default(), Metrics::new().rank(0))
    }

    /// A state machine and the registry its counters live in.
    fn state_with_metrics() -> (RankState, Metrics) {
        let m = Metrics::new();
        (RankState::new(None, Limits::default(), m.rank(0)), m)
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
                batch(from, b"r");
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
        st.on_live(0, b"a", &mut sink, None);
        st.on_live(1, b"", &mut sink, None);
        let mut eng = Engine::new(&[0, 1], ReplayEnd::Complete);
        st.on_live(2, b"c", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [1]);
        assert_eq!(sink.0, ["0:a", "1:r", "2:c"]);
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
        st.on_live(0, b"a", &mut sink, None);
        // Live 4 arrives after a drop of 1..=3; meanwhile 5 and 6 arrive live, and the replay
        // returns 1..=5 (overlapping live 4 and 5).
        let mut eng = Engine::with_live(&[0, 1, 2, 3, 4, 5], ReplayEnd::Complete, &[5, 6]);
        st.on_live(4, b"l", &mut sink, Some(&mut eng));
        assert_eq!(eng.requests, [1]);
        assert_eq!(sink.0, ["0:a", "1:r", "2:r", "3:r", "4:r", "5:r", "6:l"]);
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
        assert_eq!(m.duplicates_dropped.with_label_values(&["0"]).get(), 4);
    }

    #[test]
    fn the_same_bytes_at_a_replayed_seq_after_a_reconnect_are_a_restart() {
        // The replay applied 0..=4 and the live copies of 2..=4 never came (the gap it filled);
        // the engine restarts and its new incarnation sends the same bytes from 0 again.
        let (mut st, m) = state_with_metrics();
        let mut sink = Rec::default();
        let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
        st.on_live(1, b"r", &mut sink, Some(&mut eng));
        st.on_reconnect();
        st.on_live(0, b"r", &mut sink, None);
        st.on_live(1, b"r", &mut sink, None);
        assert_eq!(
            sink.0,
            [
                "0:r",
                "1:r",
                "2:r",
                "3:r",
                "4:r",
                "clear:engine_restart",
                "0:r",
                "1:r"
            ]
        );
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
        // Only the live 1 the replay overtook while it filled the gap.
        assert_eq!(m.duplicates_dropped.with_label_values(&["0"]).get(), 1);
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
        assert_eq!(eng.requests, [1, 1, 1]);
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
        assert_eq!(eng.1, [1, 3]);
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
        assert_eq!(eng.requests, [8]);
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
    fn live_overflow_fails_the_replay_in_band() {
        let mut st = RankState::new(
            Some(0),
            Limits {
                replay_attempts: 1,
                live_buffer: 2,
            },
            Metrics::new().rank(0),
        );
        let mut sink = Rec::default();
        let mut eng = Engine::with_live(&[1, 2], ReplayEnd::Complete, &[4, 5, 6]);
        st.on_live(3, b"l", &mut sink, Some(&mut eng));
        assert_eq!(sink.0, ["1:r", "2:r", "clear:replay_overflow"]);
        assert_eq!(st.pos(), Pos::AcceptAny);
    }
}
