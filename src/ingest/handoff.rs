//! The end of ingest: decode each batch once, straight into the rank's ring(s).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::upstream::Handoff;
use super::Targets;
use crate::decode::{parse_group_note, ClearedBatch, Decoder, GroupNote};
use crate::health::{Degraded, UpstreamState};
use crate::ingest::RankMetrics;
use crate::ring::{ClearCause, RingHub};

/// Writer-note kind of a rank's freshness: `[2, cause, rank u16 LE, 0…]`, present only while
/// the rank is degraded, so that a restarted kvbridge does not call exact what it knew was not
/// (kind 1 is a KV-cache group, decode/groups.rs).
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

/// `rank`'s freshness as the ring's writer notes kept it (`None`: exact, or no note).
pub(super) fn degraded_of(notes: &[[u8; 16]], rank: u32) -> Option<Degraded> {
    notes
        .iter()
        .filter_map(parse_freshness_note)
        .find(|(r, _)| *r == rank)
        .map(|(_, d)| d)
}

/// The freshness series' label values.
pub(super) fn degraded_labels() -> Vec<&'static str> {
    Degraded::ALL.iter().map(|d| d.label()).collect()
}

/// Decodes each batch once and publishes it into the rank's ring(s).
pub(super) struct RingHandoff {
    rank: u32,
    decoder: Decoder,
    targets: Targets,
    m: RankMetrics,
    upstream: Arc<UpstreamState>,
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
    ) -> Self {
        RingHandoff {
            rank,
            decoder,
            targets,
            m,
            upstream,
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
    /// Sets this rank's freshness (`None`: exact). On a change: the shared state, the metric,
    /// one log line, and the ring's writer notes (a degraded rank stays degraded across a
    /// kvbridge restart; the note is written before the batch or clear that follows).
    fn set_fresh(&mut self, why: Option<Degraded>) {
        let was = self.upstream.set_degraded(self.rank, why);
        if was == why {
            return;
        }
        self.m
            .set_freshness(&degraded_labels(), why.map(Degraded::label));
        match why {
            Some(d) => tracing::warn!(
                rank = self.rank,
                cause = d.label(),
                "rank output degraded: it may miss blocks the engine holds (or hold ones it dropped) until the engine's next cache reset or restart"
            ),
            None => tracing::info!(
                rank = self.rank,
                was = was.map(Degraded::label),
                "rank output exact again: the engine's cache reset or restart is in the stream"
            ),
        }
        let rank = self.rank;
        let mut failed = None;
        for (hub, _) in ring_targets(&self.targets) {
            let kept = hub.update_notes(|all| {
                all.retain(|n| !matches!(parse_freshness_note(n), Some((r, _)) if r == rank));
                if let Some(d) = why {
                    all.push(freshness_note(rank, d));
                }
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
        let before = self.decoder.stats();
        let (cleared, unknown) = (before.cleared_events, before.filtered_group_unknown);
        let plan = match self.decoder.plan(payload) {
            Ok(p) => p,
            Err(e) => {
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
        let after = self.decoder.stats();
        let (cleared_now, unknown_now) = (after.cleared_events, after.filtered_group_unknown);
        if cleared_now > cleared {
            self.set_fresh(None);
        }
        if unknown_now > unknown {
            self.set_fresh(Some(Degraded::UnknownGroup));
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
            flags: 0,
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
        // cause leaves blocks the engine holds (or dropped) that no consumer will hear of.
        self.set_fresh(match cause {
            ClearCause::EngineRestart => None,
            ClearCause::UnfillableGap => Some(Degraded::UnfillableGap),
            ClearCause::MissingHistory => Some(Degraded::MissingHistory),
            ClearCause::Undecodable => Some(Degraded::Undecodable),
            ClearCause::ReplayOverflow => Some(Degraded::ReplayOverflow),
            ClearCause::LostRemoval => Some(Degraded::LostRemoval),
        });
        self.m.clear(cause.label());
        let msg = format!("signalling a cleared cache in band (engine seq {upstream_seq})");
        self.warn_limited(cause.label(), &msg);
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
