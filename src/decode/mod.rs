//! Engine msgpack batch → SMG `KvEventBatch` protobuf bytes, in place.
//!
//! CONTRACT (the ingest stage codes against exactly this API; the decoder issue fills it in):
//!
//! ```ignore
//! let mut dec = Decoder::new(DecodeConfig::default());
//! let plan = dec.plan(payload)?;                  // pass 1: validate + measure, no allocation
//! for i in 0..plan.records {                      //   (plan.records == 0: nothing to publish)
//!     let hdr = RecordHeader { sequence_number: seq, first_event_id: eid, dp_rank: None };
//!     let len = dec.record_len(i, &hdr);          // exact encoded length of record i
//!     let slot: &mut [u8] = ring.reserve(len)?;   // caller-provided buffer (a ring slot)
//!     dec.write_record(payload, i, &hdr, slot);   // pass 2: writes exactly `len` bytes
//!     eid += dec.record_events(i);
//! }
//! ```
//!
//! Each record is a complete `smg.grpc.common.KvEventBatch` message.
use thiserror::Error;

/// Which events reach the SMG endpoint (smg-api.md §5 "SMG filter profile").
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
    /// An engine batch whose encoding would exceed this many bytes is split at event (and, for a
    /// single huge store or removal, block/hash) boundaries into several records. < 4 MiB.
    pub split_threshold: usize,
    /// Filter profile.
    pub profile: Profile,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self { split_threshold: 1 << 20, profile: Profile::Smg }
    }
}

/// Per-record values the caller decides (the ring assigns numbers).
#[derive(Clone, Copy, Debug)]
pub struct RecordHeader {
    /// `KvEventBatch.sequence_number` (≥ 1).
    pub sequence_number: u64,
    /// `event_id` of the record's first event; later events count up by one.
    pub first_event_id: u64,
    /// `KvEventBatch.dp_rank`, sent only when `Some`.
    pub dp_rank: Option<i32>,
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
}

/// Why a payload could not be decoded at all.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{kind} at byte {offset}")]
pub struct DecodeError {
    /// What went wrong.
    pub kind: String,
    /// Byte offset in the payload.
    pub offset: usize,
}

/// Decoder counters (stub).
#[derive(Debug, Default)]
pub struct DecodeStats {}
impl DecodeStats {
    /// Every counter with its metric label.
    pub fn counters(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        std::iter::empty()
    }
}

/// The decoder (one per ingest rank; keeps reusable scratch and counters).
#[derive(Debug)]
pub struct Decoder {
    _cfg: DecodeConfig,
}

impl Decoder {
    /// A decoder with this configuration.
    pub fn new(cfg: DecodeConfig) -> Self {
        Self { _cfg: cfg }
    }
    /// Counters.
    pub fn stats(&self) -> &DecodeStats {
        unimplemented!("decoder issue")
    }
    /// Pass 1.
    pub fn plan(&mut self, _payload: &[u8]) -> Result<BatchPlan, DecodeError> {
        unimplemented!("decoder issue")
    }
    /// Encoded length of record `i` of the last plan.
    pub fn record_len(&self, _i: usize, _hdr: &RecordHeader) -> usize {
        unimplemented!("decoder issue")
    }
    /// Number of events (event ids consumed) in record `i` of the last plan.
    pub fn record_events(&self, _i: usize) -> u64 {
        unimplemented!("decoder issue")
    }
    /// Pass 2: writes record `i` into `out` (exactly `record_len` bytes); returns bytes written.
    pub fn write_record(&self, _payload: &[u8], _i: usize, _hdr: &RecordHeader, _out: &mut [u8]) -> usize {
        unimplemented!("decoder issue")
    }
}

/// A synthesized batch holding one `cleared` event without `ownership` (engine restart or
/// unfillable gap, smg-api.md §6.4). Returns the encoded length written to `out` (cleared first).
pub fn encode_cleared(_hdr: &RecordHeader, _ts: f64, _out: &mut Vec<u8>) -> usize {
    unimplemented!("decoder issue")
}
