//! Engine msgpack batch → SMG `KvEventBatch` protobuf bytes, in place.
//!
//! ```
//! use kvbridge::decode::{DecodeConfig, Decoder, RecordHeader};
//! # fn main() -> Result<(), kvbridge::decode::DecodeError> {
//! // An engine batch: `[ts, [["AllBlocksCleared"]]]` in msgpack.
//! let mut payload = vec![0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0];
//! payload.extend_from_slice(b"AllBlocksCleared");
//! let (seq, mut eid) = (1, 1);
//! let mut dec = Decoder::new(DecodeConfig::default());
//! let plan = dec.plan(&payload)?;                 // pass 1: validate + measure, no allocation
//! for i in 0..plan.records {                      //   (plan.records == 0: nothing to publish)
//!     let hdr = RecordHeader { sequence_number: seq, first_event_id: eid, dp_rank: None };
//!     let len = dec.record_len(i, &hdr);          // exact encoded length of record i
//!     let mut slot = vec![0u8; len];              // in kvbridge: a slot reserved in the ring
//!     dec.write_record(&payload, i, &hdr, &mut slot); // pass 2: writes exactly `len` bytes
//!     eid += dec.record_events(i);
//! }
//! assert_eq!((plan.records, eid), (1, 2));
//! # Ok(()) }
//! ```
//!
//! Each record is a complete `smg.grpc.common.KvEventBatch` message, byte-identical to what
//! prost encodes for the same message (canonical field order, minimal varints, packed repeated
//! scalars, proto3 default elision).
//!
//! # How it works
//!
//! The decoder reads the borrowed payload with a bounds-checked msgpack reader built on
//! `rmp::Marker` (no owned value tree, no serde, no token `Vec`s). **Pass 1** ([`Decoder::plan`])
//! walks the whole batch once, validates every event, applies the [`Profile`], and records in
//! reusable scratch vectors (capacity kept across batches, so steady state allocates nothing):
//! the canonical int64 of every hash, per block the offset of its first token, its packed token
//! byte count, the offset of its `extra_keys` entry and its `KvBlock` body length, per event the
//! spans of its strings and the length of its fixed fields, and the cut into records.
//! **Pass 2** ([`Decoder::write_record`]) re-walks the token and extra-key bytes at the recorded
//! offsets and writes protobuf straight into the caller's slot, using the recorded lengths as
//! length prefixes.
//!
//! Token ids are walked twice in steady state: once in pass 1, where the per-block packed sizes
//! are measured on the way using the last seen `block_size` as a hint (a store whose size differs
//! from the hint gets one extra measuring walk), and once in pass 2.
//!
//! # Where things are
//!
//! Pass 1, in the order an event goes through it:
//!
//! * `parse.rs` — the batch (array or map form) and each event (tagged array or map): key names
//!   and array positions to field ids, batch-level [`DecodeError`]s.
//! * `fields.rs` — an event's fields as parsed, and what each field's value may be (typed
//!   readers; hashes into the scratch, token sizes measured on the way).
//! * `measure.rs` — a parsed event into the scratch: required fields checked, the filter asked,
//!   every submessage measured.
//! * `filter.rs` — the [`Profile`]: tier, locality and group kind as enums, and the one place
//!   that says what [`Profile::Smg`] drops and why.
//! * `pack.rs` — cutting the events into records, splitting the oversized ones.
//! * `scratch.rs` — what pass 1 leaves for pass 2 (spans, events, blocks, parts, records).
//!
//! Pass 2 and the protobuf side:
//!
//! * `encode.rs` — for each SMG message its exact length (`*_len`, used by pass 1 and
//!   [`Decoder::record_len`]) right next to its writer (`write_*`, pass 2), plus
//!   [`encode_cleared`].
//! * `pb.rs` — varint sizes, the slice writer, and the named field tags (`pb::tag`, checked
//!   against `proto/smg/grpc/common.proto` by a unit test).
//! * `ekeys.rs` — the shapes of `extra_keys` entries, walked by both passes.
//! * `reader.rs` — the bounds-checked msgpack reader; `error.rs`, `stats.rs` — [`DecodeError`],
//!   [`DecodeStats`].
//! * `source.rs` — the hand-off to the ring: a planned batch ([`Decoder::planned`]) and a
//!   synthesized clear ([`ClearedBatch`]) as [`crate::ring::RecordSource`]s.
//!
//! # Accepted layouts (docs/engine-wire.md §3–§6)
//!
//! * Batch: array `[ts, events]` or `[ts, events, rank]` (extra trailing elements skipped and
//!   counted as unknown keys); a map batch keyed `ts` / `events` / `data_parallel_rank` |
//!   `attn_dp_rank` is accepted as a counted fallback. `ts` may be float64, float32 or an int.
//! * Events: tagged arrays and tagged maps, mixed freely, any header width. Array positions
//!   follow engine-wire §5.1/§5.2 (`BlockStored` length 5 = TokenSpeed without `lora_id`;
//!   position 7 is `lora_name` when str/nil and SGLang's `metadata` when a map, whose
//!   `cache_salt` is lifted). Map keys are matched by name in any order.
//! * Hashes (and `lora_id`, `parent_block_hash`): any int width (low 64 bits) or bin of length
//!   ≥ 1 (last 8 bytes big-endian, zero-left-padded), carried as int64 bits.
//! * Unknown tags, unknown keys and unknown trailing elements are skipped structurally and
//!   counted. A known event failing validation (wrong types, missing `block_hashes` /
//!   `token_ids` / `block_size`, a token id that is not a u32, invalid UTF-8 in a string that
//!   is copied, more than `max_blocks_per_event` hashes) is skipped and counted; the batch goes
//!   on. (Token values are always checked for stores forwarded with tokens, and also while the
//!   block-size hint applies; otherwise hash-only or filtered stores get a structural check.)
//!   Skipped or oversized `BlockRemoved`s are reported in [`BatchPlan::lost_removals`] so the
//!   caller can signal loss in-band (engine-wire §8).
//!
//! # Mapping decisions
//!
//! * **Tier** from `medium` (case-insensitive, engine-wire §9): GPU → DEVICE, CPU/CPU_PINNED →
//!   HOST, DISK/FS/STORAGE → DISK, OBJ/EXTERNAL → EXTERNAL; `cache_level` (each block, and the
//!   removal) = tier − 1. Both unset when `medium` is absent or unknown; `medium` is copied raw.
//! * **Locality** LOCAL/REMOTE (case-insensitive) → enum; other values unset and counted.
//! * **extra_keys**, per block *i*: nil → none; str → `text`, bin → `blob`, int → `number`,
//!   (str, int) → `multimodal`; an array of such items → one key per item (one nested level
//!   flattened); other shapes skipped and counted (`ekeys.rs`).
//! * **Unpairable stores** (`block_size == 0`, or `len(token_ids) != len(block_hashes) *
//!   block_size`, e.g. vLLM's compacted hash lists) and **placeholders** (`token_ids == []`,
//!   `block_size == 0`: offload "hashes exist in this tier"): counted separately. With
//!   [`Profile::Smg`] the store is dropped (smg-api §5, `filtered_unpairable`). With
//!   [`Profile::All`] it is forwarded **hash-only**: every block carries its hash, lora_id,
//!   cache_level and extra keys but no tokens and `block_size = 0` — it never claims wrong
//!   tokens (engine-wire §9 option 1).
//! * **SMG filter** ([`Profile::Smg`], default; `filter.rs`), first matching reason counted: DISK/EXTERNAL
//!   tier (stores, removals); a group whose `kv_cache_spec_kind` is not `full_attention` /
//!   `mla_attention` / `sink_full_attention` (the kind is remembered per `group_idx` for later
//!   events that omit it, also removals); REMOTE locality; ownership `kvcr` (case-insensitive;
//!   stores, removals, clears); unpairable stores. A batch emptied by filtering, and a batch
//!   with no events, plans `records == 0`.
//! * **Empty hash lists** (a store or removal with `block_hashes == []`): nothing to do;
//!   skipped and counted (`empty_events`).
//! * **Event ids**: record *i*'s events get `first_event_id + k`; only emitted events (parts of
//!   split events included) consume ids ([`Decoder::record_events`]).
//!
//! # Splitting (`pack.rs`)
//!
//! Records are cut so that every record is ≤ `split_threshold` bytes **for any header** (the
//! cut uses the worst case: 10-byte varints for sequence number, event ids and dp_rank, 5-byte
//! length prefixes). Events
//! are packed in order; an event that does not fit the current record starts a new one; an
//! event that does not fit an empty record is split: a store into consecutive stores of one
//! chain (each part's `parent_block_hash` is the previous part's last hash, all other fields
//! repeated), a removal into consecutive removals by hash. Every part keeps the timestamp (it is
//! a batch field). An event whose single block (or hash) cannot fit an empty record is dropped
//! and counted (`oversized_events`). Thresholds below 4 KiB are not supported.
//!
//! # Bounds
//!
//! Payload size, events per batch and blocks per event are bounded by [`DecodeConfig`];
//! declared counts are compared with the bytes left before anything is walked (every element
//! takes ≥ 1 byte) and nothing is reserved by a declared length; skipping is iterative with a
//! fixed stack of [`MAX_SKIP_DEPTH`]. Scratch memory is linear in the payload size. Malformed
//! input yields a [`DecodeError`] (kind + byte offset), never a panic or an endless loop.
//!
//! # Fuzzing
//!
//! `fuzz/` is a cargo-fuzz crate (not a workspace member) whose target `decode` calls
//! [`fuzz_entry`]:
//!
//! ```text
//! cargo install cargo-fuzz
//! cargo +nightly fuzz run decode                    # from the repository root
//! # seeded with the checked-in corpus (the first dir receives new inputs, the second is read):
//! cargo +nightly fuzz run decode fuzz/corpus/decode tests/corpus/decode-malformed
//! ```
//!
//! `fuzz/gen_malformed_corpus.py` regenerates the corpus (truncated engine vectors, huge
//! headers, deep nesting, bad UTF-8, wrong types).
//!
//! `tests/it/decode_fuzz_corpus.rs` runs the same entry point on stable over the corpus, the
//! vectors and deterministic mutations of both (`DECODE_MUTATIONS=20000000 cargo test --release
//! --test it decode_fuzz_corpus -- --ignored` for a longer campaign).
mod ekeys;
mod encode;
mod enums;
mod error;
mod fields;
mod filter;
mod groups;
mod measure;
mod observe;
mod pack;
mod parse;
mod pb;
mod reader;
mod scratch;
mod source;
mod stats;

pub use crate::ring::RecordHeader;
pub use encode::encode_cleared;
pub use error::{DecodeError, DecodeErrorKind};
pub use groups::{parse_note as parse_group_note, GroupNote};
pub use reader::MAX_DEPTH as MAX_SKIP_DEPTH;
pub use source::{ClearedBatch, PlannedBatch};
pub use stats::DecodeStats;

use scratch::{BlockInfo, Ev, Part, Rec};

/// Which events reach the SMG endpoint (docs/smg-api.md §5 "SMG filter profile").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Profile {
    /// Drop what SMG gateways would misindex: DISK/EXTERNAL tiers, non-main-attention groups,
    /// REMOTE locality, `kvcr` ownership, unpairable stores. Counted by reason.
    #[default]
    Smg,
    /// Forward everything decodable; unpairable stores go out hash-only.
    All,
}

/// Decoder settings.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// A record never exceeds this many bytes: an engine batch is split at event (and, for a
    /// single huge store or removal, block/hash) boundaries. ≥ 4 KiB.
    pub split_threshold: usize,
    /// Filter profile.
    pub profile: Profile,
    /// Largest accepted payload in bytes (larger → [`DecodeErrorKind::PayloadTooLarge`]).
    /// At most `u32::MAX`.
    pub max_payload: usize,
    /// Most events per batch (more → [`DecodeErrorKind::TooManyEvents`]).
    pub max_events: usize,
    /// Most hashes per event (more → the event is skipped, counted in `too_many_blocks`).
    pub max_blocks_per_event: usize,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            split_threshold: 1 << 20,
            profile: Profile::Smg,
            max_payload: 256 << 20,
            max_events: 1 << 20,
            max_blocks_per_event: 1 << 20,
        }
    }
}

/// Result of pass 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchPlan {
    /// Number of records this batch becomes (0 = nothing to publish, e.g. all filtered).
    pub records: usize,
    /// Engine `ts` (seconds).
    pub ts: f64,
    /// The batch's own rank element, when present and an int.
    pub rank: Option<i64>,
    /// `BlockRemoved` events of this batch that were skipped as malformed or oversized (not
    /// filtered): removals the downstream index will miss. Non-zero means the caller SHOULD
    /// treat the batch like an unfillable gap (engine-wire §8).
    pub lost_removals: usize,
    /// A block hash of this batch was a negative msgpack int: the engine's hashes are signed
    /// int64 (SGLang), which the engine-wire re-publish writes back in that form.
    pub signed_hashes: bool,
}

/// The decoder (one per ingest rank; keeps reusable scratch, the per-group kind memory of the
/// SMG filter, and counters).
#[derive(Debug)]
pub struct Decoder {
    cfg: DecodeConfig,
    stats: DecodeStats,
    // The plan (scratch.rs): cleared by every `plan`, capacity kept.
    /// Every kept hash, as int64 bits, in event order.
    hashes: Vec<i64>,
    /// Per block of a kept store.
    blocks: Vec<BlockInfo>,
    /// Per kept event.
    evs: Vec<Ev>,
    /// Per emitted event (a whole event or a part of a split one).
    parts: Vec<Part>,
    /// Per record.
    recs: Vec<Rec>,
    /// Per-block (token offset, packed bytes) measured with `bs_hint` while reading tokens.
    chunks: Vec<(u32, u32)>,
    /// The last pairable `block_size` (engines use one block size per group).
    bs_hint: u32,
    /// What the stores taught about each group of this rank (groups.rs, filter.rs).
    groups: groups::Groups,
    /// The batch's `ts`.
    ts: f64,
    /// Length of the planned payload (checked by `write_record`).
    payload_len: usize,
    /// See [`BatchPlan::lost_removals`].
    lost_removals: usize,
    /// pack.rs: whether the last record still takes parts, and its worst-case bytes so far.
    open: bool,
    used: usize,
    /// Where pass 2 wrote each block of `blocks`: record index << 32 | offset in the record
    /// ([`NOT_WRITTEN`] until written). Lets the snapshot table copy a block's encoding from the
    /// record instead of encoding its tokens again (observe.rs). Cells because `write_record`
    /// takes `&self`; capacity kept like the other scratch vectors.
    block_at: Vec<std::cell::Cell<u64>>,
    /// The record `write_record` is writing (for `block_at`).
    cur_rec: std::cell::Cell<u32>,
}

/// `Decoder::block_at` value of a block no record holds (yet).
pub(crate) const NOT_WRITTEN: u64 = u64::MAX;

impl Decoder {
    /// A decoder with this configuration.
    pub fn new(mut cfg: DecodeConfig) -> Self {
        cfg.max_payload = cfg.max_payload.min(u32::MAX as usize);
        Self {
            cfg,
            stats: DecodeStats::default(),
            hashes: Vec::new(),
            blocks: Vec::new(),
            evs: Vec::new(),
            parts: Vec::new(),
            recs: Vec::new(),
            chunks: Vec::new(),
            bs_hint: 16,
            groups: groups::Groups::default(),
            ts: 0.0,
            payload_len: 0,
            lost_removals: 0,
            open: false,
            used: 0,
            block_at: Vec::new(),
            cur_rec: std::cell::Cell::new(0),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &DecodeConfig {
        &self.cfg
    }

    /// Pass 1: validates and measures `payload`, replacing the previous plan. On error the plan
    /// is empty (`record_len`/`write_record` must not be called) and the error is counted.
    pub fn plan(&mut self, payload: &[u8]) -> Result<BatchPlan, DecodeError> {
        self.hashes.clear();
        self.blocks.clear();
        self.evs.clear();
        self.parts.clear();
        self.recs.clear();
        self.chunks.clear();
        self.lost_removals = 0;
        self.open = false;
        self.used = 0;
        self.payload_len = payload.len();
        self.stats.batches += 1;
        match self.parse_batch(payload) {
            Ok(p) => {
                self.block_at.clear();
                self.block_at
                    .resize_with(self.blocks.len(), || std::cell::Cell::new(NOT_WRITTEN));
                self.stats.batches_ok += 1;
                self.stats.records += self.recs.len() as u64;
                self.stats.emitted_events += self.parts.len() as u64;
                Ok(p)
            }
            Err(e) => {
                self.recs.clear();
                self.stats.count_error(&e.kind);
                Err(e)
            }
        }
    }

    /// Encoded length of record `i` of the last plan with this header. Panics if `i` is not
    /// below the planned `records`.
    pub fn record_len(&self, i: usize, hdr: &RecordHeader) -> usize {
        self.rec_len(i, hdr)
    }

    /// Number of events (event ids consumed) in record `i` of the last plan.
    pub fn record_events(&self, i: usize) -> u64 {
        let r = self.recs[i];
        (r.p1 - r.p0) as u64
    }

    /// Pass 2: writes record `i` into `out[..record_len]` and returns that length.
    ///
    /// `payload` must be the bytes given to the last `plan`, and `hdr` the header given to
    /// `record_len`. Panics (caller bugs) if `i` is out of range, `payload`'s length differs from
    /// the planned one, or `out` is shorter than `record_len(i, hdr)` (index out of bounds while
    /// writing; the part of `out` written so far is garbage then). Bytes of `out` past the
    /// record are untouched.
    pub fn write_record(
        &self,
        payload: &[u8],
        i: usize,
        hdr: &RecordHeader,
        out: &mut [u8],
    ) -> usize {
        assert_eq!(
            payload.len(),
            self.payload_len,
            "write_record: payload differs from plan"
        );
        // No separate length check: indexing `out` panics if it is shorter than the record.
        let mut w = pb::W { buf: out, pos: 0 };
        self.cur_rec.set(i as u32);
        self.write_rec(payload, i, hdr, &mut w);
        debug_assert_eq!(w.pos, self.rec_len(i, hdr));
        w.pos
    }

    /// Counters.
    pub fn stats(&self) -> &DecodeStats {
        &self.stats
    }
}

/// Fuzz / robustness entry point: plans `data` under both profiles and two thresholds, writes
/// every record, and checks that each has exactly `record_len` bytes, is within the threshold,
/// decodes with prost, and re-encodes with prost to the same bytes. Panics on any violation.
#[doc(hidden)]
pub fn fuzz_entry(data: &[u8]) {
    use prost::Message;
    for (profile, thr) in [
        (Profile::All, 4096),
        (Profile::Smg, 1 << 20),
        (Profile::All, 1 << 20),
    ] {
        let mut dec = Decoder::new(DecodeConfig {
            split_threshold: thr,
            profile,
            max_events: 4096,
            max_blocks_per_event: 1 << 16,
            ..DecodeConfig::default()
        });
        let Ok(plan) = dec.plan(data) else { continue };
        let mut eid = 1u64;
        for i in 0..plan.records {
            let hdr = RecordHeader {
                sequence_number: i as u64 + 1,
                first_event_id: eid,
                dp_rank: plan.rank.map(|r| r as i32),
            };
            let len = dec.record_len(i, &hdr);
            assert!(len <= thr, "record {i} has {len} bytes > threshold {thr}");
            let mut out = vec![0xAAu8; len + 3];
            assert_eq!(dec.write_record(data, i, &hdr, &mut out), len);
            assert_eq!(&out[len..], &[0xAA; 3], "write past record_len");
            let msg = crate::proto::common::KvEventBatch::decode(&out[..len])
                .expect("record decodes with prost");
            assert_eq!(msg.events.len() as u64, dec.record_events(i));
            assert_eq!(msg.encode_to_vec(), &out[..len], "record is not canonical");
            eid += dec.record_events(i);
        }
    }
}
