//! Decoder counters (plain `u64`s; the metrics module exports them).
use super::error::DecodeErrorKind;

/// Counters of one [`super::Decoder`], cumulative over its lifetime. Updated by `plan` only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Payloads given to `plan`.
    pub batches: u64,
    /// Payloads that planned successfully.
    pub batches_ok: u64,
    /// Map-shaped batches (the counted fallback of docs/engine-wire.md §3).
    pub map_batches: u64,
    /// Batches with an empty event list.
    pub empty_batches: u64,
    /// Batches that had events but were emptied by filtering/skipping (`records == 0`).
    pub emptied_batches: u64,
    /// Batches with extra bytes after the batch value (ignored).
    pub trailing_bytes: u64,
    /// Well-formed `BlockStored` events seen (before filtering).
    pub stored_events: u64,
    /// Well-formed `BlockRemoved` events seen (before filtering).
    pub removed_events: u64,
    /// Well-formed `AllBlocksCleared` events seen (before filtering).
    pub cleared_events: u64,
    /// Events with an unknown tag (skipped).
    pub unknown_tags: u64,
    /// `BlockInactive` events (vLLM #50732): nothing for a router's index, skipped.
    pub inactive_events: u64,
    /// Unknown map keys, unknown trailing array elements (events, batch, `metadata`), and keys
    /// that do not belong to the event's type. Skipped.
    pub unknown_keys: u64,
    /// Events skipped because they failed validation (wrong types, missing fields, not an
    /// array/map, too many blocks, invalid UTF-8 in a copied string).
    pub malformed_events: u64,
    /// Of `malformed_events`: `BlockRemoved` events (a lost removal; see `BatchPlan::lost_removals`).
    pub malformed_removals: u64,
    /// Of `malformed_events`: strings that were not valid UTF-8.
    pub invalid_utf8: u64,
    /// Of `malformed_events`: events over `max_blocks_per_event`.
    pub too_many_blocks: u64,
    /// Events with an empty hash list (nothing to do; skipped).
    pub empty_events: u64,
    /// Events whose smallest possible record exceeds `split_threshold` (dropped).
    pub oversized_events: u64,
    /// Stores whose tokens cannot be paired with their hashes (`bs == 0` with tokens, or
    /// `len(token_ids) != len(block_hashes) * bs`), excluding placeholders.
    pub unpairable_stores: u64,
    /// Offload placeholders (`token_ids == []` and `block_size == 0`).
    pub placeholders: u64,
    /// Stores whose `token_ids` are SGLang EAGLE bigrams (`[[t0, t1], [t1, t2], …]`), counted
    /// also as unpairable: forwarded hash-only, or filtered (engine-wire §5.4).
    pub bigram_stores: u64,
    /// Stores forwarded hash-only (Profile::All; unpairable + placeholders).
    pub hash_only_stores: u64,
    /// Profile::Smg: dropped for a DISK/EXTERNAL tier.
    pub filtered_tier: u64,
    /// Profile::Smg: dropped for a non-main-attention group.
    pub filtered_group: u64,
    /// Profile::Smg: removals of a group no store has been seen of (kind unknown).
    pub filtered_group_unknown: u64,
    /// Profile::Smg: stores contradicting their group's pinned kind or block size.
    pub filtered_group_conflict: u64,
    /// Profile::Smg: dropped for REMOTE locality.
    pub filtered_remote: u64,
    /// Profile::Smg: dropped for `kvcr` ownership.
    pub filtered_ownership: u64,
    /// Profile::Smg: unpairable stores and placeholders dropped.
    pub filtered_unpairable: u64,
    /// `locality` values other than LOCAL/REMOTE (left unset).
    pub locality_unknown: u64,
    /// Extra-key entries/items of an unsupported shape, and list-length mismatches (skipped).
    pub extra_key_shapes_skipped: u64,
    /// Batches that became more than one record.
    pub split_batches: u64,
    /// Events cut into more than one part (one chain / hash list over several events).
    pub split_events: u64,
    /// Records planned.
    pub records: u64,
    /// Events emitted into records (event ids consumed).
    pub emitted_events: u64,
    /// Decode errors: empty payload.
    pub err_empty: u64,
    /// Decode errors: truncated payload.
    pub err_truncated: u64,
    /// Decode errors: declared length beyond the input.
    pub err_length: u64,
    /// Decode errors: reserved marker.
    pub err_marker: u64,
    /// Decode errors: nesting too deep.
    pub err_depth: u64,
    /// Decode errors: wrong type / shape at batch level (incl. missing/duplicate batch keys).
    pub err_shape: u64,
    /// Decode errors: limits (events per batch, payload size).
    pub err_limit: u64,
}

impl DecodeStats {
    /// Every counter with its metric label (exported as `kvbridge_decoder_events_total{rank,kind}`).
    pub fn counters(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        [
            ("batches", self.batches),
            ("batches_ok", self.batches_ok),
            ("map_batches", self.map_batches),
            ("empty_batches", self.empty_batches),
            ("emptied_batches", self.emptied_batches),
            ("trailing_bytes", self.trailing_bytes),
            ("stored_events", self.stored_events),
            ("removed_events", self.removed_events),
            ("cleared_events", self.cleared_events),
            ("unknown_tags", self.unknown_tags),
            ("inactive_events", self.inactive_events),
            ("unknown_keys", self.unknown_keys),
            ("malformed_events", self.malformed_events),
            ("malformed_removals", self.malformed_removals),
            ("invalid_utf8", self.invalid_utf8),
            ("too_many_blocks", self.too_many_blocks),
            ("empty_events", self.empty_events),
            ("oversized_events", self.oversized_events),
            ("unpairable_stores", self.unpairable_stores),
            ("placeholders", self.placeholders),
            ("bigram_stores", self.bigram_stores),
            ("hash_only_stores", self.hash_only_stores),
            ("filtered_tier", self.filtered_tier),
            ("filtered_group", self.filtered_group),
            ("filtered_group_unknown", self.filtered_group_unknown),
            ("filtered_group_conflict", self.filtered_group_conflict),
            ("filtered_remote", self.filtered_remote),
            ("filtered_ownership", self.filtered_ownership),
            ("filtered_unpairable", self.filtered_unpairable),
            ("locality_unknown", self.locality_unknown),
            ("extra_key_shapes_skipped", self.extra_key_shapes_skipped),
            ("split_batches", self.split_batches),
            ("split_events", self.split_events),
            ("records", self.records),
            ("emitted_events", self.emitted_events),
            ("err_empty", self.err_empty),
            ("err_truncated", self.err_truncated),
            ("err_length", self.err_length),
            ("err_marker", self.err_marker),
            ("err_depth", self.err_depth),
            ("err_shape", self.err_shape),
            ("err_limit", self.err_limit),
        ]
        .into_iter()
    }

    pub(crate) fn count_error(&mut self, k: &DecodeErrorKind) {
        use DecodeErrorKind::*;
        let c = match k {
            Empty => &mut self.err_empty,
            Truncated { .. } => &mut self.err_truncated,
            LengthExceedsInput { .. } => &mut self.err_length,
            InvalidMarker => &mut self.err_marker,
            TooDeep { .. } => &mut self.err_depth,
            WrongType { .. } | BatchTooShort { .. } | MissingField(_) | DuplicateKey(_) => {
                &mut self.err_shape
            }
            TooManyEvents { .. } | PayloadTooLarge { .. } => &mut self.err_limit,
        };
        *c += 1;
    }
}
