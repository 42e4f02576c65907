//! What the ring stores: records that a source writes in place, and the header the ring assigns.
//!
//! The ring does not know how a record is encoded. Anything that can say how many records it
//! becomes, how long each is for a given header, and write each one into a slot can be published:
//! the decoder's planned engine batch and the synthesized `cleared` batch both implement
//! [`RecordSource`]. This keeps the data path one-way: `ingest → decode → ring`.

use bytes::Bytes;
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
    /// Shows every event the source's records hold, in order, to `v` (once per source, not per
    /// record). Used by a [`PublishHook`](super::PublishHook) such as the snapshot table, which
    /// must follow the same events without decoding the records again. `records` are the bytes
    /// [`write_record`](Self::write_record) wrote, record `i` at index `i` (or empty when the
    /// caller does not have them): a source may hand out slices of them (a block's encoding)
    /// instead of encoding the same thing a second time. Default: no events.
    fn visit(&self, _records: &[Bytes], _v: &mut dyn EventVisitor) {}
}

/// Receives the events of a published source, after the filter profile, with every field a
/// store carries (see [`RecordSource::visit`]).
pub trait EventVisitor {
    /// A kept `BlockStored` (the whole engine event, even when it was split into parts).
    fn stored(&mut self, ev: &dyn StoredEvent);
    /// A kept `BlockRemoved`: its hashes, its `KvCacheTier` value (`None`: unset) and its
    /// `group_idx` (`None`: unset).
    fn removed(&mut self, hashes: &[i64], tier: Option<i32>, group: Option<u32>);
    /// A kept `cleared` (from the engine or synthesized by kvbridge).
    fn cleared(&mut self);
}

/// One kept store, readable block by block in its wire encoding.
pub trait StoredEvent {
    /// `parent_block_hash` of the first block (`None`: the chain starts at position 0).
    fn parent(&self) -> Option<i64>;
    /// Its `KvCacheTier` value (`None`: unset).
    fn tier(&self) -> Option<i32>;
    /// Its `group_idx` (`None`: unset).
    fn group(&self) -> Option<u32>;
    /// Number of blocks.
    fn blocks(&self) -> usize;
    /// `block_hash` of block `i`.
    fn hash(&self, i: usize) -> i64;
    /// Appends `KvBlocksStored` fields 3–12 (everything but `blocks` and `parent_block_hash`),
    /// canonically encoded, to `out`.
    fn write_attrs(&self, out: &mut Vec<u8>);
    /// Appends block `i` as a `KvBlocksStored.blocks` entry (tag, length, `KvBlock`) to `out`.
    fn write_block(&self, i: usize, out: &mut Vec<u8>);
}

/// Record flag: a batch kvbridge synthesized (an in-band clear), not an engine batch.
pub const FLAG_SYNTHESIZED: u32 = 1;
/// Record flag: the engine sent this batch's block hashes as signed int64 (one was a negative
/// msgpack int: SGLang), so that the engine-wire re-publish writes them back in that form.
pub const FLAG_SIGNED_HASHES: u32 = 2;

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
    /// Every cause (the metric's label values).
    pub const ALL: [ClearCause; 6] = [
        ClearCause::EngineRestart,
        ClearCause::UnfillableGap,
        ClearCause::MissingHistory,
        ClearCause::Undecodable,
        ClearCause::ReplayOverflow,
        ClearCause::LostRemoval,
    ];

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
            upstream_digest: 0,
        }
    }
}
