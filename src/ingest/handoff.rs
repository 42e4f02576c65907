//! The end of ingest: decode each batch once, straight into the rank's ring(s).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::upstream::Handoff;
use super::Targets;
use crate::decode::{parse_group_note, ClearedBatch, Decoder, GroupNote};
use crate::health::{Causes, Degraded, UpstreamState};
use crate::ingest::RankMetrics;
use crate::ring::{ClearCause, RingHub};

/// Writer-note kind of a rank's freshness: `[2, cause, rank u16 LE, 0…]`, one note per active
/// cause, present only while the rank is degraded, so that a restarted kvbridge does not call
/// exact what it knew was not (kind 1 is a KV-cache group, decode/groups.rs).
const NOTE_FRESHNESS: u8 = 2;

fn freshness_note(rank: u32, why: Degraded) -> [u8; 16] {
    let mut n = [0u8; 16];
    n[0] = NOTE_FRESHNESS;
    n[1] = why as u8;
    n[2..4].copy_from_slice(&(rank as u16).to_le_bytes());
    n
}

fn parse_freshness_note(n: &[u8; 16]) -> Option<(u32, Degraded)> {
    if n[0] != NOTE_FRESHNESS {
        return None;
    }
    let rank = u16::from_le_bytes([n[2], n[3]]) as u32;
    Degraded::from_code(n[1]).map(|d| (rank, d))
}

/// `rank`'s causes as the ring's writer notes kept them (exact when there is no note).
pub(super) fn causes_of(notes: &[[u8; 16]], rank: u32) -> Causes {
    notes
        .iter()
        .filter_map(parse_freshness_note)
        .filter(|(r, _)| *r == rank)
        .fold(Causes::EXACT, |c, (_, d)| c.with(d))
}

/// Decodes each batch once and publishes it into the rank's ring(s).
pub(super) struct RingHandoff {
    rank: u32,
    decoder: Decoder,
    targets: Targets,
    m: RankMetrics,
    upstream: Arc<UpstreamState>,
    /// No consumer can hold a block of a KV-cache group the decoder has not seen: every store
    /// forwarded since the last clear taught its group first (and the groups are restored from
    /// the ring across restarts). Then a removal dropped for an unseen group (`--profile smg`)
    /// cannot leave a block behind, and is no cause to call the rank degraded. False only on a
    /// ring that holds this rank's batches but none of its groups (written before groups were
    /// kept), until the next clear.
    groups_complete: bool,
    /// An engine restart was signalled and its clear not yet published: the new incarnation's
    /// first batch decides. When it is nothing but the engine's own clear (SGLang publishes one
    /// as seq 0 of every start), that is the clear consumers get, so that they drop their index
    /// once per restart, not twice; otherwise the synthesized clear goes first. Published by
    /// [`Handoff::settle`] at the latest, before the state machine waits for the next message.
    pending_restart: Option<u64>,
    warned: std::collections::HashMap<&'static str, (Instant, u64)>,
    last_flush: Instant,
}

impl RingHandoff {
    pub(super) fn new(
        rank: u32,
        decoder: Decoder,
        targets: Targets,
        m: RankMetrics,
        upstream: Arc<UpstreamState>,
        groups_complete: bool,
    ) -> Self {
        RingHandoff {
            rank,
            decoder,
            targets,
            m,
            upstream,
            groups_complete,
            pending_restart: None,
            warned: Default::default(),
            last_flush: Instant::now(),
        }
    }

    /// Logs at most one warning per kind every 10 s, with the count suppressed meanwhile.
    pub(super) fn warn_limited(&mut self, kind: &'static str, msg: &str) {
        let now = Instant::now();
        let e = self
            .warned
            .entry(kind)
            .or_insert((now - Duration::from_secs(3600), 0));
        if now.duration_since(e.0) >= Duration::from_secs(10) {
            tracing::warn!(rank = self.rank, kind, suppressed = e.1, "{msg}");
            *e = (now, 0);
        } else {
            e.1 += 1;
        }
    }

    /// Exports the decoder's counters (at most every 500 ms unless `force`).
    pub(super) fn flush_decoder_metrics(&mut self, force: bool) {
        if !force && self.last_flush.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_flush = Instant::now();
        for (kind, value) in self.decoder.stats().counters() {
            self.m.decoder_set(kind, value);
        }
    }
}

impl RingHandoff {
    /// Writes this rank's groups to the writer notes of each ring it feeds, when the decoder
    /// learnt something new (decode/groups.rs: why they must survive a restart).
    fn keep_groups(&mut self) {
        let Some(notes) = self.decoder.group_notes_changed(self.rank) else {
            return;
        };
        let rank = self.rank;
        let mut failed = None;
        for (hub, _) in ring_targets(&self.targets) {
            let kept = hub.update_notes(|all| {
                all.retain(|n| !matches!(parse_group_note(n), Some((r, _, _)) if r == rank));
                all.extend_from_slice(&notes);
            });
            if let Err(e) = kept {
                failed = Some(format!("ring {} notes write failed: {e}", hub.label()));
            }
        }
        if let Some(msg) = failed {
            self.warn_limited("ring_notes", &msg);
        }
    }
}

impl RingHandoff {
    /// Adds `d` to this rank's causes.
    fn degrade(&mut self, d: Degraded) {
        let now = self.upstream.causes(self.rank).with(d);
        self.set_causes(now);
    }

    /// Sets this rank's causes ([`Causes::EXACT`]: exact). On a change: the shared state, the
    /// metrics, one log line, and the ring's writer notes (a degraded rank stays degraded across
    /// a kvbridge restart; the notes are written before the batch or clear that follows).
    fn set_causes(&mut self, now: Causes) {
        let was = self.upstream.set_causes(self.rank, now);
        if was == now {
            return;
        }
        self.m.set_freshness(now);
        if now.is_exact() {
            tracing::info!(
                rank = self.rank,
                was = ?was.labels(),
                "rank output exact again: the engine's cache reset or restart is in the stream"
            );
        } else {
            tracing::warn!(
                rank = self.rank,
                causes = ?now.labels(),
                "rank output degraded: it may miss blocks the engine holds (or hold ones it dropped) until the engine's next cache reset or restart"
            );
        }
        let rank = self.rank;
        let mut failed = None;
        for (hub, _) in ring_targets(&self.targets) {
            let kept = hub.update_notes(|all| {
                all.retain(|n| !matches!(parse_freshness_note(n), Some((r, _)) if r == rank));
                all.extend(now.iter().map(|d| freshness_note(rank, d)));
            });
            if let Err(e) = kept {
                failed = Some(format!("ring {} notes write failed: {e}", hub.label()));
            }
        }
        if let Some(msg) = failed {
            self.warn_limited("ring_notes", &msg);
        }
    }
}

/// The groups of `rank` among a ring's writer notes.
pub(super) fn groups_of(notes: &[[u8; 16]], rank: u32) -> Vec<(u32, GroupNote)> {
    notes
        .iter()
        .filter_map(parse_group_note)
        .filter(|(r, _, _)| *r == rank)
        .map(|(_, i, g)| (i, g))
        .collect()
}

/// Each ring this rank feeds, with whether its records carry `dp_rank`.
fn ring_targets(t: &Targets) -> impl Iterator<Item = (&Arc<RingHub>, bool)> {
    std::iter::once((&t.merged, t.merged_sends_rank)).chain(t.own.iter().map(|h| (h, true)))
}

impl Handoff for RingHandoff {
    fn apply(&mut self, seq: u64, digest: u32, payload: &[u8]) {
        self.m.batches.inc();
        if payload.is_empty() {
            // Only replay gets here with one (live ones are dropped before the state machine):
            // the engine's own copy is empty too, so the batch is lost for good
            // (docs/engine-wire.md §1).
            self.m.frame_dropped("empty_payload");
            self.clear(seq, ClearCause::Undecodable);
            return;
        }
        let before = ClearCount::of(self.decoder.stats());
        let unknown = self.decoder.stats().filtered_group_unknown;
        let plan = match self.decoder.plan(payload) {
            Ok(p) => p,
            Err(e) => {
                self.settle();
                self.m.decode_error(e.kind.label());
                let msg = format!("undecodable batch (engine seq {seq}): {e}");
                self.warn_limited("undecodable", &msg);
                self.clear(seq, ClearCause::Undecodable);
                return;
            }
        };
        if plan.lost_removals > 0 {
            // A removal the index will never see leaves a stale block that routes requests to
            // a worker that no longer holds it: reset this rank's state before the batch.
            self.warn_limited(
                "lost_removal",
                "a BlockRemoved could not be decoded; signalling a clear",
            );
            self.clear(seq, ClearCause::LostRemoval);
        }
        // What the batch taught about its groups is in the ring before the batch is.
        self.keep_groups();
        // The engine's own reset makes its state what follows again; a removal dropped for an
        // unknown group may leave a block behind (counted once per batch, after its clears).
        let unknown_now = self.decoder.stats().filtered_group_unknown;
        let after = ClearCount::of(self.decoder.stats());
        if after.only_clears_since(before) {
            // The engine's own clear, first in its incarnation: it is the restart's clear.
            self.pending_restart = None;
        }
        if after.forwards_more_than(before) {
            // Consumers drop what they hold here: the engine's state is what follows.
            self.groups_complete = true;
            self.set_causes(Causes::EXACT);
        }
        self.settle();
        if unknown_now > unknown && !self.groups_complete {
            self.degrade(Degraded::UnknownGroup);
        }
        let batch_rank = match plan.rank {
            Some(r) => {
                if r != self.rank as i64 {
                    self.m.rank_mismatch.inc();
                }
                i32::try_from(r).unwrap_or(self.rank as i32)
            }
            None => self.rank as i32,
        };
        let meta = kvbridge_shm::RecordMeta {
            dp_rank: self.rank,
            upstream_seq: seq,
            flags: if plan.signed_hashes {
                crate::ring::FLAG_SIGNED_HASHES
            } else {
                0
            },
            ingest_ns: crate::clock::unix_nanos(),
            // What a restarted kvbridge compares the engine's replay of `seq` with.
            upstream_digest: digest,
        };
        let batch = self.decoder.planned(&plan, payload);
        let mut failed = None;
        for (hub, sends_rank) in ring_targets(&self.targets) {
            if let Err(e) = hub.publish(&batch, sends_rank.then_some(batch_rank), meta) {
                failed = Some(format!("ring {} write failed: {e}", hub.label()));
            }
        }
        if let Some(msg) = failed {
            self.warn_limited("ring_write", &msg);
        }
    }

    fn clear(&mut self, upstream_seq: u64, cause: ClearCause) {
        if cause == ClearCause::EngineRestart {
            // The new incarnation teaches its groups again (it may serve another model); its
            // removals of a group come after its stores.
            self.decoder.forget_groups();
            self.keep_groups();
        }
        // After a restart the new incarnation's history follows from its start; every other
        // cause leaves blocks the engine holds (or dropped) that no consumer will hear of. Either
        // way consumers hold nothing from before the clear.
        self.groups_complete = true;
        match cause {
            ClearCause::EngineRestart => self.set_causes(Causes::EXACT),
            ClearCause::UnfillableGap => self.degrade(Degraded::UnfillableGap),
            ClearCause::MissingHistory => self.degrade(Degraded::MissingHistory),
            ClearCause::Undecodable => self.degrade(Degraded::Undecodable),
            ClearCause::ReplayOverflow => self.degrade(Degraded::ReplayOverflow),
            ClearCause::LostRemoval => self.degrade(Degraded::LostRemoval),
        }
        self.m.clear(cause.label());
        let msg = format!("signalling a cleared cache in band (engine seq {upstream_seq})");
        self.warn_limited(cause.label(), &msg);
        if cause == ClearCause::EngineRestart {
            // Published with the new incarnation's first batch, or by `settle` (field doc).
            self.pending_restart = Some(upstream_seq);
            return;
        }
        // This clear empties the consumers too: a pending restart's would be a second one.
        self.pending_restart = None;
        self.publish_clear(upstream_seq, cause);
    }

    fn settle(&mut self) {
        if let Some(seq) = self.pending_restart.take() {
            self.publish_clear(seq, ClearCause::EngineRestart);
        }
    }

    fn restored(&mut self) {
        // Exact again only when the snapshot's own clear is the one cause: a chunk that could
        // not be decoded (or a cause from before) keeps the rank degraded, as without a snapshot.
        if self.upstream.causes(self.rank) == Causes::of(Degraded::MissingHistory) {
            self.groups_complete = true;
            self.set_causes(Causes::EXACT);
        }
    }
}

impl RingHandoff {
    /// Writes a synthesized `cleared` record for this rank into each ring it feeds.
    fn publish_clear(&mut self, upstream_seq: u64, cause: ClearCause) {
        let src = ClearedBatch::new(crate::clock::unix_seconds());
        let meta = cause.meta(self.rank, upstream_seq);
        for (hub, sends_rank) in ring_targets(&self.targets) {
            let dp_rank = sends_rank.then_some(self.rank as i32);
            if let Err(e) = hub.publish(&src, dp_rank, meta) {
                tracing::error!(rank = self.rank, ring = hub.label(), error = %e, "cannot write the in-band clear");
            }
        }
    }
}

/// The decoder's counts that tell whether a batch forwarded an `AllBlocksCleared`.
#[derive(Clone, Copy)]
struct ClearCount {
    cleared: u64,
    others: u64,
    filtered_ownership: u64,
}

impl ClearCount {
    fn of(s: &crate::decode::DecodeStats) -> ClearCount {
        ClearCount {
            cleared: s.cleared_events,
            others: s.stored_events + s.removed_events,
            filtered_ownership: s.filtered_ownership,
        }
    }

    /// The batch planned since `before` forwards a clear to consumers: it had one, and the
    /// profile filtered nothing by ownership (the one filter a clear meets; a `kvcr` clear is
    /// not the engine's cache).
    fn forwards_more_than(self, before: ClearCount) -> bool {
        self.cleared > before.cleared && self.filtered_ownership == before.filtered_ownership
    }

    /// As [`Self::forwards_more_than`], and the batch had nothing but clears: it can stand for a
    /// restart's clear (SGLang's seq 0), which consumers must meet before any event of the new
    /// incarnation.
    fn only_clears_since(self, before: ClearCount) -> bool {
        self.forwards_more_than(before) && self.others == before.others
    }
}
