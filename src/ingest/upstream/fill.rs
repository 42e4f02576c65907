//! Filling a gap through the engine's replay service (docs/engine-wire.md §8): ask, apply what
//! is replayed while queueing the live batches that arrive meanwhile, retry or give up in band,
//! then handle the queued live batches.

use std::collections::VecDeque;

use super::{digest, EngineSnapshot, Fill, Handoff, Pos, RankState, ReplayEnd, ReplaySource};
use crate::ingest::wire::Epoch;
use crate::ring::ClearCause;

/// What one replay request brought.
struct Tally {
    /// No batch after `last` applied yet (a missing one is then `history_missing`, not a hole).
    first: bool,
    /// Batches received.
    received: u64,
    /// One contradicted what was applied at its seq: a new incarnation.
    other_incarnation: bool,
    /// The engine no longer has what was asked for, and its snapshot is to be taken instead:
    /// the rest of the replay is not applied.
    missing: bool,
}

/// What follows a replay that did not meet a new incarnation.
enum Next {
    /// The fill is over: drain the live batches.
    Done,
    /// Shutdown: return at once.
    Aborted,
    /// Ask again.
    Retry,
}

impl RankState {
    /// Replays from `from`, merging the live batches that arrive meanwhile (`live` holds those
    /// that arrived before), then drains the merged live batches.
    pub(super) fn fill(
        &mut self,
        from: u64,
        mut live: VecDeque<(u64, Vec<u8>)>,
        handoff: &mut dyn Handoff,
        mut rep: Option<&mut dyn ReplaySource>,
        why: Fill,
    ) {
        let Some(source) = rep.as_mut() else {
            return;
        };
        self.proven_by_replay = false;
        self.snapshot_ok = source.has_snapshot();
        let mut overflow = false;
        let mut want = from;
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.m.replay("requested");
            let (end, tally) =
                self.replay_once(&mut **source, want, &mut live, &mut overflow, handoff);
            if tally.missing {
                let limit = self.limits.live_buffer;
                let answer = source
                    .snapshot(&mut |ls, lp| queue_live(&mut live, &mut overflow, limit, ls, lp));
                match answer {
                    EngineSnapshot::State { cut, epoch, chunks } => {
                        // The engine's own batch at the cut (its replay buffer holds its newest
                        // batches): what the ring records for the state, so that a restarted
                        // kvbridge comparing the engine's replay of `last` finds it the same.
                        let mut at_cut = None;
                        source.replay(
                            cut,
                            &mut |rs, rp| {
                                if rs == cut {
                                    at_cut = Some(digest(rp));
                                }
                            },
                            &mut |ls, lp| queue_live(&mut live, &mut overflow, limit, ls, lp),
                        );
                        self.restore(cut, epoch, &chunks, at_cut, handoff);
                        // What the engine published after its cut, from its replay buffer.
                        want = cut + 1;
                        attempt = 0;
                    }
                    EngineSnapshot::Unavailable(why) => {
                        tracing::warn!(
                            why,
                            "the engine's snapshot gave no state: the history is missing"
                        );
                        self.m.replay("snapshot_unavailable");
                        self.snapshot_ok = false;
                        attempt -= 1;
                    }
                }
                continue;
            }
            let nothing_at_last = end == ReplayEnd::Complete
                && tally.received == 0
                && matches!(self.pos, Pos::Last(l) if l == want);
            if tally.other_incarnation || nothing_at_last {
                // A different batch where `last` was applied, or nothing at or after it (the
                // engine's newest is below `last`): a new incarnation. Its whole history, from 0.
                self.m.replay("other_incarnation");
                self.restart(handoff, want);
                want = 0;
                attempt -= 1;
                continue;
            }
            match self.after_replay(end, attempt, why, &mut want, handoff) {
                Next::Done => break,
                Next::Aborted => return,
                Next::Retry => {}
            }
        }
        self.drain_live(want, overflow, live, handoff);
    }

    /// One replay request from `want`: replayed batches are handled as they arrive
    /// ([`RankState::on_replayed`]); live batches that arrive meanwhile are queued on `live`, up
    /// to the limit (past it: `overflow`).
    fn replay_once(
        &mut self,
        source: &mut dyn ReplaySource,
        want: u64,
        live: &mut VecDeque<(u64, Vec<u8>)>,
        overflow: &mut bool,
        handoff: &mut dyn Handoff,
    ) -> (ReplayEnd, Tally) {
        let mut tally = Tally {
            first: true,
            received: 0,
            other_incarnation: false,
            missing: false,
        };
        let limit = self.limits.live_buffer;
        let end = source.replay(
            want,
            &mut |rs, rp| self.on_replayed(rs, rp, want, &mut tally, handoff),
            &mut |ls, lp| queue_live(live, overflow, limit, ls, lp),
        );
        (end, tally)
    }

    /// One replayed batch `rs` (bytes `rp`) of the replay asked from `want`: a copy of what was
    /// applied at or below `last` (counted, and proof of the incarnation), one that contradicts
    /// it (noted: the caller restarts), or a batch to apply, after an in-band clear when the
    /// engine no longer has what comes before it.
    fn on_replayed(
        &mut self,
        rs: u64,
        rp: &[u8],
        want: u64,
        tally: &mut Tally,
        handoff: &mut dyn Handoff,
    ) {
        if tally.other_incarnation || tally.missing {
            // The rest of a new incarnation's answer (asked again from 0 by the caller), or of
            // one the engine's snapshot replaces.
            return;
        }
        tally.received += 1;
        let d = digest(rp);
        let expected = match self.pos {
            Pos::Last(l) if rs <= l => {
                match self.applied_at(rs) {
                    Some(known) if known != d => tally.other_incarnation = true,
                    Some(_) => {
                        self.verified = true;
                        self.proven_by_replay |= rs == l;
                        // (the copy of `last` asked for, to compare, is no
                        // duplicate: anything else at or below it is)
                        if rs != want {
                            self.m.duplicates.inc();
                        }
                    }
                    // Older than the window: nothing to compare with.
                    None => self.m.duplicates.inc(),
                }
                // (`first` stays: it means the first batch after `last`)
                return;
            }
            Pos::Last(l) => l + 1,
            // Unknown: whatever comes first is preceded by a clear anyway.
            Pos::Unknown => rs,
            _ => want,
        };
        if rs > expected && self.snapshot_ok {
            // The engine's snapshot stands in for the history its buffer no longer holds.
            tally.missing = true;
            return;
        }
        if rs > expected {
            // The engine no longer has (or never had: burned seqs) what we
            // asked for; or it no longer has `last`, which then cannot be
            // compared: either way, what it held is gone.
            self.m.replay(if tally.first {
                "history_missing"
            } else {
                "hole"
            });
            self.clear(handoff, rs, ClearCause::MissingHistory);
            self.pos = Pos::AcceptAny;
        }
        tally.first = false;
        self.m.replayed.inc();
        self.apply(rs, d, rp, handoff);
    }

    /// Counts how the `attempt`th replay of this fill ended, and decides what follows: a failed
    /// one is retried (from what is now wanted) until the attempts run out; then a gap is given
    /// up in band.
    fn after_replay(
        &mut self,
        end: ReplayEnd,
        attempt: u32,
        why: Fill,
        want: &mut u64,
        handoff: &mut dyn Handoff,
    ) -> Next {
        match end {
            ReplayEnd::Complete => {
                self.m.replay("succeeded");
                Next::Done
            }
            ReplayEnd::Aborted => Next::Aborted,
            ReplayEnd::TimedOut | ReplayEnd::Malformed => {
                self.m.replay(if end == ReplayEnd::TimedOut {
                    "timed_out"
                } else {
                    "malformed"
                });
                if attempt >= self.limits.replay_attempts {
                    if why == Fill::Gap {
                        self.m.replay("gave_up");
                        self.clear(handoff, *want, ClearCause::UnfillableGap);
                        self.pos = Pos::AcceptAny;
                    }
                    // On start-up, a silent replay endpoint only means we cannot prove what
                    // we missed, and a check of the next batch in order that cannot be made
                    // is no loss: the live stream decides (a gap in it is still reported).
                    return Next::Done;
                }
                *want = match self.pos {
                    Pos::Last(l) if self.verified => l + 1,
                    Pos::Last(l) => l,
                    _ => *want,
                };
                Next::Retry
            }
        }
    }

    /// Applies the engine's snapshot as a replacement state: an in-band clear (consumers drop
    /// what they hold), its chunks as batches numbered `cut`, then the rank is exact again and
    /// the state machine stands at `cut`, proven the incarnation of `epoch` (live batches queued
    /// at or below `cut` are copies).
    /// `at_cut`, the digest of the engine's batch at the cut when its replay still had it, is
    /// recorded with the last chunk (and kept as what was applied at `cut`).
    fn restore(
        &mut self,
        cut: u64,
        epoch: Epoch,
        chunks: &[Vec<u8>],
        at_cut: Option<u32>,
        handoff: &mut dyn Handoff,
    ) {
        self.clear(handoff, cut, ClearCause::MissingHistory);
        for (i, c) in chunks.iter().enumerate() {
            let d = match at_cut {
                Some(d) if i + 1 == chunks.len() => d,
                _ => digest(c),
            };
            handoff.apply(cut, d, c);
        }
        handoff.restored();
        self.pos = Pos::Last(cut);
        self.applied.clear();
        if let Some(d) = at_cut {
            self.applied.push_back((cut, d));
        }
        self.verified = true;
        self.proven_by_replay = true;
        self.epoch = Some(epoch);
        self.m.last_seq.set(cut as i64);
        // Counted once the state is in place and the rank exact, so that a reader who sees the
        // count sees the rank's restored freshness too.
        self.m.replay("snapshot");
    }

    /// After a fill: live batches beyond the buffer fail it in band (the buffered ones are
    /// dropped with them); else the buffered ones are handled in order.
    fn drain_live(
        &mut self,
        want: u64,
        overflow: bool,
        mut live: VecDeque<(u64, Vec<u8>)>,
        handoff: &mut dyn Handoff,
    ) {
        if overflow {
            self.m.replay("live_overflow");
            self.clear(handoff, want, ClearCause::ReplayOverflow);
            self.pos = Pos::AcceptAny;
            live.clear();
        }
        while let Some((s, p)) = live.pop_front() {
            // One replay per gap: a gap still open after it is reported, not replayed again;
            // a copy of a replayed batch is recognised by its bytes.
            self.step(s, &p, handoff, None, false);
        }
        self.proven_by_replay = false;
    }
}

/// Queues live batch `ls` (bytes `lp`) that arrived during a replay or snapshot, up to `limit`
/// (past it: `overflow`).
fn queue_live(
    live: &mut VecDeque<(u64, Vec<u8>)>,
    overflow: &mut bool,
    limit: usize,
    ls: u64,
    lp: Vec<u8>,
) {
    if live.len() >= limit {
        *overflow = true;
    } else {
        live.push_back((ls, lp));
    }
}
