//! What the ring stores: records that a source writes in place, and the header the ring assigns.
//!
//! The ring does not know how a record is encoded. Anything that can say how many records it
//! becomes, how long each is for a given header, and write each one into a slot can be published:
//! the decoder's planned engine batch and the synthesized `cleared` batch both implement
//! [`RecordSource`]. This keeps the data path one-way: `ingest → decode → ring`.

use kvbridge_shm::RecordMeta;

/// Per-record values the ring decides (it assigns numbers) and the source writes into the record.
#[derive(Clone, Copy, Debug)]
pub struct RecordHeader {
    /// `KvEventBatch.sequence_number` (≥ 1).
    pub sequence_number: u64,
    /// `event_id` of the record's first event; later events count up by one.
    pub first_event_id: u64,
    /// `KvEventBatch.dp_rank`, sent only when `Some`.
    pub dp_rank: Option<i32>,
}

/// One unit of input (an engine batch, a synthesized clear) that becomes `records()` ring records.
///
/// The ring calls, for each `i` in `0..records()`, `record_len(i, hdr)`, reserves that many bytes,
/// calls `write_record(i, hdr, slot)` (which must write exactly that many bytes) and advances the
/// event id by `record_events(i)`; all under the writer lock, so the numbering is contiguous.
pub trait RecordSource {
    /// Number of records (0: nothing to publish).
    fn records(&self) -> usize;
    /// Exact encoded length of record `i` with header `hdr`.
    fn record_len(&self, i: usize, hdr: &RecordHeader) -> usize;
    /// Writes record `i` into `out[..record_len(i, hdr)]`; returns the length written.
    fn write_record(&self, i: usize, hdr: &RecordHeader, out: &mut [u8]) -> usize;
    /// Event ids record `i` consumes.
    fn record_events(&self, i: usize) -> u64;
}

/// Record flag: a batch kvbridge synthesized (an in-band clear), not an engine batch.
pub const FLAG_SYNTHESIZED: u32 = 1;

/// Why kvbridge inserted a `cleared` event (docs/smg-api.md §6.4). Stored in record flags bits 8..16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClearCause {
    /// The engine's sequence went back: a new incarnation with an empty cache.
    EngineRestart = 1,
    /// A gap with no replay endpoint, or one replay could not fill.
    UnfillableGap = 2,
    /// The engine's replay buffer no longer held the start of the gap.
    MissingHistory = 3,
    /// A batch that could not be decoded (or was empty) consumed a sequence number.
    Undecodable = 4,
    /// Live batches overflowed the buffer kept during a replay.
    ReplayOverflow = 5,
    /// A `BlockRemoved` could not be decoded: the index would keep a stale block.
    LostRemoval = 6,
}

impl ClearCause {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            ClearCause::EngineRestart => "engine_restart",
            ClearCause::UnfillableGap => "unfillable_gap",
            ClearCause::MissingHistory => "missing_history",
            ClearCause::Undecodable => "undecodable",
            ClearCause::ReplayOverflow => "replay_overflow",
            ClearCause::LostRemoval => "lost_removal",
        }
    }

    /// Record metadata of the synthesized clear for engine rank `rank`, at engine seq
    /// `upstream_seq`, stamped now.
    pub fn meta(self, rank: u32, upstream_seq: u64) -> RecordMeta {
        RecordMeta {
            dp_rank: rank,
            upstream_seq,
            flags: FLAG_SYNTHESIZED | ((self as u32) << 8),
            ingest_ns: crate::clock::unix_nanos(),
        }
    }
}
