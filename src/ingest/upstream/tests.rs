use super::*;
use crate::ingest::metrics::IngestMetrics;
use crate::ingest::wire::Epoch;

#[derive(Default)]
struct Rec(Vec<String>);
impl Handoff for Rec {
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
    let mut handoff = Rec::default();
    st.on_reconnect();
    st.on_live(0, None, b"a", &mut handoff, None);
    st.on_live(1, None, b"b", &mut handoff, None);
    st.on_live(1, None, b"b", &mut handoff, None);
    st.on_live(2, None, b"c", &mut handoff, None);
    assert_eq!(handoff.0, ["0:a", "1:b", "2:c"]);
    assert_eq!(m.repeated_frames.with_label_values(&["0"]).get(), 1);
    assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
    assert_eq!(st.pos(), Pos::Last(2));
}

#[test]
fn the_last_seq_again_after_a_reconnect_is_a_restart() {
    let (mut st, m) = state_with_metrics();
    let mut handoff = Rec::default();
    st.on_live(0, None, b"a", &mut handoff, None);
    st.on_live(1, None, b"b", &mut handoff, None);
    st.on_reconnect();
    st.on_live(1, None, b"n", &mut handoff, None);
    assert_eq!(
        handoff.0,
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
    st.on_live(1, None, b"n", &mut handoff, None);
    assert_eq!(handoff.0.len(), 5);
    assert_eq!(m.repeated_frames.with_label_values(&["0"]).get(), 1);
}

#[test]
fn a_lower_seq_is_a_restart_with_or_without_a_reconnect() {
    let mut st = state(None);
    let mut handoff = Rec::default();
    for s in 0..4 {
        st.on_live(s, None, b"x", &mut handoff, None);
    }
    st.on_live(0, None, b"n", &mut handoff, None);
    assert_eq!(handoff.0[4..], ["clear:engine_restart", "0:n"]);
    st.on_live(1, None, b"n", &mut handoff, None);
    st.on_reconnect();
    st.on_live(0, None, b"m", &mut handoff, None);
    assert_eq!(handoff.0[7..], ["clear:engine_restart", "0:m"]);
}

#[test]
fn an_empty_payload_never_moves_last() {
    let (mut st, m) = state_with_metrics();
    let mut handoff = Rec::default();
    st.on_live(0, None, b"a", &mut handoff, None);
    st.on_live(1, None, b"", &mut handoff, None);
    assert_eq!(st.pos(), Pos::Last(0));
    // The same seq with a payload is the batch itself: applied, nothing cleared.
    st.on_live(1, None, b"b", &mut handoff, None);
    assert_eq!(handoff.0, ["0:a", "1:b"]);
    let dropped = m
        .frames_dropped
        .with_label_values(&["0", "empty_payload"])
        .get();
    assert_eq!(dropped, 1);
    assert_eq!(m.batches_received.with_label_values(&["0"]).get(), 0);
    // An empty payload at the start does not make the first batch look like a restart.
    let (mut st, _) = state_with_metrics();
    let mut handoff = Rec::default();
    st.on_live(0, None, b"", &mut handoff, None);
    assert_eq!(st.pos(), Pos::Fresh);
    st.on_live(0, None, b"a", &mut handoff, None);
    assert_eq!(handoff.0, ["0:a"]);
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
    let mut handoff = Rec::default();
    st.on_live(0, None, b"a", &mut handoff, None);
    st.on_live(2, None, b"b", &mut handoff, Some(&mut Rep));
    assert_eq!(handoff.0, ["0:a", "1:r", "2:b", "3:c"]);
    let dropped = m
        .frames_dropped
        .with_label_values(&["0", "empty_payload"])
        .get();
    assert_eq!(dropped, 1);
}

#[test]
fn an_empty_payload_followed_by_the_next_seq_is_a_lost_batch() {
    let mut st = state(None);
    let mut handoff = Rec::default();
    st.on_live(0, None, b"a", &mut handoff, None);
    st.on_live(1, None, b"", &mut handoff, None);
    st.on_live(2, None, b"c", &mut handoff, None);
    assert_eq!(handoff.0, ["0:a", "clear:unfillable_gap", "2:c"]);
    // With a replay endpoint the engine's copy of the batch fills the gap.
    let mut st = state(None);
    let mut handoff = Rec::default();
    st.on_live(0, None, b"r", &mut handoff, None);
    st.on_live(1, None, b"", &mut handoff, None);
    let mut eng = Engine::new(&[0, 1], ReplayEnd::Complete);
    st.on_live(2, None, b"c", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [0], "from `last`, to compare it");
    assert_eq!(handoff.0, ["0:r", "1:r", "2:c"]);
}

#[test]
fn contiguous_stream_applies_in_order() {
    let mut st = state(None);
    let mut handoff = Rec::default();
    for s in 0..3 {
        st.on_live(s, None, b"x", &mut handoff, None);
    }
    assert_eq!(handoff.0, ["0:x", "1:x", "2:x"]);
    assert_eq!(st.pos(), Pos::Last(2));
}

#[test]
fn gap_without_replay_is_signalled_in_band() {
    let mut st = state(None);
    let mut handoff = Rec::default();
    st.on_live(0, None, b"a", &mut handoff, None);
    st.on_live(5, None, b"b", &mut handoff, None);
    assert_eq!(handoff.0, ["0:a", "clear:unfillable_gap", "5:b"]);
}

#[test]
fn restart_clears_then_applies() {
    let mut st = state(Some(41));
    let mut handoff = Rec::default();
    st.on_live(0, None, b"n", &mut handoff, None);
    assert_eq!(handoff.0, ["clear:engine_restart", "0:n"]);
}

#[test]
fn gap_is_filled_by_replay_and_merged_without_duplicates() {
    let mut st = state(None);
    let mut handoff = Rec::default();
    st.on_live(0, None, b"r", &mut handoff, None);
    // Live 4 arrives after a drop of 1..=3; meanwhile 5 and 6 arrive live, and the replay
    // returns 0..=5 (its copy of 0 first, then 1..=5, overlapping live 4 and 5).
    let mut eng = Engine::with_live(&[0, 1, 2, 3, 4, 5], ReplayEnd::Complete, &[5, 6]);
    st.on_live(4, None, b"r", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [0]);
    assert_eq!(handoff.0, ["0:r", "1:r", "2:r", "3:r", "4:r", "5:r", "6:l"]);
}

#[test]
fn live_copies_arriving_after_the_replay_that_applied_them_are_duplicates() {
    // A slow joiner sees live 1 first; the replay from 0 returns 0..=4 and ends before the
    // live copies of 2..=4 arrive (two connections, no order between them).
    let (mut st, m) = state_with_metrics();
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
    st.on_live(1, None, b"r", &mut handoff, Some(&mut eng));
    for s in 2..=4 {
        st.on_live(s, None, b"r", &mut handoff, Some(&mut eng));
    }
    st.on_live(5, None, b"l", &mut handoff, Some(&mut eng));
    assert_eq!(handoff.0, ["0:r", "1:r", "2:r", "3:r", "4:r", "5:l"]);
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
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
    st.catch_up(&mut handoff, &mut eng);
    st.on_reconnect();
    for s in 2..=4 {
        st.on_live(s, None, b"r", &mut handoff, Some(&mut eng));
    }
    st.on_live(5, None, b"l", &mut handoff, Some(&mut eng));
    assert_eq!(handoff.0, ["0:r", "1:r", "2:r", "3:r", "4:r", "5:l"]);
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
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
    st.on_live(1, None, b"r", &mut handoff, Some(&mut eng));
    // No reconnect seen (the monitor can lag): the bytes decide.
    st.on_live(0, None, b"n", &mut handoff, None);
    st.on_live(1, None, b"n", &mut handoff, None);
    assert_eq!(
        handoff.0,
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
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[0, 1, 2, 3], ReplayEnd::Complete);
    st.on_live(1, None, b"r", &mut handoff, Some(&mut eng));
    // Live 2 (a late copy), then the engine restarts before live 3's copy came.
    st.on_live(2, None, b"r", &mut handoff, None);
    st.on_live(0, None, b"n", &mut handoff, None);
    assert_eq!(
        handoff.0,
        ["0:r", "1:r", "2:r", "3:r", "clear:engine_restart", "0:n"]
    );
    // A copy of the old 3 that would still come is not the new incarnation's business:
    // it is judged against the new seqs (here a gap without a replay endpoint).
    st.on_live(1, None, b"n", &mut handoff, None);
    assert_eq!(handoff.0.last().unwrap(), "1:n");
}

#[test]
fn missing_history_clears_before_the_first_replayed_batch() {
    let mut st = state(Some(10));
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[20, 21], ReplayEnd::Complete);
    st.on_live(22, None, b"l", &mut handoff, Some(&mut eng));
    assert_eq!(handoff.0, ["clear:missing_history", "20:r", "21:r", "22:l"]);
}

#[test]
fn burned_seq_inside_replay_is_a_hole() {
    let mut st = state(Some(0));
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[1, 3], ReplayEnd::Complete);
    st.on_live(4, None, b"l", &mut handoff, Some(&mut eng));
    assert_eq!(handoff.0, ["1:r", "clear:missing_history", "3:r", "4:l"]);
}

#[test]
fn timed_out_replay_retries_then_gives_up_in_band() {
    let mut st = state(Some(0));
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[], ReplayEnd::TimedOut);
    st.on_live(3, None, b"l", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [0, 0, 0]);
    assert_eq!(handoff.0, ["clear:unfillable_gap", "3:l"]);
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
    let mut handoff = Rec::default();
    let mut eng = Trunc(0, vec![]);
    st.on_live(5, None, b"l", &mut handoff, Some(&mut eng));
    // `last` (0) never came back to compare with, so the retry asks from the new `last`.
    assert_eq!(eng.1, [0, 2]);
    assert_eq!(handoff.0, ["1:r", "2:r", "3:r", "4:r", "5:l"]);
}

#[test]
fn slow_joiner_replays_from_zero() {
    let mut st = state(None);
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[0, 1], ReplayEnd::Complete);
    st.on_live(2, None, b"l", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [0]);
    assert_eq!(handoff.0, ["0:r", "1:r", "2:l"]);
}

#[test]
fn catch_up_on_connect_asks_after_what_the_ring_holds() {
    let mut st = state(Some(7));
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[6, 7, 8, 9], ReplayEnd::Complete);
    st.catch_up(&mut handoff, &mut eng);
    assert_eq!(eng.requests, [7], "from `last`, to compare it");
    assert_eq!(handoff.0, ["8:r", "9:r"]);
    // A silent replay endpoint at start-up is not itself a loss.
    let mut st = state(None);
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[], ReplayEnd::TimedOut);
    st.catch_up(&mut handoff, &mut eng);
    assert!(handoff.0.is_empty());
    assert_eq!(st.pos(), Pos::Fresh);
}

#[test]
fn an_engine_restarted_while_kvbridge_was_down_and_now_past_last_is_a_restart() {
    // The ring's last batch is seq 3; the new incarnation has published 0..=6 since.
    let m = IngestMetrics::for_tests();
    let mut st = RankState::new(resume(Some(3)), Limits::default(), m.rank(0));
    let mut handoff = Rec::default();
    let mut eng = Engine::restarted(&[0, 1, 2, 3, 4, 5, 6]);
    st.catch_up(&mut handoff, &mut eng);
    assert_eq!(
        eng.requests,
        [3, 0],
        "compare at `last`, then the whole new history"
    );
    let mut want = vec!["clear:engine_restart".to_string()];
    want.extend((0..=6).map(|s| format!("{s}:n")));
    assert_eq!(handoff.0, want);
    assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
    // Live copies of what the replay applied are copies of the new incarnation.
    st.on_live(6, None, b"n", &mut handoff, Some(&mut eng));
    st.on_live(7, None, b"m", &mut handoff, Some(&mut eng));
    assert_eq!(handoff.0.last().unwrap(), "7:m");
    assert_eq!(handoff.0.len(), 9);
}

#[test]
fn an_engine_whose_newest_is_below_last_is_a_restart() {
    let (mut st, mut handoff) = (state(Some(10)), Rec::default());
    let mut eng = Engine::restarted(&[0, 1, 2]);
    st.catch_up(&mut handoff, &mut eng);
    assert_eq!(eng.requests, [10, 0]);
    assert_eq!(handoff.0, ["clear:engine_restart", "0:n", "1:n", "2:n"]);
    // Nothing published yet by the new incarnation: the same verdict, and nothing to apply.
    let (mut st, mut handoff) = (state(Some(10)), Rec::default());
    let mut eng = Engine::restarted(&[]);
    st.catch_up(&mut handoff, &mut eng);
    assert_eq!(handoff.0, ["clear:engine_restart"]);
    assert_eq!(st.pos(), Pos::Fresh);
}

#[test]
fn an_engine_that_no_longer_has_last_cannot_be_compared_history_is_missing() {
    let m = IngestMetrics::for_tests();
    let mut st = RankState::new(resume(Some(3)), Limits::default(), m.rank(0));
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[5, 6], ReplayEnd::Complete);
    st.catch_up(&mut handoff, &mut eng);
    assert_eq!(handoff.0, ["clear:missing_history", "5:r", "6:r"]);
    assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
    // A late live copy of a batch declared lost proves nothing by its seq: the engine is asked
    // for `last`, which it still holds as applied, so it is a copy, dropped.
    st.on_live(4, None, b"r", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [3, 6]);
    assert_eq!(handoff.0.len(), 3);
    assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
    assert_eq!(m.duplicates_dropped.with_label_values(&["0"]).get(), 1);
}

/// The campaign's seed 1 (issue: four steps against a real engine): kvbridge started past the
/// engine's replay buffer records seqs 0..N as lost; after a cache reset it is exact again; the
/// engine then restarts under it, and its new seqs 0..N must be a restart, not late copies.
#[test]
fn a_new_incarnation_at_seqs_declared_lost_is_a_restart_not_copies() {
    for reconnect in [true, false] {
        let m = IngestMetrics::for_tests();
        let mut st = RankState::new(Resume::New, Limits::default(), m.rank(0));
        let mut handoff = Rec::default();
        let mut eng = Engine::new(&[20, 21, 22], ReplayEnd::Complete);
        st.catch_up(&mut handoff, &mut eng);
        assert_eq!(handoff.0, ["clear:missing_history", "20:r", "21:r", "22:r"]);
        st.on_live(23, None, b"c", &mut handoff, Some(&mut eng));
        if reconnect {
            st.on_reconnect();
        }
        // The new incarnation: seq 0 (then 1), where nothing is known but "lost".
        let mut eng = Engine::restarted(&[0]);
        st.on_live(0, None, b"n", &mut handoff, Some(&mut eng));
        assert_eq!(
            eng.requests,
            [23, 0],
            "asked for `last`, then the new history"
        );
        let tail: Vec<_> = handoff.0[5..].to_vec();
        assert_eq!(
            tail,
            ["clear:engine_restart", "0:n"],
            "reconnect {reconnect}"
        );
        assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
        st.on_live(1, None, b"n1", &mut handoff, Some(&mut eng));
        assert_eq!(handoff.0.last().unwrap(), "1:n1");
    }
}

#[test]
fn an_unproven_seq_without_a_replay_endpoint_is_a_restart() {
    let (mut st, mut handoff) = (state(None), Rec::default());
    // A gap without replay: seqs 0..=4 are lost.
    st.on_live(5, None, b"a", &mut handoff, None);
    st.on_live(6, None, b"b", &mut handoff, None);
    st.on_live(2, None, b"x", &mut handoff, None);
    assert_eq!(
        handoff.0,
        [
            "clear:unfillable_gap",
            "5:a",
            "6:b",
            "clear:engine_restart",
            "clear:unfillable_gap",
            "2:x"
        ]
    );
}

#[test]
fn a_seq_older_than_the_digest_window_is_checked_against_the_engine() {
    let limits = Limits {
        window: 2,
        ..Limits::default()
    };
    let m = IngestMetrics::for_tests();
    let mut st = RankState::new(Resume::New, limits, m.rank(0));
    let mut handoff = Rec::default();
    for s in 0..6 {
        st.on_live(s, None, b"r", &mut handoff, None);
    }
    // The same incarnation: `last` (5) is what the engine replays.
    let mut eng = Engine::new(&[3, 4, 5], ReplayEnd::Complete);
    st.on_live(1, None, b"r", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [5]);
    assert_eq!(handoff.0.len(), 6);
    assert_eq!(m.duplicates_dropped.with_label_values(&["0"]).get(), 1);
    // Another incarnation that has not reached seq 5 yet.
    let mut eng = Engine::restarted(&[0, 1]);
    st.on_live(1, None, b"n", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [5, 0]);
    assert_eq!(&handoff.0[6..], ["clear:engine_restart", "0:n", "1:n"]);
}

#[test]
fn a_digest_the_ring_did_not_record_is_not_taken_as_proof() {
    let mut st = RankState::new(
        Resume::Applied { seq: 2, digest: 0 },
        Limits::default(),
        IngestMetrics::for_tests().rank(0),
    );
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[0, 1, 2, 3], ReplayEnd::Complete);
    st.catch_up(&mut handoff, &mut eng);
    assert_eq!(
        handoff.0,
        ["clear:engine_restart", "0:r", "1:r", "2:r", "3:r"]
    );
}

#[test]
fn an_adopted_ring_without_the_rank_clears_before_its_first_batch() {
    let mut st = RankState::new(
        Resume::Unknown,
        Limits::default(),
        IngestMetrics::for_tests().rank(0),
    );
    let mut handoff = Rec::default();
    let mut eng = Engine::new(&[4, 5], ReplayEnd::Complete);
    st.catch_up(&mut handoff, &mut eng);
    assert_eq!(handoff.0, ["clear:missing_history", "4:r", "5:r"]);
    let mut st = RankState::new(
        Resume::Unknown,
        Limits::default(),
        IngestMetrics::for_tests().rank(0),
    );
    let mut handoff = Rec::default();
    st.on_live(0, None, b"a", &mut handoff, None);
    st.on_live(1, None, b"b", &mut handoff, None);
    assert_eq!(handoff.0, ["clear:missing_history", "0:a", "1:b"]);
}

#[test]
fn after_a_reconnect_the_next_batch_in_order_is_checked_first() {
    let m = IngestMetrics::for_tests();
    let mut st = RankState::new(Resume::New, Limits::default(), m.rank(0));
    let mut handoff = Rec::default();
    for s in 0..=3 {
        st.on_live(s, None, b"r", &mut handoff, None);
    }
    // The same publisher again: its replay's copy of 3 matches; 4 is applied once.
    st.on_reconnect();
    let mut eng = Engine::new(&[0, 1, 2, 3, 4], ReplayEnd::Complete);
    st.on_live(4, None, b"r", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [3]);
    assert_eq!(handoff.0[4..], ["4:r"]);
    // A new incarnation that happens to be one past `last`: caught by the comparison.
    st.on_reconnect();
    let mut eng = Engine::restarted(&[0, 1, 2, 3, 4, 5]);
    st.on_live(5, None, b"n", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [4, 0]);
    assert_eq!(
        handoff.0[5..],
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
    st.on_live(6, None, b"n", &mut handoff, Some(&mut eng));
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
    let mut handoff = Rec::default();
    let mut eng = Engine::with_live(&[1, 2], ReplayEnd::Complete, &[4, 5, 6]);
    st.on_live(3, None, b"l", &mut handoff, Some(&mut eng));
    assert_eq!(handoff.0, ["1:r", "2:r", "clear:replay_overflow"]);
    assert_eq!(st.pos(), Pos::AcceptAny);
}

/// The engines' next wire (docs/engine-wire.md §13): a publisher epoch decides the incarnation.
#[test]
fn a_new_epoch_is_a_restart_even_where_the_seq_goes_on() {
    let m = IngestMetrics::for_tests();
    let mut st = RankState::new(Resume::New, Limits::default(), m.rank(0));
    let mut handoff = Rec::default();
    let (a, b) = (Some(Epoch(1)), Some(Epoch(2)));
    st.on_live(0, a, b"a0", &mut handoff, None);
    st.on_live(1, a, b"a1", &mut handoff, None);
    // A new publisher whose first seq happens to follow: a restart all the same; its seq 2 is a
    // gap after the clear (no replay here).
    let mut eng = Engine::restarted(&[0, 1, 2]);
    st.on_live(2, b, b"n", &mut handoff, Some(&mut eng));
    assert_eq!(eng.requests, [0], "the new incarnation's whole history");
    assert_eq!(
        handoff.0,
        ["0:a0", "1:a1", "clear:engine_restart", "0:n", "1:n", "2:n"]
    );
    assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 1);
}

#[test]
fn the_same_epoch_makes_a_lower_seq_a_copy_without_asking_the_engine() {
    let m = IngestMetrics::for_tests();
    let limits = Limits {
        window: 2,
        ..Limits::default()
    };
    let mut st = RankState::new(Resume::New, limits, m.rank(0));
    let mut handoff = Rec::default();
    let a = Some(Epoch(7));
    for s in 0..5 {
        st.on_live(s, a, b"x", &mut handoff, None);
    }
    st.on_reconnect();
    // Older than the digest window, other bytes, no replay endpoint: the epoch decides.
    st.on_live(1, a, b"other", &mut handoff, None);
    st.on_live(5, a, b"y", &mut handoff, None);
    assert_eq!(handoff.0.len(), 6);
    assert_eq!(handoff.0.last().unwrap(), "5:y");
    assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
    assert_eq!(m.duplicates_dropped.with_label_values(&["0"]).get(), 1);
}

#[test]
fn without_an_epoch_before_the_bytes_decide() {
    // The first epoch seen after a start names nothing to compare with: the content rule.
    let (mut st, mut handoff) = (state(Some(3)), Rec::default());
    let mut eng = Engine::restarted(&[0, 1]);
    st.on_live(1, Some(Epoch(9)), b"n", &mut handoff, Some(&mut eng));
    assert_eq!(handoff.0, ["clear:engine_restart", "0:n", "1:n"]);
}

/// An engine whose replay buffer holds `have` (batches `b"r"`) and whose snapshot service
/// answers `snap`.
struct SnapshotEngine {
    inner: Engine,
    snap: EngineSnapshot,
    asked: u32,
}
impl SnapshotEngine {
    /// Buffering `have`, its snapshot the state at 12 in two chunks `s1`, `s2`.
    fn at_12(have: &[u64]) -> Self {
        SnapshotEngine {
            inner: Engine::new(have, ReplayEnd::Complete),
            snap: EngineSnapshot::State {
                cut: 12,
                epoch: Epoch(7),
                chunks: vec![b"s1".to_vec(), b"s2".to_vec()],
            },
            asked: 0,
        }
    }
}
impl ReplaySource for SnapshotEngine {
    fn replay(
        &mut self,
        from: u64,
        batch: &mut dyn FnMut(u64, &[u8]),
        live: &mut dyn FnMut(u64, Vec<u8>),
    ) -> ReplayEnd {
        self.inner.replay(from, batch, live)
    }
    fn has_snapshot(&self) -> bool {
        true
    }
    fn snapshot(&mut self, live: &mut dyn FnMut(u64, Vec<u8>)) -> EngineSnapshot {
        self.asked += 1;
        // A live batch at the cut arrives meanwhile: a copy of what the snapshot holds.
        live(12, b"r".to_vec());
        self.snap.clone()
    }
}

#[test]
fn a_history_the_replay_no_longer_holds_comes_from_the_engines_snapshot() {
    let (mut st, m) = state_with_metrics();
    let mut handoff = Rec::default();
    let mut engine = SnapshotEngine::at_12(&[10, 11, 12, 13]);
    st.catch_up(&mut handoff, &mut engine);
    // One clear, the state at 12, then 13 from the replay; the live copy of 12 is dropped, and
    // nothing of the replay before the snapshot was applied.
    assert_eq!(
        handoff.0,
        ["clear:missing_history", "12:s1", "12:s2", "13:r"]
    );
    assert_eq!(engine.asked, 1);
    // From 0 (history missing), from the cut (its batch's digest, for the ring), after it.
    assert_eq!(engine.inner.requests, [0, 12, 13]);
    assert_eq!(st.pos(), Pos::Last(13));
    assert_eq!(m.replays.with_label_values(&["0", "snapshot"]).get(), 1);
    assert_eq!(m.engine_restarts.with_label_values(&["0"]).get(), 0);
}

#[test]
fn an_unavailable_snapshot_falls_back_to_the_missing_history() {
    let (mut st, m) = state_with_metrics();
    let mut handoff = Rec::default();
    let mut engine = SnapshotEngine {
        inner: Engine::new(&[10, 11], ReplayEnd::Complete),
        snap: EngineSnapshot::Unavailable("-2"),
        asked: 0,
    };
    st.catch_up(&mut handoff, &mut engine);
    // (12 arrived live while the snapshot was asked for: the next batch, applied in order)
    assert_eq!(handoff.0, ["clear:missing_history", "10:r", "11:r", "12:r"]);
    assert_eq!(engine.inner.requests, [0, 0]);
    assert_eq!(
        m.replays
            .with_label_values(&["0", "snapshot_unavailable"])
            .get(),
        1
    );
}

/// What a restarted kvbridge finds in the ring after a snapshot: the last chunk recorded with the
/// digest of the engine's own batch at the cut, so its replay of `last` proves the incarnation.
#[test]
fn the_snapshot_is_recorded_with_the_engines_digest_at_the_cut() {
    #[derive(Default)]
    struct Digests(Vec<(u64, u32)>);
    impl Handoff for Digests {
        fn apply(&mut self, seq: u64, digest: u32, _payload: &[u8]) {
            self.0.push((seq, digest));
        }
        fn clear(&mut self, _s: u64, _cause: ClearCause) {}
    }
    let (mut st, _m) = state_with_metrics();
    let mut handoff = Digests::default();
    let mut engine = SnapshotEngine::at_12(&[10, 11, 12]);
    st.catch_up(&mut handoff, &mut engine);
    assert_eq!(handoff.0, [(12, digest(b"s1")), (12, digest(b"r"))]);
    // A kvbridge restart resumes at 12 with that digest: the engine's replay of 12 matches.
    let mut again = RankState::new(
        Resume::Applied {
            seq: 12,
            digest: digest(b"r"),
        },
        Limits::default(),
        IngestMetrics::for_tests().rank(0),
    );
    let mut rec = Rec::default();
    again.catch_up(
        &mut rec,
        &mut Engine::new(&[10, 11, 12, 13], ReplayEnd::Complete),
    );
    assert_eq!(rec.0, ["13:r"], "a continuation, not a restart");
}
